"""The method nerfstudio loads: the method configs (ns-train splat-metal / splat-metal-mcmc) and the models."""

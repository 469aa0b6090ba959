"""Device-aware op layer: one public API, backends behind it keeping one contract (ops/contract.py)."""

from .distributed import distributed_rasterization
from .mcmc import compute_relocation, quat_scale_to_covar_preci
from .metal.fused import rasterization_metal
from .metal.isect import IntersectionCapacities
from .rasterization import BACKENDS, BackendUnavailable, backend_module, best_device, rasterization, resolve_backend

__all__ = [
    "BACKENDS",
    "BackendUnavailable",
    "IntersectionCapacities",
    "backend_module",
    "best_device",
    "compute_relocation",
    "distributed_rasterization",
    "quat_scale_to_covar_preci",
    "rasterization",
    "rasterization_metal",
    "resolve_backend",
]

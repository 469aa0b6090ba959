"""Benchmarking: the splat-metal-bench command, its scenes, the step ledger and the step model."""

"""Device-aware op layer: one public API, backends behind it with identical stage signatures."""

from .rasterization import BACKENDS, BackendUnavailable, backend_module, rasterization, resolve_backend

__all__ = ["BACKENDS", "BackendUnavailable", "backend_module", "rasterization", "resolve_backend"]

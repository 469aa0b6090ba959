"""Per-stage fallback of the Metal backend: a stage that failed the self-check on this GPU
(splat_metal_method/verify/self_check.py) runs on the PyTorch reference, on the same device; the other
stages keep their Metal kernels.

The failed stages are a per-process set. ``backend_module("metal")`` (rasterization.py) returns the
Metal module itself while the set is empty, else :func:`routed`'s mix of Metal and reference
functions (same names and signatures: the backend contract); ops/mcmc.py runs the covariance on the
reference when "covariance" failed, ops/loss.py the training loss when "loss" failed, engine/optimizers.py
torch's Adam when "adam" failed. The self-check and the doctor import ``ops.metal`` directly, so
they always test the Metal kernels themselves. Imports are one-way: the model and the self-check
import this module, never the other way round.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from types import ModuleType, SimpleNamespace
from typing import FrozenSet, Iterable, Iterator

# stage -> the backend-contract functions it owns (covariance is ops/mcmc.py's quat_scale_to_covar_preci)
STAGES = {
    "projection": ("project",),
    "sh": ("spherical_harmonics",),
    "isect+sort": ("isect_tiles", "isect_offset_encode"),
    "rasterize": ("rasterize_to_pixels", "rasterize_depth_chunk"),
    "covariance": (),
    "loss": (),  # the fused L1 + SSIM training loss (ops/loss.py's l1_ssim_loss)
    "adam": (),  # the gaussians' fused Adam (engine/optimizers.py): torch's Adam instead
}

_failed: set = set()
_lock = threading.Lock()


def stage_of(check_name: str) -> str:
    """The stage a doctor/self-check Check (by its name) verifies: "project (classic)" -> "projection",
    "sh (degree 1)" -> "sh", "isect + sort (tile 16)" -> "isect+sort", "rasterize (...)" and the whole
    op in depth chunks "rasterization (metal, 3 depth chunks)" -> "rasterize", "covariance + precision
    (...)" -> "covariance", "l1 + ssim loss (...)" -> "loss", "adam (...)" -> "adam"."""
    for prefix, stage in (("project", "projection"), ("sh ", "sh"), ("isect", "isect+sort"),
                          ("rasteriz", "rasterize"), ("covariance", "covariance"), ("l1 + ssim", "loss"), ("adam", "adam")):  # fmt: skip
        if check_name.startswith(prefix):
            return stage
    raise ValueError(f"[stage_of] no Metal stage verifies the check {check_name!r}")


def mark_failed(stages: Iterable[str]) -> None:
    """From now on (in this process) these stages of the Metal backend run on the reference."""
    stages = set(stages)
    unknown = stages - set(STAGES)
    if unknown:
        raise ValueError(f"[mark_failed] unknown stages {sorted(unknown)}; stages are {list(STAGES)}")
    with _lock:
        _failed.update(stages)


def failed() -> FrozenSet[str]:
    """The stages of the Metal backend this process runs on the reference."""
    return frozenset(_failed)


@contextmanager
def also_failed(stages: Iterable[str]) -> Iterator[None]:
    """Within the block, `stages` run on the reference too (the self-check's whole-op check, so that its
    verdict is about the stages not already found wrong); the set is restored afterwards."""
    with _lock:
        before = set(_failed)
        _failed.update(stages)
    try:
        yield
    finally:
        with _lock:
            _failed.clear()
            _failed.update(before)


def reset() -> None:
    """Every stage back on its Metal kernels (tests)."""
    with _lock:
        _failed.clear()


def routed(metal: ModuleType):
    """`metal` itself when no stage failed, else a namespace with the backend contract's functions:
    the reference's for the failed stages, `metal`'s for the others."""
    bad = failed()
    if not bad:
        return metal
    from . import reference

    functions = {}
    for stage, names in STAGES.items():
        for name in names:
            functions[name] = getattr(reference if stage in bad else metal, name)
    if not bad & {"isect+sort", "rasterize"}:  # padded lists: Metal's intersections for Metal's rasterizer
        functions["isect_tiles_padded"] = metal.isect_tiles_padded
    return SimpleNamespace(**functions)

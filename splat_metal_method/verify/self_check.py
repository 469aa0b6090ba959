"""The Metal self-check: before a run trains or renders with the Metal kernels, the stages it will use
are checked against the PyTorch reference on this machine's GPU.

The kernels are verified on Linux under the MSL emulator, but a GPU family, macOS or torch version
nobody tested can still run them differently (an earlier Metal port of 3DGS rendered right and
trained 30,000 steps on a wrong backward). So the first time a configuration runs on a machine,
every stage it is about to use runs forward and backward on a small seeded scene, with the Metal
backend and with the reference on the same device, compared by doctor.py's comparisons and
tolerances (one implementation): the projection in this run's rasterize mode, SH at each degree up
to the model's, tile intersection + sort and the rasterizer at this run's tile size and channel
counts (3 for RGB training, 4 for RGB+depth: eval and the viewer), with absgrad when the strategy
reads it.

The verdict is cached per machine in a small JSON file (``cache_path()``), keyed by torch version,
GPU name, the MSL version torch compiles at, a hash of the kernel sources and their dispatch code,
PYTORCH_MPS_FAST_MATH and the run's configuration, so it costs seconds once.

A stage that mismatches (or raises) falls back (``--pipeline.model.metal-self-check`` True, the
default, or "fallback"): it runs on the PyTorch reference on the same device for the rest of the
process (ops/stage_fallback.py), the other stages keep their Metal kernels, and the run says so in
one line at start (the stage, its error, the doctor command to paste into an issue). Stages:
projection, sh, isect+sort, rasterize, covariance, loss (the fused L1 + SSIM training loss). The cached verdict names the failed stages, so a
later run falls back without checking again. ``strict`` stops the run before its first step (so
before any checkpoint) instead; ``False`` skips the check. Fast math: where the MSL version cannot
declare safe math in the source (below 3.2, see common.h), PYTORCH_MPS_FAST_MATH compiles the kernels
with fast math; the check runs them as compiled (and is keyed on the variable), so a stage that fast
math breaks is a failed stage like any other.
SplatMetalModel calls :func:`ensure_verified` when training is set up and before each render (a set
lookup once verified). It runs whenever the model's backend resolves to "metal": on MPS, and on CPU
tensors under the MSL emulator (how the tests exercise it).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from ..ops import stage_fallback
from ..ops.constants import TILE_SIZE

FAST_MATH_ENV = "PYTORCH_MPS_FAST_MATH"
SKIP_OPTION = "--pipeline.model.metal-self-check False"
STRICT_OPTION = "--pipeline.model.metal-self-check strict"
FALLBACK_OPTION = "--pipeline.model.backend reference"
DOCTOR_COMMAND = ".venv/bin/splat-metal-doctor 2>&1 | tee splat-metal-doctor.txt"
MODES = (True, False, "fallback", "strict")  # --pipeline.model.metal-self-check; True is "fallback"
# The check's scene: one camera (training renders one), non-square, partial edge tiles at 16 px.
SCENE = {"n": 200, "width": 45, "height": 29, "cameras": 1}


class SelfCheckFailed(SystemExit):
    """The Metal kernels disagree with the reference on this machine. A SystemExit, like
    reliability.NonFiniteError: ns-train prints only the message and exits with status 1."""


@dataclass(frozen=True)
class RunKernels:
    """What one run asks of the Metal kernels."""

    tile_size: int
    channels: Tuple[int, ...]  # rasterizer channel counts
    rasterize_mode: str  # "classic" | "antialiased"
    absgrad: bool
    sh_degree: int  # 0: colours without SH (no SH stage)
    depth_chunks: bool = False  # an intersection budget may split a render into depth chunks (ops/chunked.py)
    covariance: bool = False  # MCMC's position noise: quat_scale_to_covar_preci (covar.metal) every step

    @classmethod
    def of(cls, model) -> "RunKernels":
        from gsplat.strategy import MCMCStrategy

        train_channels = 4 if model.config.output_depth_during_training else 3
        return cls(
            tile_size=TILE_SIZE,  # SplatMetalModel renders at the op layer's default tile size
            channels=tuple(sorted({train_channels, 4})),  # RGB+depth: eval images and the viewer
            rasterize_mode=model.config.rasterize_mode,
            absgrad=bool(getattr(model.strategy, "absgrad", False)),
            sh_degree=int(model.config.sh_degree),
            depth_chunks=bool(getattr(getattr(model, "memory", None), "max_intersections", None)),
            covariance=isinstance(getattr(model, "strategy", None), MCMCStrategy),
        )


def fast_math_enabled() -> bool:
    """Whether torch compiles Metal shaders with fast math (it reads PYTORCH_MPS_FAST_MATH; "0" is off)."""
    return os.environ.get(FAST_MATH_ENV, "").strip() not in ("", "0")


def gpu_name(device: torch.device) -> str:
    """The GPU the kernels run on, for the cache key and messages."""
    if device.type != "mps":
        return f"MSL emulator ({platform.machine()})"
    try:
        return torch.backends.mps.get_name()  # torch >= 2.8
    except Exception:
        pass
    try:
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5)
        if out.stdout.strip():
            return out.stdout.strip()  # Apple silicon: the SoC names its GPU family ("Apple M2 Pro")
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown Apple GPU"


def cache_path() -> Path:
    """The per-machine verdict file, in the user's cache dir (~/Library/Caches on macOS, else $XDG_CACHE_HOME
    or ~/.cache)."""
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "splat_metal" / "self_check.json"


def kernel_source_hash() -> str:
    """Hash of the kernel sources and the Python that assembles and dispatches them (ops/metal/)."""
    from ..ops.metal.runtime import KERNEL_DIR

    h = hashlib.sha256()
    for f in sorted(KERNEL_DIR.iterdir()):
        if f.is_file() and f.suffix in (".metal", ".h", ".py"):
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _key(device: torch.device, run: RunKernels) -> Tuple[str, dict]:
    from ..ops.metal.kernels import msl_version
    from .kernel_checks import BWD_RTOL, FWD_ATOL

    facts = {
        "torch": torch.__version__,
        "gpu": gpu_name(device),
        "msl": msl_version(device.type),
        "kernels": kernel_source_hash(),
        "fast_math": fast_math_enabled() and device.type == "mps",
        "run": asdict(run),
        "scene": SCENE,
        "tolerances": [FWD_ATOL, BWD_RTOL],
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:24], facts


def _load_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # no file yet, or unreadable: check again


def _store(path: Path, key: str, entry: dict) -> None:
    """Adds one verdict; written to a temporary file and renamed, so concurrent runs never see half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load_cache(path)
        data[key] = entry
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:  # a read-only home must not stop training; the check just runs again next time
        warnings.warn(f"splat-metal: could not cache the Metal self-check verdict in {path}: {e}", stacklevel=3)


def run_checks(device: torch.device, run: RunKernels):
    """kernel_checks.stage_checks restricted to what `run` uses, Metal vs reference on `device`; with depth
    chunks, also the whole op cut into about 3 chunks (resumed compositing) vs the unchunked reference;
    with SH colours, the fused preparation; for MCMC, also the covariance kernel; always the fused training loss
    and the fused Adam."""
    from ..ops import metal, reference
    from .kernel_checks import (
        adam_checks,
        covariance_checks,
        full_op_checks,
        loss_checks,
        prepare_checks,
        stage_checks,
    )

    with torch.inference_mode(False), torch.enable_grad():  # renders run under no_grad; the check needs grads
        checks = stage_checks(
            device, metal, reference, SCENE["width"], SCENE["height"], tile_size=run.tile_size,
            channels=run.channels, sh_degrees=range(run.sh_degree + 1) if run.sh_degree > 0 else (),
            modes=(run.rasterize_mode,), absgrad=run.absgrad, backgrounds=False, cameras=SCENE["cameras"],
            n=SCENE["n"],
        )  # fmt: skip
        if run.depth_chunks:  # the whole op, with the stages found wrong above on the reference (as they will run)
            with stage_fallback.also_failed(failed_stages([c for c in checks if not c.ok])):
                checks += full_op_checks(device, "metal", SCENE["width"], SCENE["height"], depth_chunks=3,
                                         n=SCENE["n"], cameras=SCENE["cameras"], absgrad=run.absgrad,
                                         rasterize_mode=run.rasterize_mode)  # fmt: skip
        if run.sh_degree > 0:  # the fused preparation renders SH colours (ops/metal/prepare.py)
            checks += prepare_checks(device, run.sh_degree, run.rasterize_mode)
        if run.covariance:
            checks += covariance_checks(device, "metal")
        checks += loss_checks(device)  # the training loss (a render-only run never calls it; the check is small)
        checks += adam_checks(device)  # the gaussians' fused Adam (engine/optimizers.py), small too
        return checks


def failed_stages(bad: List) -> Dict[str, str]:
    """stage -> the first failing check's description, in check order."""
    stages: Dict[str, str] = {}
    for c in bad:
        stages.setdefault(stage_fallback.stage_of(c.stage), c.describe())
    return stages


def _fast_math_hint(device: torch.device) -> str:
    from ..ops.metal.kernels import safe_math_declared

    if device.type != "mps" or not fast_math_enabled() or safe_math_declared(device.type):
        return ""
    return f" ({FAST_MATH_ENV} is set and this MSL version cannot declare safe math: unset it)"


def fallback_message(stages: Dict[str, str], device: torch.device) -> str:
    """The one line a run prints at start when stages fall back to the reference."""
    failed = "; ".join(f"{stage} failed ({error})" for stage, error in stages.items())
    which = "that stage runs" if len(stages) == 1 else "those stages run"
    return (
        f"splat-metal: Metal self-check on {gpu_name(device)}, torch {torch.__version__}: {failed}"
        f"{_fast_math_hint(device)}; {which} on the PyTorch reference on {device.type}, the others on Metal. "
        f"Please report it with the output of `{DOCTOR_COMMAND}`"
    )


def failure_message(bad: List, device: torch.device, before: str) -> str:
    lines = "\n".join(f"  - {c.describe()}" for c in bad)
    return (
        f"splat-metal: the Metal kernels failed their self-check on this GPU ({gpu_name(device)}, torch "
        f"{torch.__version__}){_fast_math_hint(device)}: they disagree with the PyTorch reference in\n{lines}\n"
        f"Stopped before {before} ({STRICT_OPTION}); nothing was written to the run's checkpoints.\n"
        "To continue now: rerun without it (the failing stages then run on the PyTorch reference, the others on "
        f"Metal), or with {FALLBACK_OPTION} (every stage on the PyTorch reference on the same GPU: slower, right).\n"
        f"Please report this: run `{DOCTOR_COMMAND}` and paste splat-metal-doctor.txt, with the lines above, "
        "into an issue.\n"
        f"(Experts who accept wrong results can skip the check with {SKIP_OPTION}.)"
    )


def _print(message: str) -> None:
    from nerfstudio.utils.rich_utils import CONSOLE

    CONSOLE.print(message, highlight=False, soft_wrap=True)


def verify(device: torch.device, run: RunKernels, before: str = "training", strict: bool = False) -> Optional[float]:
    """Checks `run`'s stages on `device` unless this machine has a verdict for them. Returns the seconds the
    check took (None when the cached verdict was used). Failed stages are marked to run on the reference
    (ops/stage_fallback.py) and named in one printed line; with `strict`, SelfCheckFailed is raised instead."""
    path = cache_path()
    key, facts = _key(device, run)
    cached = _load_cache(path).get(key, {})
    seconds = None
    if cached.get("passed"):
        _print(f"splat-metal: Metal self-check passed on {facts['gpu']} (verdict of {cached.get('when')}, "
               f"cached in {path})")  # fmt: skip
        return None
    if cached.get("failed"):  # the stages failed here before: same verdict, no check
        stages, message = cached["failed"], cached.get("message", "")
    else:
        start = time.perf_counter()
        checks = run_checks(device, run)
        seconds = time.perf_counter() - start
        bad = [c for c in checks if not c.ok]
        when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        entry = {**facts, "checks": len(checks), "seconds": round(seconds, 2), "when": when}
        if not bad:
            _store(path, key, {**entry, "passed": True})
            math = "safe math declared" if _safe_math(device) else f"safe math not declarable: {FAST_MATH_ENV} applies"
            _print(f"splat-metal: Metal self-check passed on {facts['gpu']}: {len(checks)} checks of the stages this "
                   f"run uses in {seconds:.1f} s, MSL {facts['msl'] / 100:.1f} ({math}; verdict cached in {path}; "
                   f"skip with {SKIP_OPTION})")  # fmt: skip
            return seconds
        stages, message = failed_stages(bad), failure_message(bad, device, before)
        _store(path, key, {**entry, "passed": False, "failed": stages, "message": message})
    if strict:
        if threading.current_thread() is not threading.main_thread():  # a viewer thread: SystemExit is silent there
            _print(message)
        raise SelfCheckFailed(message)
    stage_fallback.mark_failed(stages)
    _print(fallback_message(stages, device))
    return seconds


_verified: set = set()
_lock = threading.Lock()


def ensure_verified(model, device: torch.device, backend: str, before: str = "training") -> None:
    """The check for `model` rendering on `device` with `backend`, once per process and configuration;
    a no-op unless the backend resolves to "metal" and model.config.metal_self_check is on."""
    mode = getattr(model.config, "metal_self_check", True)
    if mode not in MODES:
        raise ValueError(f"--pipeline.model.metal-self-check must be one of {MODES}, got {mode!r}")
    if mode is False:
        return
    from ..ops import resolve_backend

    device = torch.device(device)
    if resolve_backend(backend, device) != "metal":
        return
    run = RunKernels.of(model)
    if (device.type, run) in _verified:
        return
    with _lock:  # the viewer's render thread and training may both get here first
        if (device.type, run) in _verified:
            return
        if device.type == "mps" and fast_math_enabled() and not _safe_math(device):
            warnings.warn(
                f"splat-metal: {FAST_MATH_ENV}={os.environ[FAST_MATH_ENV]} makes torch compile the Metal kernels "
                "with fast math (this MSL version cannot declare safe math in the source); they are verified "
                "without it. The self-check runs them as compiled: a stage fast math breaks runs on the reference. "
                f"Unset {FAST_MATH_ENV} unless you measured it.",
                RuntimeWarning, stacklevel=2,
            )  # fmt: skip
        verify(device, run, before, strict=mode == "strict")
        _verified.add((device.type, run))


def _safe_math(device: torch.device) -> bool:
    from ..ops.metal.kernels import safe_math_declared

    return safe_math_declared(device.type)

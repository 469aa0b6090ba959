"""Builds the native sources (ops/cpu/*.cpp) into one cached shared library and loads it with ctypes.

No Python headers, torch headers or ninja are needed: only a C++17 compiler ($CXX, else c++, g++
or clang++). The library is keyed by a hash of the source, the compiler's version and the flags, so
an edited source or a new compiler rebuilds it; concurrent processes never see a half-written file.
When no compiler is found or the build fails, ``load()`` returns None and ``unavailable_reason()``
says why (the op layer then falls back to the reference backend with one warning).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

SOURCES = sorted(Path(__file__).resolve().parent.glob("*.cpp"))
# covar.h and sh.h are shared with the Metal kernels (shared.h includes them from ../metal).
SHARED_HEADERS = [Path(__file__).resolve().parents[1] / "metal" / name for name in ("covar.h", "sh.h")]
HEADERS = sorted(Path(__file__).resolve().parent.glob("*.h")) + SHARED_HEADERS
# -fno-trapping-math lets the compiler turn the pixel loops' selects into vector blends; it does not
# change any result (no fast-math: no reassociation, no contraction into fma).
FLAGS = ["-std=c++17", "-O3", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-trapping-math"]
# Vector width of this CPU (AVX2/AVX-512, NEON): about 2x on the pixel loops. Tried first; compilers
# that reject it build without it. The library is cached per CPU (see _cpu_id), never shared.
NATIVE_FLAGS = ["-march=native"]

_lock = threading.Lock()
_state: dict = {}  # "lib": CDLL | None, "reason": str


def cache_dir() -> Path:
    root = os.environ.get("SPLAT_METAL_CACHE_DIR") or os.path.join(Path.home(), ".cache", "splat_metal")
    return Path(root) / "native"


def find_compiler() -> Optional[str]:
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


def _cpu_id() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    ident = [platform.machine(), platform.processor()]
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        ident += sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features", "CPU part"))})
    except OSError:
        pass
    return "\n".join(ident)


def _compile(cxx: str, flags: list, so: Path) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(dir=so.parent) as tmp:
        tmp_so = Path(tmp) / so.name
        res = subprocess.run([cxx, *flags, *map(str, SOURCES), "-o", str(tmp_so)], capture_output=True, text=True)
        if res.returncode == 0:
            os.replace(tmp_so, so)  # atomic: concurrent processes never see a half-written library
        return res


def _build() -> ctypes.CDLL:
    cxx = find_compiler()
    if cxx is None:
        wanted = os.environ.get("CXX") or "c++, g++ or clang++"
        raise RuntimeError(f"no C++ compiler found ({wanted} not on PATH)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    sources = [f.read_text() for f in SOURCES + HEADERS]
    key = hashlib.sha256("\0".join([*sources, cxx, version, _cpu_id(), *FLAGS]).encode()).hexdigest()[:24]
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    native, portable = d / f"splat-cpu-{key}-native.so", d / f"splat-cpu-{key}-portable.so"
    if not native.exists() and not portable.exists():
        if _compile(cxx, FLAGS + NATIVE_FLAGS, native).returncode != 0:
            res = _compile(cxx, FLAGS, portable)
            if res.returncode != 0:
                names = ", ".join(f.name for f in SOURCES)
                raise RuntimeError(f"{cxx} failed to build {names}:\n{res.stderr.strip()[-2000:]}")
    so = native if native.exists() else portable
    _state["built"] = f"{cxx}, {'-march=native' if so is native else 'portable (no -march=native)'}, {so}"
    lib = ctypes.CDLL(str(so))
    i32, i64, f32, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    head = [i32] * 7 + [i64, f32, f32, f32]  # C, D, width, height, tile_size, tile_w, tile_h, M, constants
    lib.splat_rasterize_fwd.argtypes = head + [ptr] * 12 + [i32]
    lib.splat_rasterize_bwd.argtypes = head + [ptr] * 16 + [i32]
    lib.splat_rasterize_fwd.restype = lib.splat_rasterize_bwd.restype = i32
    lib.splat_isect_count.argtypes = [i64, i32, i32, i32, ptr, ptr, ptr, i32]
    lib.splat_isect_count.restype = i64
    lib.splat_isect_fill.argtypes = [i64, i64, i32, i32, i32, ptr, ptr, ptr, ptr, i64, ptr, ptr, i32]
    lib.splat_isect_fill.restype = i32
    lib.splat_project_fwd.argtypes = [i64, i64, i64, i64, f32, f32, f32, f32, i32] + [ptr] * 10 + [i32]
    lib.splat_project_bwd.argtypes = [i64, i64, i64, i64, f32, i32, i32, i64] + [ptr] * 14 + [i32]
    lib.splat_sh_fwd.argtypes = [i64, i64, i64] + [ptr] * 4 + [i32]
    lib.splat_sh_bwd.argtypes = [i64, i64, i64] + [ptr] * 6 + [i32]
    lib.splat_quat_scale_to_covar_preci_fwd.argtypes = [i64, i32, ptr, ptr, ptr, ptr, i32]
    for name in (
        "splat_project_fwd",
        "splat_project_bwd",
        "splat_sh_fwd",
        "splat_sh_bwd",
        "splat_quat_scale_to_covar_preci_fwd",
    ):
        getattr(lib, name).restype = i32
    return lib


def load() -> Optional[ctypes.CDLL]:
    """The compiled library, or None if it cannot be built here (see ``unavailable_reason``)."""
    with _lock:
        if "lib" not in _state:
            try:
                _state["lib"] = _build()
            except (RuntimeError, OSError) as err:
                _state["lib"], _state["reason"] = None, str(err)
        return _state["lib"]


def unavailable_reason() -> str:
    load()
    return _state.get("reason", "")


def describe() -> str:
    """How the loaded library was built (compiler, flags, path), or why there is none."""
    return _state.get("built", "") if load() is not None else f"unavailable: {unavailable_reason()}"

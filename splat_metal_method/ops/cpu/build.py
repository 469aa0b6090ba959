"""Builds the native sources (rasterize.cpp, isect.cpp) into one shared library on first use (cached) and loads it with ctypes.

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
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

SOURCES = sorted(Path(__file__).resolve().parent.glob("*.cpp"))
FLAGS = ["-std=c++17", "-O3", "-fPIC", "-shared", "-pthread", "-ffp-contract=off"]

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


def _build() -> ctypes.CDLL:
    cxx = find_compiler()
    if cxx is None:
        wanted = os.environ.get("CXX") or "c++, g++ or clang++"
        raise RuntimeError(f"no C++ compiler found ({wanted} not on PATH)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    sources = [f.read_text() for f in SOURCES]
    key = hashlib.sha256("\0".join([*sources, cxx, version, *FLAGS]).encode()).hexdigest()[:24]
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    so = d / f"splat-cpu-{key}.so"
    if not so.exists():
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            tmp_so = Path(tmp) / so.name
            cmd = [cxx, *FLAGS, *map(str, SOURCES), "-o", str(tmp_so)]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                names = ", ".join(f.name for f in SOURCES)
                raise RuntimeError(f"{cxx} failed to build {names}:\n{res.stderr.strip()[-2000:]}")
            os.replace(tmp_so, so)
    lib = ctypes.CDLL(str(so))
    i32, i64, f32, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    head = [i32] * 7 + [i64, f32, f32, f32]  # C, D, width, height, tile_size, tile_w, tile_h, M, constants
    lib.splat_rasterize_fwd.argtypes = head + [ptr] * 10 + [i32]
    lib.splat_rasterize_bwd.argtypes = head + [ptr] * 16 + [i32]
    lib.splat_rasterize_fwd.restype = lib.splat_rasterize_bwd.restype = i32
    lib.splat_isect_count.argtypes = [i64, i32, i32, i32, ptr, ptr, ptr, i32]
    lib.splat_isect_count.restype = i64
    lib.splat_isect_fill.argtypes = [i64, i64, i32, i32, i32, ptr, ptr, ptr, ptr, i64, ptr, ptr, i32]
    lib.splat_isect_fill.restype = i32
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


def reset() -> None:
    """Forget the loaded library (tests use it to re-run the build with another $CXX)."""
    with _lock:
        _state.clear()

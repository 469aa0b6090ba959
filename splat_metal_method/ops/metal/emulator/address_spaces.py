"""Address-space check: clang type-checks a kernel library with Metal's address spaces kept apart.

g++ compiles the emulator with ``device``, ``constant`` and ``threadgroup`` defined away, so a
device pointer passed where a thread pointer is expected (or a threadgroup reference bound to a
thread parameter) compiles and even runs. Apple's compiler rejects it. This check compiles the same
source with ``clang++ -fsyntax-only`` against ``address_spaces/metal_stdlib``, a declaration-only
stand-in for <metal_stdlib> in which the three keywords are distinct
``__attribute__((address_space(N)))`` qualifiers and ``thread`` is the default address space, so
clang refuses every mismatch with a file:line of the .metal source.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from .errors import EmulatorError, MetalCompileError
from .parse import TgDecl

STANDIN_DIR = Path(__file__).resolve().parent / "address_spaces"
_CLANG = os.environ.get("SPLAT_METAL_EMU_CLANG", "clang++")
_FLAGS = [
    "-std=c++17",
    "-fsyntax-only",
    "-nostdinc",
    "-nostdinc++",
    "-Wno-unknown-attributes",
    "-Werror=vla",
    "-ferror-limit=20",
]


def clang() -> str | None:
    """Path of the clang++ the check uses, or None when none is installed."""
    return shutil.which(_CLANG)


def standin_text() -> str:
    return (STANDIN_DIR / "metal_stdlib").read_text()


def check_address_spaces(source: str, tg_decls: list[TgDecl], name: str = "kernels") -> None:
    """Raise MetalCompileError if `source` does not type-check with Metal's address spaces.

    `tg_decls`: the kernels' shared-array declarations (parse.parse_kernels); they become
    `static threadgroup` (clang allows no address space on an automatic variable; Metal's
    threadgroup arrays live as long as the group anyway).
    """
    exe = clang()
    if exe is None:
        raise EmulatorError(
            f"the address-space check needs clang++ ({_CLANG!r} not found; "
            "scripts/setup.sh installs it, or set $SPLAT_METAL_EMU_CLANG)"
        )
    for d in sorted(tg_decls, key=lambda d: -d.start):
        source = source[: d.start] + "static " + source[d.start :]
    prefix = "" if source.lstrip().startswith("#line") else f'#line 1 "{name}"\n'
    res = subprocess.run(
        [exe, *_FLAGS, "-I", str(STANDIN_DIR), "-x", "c++", "-"], input=prefix + source, capture_output=True, text=True
    )
    if res.returncode != 0:
        raise MetalCompileError(
            f"{name}: does not type-check with Metal's address spaces (device, constant, "
            f"threadgroup and thread are distinct on Apple GPUs):\n{res.stderr}"
        )

"""The PlayCanvas formats for ``splat-metal-export --format sog compressed-ply``: writes one to a
(temporary) path and returns its size and the note the command prints after it."""

from __future__ import annotations

from pathlib import Path
from typing import Tuple

from .gaussians import ExportGaussians


def write_playcanvas(g: ExportGaussians, fmt: str, path: Path, device=None) -> Tuple[int, str]:
    notes = []
    if fmt == "sog":
        from .sog_file import encode_sog

        enc = encode_sog(g, device=device)
        data = enc.data
        if enc.palette:
            notes.append(f"SH from a {enc.palette:,}-entry palette")
    elif fmt == "compressed-ply":
        from .compressed_ply_file import encode_compressed_ply

        enc = encode_compressed_ply(g)
        data = enc.data
        if enc.clamped_sh:
            notes.append(f"{enc.clamped_sh:,} SH coefficients clamped to [-4, 4]")
    else:
        raise ValueError(f"unknown PlayCanvas format {fmt!r}")
    if g.sh_degree > enc.sh_degree:
        notes.append(f"SH band {g.sh_degree} dropped (the format stores bands 1-3)")
    path.write_bytes(data)
    return len(data), "".join(f", {n}" for n in notes)

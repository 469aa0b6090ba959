"""The PlayCanvas formats for ``splat-metal-export --format sog compressed-ply``: writes one to a
(temporary) path and returns its size and the note the command prints after it.

The .sog's SH palette (k-means, the costly part; quantize.kmeans) runs on the
device the run trains on: nerfstudio's loader puts the model on "cuda if available else cpu", never
mps, so a model on the CPU clusters on mps > cuda > cpu (the order ``ns-train splat-metal`` picks),
one on a GPU on that GPU. The same machine gives the same bytes; another device may round a
distance differently and pick another centroid for a near tie.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Tuple

from .gaussians import ExportGaussians


def kmeans_device(model_device=None):  # -> torch.device, or "cpu" (quantize's numpy path, torch not imported)
    if model_device is None and not gpu_possible():
        return "cpu"  # what torch would answer here, without its 2-3 s import
    import torch

    device = torch.device(model_device) if model_device is not None else torch.device("cpu")
    if device.type != "cpu":
        return device
    if torch.backends.mps.is_available():
        return torch.device("mps")
    if torch.cuda.is_available():
        return torch.device("cuda")
    return device


def gpu_possible() -> bool:
    """False only where torch cannot see a GPU: not macOS (MPS), and no NVIDIA (/dev/nvidia*), AMD
    ROCm (/dev/kfd) or WSL (/dev/dxg) device node. Anywhere else torch is asked."""
    if sys.platform == "darwin":
        return True
    dev = Path("/dev")
    return any(dev.glob("nvidia*")) or (dev / "kfd").exists() or (dev / "dxg").exists()


def write_playcanvas(g: ExportGaussians, fmt: str, path: Path, device=None, report=None) -> Tuple[int, str]:
    notes = []
    if fmt == "sog":
        from .sog_file import encode_sog

        enc = encode_sog(g, device=kmeans_device(device), report=report)
        data = enc.data
        if enc.palette:
            notes.append(f"SH palette of {enc.palette:,} entries")
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

"""splatfacto's background composite of a render, ``clamp(color + (1 - alpha) * background, 0, 1)``, as one op.

    rgb = composite_background(color, alpha, background, backend)

color [..., D] (D >= 3; only the first 3 channels are composited, "RGB+ED" renders carry depth last),
alpha [..., 1], background [3] (no gradient) -> rgb [..., 3], differentiable in color and alpha.
backend "metal" runs train.metal's composite_fwd / composite_bwd (one launch each way, the same float32
operations: the same bits) where PyTorch issues 4 aten ops forward and about 8 backward; every other
backend, and what the kernels do not cover, runs the reference: splatfacto's expression.
"""

from __future__ import annotations

import torch
from torch import Tensor


def composite_background_reference(color: Tensor, alpha: Tensor, background: Tensor) -> Tensor:
    """splatfacto's get_outputs expression: the oracle and the fallback."""
    color = color if color.shape[-1] == 3 else color[..., :3]
    return torch.clamp(color + (1 - alpha) * background, 0.0, 1.0)


def composite_background(color: Tensor, alpha: Tensor, background: Tensor, backend: str = "auto",
                         squeeze: bool = False) -> Tensor:  # fmt: skip
    """``squeeze``: as ``.squeeze(0)`` of the result; for one camera's [1, H, W, D] the kernel writes [H, W, 3]
    (no view op)."""
    from .rasterization import resolve_backend

    covered = (
        color.dtype == alpha.dtype == background.dtype == torch.float32
        and color.shape[-1] >= 3 and tuple(alpha.shape) == tuple(color.shape[:-1]) + (1,)
        and tuple(background.shape) == (3,) and not background.requires_grad
        and color.device == alpha.device == background.device
        and color.is_contiguous() and alpha.is_contiguous() and background.is_contiguous()
    )  # fmt: skip
    if covered and resolve_backend(backend, color.device) == "metal":
        from .metal.train import composite

        if not squeeze or color.shape[0] == 1:
            return composite(color, alpha, background, squeeze)
        return composite(color, alpha, background).squeeze(0)  # several cameras: as the reference (a no-op view)
    rgb = composite_background_reference(color, alpha, background)
    return rgb.squeeze(0) if squeeze else rgb

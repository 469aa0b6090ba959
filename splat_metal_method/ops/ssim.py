"""SSIM for the training loss and the eval metric, with fewer device ops than splatfacto's.

splatfacto builds ``pytorch_msssim.SSIM(data_range=1.0, size_average=True, channel=3)``. That one
blurs its five maps (x, y, x^2, y^2, xy) one after the other: 10 convolutions forward and 6 more
backward per step, plus a copy of its window to the image's device on every call (a host-to-device
copy, which waits on MPS). ``FusedSSIM`` computes the same formula (pytorch_msssim 1.0's ``_ssim``:
11-tap gaussian window, sigma 1.5, K = (0.01, 0.03), valid padding, mean over pixels, channels and
images) with the five maps stacked along the channel axis, so the blur is one grouped convolution
per image axis, and keeps its window on the model's device. Equal to pytorch_msssim up to float32
rounding (tests/ops/test_ssim.py).
"""

from __future__ import annotations

import pytorch_msssim
import torch
import torch.nn.functional as F
from pytorch_msssim.ssim import _fspecial_gauss_1d
from torch import Tensor


class FusedSSIM(torch.nn.Module):
    """``pytorch_msssim.SSIM(data_range, size_average=True, channel=channel)`` for [B, C, H, W] images."""

    def __init__(self, data_range: float = 1.0, channel: int = 3, win_size: int = 11, win_sigma: float = 1.5,
                 K=(0.01, 0.03)):  # fmt: skip
        super().__init__()
        self.data_range, self.channel, self.K = data_range, channel, K
        window = _fspecial_gauss_1d(win_size, win_sigma)  # [1, 1, win]
        # one window per channel of the five stacked maps; not in checkpoints (nor was pytorch_msssim's)
        self.register_buffer("win", window.repeat(5 * channel, 1, 1, 1), persistent=False)  # [5C, 1, 1, win]

    def forward(self, X: Tensor, Y: Tensor) -> Tensor:  # [B, C, H, W] each -> scalar
        win_size = self.win.shape[-1]
        if X.dim() != 4 or X.shape != Y.shape or X.shape[1] != self.channel or min(X.shape[2:]) < win_size:
            # what this does not cover (pytorch_msssim skips the blur along short axes): theirs
            return pytorch_msssim.ssim(X, Y, data_range=self.data_range, win=self.win[: self.channel], K=self.K)
        C1 = (self.K[0] * self.data_range) ** 2
        C2 = (self.K[1] * self.data_range) ** 2
        win = self.win.to(dtype=X.dtype)
        maps = torch.cat([X, Y, X * X, Y * Y, X * Y], dim=1)  # [B, 5C, H, W]
        blurred = F.conv2d(maps, win.transpose(2, -1), groups=maps.shape[1])  # along H (valid)
        blurred = F.conv2d(blurred, win, groups=maps.shape[1])  # along W (valid)
        mu1, mu2, xx, yy, xy = blurred.chunk(5, dim=1)  # [B, C, H', W'] each
        mu1_sq, mu2_sq, mu1_mu2 = mu1.pow(2), mu2.pow(2), mu1 * mu2
        cs_map = (2 * (xy - mu1_mu2) + C2) / ((xx - mu1_sq) + (yy - mu2_sq) + C2)
        ssim_map = ((2 * mu1_mu2 + C1) / (mu1_sq + mu2_sq + C1)) * cs_map
        return ssim_map.mean()

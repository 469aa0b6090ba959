"""splat_metal_method/ops/ssim.py: FusedSSIM equals splatfacto's pytorch_msssim.SSIM, value and gradient."""

from __future__ import annotations

import pytest
import pytorch_msssim
import torch

from splat_metal_method.ops.ssim import FusedSSIM


@pytest.mark.parametrize("shape", [(1, 3, 64, 96), (1, 3, 37, 20), (2, 3, 11, 15), (1, 3, 8, 40)],
                         ids=["96x64", "odd-20x37", "batch-at-window", "shorter-than-window"])  # fmt: skip
def test_fused_ssim_equals_pytorch_msssim(shape):
    g = torch.Generator().manual_seed(0)
    X = torch.rand(*shape, generator=g)
    Y = (X + 0.2 * torch.randn(*shape, generator=g)).clamp(0, 1).requires_grad_()
    theirs = pytorch_msssim.SSIM(data_range=1.0, size_average=True, channel=3)(X, Y)
    ours = FusedSSIM(data_range=1.0, channel=3)(X, Y)
    (g_theirs,) = torch.autograd.grad(theirs, Y)
    (g_ours,) = torch.autograd.grad(ours, Y)
    assert 0.05 < float(theirs) < 0.99  # a real comparison, not two ones
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-4, atol=1e-8)
    assert g_ours.abs().max() > 1e-5


def test_fused_ssim_has_no_window_in_the_state_dict_and_moves_with_the_module():
    ssim = FusedSSIM()
    assert ssim.state_dict() == {} and ssim.win.shape == (15, 1, 1, 11)
    assert ssim.to(torch.float64).win.dtype == torch.float64

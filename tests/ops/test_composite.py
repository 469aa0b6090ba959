"""ops/composite.py: the background composite's Metal kernels (train.metal composite_fwd / composite_bwd,
under the emulator) against splatfacto's expression (the reference): forward and both gradients."""

from __future__ import annotations

import pytest
import torch

from splat_metal_method.bench import step_ledger
from splat_metal_method.ops.composite import composite_background, composite_background_reference


@pytest.mark.parametrize("D,squeeze", [(3, False), (4, False), (3, True)])
def test_composite_kernels_match_the_reference(D, squeeze):
    g = torch.Generator().manual_seed(7)
    H, W = 5, 9  # non-square
    color = torch.rand(1, H, W, D, generator=g) * 1.6 - 0.3  # some below 0 and above 1: clamped
    alpha = torch.rand(1, H, W, 1, generator=g)
    color[0, 0, 0, 0] = float("nan")
    color[0, 1, 2, 1] = 1.0 - (1 - alpha[0, 1, 2, 0]) * 0.25  # lands on the clamp's boundary (passes)
    background = torch.tensor([0.25, 0.5, 1.0])
    v_rgb = torch.randn(1, H, W, 3, generator=g)
    out = {}
    for backend in ("reference", "metal"):
        c, a = color.clone().requires_grad_(), alpha.clone().requires_grad_()
        with step_ledger.count(backend) as led:
            if backend == "metal":
                rgb = composite_background(c, a, background, backend=backend, squeeze=squeeze)
            else:
                rgb = composite_background_reference(c, a, background)
                rgb = rgb.squeeze(0) if squeeze else rgb
            rgb.backward(v_rgb[0] if squeeze else v_rgb)
        out[backend] = (rgb.detach(), c.grad, a.grad, led)
    ref, got = out["reference"], out["metal"]
    assert got[0].shape == ((H, W, 3) if squeeze else (1, H, W, 3))
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)  # v_color (depth channel 0)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-6, atol=1e-7)  # v_alpha: a 3-term channel sum
    assert (got[1] == 0).any() and (got[1] != 0).any()
    assert got[3].kernel_launches == 2 and got[3].aten_dispatches < ref[3].aten_dispatches


def test_composite_squeeze_of_several_cameras_is_a_no_op():
    color, alpha, bg = torch.rand(2, 3, 4, 3), torch.rand(2, 3, 4, 1), torch.rand(3)
    out = composite_background(color, alpha, bg, "metal", squeeze=True)
    assert torch.equal(out, composite_background_reference(color, alpha, bg))


def test_composite_falls_back_where_the_kernels_do_not_cover():
    color, alpha = torch.rand(2, 3, 3), torch.rand(2, 3, 1)
    background = torch.rand(3, requires_grad=True)  # a background with a gradient: the reference
    rgb = composite_background(color, alpha, background, "metal")
    rgb.sum().backward()
    assert background.grad is not None

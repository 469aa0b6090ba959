"""model.py's camera helpers built on the device equal nerfstudio's: viewmat_from_c2w vs splatfacto's
get_viewmat (values and gradients), intrinsics vs Cameras.rescale_output_resolution +
get_intrinsics_matrices, with the training size as ``size // scale``."""

from __future__ import annotations

import pytest
import torch
from nerfstudio.cameras.cameras import Cameras
from nerfstudio.models.splatfacto import get_viewmat

from splat_metal_method.model import intrinsics, viewmat_from_c2w


def test_viewmat_equals_splatfactos_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    c2w = torch.randn(3, 3, 4, generator=g, requires_grad=True)
    theirs = getattr(get_viewmat, "__wrapped__", get_viewmat)(c2w)
    ours = viewmat_from_c2w(c2w)
    assert torch.equal(ours, theirs)
    weights = torch.randn(3, 4, 4, generator=g)
    (g_theirs,) = torch.autograd.grad((theirs * weights).sum(), c2w)
    (g_ours,) = torch.autograd.grad((ours * weights).sum(), c2w)
    assert torch.equal(g_ours, g_theirs) and g_ours.abs().sum() > 0


@pytest.mark.parametrize("scale", [1, 2, 4])
def test_intrinsics_and_size_equal_the_rescaled_camera(scale):
    c2w = torch.eye(4)[:3][None].repeat(2, 1, 1)
    camera = Cameras(camera_to_worlds=c2w, fx=torch.tensor([[100.3], [80.0]]), fy=torch.tensor([[90.1], [70.5]]),
                     cx=torch.tensor([[47.7], [40.2]]), cy=torch.tensor([[31.1], [33.3]]),
                     width=torch.tensor([[97], [97]]), height=torch.tensor([[65], [65]]))  # fmt: skip
    ours = intrinsics(camera, scale)
    camera.rescale_output_resolution(1 / scale)
    assert torch.equal(ours, camera.get_intrinsics_matrices())
    assert (int(camera.width[0]), int(camera.height[0])) == (97 // scale, 65 // scale)

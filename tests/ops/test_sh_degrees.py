"""Spherical harmonics of every degree gsplat 1.4 supports (0..4, up to 25 coefficients per colour channel) on
every backend with an SH stage -- reference, native cpu, metal (the MSL emulator here) -- against gsplat's own
PyTorch implementation (gsplat.cuda._torch_impl._spherical_harmonics), forward and backward (directions and
coefficients), with masks, zero directions and more coefficient rows than the degree reads. Also: the host's
highest degree (constants.SH_MAX_DEGREE) is the one the kernels' shared basis (ops/metal/sh.h) is sized for,
and a degree above it is one clear error on every backend."""

from __future__ import annotations

import re

import pytest
import torch
from gsplat.cuda._torch_impl import _spherical_harmonics

from splat_metal_method.ops import constants, cpu, metal, reference
from splat_metal_method.ops.metal.runtime import KERNEL_DIR

BACKENDS = {"reference": reference, "cpu": cpu, "metal": metal}


def test_kernel_basis_is_sized_for_the_hosts_highest_degree():
    header = (KERNEL_DIR / "sh.h").read_text()
    degree = int(re.search(r"#define SPLAT_SH_MAX_DEGREE (\d+)", header).group(1))
    bases = int(re.search(r"#define SPLAT_SH_MAX_BASES (\d+)", header).group(1))
    assert degree == constants.SH_MAX_DEGREE == 4 and bases == (degree + 1) ** 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("degree", [0, 1, 2, 3, 4])
def test_every_backend_matches_gsplat_at_every_degree(backend, degree):
    if backend == "cpu" and not cpu.available():
        pytest.skip("no C++ compiler here to build the native CPU backend")
    g = torch.Generator().manual_seed(40 + degree)
    C, N, K = 2, 257, 25  # K rows for degree 4; lower degrees must read only the first (degree+1)^2
    dirs = torch.randn(C, N, 3, generator=g) * 2.0
    dirs[0, :3] = 0.0  # F.normalize's zero direction: only band 0 contributes
    coeffs = torch.randn(C, N, K, 3, generator=g)
    masks = torch.rand(C, N, generator=g) > 0.25
    v_colors = torch.randn(C, N, 3, generator=g)

    def grads(fn):
        d, c = dirs.clone().requires_grad_(), coeffs.clone().requires_grad_()
        colors = fn(d, c)
        (colors * v_colors).sum().backward()
        return colors.detach(), torch.zeros_like(dirs) if d.grad is None else d.grad, c.grad

    want = grads(lambda d, c: _spherical_harmonics(degree, d, c) * masks[..., None])
    got = grads(lambda d, c: BACKENDS[backend].spherical_harmonics(degree, d, c, masks))
    for name, a, b in zip(("colors", "v_dirs", "v_coeffs"), got, want):
        scale = float(b.abs().max())
        assert scale > 0 or (name == "v_dirs" and degree == 0), f"{name}: the comparison would be empty"
        err = float((a - b).abs().max())
        assert err <= 2e-6 * max(scale, 1.0), (
            f"{backend} degree {degree} {name}: max error {err:.3g} (scale {scale:.3g})"
        )
    assert (got[2][..., (degree + 1) ** 2 :, :] == 0).all(), "rows beyond the degree got a gradient"
    assert (got[0][~masks] == 0).all() and (got[2][~masks] == 0).all(), "masked entries must be exactly 0"


@pytest.mark.parametrize("backend", BACKENDS)
def test_degree_above_four_is_one_clear_error(backend):
    if backend == "cpu" and not cpu.available():
        pytest.skip("no C++ compiler here to build the native CPU backend")
    with pytest.raises(ValueError, match=r"spherical_harmonics\] degree must be 0\.\.4, got 5"):
        BACKENDS[backend].spherical_harmonics(5, torch.randn(1, 4, 3), torch.randn(1, 4, 36, 3))

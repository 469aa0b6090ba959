"""Run-to-run determinism of one forward + backward of ``rasterization`` on CPU tensors.

The reference and cpu backends have no atomics: bit-identical (the cpu backend's native
rasterizer sums gradients per gaussian in a fixed order after its threads join). The Metal rasterize backward accumulates
gradients with device float atomics; under the emulator threadgroups run on several OS threads
(SPLAT_METAL_EMU_THREADS, default min(cores, 8)), so the order of those additions, and thus the
last bits of the gradients of gaussians that span several tiles, changes from run to run, as on a
real GPU (gsplat's CUDA backward does the same). With one emulator thread the order is fixed and the
result bit-identical. What README "Reliability" reports about magnitudes was measured this way."""

from __future__ import annotations

import pytest
import torch
from scenes import random_scene

from splat_metal_method.ops import rasterization


def _grads(scene, backend):
    inputs = {
        k: getattr(scene, k).clone().requires_grad_(True) for k in ("means", "quats", "scales", "opacities", "colors")
    }
    colors, alphas, meta = rasterization(**scene.kwargs(**inputs, backend=backend), absgrad=True)
    meta["means2d"].retain_grad()
    weights = torch.rand(colors.shape, generator=torch.Generator().manual_seed(0))
    ((colors * weights).sum() + alphas.sum()).backward()
    out = {k: v.grad for k, v in inputs.items()}
    out.update(means2d=meta["means2d"].grad, absgrad=meta["means2d"].absgrad, colors_out=colors.detach())
    return out


@pytest.fixture(scope="module")
def scene():
    # Many large gaussians on a non-square image: most span several 16x16 tiles (threadgroups).
    return random_scene(n=600, width=61, height=37, seed=5, scale_range=(0.05, 0.5))


@pytest.mark.parametrize("backend,threads", [("reference", None), ("cpu", None), ("metal", "1")])
def test_backward_is_bit_identical_without_concurrent_atomics(scene, backend, threads, monkeypatch):
    if threads is not None:
        monkeypatch.setenv("SPLAT_METAL_EMU_THREADS", threads)
    a, b = _grads(scene, backend), _grads(scene, backend)
    for k in a:
        assert torch.equal(a[k], b[k]), f"{backend}: {k} differs between two identical runs"


def test_metal_atomics_order_changes_only_the_last_bits(scene, monkeypatch):
    monkeypatch.setenv("SPLAT_METAL_EMU_THREADS", "4")
    a, b = _grads(scene, "metal"), _grads(scene, "metal")
    assert torch.equal(a["colors_out"], b["colors_out"])  # the forward pass has no atomics
    for k in ("means", "quats", "scales", "opacities", "colors", "means2d", "absgrad"):
        scale = a[k].abs().max()
        # Reordered float32 sums: differences of a few ulps of the largest terms, never more.
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=float(scale) * 1e-5, msg=lambda m, k=k: f"{k}: {m}")

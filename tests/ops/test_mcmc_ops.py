"""The MCMC strategy's ops (splat_metal_method/ops/mcmc.py) against their formulas, written out here
independently: relocation (3DGS as MCMC, eq. 9) evaluated term by term in float64 with math.comb,
and covariances built by rotating the axes with quaternion products (not a rotation matrix)."""

from __future__ import annotations

import math

import pytest
import torch

from splat_metal_method import ops
from splat_metal_method.ops import reference

N_MAX = 51  # gsplat's table size


def binoms_table(n_max: int = N_MAX, dtype=torch.float32) -> torch.Tensor:
    """What MCMCStrategy.initialize_state builds: [n_max, n_max], C(n, k) (float32 there)."""
    return torch.tensor([[float(math.comb(n, k)) for k in range(n_max)] for n in range(n_max)], dtype=dtype)


def relocation_formula(o: float, n: int):
    """Eq. 9 of the paper, term by term, in float64: (o', scale factor)."""
    o_new = 1.0 - (1.0 - o) ** (1.0 / n)
    denom = sum(
        math.comb(i - 1, k) * (-1) ** k / math.sqrt(k + 1) * o_new ** (k + 1) for i in range(1, n + 1) for k in range(i)
    )
    return o_new, o / denom


OPACITIES = [0.005, 0.02, 0.1, 0.5, 0.9, 0.99, 1 - 1.19e-7]
COUNTS = [1, 2, 3, 7, 20, 50, 51]


# With gsplat's float32 table, C(50, 25) ~ 1.3e14 is rounded and the alternating sum magnifies that to
# 8e-5 relative at o ~ 1, n = 51 (gsplat's float32 kernel: 3e-4); with exact (float64) coefficients
# the reference is exact to float32.
@pytest.mark.parametrize(
    "table, rel", [(torch.float64, 1e-6), (torch.float32, 1e-4)], ids=["exact-table", "gsplat-table"]
)
def test_relocation_matches_the_paper_formula(table, rel):
    o = torch.tensor([a for a in OPACITIES for _ in COUNTS])
    n = torch.tensor([b for _ in OPACITIES for b in COUNTS], dtype=torch.int32)
    scales = torch.rand(len(o), 3) + 0.1
    new_o, new_s = ops.compute_relocation(o, scales, n, binoms_table(dtype=table))
    assert new_o.dtype == new_s.dtype == torch.float32 and new_s.shape == scales.shape
    for i, (a, b) in enumerate(zip(o.tolist(), n.tolist())):
        want_o, factor = relocation_formula(a, b)
        assert new_o[i].item() == pytest.approx(want_o, rel=1e-6), (a, b)
        assert new_s[i].tolist() == pytest.approx((scales[i].double() * factor).tolist(), rel=rel), (a, b)


def test_relocation_keeps_what_the_original_looked_like():
    """n copies of o' composite to the original opacity; one copy is the original itself."""
    o = torch.tensor([0.05, 0.3, 0.7, 0.95])
    for n in (1, 4, 30):
        new_o, new_s = ops.compute_relocation(o, torch.ones(4, 3), torch.full((4,), n), binoms_table())
        torch.testing.assert_close(1 - (1 - new_o) ** n, o, rtol=1e-5, atol=1e-6)
        if n == 1:
            torch.testing.assert_close(new_o, o)
            torch.testing.assert_close(new_s, torch.ones(4, 3))
        else:
            assert (new_o < o).all() and (new_s < 1).all()  # more, fainter, smaller gaussians


def test_relocation_clamps_counts_like_gsplat_and_leaves_its_input_alone():
    o, s = torch.full((4,), 0.4), torch.rand(4, 3) + 0.5
    ratios = torch.tensor([0, 1, 51, 500], dtype=torch.int32)
    before = ratios.clone()
    new_o, new_s = ops.compute_relocation(o, s, ratios, binoms_table())
    torch.testing.assert_close(ratios, before)  # gsplat clamps its argument in place; we do not
    clamped_o, clamped_s = ops.compute_relocation(o, s, torch.tensor([1, 1, 51, 51]), binoms_table())
    torch.testing.assert_close(new_o, clamped_o)
    torch.testing.assert_close(new_s, clamped_s)
    # a smaller table clamps lower: n_max = 10
    small_o, _ = ops.compute_relocation(o, s, torch.tensor([20, 20, 20, 20]), binoms_table(10))
    torch.testing.assert_close(small_o, torch.full((4,), relocation_formula(0.4, 10)[0]))


def test_relocation_keeps_the_opacity_shape():
    o = torch.rand(6, 1) * 0.9 + 0.05  # splatfacto's opacities are [N, 1]; gsplat's ops pass them so
    s, n = torch.rand(6, 3) + 0.1, torch.tensor([1, 2, 3, 4, 5, 6])
    new_o, new_s = ops.compute_relocation(o, s, n, binoms_table())
    assert new_o.shape == (6, 1)
    flat_o, flat_s = ops.compute_relocation(o.flatten(), s, n, binoms_table())
    torch.testing.assert_close(new_o.flatten(), flat_o)
    torch.testing.assert_close(new_s, flat_s)


def test_relocation_of_nothing():
    empty = torch.zeros(0, dtype=torch.int32)
    new_o, new_s = ops.compute_relocation(torch.zeros(0), torch.zeros(0, 3), empty, binoms_table())
    assert new_o.shape == (0,) and new_s.shape == (0, 3)


def rotate(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q v q* with Hamilton products (q [N,4] wxyz unit, v [N,3])."""

    def mul(a, b):
        aw, ax, ay, az = a.unbind(-1)
        bw, bx, by, bz = b.unbind(-1)
        return torch.stack([
            aw * bw - ax * bx - ay * by - az * bz,
            aw * bx + ax * bw + ay * bz - az * by,
            aw * by - ax * bz + ay * bw + az * bx,
            aw * bz + ax * by - ay * bx + az * bw,
        ], dim=-1)  # fmt: skip

    conj = q * torch.tensor([1.0, -1.0, -1.0, -1.0], dtype=q.dtype)
    return mul(mul(q, torch.cat([torch.zeros_like(v[:, :1]), v], dim=-1)), conj)[:, 1:]


def covariance_formula(quats: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """sum_i s_i^2 r_i r_i^T with r_i the i-th axis rotated by the normalised quaternion: [N, 3, 3]."""
    q = quats.double() / quats.double().norm(dim=-1, keepdim=True)
    s = scales.double()
    cov = torch.zeros(len(q), 3, 3, dtype=torch.float64)
    for i in range(3):
        axis = torch.zeros(len(q), 3, dtype=torch.float64)
        axis[:, i] = 1
        r = rotate(q, axis)
        cov += s[:, i, None, None] ** 2 * r[:, :, None] * r[:, None, :]
    return cov


@pytest.mark.parametrize("triu", [False, True])
def test_covariance_and_precision_match_the_formula(triu):
    g = torch.Generator().manual_seed(0)
    quats = torch.randn(64, 4, generator=g) * 3  # not normalised
    scales = torch.rand(64, 3, generator=g) * 2 + 0.05
    covars, precis = ops.quat_scale_to_covar_preci(quats, scales, triu=triu)
    want_cov = covariance_formula(quats, scales)
    want_pre = torch.linalg.inv(want_cov)
    if triu:
        assert covars.shape == precis.shape == (64, 6)
        upper = [0, 1, 2, 4, 5, 8]  # xx, xy, xz, yy, yz, zz
        want_cov, want_pre = want_cov.flatten(1)[:, upper], want_pre.flatten(1)[:, upper]
    else:
        assert covars.shape == precis.shape == (64, 3, 3)
    torch.testing.assert_close(covars.double(), want_cov, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(precis.double(), want_pre, rtol=1e-4, atol=1e-4)


def test_covariance_flags_and_gsplat_torch_oracle():
    from gsplat.cuda._torch_impl import _quat_scale_to_covar_preci

    quats, scales = torch.randn(10, 4), torch.rand(10, 3) + 0.1
    covars, precis = ops.quat_scale_to_covar_preci(quats, scales, compute_covar=True, compute_preci=False)
    assert precis is None
    torch.testing.assert_close(covars, _quat_scale_to_covar_preci(quats, scales)[0])
    covars, precis = ops.quat_scale_to_covar_preci(quats, scales, compute_covar=False, compute_preci=True, triu=True)
    assert covars is None
    torch.testing.assert_close(precis, _quat_scale_to_covar_preci(quats, scales, triu=True)[1])


def test_covariance_is_differentiable():
    quats = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    scales = (torch.rand(5, 3, dtype=torch.float64) + 0.2).requires_grad_()
    assert torch.autograd.gradcheck(lambda q, s: reference.quat_scale_to_covar_preci(q, s), (quats, scales))


def test_bad_input_names_the_op_and_the_backend():
    with pytest.raises(ValueError, match=r"\[compute_relocation\] needs opacities \[N\] or \[N,1\], scales \[N,3\]"):
        ops.compute_relocation(torch.rand(4), torch.rand(4, 2), torch.ones(4), binoms_table())
    with pytest.raises(ValueError, match=r"\[quat_scale_to_covar_preci\].*quats \[N,4\]"):
        ops.quat_scale_to_covar_preci(torch.rand(4, 3), torch.rand(4, 3))
    with pytest.raises(ValueError, match="backend 'gsplat' needs CUDA tensors"):
        ops.quat_scale_to_covar_preci(torch.rand(4, 4), torch.rand(4, 3), backend="gsplat")
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.compute_relocation(torch.rand(4), torch.rand(4, 3), torch.ones(4), binoms_table(), backend="metal")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="gsplat's CUDA kernels need an NVIDIA GPU")
def test_gsplat_cuda_kernels_agree_with_the_reference():
    o = torch.tensor([a for a in OPACITIES for _ in COUNTS], device="cuda")
    n = torch.tensor([b for _ in OPACITIES for b in COUNTS], dtype=torch.int32, device="cuda")
    s = torch.rand(len(o), 3, device="cuda") + 0.1
    binoms = binoms_table().cuda()
    got = ops.compute_relocation(o, s, n, binoms)  # auto: gsplat on CUDA
    want = ops.compute_relocation(o, s, n, binoms, backend="reference")
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=5e-4, atol=1e-6)
    quats, scales = torch.randn(100, 4, device="cuda"), torch.rand(100, 3, device="cuda") + 0.1
    for triu in (False, True):
        got = ops.quat_scale_to_covar_preci(quats, scales, triu=triu)
        want = ops.quat_scale_to_covar_preci(quats, scales, triu=triu, backend="reference")
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

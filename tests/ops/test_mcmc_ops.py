"""The MCMC strategy's ops (splat_metal_method/ops/mcmc.py) against their formulas, written out here
independently: relocation (3DGS as MCMC, eq. 9) evaluated term by term in float64 with math.comb,
and covariances built by rotating the axes with quaternion products (not a rotation matrix), on every
backend (reference, native cpu, metal under the MSL emulator)."""

from __future__ import annotations

import math

import pytest
import torch

from splat_metal_method import ops
from splat_metal_method.ops import reference


@pytest.fixture(autouse=True)
def _seeded():
    """The tests here draw from torch's global generator: seed it per test, so a test sees the same
    draws whatever ran before it in its process (pytest-xdist orders tests differently from run to run;
    an ill-conditioned draw once pushed covariance @ precision past its float32 tolerance)."""
    torch.manual_seed(0)


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


def axes_formula(quats: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_i w_i r_i r_i^T with r_i the i-th axis rotated by the normalised quaternion (a zero
    quaternion: no rotation), in float64: [N, 3, 3]. w = s^2 is the covariance, w = s^-2 the precision."""
    q = quats.double()
    norm = q.norm(dim=-1, keepdim=True)
    q = torch.where(norm > 0, q / norm, torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64))
    cov = torch.zeros(len(q), 3, 3, dtype=torch.float64)
    for i in range(3):
        axis = torch.zeros(len(q), 3, dtype=torch.float64)
        axis[:, i] = 1
        r = rotate(q, axis)
        cov += weights[:, i, None, None].double() * r[:, :, None] * r[:, None, :]
    return cov


UPPER = [0, 1, 2, 4, 5, 8]  # gsplat's triu order: xx, xy, xz, yy, yz, zz
COVAR_BACKENDS = ["reference", "cpu", "metal"]  # metal: the kernel under the MSL emulator
FLAGS = [(True, True), (True, False), (False, True)]  # (compute_covar, compute_preci)


def covar_inputs(n: int, seed: int = 0):
    """Unnormalised quaternions (|q| from 1e-3 to 1e3, every 7th exactly zero) and scales from 1e-4 to
    1e4 (tiny, huge and very anisotropic gaussians), float32: quats [n, 4], scales [n, 3]."""
    g = torch.Generator().manual_seed(seed)
    quats = torch.randn(n, 4, generator=g) * 10.0 ** torch.randint(-3, 4, (n, 1), generator=g)
    quats[::7] = 0.0
    scales = 10.0 ** (torch.rand(n, 3, generator=g) * 8 - 4)
    return quats, scales


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Worst over gaussians of max |got - want| / max |want|, rows flattened (float32 rounds relative
    to the largest entry of a matrix: tiny entries beside huge ones carry no relative precision)."""
    got, want = got.flatten(1).double(), want.flatten(1).double()
    err = (got - want).abs().amax(dim=1) / want.abs().amax(dim=1)
    return float(err.max()) if len(err) else 0.0


@pytest.mark.parametrize("backend", COVAR_BACKENDS)
@pytest.mark.parametrize("triu", [False, True])
def test_covariance_and_precision_match_the_formula(backend, triu):
    """Every backend and flag combination, N from 0 to 1000+, against the rotated-axes formula."""
    for n in (0, 1, 37, 1029):
        quats, scales = covar_inputs(n, seed=n)
        want = {"cov": axes_formula(quats, scales.double() ** 2), "pre": axes_formula(quats, scales.double() ** -2)}
        for compute_covar, compute_preci in FLAGS:
            outs = ops.quat_scale_to_covar_preci(quats, scales, compute_covar, compute_preci, triu, backend=backend)
            for key, asked, out in zip(("cov", "pre"), (compute_covar, compute_preci), outs):
                if not asked:
                    assert out is None
                    continue
                assert out.dtype == torch.float32 and out.shape == ((n, 6) if triu else (n, 3, 3)), (key, n)
                full = want[key].flatten(1)
                assert rel_error(out, full[:, UPPER] if triu else full) < 2e-6, (key, n)
                if not triu:
                    assert torch.equal(out, out.transpose(1, 2))  # exactly symmetric


def test_precision_is_the_inverse_of_the_covariance():
    quats, scales = torch.randn(64, 4) * 3, torch.rand(64, 3) * 2 + 0.05
    for backend in COVAR_BACKENDS:
        covars, precis = ops.quat_scale_to_covar_preci(quats, scales, backend=backend)
        torch.testing.assert_close(precis.double(), torch.linalg.inv(covariance_formula(quats, scales)),
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
        torch.testing.assert_close(covars @ precis, torch.eye(3).expand(64, 3, 3), rtol=0, atol=1e-4)


@pytest.mark.parametrize("backend", COVAR_BACKENDS)
def test_zero_and_unnormalised_quaternions(backend):
    """A zero quaternion is the identity rotation (covariance exactly diag(s^2)); a quaternion's length
    does not matter."""
    scales = torch.tensor([[0.5, 2.0, 3.0], [1e-4, 1.0, 1e4]])
    covars, precis = ops.quat_scale_to_covar_preci(torch.zeros(2, 4), scales, backend=backend)
    assert torch.equal(covars, torch.diag_embed(scales**2)) and torch.equal(precis, torch.diag_embed((1 / scales) ** 2))
    g = torch.Generator().manual_seed(0)
    q, s = torch.randn(5, 4, generator=g), torch.rand(5, 3, generator=g) + 0.5
    unit = ops.quat_scale_to_covar_preci(q / q.norm(dim=-1, keepdim=True), s, backend=backend)
    for length in (1e-3, 7.0, 1e3):
        for a, b in zip(ops.quat_scale_to_covar_preci(q * length, s, backend=backend), unit):
            # entries up to 1/0.5^2 = 4: float32 rounding of the two normalisations is a few ulp (~5e-7) there
            torch.testing.assert_close(a, b, rtol=1e-6, atol=4e-6)


@pytest.mark.parametrize("backend", ["cpu", "metal"])
def test_native_covariance_matches_the_reference(backend):
    quats, scales = covar_inputs(1029, seed=3)
    for triu in (False, True):
        for flags in FLAGS:
            got = ops.quat_scale_to_covar_preci(quats, scales, *flags, triu=triu, backend=backend)
            want = ops.quat_scale_to_covar_preci(quats, scales, *flags, triu=triu, backend="reference")
            for a, b in zip(got, want):
                assert (a is None) == (b is None)
                if a is not None:
                    assert rel_error(a, b) < 1e-6


@pytest.mark.parametrize("backend", ["cpu", "metal"])
def test_native_covariance_backward_matches_the_reference(backend):
    """The native forward is wrapped in an autograd.Function: its gradients to quats and scales are the
    reference's (which is gradchecked in float64: test_covariance_is_differentiable)."""
    g = torch.Generator().manual_seed(1)
    quats = torch.randn(37, 4, generator=g)
    quats[5] = 0.0
    scales = torch.rand(37, 3, generator=g) * 2 + 0.05
    for triu in (False, True):
        for flags in FLAGS:
            grads = []
            for b in (backend, "reference"):
                q, s = quats.clone().requires_grad_(), scales.clone().requires_grad_()
                outs = ops.quat_scale_to_covar_preci(q, s, *flags, triu=triu, backend=b)
                weights = torch.Generator().manual_seed(2)
                loss = sum((o * torch.randn(o.shape, generator=weights)).sum() for o in outs if o is not None)
                grads.append(torch.autograd.grad(loss, [q, s]))
            for got, want in zip(*grads):
                assert got.abs().max() > 0
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    q = quats.clone().requires_grad_()  # only one input needs a gradient
    covars, _ = ops.quat_scale_to_covar_preci(q, scales, compute_preci=False, backend=backend)
    covars.sum().backward()
    assert q.grad.shape == (37, 4) and q.grad.abs().max() > 0


def test_covariance_routing(monkeypatch):
    """auto runs the native CPU kernel on float32 CPU tensors and the reference on other dtypes; the
    metal backend launches its kernel."""
    from splat_metal_method.ops.cpu import covar as cpu_covar
    from splat_metal_method.ops.metal import runtime

    calls = []
    native = cpu_covar.quat_scale_to_covar_preci_fwd
    monkeypatch.setattr(cpu_covar, "quat_scale_to_covar_preci_fwd", lambda *a: calls.append(a[2:]) or native(*a))
    quats, scales = covar_inputs(10)
    ops.quat_scale_to_covar_preci(quats, scales, compute_preci=False)
    assert calls == [(True, False, False)]
    covars, _ = ops.quat_scale_to_covar_preci(quats.double(), scales.double())
    assert len(calls) == 1 and covars.dtype == torch.float64
    runtime.reset_launch_counts()
    ops.quat_scale_to_covar_preci(quats, scales, backend="metal")
    assert runtime.launch_counts() == {"quat_scale_to_covar_preci_fwd": 1}


def covariance_formula(quats: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """sum_i s_i^2 r_i r_i^T with r_i the i-th axis rotated by the normalised quaternion: [N, 3, 3]."""
    return axes_formula(quats, scales.double() ** 2)


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
        ops.compute_relocation(torch.rand(4), torch.rand(4, 3), torch.ones(4), binoms_table(), backend="vulkan")


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
    quats[::9] = 0.0  # gsplat's kernel alone makes these NaN; the op gives them the identity like the others
    for triu in (False, True):
        got = ops.quat_scale_to_covar_preci(quats, scales, triu=triu)
        want = ops.quat_scale_to_covar_preci(quats, scales, triu=triu, backend="reference")
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

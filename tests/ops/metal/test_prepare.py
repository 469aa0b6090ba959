"""The metal backend's fused preparation (ops/metal/prepare.py: project_fwd with the SH colour in it,
sh_fused_bwd and project_bwd) against the unfused path it replaces (the project and spherical_harmonics
stages with rasterization.py's culling glue between them, and splatfacto's activations in PyTorch), on the
same metal kernels, and against the reference backend: forward outputs and meta, every parameter's
gradient (raw: log-scales, opacity logits, the SH bands apart as splatfacto stores them; and activated),
several cameras, antialiased, and non-finite values the glue culls (opacity, an SH coefficient of a band
in use, a camera whose view matrix' last row or position is not finite; not a coefficient of a band
beyond the degree in use, which colours nothing). And the one forward kernel against its unfused twin
(project_fwd, then sh.metal's sh_fused_fwd), bit for bit, forward and backward, with a planted bug that
the comparison catches."""

from __future__ import annotations

import pytest
import torch
from scenes import random_scene

from splat_metal_method.bench import step_ledger
from splat_metal_method.ops import metal, rasterization
from splat_metal_method.ops.metal import fused as fused_module
from splat_metal_method.ops.metal.fused import rasterization_metal

W, H = 40, 24  # non-square
K = 25  # SH coefficients stored (degree 4), fewer in use below degree 4


def _params(C: int, seed: int, poison: str, degree: int = 4, width: int = W, height: int = H):
    s = random_scene(n=70, C=C, width=width, height=height, seed=seed, sh_degree=4)
    coeffs = s.colors.float()
    params = {
        "means": s.means.float(),
        "quats": s.quats.float(),
        "log_scales": torch.log(s.scales.float()),
        "logit_opacities": torch.logit(s.opacities.float())[:, None],  # [N, 1] as splatfacto stores it
        "features_dc": coeffs[:, 0].contiguous(),
        "features_rest": coeffs[:, 1:].contiguous(),
    }
    viewmats, Ks = s.viewmats.float(), s.Ks.float()
    if poison == "gaussians":
        params["logit_opacities"][3, 0] = float("nan")
        if degree > 0:  # the last coefficient of the bands in use
            params["features_rest"][5, (degree + 1) ** 2 - 2, 1] = float("inf")
        else:
            params["features_dc"][5, 2] = float("inf")
        if degree < 4:  # a band beyond the degree in use colours nothing: not culled
            params["features_rest"][13, 23, 0] = float("nan")
        params["log_scales"][7, 2] = float("nan")
        params["features_dc"][9, 0] = float("-inf")
    elif poison == "camera" and C > 1:
        viewmats[1, 3, 2] = float("nan")  # the last row: projection does not read it, the glue's check does
    return params, viewmats, Ks


def _render(params, viewmats, Ks, degree, raw, antialiased, fused, monkeypatch):
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    Ks = Ks.clone().requires_grad_()
    if raw:
        kwargs = dict(scales=leaves["log_scales"], opacities=leaves["logit_opacities"], colors=leaves["features_dc"],
                      scales_are_log=True, opacities_are_logits=True, colors_rest=leaves["features_rest"])  # fmt: skip
    else:
        kwargs = dict(scales=torch.exp(leaves["log_scales"]), opacities=torch.sigmoid(leaves["logit_opacities"])[:, 0],
                      colors=torch.cat((leaves["features_dc"][:, None], leaves["features_rest"]), dim=1))  # fmt: skip
    with monkeypatch.context() as m:
        if not fused:  # the unfused stages, the oracle of the fused preparation
            m.setattr(fused_module, "_fuses_preparation", lambda *args: False)
        colors, alphas, meta = rasterization_metal(
            leaves["means"], leaves["quats"], viewmats=viewmats, Ks=Ks, width=W, height=H, sh_degree=degree,
            absgrad=True, rasterize_mode="antialiased" if antialiased else "classic",
            render_mode="RGB+ED", **kwargs,
        )  # fmt: skip
        g = torch.Generator().manual_seed(11)
        loss = (colors * torch.randn(colors.shape, generator=g)).sum() + (
            alphas * torch.rand(alphas.shape, generator=g)
        ).sum()
        loss.backward()
    grads = {k: v.grad for k, v in leaves.items()}
    grads["Ks"] = Ks.grad
    grads["absgrad"] = meta["means2d"].absgrad
    return colors.detach(), alphas.detach(), meta, grads


@pytest.mark.parametrize(
    "C,degree,raw,antialiased,poison",
    [(1, 3, True, False, "none"), (2, 1, True, True, "gaussians"), (2, 3, False, False, "camera"),
     (1, 0, True, True, "gaussians"), (3, 2, False, True, "none"), (2, 4, True, True, "gaussians"),
     (1, 4, False, False, "none")],
)  # fmt: skip
def test_fused_preparation_matches_the_unfused_path(C, degree, raw, antialiased, poison, monkeypatch):
    params, viewmats, Ks = _params(C, seed=C * 10 + degree, poison=poison, degree=degree)
    fused = _render(params, viewmats, Ks, degree, raw, antialiased, True, monkeypatch)
    plain = _render(params, viewmats, Ks, degree, raw, antialiased, False, monkeypatch)
    (c1, a1, m1, g1), (c0, a0, m0, g0) = fused, plain
    assert torch.equal(m1["radii"], m0["radii"])  # the same gaussians culled and kept
    assert (m1["radii"] > 0).sum() > 10
    if poison == "gaussians":
        assert (m1["radii"][:, [3, 5, 7, 9]] == 0).all()
        assert degree == 4 or (m1["radii"][:, 13] > 0).any()  # its NaN is in a band not in use
    if poison == "camera":
        assert (m1["radii"][1] == 0).all() and (m1["radii"][0] > 0).any()
    for key in ("means2d", "depths", "conics", "opacities"):
        torch.testing.assert_close(m1[key], m0[key], rtol=1e-6, atol=1e-6, msg=key)
    torch.testing.assert_close(c1, c0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a1, a0, rtol=1e-5, atol=1e-5)
    for key, g in g0.items():
        assert g1[key] is not None, key
        if key != "features_rest":  # the NaN beyond the bands in use: a gradient of 0 (written) to a NaN there
            assert torch.isfinite(g1[key]).all(), key
        # the unfused path's exp / sigmoid backward turns a culled gaussian's zero gradient into 0 * NaN = NaN
        # where its raw parameter is NaN; the kernels leave it 0 (the NaN guard sees the parameter itself)
        bad = ~torch.isfinite(g)
        assert (g1[key][bad] == 0).all(), key
        g = torch.where(bad, 0.0, g)
        scale = g.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(g1[key] / scale, g / scale, rtol=1e-4, atol=1e-5, msg=key)
    if degree < 4:  # bands beyond the degree in use: zero
        assert g1["features_rest"][:, (degree + 1) ** 2 - 1 :].abs().max() == 0
    if poison == "gaussians":
        for key in ("means", "quats", "log_scales", "logit_opacities", "features_dc", "features_rest"):
            assert (g1[key][[3, 5, 7, 9]] == 0).all(), key


def test_fused_preparation_matches_the_reference_backend(monkeypatch):
    params, viewmats, Ks = _params(2, seed=4, poison="gaussians")
    c1, a1, m1, g1 = _render(params, viewmats, Ks, 4, True, False, True, monkeypatch)
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    Kr = Ks.clone().requires_grad_()
    colors, alphas, meta = rasterization(
        leaves["means"], leaves["quats"], torch.exp(leaves["log_scales"]), torch.sigmoid(leaves["logit_opacities"])[:, 0],
        torch.cat((leaves["features_dc"][:, None], leaves["features_rest"]), dim=1), viewmats, Kr, W, H, sh_degree=4,
        backend="reference", absgrad=True, render_mode="RGB+ED",
    )  # fmt: skip
    g = torch.Generator().manual_seed(11)
    (
        (colors * torch.randn(colors.shape, generator=g)).sum() + (alphas * torch.rand(alphas.shape, generator=g)).sum()
    ).backward()
    assert torch.equal(m1["radii"], meta["radii"])
    torch.testing.assert_close(c1, colors.detach(), rtol=1e-3, atol=1e-4)
    for key, leaf in list(leaves.items()) + [("Ks", Kr)]:
        ref = torch.where(torch.isfinite(leaf.grad), leaf.grad, 0.0)  # 0 * NaN of exp / sigmoid (see above)
        scale = ref.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(g1[key] / scale, ref / scale, rtol=1e-3, atol=1e-4, msg=key)


def test_fused_preparation_is_fewer_aten_ops(monkeypatch):
    """The point of it: the glue's and activations' aten ops are gone (each an encode on MPS)."""
    params, viewmats, Ks = _params(1, seed=1, poison="none")
    counts = {}
    for fused in (True, False):
        with step_ledger.count(str(fused)) as led:
            _render(params, viewmats, Ks, 3, True, False, fused, monkeypatch)
        counts[fused] = led.aten_dispatches
    assert counts[True] + 30 < counts[False], counts


def test_a_viewmat_gradient_keeps_the_unfused_path():
    """A camera pose with a gradient (splatfacto's camera optimizer) flows through inv(viewmat): unfused."""
    params, viewmats, Ks = _params(1, seed=2, poison="none")
    viewmats = viewmats.clone().requires_grad_()
    colors, _, _ = rasterization_metal(
        params["means"], params["quats"], params["log_scales"], params["logit_opacities"], params["features_dc"],
        viewmats, Ks, W, H, sh_degree=3, scales_are_log=True, opacities_are_logits=True,
        colors_rest=params["features_rest"],
    )  # fmt: skip
    colors.sum().backward()
    assert viewmats.grad is not None and viewmats.grad.abs().sum() > 0


@pytest.mark.parametrize("degree,mode", [(3, "classic"), (1, "antialiased"), (0, "classic"), (4, "antialiased")])
def test_self_check_of_the_fused_preparation_passes(degree, mode):
    """verify/kernel_checks.prepare_checks (the self-check's, stage outputs weighted directly: also the
    gradient of the composited opacity of a gaussian projection culled, which the rasterizer never gives)."""
    from splat_metal_method.verify.kernel_checks import prepare_checks

    checks = prepare_checks(torch.device("cpu"), degree, mode)
    assert len(checks) == 2 and all(c.ok for c in checks), [c.describe() for c in checks]


def test_stage_gradients_of_culled_gaussians_match_the_glue():
    """project_and_shade's outputs weighted directly (as the self-check does), with gaussians the glue culls
    (NaN / Inf values, a colour past float32 from finite coefficients) and ones only projection culls (out
    of view): both have opacity 0 and no gradient through it (whatever culled it), as in the unfused path."""
    from splat_metal_method.ops import reference
    from splat_metal_method.ops.rasterization import _project_and_cull

    params, viewmats, Ks = _params(1, seed=6, poison="gaussians", degree=3)
    campos = torch.linalg.inv(viewmats[0])[:3, 3]
    params["means"][11] = campos * 2  # behind the camera (it looks at the origin): projection culls it
    # finite coefficients whose colour is past float32: every term of the sum positive, each near float32's max
    signs = reference.sh_bases(3, torch.nn.functional.normalize(params["means"][15] - campos, dim=0)).sign()  # [16]
    params["features_dc"][15] = 3.0e38 * signs[0]
    params["features_rest"][15, :15] = 3.0e38 * signs[1:, None]
    results = {}
    for which in ("metal", "glue"):
        x = {k: v.clone().requires_grad_() for k, v in params.items()}
        if which == "metal":
            out = metal.project_and_shade(x["means"], x["quats"], x["log_scales"], x["logit_opacities"],
                                          x["features_dc"], x["features_rest"], viewmats, Ks, W, H, 0.3, 0.01,
                                          1e10, 0.0, False, 3, True, True)  # fmt: skip
        else:
            out = _project_and_cull(reference, x["means"], x["quats"], torch.exp(x["log_scales"]),
                                    torch.sigmoid(x["logit_opacities"])[:, 0],
                                    torch.cat((x["features_dc"][:, None], x["features_rest"]), dim=1), viewmats, Ks,
                                    W, H, 0.3, 0.01, 1e10, 0.0, "classic", 3)  # fmt: skip
        g = torch.Generator().manual_seed(3)
        sum((o * torch.randn(o.shape, generator=g)).sum() for o in out if o.is_floating_point()).backward()
        results[which] = (out, {k: v.grad for k, v in x.items()})
    (out1, g1), (out0, g0) = results["metal"], results["glue"]
    assert torch.equal(out1[0], out0[0]) and (out1[0][:, 11] == 0).all()
    torch.testing.assert_close(out1[4], out0[4], rtol=1e-6, atol=1e-7)  # opacities: 0 wherever radius is 0
    # 7 (a NaN scale) and 11 are culled by projection, 3, 5, 9 (opacity, SH coefficients) by the glue
    assert (out1[4][:, [3, 5, 7, 9, 11]] == 0).all() and (g1["logit_opacities"][[3, 5, 7, 9, 11]] == 0).all()
    assert (out1[0][:, 13] > 0).all()  # a NaN beyond the bands in use: kept
    assert (out1[0][:, 15] == 0).all() and (g1["features_dc"][15] == 0).all()  # its colour overflowed: culled
    assert all(torch.isfinite(g).all() for k, g in g1.items() if k != "features_rest")
    for key, g in g0.items():
        g = torch.where(torch.isfinite(g), g, 0.0)
        scale = g.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(g1[key] / scale, g / scale, rtol=1e-4, atol=1e-5, msg=key)


# ------------------------------------------------------------------------------------------------
# The one kernel each way (project_fwd / project_bwd with PROJECT_SHADE) against its unfused twin
# (project_fwd, then sh.metal's sh_fused_fwd; sh_bwd.metal's sh_fused_bwd, then project_bwd): the same
# arithmetic in the same order (sh.h splat_sh_color / splat_sh_color_bwd, common.h
# splat_camera_position), so every output and every gradient is compared bit for bit.
# ------------------------------------------------------------------------------------------------
def _prepare(params, viewmats, Ks, width, height, degree, antialiased, camera_grad, shade_in_projection):
    x = {k: v.clone().requires_grad_() for k, v in params.items()}
    vm, Kr = viewmats.clone().requires_grad_(camera_grad), Ks.clone().requires_grad_(camera_grad)
    out = metal.project_and_shade(x["means"], x["quats"], x["log_scales"], x["logit_opacities"], x["features_dc"],
                                  x["features_rest"], vm, Kr, width, height, 0.3, 0.01, 1e10, 0.0, antialiased, degree,
                                  True, True, shade_in_projection=shade_in_projection)  # fmt: skip
    g = torch.Generator().manual_seed(5)
    sum((o * torch.randn(o.shape, generator=g)).sum() for o in out if o.is_floating_point()).backward()
    grads = {k: v.grad for k, v in x.items()}
    if camera_grad:
        grads.update(viewmats=vm.grad, Ks=Kr.grad)
    return [o.detach() for o in out], grads


def _assert_same_as_twin(fused, twin):
    (out1, g1), (out0, g0) = fused, twin
    for name, a, b in zip(("radii", "means2d", "depths", "conics", "opacities", "colors"), out1, out0):
        assert torch.equal(a, b), f"forward {name} differs from the twin's"
    assert g1.keys() == g0.keys()
    for key in g0:
        assert torch.equal(g1[key], g0[key]), f"gradient of {key} differs from the twin's"


TWIN_CASES = [  # (C, width, height, degree, antialiased, camera_grad): non-square and partial-tile grids
    (1, 40, 24, 0, False, False), (2, 23, 37, 1, True, True), (1, 64, 17, 2, False, True),
    (3, 33, 33, 3, True, False), (2, 96, 64, 4, False, True), (1, 17, 50, 4, True, False),
]  # fmt: skip


@pytest.mark.parametrize("C,width,height,degree,antialiased,camera_grad", TWIN_CASES)
def test_one_kernel_each_way_matches_its_unfused_twin(C, width, height, degree, antialiased, camera_grad):
    params, viewmats, Ks = _params(
        C, seed=width + degree, poison="gaussians", degree=degree, width=width, height=height
    )
    fused = _prepare(params, viewmats, Ks, width, height, degree, antialiased, camera_grad, True)
    twin = _prepare(params, viewmats, Ks, width, height, degree, antialiased, camera_grad, False)
    radii = fused[0][0]
    assert (radii > 0).sum() > 10 and (radii[:, [3, 5, 7, 9]] == 0).all()  # kept ones, and the poisoned culled
    _assert_same_as_twin(fused, twin)
    if camera_grad:
        assert fused[1]["viewmats"].abs().sum() > 0 and fused[1]["Ks"].abs().sum() > 0


def test_one_kernel_each_way_reads_each_coefficient_once():
    """The point of it: one launch each way, and the SH coefficients bound once each way (the twin binds them
    twice forward), the directions' gradient never written."""
    params, viewmats, Ks = _params(1, seed=3, poison="none", degree=3)
    launches, sh_bytes = {}, {}
    for shade in (True, False):
        with step_ledger.count(str(shade)) as led:
            _prepare(params, viewmats, Ks, W, H, 3, False, False, shade)
        launches[shade] = {k: w.launches for k, w in led.kernels.items()}
        sh_bytes[shade] = led.kernel_total().buffer_bytes
    assert launches[True] == {"project_fwd": 1, "project_bwd": 1}, launches
    assert launches[False] == {"project_fwd": 1, "sh_fused_fwd": 1, "sh_fused_bwd": 1, "project_bwd": 1}, launches
    coeff_bytes = 4 * (params["features_dc"].numel() + params["features_rest"].numel())
    assert sh_bytes[False] - sh_bytes[True] >= coeff_bytes, (sh_bytes, coeff_bytes)


PLANTED = {  # (file, line, planted line): wrong lines in the PROJECT_SHADE blocks, a colour cull left out
    "fwd_channel": ("project.metal", "colors[3 * idx + 1] = sh_activate(rgb[1] + 0.5f);",
                    "colors[3 * idx + 1] = sh_activate(rgb[2] + 0.5f);"),
    "fwd_direction": ("project.metal", "my - campos[1], mz - campos[2]", "my - campos[1], mz + campos[2]"),
    "fwd_no_cull": ("project.metal", "      return;  // a non-finite coefficient in use", "      ;  // planted: no cull"),
    "bwd_direction": ("project_bwd.metal", "m[1] - campos[1], m[2] - campos[2]", "m[1] - campos[1], m[2] + campos[2]"),
    "bwd_means": ("project_bwd.metal", "(shade ? v_m + v_sh[k] : v_m)", "(shade ? v_m - v_sh[k] : v_m)"),
}  # fmt: skip


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_the_twin_comparison_catches_a_planted_bug(bug, monkeypatch):
    """project.metal / project_bwd.metal with one planted bug in a PROJECT_SHADE block, run as prepare.py's
    forward / backward: the comparison above fails (so it can)."""
    from splat_metal_method.ops.metal import kernels, prepare, runtime

    stage, old, new = PLANTED[bug]
    if stage == "project.metal":
        src = kernels.stage_source(stage)
    else:
        group = prepare.project_bwd_library(torch.device("cpu"))[1]
        src = kernels.stage_source(stage, extra=(("SPLAT_PROJECT_BWD_GROUP", group),))
    assert src.count(old) == 1, f"{stage} changed: update the planted bug"
    planted = runtime.library_for("cpu", src.replace(old, new), name=stage)
    params, viewmats, Ks = _params(2, seed=1, poison="gaussians", degree=3, width=W, height=H)
    twin = _prepare(params, viewmats, Ks, W, H, 3, False, True, False)
    _assert_same_as_twin(_prepare(params, viewmats, Ks, W, H, 3, False, True, True), twin)  # the real one agrees
    if stage == "project.metal":
        monkeypatch.setattr(prepare, "project_library", lambda device: planted)
    else:
        monkeypatch.setattr(prepare, "project_bwd_library", lambda device: (planted, group))
    with pytest.raises(AssertionError, match="differs from the twin"):
        _assert_same_as_twin(_prepare(params, viewmats, Ks, W, H, 3, False, True, True), twin)

"""ops/metal/loss.metal (the fused L1 + SSIM training loss) against the reference (ssim.FusedSSIM + L1),
value and gradient in pred. Imports no nerfstudio (the ASan suite runs this file: test_emulator_asan.py);
SplatMetalModel.get_loss_dict against splatfacto's is tests/method/test_model_loss_dict.py."""

from __future__ import annotations

import pytest
import torch

from splat_metal_method.ops.loss import l1_ssim_loss, l1_ssim_loss_reference
from splat_metal_method.ops.metal import runtime

SHAPES = {  # [H, W, C] or [B, H, W, C]
    "48x64": (48, 64, 3),
    "odd-37x23": (37, 23, 3),
    "window-11x11": (11, 11, 3),
    "window+1-12x29": (12, 29, 3),
    "blocks+1-17x33": (17, 33, 3),
    "batch-2x21x15": (2, 21, 15, 3),
    "one-channel-30x19": (30, 19, 1),
}


def images(shape, seed):
    g = torch.Generator().manual_seed(seed)
    gt = torch.rand(shape, generator=g)
    pred = (gt + 0.2 * torch.randn(shape, generator=g)).clamp(0, 1)  # correlated, as a render and its photo
    return pred, gt


def loss_and_grad(pred, gt, ssim_lambda, backend):
    pred = pred.clone().requires_grad_(True)
    if backend == "reference":
        loss, l1, ssim = l1_ssim_loss_reference(pred, gt, ssim_lambda)
    else:
        loss, l1, ssim = l1_ssim_loss(pred, gt, ssim_lambda, backend)
    (grad,) = torch.autograd.grad(loss, pred)
    return loss.detach(), l1.detach(), ssim.detach(), grad


def assert_matches(ours, ref):
    """Float32 rounding apart: values to 1e-5 relative (SSIM, which can be near 0, to 1e-6 absolute), the
    gradient to 1e-5 of its largest entry."""
    loss, l1, ssim, grad = ours
    r_loss, r_l1, r_ssim, r_grad = ref
    torch.testing.assert_close(loss, r_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(l1, r_l1, rtol=1e-5, atol=0)
    torch.testing.assert_close(ssim, r_ssim, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, r_grad, rtol=1e-5, atol=1e-5 * float(r_grad.abs().max()))


@pytest.mark.parametrize("ssim_lambda", [0.0, 0.2, 1.0])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_metal_loss_equals_reference(shape, ssim_lambda):
    pred, gt = images(shape, seed=len(shape) * 100 + shape[-2])
    runtime.reset_launch_counts()
    ours = loss_and_grad(pred, gt, ssim_lambda, "metal")
    assert runtime.launch_counts() == {"l1_ssim_fwd": 1, "l1_ssim_reduce": 1, "l1_ssim_bwd": 1}
    ref = loss_and_grad(pred, gt, ssim_lambda, "reference")
    assert 0.05 < float(ref[2]) < 0.95 and ref[3].abs().max() > 0  # a real comparison
    assert_matches(ours, ref)


def test_planted_errors_fail_the_comparison():
    pred, gt = images((23, 31, 3), seed=3)
    ours, ref = loss_and_grad(pred, gt, 0.2, "metal"), loss_and_grad(pred, gt, 0.2, "reference")
    assert_matches(ours, ref)
    loss, l1, ssim, grad = ours
    # lambda off by 1e-3 changes the loss by ~1e-4 relative
    off_lambda = loss_and_grad(pred, gt, 0.2002, "metal")
    with pytest.raises(AssertionError):
        assert_matches(off_lambda, ref)
    for planted in (
        (loss * (1 + 1e-4), l1, ssim, grad),
        (loss, l1, ssim + 1e-5, grad),
        (loss, l1, ssim, grad.index_put((torch.tensor(11), torch.tensor(7), torch.tensor(1)), grad[11, 7, 1] * 1.01)),
        (loss, l1, ssim, grad.flip(0)),
    ):
        with pytest.raises(AssertionError):
            assert_matches(planted, ref)


def test_what_the_kernels_do_not_cover_runs_the_reference():
    runtime.reset_launch_counts()
    for shape in [(10, 40, 3), (40, 10, 3)]:  # shorter than the window along one axis
        pred, gt = images(shape, seed=5)
        assert_matches(loss_and_grad(pred, gt, 0.2, "metal"), loss_and_grad(pred, gt, 0.2, "reference"))
    pred, gt = images((20, 20, 3), seed=6)
    pred64, gt64 = pred.double(), gt.double()
    ours = loss_and_grad(pred64, gt64, 0.2, "metal")
    assert ours[0].dtype == torch.float64
    assert runtime.launch_counts() == {}
    with pytest.raises(ValueError, match="l1_ssim_loss"):
        l1_ssim_loss(pred, gt[:-1], 0.2, "metal")


def test_gradient_of_the_loss_scales_with_the_incoming_gradient():
    pred, gt = images((19, 26, 3), seed=7)
    pred = pred.requires_grad_(True)
    loss, _, _ = l1_ssim_loss(pred, gt, 0.2, "metal")
    (g1,) = torch.autograd.grad(loss, pred, retain_graph=True)
    (g3,) = torch.autograd.grad(-3.0 * loss, pred)
    torch.testing.assert_close(g3, -3.0 * g1, rtol=1e-6, atol=0)


def test_the_self_check_verifies_the_loss_and_a_failed_check_falls_back(monkeypatch):
    """The loss kernels' check (kernel_checks.loss_checks, run by the doctor and the self-check) passes,
    catches a planted wrong backward, and once the stage "loss" failed (the self-check's verdict on a GPU) l1_ssim_loss runs the reference."""
    from splat_metal_method.ops import stage_fallback
    from splat_metal_method.ops.metal import loss as metal_loss
    from splat_metal_method.verify import kernel_checks

    checks = kernel_checks.loss_checks(torch.device("cpu"))
    assert [c.direction for c in checks] == ["forward", "backward"] and all(c.ok for c in checks), checks
    assert {stage_fallback.stage_of(c.stage) for c in checks} == {"loss"}
    wrong_bwd = metal_loss.l1_ssim_bwd
    monkeypatch.setattr(metal_loss, "l1_ssim_bwd", lambda *a: wrong_bwd(*a) * 1.01)  # a backward 1% off
    assert [c.ok for c in kernel_checks.loss_checks(torch.device("cpu"))] == [True, False]
    monkeypatch.undo()

    pred, gt = images((20, 20, 3), seed=8)
    monkeypatch.setattr(stage_fallback, "_failed", {"loss"})
    runtime.reset_launch_counts()
    fallback = loss_and_grad(pred, gt, 0.2, "metal")
    assert runtime.launch_counts() == {}
    assert_matches(fallback, loss_and_grad(pred, gt, 0.2, "reference"))


@pytest.mark.parametrize("backend", ["metal", "reference"])
def test_loss_without_stats_is_the_same_loss_in_fewer_allocations(backend):
    """stats=False (the training step's call): l1 and ssim are None, the loss and its gradient the same
    bits, and on the metal kernels two allocations fewer (the per-group sums live in a workspace buffer)."""
    from splat_metal_method.bench import step_ledger

    pred, gt = images((19, 26, 3), seed=9)
    l1_ssim_loss(pred, gt, 0.2, backend)  # the workspace buffer for the sums, as after a first training step
    counted, out = {}, {}
    for stats in (True, False):
        p = pred.clone().requires_grad_(True)
        with step_ledger.count(str(stats)) as led:
            loss, l1, ssim = l1_ssim_loss(p, gt, 0.2, backend, stats=stats)
            (grad,) = torch.autograd.grad(loss, p)
        counted[stats], out[stats] = led, (loss.detach(), grad, l1, ssim)
    assert out[False][2] is None and out[False][3] is None and out[True][2] is not None
    torch.testing.assert_close(out[False][0], out[True][0], rtol=0, atol=0)
    torch.testing.assert_close(out[False][1], out[True][1], rtol=0, atol=0)
    if backend == "metal":
        assert counted[False].aten_allocations == counted[True].aten_allocations - 2
        assert counted[False].kernel_launches == counted[True].kernel_launches == 3

"""SplatMetalModel.get_loss_dict (the fused L1 + SSIM loss of ops/loss.py, scale_reg's zero made on the device)
against splatfacto's own get_loss_dict with its pytorch_msssim SSIM: same keys, values and gradients."""

from __future__ import annotations

import pytest
import pytorch_msssim
import torch
from aten_counter import AtenCounter
from nerfstudio.cameras.camera_optimizers import CameraOptimizerConfig
from nerfstudio.data.scene_box import SceneBox
from nerfstudio.models.splatfacto import SplatfactoModel

from splat_metal_method.method.model import SplatMetalModelConfig
from splat_metal_method.ops.metal import runtime


def small_model(scale_regularization: bool):
    gen = torch.Generator().manual_seed(1)
    means, colors = torch.rand(50, 3, generator=gen) - 0.5, (torch.rand(50, 3, generator=gen) * 255).to(torch.uint8)
    config = SplatMetalModelConfig(backend="metal", background_color="random",
                                   camera_optimizer=CameraOptimizerConfig(mode="SO3xR3"),
                                   use_scale_regularization=scale_regularization)  # fmt: skip
    model = config.setup(scene_box=SceneBox(aabb=torch.tensor([[-1.0, -1, -1], [1, 1, 1]])), num_train_data=2,
                         metadata={}, seed_points=(means, colors))  # fmt: skip
    model.config.num_downscales = 0
    with torch.no_grad():
        model.gauss_params["scales"].copy_(torch.randn(50, 3, generator=gen))  # some ratios above max_gauss_ratio
        for p in model.camera_optimizer.parameters():
            p.copy_(0.01 * torch.randn(p.shape, generator=gen))
    return model.train()


@pytest.mark.parametrize("scale_regularization, step", [(False, 10), (True, 10), (True, 11)],
                         ids=["no-scale-reg", "scale-reg-step", "scale-reg-off-step"])  # fmt: skip
@pytest.mark.parametrize("with_mask", [False, True], ids=["no-mask", "mask"])
def test_model_loss_dict_equals_splatfactos(scale_regularization, step, with_mask):
    torch.manual_seed(0)  # the random background
    model = small_model(scale_regularization)
    model.step = step
    H, W = 30, 41
    g = torch.Generator().manual_seed(2)
    pred = torch.rand(H, W, 3, generator=g)
    batch = {"image": (torch.rand(H, W, 4, generator=g) * 255).to(torch.uint8)}  # RGBA: composited on background
    if with_mask:
        batch["mask"] = torch.rand(H, W, 1, generator=g) > 0.3

    def run(get_loss_dict):
        rgb = pred.clone().requires_grad_(True)
        outputs = {"rgb": rgb, "background": torch.rand(3, generator=torch.Generator().manual_seed(4))}
        runtime.reset_launch_counts()
        losses = get_loss_dict(model, outputs, batch)
        launches = runtime.launch_counts()
        params = [rgb, model.gauss_params["scales"], *model.camera_optimizer.parameters()]
        grads = torch.autograd.grad(sum(losses.values()), params, allow_unused=True)
        return {k: v.detach() for k, v in losses.items()}, grads, launches

    ours, our_grads, launches = run(type(model).get_loss_dict)
    assert launches.get("l1_ssim_fwd") == 1 and launches.get("l1_ssim_bwd") is None  # backward not yet run
    model.ssim = pytorch_msssim.SSIM(data_range=1.0, size_average=True, channel=3)  # splatfacto's own SSIM
    theirs, their_grads, _ = run(SplatfactoModel.get_loss_dict)
    assert set(ours) == set(theirs) == {"main_loss", "scale_reg", "camera_opt_regularizer"}
    for k in theirs:
        assert ours[k].shape == theirs[k].shape and ours[k].device == theirs[k].device, k
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-5, atol=1e-7, msg=k)
    assert (float(theirs["scale_reg"]) > 0) == (scale_regularization and step % 10 == 0)
    for ours_g, theirs_g in zip(our_grads, their_grads):
        if theirs_g is None:
            assert ours_g is None or not ours_g.any()
            continue
        torch.testing.assert_close(ours_g, theirs_g, rtol=1e-5, atol=1e-5 * float(theirs_g.abs().max()))
    assert our_grads[0].abs().max() > 0


def test_gt_img_is_splatfactos_in_one_dispatch():
    """get_gt_img converts a uint8 image once per batch image, with one aten division (not a copy, then a division) to the very
    bits of splatfacto's image.float() / 255.0, and passes float images through as splatfacto does."""
    model = small_model(False)
    image = torch.arange(256, dtype=torch.uint8).repeat(3 * 41)[: 30 * 41 * 3].reshape(30, 41, 3)  # every value
    with AtenCounter() as mode:
        ours = model.get_gt_img(image)
        again = model.get_gt_img(image)  # get_loss_dict's call after get_metrics_dict's: the cached image
    assert mode.ops == ["aten.div.Tensor"] and again is ours, mode.ops
    theirs = SplatfactoModel.get_gt_img(model, image)
    assert ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
    floats = torch.rand(30, 41, 3)
    assert torch.equal(model.get_gt_img(floats), SplatfactoModel.get_gt_img(model, floats))

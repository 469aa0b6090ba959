"""model.py's camera helpers built on the device equal nerfstudio's: viewmat_from_c2w vs splatfacto's
get_viewmat (values and gradients), intrinsics vs Cameras.rescale_output_resolution +
get_intrinsics_matrices, with the training size as ``size // scale``."""

from __future__ import annotations

import pytest
import torch
from nerfstudio.cameras.cameras import Cameras
from nerfstudio.models.splatfacto import get_viewmat

from splat_metal_method.method.model import intrinsics, viewmat_from_c2w


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


# --------------------------------------------------------------------------------------------------
# One Cameras per training image (datamanager.py) and the viewmat/K made once per camera (model.py)
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """splat-metal's pipeline (tests/pipelines.py: SO3xR3 camera optimizer, white background) on a
    40x28 demo scene of 10 views, reference backend."""
    import pipelines

    from splat_metal_method.data import demo_scene

    data = tmp_path_factory.mktemp("camera") / "demo"
    demo_scene.generate(data, width=40, height=28, views=10, seed=0)
    from nerfstudio.engine.callbacks import TrainingCallbackLocation

    pipe, _, callbacks = pipelines.make_pipeline(data, backend="reference")
    pipe.train()
    for cb in callbacks:  # what a training step starts with (splatfacto hands the model its optimizers)
        cb.run_callback_at_location(0, TrainingCallbackLocation.BEFORE_TRAIN_ITERATION)
    return pipe


def _fields(camera: Cameras) -> dict:
    return {k: v for k, v in vars(camera).items() if isinstance(v, torch.Tensor)}


def test_next_train_gives_nerfstudios_cameras_and_images_in_the_same_order(pipeline):
    from nerfstudio.data.datamanagers.full_images_datamanager import FullImageDatamanager

    dm = pipeline.datamanager
    n = len(dm.train_unseen_cameras) - 1  # without re-drawing the queue
    queue = list(dm.train_unseen_cameras)
    ours = [dm.next_train(s) for s in range(n)]
    dm.train_unseen_cameras = list(queue)
    theirs = [FullImageDatamanager.next_train(dm, s) for s in range(n)]
    assert [c.metadata for c, _ in ours] == [c.metadata for c, _ in theirs] == [{"cam_idx": i} for i in queue[:n]]
    for (a, da), (b, db) in zip(ours, theirs):
        assert a.shape == b.shape == (1,) and torch.equal(da["image"], db["image"])
        fa, fb = _fields(a), _fields(b)
        assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa), (fa, fb)


def test_a_training_camera_is_made_once_and_again_after_a_field_is_replaced(pipeline):
    dm = pipeline.datamanager
    camera = dm.train_camera(1)
    camera.metadata["extra"] = 1  # metadata is new each time, as nerfstudio's is
    assert dm.train_camera(1) is camera and camera.metadata == {"cam_idx": 1}
    fx = camera.fx.clone()
    camera.rescale_output_resolution(0.5)  # replaces fx, fy, cx, cy, width, height
    again = dm.train_camera(1)
    assert again is not camera and torch.equal(again.fx, fx) and torch.equal(again.fx, dm.train_cameras.fx[1:2])


def _render_and_grads(model, camera):
    """Training render of ``camera`` and the gradients of a fixed weighting of it: to means, and to the
    camera optimizer's pose adjustment (None when it is off)."""
    params = [model.gauss_params["means"], model.camera_optimizer.pose_adjustment]
    for p in params:
        p.grad = None
    rgb = model.get_outputs(camera)["rgb"]
    weights = torch.linspace(-1, 1, rgb.numel()).reshape(rgb.shape)
    (rgb * weights).sum().backward()
    return rgb.detach(), [None if p.grad is None else p.grad.clone() for p in params]


def test_cached_camera_matrices_give_the_same_render_and_gradients(pipeline):
    model, dm = pipeline.model, pipeline.datamanager
    model._camera_matrices.clear()
    camera = dm.train_camera(2)
    # the camera optimizer on: camera_to_world has a gradient, so nothing is cached; poses get gradients
    assert model.camera_optimizer.config.mode == "SO3xR3"
    first, (g_means, g_pose) = _render_and_grads(model, camera)
    again, (g_means2, g_pose2) = _render_and_grads(model, camera)
    assert model._camera_matrices == {} and g_pose is not None and g_pose.abs().sum() > 0
    assert torch.equal(first, again) and torch.equal(g_means, g_means2) and torch.equal(g_pose, g_pose2)
    model.camera_optimizer.config.mode = "off"
    try:
        built, (g_built, _) = _render_and_grads(model, camera)  # builds and caches
        assert 2 in model._camera_matrices
        cached, (g_cached, g_none) = _render_and_grads(model, camera)  # reuses
        assert torch.equal(built, first) and torch.equal(cached, built) and torch.equal(g_cached, g_built)
        assert g_none is None
        with torch.no_grad():  # an in-place edit of the camera's pose: the cache sees the version change
            camera.camera_to_worlds[..., 3] += 0.05
        moved, _ = _render_and_grads(model, camera)
        model._camera_matrices.clear()
        fresh, _ = _render_and_grads(model, camera)
        assert torch.equal(moved, fresh) and not torch.equal(moved, built)
    finally:
        model.camera_optimizer.config.mode = "SO3xR3"
        with torch.no_grad():
            camera.camera_to_worlds[..., 3] -= 0.05


def test_training_camera_sizes_come_from_the_host_cameras_never_the_device(pipeline):
    """Each training camera's size is read from the dataset's host cameras the first time the camera is
    handed out (by then nerfstudio has undistorted its image and rewritten that camera:
    test_distorted_capture.py), never from the device; then cached per camera object, so steady steps
    read nothing; a new camera object for the same image is read again."""
    from splat_metal_method.bench import step_ledger

    model, dm = pipeline.model, pipeline.datamanager
    cameras = dm.train_dataset.cameras
    model._train_sizes.clear()
    for i in range(len(cameras)):
        camera = dm.train_camera(i)
        with step_ledger.count("first", host_tensors=[cameras.width, cameras.height]) as led:
            size = model._train_camera_size(camera)
        assert size == (int(camera.width.max()), int(camera.height.max()))
        assert led.host_syncs == 0, led.host_reads
        with step_ledger.count("size") as led:
            assert model._train_camera_size(camera) == size
        assert led.host_syncs == 0 and led.aten_dispatches == 0, led.host_reads
    fresh = dm.train_cameras[0:1]  # the same image, a new Cameras object
    fresh.metadata = {"cam_idx": 0}
    assert model._train_camera_size(fresh) == model._train_sizes[0][2] and model._train_sizes[0][0] is fresh.width

"""The bundled demo scene: deterministic, loadable by nerfstudio's own dataparser, and consistent
end to end with the camera conventions splatfacto uses (re-rendered through nerfstudio's cameras)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from splat_metal_method.data import demo_scene
from splat_metal_method.ops.reference import quat_to_rotmat

VIEWS, WIDTH, HEIGHT, SEED = 32, 96, 64, 0


@pytest.fixture(scope="module")
def scene(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    stats = demo_scene.generate(out, width=WIDTH, height=HEIGHT, views=VIEWS, seed=SEED)
    assert (stats.n_views, stats.width, stats.height) == (VIEWS, WIDTH, HEIGHT)
    assert stats.seconds < 60, f"generation took {stats.seconds:.1f} s; it should take a few seconds"
    return out


@pytest.fixture(scope="module")
def parsed(scene):
    """nerfstudio's nerfstudio-data dataparser, as splatfacto configures it (load_3D_points=True)."""
    try:
        import open3d  # noqa: F401  (the dataparser imports it to read the seed points)
    except ImportError as e:  # a real failure: training on the demo scene would fail the same way
        pytest.fail(f"open3d cannot be imported ({e}); on Debian it needs the system package libusb-1.0-0")
    from nerfstudio.data.dataparsers.nerfstudio_dataparser import NerfstudioDataParserConfig

    parser = NerfstudioDataParserConfig(data=scene, load_3D_points=True).setup()
    return parser.get_dataparser_outputs("train"), parser.get_dataparser_outputs("test")


def _files(root: Path):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _image(path) -> np.ndarray:
    with Image.open(path) as im:
        assert im.mode == "RGB", f"{path}: mode {im.mode}, expected RGB without alpha"
        return np.asarray(im)


def test_generation_is_deterministic(scene, tmp_path):
    again = demo_scene.generate(tmp_path / "again", width=WIDTH, height=HEIGHT, views=VIEWS, seed=SEED)
    first, second = _files(scene), _files(again.out)
    assert sorted(first) == sorted(second)
    assert len([f for f in first if f.startswith("images/")]) == VIEWS
    for name in first:
        assert first[name] == second[name], f"{name} differs between two runs with the same seed"

    # The seed matters (checked on the inputs of the render, which is the slow part).
    a, b = demo_scene.make_gaussians(SEED), demo_scene.make_gaussians(SEED + 1)
    assert not torch.equal(a["means"], b["means"]) and not torch.equal(a["colors"], b["colors"])
    assert not np.array_equal(demo_scene.make_cameras(VIEWS, WIDTH, HEIGHT, SEED)[0],
                              demo_scene.make_cameras(VIEWS, WIDTH, HEIGHT, SEED + 1)[0])  # fmt: skip


def test_transforms_json_format(scene):
    meta = json.loads((scene / "transforms.json").read_text())
    assert meta["camera_model"] == "OPENCV"
    assert (meta["w"], meta["h"]) == (WIDTH, HEIGHT)
    assert all(meta[k] == 0.0 for k in ("k1", "k2", "p1", "p2"))
    assert meta["ply_file_path"] == "sparse_pc.ply" and (scene / "sparse_pc.ply").is_file()
    assert [f["file_path"] for f in meta["frames"]] == [f"images/frame_{i:05d}.png" for i in range(VIEWS)]
    target = np.asarray(demo_scene.LOOK_AT)
    for frame in meta["frames"]:
        c2w = np.asarray(frame["transform_matrix"])
        assert c2w.shape == (4, 4)
        np.testing.assert_allclose(c2w[3], [0, 0, 0, 1])
        np.testing.assert_allclose(c2w[:3, :3] @ c2w[:3, :3].T, np.eye(3), atol=1e-6)
        assert np.linalg.det(c2w[:3, :3]) > 0
        # OpenGL convention: the camera looks down its -z axis, at the scene centre, with +y up.
        to_target = (target - c2w[:3, 3]) / np.linalg.norm(target - c2w[:3, 3])
        assert np.dot(-c2w[:3, 2], to_target) > 0.999
        assert c2w[2, 1] > 0.5  # camera +y points roughly along world +z (up)


def test_nerfstudio_dataparser_loads_scene(scene, parsed):
    train, test = parsed
    eval_frames = demo_scene.eval_indices(VIEWS)
    assert len(eval_frames) >= 3
    assert len(train.image_filenames) == VIEWS - len(eval_frames)
    assert [int(p.stem.split("_")[1]) for p in test.image_filenames] == eval_frames.tolist()
    meta = json.loads((scene / "transforms.json").read_text())
    for out in (train, test):
        cams = out.cameras
        assert cams.shape[0] == len(out.image_filenames)
        assert (cams.width == WIDTH).all() and (cams.height == HEIGHT).all()
        for key, value in (("fx", meta["fl_x"]), ("fy", meta["fl_y"]), ("cx", meta["cx"]), ("cy", meta["cy"])):
            torch.testing.assert_close(getattr(cams, key), torch.full_like(getattr(cams, key), value))
        for path in out.image_filenames:
            assert _image(path).shape == (HEIGHT, WIDTH, 3)  # non-square, as the cameras say

    # Seed points: what we wrote, moved by the same transform and scale as the poses.
    xyz, rgb = demo_scene.read_ply(scene / "sparse_pc.ply")
    assert 1000 <= len(xyz) <= 2000
    points, colors = train.metadata["points3D_xyz"], train.metadata["points3D_rgb"]
    T, s = train.dataparser_transform, train.dataparser_scale
    expected = (torch.from_numpy(xyz) @ T[:3, :3].T + T[:3, 3]) * s
    torch.testing.assert_close(points, expected, atol=1e-5, rtol=1e-5)
    assert colors.dtype == torch.uint8 and np.abs(colors.numpy().astype(int) - rgb).max() <= 1
    # Seed points and cameras share a frame: every camera sees most seed points in its image.
    from nerfstudio.models.splatfacto import get_viewmat

    viewmats, Ks = get_viewmat(train.cameras.camera_to_worlds), train.cameras.get_intrinsics_matrices()
    cam = points @ viewmats[:, :3, :3].transpose(1, 2) + viewmats[:, None, :3, 3]  # [C, P, 3]
    uv = (cam / cam[..., 2:]) @ Ks.transpose(1, 2)
    inside = (cam[..., 2] > 0) & (uv[..., 0] >= 0) & (uv[..., 0] < WIDTH) & (uv[..., 1] >= 0) & (uv[..., 1] < HEIGHT)
    assert inside.float().mean(dim=1).min() > 0.8


def test_splits_are_disjoint_and_non_empty(parsed):
    train, test = parsed
    a, b = set(train.image_filenames), set(test.image_filenames)
    assert a and b and not (a & b)
    assert len(a | b) == VIEWS


def test_images_have_content_and_differ_between_views(scene):
    images = np.stack([_image(scene / demo_scene.frame_name(i)) for i in range(VIEWS)]).astype(np.float32)
    background = np.asarray(demo_scene.BACKGROUND, dtype=np.float32) * 255
    for i, im in enumerate(images):
        covered = np.abs(im - background).max(-1) > 8
        assert 0.25 < covered.mean() < 0.95, f"frame {i}: {covered.mean():.0%} of pixels show the scene"
        assert im[covered].std() > 25, f"frame {i} is nearly uniform"
        assert len(np.unique(im.reshape(-1, 3) // 32, axis=0)) > 10, f"frame {i} has too few colours"
    neighbour_diff = np.abs(images - np.roll(images, 1, axis=0)).mean(axis=(1, 2, 3))
    assert neighbour_diff.min() > 5, f"consecutive views too similar: {neighbour_diff.min():.1f}"


def _gaussians_in_dataparser_frame(gaussians, transform, scale):
    """Applies the dataparser's similarity transform (x -> s (R x + t)) to the gt gaussians."""
    R, t = transform[:3, :3].double(), transform[:3, 3].double()
    rot = R @ quat_to_rotmat(gaussians["quats"].double())  # [N, 3, 3]
    return {
        "means": ((gaussians["means"].double() @ R.T + t) * scale).float(),
        "quats": torch.from_numpy(demo_scene._rotmat_to_quat(rot.numpy())).float(),
        "scales": gaussians["scales"] * scale,
        "opacities": gaussians["opacities"],
        "colors": gaussians["colors"],
    }


def test_rerender_through_nerfstudio_cameras_matches_pngs(scene, parsed):
    """Proves the pose conventions end to end: gt gaussians moved into the dataparser's frame and
    rendered through the cameras nerfstudio hands splatfacto (its own get_viewmat) reproduce the
    saved images within quantisation."""
    from nerfstudio.models.splatfacto import get_viewmat

    train, test = parsed
    T = train.dataparser_transform
    assert torch.allclose(T[:3, :3] @ T[:3, :3].T, torch.eye(3), atol=1e-5)
    assert not torch.allclose(T, torch.eye(4)[:3]) and train.dataparser_scale != 1.0  # the check has teeth
    gaussians = _gaussians_in_dataparser_frame(demo_scene.make_gaussians(SEED), T, train.dataparser_scale)

    picks = [(test, i) for i in range(len(test.image_filenames))] + [(train, 0), (train, 7)]
    c2w = torch.stack([out.cameras.camera_to_worlds[i] for out, i in picks])  # [C, 3, 4]
    Ks = torch.stack([out.cameras.get_intrinsics_matrices()[i] for out, i in picks])  # [C, 3, 3]
    saved = np.stack([_image(out.image_filenames[i]) for out, i in picks]).astype(int)

    rendered = demo_scene.to_uint8(demo_scene.render(gaussians, get_viewmat(c2w), Ks, WIDTH, HEIGHT)).astype(int)
    diff = np.abs(rendered - saved)
    assert diff.mean() < 0.01 and (diff > 1).mean() < 1e-3 and diff.max() <= 4, (
        f"re-render differs: mean {diff.mean():.3f}, >1 on {(diff > 1).mean():.2%}, max {diff.max()}"
    )

    # A wrong convention (no y/z flip: OpenGL pose used as if it were OpenCV) must fail loudly.
    full = torch.cat([c2w, torch.tensor([0.0, 0, 0, 1]).expand(len(picks), 1, 4)], dim=1)
    wrong = demo_scene.to_uint8(demo_scene.render(gaussians, torch.linalg.inv(full), Ks, WIDTH, HEIGHT)).astype(int)
    assert np.abs(wrong - saved).mean() > 20


def test_refuses_to_overwrite_other_directories(tmp_path, capsys):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="does not look like a demo scene"):
        demo_scene.generate(foreign, views=12)
    assert demo_scene.main(["--out", str(foreign), "--views", "12"]) == 2
    assert "refusing" in capsys.readouterr().err
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"] and (foreign / "notes.txt").read_text() == "keep me"

    not_ours = tmp_path / "other_dataset"
    not_ours.mkdir()
    (not_ours / "transforms.json").write_text(json.dumps({"frames": []}))
    with pytest.raises(FileExistsError):
        demo_scene.generate(not_ours, views=12)


def test_regenerating_a_demo_directory_replaces_it(tmp_path):
    out = tmp_path / "demo"
    demo_scene.generate(out, width=32, height=24, views=14, seed=3)
    stats = demo_scene.main(["--out", str(out), "--width", "40", "--height", "24", "--views", "10", "--seed", "3"])
    assert stats == 0
    frames = sorted(p.name for p in (out / "images").iterdir())
    assert frames == [f"frame_{i:05d}.png" for i in range(10)]  # no stale frames from the first run
    meta = json.loads((out / "transforms.json").read_text())
    assert (meta["w"], meta["h"], len(meta["frames"])) == (40, 24, 10)
    assert _image(out / "images" / frames[0]).shape == (24, 40, 3)


def test_rejects_too_few_views(tmp_path):
    with pytest.raises(ValueError, match="no held-out image"):
        demo_scene.generate(tmp_path / "few", views=9)
    assert not (tmp_path / "few").exists()

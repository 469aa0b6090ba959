"""`ns-export gaussian-splat` as users run it, and a round trip through the PLY it writes.

The PLY is read with plyfile and open3d; its contents are turned back into a SplatMetalModel by the
inverse of nerfstudio 1.1.5's exporter (scripts/exporter.py ExportGaussianSplat: positions, zero
normals, f_dc_*, f_rest_* in the Inria order = SH rest transposed to [N, 3, K-1] and flattened,
opacity logits, log-scales, raw quaternions; gaussians with non-finite values or opacity below
1/255 are dropped). Rendering the same cameras with the checkpoint's model and the PLY's model must
agree within 1e-5, for SH degree 3 and SH degree 0.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Dict

import demo_runs
import numpy as np
import pytest
import torch
import yaml
from nerfstudio.models.splatfacto import RGB2SH, SH2RGB

pytestmark = pytest.mark.timeout(900)

TOL = 1e-5
LOW_OPACITY_LOGIT = -5.5373  # the exporter's cut: logit(1/255)


def _inria_names(n_rest: int):
    return (["x", "y", "z", "nx", "ny", "nz", "f_dc_0", "f_dc_1", "f_dc_2"]
            + [f"f_rest_{i}" for i in range(n_rest)]
            + ["opacity", "scale_0", "scale_1", "scale_2", "rot_0", "rot_1", "rot_2", "rot_3"])  # fmt: skip


def read_splat_ply(path: Path, inria_rest_order: bool = True) -> Dict[str, np.ndarray]:
    """The inverse of ExportGaussianSplat: gauss_params arrays from a PLY. ``inria_rest_order=False``
    reads f_rest_* in the wrong (untransposed) order; the tests use it to show they would notice."""
    from plyfile import PlyData

    vertex = PlyData.read(str(path))["vertex"]
    names = [p.name for p in vertex.properties]
    col = lambda name: np.asarray(vertex[name], dtype=np.float32)  # noqa: E731
    n = len(vertex)
    n_rest = len([name for name in names if name.startswith("f_rest_")])
    assert n_rest % 3 == 0, f"{n_rest} f_rest fields is not 3 x (K-1)"
    rest = np.stack([col(f"f_rest_{i}") for i in range(n_rest)], axis=1) if n_rest else np.zeros((n, 0), np.float32)
    if inria_rest_order:
        rest = rest.reshape(n, 3, n_rest // 3).transpose(0, 2, 1)  # exporter: shs_rest.transpose(1, 2)
    else:
        rest = rest.reshape(n, n_rest // 3, 3)
    return {
        "means": np.stack([col("x"), col("y"), col("z")], axis=1),
        "features_dc": np.stack([col(f"f_dc_{i}") for i in range(3)], axis=1),
        "features_rest": np.ascontiguousarray(rest),
        "opacities": col("opacity")[:, None],
        "scales": np.stack([col(f"scale_{i}") for i in range(3)], axis=1),
        "quats": np.stack([col(f"rot_{i}") for i in range(4)], axis=1),
    }


def model_from_ply(template, params: Dict[str, np.ndarray], dc_as_stored: bool = False):
    """A copy of ``template`` whose gaussians are ``params`` (splatfacto's load_state_dict resizes the
    parameters, as when loading a checkpoint). The PLY's f_dc are DC SH coefficients (Inria convention)
    also for SH degree 0, where the exporter writes RGB2SH(sigmoid(features_dc)); the model stores
    sigmoid logits then, so they are converted back (``dc_as_stored=True`` skips that, for the tests'
    negative control)."""
    if template.config.sh_degree == 0 and not dc_as_stored:
        dc = torch.from_numpy(params["features_dc"])
        params = dict(params, features_dc=torch.logit(SH2RGB(dc)).numpy())
    model = copy.deepcopy(template)
    model.load_state_dict({f"gauss_params.{k}": torch.from_numpy(v) for k, v in params.items()}, strict=False)
    model.eval()
    return model


def _cameras(pipeline):
    """The held-out cameras (64x48) plus a wider novel view at another resolution (80x52)."""
    from nerfstudio.cameras.cameras import Cameras

    cams = pipeline.datamanager.eval_dataset.cameras
    train = pipeline.datamanager.train_dataset.cameras
    c2w = train.camera_to_worlds[3].clone()
    c2w[:, 3] = c2w[:, 3] * 1.3  # step back
    novel = Cameras(camera_to_worlds=c2w[None], fx=train.fx[3] * 0.8, fy=train.fy[3] * 0.8,
                    cx=40.0, cy=26.0, width=80, height=52)  # fmt: skip
    return [cams[i : i + 1] for i in range(cams.shape[0])] + [novel]


def _max_render_diff(a, b, cameras) -> float:
    worst = 0.0
    for cam in cameras:
        out_a, out_b = a.get_outputs_for_camera(cam), b.get_outputs_for_camera(cam)
        for key in ("rgb", "depth", "accumulation"):
            assert out_a[key].shape == out_b[key].shape
            assert torch.isfinite(out_a[key]).all(), f"{key}: non-finite values in the checkpoint's render"
            worst = max(worst, (out_a[key] - out_b[key]).abs().max().item())
    return worst


def _export(config: Path, out_dir: Path) -> Path:
    demo_runs.run_tool([demo_runs.tool("ns-export"), "gaussian-splat", "--load-config", config,
                        "--output-dir", out_dir], out_dir, "ns-export")  # fmt: skip
    ply = out_dir / "splat.ply"
    assert ply.is_file(), f"ns-export wrote no {ply}"
    return ply


def _copy_run_with_checkpoint(config: Path, dest_root: Path, edit) -> Path:
    """A copy of a finished run (its config.yml re-rooted under dest_root) whose checkpoint has its
    gaussian parameters changed by ``edit(params: dict of tensors)``."""
    cfg = yaml.load(config.read_text(), Loader=yaml.Loader)
    cfg.output_dir = dest_root
    ckpt_path = demo_runs.latest_checkpoint(config)
    ckpt = torch.load(ckpt_path, map_location="cpu")
    prefix = "_model.gauss_params."
    params = {k[len(prefix) :]: v for k, v in ckpt["pipeline"].items() if k.startswith(prefix)}
    edit(params)
    ckpt["pipeline"].update({prefix + k: v for k, v in params.items()})
    models = cfg.get_base_dir() / "nerfstudio_models"
    models.mkdir(parents=True)
    torch.save(ckpt, models / ckpt_path.name)
    cfg.save_config()
    shutil.copy(config.parent / "dataparser_transforms.json", cfg.get_base_dir())
    return cfg.get_base_dir() / "config.yml"


@pytest.fixture(scope="module")
def sh3_export(tmp_path_factory):
    """The SH-3 demo run, with random SH rest coefficients (so a mis-ordered f_rest cannot hide behind
    near-zero trained values) and 10% of the gaussians below the exporter's opacity cut."""
    config = demo_runs.sh3_run(tmp_path_factory)
    gen = torch.Generator().manual_seed(0)
    dropped = {}

    def edit(params):
        rest = params["features_rest"]
        assert rest.shape[1:] == (15, 3), f"SH degree 3 run has features_rest {tuple(rest.shape)}"
        params["features_rest"] = 0.3 * torch.randn(rest.shape, generator=gen)
        n = params["opacities"].shape[0]
        low = torch.randperm(n, generator=gen)[: n // 10]
        params["opacities"][low] = -8.0
        dropped["low"] = low

    root = tmp_path_factory.mktemp("sh3_export")
    edited = _copy_run_with_checkpoint(config, root / "outputs", edit)
    ply = _export(edited, root / "exports")
    return edited, ply, len(dropped["low"])


@pytest.fixture(scope="module")
def sh0_export(tmp_path_factory):
    config = demo_runs.sh0_run(tmp_path_factory)
    root = tmp_path_factory.mktemp("sh0_export")
    return config, _export(config, root / "exports")


def test_sh3_ply_layout_plyfile_and_open3d(sh3_export):
    config, ply, n_low = sh3_export
    from plyfile import PlyData

    pipeline, _, _ = demo_runs.load_pipeline(config, test_mode="inference")
    model = pipeline.model
    data = PlyData.read(str(ply))
    vertex = data["vertex"]
    assert [p.name for p in vertex.properties] == _inria_names(45)  # the 3DGS layout other viewers read
    assert all(p.val_dtype in ("f4", "float32", "float") for p in vertex.properties)
    assert data.byte_order == "<"

    opacities = model.opacities.detach().squeeze(-1)
    keep = torch.isfinite(opacities) & (opacities >= LOW_OPACITY_LOGIT)
    assert n_low > 0 and len(vertex) == int(keep.sum()) == model.num_points - n_low
    params = read_splat_ply(ply)
    for name, value in params.items():
        expected = model.gauss_params[name].detach()[keep].numpy()
        np.testing.assert_array_equal(value, expected, err_msg=f"{name} differs between the PLY and the checkpoint")
    np.testing.assert_array_equal(np.stack([vertex[k] for k in ("nx", "ny", "nz")]), 0)

    import open3d as o3d

    cloud = o3d.io.read_point_cloud(str(ply))
    points = np.asarray(cloud.points)
    assert points.shape == (len(vertex), 3), f"open3d read {points.shape} points from a {len(vertex)}-vertex PLY"
    np.testing.assert_array_equal(points, params["means"].astype(np.float64))


def test_sh3_round_trip_reproduces_render(sh3_export):
    config, ply, _ = sh3_export
    pipeline, _, _ = demo_runs.load_pipeline(config)
    original = pipeline.model
    assert original.config.sh_degree == 3 and original.step >= 3 * original.config.sh_degree_interval
    cameras = _cameras(pipeline)

    restored = model_from_ply(original, read_splat_ply(ply))
    diff = _max_render_diff(original, restored, cameras)
    assert diff <= TOL, f"PLY round trip changes the render by {diff:.3g} (> {TOL})"

    # The check has teeth: the same PLY read with the SH rest in the wrong order renders differently.
    wrong = model_from_ply(original, read_splat_ply(ply, inria_rest_order=False))
    assert _max_render_diff(original, wrong, cameras) > 1e-2


def test_sh0_round_trip_reproduces_render(sh0_export):
    config, ply = sh0_export
    pipeline, _, _ = demo_runs.load_pipeline(config)
    original = pipeline.model
    assert original.config.sh_degree == 0 and original.features_rest.shape[1] == 0

    from plyfile import PlyData

    vertex = PlyData.read(str(ply))["vertex"]
    assert [p.name for p in vertex.properties] == _inria_names(0)
    import open3d as o3d

    assert len(o3d.io.read_point_cloud(str(ply)).points) == len(vertex) > 0

    params = read_splat_ply(ply)
    assert params["features_rest"].shape == (len(vertex), 0, 3)
    opacities = original.opacities.detach().squeeze(-1)
    keep = torch.isfinite(opacities) & (opacities >= LOW_OPACITY_LOGIT)
    assert len(vertex) == int(keep.sum())
    expected_dc = RGB2SH(torch.sigmoid(original.features_dc.detach()[keep])).numpy()
    np.testing.assert_allclose(params["features_dc"], expected_dc, rtol=0, atol=1e-6)
    cameras = _cameras(pipeline)
    restored = model_from_ply(original, params)
    diff = _max_render_diff(original, restored, cameras)
    assert diff <= TOL, f"PLY round trip changes the SH-0 render by {diff:.3g} (> {TOL})"

    # The check has teeth: taking f_dc for the model's stored logits renders visibly differently, and
    # 1e-5 notices even a lossy store (the same values through float16).
    assert _max_render_diff(original, model_from_ply(original, params, dc_as_stored=True), cameras) > 1e-2
    lossy = {k: v.astype(np.float16).astype(np.float32) for k, v in params.items()}
    assert _max_render_diff(original, model_from_ply(original, lossy), cameras) > 10 * TOL

"""Small demo-scene runs for the tests that drive nerfstudio's own tools as users do (ns-train,
ns-export, ns-render, ns-eval, ns-viewer). Each scene/run is made once per pytest session (cached
under pytest's base temp dir) and shared by tests/viewer/test_viewer.py, test_export_roundtrip.py and
test_nerfstudio_tools.py.

Under pytest-xdist (scripts/test.sh) the workers share them: they live in the base temp dir all
workers have in common, and a file lock makes one worker build each while the others wait.

Sizes are chosen for CPU speed: 64x48 images (non-square, docs/design.md section 3.2), 20 views (nerfstudio's split
holds out 2), 10-12 training steps. Tests check rendering and tooling, not quality.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
from pathlib import Path
from typing import Dict, Optional, Sequence

import pytest
import torch
from cli_helpers import cli_env, demo_args, executable  # noqa: F401 (demo_args is part of this module's API)

REPO = Path(__file__).resolve().parents[1]
WIDTH, HEIGHT, VIEWS, SEED = 64, 48, 20, 0
# The eval split nerfstudio's dataparser makes for VIEWS views (see demo_scene.eval_indices).
N_EVAL = 2


def tool(name: str) -> str:
    """Path of a nerfstudio console script (ns-train, ...) of this interpreter's environment."""
    return executable(name)


def tool_env(**extra: str) -> Dict[str, str]:
    """The environment the tools run in: offline, unbuffered, no splat-metal overrides unless given."""
    return cli_env(extra=extra)


def run_tool(args: Sequence[str], log_dir: Path, name: str, timeout: float = 600, env=None) -> str:
    """Runs a tool to completion; fails the test with the end of its output when it fails.
    Returns stdout+stderr (also kept in log_dir/name.log)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    try:
        proc = subprocess.run(
            [str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=timeout, env=env or tool_env(), cwd=log_dir,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        log.write_text(e.stdout if isinstance(e.stdout, str) else "")
        pytest.fail(f"{name} did not finish within {timeout:.0f} s; output in {log}")
    log.write_text(proc.stdout)
    if proc.returncode != 0:
        pytest.fail(f"{name} failed with exit code {proc.returncode}; last output:\n{proc.stdout[-4000:]}")
    return proc.stdout


_cache: Dict[str, Path] = {}


def shared_temp(tmp_path_factory) -> Path:
    """pytest's base temp dir; under pytest-xdist the one every worker of the session has in common
    (each worker's own base temp dir is a folder in it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def exclusive(folder: Path):
    """Holds a lock on ``folder`` (a file beside it) for as long as the block runs, across processes."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        yield


def demo_scene(tmp_path_factory) -> Path:
    if "scene" not in _cache:
        from splat_metal_method.data import demo_scene as generator

        out = shared_temp(tmp_path_factory) / "demo_runs" / "scene"
        with exclusive(out):
            if not (out / "transforms.json").is_file():
                generator.generate(out, width=WIDTH, height=HEIGHT, views=VIEWS, seed=SEED)
        _cache["scene"] = out
    return _cache["scene"]


# A phone-like lens with every OPENCV coefficient nerfstudio undistorts (k1 k2 k3 p1 p2), and a fisheye's k1..k4.
LENSES = {
    "OPENCV": {"k1": -0.12, "k2": 0.03, "k3": -0.004, "p1": 0.0015, "p2": -0.001},
    "OPENCV_FISHEYE": {"k1": 0.05, "k2": -0.01, "k3": 0.002, "k4": -0.0005},
}


def lens_scene(tmp_path_factory, camera_model: str = "OPENCV", per_frame_intrinsics: bool = True) -> Path:
    """The demo scene (same size, views and seed) shot through LENSES[camera_model], its intrinsics and
    coefficients per frame or shared, made once per session."""
    key = f"lens_{camera_model}_{'per_frame' if per_frame_intrinsics else 'shared'}"
    if key not in _cache:
        from splat_metal_method.data import demo_scene as generator

        out = shared_temp(tmp_path_factory) / "demo_runs" / key
        with exclusive(out):
            if not (out / "transforms.json").is_file():
                generator.generate(out, width=WIDTH, height=HEIGHT, views=VIEWS, seed=SEED, camera_model=camera_model,
                                   lens=LENSES[camera_model], per_frame_intrinsics=per_frame_intrinsics)  # fmt: skip
        _cache[key] = out
    return _cache[key]


def distorted_run(tmp_path_factory) -> Path:
    """10 steps (SH degree 1 from step 4) on lens_scene's OPENCV scene with per-frame intrinsics and
    coefficients: nerfstudio undistorts every image and crops it (64x48 to 63x47)."""
    scene = lens_scene(tmp_path_factory)
    return finished_run(tmp_path_factory, "distorted", 10, ["--pipeline.model.sh-degree-interval", "4"], scene=scene)


def finished_run(
    tmp_path_factory, name: str, steps: int, extra: Sequence[str] = (), scene: Optional[Path] = None
) -> Path:
    """config.yml of a finished `ns-train splat-metal` run on the demo scene, or ``scene`` (demo preset + extra)."""
    if name not in _cache:
        scene = scene or demo_scene(tmp_path_factory)
        root = shared_temp(tmp_path_factory) / "demo_runs" / name
        config = root / "outputs" / scene.name / "splat-metal" / "run" / "config.yml"
        with exclusive(root):
            if not config.is_file():
                run_tool(
                    [tool("ns-train"), "splat-metal", *demo_args(), "--data", scene, "--output-dir", root / "outputs",
                     "--timestamp", "run", "--vis", "tensorboard", "--max-num-iterations", steps,
                     "--steps-per-save", 100000, "--steps-per-eval-image", 100000, "--steps-per-eval-all-images",
                     100000, *extra],
                    root, "ns-train",
                )  # fmt: skip
        ckpts = sorted((config.parent / "nerfstudio_models").glob("step-*.ckpt"))
        assert config.is_file() and ckpts, f"ns-train wrote no config/checkpoint under {config.parent}"
        assert ckpts[-1].name == f"step-{steps - 1:09d}.ckpt", f"unexpected final checkpoint {ckpts[-1].name}"
        _cache[name] = config
    return _cache[name]


def sh3_run(tmp_path_factory) -> Path:
    """12 steps at SH degree 3 (bands 1 and 2 are trained: degree interval 4)."""
    return finished_run(tmp_path_factory, "sh3", 12, ["--pipeline.model.sh-degree-interval", "4"])


def sh0_run(tmp_path_factory) -> Path:
    """10 steps with --pipeline.model.sh-degree 0 (colours as sigmoid logits, no SH rest)."""
    return finished_run(tmp_path_factory, "sh0", 10, ["--pipeline.model.sh-degree", "0"])


def load_pipeline(config: Path, test_mode: str = "test"):
    """nerfstudio's own loader, as ns-export/ns-render/ns-eval/ns-viewer use it."""
    from nerfstudio.utils.eval_utils import eval_setup

    _, pipeline, ckpt, step = eval_setup(config, test_mode=test_mode)
    pipeline.eval()
    return pipeline, Path(ckpt), step


def latest_checkpoint(config: Path) -> Optional[Path]:
    ckpts = sorted((config.parent / "nerfstudio_models").glob("step-*.ckpt"))
    return ckpts[-1] if ckpts else None


# ---------------------------------------------------------------------------------------------
# Tiny in-process models and cameras (no dataset, no training).


def small_model(background: str):
    """A SplatMetalModel with 200 gaussians in the unit cube, no dataset needed."""
    from nerfstudio.data.scene_box import SceneBox

    from splat_metal_method.method.model import SplatMetalModelConfig

    gen = torch.Generator().manual_seed(1)
    means = torch.rand(200, 3, generator=gen) - 0.5
    colors = (torch.rand(200, 3, generator=gen) * 255).to(torch.uint8)
    config = SplatMetalModelConfig(background_color=background, backend="reference")
    model = config.setup(scene_box=SceneBox(aabb=torch.tensor([[-1.0, -1, -1], [1, 1, 1]])), num_train_data=1,
                         metadata={}, seed_points=(means, colors))  # fmt: skip
    model.config.num_downscales = 0  # full resolution in train mode too
    with torch.no_grad():
        model.gauss_params["opacities"].fill_(2.0)
    return model


def camera(c2w, width=40, height=30):
    from nerfstudio.cameras.cameras import Cameras

    return Cameras(camera_to_worlds=c2w[None], fx=30.0, fy=30.0, cx=width / 2, cy=height / 2,
                   width=width, height=height)  # fmt: skip


def facing_origin(distance=3.0):
    """An OpenGL-convention camera on the +z axis looking at the origin (down its own -z)."""
    c2w = torch.eye(4)[:3].clone()
    c2w[2, 3] = distance
    return c2w


def look_away(c2w: torch.Tensor) -> torch.Tensor:
    """The same camera moved 10x further out and turned around: every gaussian is behind it."""
    away = c2w.clone()
    away[:, 3] = c2w[:, 3] * 10
    away[:, 0] = -c2w[:, 0]  # rotate 180 degrees about the camera's own y (up) axis
    away[:, 2] = -c2w[:, 2]
    return away

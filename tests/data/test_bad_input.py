"""Bad datasets: ``ns-train splat-metal --data BAD`` stops at once with one clear message that names
the offending path, exit status non-zero, no traceback, no hang, and nothing written or overwritten.

The CLI cases run the real ns-train in a subprocess. Each points --output-dir/--experiment-name/
--timestamp at an existing run, so that nerfstudio, left alone, would overwrite its config.yml
before it ever reads the data (train.py saves the config first); the run must stay byte-identical.
The in-process cases drive SplatMetalDataParser directly (the path ns-eval and Python users take).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from bad_input_table import record
from bad_scenes import CLI_TIMEOUT, EXPERIMENT, HEIGHT, TIMESTAMP, VIEWS, WIDTH
from cli_helpers import run_cli, snapshot
from PIL import Image

from splat_metal_method.data import demo_scene
from splat_metal_method.data.dataparser import DatasetError, SplatMetalDataParserConfig, check_dataset


@pytest.fixture
def existing_run(tmp_path) -> Path:
    """An output dir holding a finished run, exactly where the bad command would write."""
    output_dir = tmp_path / "outputs"
    run = output_dir / EXPERIMENT / "splat-metal" / TIMESTAMP
    (run / "nerfstudio_models").mkdir(parents=True)
    (run / "config.yml").write_text("# the config of a run that must survive\n")
    (run / "nerfstudio_models" / "step-000000099.ckpt").write_bytes(b"checkpoint bytes that must survive")
    return output_dir


def _edit_transforms(scene: Path, edit) -> Path:
    path = scene / "transforms.json"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta, indent=2))
    return path


# Each builder breaks a dataset under tmp and returns (--data, path the message must name, other expected words).
def _missing_folder(scene_copy, tmp):
    return tmp / "no_such_scene", tmp / "no_such_scene", ["does not exist", "transforms.json"]


def _empty_folder(scene_copy, tmp):
    (tmp / "empty").mkdir()
    return tmp / "empty", tmp / "empty", ["is empty", "transforms.json"]


def _no_transforms(scene_copy, tmp):
    scene = scene_copy()
    (scene / "transforms.json").unlink()
    return scene, scene, ["images/ but no transforms.json", "ns-process-data images", "--no-gpu"]


def _zero_pose(scene_copy, tmp):
    scene = scene_copy()
    path = _edit_transforms(scene, lambda m: m["frames"][1].update(transform_matrix=[[0.0] * 4] * 4))
    return scene, path, ["frame 1", "transform_matrix", "last row", "0 0 0 1"]


def _three_row_pose(scene_copy, tmp):
    """[R|t] without the row 0 0 0 1: nerfstudio 1.1.5's own parser fails on it (a RuntimeError in
    auto_orient_and_center_poses, whatever the orientation and centre methods), so it is refused too."""
    scene = scene_copy()
    path = _edit_transforms(
        scene, lambda m: m["frames"][1].update(transform_matrix=m["frames"][1]["transform_matrix"][:3])
    )
    return scene, path, ["frame 1", "transform_matrix", "has 3 rows", "4x4", "[0, 0, 0, 1]"]


def _scaled_rotation(scene_copy, tmp):
    scene = scene_copy()

    def scale(meta):
        pose = meta["frames"][2]["transform_matrix"]  # [4, 4]
        for r in range(3):
            pose[r][:3] = [2.0 * x for x in pose[r][:3]]

    path = _edit_transforms(scene, scale)
    return scene, path, ["frame 2", "not a rotation", "det R = 8"]


def _mirrored_rotation(scene_copy, tmp):
    scene = scene_copy()

    def mirror(meta):
        pose = meta["frames"][2]["transform_matrix"]  # [4, 4]
        for r in range(3):
            pose[r][0] = -pose[r][0]

    path = _edit_transforms(scene, mirror)
    return scene, path, ["frame 2", "not a rotation", "det R = -1"]


def _duplicate_image(scene_copy, tmp):
    scene = scene_copy()
    _edit_transforms(scene, lambda m: m["frames"][3].update(file_path=m["frames"][1]["file_path"]))
    return scene, scene / demo_scene.frame_name(1), ["frame 3", "also frame 1's", "listed once"]


def _folder_as_image(scene_copy, tmp):
    scene = scene_copy()
    (scene / "images" / "sub").mkdir()
    _edit_transforms(scene, lambda m: m["frames"][2].update(file_path="images/sub"))
    return scene, scene / "images" / "sub", ["frame 2", "is a folder, not an image file"]


def _negative_principal_point(scene_copy, tmp):
    scene = scene_copy()
    path = _edit_transforms(scene, lambda m: m["frames"][4].update(cx=-3.0))
    return scene, path, ["frame 4", "cx", "-3.0", "> 0"]


def _missing_image(scene_copy, tmp):
    scene = scene_copy()
    image = scene / demo_scene.frame_name(4)
    image.unlink()
    return scene, image, ["does not exist"]


def _truncated_image(scene_copy, tmp):
    scene = scene_copy()
    image = scene / demo_scene.frame_name(3)
    data = image.read_bytes()
    image.write_bytes(data[: len(data) // 2])  # the header still parses: only a full decode notices
    with Image.open(image) as im:
        assert im.size == (WIDTH, HEIGHT)
    return scene, image, ["truncated"]


def _zero_focal(scene_copy, tmp):
    scene = scene_copy()
    path = _edit_transforms(scene, lambda m: m.update(fl_x=0.0))
    return scene, path, ["fl_x", "> 0"]


def _negative_focal_in_a_frame(scene_copy, tmp):
    scene = scene_copy()
    path = _edit_transforms(scene, lambda m: m["frames"][2].update(fl_y=-50.0))
    return scene, path, ["frame 2", "fl_y", "-50.0", "> 0"]


def _mixed_image_sizes(scene_copy, tmp):
    scene = scene_copy()
    image = scene / demo_scene.frame_name(5)
    with Image.open(image) as im:
        im.resize((WIDTH * 2, HEIGHT * 2)).save(image)
    return scene, image, [f"{2 * WIDTH}x{2 * HEIGHT}", f"w={WIDTH}, h={HEIGHT}"]


CLI_CASES = {
    "missing-folder": _missing_folder,
    "empty-folder": _empty_folder,
    "no-transforms-json": _no_transforms,
    "missing-image": _missing_image,
    "truncated-image": _truncated_image,
    "zero-focal": _zero_focal,
    "mixed-image-sizes": _mixed_image_sizes,
    "zero-pose": _zero_pose,
    "scaled-rotation": _scaled_rotation,
    "duplicate-image": _duplicate_image,
    "folder-as-image": _folder_as_image,
}
PARSER_CASES = {
    **CLI_CASES,
    "negative-focal-in-a-frame": _negative_focal_in_a_frame,
    "mirrored-rotation": _mirrored_rotation,
    "negative-principal-point": _negative_principal_point,
    "three-row-pose": _three_row_pose,
}
WHAT = {  # the table's description of each case (docs/reliability.md)
    "missing-folder": "`ns-train splat-metal --data` a folder that does not exist",
    "empty-folder": "`--data` an empty folder",
    "no-transforms-json": "`--data` a folder ns-process-data left half-written (images/, no transforms.json)",
    "zero-pose": "a frame's `transform_matrix` is all zeros",
    "three-row-pose": "a frame's `transform_matrix` is 3x4 (no last row 0 0 0 1)",
    "scaled-rotation": "a frame's rotation is scaled by 2 (not orthonormal)",
    "mirrored-rotation": "a frame's rotation is mirrored (determinant -1)",
    "duplicate-image": "two frames list the same image",
    "folder-as-image": "a frame's `file_path` is a folder",
    "negative-principal-point": "one frame's `cx` is negative",
    "missing-image": "an image transforms.json names is missing",
    "truncated-image": "an image is truncated (its header still reads)",
    "zero-focal": "`fl_x` is 0",
    "mixed-image-sizes": "an image is not the size transforms.json says",
    "negative-focal-in-a-frame": "one frame's `fl_y` is negative",
}


def _message_lines(stderr: str) -> list:
    """The error message at the end of stderr: from the last line starting "splat-metal: " on."""
    lines = stderr.rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("splat-metal: ")]
    return lines[starts[-1] :] if starts else []


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_ns_train_rejects_bad_data_cleanly(case, scene_copy, tmp_path, existing_run):
    data, named, words = CLI_CASES[case](scene_copy, tmp_path)
    before_data = snapshot(data) if data.exists() else None
    before_run = snapshot(existing_run)
    result = run_cli(
        "ns-train", "splat-metal", "--data", data, "--output-dir", existing_run,
        "--experiment-name", EXPERIMENT, "--timestamp", TIMESTAMP,
        "--max-num-iterations", 5, "--vis", "tensorboard",
        timeout=CLI_TIMEOUT, torch_home=tmp_path / "torch_home",
    )  # fmt: skip
    assert result.returncode != 0, result.tail()
    assert "Traceback" not in result.output, result.tail()
    message = _message_lines(result.stderr)
    assert message, f"no 'splat-metal: ' message at the end of stderr\n{result.tail()}"
    after = [line for line in message[1:] if not line.startswith("  ")]  # the message's own lines are indented
    assert not after, f"something was printed after the message\n{result.tail()}"
    text = "\n".join(message)
    record(f"data/{case}", WHAT[case], text, data=data)
    assert str(named) in text, f"message does not name {named}:\n{text}"
    for word in words:
        assert word in text, f"{word!r} not in message:\n{text}"
    # Nothing written: the existing run is byte-identical (same mtimes) and no new run appeared;
    # the dataset itself is untouched.
    assert snapshot(existing_run) == before_run
    if before_data is not None:
        assert snapshot(data) == before_data


@pytest.mark.parametrize("case", list(PARSER_CASES))
def test_dataparser_raises_dataset_error(case, scene_copy, tmp_path):
    """The same checks inside the dataparser (ns-eval, --load-config, Python), before any loading."""
    data, named, words = PARSER_CASES[case](scene_copy, tmp_path)
    parser = SplatMetalDataParserConfig(data=data, load_3D_points=True).setup()
    with pytest.raises(DatasetError) as info:
        parser.get_dataparser_outputs(split="train")
    message = str(info.value)
    record(f"data/{case}", WHAT[case], message, data=data)
    assert message.startswith("splat-metal: ") and message == info.value.code  # what Python prints on exit
    assert isinstance(info.value, SystemExit) and not isinstance(info.value, Exception)
    assert str(named) in message
    for word in words:
        assert word in message


@pytest.mark.parametrize(
    "edit, words, what",
    [
        (lambda s: (s / "transforms.json").write_text('{"frames": [{"file_path": '), ["not valid JSON", "line 1"],
         "transforms.json is not valid JSON"),
        (lambda s: _edit_transforms(s, lambda m: m.update(frames=[])), ["lists no frames"], "transforms.json lists no frames"),
        (lambda s: (s / demo_scene.PLY_NAME).unlink(), ["seed points", demo_scene.PLY_NAME, "do not exist"],
         "the seed-point PLY transforms.json names is missing"),
        (
            lambda s: _edit_transforms(s, lambda m: m["frames"][1]["transform_matrix"][0].__setitem__(3, "nan")),
            ["frame 1", "transform_matrix"],
            "a frame's transform holds NaN",
        ),
        (lambda s: _edit_transforms(s, lambda m: m.pop("fl_y")), ["no fl_y"], "no `fl_y` anywhere"),
        (lambda s: _edit_transforms(s, lambda m: m.update(w=32.5)), ["w = 32.5", "whole number"], "`w` is 32.5"),
    ],
    ids=["invalid-json", "no-frames", "missing-seed-points", "nan-pose", "no-focal", "fractional-width"],
)  # fmt: skip
def test_more_problems_are_named(scene_copy, edit, words, what, request):
    scene = scene_copy()
    edit(scene)
    with pytest.raises(DatasetError) as info:
        check_dataset(scene)
    record(f"data/{request.node.callspec.id}", what, str(info.value), data=scene)
    assert str(scene) in str(info.value)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_many_problems_are_listed_together(scene_copy):
    scene = scene_copy()
    for i in range(VIEWS):
        (scene / demo_scene.frame_name(i)).unlink()
    with pytest.raises(DatasetError) as info:
        check_dataset(scene)
    message = str(info.value)
    record("data/every-image-missing", "every image is missing (many problems at once)", message, data=scene)
    assert f"{VIEWS} problems" in message and "... and 2 more" in message
    assert message.count("does not exist") == 8


def test_good_datasets_pass(good_scene, scene_copy):
    """No false alarms: the demo scene, its transforms.json given directly, and frames of different
    sizes when each frame states its own w/h (nerfstudio supports that)."""
    check_dataset(good_scene)
    outputs = SplatMetalDataParserConfig(data=good_scene / "transforms.json", load_3D_points=True).setup()
    assert len(outputs.get_dataparser_outputs("train").image_filenames) == VIEWS - len(demo_scene.eval_indices(VIEWS))

    scene = scene_copy("per_frame_sizes")
    image = scene / demo_scene.frame_name(5)
    with Image.open(image) as im:
        im.resize((WIDTH * 2, HEIGHT * 2)).save(image)

    def per_frame(meta):
        for frame in meta["frames"]:
            frame.update(w=meta["w"], h=meta["h"])
        meta["frames"][5].update(w=WIDTH * 2, h=HEIGHT * 2)
        del meta["w"], meta["h"]

    _edit_transforms(scene, per_frame)
    parsed = SplatMetalDataParserConfig(data=scene, load_3D_points=True).setup().get_dataparser_outputs("train")
    widths = {int(w) for w in parsed.cameras.width}
    assert widths == {WIDTH, WIDTH * 2}


def test_inference_setup_does_not_need_the_images(scene_copy):
    """ns-export/ns-viewer set up nerfstudio in "inference" mode, which opens no image: exporting a
    trained model must keep working after its training images are gone. Training must not."""
    scene = scene_copy()
    shutil.rmtree(scene / "images")
    parser = SplatMetalDataParserConfig(data=scene, load_3D_points=True).setup()
    parser.downscale_factor = 1  # what FullImageDatamanager does for test_mode="inference"
    assert len(parser.get_dataparser_outputs("train").image_filenames) > 0
    with pytest.raises(DatasetError, match="does not exist"):
        SplatMetalDataParserConfig(data=scene, load_3D_points=True).setup().get_dataparser_outputs("train")

"""What a real capture can get wrong (issue 35 items 4 and 7), caught by the dataset check before a run
folder exists: each case breaks a demo scene the way ns-process-data output (COLMAP, Polycam, Record3D)
or a hand edit breaks, and expects one message that names the file and says what to do.

Same style as test_bad_input.py: builders return (--data, the path the message must name, other words
it must hold, nerfstudio-data options). Every case runs through SplatMetalDataParser (ns-eval, Python);
a few run the real ns-train, which must exit with the message alone and write nothing (an existing run
at the output path stays byte-identical, no new run appears).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from bad_input_table import record
from bad_scenes import CLI_TIMEOUT, EXPERIMENT, HEIGHT, TIMESTAMP, WIDTH
from cli_helpers import run_cli, snapshot
from PIL import Image

from splat_metal_method.data import demo_scene
from splat_metal_method.data.dataparser import DatasetError, SplatMetalDataParserConfig, check_dataset

SEED_FIX = "--load-3D-points False"  # nerfstudio-data's option: random gaussians instead of the PLY
DOWNSCALE_FIX = "--num-downscales"


def _edit_transforms(scene: Path, edit) -> Path:
    path = scene / "transforms.json"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta, indent=2))
    return path


def _downscaled_folder(scene: Path, factor: int, size=None) -> Path:
    """images_<factor>/ as ns-process-data --num-downscales writes it (every image at 1/factor), or at ``size``."""
    folder = scene / f"images_{factor}"
    folder.mkdir()
    for image in sorted((scene / demo_scene.IMAGE_DIR).glob("*.png")):
        with Image.open(image) as im:
            im.resize(size or (im.width // factor, im.height // factor), Image.Resampling.BILINEAR).save(
                folder / image.name
            )
    return folder


def _per_frame_intrinsics(meta: dict) -> None:
    """Intrinsics in every frame (as ns-process-data writes for Record3D/Polycam), none shared."""
    for frame in meta["frames"]:
        frame.update({key: meta[key] for key in ("fl_x", "fl_y", "cx", "cy", "w", "h")})
    for key in ("fl_x", "fl_y", "cx", "cy", "w", "h"):
        del meta[key]


def _masks(scene: Path, edit=None) -> None:
    """masks/ with a one-channel mask per frame (nerfstudio: 0 = ignore), mask_path in every frame."""
    (scene / "masks").mkdir()

    def add(meta):
        for frame in meta["frames"]:
            name = Path(frame["file_path"]).name
            Image.fromarray(np.full((HEIGHT, WIDTH), 255, np.uint8)).save(scene / "masks" / name)
            frame["mask_path"] = f"masks/{name}"
        if edit:
            edit(meta)

    _edit_transforms(scene, add)


# ---- builders: (data, named, words, nerfstudio-data options)
def _one_frame(scene_copy, tmp):
    scene = scene_copy()
    path = _edit_transforms(scene, lambda m: m.update(frames=m["frames"][:1]))
    return scene, path, ["1 frame", "add more"], {}


def _unknown_camera_model(scene_copy, tmp):
    scene = scene_copy()
    path = _edit_transforms(scene, lambda m: m.update(camera_model="THIN_PRISM_FISHEYE"))  # a COLMAP model
    return scene, path, ["unknown camera_model 'THIN_PRISM_FISHEYE'", "OPENCV_FISHEYE"], {}


def _equirectangular(scene_copy, tmp):
    scene = scene_copy()
    path = _edit_transforms(scene, lambda m: m.update(camera_model="EQUIRECTANGULAR"))
    return scene, path, ["pinhole", "--images-per-equirect"], {}


def _downscale_folder_missing(scene_copy, tmp):
    scene = scene_copy()
    return (
        scene,
        scene / "images_2",
        ["--downscale-factor 2", DOWNSCALE_FIX, "camera-res-scale-factor 0.5"],
        {"downscale_factor": 2},
    )


def _downscale_wrong_size(scene_copy, tmp):
    scene = scene_copy()
    folder = _downscaled_folder(scene, 2)
    named = folder / Path(demo_scene.frame_name(6)).name
    shutil.copy(scene / demo_scene.frame_name(6), named)  # one image copied at full size
    return (
        scene,
        named,
        [f"{WIDTH}x{HEIGHT}", f"w={WIDTH // 2}, h={HEIGHT // 2}", DOWNSCALE_FIX],
        {"downscale_factor": 2},
    )


def _downscale_file_missing(scene_copy, tmp):
    scene = scene_copy()
    folder = _downscaled_folder(scene, 4)
    missing = folder / Path(demo_scene.frame_name(7)).name
    missing.unlink()
    return scene, missing, ["does not exist", DOWNSCALE_FIX], {"downscale_factor": 4}


def _auto_downscale_wrong_size(scene_copy, tmp):
    """Images over 1600 px: nerfstudio reads images_2/ by itself when it holds the first frame's image."""
    scene = scene_copy()
    big = (1700, 1020)  # 1700 > 1600; w/h in transforms.json follow
    for image in sorted((scene / demo_scene.IMAGE_DIR).glob("*.png")):
        with Image.open(image) as im:
            im.resize(big, Image.Resampling.NEAREST).save(image, compress_level=1)
    _edit_transforms(scene, lambda m: m.update(w=big[0], h=big[1], fl_x=m["fl_x"] * 1700 / WIDTH, fl_y=m["fl_y"] * 1020 / HEIGHT,
                                                cx=m["cx"] * 1700 / WIDTH, cy=m["cy"] * 1020 / HEIGHT))  # fmt: skip
    folder = _downscaled_folder(scene, 2)
    named = folder / Path(demo_scene.frame_name(9)).name
    with Image.open(named) as im:
        im.resize((849, 510)).save(named)  # one pixel short, as an odd rounding makes it
    return scene, named, ["849x510", "w=850, h=510", "nerfstudio-data --downscale-factor 1"], {}


def _per_frame_intrinsic_missing(scene_copy, tmp):
    scene = scene_copy()
    path = _edit_transforms(scene, lambda m: (_per_frame_intrinsics(m), m["frames"][3].pop("cx")))
    return scene, path, ["frame 3", "no cx", "give every frame"], {}


def _per_frame_intrinsic_invalid(scene_copy, tmp):
    scene = scene_copy()
    path = _edit_transforms(scene, lambda m: (_per_frame_intrinsics(m), m["frames"][6].update(fl_x="NaN")))
    return scene, path, ["frame 6", "fl_x = 'NaN'", "> 0"], {}


def _distortion_invalid(scene_copy, tmp):
    scene = scene_copy()
    path = _edit_transforms(scene, lambda m: m["frames"][2].update(k1=None))
    return scene, path, ["frame 2", "k1 = None", "finite number"], {}


def _opencv_k4(scene_copy, tmp):
    scene = scene_copy()
    path = _edit_transforms(scene, lambda m: m.update(camera_model="OPENCV", k1=-0.05, k4=0.01))
    return scene, path, ["k4 = 0.01", "OPENCV_FISHEYE"], {}


def _no_file_path(scene_copy, tmp):
    scene = scene_copy()
    path = _edit_transforms(scene, lambda m: m["frames"][4].pop("file_path"))
    return scene, path, ["frame 4", 'no "file_path"'], {}


def _size_differs_from_frame(scene_copy, tmp):
    """Per-frame w/h (mixed sizes are fine) but one image is not the size its frame says."""
    scene = scene_copy()
    image = scene / demo_scene.frame_name(5)
    with Image.open(image) as im:
        im.resize((WIDTH + 8, HEIGHT)).save(image)
    _edit_transforms(scene, _per_frame_intrinsics)
    return scene, image, [f"{WIDTH + 8}x{HEIGHT}", f"w={WIDTH}, h={HEIGHT}"], {}


def _rotated_image(scene_copy, tmp):
    scene = scene_copy()
    image = scene / demo_scene.frame_name(1)
    with Image.open(image) as im:
        im.transpose(Image.Transpose.ROTATE_90).save(image)
    return scene, image, [f"{HEIGHT}x{WIDTH}", "swapped", "EXIF"], {}


def _mask_missing(scene_copy, tmp):
    scene = scene_copy()
    _masks(scene)
    mask = scene / "masks" / Path(demo_scene.frame_name(2)).name
    mask.unlink()
    return scene, mask, ["does not exist", "remove mask_path"], {}


def _masks_on_some_frames(scene_copy, tmp):
    scene = scene_copy()
    _masks(scene, lambda m: m["frames"][0].pop("mask_path"))
    return scene, scene / "transforms.json", ["9 of the 10 frames", "mask_path", "every frame or for none"], {}


def _depths_on_some_frames(scene_copy, tmp):
    scene = scene_copy()
    path = _edit_transforms(scene, lambda m: m["frames"][4].update(depth_file_path="depths/frame_00004.png"))
    return scene, path, ["1 of the 10 frames", "depth_file_path", "every frame or for none"], {}


def _mask_rgb(scene_copy, tmp):
    scene = scene_copy()
    _masks(scene)
    mask = scene / "masks" / Path(demo_scene.frame_name(3)).name
    Image.new("RGB", (WIDTH, HEIGHT), (255, 255, 255)).save(mask)
    return scene, mask, ["3 channels", "grayscale"], {}


def _mask_wrong_size(scene_copy, tmp):
    scene = scene_copy()
    _masks(scene)
    mask = scene / "masks" / Path(demo_scene.frame_name(8)).name
    Image.new("L", (WIDTH // 2, HEIGHT // 2), 255).save(mask)
    return scene, mask, [f"{WIDTH // 2}x{HEIGHT // 2}", "masks must match"], {}


def _split_list_missing(scene_copy, tmp):
    scene = scene_copy()

    def edit(meta):
        meta["train_filenames"] = [f["file_path"] for f in meta["frames"][:8]]
        meta["test_filenames"] = [f["file_path"] for f in meta["frames"][8:]]

    path = _edit_transforms(scene, edit)
    return scene, path, ['no "val_filenames"'], {}


def _split_names_unknown_file(scene_copy, tmp):
    scene = scene_copy()

    def edit(meta):
        meta["train_filenames"] = [f["file_path"] for f in meta["frames"][:8]] + ["images/IMG_0001.JPG"]
        meta["val_filenames"] = [f["file_path"] for f in meta["frames"][8:]]

    path = _edit_transforms(scene, edit)
    return scene, path, ['"train_filenames"', "images/IMG_0001.JPG"], {}


def _filename_split_without_names(scene_copy, tmp):
    scene = scene_copy()
    return scene, scene / "transforms.json", ["--eval-mode filename", '"train" or "eval"'], {"eval_mode": "filename"}


def _cameras_at_one_position(scene_copy, tmp):
    """A tripod capture: the camera turned but did not move."""
    scene = scene_copy()

    def edit(meta):
        for frame in meta["frames"]:
            for row in frame["transform_matrix"][:3]:
                row[3] = 1.5

    path = _edit_transforms(scene, edit)
    return scene, path, ["same position", "camera movement"], {}


def _seed(scene_copy, data: bytes):
    scene = scene_copy()
    ply = scene / demo_scene.PLY_NAME
    ply.write_bytes(data)
    return scene, ply


def _seed_garbage(scene_copy, tmp):
    scene, ply = _seed(scene_copy, b"\x89PNG\r\n\x1a\n not a point cloud at all" * 20)
    return scene, ply, ["not a PLY file", SEED_FIX], {}


def _seed_empty(scene_copy, tmp):
    scene = scene_copy()
    ply = scene / demo_scene.PLY_NAME
    demo_scene.write_ply(ply, np.zeros((0, 3), np.float32), np.zeros((0, 3), np.uint8))
    return scene, ply, ["holds no points", SEED_FIX], {}


def _seed_truncated(scene_copy, tmp):
    scene = scene_copy()
    ply = scene / demo_scene.PLY_NAME
    ply.write_bytes(ply.read_bytes()[:-100])  # open3d warns, then hands back what it read
    return scene, ply, ["truncated", "1500 points", SEED_FIX], {}


def _seed_nan(scene_copy, tmp):
    scene = scene_copy()
    ply = scene / demo_scene.PLY_NAME
    xyz, rgb = demo_scene.read_ply(ply)
    xyz = xyz.copy()
    xyz[10, 2] = np.nan
    xyz[11, 0] = np.inf
    demo_scene.write_ply(ply, xyz, rgb)
    return scene, ply, ["2 point(s) with NaN or infinite", SEED_FIX], {}


def _seed_ascii_nan(scene_copy, tmp):
    header = (
        "ply\nformat ascii 1.0\nelement vertex 3\nproperty float x\nproperty float y\nproperty float z\nend_header\n"
    )
    scene, ply = _seed(scene_copy, (header + "0 0 0\n0.5 0.1 0.2\nnan 1 1\n").encode())
    return scene, ply, ["1 point(s) with NaN", SEED_FIX], {}


def _seed_ascii_truncated(scene_copy, tmp):
    header = (
        "ply\nformat ascii 1.0\nelement vertex 4\nproperty float x\nproperty float y\nproperty float z\nend_header\n"
    )
    scene, ply = _seed(scene_copy, (header + "0 0 0\n0.5 0.1 0.2\n").encode())
    return scene, ply, ["truncated", "4 points (4 lines", "holds 2 lines", SEED_FIX], {}


CLI_CASES = {
    "one-frame": _one_frame,
    "downscale-folder-missing": _downscale_folder_missing,
    "seed-points-nan": _seed_nan,
}
PARSER_CASES = {
    **CLI_CASES,
    "unknown-camera-model": _unknown_camera_model,
    "equirectangular": _equirectangular,
    "downscale-wrong-size": _downscale_wrong_size,
    "downscale-file-missing": _downscale_file_missing,
    "auto-downscale-wrong-size": _auto_downscale_wrong_size,
    "per-frame-intrinsic-missing": _per_frame_intrinsic_missing,
    "per-frame-intrinsic-invalid": _per_frame_intrinsic_invalid,
    "distortion-invalid": _distortion_invalid,
    "opencv-k4": _opencv_k4,
    "no-file-path": _no_file_path,
    "size-differs-from-frame": _size_differs_from_frame,
    "rotated-image": _rotated_image,
    "mask-missing": _mask_missing,
    "masks-on-some-frames": _masks_on_some_frames,
    "mask-rgb": _mask_rgb,
    "depths-on-some-frames": _depths_on_some_frames,
    "mask-wrong-size": _mask_wrong_size,
    "split-list-missing": _split_list_missing,
    "split-names-unknown-file": _split_names_unknown_file,
    "filename-split-without-names": _filename_split_without_names,
    "cameras-at-one-position": _cameras_at_one_position,
    "seed-points-garbage": _seed_garbage,
    "seed-points-empty": _seed_empty,
    "seed-points-truncated": _seed_truncated,
    "seed-points-ascii-nan": _seed_ascii_nan,
    "seed-points-ascii-truncated": _seed_ascii_truncated,
}


def _message_lines(stderr: str) -> list:
    lines = stderr.rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("splat-metal: ")]
    return lines[starts[-1] :] if starts else []


@pytest.mark.parametrize("case", list(PARSER_CASES))
def test_dataparser_names_the_file_and_the_fix(case, scene_copy, tmp_path):
    data, named, words, options = PARSER_CASES[case](scene_copy, tmp_path)
    parser = SplatMetalDataParserConfig(data=data, load_3D_points=True, **options).setup()
    with pytest.raises(DatasetError) as info:
        parser.get_dataparser_outputs(split="train")
    message = str(info.value)
    assert message.startswith("splat-metal: bad dataset ") and "\n" not in message, message  # one line
    assert str(named) in message, f"message does not name {named}:\n{message}"
    for word in words:
        assert word in message, f"{word!r} not in message:\n{message}"
    record(f"capture/{case}", f"capture: {case.replace('-', ' ')}", message, data=data, named=named)


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_ns_train_stops_before_the_run_folder(case, scene_copy, tmp_path):
    """The real ns-train: exit status 1, the message last, no traceback; the existing run at the output
    path byte-identical and no new run folder."""
    data, named, words, options = CLI_CASES[case](scene_copy, tmp_path)
    output_dir = tmp_path / "outputs"
    run = output_dir / EXPERIMENT / "splat-metal" / TIMESTAMP
    (run / "nerfstudio_models").mkdir(parents=True)
    (run / "config.yml").write_text("# the config of a run that must survive\n")
    before = snapshot(output_dir)
    parser_args = ["nerfstudio-data"] + [a for k, v in options.items() for a in (f"--{k.replace('_', '-')}", v)]
    result = run_cli(
        "ns-train", "splat-metal", "--data", data, "--output-dir", output_dir,
        "--experiment-name", EXPERIMENT, "--timestamp", TIMESTAMP,
        "--max-num-iterations", 5, "--vis", "tensorboard", *(parser_args if options else []),
        timeout=CLI_TIMEOUT, torch_home=tmp_path / "torch_home",
    )  # fmt: skip
    assert result.returncode == 1, result.tail()
    assert "Traceback" not in result.output, result.tail()
    message = _message_lines(result.stderr)
    assert len(message) == 1, f"expected the one-line message last on stderr\n{result.tail()}"
    assert str(named) in message[0] and all(word in message[0] for word in words), message[0]
    assert snapshot(output_dir) == before  # nothing written, no new run folder
    assert sorted(p.name for p in (output_dir / EXPERIMENT / "splat-metal").iterdir()) == [TIMESTAMP]


def test_random_initialisation_stays_available(scene_copy, tmp_path):
    """With load_3D_points off (the fix the seed-point messages name) the same capture parses, without
    seed points: splatfacto then starts from random gaussians."""
    data, ply, _, _ = _seed_nan(scene_copy, tmp_path)
    with pytest.raises(DatasetError):
        check_dataset(data)
    outputs = SplatMetalDataParserConfig(data=data, load_3D_points=False).setup().get_dataparser_outputs("train")
    assert "points3D_xyz" not in outputs.metadata


def test_good_captures_pass(scene_copy):
    """No false alarms on what ns-process-data writes: per-frame intrinsics, masks for every frame,
    images_2/ with --downscale-factor 2 (masks_2/ too), split lists, an empty held-out split."""
    scene = scene_copy("good")
    _masks(scene, _per_frame_intrinsics)
    _downscaled_folder(scene, 2)
    (scene / "masks_2").mkdir()
    for mask in (scene / "masks").iterdir():
        Image.new("L", (WIDTH // 2, HEIGHT // 2), 255).save(scene / "masks_2" / mask.name)
    config = SplatMetalDataParserConfig(data=scene, load_3D_points=True, downscale_factor=2)
    check_dataset(scene, config=config)
    outputs = config.setup().get_dataparser_outputs("train")
    assert all("images_2" in str(p) for p in outputs.image_filenames)
    assert int(outputs.cameras.width[0]) == WIDTH // 2 and len(outputs.metadata["points3D_xyz"]) == 1500

    def split(meta):
        meta["train_filenames"] = [f["file_path"] for f in meta["frames"][:9]]
        meta["val_filenames"] = []  # nothing held out: nerfstudio trains without evaluating
        meta["test_filenames"] = [f["file_path"] for f in meta["frames"][9:]]

    _edit_transforms(scene, split)
    check_dataset(scene, config=config)
    few = scene_copy("few")
    _edit_transforms(few, lambda m: m.update(frames=m["frames"][:5]))  # 5 frames: fraction 0.9 holds none out
    check_dataset(few)

"""Lens distortion on a real capture: the snowmiku phone capture (../shared/data/snowmiku: 97 photos,
pinhole 785x589) trained as it is, and with its training photos re-shot through a phone-like OPENCV
lens, the same number of steps each; held-out PSNR of both on the same pinhole held-out photos.

    python benchmarks/bench_distortion.py                                   # 7K steps, full size
    python benchmarks/bench_distortion.py --steps 600 --width 196 --threads 1    # what fits a busy CPU

Both copies are cut from the capture at --width (tests/real_capture.py) and trained by
bench_real_capture.py's ``train`` (one ns-train process each, then ns-eval; nerfstudio-data
``--eval-mode interval``: every 8th photo held out). In the distorted copy every training photo is
re-sampled through the lens (splat_metal_method/data/demo_scene.py's subpixel_rays + through_lens: 3x3
sub-pixel rays per pixel, OpenCV's model inverted), with a focal length a little longer than the photo's
so that every ray falls inside the photo, and written with per-frame intrinsics and the coefficients;
the held-out photos stay as they are (their frames carry zero coefficients and the photo's intrinsics),
so both runs are scored on the same pinhole images. nerfstudio's datamanager undistorts the training
photos again (and crops them to the valid area) before training.

Goal (issue 35): the distorted copy within 0.5 dB of the pinhole one. Prints both and the difference;
writes benchmarks/results/distortion_<label>.csv.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import bench_real_capture  # noqa: E402
import real_capture  # noqa: E402

from splat_metal_method.data.demo_scene import SUPERSAMPLE, subpixel_rays, through_lens  # noqa: E402

PHONE_LENS = {"k1": -0.12, "k2": 0.03, "p1": 0.0008, "p2": -0.0005}  # a phone main camera's size, OpenCV's model


def distorted_copy(pinhole: Path, out: Path, lens: dict) -> tuple[Path, float]:
    """``out``: ``pinhole``'s capture with every training photo shot through ``lens`` (OPENCV). Returns
    ``out`` and the focal-length factor of the distorted photos."""
    meta = json.loads((pinhole / "transforms.json").read_text())
    W, H = int(meta["w"]), int(meta["h"])
    shared = {k: meta.pop(k) for k in ("fl_x", "fl_y", "cx", "cy", "w", "h", "k1", "k2", "k3", "k4", "p1", "p2")
              if k in meta}  # fmt: skip
    assert not any(shared.get(k, 0.0) for k in ("k1", "k2", "k3", "k4", "p1", "p2")), "the capture is pinhole"
    K = np.array([[shared["fl_x"], 0, shared["cx"]], [0, shared["fl_y"], shared["cy"]], [0, 0, 1]])
    # The shortest focal length (steps of 0.5 %) whose rays all land inside the photo (0.5 px inside).
    factor = 1.0
    while True:
        own = dict(shared, fl_x=shared["fl_x"] * factor, fl_y=shared["fl_y"] * factor)
        rays = subpixel_rays("OPENCV", own, lens)  # [H*s, W*s, 2]
        x, y = rays[..., 0] * K[0, 0] + K[0, 2], rays[..., 1] * K[1, 1] + K[1, 2]
        if x.min() >= 0.5 and y.min() >= 0.5 and x.max() <= W - 0.5 and y.max() <= H - 0.5:
            break
        factor += 0.005
    names = sorted(f["file_path"] for f in meta["frames"])
    held_out = {name for i, name in enumerate(names) if i % real_capture.EVAL_INTERVAL == 0}  # --eval-mode interval
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / meta["ply_file_path"]).write_bytes((pinhole / meta["ply_file_path"]).read_bytes())
    for frame in meta["frames"]:
        source = pinhole / frame["file_path"]
        target = out / frame["file_path"]
        if frame["file_path"] in held_out:
            target.write_bytes(source.read_bytes())
            frame.update(shared, k1=0.0, k2=0.0, p1=0.0, p2=0.0)
            continue
        photo = np.asarray(Image.open(source).convert("RGB"), dtype=np.float32) / 255  # [H, W, 3]
        image = through_lens(photo, K, rays, SUPERSAMPLE)  # [H, W, 3]
        Image.fromarray((np.clip(image, 0, 1) * 255).round().astype(np.uint8)).save(target.with_suffix(".png"))
        frame["file_path"] = str(Path(frame["file_path"]).with_suffix(".png"))
        frame.update(own, **lens)
    (out / "transforms.json").write_text(json.dumps(meta, indent=2))
    return out, factor


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=bench_real_capture.FULL_STEPS)
    p.add_argument("--schedule", choices=("default", "scaled"), default="scaled")
    p.add_argument("--width", type=int, default=None, help="photo width (default 785, as captured)")
    p.add_argument("--method", choices=("default", "mcmc"), default="mcmc")
    p.add_argument("--cap-max", type=int, default=30000, help="MCMC's gaussian count (--method mcmc)")
    for name, value in PHONE_LENS.items():
        p.add_argument(f"--{name}", type=float, default=value)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of each ns-train")
    p.add_argument("--eval-points", type=int, default=3, help="held-out PSNR this many times over each run")
    p.add_argument("--label", default=None)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument(
        "--keep", type=Path, default=None, help="keep the copies and runs here (default: a temporary folder)"
    )
    args = p.parse_args(argv)
    lens = {k: getattr(args, k) for k in PHONE_LENS}
    label = args.label or f"{args.device}_{args.method}_{args.steps}steps_w{args.width or 785}"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        pinhole = real_capture.make_cut(root / "pinhole", width=args.width)
        distorted, factor = distorted_copy(pinhole, root / "distorted", lens)
        print(f"distorted copy: OPENCV {lens}, focal length x{factor:.3f} (every ray inside the photo)", flush=True)
        for data in (pinhole, distorted):
            row = bench_real_capture.train(args.method, data, root / "outputs", args, cap_max=args.cap_max)
            row.update(copy=data.name, lens=json.dumps(lens if data is distorted else {}), width=args.width or 785)
            row.pop("run_dir")
            print(f"{data.name}: held-out PSNR {row['psnr']:.2f} dB, SSIM {row['ssim']:.3f}, "
                  f"{row['gaussians']:,} gaussians, wall {row['wall_s']} s", flush=True)  # fmt: skip
            rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / f"distortion_{label}.csv"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    diff = rows[1]["psnr"] - rows[0]["psnr"]
    print(
        f"\n| copy | held-out PSNR | SSIM |\n|---|---:|---:|\n| pinhole | {rows[0]['psnr']:.2f} dB | {rows[0]['ssim']:.3f} |"
    )
    print(f"| distorted (OPENCV {lens}) | {rows[1]['psnr']:.2f} dB | {rows[1]['ssim']:.3f} |")
    print(f"distorted - pinhole: {diff:+.2f} dB (goal: within 0.5 dB); wrote {csv_path}")


if __name__ == "__main__":
    main()

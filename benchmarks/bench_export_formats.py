"""Every format `splat-metal-export` writes, measured on one trained run: bytes per gaussian, and the
held-out views rendered from each file as a viewer reads it, against the model's own render (PSNR).

    python benchmarks/bench_export_formats.py --load-config outputs/.../config.yml [--browser] [--label demo]

Each file is decoded by a reader written from its format's sources: .ply by plyfile, .splat and .spz
by tests/export_readers.py, .sog and .compressed.ply by PlayCanvas's splat-transform (to .ply), and
rendered by the reference op at the held-out cameras; the model renders the same cameras with the
same op. --browser adds SuperSplat's viewer (tests/playcanvas_viewer.py) opening .ply, .sog and
.compressed.ply in headless Chromium at the held-out cameras' positions and view axes (256x192, 60
degrees wide), against the model's render of those cameras and against the viewer's own render of
the .ply; and the PlayCanvas engine alone (tests/export/test_export_glb.py) opening the .glb as glTF,
against the model's render and the engine's own render of the .ply (the .glb row's browser columns).
The .glb is read by tests/export_readers.read_glb and turned back into the run's axes. Prints a Markdown table and writes benchmarks/results/export_formats_<label>.csv.
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "export")]  # helpers, and the export tests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load-config", type=Path, required=True)
    parser.add_argument("--label", default="run")
    parser.add_argument("--browser", action="store_true")
    args = parser.parse_args()

    import demo_runs
    from export_readers import read_glb, read_splat, read_spz
    from playcanvas_viewer import splat_transform
    from test_export_formats import _psnr, _reference_model, _render, _splat_params, _spz_params
    from test_export_glb import glb_params
    from test_export_playcanvas import _eval_cameras, viewer_camera, viewer_renders
    from test_export_roundtrip import model_from_ply, read_splat_ply

    from splat_metal_method.export.cli import ExportSplats

    out = Path(tempfile.mkdtemp(prefix="bench_export_formats_"))
    formats = ("ply", "splat", "spz", "sog", "compressed-ply", "glb")
    paths = ExportSplats(load_config=args.load_config, output_dir=out, format=formats).main()
    pipeline, _, step = demo_runs.load_pipeline(args.load_config)
    model = _reference_model(pipeline)
    cameras = _eval_cameras(pipeline)
    reference = _render(model, cameras)
    n_rest = model.features_rest.shape[1]
    n = len(read_splat_ply(out / "splat.ply")["means"])

    params = {
        "ply": read_splat_ply(out / "splat.ply"),
        "splat": _splat_params(read_splat(out / "splat.splat"), n_rest),
        "spz": _spz_params(read_spz(out / "splat.spz")),
        "glb": glb_params(read_glb(out / "splat.glb"), n_rest),
    }
    for fmt, name in (("sog", "splat.sog"), ("compressed-ply", "splat.compressed.ply")):
        decoded = out / f"decoded_{fmt}.ply"
        splat_transform(out / name, decoded)
        params[fmt] = read_splat_ply(decoded)

    rows = []
    for fmt, path in zip(formats, paths):
        size = path.stat().st_size
        psnr = _psnr(reference, _render(model_from_ply(model, params[fmt]), cameras))
        rows.append({"format": fmt, "file": path.name, "bytes": size, "bytes_per_gaussian": round(size / n, 2),
                     "psnr_vs_model_db": round(psnr, 1), "browser_psnr_db": "", "browser_vs_ply_db": ""})  # fmt: skip

    if args.browser:
        import browser as test_viewer  # Chromium helpers (tests/browser.py)
        from playcanvas_viewer import SuperSplatViewer

        browser = test_viewer.Browser(out / "chromium-profile")
        viewer = SuperSplatViewer(out / "site", browser)
        try:
            for name in ("splat.ply", "splat.sog", "splat.compressed.ply"):
                (viewer.folder / name).write_bytes((out / name).read_bytes())
            model_views = _render(model, [viewer_camera(c)[2] for c in cameras])
            renders = viewer_renders(viewer, ("splat.ply", "splat.sog", "splat.compressed.ply"), model, cameras)
            for row in rows:
                if row["file"] in renders:
                    row["browser_psnr_db"] = round(_psnr(renders[row["file"]], model_views), 1)
                    row["browser_vs_ply_db"] = round(_psnr(renders[row["file"]], renders["splat.ply"]), 1)
        finally:
            viewer.close()
            browser.quit()
        from test_export_glb import EnginePage, engine_renders

        browser = test_viewer.Browser(out / "chromium-profile-engine")
        page = EnginePage(out / "engine-site", browser)
        try:
            for name in ("splat.glb", "splat.ply"):
                (page.folder / name).write_bytes((out / name).read_bytes())
            renders = engine_renders(page, model, cameras)
            row = next(r for r in rows if r["format"] == "glb")
            row["browser_psnr_db"] = round(_psnr(renders["splat.glb"], renders["model"]), 1)
            row["browser_vs_ply_db"] = round(_psnr(renders["splat.glb"], renders["splat.ply"]), 1)
        finally:
            page.close()
            browser.quit()

    print(f"\n{args.load_config}: {n:,} gaussians, SH degree {model.config.sh_degree}, step {step}, "
          f"{len(cameras)} held-out views\n")  # fmt: skip
    print("| format | file | bytes | bytes/gaussian | PSNR vs model (reference op) "
          "| PSNR vs model (SuperSplat viewer) | PSNR vs the viewer's .ply render |\n"
          "|---|---|---:|---:|---:|---:|---:|")  # fmt: skip
    for r in rows:
        browser_psnr, vs_ply = (f"{r[k]} dB" if r[k] != "" else "" for k in ("browser_psnr_db", "browser_vs_ply_db"))
        print(f"| {r['format']} | {r['file']} | {r['bytes']:,} | {r['bytes_per_gaussian']} "
              f"| {r['psnr_vs_model_db']} dB | {browser_psnr} | {vs_ply} |")  # fmt: skip
    results = REPO / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    with open(results / f"export_formats_{args.label}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()

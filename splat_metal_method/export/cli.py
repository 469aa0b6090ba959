"""``splat-metal-export``: a trained run as .ply, .splat, .spz, .sog and/or .compressed.ply, in one go.

    splat-metal-export --load-config outputs/.../config.yml --output-dir exports/ --format ply splat spz
    splat-metal-export --load-config outputs/.../config.yml --output-dir exports/ --format sog compressed-ply

The run's gaussians are read from the checkpoint ``ns-export`` loads (the newest readable one;
splat-metal's checkpoint allow-list applies because importing this package installs it) without
building its pipeline (checkpoint.py: seconds instead of nerfstudio's ``eval_setup``, which loads
the datamanager too), and config.yml is read without importing the run's classes where it is a
splatfacto-family run (run_config.py; anything else takes nerfstudio's full load and its checks); the .sog's k-means runs where eval_setup would put the model (cuda if
available, else the best device this machine has). Any splatfacto run works, not only splat-metal.

``.ply`` is byte for byte what ``ns-export gaussian-splat`` writes (nerfstudio's ``write_ply`` bytes
over the same columns, written a block at a time: ply_file.py), plus, for a run trained with
``rasterize_mode antialiased``, the header line ``comment SplatRenderMode: mip`` that tells a viewer to
draw it with the mip filter (as every other format but .splat records it: gaussians.py); ``.splat``, ``.spz``, ``.sog`` and ``.compressed.ply`` are described in
splat_file.py, spz_file.py, sog_file.py and compressed_ply_file.py (the .sog's SH palette is k-means
on the device the run trains on: playcanvas.py).
``--format lod`` writes a folder, NAME.lod (lod_file.py: lod-meta.json and its SOG chunks), renamed into
place at the end as the files are.
Every requested file is first written to a hidden temporary file in the output folder; only when
all are complete are they renamed into place (engine/files.atomic_path), so a failure or Ctrl-C
leaves no partial file and the files already there untouched: SIGTERM and SIGHUP (``kill``, a closed
terminal) clean up as Ctrl-C does, and the hidden temporary files that a SIGKILLed or crashed export
left are removed by the next export into that folder (those of a process still running are kept).
Bad input (no such config, not a
gaussian-splatting run, no checkpoint, an unusable output folder, an --output-name that is not a
plain file name, nothing left to export) stops
with one message before anything is written.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Literal, Optional, Sequence, Tuple, get_args

Format = Literal["ply", "splat", "spz", "sog", "compressed-ply", "glb", "lod"]
FORMATS = get_args(Format)
EXTENSIONS = {"compressed-ply": "compressed.ply"}  # file name = output_name + "." + this (else the format)
PROG = "splat-metal-export"


class ExportError(SystemExit):
    """A clear, one-line reason the export cannot run; exits with status 1 and no traceback."""

    def __init__(self, message: str):
        super().__init__(f"{PROG}: {message}")


@dataclass
class ExportSplats:
    """Export a trained gaussian-splatting run (splat-metal or splatfacto) to .ply, .splat, .spz, .sog
    and .compressed.ply."""

    load_config: Path
    """config.yml of the run (as for ns-export)."""
    output_dir: Path
    """Folder for the files; created if missing."""
    format: Tuple[Format, ...] = ("ply", "splat", "spz")
    """One or more of: ply (3DGS .ply, as ns-export gaussian-splat), splat (antimatter15's 32 bytes per
    gaussian, no view-dependent colour), spz (Niantic's compressed format, keeps SH; --spz-version), sog
    (PlayCanvas/SuperSplat's WebP bundle, SH from a palette), compressed-ply (PlayCanvas's chunked
    .compressed.ply, SH at 8 bits), glb (binary glTF 2.0 with KHR_gaussian_splatting, in glTF's y-up axes,
    SH bands 1-3), lod (a folder NAME.lod: lod-meta.json and SOG chunks of --lod-levels levels of detail,
    which the PlayCanvas engine streams; lod_file.py)."""
    output_name: str = "splat"
    """File name without extension: splat.ply (ns-export's name), splat.splat, splat.spz, splat.sog,
    splat.compressed.ply."""
    spz_version: Literal[3, 4] = 3
    """Version of the .spz: 3 (gzip; every SPZ reader opens it, Spark included) or 4 (Niantic's
    current layout, one ZSTD stream per attribute; Niantic's library and splat-transform read it,
    Spark 2.2 does not)."""
    glb_compression: Literal["none", "spz"] = "none"
    """Compression of the .glb: none (float32 attributes, KHR_gaussian_splatting) or spz (one SPZ version 3
    stream in KHR_gaussian_splatting_compression_spz_2, the files CesiumJS draws; gltf_file.py)."""
    lod_levels: int = 4
    """Levels of detail in --format lod: the model, then each level a quarter of the one before."""
    obb_center: Optional[Tuple[float, float, float]] = None
    """Center of an oriented box to crop to (as ns-export gaussian-splat)."""
    obb_rotation: Optional[Tuple[float, float, float]] = None
    """Rotation of the box, RPY Euler angles in radians."""
    obb_scale: Optional[Tuple[float, float, float]] = None
    """Size of the box along each axis."""

    def main(self) -> List[Path]:
        """Writes the files; returns their paths."""
        formats = list(dict.fromkeys(self.format))  # in order, once each
        if not formats:
            raise ExportError(f"--format needs at least one of {', '.join(FORMATS)}")
        obb_parts = (self.obb_center, self.obb_rotation, self.obb_scale)
        if any(p is not None for p in obb_parts) and not all(p is not None for p in obb_parts):
            raise ExportError("a crop needs all three of --obb-center, --obb-rotation and --obb-scale")
        _check_output_name(self.output_name)
        if "lod" in formats and self.lod_levels < 1:
            raise ExportError(f"--lod-levels {self.lod_levels}: give 1 or more (1 = the model alone).")
        targets = [self.output_dir / f"{self.output_name}.{EXTENSIONS.get(fmt, fmt)}" for fmt in formats]
        _check_config_file(self.load_config)
        _prepare_output_dir(self.output_dir, targets)
        from .run_config import quick_run

        run = quick_run(self.load_config)  # without importing the run's classes; None: not sure, full load
        if run is None:
            run = _check_run(self.load_config)
        else:
            _check_checkpoints(self.load_config, run.checkpoint_dir)

        from .checkpoint import CheckpointProblem, load_run
        from .gaussians import export_gaussians

        started = time.perf_counter()
        try:
            model, checkpoint, step = load_run(run)
        except CheckpointProblem as e:
            raise ExportError(f"{e}; nothing was written.") from None
        g = export_gaussians(model, obb=None if self.obb_center is None else obb_parts)  # type: ignore[arg-type]
        loaded = time.perf_counter() - started
        dropped = ", ".join(
            f"{n:,} {why}" for n, why in ((g.n_cropped, "outside the box"), (g.n_nonfinite, "with NaN/Inf"),
                                          (g.n_low_opacity, "below opacity 1/255")) if n
        )  # fmt: skip
        if g.count == 0:
            raise ExportError(
                f"the model in {checkpoint} has no gaussians to export ({g.n_model:,} in the checkpoint"
                f"{': ' + dropped if dropped else ''}); nothing was written."
            )

        sizes = _write_all(
            g,
            formats,
            targets,
            device=model.device if {"sog", "lod"} & set(formats) else None,
            spz_version=self.spz_version,
            lod_levels=self.lod_levels,
            glb_compression=self.glb_compression,
        )  # torch for .sog and lod only

        say = _Summary()
        say(
            f"{g.count:,} gaussians (of {g.n_model:,}{'; ' + dropped if dropped else ''}), "
            f"SH degree {g.sh_degree}, step {step}, from {checkpoint} (loaded in {loaded:.1f} s)",
            title=PROG,
        )
        ply = sizes.get("ply")
        for fmt, target in zip(formats, targets):
            size, note, seconds = sizes[fmt]
            ratio = f", {ply[0] / size:.1f}x smaller than .ply" if ply and fmt != "ply" else ""
            say(f"  {target}  {size:,} bytes  {size / g.count:.1f} bytes/gaussian{ratio}{note}  ({seconds:.1f} s)")
        return targets


class _Summary:
    """Prints the summary's lines: on a terminal (or where FORCE_COLOR / TTY_COMPATIBLE asks for
    styles) through rich on nerfstudio's console, the title in bold and the first line's numbers
    highlighted, as nerfstudio's commands print; elsewhere (a pipe, a file, a test) the same text with
    print(), which is what rich writes there, without importing rich (~20-30 ms of a 0.4 s export).
    The text is printed as it is: no rich markup or emoji codes are read in it (a path with
    ``[run]`` in it stays whole)."""

    def __init__(self, file=None, console=None):
        self.file = file if file is not None else sys.stdout
        self.console = console  # rich's, for the styled lines (default: nerfstudio's CONSOLE)
        env = os.environ
        isatty = getattr(self.file, "isatty", None)
        try:
            tty = bool(isatty and isatty())
        except ValueError:  # a closed file, as rich answers
            tty = False
        self.styled = tty or "FORCE_COLOR" in env or "TTY_COMPATIBLE" in env  # else rich would write plain text
        self.lines = 0

    def __call__(self, text: str, title: Optional[str] = None) -> None:
        first, self.lines = self.lines == 0, self.lines + 1
        if not self.styled:
            print(f"{title}: {text}" if title else text, file=self.file, flush=True)
            return
        from rich.markup import escape

        if self.console is None:
            from nerfstudio.utils.rich_utils import CONSOLE

            self.console = CONSOLE
        body = escape(text)
        self.console.print(f"[bold]{escape(title)}[/bold]: {body}" if title else body, highlight=first, emoji=False,
                      soft_wrap=True)  # fmt: skip


def _check_config_file(path: Path) -> None:
    if not path.exists():
        raise ExportError(
            f"--load-config {path}: no such file. Give the config.yml of a run "
            "(ns-train writes it to outputs/<data>/<method>/<timestamp>/config.yml)."
        )
    if not path.is_file():
        raise ExportError(f"--load-config {path} is a folder; give the config.yml inside a run's folder.")


def _check_output_name(name: str) -> None:
    """A file name: the files stay in --output-dir."""
    if not name or name in (".", "..") or "/" in name or os.sep in name or (os.altsep and os.altsep in name):
        raise ExportError(
            f"--output-name {name!r} must be a plain file name (no '/' or '..'); choose the folder with --output-dir."
        )


def _prepare_output_dir(out: Path, targets: List[Path]) -> None:
    """Creates the folder and checks a file can be created in it, before the (slow) model load."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--output-dir {out} is a file, not a folder.")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".{PROG}-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ExportError(f"--output-dir {out}: cannot write there ({e.strerror or e}).") from None
    from ..engine.files import remove_stale_partials

    stale = remove_stale_partials(out)
    if stale:
        print(f"{PROG}: removed {len(stale)} partial file(s) that an interrupted export left in {out}.")
    for target in targets:
        if target.is_dir() and target.suffix != ".lod":  # lod: a folder, replaced at the end
            raise ExportError(f"{target} is a folder; remove it or choose another --output-name.")


def _check_run(config_path: Path):
    """The config is a nerfstudio run of a gaussian-splatting method and has a checkpoint; returns
    what the export reads of it (run_config.RunSettings). nerfstudio's full load: imports the run's classes."""
    import yaml
    from nerfstudio.engine.trainer import TrainerConfig
    from nerfstudio.models.splatfacto import SplatfactoModelConfig

    try:
        config = yaml.load(config_path.read_text(), Loader=yaml.Loader)
    except Exception as e:  # YAML syntax, or a class that cannot be imported (e.g. a plugin not installed)
        raise ExportError(f"{config_path} cannot be read as a run's config ({type(e).__name__}: {e}).") from None
    if not isinstance(config, TrainerConfig):
        raise ExportError(f"{config_path} is not a run's config.yml (no nerfstudio TrainerConfig in it).")
    model = getattr(getattr(config, "pipeline", None), "model", None)
    if not isinstance(model, SplatfactoModelConfig):
        raise ExportError(
            f"{config_path} is a {config.method_name} run; only gaussian-splatting runs (splat-metal, splatfacto) "
            "can be exported."
        )
    from nerfstudio.configs.method_configs import all_methods

    if config.method_name not in all_methods:  # as ns-export refuses it (eval_setup looks the method up)
        raise ExportError(
            f"{config_path} is a {config.method_name!r} run, a method not installed here "
            f"(installed: {', '.join(sorted(all_methods))})."
        )
    from .run_config import RunSettings

    ckpt_dir = config.get_checkpoint_dir()
    _check_checkpoints(config_path, ckpt_dir)
    return RunSettings(config.method_name, ckpt_dir, config.load_step, model)


def _check_checkpoints(config_path: Path, ckpt_dir: Path) -> None:
    if not sorted(Path(ckpt_dir).glob("step-*.ckpt")):
        raise ExportError(
            f"no checkpoint (step-*.ckpt) in {ckpt_dir}, where {config_path} says the run saved them"
            + (" (a relative path: run from the folder ns-train ran in)" if not Path(ckpt_dir).is_absolute() else "")
            + "."
        )


def _write_all(
    g,
    formats: List[str],
    targets: List[Path],
    device=None,
    spz_version: int = 3,
    lod_levels: int = 4,
    glb_compression: str = "none",
) -> dict:
    """Writes every format to a temporary file, then renames them all into place.
    Returns {format: (bytes, note, seconds)}."""
    from ..engine.files import atomic_folder, atomic_path
    from .progress import export_progress

    sizes = {}
    try:
        with contextlib.ExitStack() as stack:
            bar = stack.enter_context(export_progress())
            for fmt, target in zip(formats, targets):
                tmp = stack.enter_context(atomic_folder(target) if fmt == "lod" else atomic_path(target))
                started = time.perf_counter()
                size, note = _write_one(g, fmt, tmp, device, bar(target.name), spz_version, lod_levels, glb_compression)
                sizes[fmt] = (size, note, time.perf_counter() - started)
    except KeyboardInterrupt:
        raise ExportError("interrupted; nothing was written (files already there are untouched).") from None
    except ValueError as e:  # the model holds values a format cannot represent
        raise ExportError(f"{e}; nothing was written.") from None
    except OSError as e:
        raise ExportError(
            f"could not write {e.filename or 'the export'} ({e.strerror or e}); nothing was written."
        ) from None
    return sizes


def _write_one(g, fmt: str, path: Path, device=None, report=None, spz_version: int = 3,
               lod_levels: int = 4, glb_compression: str = "none") -> Tuple[int, str]:  # fmt: skip
    if fmt == "lod":
        from .lod_file import write_lod
        from .playcanvas import kmeans_device

        lod = write_lod(g, path, kmeans_device(device), report, lod_levels)
        dropped = (
            f", SH band {g.sh_degree} dropped (the format stores bands 1-3)" if g.sh_degree > lod.sh_degree else ""
        )
        counts = " / ".join(f"{c:,}" for c in lod.counts)
        return lod.bytes, f", {len(lod.counts)} levels of {counts} gaussians in {lod.files} chunks{dropped}"
    if fmt == "glb":
        from .gltf_file import write_glb

        size, note = write_glb(g, path, report, glb_compression)
        return size, (", SPZ-compressed (version 3 stream)" if glb_compression == "spz" else "") + note
    if fmt in ("sog", "compressed-ply"):
        from .playcanvas import write_playcanvas

        return write_playcanvas(g, fmt, path, device, report)
    if fmt == "ply":
        from .ply_file import write_ply

        rows = [0]

        def block(n: int) -> None:
            rows[0] += n
            if report is not None:
                report("rows", rows[0], g.count)

        write_ply(str(path), g.count, g.ply_columns(), block, comments=g.ply_comments())
        return path.stat().st_size, ""
    if fmt == "splat":
        from .splat_file import encode_splat

        path.write_bytes(encode_splat(g))
        return path.stat().st_size, ", no SH bands >= 1" if g.sh_degree > 0 else ""
    from .spz_file import encode_spz

    enc = encode_spz(g, spz_version)
    path.write_bytes(enc.data)
    clamped = ", ".join(f"{n:,} {name}" for name, n in enc.clamped.items())
    return len(enc.data), f", version {spz_version}, {enc.fractional_bits} fractional bits" + (
        f"; clamped to the format's range: {clamped}" if clamped else ""
    )


QUICK_FLAGS = {"--load-config": "load_config", "--output-dir": "output_dir", "--format": "format",
               "--output-name": "output_name"}  # fmt: skip


def quick_args(argv: Sequence[str]) -> Optional[ExportSplats]:
    """The command's arguments parsed without tyro, for the plain form only: each of --load-config,
    --output-dir (both given), --format and --output-name at most once, spelt so, as ``--flag value``
    (``--format`` with one or more of FORMATS), no value that starts with ``-``. That is what
    ``tyro.cli`` makes of it (tests/export/test_startup.py compares the two), without importing tyro
    and typeguard and building tyro's parser (~0.15 s of a 0.4 s export). None for anything else
    (--help, --obb-*, ``--flag=value``, another spelling, a mistake): tyro parses it, with its
    help and its error messages."""
    values: dict = {}
    key = None
    for token in argv:
        if token.startswith("-"):
            key = QUICK_FLAGS.get(token)
            if key is None or key in values:
                return None
            values[key] = []
        elif key is None:
            return None
        else:
            values[key].append(token)
    if "load_config" not in values or "output_dir" not in values:
        return None
    for key, given in values.items():
        if (
            not given
            or (key == "format" and any(f not in FORMATS for f in given))
            or (key != "format" and len(given) > 1)
        ):
            return None
    kw = {"output_name": values["output_name"][0]} if "output_name" in values else {}
    if "format" in values:
        kw["format"] = tuple(values["format"])
    return ExportSplats(load_config=Path(values["load_config"][0]), output_dir=Path(values["output_dir"][0]), **kw)


def parse_args(argv: Sequence[str]) -> ExportSplats:
    """The command line's ExportSplats: quick_args's where it answers, else tyro's (which prints the
    help or the mistake and exits)."""
    export = quick_args(argv)
    if export is not None:
        return export
    import tyro

    tyro.extras.set_accent_color("bright_yellow")
    return tyro.cli(tyro.conf.FlagConversionOff[ExportSplats], prog=PROG, args=list(argv))


def entrypoint() -> None:
    """Console script ``splat-metal-export``."""
    from ..engine.files import signals_interrupt

    export = parse_args(sys.argv[1:])
    try:
        with signals_interrupt():  # SIGTERM/SIGHUP clean up as Ctrl-C does
            export.main()
    except KeyboardInterrupt:  # before the files were being written (loading the run)
        raise ExportError("interrupted; nothing was written (files already there are untouched).") from None


if __name__ == "__main__":
    entrypoint()

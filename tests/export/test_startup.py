"""`splat-metal-export`'s start-up (issue 39: at 100k gaussians the command's time is mostly Python
starting): the plain command line is parsed without tyro (export/cli.quick_args, the same arguments
tyro gives), the summary is printed without rich where rich would print plain text, the progress bars
(rich) appear only once the writes take a while, and the .ply and .compressed.ply paths import none of
torch, tyro, typeguard, rich, nerfstudio or importlib.metadata (export/installed.py reads the two
facts the export needs of installed distributions).
"""

from __future__ import annotations

import io
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import demo_runs
import pytest
from cli_helpers import cli_env

from splat_metal_method.export import cli, installed, progress

pytestmark = pytest.mark.timeout(600)

# modules the quick formats must not import (each 10-2000 ms of start-up)
HEAVY = ("torch", "tyro", "typeguard", "rich", "nerfstudio", "importlib.metadata", "unittest.mock", "asyncio")

PLAIN = [  # the forms quick_args answers
    ["--load-config", "a/config.yml", "--output-dir", "out"],
    ["--output-dir", "out", "--load-config", "a/config.yml"],
    ["--load-config", "c.yml", "--output-dir", "o", "--format", "ply"],
    ["--load-config", "c.yml", "--output-dir", "o", "--format", "compressed-ply", "ply", "ply"],
    ["--load-config", "c.yml", "--format", "sog", "spz", "splat", "--output-dir", "o", "--output-name", "x y"],
    ["--load-config", "c.yml", "--output-dir", "o", "--output-name", "../x"],  # main() refuses it, with its message
    ["--load-config", "c.yml", "--output-dir", "", "--output-name", ""],
    ["--load-config", "/abs/c.yml", "--output-dir", "~/o", "--output-name", "@name"],
]
OTHER = [  # what quick_args leaves to tyro (its help, its messages, the rarer forms)
    [],
    ["--help"],
    ["-h"],
    ["--load-config", "c.yml"],
    ["--load-config", "c.yml", "--output-dir", "o", "--format"],
    ["--load-config", "c.yml", "--output-dir", "o", "--format", "jpeg"],
    ["--load-config", "c.yml", "--output-dir", "o", "o2"],
    ["--load-config", "c.yml", "--output-dir", "o", "--output-dir", "p"],
    ["--load-config=c.yml", "--output-dir", "o"],
    ["--load_config", "c.yml", "--output-dir", "o"],
    ["--load-conf", "c.yml", "--output-dir", "o"],
    ["--load-config", "c.yml", "--output-dir", "o", "--obb-center", "0", "0", "0"],
    ["--load-config", "c.yml", "--output-dir", "o", "--output-name", "-x"],
    ["c.yml", "--load-config", "c.yml", "--output-dir", "o"],
    ["--load-config", "c.yml", "--output-dir", "o", "--"],
]


def _tyro(argv):
    import tyro

    return tyro.cli(tyro.conf.FlagConversionOff[cli.ExportSplats], prog=cli.PROG, args=argv)


@pytest.mark.parametrize("argv", PLAIN, ids=lambda a: " ".join(a))
def test_quick_args_are_tyros(argv):
    quick = cli.quick_args(argv)
    assert quick is not None, argv
    assert quick == _tyro(argv)
    assert all(type(a) is type(b) for a, b in zip(vars(quick).values(), vars(_tyro(argv)).values()))


@pytest.mark.parametrize("argv", OTHER, ids=lambda a: " ".join(a) or "(none)")
def test_anything_else_is_left_to_tyro(argv):
    assert cli.quick_args(argv) is None


def test_help_and_mistakes_are_tyros(capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: splat-metal-export" in out and "--output-name" in out and "compressed-ply" in out
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--load-config", "c.yml", "--output-dir", "o", "--format", "jpeg"])
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert "invalid choice 'jpeg'" in captured.out + captured.err


def test_installed_reads_what_importlib_metadata_reads():
    assert installed.version("nerfstudio") == metadata.version("nerfstudio")
    assert installed.version("numpy") == metadata.version("numpy")
    group = "nerfstudio.method_configs"
    ours = installed.entry_point_names("splat-metal-method", group)
    assert ours and set(ours) == {ep.name for ep in metadata.entry_points(group=group) if ep.value.startswith("splat_")}


def test_summary_prints_what_rich_prints_off_a_terminal():
    """Off a terminal the summary is print()'s; it is the text rich writes there, a path with what
    rich would read as markup or emoji included (printed whole)."""
    from rich.console import Console

    lines = [("9 gaussians, from /tmp/[run]/a:smile:b/[bold]x (loaded in 0.1 s)", cli.PROG),
             ("  /o/splat.ply  1,234 bytes  248.0 bytes/gaussian  (0.1 s)", None)]  # fmt: skip
    plain, styled = io.StringIO(), io.StringIO()
    say = cli._Summary(file=plain)
    assert not say.styled  # a StringIO is no terminal
    rich_say = cli._Summary(file=styled, console=Console(file=styled, width=120))
    rich_say.styled = True  # through rich, which writes plain text to a file that is no terminal
    for text, title in lines:
        say(text, title=title)
        rich_say(text, title=title)
    assert plain.getvalue() == styled.getvalue()
    assert "/tmp/[run]/a:smile:b/[bold]x" in plain.getvalue()


def test_progress_bars_show_on_long_writes_only():
    from rich.console import Console

    def write(after, seconds):
        screen = io.StringIO()
        console = Console(file=screen, force_terminal=True, width=100)
        with progress.export_progress(after=after, console=console) as bar:
            report = bar("splat.ply")
            report("rows", 10, 100)
            time.sleep(seconds)
            report("rows", 100, 100)
        return screen.getvalue()

    assert write(after=5.0, seconds=0.05) == ""  # done before the bars were due: none shown
    shown = write(after=0.05, seconds=0.6)
    assert "writing splat.ply: rows" in shown and "10%" in shown


def test_quick_formats_import_nothing_heavy(tmp_path_factory, tmp_path):
    """The command as its console script runs it (entrypoint, sys.argv), in a fresh interpreter."""
    config = demo_runs.sh3_run(tmp_path_factory)
    for fmt in ("ply", "compressed-ply"):
        code = (
            "import sys\nfrom splat_metal_method.export.cli import entrypoint\n"
            f"sys.argv = ['splat-metal-export', '--load-config', {str(config)!r}, '--output-dir', {str(tmp_path)!r}, "
            f"'--format', {fmt!r}]\nentrypoint()\n"
            f"print('imported:', sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
        )
        result = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True,
                                timeout=300)  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        assert "imported: []" in result.stdout, result.stdout + result.stderr
        assert " bytes/gaussian" in result.stdout and Path(tmp_path / f"splat.{cli.EXTENSIONS.get(fmt, fmt)}").is_file()

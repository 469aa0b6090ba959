"""Exports that are stopped or misnamed leave nothing half-written (export/cli.py, engine/reliability.py):

* SIGTERM and SIGHUP (``kill``, a closed terminal) during ``splat-metal-export`` clean up as Ctrl-C
  does: no temporary file left, the files already there untouched, one line, exit 1;
* the hidden ``.NAME.partial-PID`` files a SIGKILLed export left are removed by the next export into
  that folder, those of a process that still runs are not;
* the same for a SIGKILLed ``--format lod``'s hidden folder (tests/export/test_export_lod.py kills a real one), only
  a folder holding atomic_folder's mark, never a user's folder of a matching name;
* ``--output-name`` cannot leave ``--output-dir``.
Real signals (os.kill of this process) are sent at a chosen moment of a real export of a trained run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import demo_runs
import pytest
from bad_input_table import record

from splat_metal_method.engine.files import PARTIAL_FOLDER_MARK, atomic_folder
from splat_metal_method.engine.reliability import atomic_path, remove_stale_partials, signals_interrupt
from splat_metal_method.export import cli


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_signal_removes_the_temporary_file(tmp_path, signum):
    target = tmp_path / "splat.ply"
    target.write_bytes(b"the previous export")
    with pytest.raises(KeyboardInterrupt):
        with signals_interrupt(), atomic_path(target) as tmp:
            tmp.write_bytes(b"half of a new one")
            os.kill(os.getpid(), signum)
    assert [p.name for p in tmp_path.iterdir()] == ["splat.ply"] and target.read_bytes() == b"the previous export"
    assert signal.getsignal(signum) in (signal.SIG_DFL, signal.SIG_IGN, signal.default_int_handler)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_export_stopped_by_a_signal_writes_nothing(tmp_path_factory, tmp_path, monkeypatch, signum, request):
    config = demo_runs.sh0_run(tmp_path_factory)
    out = tmp_path / "out"
    out.mkdir()
    (out / "splat.splat").write_bytes(b"the previous export")
    write_one = cli._write_one

    def then_signal(g, fmt, path, *args):  # the signal comes after the .ply is staged
        result = write_one(g, fmt, path, *args)
        assert path.is_file()
        os.kill(os.getpid(), signum)
        return result

    monkeypatch.setattr(cli, "_write_one", then_signal)
    monkeypatch.setattr(sys, "argv", [cli.PROG, "--load-config", str(config), "--output-dir", str(out)])
    with pytest.raises(SystemExit) as info:
        cli.entrypoint()
    message = str(info.value.code)
    if signum == signal.SIGTERM:
        record("export/sigterm-while-writing", "`kill` (SIGTERM) or a closed terminal (SIGHUP) while "
               "`splat-metal-export` writes", message)  # fmt: skip
    assert "interrupted; nothing was written" in message
    assert sorted(p.name for p in out.iterdir()) == ["splat.splat"]
    assert (out / "splat.splat").read_bytes() == b"the previous export"


def test_stale_partial_files_are_removed_by_the_next_export(tmp_path_factory, tmp_path, capsys):
    config = demo_runs.sh0_run(tmp_path_factory)
    out = tmp_path / "out"
    out.mkdir()
    dead = out / f".splat.ply.partial-{_dead_pid()}"  # what a SIGKILLed export leaves
    dead.write_bytes(b"x" * 1000)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        alive = out / f".splat.spz.partial-{sleeper.pid}"  # another export, still writing
        alive.write_bytes(b"y")
        (out / ".keep").write_text("mine")
        written = cli.ExportSplats(load_config=config, output_dir=out, format=("ply",)).main()
        printed = capsys.readouterr().out
        line = next(x for x in printed.splitlines() if "partial file" in x)
        record("export/stale-partial-files", "files left by a SIGKILLed export in `--output-dir` (exit status 0: "
               "the export goes on)", line, out=out)  # fmt: skip
        assert written == [out / "splat.ply"] and (out / "splat.ply").stat().st_size > 0
        assert not dead.exists() and alive.exists() and (out / ".keep").exists()
        assert remove_stale_partials(out) == []
    finally:
        sleeper.kill()
        sleeper.wait()
    assert remove_stale_partials(out) == [alive]  # its process is gone now


def test_stale_partial_folders_only_with_the_mark_and_a_dead_writer(tmp_path):
    """A folder is removed only if it is atomic_folder's (the name and its mark) and its process is gone."""
    dead = _dead_pid()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with atomic_folder(tmp_path / "live.lod") as live:  # this process's own partial folder, while writing
            (live / "lod-meta.json").write_text("{}")
            folders = {
                "ours, dead": (tmp_path / f".splat.lod.partial-{dead}", True),
                "ours, its writer alive": (tmp_path / f".other.lod.partial-{sleeper.pid}", True),
                "a user's, named like ours": (tmp_path / f".photos.partial-{dead}", False),
                "ours, misnamed": (tmp_path / f"splat.lod.partial-{dead}", True),
            }
            for path, marked in folders.values():
                (path / "0_0").mkdir(parents=True)
                (path / "0_0" / "meta.json").write_text("{}")
                if marked:
                    (path / PARTIAL_FOLDER_MARK).write_bytes(b"")
            link = tmp_path / f".link.lod.partial-{dead}"
            link.symlink_to(folders["a user's, named like ours"][0])
            assert remove_stale_partials(tmp_path) == [folders["ours, dead"][0]]
            assert [name for name, (path, _) in folders.items() if not path.exists()] == ["ours, dead"]
            assert live.is_dir() and link.is_symlink()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert (tmp_path / "live.lod" / "lod-meta.json").is_file() and not (
        tmp_path / "live.lod" / PARTIAL_FOLDER_MARK
    ).exists()
    assert remove_stale_partials(tmp_path) == [folders["ours, its writer alive"][0]]  # its process is gone now


def test_a_folder_moved_aside_by_a_dead_writer_is_put_back(tmp_path):
    """atomic_folder moves the earlier folder to ``.NAME.old-PID`` just before the new one takes its place: a
    writer killed between those two renames left NAME missing; the next export puts the earlier folder back.
    With NAME present (the new folder took its place), the hidden copy is left alone."""
    dead = _dead_pid()
    aside = tmp_path / f".splat.lod.old-{dead}"
    (aside / "0_0").mkdir(parents=True)
    (aside / "lod-meta.json").write_text('{"the previous": "export"}')
    kept = tmp_path / f".scene.lod.old-{dead}"
    kept.mkdir()
    (tmp_path / "scene.lod").mkdir()
    assert remove_stale_partials(tmp_path) == []
    assert (tmp_path / "splat.lod" / "lod-meta.json").read_text() == '{"the previous": "export"}'
    assert (tmp_path / "splat.lod" / "0_0").is_dir() and not aside.exists()
    assert kept.is_dir() and (tmp_path / "scene.lod").is_dir()


@pytest.mark.parametrize("name", ["../x", "sub/x", "..", "", "/tmp/x"])
def test_output_name_cannot_leave_the_output_dir(tmp_path, name):
    with pytest.raises(SystemExit) as info:
        cli.ExportSplats(load_config=tmp_path / "config.yml", output_dir=tmp_path / "out", output_name=name).main()
    message = str(info.value.code)
    if name == "../x":
        record("export/output-name-outside", "`splat-metal-export --output-name ../x`", message)
    assert message.startswith(f"{cli.PROG}: --output-name ") and "plain file name" in message
    assert not (tmp_path / "out").exists() and not Path(tmp_path.parent / "x.ply").exists()

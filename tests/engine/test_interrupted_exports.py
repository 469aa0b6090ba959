"""Exports that are stopped or misnamed leave nothing half-written (export/cli.py, engine/reliability.py):

* SIGTERM and SIGHUP (``kill``, a closed terminal) during ``splat-metal-export`` clean up as Ctrl-C
  does: no temporary file left, the files already there untouched, one line, exit 1;
* the hidden ``.NAME.partial-PID`` files a SIGKILLed export left are removed by the next export into
  that folder, those of a process that still runs are not;
* a SIGKILLed ``--format lod`` leaves its hidden ``.NAME.partial-PID`` folder, which the next export removes (only
  a folder holding atomic_folder's mark: a user's folder of a matching name stays);
* ``--output-name`` cannot leave ``--output-dir``.
Real signals (os.kill of this process) are sent at a chosen moment of a real export of a trained run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import demo_runs
import pytest
import torch
from bad_input_table import record
from cli_helpers import cli_env
from test_export_roundtrip import _copy_run_with_checkpoint

from splat_metal_method.engine.files import PARTIAL_FOLDER_MARK
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


LOD_GAUSSIANS = 60_000  # enough that the level-0 chunk's encoding takes seconds: the kill lands mid-write


def _wait_for(predicate, proc, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the export exited ({proc.returncode}) before it was mid-write"
        assert time.monotonic() < end, "timed out waiting for the export to be mid-write"
        time.sleep(0.02)


def test_a_sigkilled_lod_export_leaves_a_folder_the_next_export_removes(tmp_path_factory, tmp_path):
    gen = torch.Generator().manual_seed(3)

    def edit(params):  # LOD_GAUSSIANS drawn from the run's, all above the opacity cut
        rows = torch.randint(params["means"].shape[0], (LOD_GAUSSIANS,), generator=gen)
        for key in params:
            params[key] = params[key][rows]
        params["means"] = params["means"] + 0.05 * torch.randn(params["means"].shape, generator=gen)
        params["opacities"] = torch.full_like(params["opacities"], 2.0)

    config = _copy_run_with_checkpoint(demo_runs.sh3_run(tmp_path_factory), tmp_path / "run", edit)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    users = out / f".photos.partial-{_dead_pid()}"  # a user's folder named like ours, its "pid" gone: not ours
    users.mkdir()
    (users / "a.jpg").write_bytes(b"jpeg")
    code = (
        "import sys\nfrom splat_metal_method.export.cli import entrypoint\n"
        f"sys.argv = ['splat-metal-export', '--load-config', {str(config)!r}, '--output-dir', {str(out)!r}, "
        "'--format', 'lod']\nentrypoint()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], env=cli_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    partial = out / f".splat.lod.partial-{proc.pid}"
    try:
        _wait_for(lambda: (partial / "lod-meta.json").is_file(), proc)  # the levels are made; chunks being written
        proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "splat.lod").exists() and (partial / PARTIAL_FOLDER_MARK).is_file()  # killed mid-write
    meta = json.loads((partial / "lod-meta.json").read_text())
    assert not all((partial / name).is_file() for name in meta["filenames"]), "the export had finished"

    written = cli.ExportSplats(load_config=config, output_dir=out, format=("lod",)).main()
    assert written == [out / "splat.lod"]
    assert not partial.exists(), "the SIGKILLed export's partial folder is still there"
    assert sorted(p.name for p in out.iterdir()) == sorted(["notes.txt", users.name, "splat.lod"])
    assert (out / "notes.txt").read_text() == "mine" and (users / "a.jpg").read_bytes() == b"jpeg"
    meta = json.loads((out / "splat.lod" / "lod-meta.json").read_text())  # the finished folder is complete
    assert sum(meta["counts"]) == meta["count"] and meta["counts"][0] == LOD_GAUSSIANS
    chunks = {p.relative_to(out / "splat.lod").as_posix() for p in (out / "splat.lod").rglob("meta.json")}
    assert chunks == set(meta["filenames"]) and not (out / "splat.lod" / PARTIAL_FOLDER_MARK).exists()


@pytest.mark.parametrize("name", ["../x", "sub/x", "..", "", "/tmp/x"])
def test_output_name_cannot_leave_the_output_dir(tmp_path, name):
    with pytest.raises(SystemExit) as info:
        cli.ExportSplats(load_config=tmp_path / "config.yml", output_dir=tmp_path / "out", output_name=name).main()
    message = str(info.value.code)
    if name == "../x":
        record("export/output-name-outside", "`splat-metal-export --output-name ../x`", message)
    assert message.startswith(f"{cli.PROG}: --output-name ") and "plain file name" in message
    assert not (tmp_path / "out").exists() and not Path(tmp_path.parent / "x.ply").exists()

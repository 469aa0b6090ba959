"""Helpers for tests that drive splat-metal through nerfstudio's real command lines in subprocesses.

``run_cli("ns-train", "splat-metal", ...)`` runs the console script installed next to this Python
(the venv's), with a hard timeout that kills the whole process group, offline-safe environment
(WANDB_MODE=disabled, HF_HUB_OFFLINE=1, and a TORCH_HOME of the caller's choosing so that nothing
is downloaded into or read from the user's cache) and captured output.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

REPO = Path(__file__).resolve().parents[1]
DEMO_ARGS = REPO / "configs" / "demo.args"


@dataclass
class CliResult:
    args: List[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def tail(self, n: int = 60) -> str:
        """The last ``n`` lines of stdout and stderr, for assertion messages."""
        out = "\n".join(self.stdout.splitlines()[-n:])
        err = "\n".join(self.stderr.splitlines()[-n:])
        head = f"$ {' '.join(self.args)}\n(exit {self.returncode}, {self.seconds:.1f} s)"
        return f"{head}\n--- stdout\n{out}\n--- stderr\n{err}"


class CliTimeout(AssertionError):
    pass


def executable(name: str) -> str:
    """The console script ``name`` of the Python running the tests (the venv), else from PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.is_file():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found next to {sys.executable} or on PATH; is nerfstudio installed?")
    return found


def cli_env(torch_home: Optional[Path] = None, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(
        WANDB_MODE="disabled",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        COLUMNS="200",  # rich wraps at the terminal width; keep paths on one line
        PYTHONFAULTHANDLER="1",  # a hung process's threads can be dumped (hung_process_report: SIGABRT)
    )
    for name in [n for n in env if n.startswith("SPLAT_METAL_")]:
        del env[name]  # backend/render-device overrides: the tests get what a user gets by default
    if torch_home is not None:
        env["TORCH_HOME"] = str(torch_home)
    if extra:
        env.update(extra)
    return env


def run_cli(
    command: Union[str, Sequence[str]],
    *args: Union[str, Path, int, float],
    cwd: Optional[Path] = None,
    timeout: float = 300.0,
    torch_home: Optional[Path] = None,
    env: Optional[Dict[str, str]] = None,
) -> CliResult:
    """Runs ``command *args`` (``command`` a console script name like "ns-train", or an argv prefix
    like [sys.executable, "-m", "pkg"]) and returns its result. Raises CliTimeout (an
    AssertionError, so the test fails with the output so far) if it runs longer than ``timeout``."""
    prefix = [executable(command)] if isinstance(command, str) else [str(c) for c in command]
    argv = prefix + [str(a) for a in args]
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        cwd=str(cwd) if cwd else None,
        env=env if env is not None else cli_env(torch_home),
        stdin=subprocess.DEVNULL,  # a prompt (nerfstudio asks some questions) must not hang the test
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,  # its own process group, so a timeout kills its children too
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        result = CliResult(argv, -9, stdout, stderr, time.perf_counter() - start)
        raise CliTimeout(f"timed out after {timeout:.0f} s (a hang?)\n{result.tail()}") from None
    return CliResult(argv, proc.returncode, stdout, stderr, time.perf_counter() - start)


def hung_process_report(proc: subprocess.Popen, log_path: Optional[Path] = None, lines: int = 120) -> str:
    """For the assertion message of a test whose subprocess hung: every Python thread's stack
    (``py-spy dump`` where it is installed; else SIGABRT, which cli_env's PYTHONFAULTHANDLER turns into
    a dump of every thread on stderr, so ``log_path`` must be where that goes), then the log's tail.
    The process is gone afterwards."""
    report = []
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy and proc.poll() is None:
        try:
            dump = subprocess.run([spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=60)
            report.append(f"--- py-spy dump --pid {proc.pid}\n{dump.stdout}{dump.stderr}")
        except (OSError, subprocess.SubprocessError) as e:
            report.append(f"--- py-spy failed: {e}")
    if proc.poll() is None:
        proc.send_signal(signal.SIGABRT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if log_path is not None and Path(log_path).exists():
        tail = Path(log_path).read_text(errors="replace").splitlines()[-lines:]
        report.append(f"--- the last {lines} lines of {log_path}\n" + "\n".join(tail))
    return "\n".join(report)


def latest_config(output_dir: Path) -> Path:
    """The newest config.yml that ns-train wrote under ``output_dir``."""
    configs = sorted(Path(output_dir).rglob("config.yml"), key=lambda p: p.stat().st_mtime_ns)
    if not configs:
        raise FileNotFoundError(f"no config.yml under {output_dir}")
    return configs[-1]


def small_scene(folder: Path, width: int, height: int, views: int = 12, points: int = 300) -> Path:
    """The bundled demo scene at ``width`` x ``height`` with its first ``points`` seed points, in
    ``folder``/scene: small enough for several ns-train runs in one test module."""
    from splat_metal_method.data import demo_scene

    out = Path(folder) / "scene"
    demo_scene.generate(out, width=width, height=height, views=views, seed=0)
    xyz, rgb = demo_scene.read_ply(out / demo_scene.PLY_NAME)
    demo_scene.write_ply(out / demo_scene.PLY_NAME, xyz[:points], rgb[:points])
    return out


def run_dir(output_dir: Path, timestamp: str, method: str = "splat-metal", scene: str = "scene") -> Path:
    """Where ns-train puts a run of ``method`` on the data folder named ``scene`` (config.yml, checkpoints)."""
    return Path(output_dir) / scene / method / timestamp


def final_checkpoint(run_dir: Path) -> dict:
    """The run's last checkpoint, loaded as --load-dir and ns-export load it (weights_only)."""
    import torch

    return torch.load(checkpoints(run_dir)[-1], map_location="cpu")


def checkpoints(run_dir: Path) -> List[Path]:
    """step-*.ckpt files of a run (``run_dir`` is the folder holding config.yml), by step."""
    return sorted((Path(run_dir) / "nerfstudio_models").glob("step-*.ckpt"))


def checkpoint_step(path: Path) -> int:
    return int(Path(path).stem.split("-")[1])


def tensorboard_scalars(run_dir: Path, tag: str) -> Dict[int, float]:
    """{step: value} of a scalar a run logged to tensorboard (``--vis tensorboard``); {} if none."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)} if tag in events.Tags()["scalars"] else {}


def demo_args(**overrides: Union[str, int, float]) -> List[str]:
    """configs/demo.args as an argument list (comments dropped), with options replaced or added:
    ``demo_args(max_num_iterations=100)`` replaces ``--max-num-iterations``; keys map ``_`` to
    ``-`` and ``__`` to ``.`` (``pipeline__model__warmup_length`` -> ``--pipeline.model.warmup-length``)."""
    options: Dict[str, List[str]] = {}
    for line in DEMO_ARGS.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        flag, *values = line.split()
        options[flag] = values
    for key, value in overrides.items():
        options["--" + key.replace("__", ".").replace("_", "-")] = [str(value)]
    return [item for flag, values in options.items() for item in (flag, *values)]


def snapshot(root: Path) -> Dict[str, tuple]:
    """{relative path: (size, mtime_ns, bytes)} of every file under ``root`` (small trees only)."""
    root = Path(root)
    return {
        p.relative_to(root).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def interrupt_after_checkpoint(args, log_path: Path, env, run_dir: Path, after: int, timeout: float = 600):
    """Runs ``args`` (an ns-train command) in its own process group and Ctrl-C's it (SIGINT to the
    group, as a terminal sends it) once the checkpoint of step ``after`` exists in ``run_dir``.
    Returns (exit code, output); the output is also kept in ``log_path``."""

    with open(log_path, "w+") as log:
        proc = subprocess.Popen([str(a) for a in args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)  # fmt: skip
        try:
            deadline = time.monotonic() + timeout
            while not any(checkpoint_step(c) >= after for c in checkpoints(run_dir)):
                assert proc.poll() is None and time.monotonic() < deadline, "ns-train ended before the Ctrl-C"
                time.sleep(0.02)
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"no exit within 300 s of Ctrl-C\n{hung_process_report(proc, log_path)}") from None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.seek(0)
        return proc.returncode, log.read()


def checkpoint_differences(a, b, where="") -> list:
    """Where two checkpoint trees differ (tensors compared bit for bit, with dtype and shape)."""
    import torch

    if torch.is_tensor(a) or torch.is_tensor(b):
        same = torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
        return [] if same and torch.equal(a, b) else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [d for k in a for d in checkpoint_differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in checkpoint_differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]

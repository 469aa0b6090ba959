"""Reliability through the real command lines, on CPU, where a user would meet each case:

* NaN in a gradient (planted by tests/inject.py around the real ns-train) with
  ``--pipeline.model.nonfinite recover`` (default) and ``stop``;
* Ctrl-C (SIGINT to the process group, as a terminal sends it) during ``ns-train`` with the viewer
  on, after a real headless Chromium connected, disconnected, reconnected and was killed several
  times mid-training; then resuming with --load-dir;
* ``ns-export gaussian-splat`` interrupted (SIGKILL and Ctrl-C) while writing over an earlier export;
* determinism: the same --machine.seed twice, 100 steps, bit-identical losses at every step.

Subprocesses that do not depend on each other run in parallel (threads around cli_helpers.run_cli):
the machine has few cores, and most of each run is start-up. Sizes: the shared 64x48 demo scene
(demo_runs.py); for determinism a 32x24 one with 400 seed points.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

import demo_runs
import inject
import psutil
import pytest
import torch
import yaml
from cli_helpers import (
    CliResult,
    checkpoint_step,
    checkpoints,
    cli_env,
    demo_args,
    executable,
    hung_process_report,
    run_cli,
)

from splat_metal_method.data import demo_scene
from splat_metal_method.engine.trainer import INTERRUPTED_EXIT_CODE

pytestmark = pytest.mark.timeout(900)

QUIET = dict(steps_per_eval_image=10**6, steps_per_eval_all_images=10**6)  # no eval renders: time
TRACEBACK = re.compile(r"Traceback \(most recent call last\)|Exception in thread")


def _flat(text: str) -> str:
    """Output with rich's line wrapping undone (paths and messages can be split across lines)."""
    return " ".join(text.split())


def _scalars(run_dir: Path, tag: str) -> Dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)} if tag in events.Tags()["scalars"] else {}


def _parallel(*calls):
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def _train(scene: Path, output_dir: Path, timestamp: str, *extra, env=None, timeout=420, fault=None,
           **options) -> CliResult:  # fmt: skip
    """ns-train; ``fault``: (fault, spec) that tests/inject.py plants first."""
    args = ["splat-metal", *demo_args(**{**QUIET, **options}), "--data", scene, "--output-dir", output_dir,
            "--timestamp", timestamp, *extra]  # fmt: skip
    command = "ns-train" if fault is None else inject.command(*fault, "ns-train")
    return run_cli(command, *args, timeout=timeout, env=env or cli_env(output_dir / "torch_home"))


def _run_dir(output_dir: Path, scene: Path, timestamp: str) -> Path:
    return output_dir / scene.name / "splat-metal" / timestamp


def _resume_command(text: str) -> List[str]:
    """The command after "Resume with:" in splat-metal's message, as arguments."""
    match = re.search(r"Resume with: (\S*ns-train .*?--max-num-iterations \d+)", text)
    assert match, text[-3000:]
    return shlex.split(match.group(1))


def _no_partial_files(folder: Path) -> List[Path]:
    return [p for p in folder.rglob("*") if ".partial-" in p.name]


# ----------------------------------------------------------------------------- NaN / Inf, determinism
NAN_STEPS, NAN_AT, NAN_ROWS = 8, 5, 3
DET_STEPS = 100


def _tiny_scene(folder: Path) -> Path:
    """24x16 (two tiles, non-square), 12 views, 300 seed points: cheap steps for the 100-step runs."""
    out = folder / "tiny"
    demo_scene.generate(out, width=24, height=16, views=12, seed=0)
    xyz, rgb = demo_scene.read_ply(out / demo_scene.PLY_NAME)
    demo_scene.write_ply(out / demo_scene.PLY_NAME, xyz[:300], rgb[:300])
    return out


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """The independent runs, in parallel: NaN recover, NaN stop, and three determinism runs (seed 7
    twice for 100 steps, seed 8 for 5)."""
    scene = demo_runs.demo_scene(tmp_path_factory)
    out = tmp_path_factory.mktemp("batch")
    tiny = _tiny_scene(out)
    fault = ("nan-at-step", f"{NAN_AT}:scales:{NAN_ROWS}")
    nan = dict(max_num_iterations=NAN_STEPS, steps_per_save=2, fault=fault)  # warmup 200: no densification
    # Densification (low threshold, so it certainly fires) at steps 60 and 90 is inside the 100 steps.
    det = dict(max_num_iterations=DET_STEPS, steps_per_save=10**6, logging__steps_per_log=1,
               pipeline__model__warmup_length=30, pipeline__model__refine_every=30,
               pipeline__model__densify_grad_thresh=0.0001, machine__device_type="cpu")  # fmt: skip
    runs = _parallel(
        lambda: _train(scene, out, "recover", **nan),
        lambda: _train(scene, out, "stop", "--pipeline.model.nonfinite", "stop", **nan),
        lambda: _train(tiny, out, "a", "--machine.seed", "7", **det),
        lambda: _train(tiny, out, "b", "--machine.seed", "7", **det),
        lambda: _train(tiny, out, "c", "--machine.seed", "8", **{**det, "max_num_iterations": 5}),
    )
    return dict(scene=scene, tiny=tiny, out=out, **dict(zip(["recover", "stop", "a", "b", "c"], runs, strict=True)))


@pytest.fixture(scope="module")
def nan_runs(batch):
    return batch["scene"], batch["out"], batch["recover"], batch["stop"]


def test_nan_recover_drops_the_gaussians_and_finishes(nan_runs):
    scene, out, result, _ = nan_runs
    assert result.returncode == 0, result.tail()
    text = _flat(result.output)
    assert (
        f"splat-metal: step {NAN_AT}: non-finite values: NaN in the gradient of scales ({NAN_ROWS} gaussians)" in text
    ), result.tail()
    assert f"Dropped those {NAN_ROWS} of {demo_scene.N_SEED_POINTS:,} gaussians" in text
    assert not TRACEBACK.search(result.output), result.tail()
    (final,) = checkpoints(_run_dir(out, scene, "recover"))
    assert checkpoint_step(final) == NAN_STEPS - 1
    state = torch.load(final, map_location="cpu")
    for name in ("means", "scales", "quats", "features_dc", "features_rest", "opacities"):
        param = state["pipeline"][f"_model.gauss_params.{name}"]
        assert param.shape[0] == demo_scene.N_SEED_POINTS - NAN_ROWS and torch.isfinite(param).all(), name
        assert state["optimizers"][name]["state"][0]["exp_avg"].shape == param.shape
    losses = _scalars(_run_dir(out, scene, "recover"), "Train Loss")
    assert losses and all(v == v for v in losses.values()), losses  # no NaN loss logged


def test_nan_stop_keeps_the_last_good_checkpoint(nan_runs):
    scene, out, _, result = nan_runs
    run_dir = _run_dir(out, scene, "stop")
    assert result.returncode == 1, result.tail()
    text = _flat(result.output)
    assert f"splat-metal: step {NAN_AT}: non-finite values: NaN in the gradient of scales" in text, result.tail()
    assert "Training stopped before saving this step (--pipeline.model.nonfinite stop)" in text
    good = run_dir / "nerfstudio_models" / f"step-{NAN_AT - 1:09d}.ckpt"  # saves every 2 steps: 0, 2, 4
    assert f"The last good checkpoint is kept: {good}" in text, result.tail()
    assert checkpoints(run_dir) == [good]
    state = torch.load(good, map_location="cpu")
    assert all(torch.isfinite(v).all() for v in state["pipeline"].values() if v.is_floating_point())
    resume = _resume_command(text)
    assert resume[resume.index("--load-dir") + 1] == str(good.parent)
    assert resume[resume.index("--max-num-iterations") + 1] == str(NAN_STEPS - NAN_AT)
    assert not TRACEBACK.search(result.output), result.tail()


def test_same_seed_gives_bit_identical_losses_on_cpu(batch):
    for name in "abc":
        assert batch[name].returncode == 0, batch[name].tail()
    runs = [_run_dir(batch["out"], batch["tiny"], t) for t in "abc"]
    la, lb, lc = (_scalars(r, "Train Loss") for r in runs)
    assert sorted(la) == list(range(DET_STEPS)), sorted(la)
    diffs = [s for s in la if la[s] != lb[s]]
    assert not diffs, f"losses differ at steps {diffs[:10]}: {[(la[s], lb[s]) for s in diffs[:3]]}"
    counts_a = _scalars(runs[0], "Train Metrics Dict/gaussian_count")
    assert counts_a == _scalars(runs[1], "Train Metrics Dict/gaussian_count")
    assert counts_a[DET_STEPS - 1] != counts_a[0], "densification did not run; the test would miss its randomness"
    assert [la[s] for s in range(5)] != [lc[s] for s in range(5)], "another seed gave the same losses"
    ka, kb = (torch.load(checkpoints(r)[-1], map_location="cpu")["pipeline"] for r in runs[:2])
    assert all(torch.equal(ka[k], kb[k]) for k in ka), "final parameters differ"


# ----------------------------------------------------------------------------- viewer + Ctrl-C + resume
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--enable-unsafe-swiftshader",
                "--window-size=400,300", "--disable-features=BackForwardCache"):  # fmt: skip
        options.add_argument(arg)
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"), options=options)


def _quit(driver) -> None:
    try:
        driver.quit()
    except Exception:  # the browser was killed on purpose
        pass


def _wait(predicate, timeout: float, what: str, proc=None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"ns-train exited ({proc.returncode}) while waiting for {what}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _latest_step(run_dir: Path) -> int:
    ckpts = checkpoints(run_dir)
    return checkpoint_step(ckpts[-1]) if ckpts else -1


@dataclass
class Interrupted:
    scene: Path
    output_dir: Path
    run_dir: Path
    returncode: int
    output: str
    exit_seconds: float
    render_log: Path
    cycles: List[dict] = field(default_factory=list)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> Interrupted:
    """ns-train with the viewer; browser sessions come and go mid-training (closed, reloaded, killed);
    then Ctrl-C while a fourth is connected and the viewer renders for it."""
    pytest.importorskip("selenium")
    if not (shutil.which("chromium") or Path("/usr/bin/chromium").exists()):
        pytest.skip("chromium is not installed")
    scene = demo_runs.demo_scene(tmp_path_factory)
    out = tmp_path_factory.mktemp("interrupt")
    run_dir = _run_dir(out, scene, "interrupted")
    port, render_log = _free_port(), out / "renders.jsonl"
    args = ["splat-metal", *demo_args(max_num_iterations=2000, steps_per_save=2, vis="viewer+tensorboard",
            viewer__websocket_port=port, viewer__quit_on_train_completion="False", **QUIET),
            "--data", scene, "--output-dir", out, "--timestamp", "interrupted"]  # fmt: skip
    env = cli_env(out / "torch_home", extra={"SPLAT_METAL_RENDER_LOG": str(render_log)})
    log = open(out / "ns-train.log", "w+")
    proc = subprocess.Popen([executable("ns-train"), *map(str, args)], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env, start_new_session=True)  # fmt: skip
    cycles, driver = [], None
    try:
        _wait(lambda: _latest_step(run_dir) >= 0, 300, "the first checkpoint", proc)
        for how in ("close", "reload", "kill", "stay"):
            cycle = {"how": how, "step_before": _latest_step(run_dir)}
            renders_before = len(render_log.read_text().splitlines()) if render_log.exists() else 0
            driver = _browser()
            driver.get(f"http://localhost:{port}")
            connected = lambda d=driver: any("Connected!" in e["message"] for e in d.get_log("browser"))  # noqa: E731
            _wait(connected, 60, f"the browser to connect ({how})", proc)
            if how == "reload":  # disconnect and reconnect the same page
                driver.refresh()
                _wait(connected, 60, "the browser to reconnect", proc)
            _wait(lambda n=renders_before: render_log.exists() and len(render_log.read_text().splitlines()) > n,
                  120, f"a viewer render for the browser ({how})", proc)  # fmt: skip
            cycle["renders"] = len(render_log.read_text().splitlines()) - renders_before
            if how == "stay":  # Ctrl-C with the viewer open and rendering
                cycles.append(cycle)
                break
            if how == "kill":  # the browser dies without closing its websocket
                for c in psutil.Process(driver.service.process.pid).children(recursive=True):
                    if "chrom" in c.name() and "driver" not in c.name():
                        c.kill()
            _quit(driver)
            driver = None
            # Training goes on after the client left: two more steps are saved.
            after = _latest_step(run_dir)
            _wait(lambda a=after: _latest_step(run_dir) >= a + 2, 120, f"training to continue after '{how}'", proc)
            cycle["step_after"] = _latest_step(run_dir)
            cycles.append(cycle)
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            log.flush()
            report = hung_process_report(proc, out / "ns-train.log")
            raise AssertionError(f"ns-train did not exit within 120 s of Ctrl-C (a hang?)\n{report}") from None
        exit_seconds = time.monotonic() - sent
    finally:
        if driver is not None:
            _quit(driver)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.seek(0)
        output = log.read()
        log.close()
    return Interrupted(scene, out, run_dir, proc.returncode, output, exit_seconds, render_log, cycles)


def test_browser_sessions_do_not_disturb_training(interrupted):
    assert [c["how"] for c in interrupted.cycles] == ["close", "reload", "kill", "stay"], interrupted.output[-3000:]
    for c in interrupted.cycles[:3]:
        assert c["renders"] >= 1 and c["step_after"] >= c["step_before"] + 2, c
    assert "Viewer failed" not in interrupted.output
    assert not TRACEBACK.search(interrupted.output), interrupted.output[-5000:]


def test_ctrl_c_saves_a_loadable_checkpoint_and_exits(interrupted):
    text = _flat(interrupted.output)
    assert interrupted.returncode == INTERRUPTED_EXIT_CODE, interrupted.output[-3000:]
    assert interrupted.exit_seconds < 60
    assert "splat-metal: Ctrl-C: finishing the current step, then saving a checkpoint and stopping" in text
    step = int(re.search(r"splat-metal: training stopped after step (\d+); checkpoint saved:", text).group(1))
    (ckpt,) = checkpoints(interrupted.run_dir)  # only the latest is kept, and nothing else is in the folder
    assert checkpoint_step(ckpt) == step and [p.name for p in ckpt.parent.iterdir()] == [ckpt.name]
    state = torch.load(ckpt, map_location="cpu")  # weights_only, as ns-export and --load-dir load it
    assert state["step"] == step and step >= interrupted.cycles[-2]["step_after"]
    assert all(torch.isfinite(v).all() for v in state["pipeline"].values() if v.is_floating_point())
    assert _no_partial_files(interrupted.output_dir) == []
    assert not TRACEBACK.search(interrupted.output), interrupted.output[-5000:]


# ----------------------------------------------------------------------------- after the interrupt
BIG = 40_000  # gaussians: more than a header's worth of rows, so the partial file shows writing has begun


def _big_run(interrupted) -> Path:
    """config.yml of a copy of the interrupted run whose checkpoint holds BIG gaussians."""
    config = yaml.load((interrupted.run_dir / "config.yml").read_text(), Loader=yaml.Loader)
    config.timestamp = "big"
    run_dir = config.get_base_dir()
    (run_dir / "nerfstudio_models").mkdir(parents=True)
    (run_dir / "config.yml").write_text(yaml.dump(config), "utf8")
    shutil.copy(interrupted.run_dir / "dataparser_transforms.json", run_dir)
    (ckpt,) = checkpoints(interrupted.run_dir)
    state = torch.load(ckpt, map_location="cpu")
    pipeline = state["pipeline"]
    g = torch.Generator().manual_seed(0)
    for key in [k for k in pipeline if k.startswith("_model.gauss_params.")]:
        pipeline[key] = pipeline[key][torch.randint(pipeline[key].shape[0], (BIG,), generator=g)]
    pipeline["_model.gauss_params.opacities"] = torch.full((BIG, 1), 2.0)  # all kept by the exporter
    torch.save({"step": state["step"], "pipeline": pipeline}, run_dir / "nerfstudio_models" / ckpt.name)
    return run_dir / "config.yml"


def _interrupt_export(config: Path, out_dir: Path, sig: int):
    """Starts ns-export over an existing splat.ply, sends ``sig`` once it is writing; returns
    (exit code, output, the old bytes)."""
    out_dir.mkdir()
    target = out_dir / "splat.ply"
    old = b"ply\nformat ascii 1.0\ncomment the user's previous export\nelement vertex 0\nend_header\n"
    target.write_bytes(old)
    log = open(out_dir.parent / f"{out_dir.name}.log", "w+")
    proc = subprocess.Popen(
        inject.command("write-pause", 30, "ns-export", "gaussian-splat", "--load-config", config, "--output-dir",
                       out_dir),
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        env=cli_env(config.parent / "torch_home"),
    )  # fmt: skip  # the block writer takes milliseconds: it waits after its block for the signal to land
    try:
        # Writing has begun when the target changed or another file in the folder has grown past a header.
        def writing() -> bool:
            return target.read_bytes() != old or any(p.stat().st_size > 4096 for p in out_dir.iterdir() if p != target)

        _wait(writing, 300, "ns-export to start writing", proc)
        os.killpg(proc.pid, sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.seek(0)
        output = log.read()
        log.close()
    return proc.returncode, output, old


@pytest.fixture(scope="module")
def after_interrupt(interrupted, tmp_path_factory):
    """In parallel: the resume of the interrupted run (3 steps), and two exports of a big copy of it,
    one killed (SIGKILL) and one Ctrl-C'd while writing over an earlier export."""
    (ckpt,) = checkpoints(interrupted.run_dir)
    before = ckpt.read_bytes()
    big = _big_run(interrupted)
    exports = tmp_path_factory.mktemp("exports")
    resumed, killed, stopped = _parallel(
        lambda: _train(
            interrupted.scene,
            interrupted.output_dir,
            "resumed",
            "--load-dir",
            ckpt.parent,
            max_num_iterations=3,
            steps_per_save=100,
            logging__steps_per_log=1,
        ),  # fmt: skip
        lambda: _interrupt_export(big, exports / "killed", signal.SIGKILL),
        lambda: _interrupt_export(big, exports / "ctrl_c", signal.SIGINT),
    )
    return dict(ckpt=ckpt, before=before, resumed=resumed, killed=killed, stopped=stopped, exports=exports)


def test_resume_after_ctrl_c_continues_the_step_count(interrupted, after_interrupt):
    ckpt, result = after_interrupt["ckpt"], after_interrupt["resumed"]
    step = checkpoint_step(ckpt)
    printed = _resume_command(_flat(interrupted.output))
    assert printed[printed.index("--load-dir") + 1] == str(ckpt.parent)
    assert printed[printed.index("--max-num-iterations") + 1] == str(2000 - (step + 1))  # the rest of the schedule
    assert "--timestamp" not in printed  # the resumed run gets its own folder

    assert result.returncode == 0, result.tail()
    assert f"Done loading Nerfstudio checkpoint from {ckpt}" in _flat(result.stdout), result.tail()
    resumed_dir = _run_dir(interrupted.output_dir, interrupted.scene, "resumed")
    assert [checkpoint_step(c) for c in checkpoints(resumed_dir)] == [step + 3]
    assert min(_scalars(resumed_dir, "Train Loss")) == step + 1
    assert ckpt.read_bytes() == after_interrupt["before"]  # the interrupted run's checkpoint is untouched


def test_interrupted_export_never_leaves_a_partial_ply(after_interrupt):
    exports = after_interrupt["exports"]
    killed, k_out, old = after_interrupt["killed"]
    stopped, s_out, _ = after_interrupt["stopped"]
    assert killed == -signal.SIGKILL, k_out[-2000:]
    assert (exports / "killed" / "splat.ply").read_bytes() == old  # the previous export survives a SIGKILL
    leftovers = [p.name for p in (exports / "killed").iterdir() if p.name != "splat.ply"]
    assert leftovers and all(n.startswith(".splat.ply.partial-") for n in leftovers), leftovers  # hidden temp only

    assert stopped == 1, s_out[-2000:]
    assert "splat-metal: export interrupted;" in _flat(s_out) and "untouched" in s_out, s_out[-2000:]
    assert not TRACEBACK.search(s_out), s_out[-3000:]
    assert [p.name for p in (exports / "ctrl_c").iterdir()] == ["splat.ply"]  # temp file removed
    assert (exports / "ctrl_c" / "splat.ply").read_bytes() == old

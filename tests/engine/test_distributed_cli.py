"""`torchrun --nproc-per-node N $(command -v ns-train) splat-metal ...` on CPU (gloo), through the real
command lines: one scene trained by 2 processes (each rank a shard of the gaussians), checkpoints of
the whole scene written by rank 0 alone, a held-out PSNR like one process's, ns-export from the
gathered model, a Ctrl-C'd run resumed with the printed command ending bit-identical to the
uninterrupted one, one process under torchrun bit-identical to plain ns-train, and the bad cases:
ranks started with other options, a rank killed, a rank that hangs (the collective timeout).

Scene: 48x36, 12 views (nerfstudio holds out 2), 300 seed points; refines every 10 steps from step 20,
an eval image every 7 steps (rank 0 evaluates the gathered scene), white background (the scene's: a
held-out PSNR means something; the resumed part still draws from every rank's generator when it splits).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from cli_helpers import (
    checkpoint_differences,
    checkpoint_step,
    checkpoints,
    cli_env,
    demo_args,
    executable,
    final_checkpoint,
    interrupt_after_checkpoint,  # fmt: skip
    run_cli,
    run_dir,
    small_scene,
)

pytestmark = pytest.mark.timeout(1200)

TOTAL = 80
INTERRUPT_AFTER = 30  # Ctrl-C once the checkpoint of this step exists
OPTIONS = dict(
    max_num_iterations=TOTAL, machine__device_type="cpu", machine__seed=3, steps_per_save=30,
    steps_per_eval_image=7, steps_per_eval_all_images=10**6, pipeline__model__warmup_length=20,
    pipeline__model__refine_every=10, pipeline__model__background_color="white",
    pipeline__model__sh_degree_interval=20,
)  # fmt: skip
START_LINE = re.compile(
    r"splat-metal distributed: world size (\d+), backend (\w+), gaussians per rank ([\d,]+(?: / [\d,]+)*)"
)
# On a loaded 2-core machine two ranks take longer; 1.0 dB is far below what a broken exchange costs
# (a rank rendering only its own shard loses > 5 dB) and above the seed-to-seed spread of this run.
PSNR_MARGIN_DB = 1.0


def _ns_train_args(scene: Path, out: Path, timestamp: str, method: str = "splat-metal", **options) -> list:
    return [method, *demo_args(**{**OPTIONS, **options}), "--data", scene, "--output-dir", out,
            "--timestamp", timestamp]  # fmt: skip


def _torchrun(n: int) -> list:
    # --standalone: a free port of its own, so that runs side by side never meet on torchrun's default port
    return [executable("torchrun"), "--standalone", "--nproc-per-node", str(n), executable("ns-train")]


def _env(out: Path, **extra: str):
    return cli_env(out / "torch_home", extra={"OMP_NUM_THREADS": "1", **extra})


def _train(out: Path, launcher: list, timestamp: str, scene: Path, **options):
    return run_cli(*launcher, *_ns_train_args(scene, out, timestamp, **options), timeout=900, env=_env(out))


@pytest.fixture(scope="module")
def scene(tmp_path_factory):
    """{"out": the module's output folder, "scene": the scene in it}: all the bad-situation tests need."""
    out = tmp_path_factory.mktemp("distributed")
    return dict(out=out, scene=small_scene(out, 48, 36))


@pytest.fixture(scope="module")
def runs(scene):
    out, scene = scene["out"], scene["scene"]
    with ThreadPoolExecutor(3) as pool:
        two = pool.submit(_train, out, _torchrun(2), "two", scene)
        one = pool.submit(_train, out, [executable("ns-train")], "one", scene)
        args = [*_torchrun(2), *_ns_train_args(scene, out, "interrupted")]
        interrupted = pool.submit(interrupt_after_checkpoint, args, out / "interrupted.log", _env(out),
                                  run_dir(out, "interrupted"), INTERRUPT_AFTER, 900)  # fmt: skip
        two, one, (_, text) = two.result(), one.result(), interrupted.result()  # torchrun: its own exit status
    for result in (two, one):
        assert result.returncode == 0, result.tail()
    flat = " ".join(text.split())
    match = re.search(r"Resume with: (torchrun --nproc-per-node 2 \$\(command -v ns-train\) .*?--max-num-iterations \d+)",
                      flat)  # fmt: skip
    assert match, text[-4000:]
    resume = shlex.split(match.group(1).replace("$(command -v ns-train)", shlex.quote(executable("ns-train"))))
    resume[0:1] = [executable("torchrun"), "--standalone"]
    two_ckpts = run_dir(out, "two") / "nerfstudio_models"
    with ThreadPoolExecutor(4) as pool:
        resumed = pool.submit(run_cli, *resume, "--timestamp", "resumed", timeout=900, env=_env(out))
        under_torchrun = pool.submit(_train, out, _torchrun(1), "torchrun1", scene)
        # the 2-rank checkpoint loads into any number of ranks: 3, and plain ns-train
        on_three = pool.submit(_train, out, _torchrun(3), "three", scene, max_num_iterations=6, load_dir=two_ckpts)
        on_one = pool.submit(_train, out, [executable("ns-train")], "from_two", scene, max_num_iterations=6,
                             load_dir=two_ckpts)  # fmt: skip
        resumed, under_torchrun, on_three, on_one = (f.result() for f in (resumed, under_torchrun, on_three, on_one))
    for result in (resumed, under_torchrun, on_three, on_one):
        assert result.returncode == 0, result.tail()
    return dict(out=out, scene=scene, two=two, one=one, interrupted=text, resume=match.group(1), resumed=resumed,
                under_torchrun=under_torchrun, on_three=on_three, on_one=on_one)  # fmt: skip


def test_two_processes_train_one_scene_and_rank_0_writes_it(runs):
    out, text = runs["out"], runs["two"].output
    starts = START_LINE.findall(text)
    assert len(starts) == 1, f"the start line must be printed once (rank 0), got {starts}"
    world, backend, counts = starts[0]
    per_rank = [int(c.replace(",", "")) for c in counts.split(" / ")]
    assert (world, backend) == ("2", "gloo") and len(per_rank) == 2 and sum(per_rank) == 300, starts
    assert abs(per_rank[0] - per_rank[1]) <= 1
    run = run_dir(out, "two")
    assert [p.name for p in (out / "scene" / "splat-metal").iterdir() if p.name.startswith("two")] == ["two"]
    assert len(list(run.glob("events.out.tfevents.*"))) == 1, "only rank 0 writes logs"
    assert [checkpoint_step(c) for c in checkpoints(run)] == [TOTAL - 1]
    state = final_checkpoint(run)
    n = state["pipeline"]["_model.gauss_params.means"].shape[0]
    for key, value in state["pipeline"].items():
        if ".gauss_params." in key:
            assert value.shape[0] == n, key  # one whole scene, not a shard
    moments = state["optimizers"]["means"]["state"][0]
    assert moments["exp_avg"].shape[0] == n and moments["exp_avg_sq"].shape[0] == n
    assert state["splat_metal_resume"]["distributed"]["world_size"] == 2
    assert sum(state["splat_metal_resume"]["distributed"]["counts"]) == n


def _held_out_psnr(config: Path) -> float:
    from mcmc_runs import held_out_psnr
    from nerfstudio.utils.eval_utils import eval_setup

    _, pipeline, _, _ = eval_setup(config, test_mode="val")
    return held_out_psnr(pipeline)


def test_two_processes_reach_one_processs_held_out_psnr(runs):
    out = runs["out"]
    two = _held_out_psnr(run_dir(out, "two") / "config.yml")
    one = _held_out_psnr(run_dir(out, "one") / "config.yml")
    print(f"held-out PSNR after {TOTAL} steps: 2 processes {two:.2f} dB, 1 process {one:.2f} dB")
    assert two >= one - PSNR_MARGIN_DB, (two, one)


def test_export_of_a_distributed_run_is_the_gathered_model(runs, tmp_path):
    from plyfile import PlyData

    run = run_dir(runs["out"], "two")
    result = run_cli("ns-export", "gaussian-splat", "--load-config", run / "config.yml", "--output-dir", tmp_path,
                     timeout=600, env=_env(runs["out"]))  # fmt: skip
    assert result.returncode == 0, result.tail()
    vertex = PlyData.read(str(tmp_path / "splat.ply"))["vertex"]
    means = final_checkpoint(run)["pipeline"]["_model.gauss_params.means"]
    ply = torch.tensor([[float(v) for v in row] for row in zip(vertex["x"], vertex["y"], vertex["z"])])
    assert ply.shape == means.shape
    assert torch.equal(ply, means.float())


def test_ctrl_c_stops_every_rank_and_the_printed_resume_is_bit_identical(runs):
    text = runs["interrupted"]
    assert text.count("Resume with:") == 1, "the resume command is printed once (rank 0)"
    assert "splat-metal: training stopped after step" in text
    stopped = checkpoints(run_dir(runs["out"], "interrupted"))
    assert len(stopped) == 1 and checkpoint_step(stopped[0]) >= INTERRUPT_AFTER
    differences = checkpoint_differences(final_checkpoint(run_dir(runs["out"], "two")),
                                         final_checkpoint(run_dir(runs["out"], "resumed")))  # fmt: skip
    assert differences == [], differences[:20]


def test_a_checkpoint_of_two_ranks_resumes_on_three_and_on_one(runs):
    n = final_checkpoint(run_dir(runs["out"], "two"))["pipeline"]["_model.gauss_params.means"].shape[0]
    starts = START_LINE.findall(runs["on_three"].output)
    assert len(starts) == 1 and starts[0][0] == "3", starts
    per_rank = [int(c.replace(",", "")) for c in starts[0][2].split(" / ")]
    assert len(per_rank) == 3 and sum(per_rank) == n and max(per_rank) - min(per_rank) <= 1, (per_rank, n)
    assert "was written by a run with 2 process(es), this one has 3" in " ".join(runs["on_three"].output.split())
    for name, process_count in (("three", 3), ("from_two", None)):
        state = final_checkpoint(run_dir(runs["out"], name))
        assert checkpoint_step(checkpoints(run_dir(runs["out"], name))[-1]) == TOTAL - 1 + 6
        assert state["pipeline"]["_model.gauss_params.means"].shape[0] > 0
        distributed = state["splat_metal_resume"].get("distributed")
        assert (distributed or {}).get("world_size") == process_count


def test_one_process_under_torchrun_is_plain_ns_train_bit_for_bit(runs):
    assert not START_LINE.search(runs["under_torchrun"].output)
    differences = checkpoint_differences(final_checkpoint(run_dir(runs["out"], "one")),
                                         final_checkpoint(run_dir(runs["out"], "torchrun1")))  # fmt: skip
    assert differences == [], differences[:20]


# ---- bad situations
def test_ranks_started_with_other_options_are_refused_before_anything_is_written(scene, tmp_path):
    """torchrun starts one command on every rank; a wrapper gives rank 1 another step count."""
    wrapper = tmp_path / "rank_dependent.sh"
    wrapper.write_text('#!/bin/sh\nif [ "$RANK" = 1 ]; then set -- "$@" --max-num-iterations 7; fi\nexec "$@"\n')
    wrapper.chmod(0o755)
    out = tmp_path / "out"
    result = run_cli(executable("torchrun"), "--standalone", "--nproc-per-node", "2", "--no-python", wrapper,
                     executable("ns-train"), *_ns_train_args(scene["scene"], out, "mismatch"), timeout=300,
                     env=_env(scene["out"]))  # fmt: skip
    assert result.returncode != 0
    text = " ".join(result.output.split())
    assert "rank 1 was started with other options than rank 0" in text, result.tail()
    assert "max_num_iterations: 7" in text and f"max_num_iterations: {TOTAL}" in text, result.tail()
    assert not out.exists(), "nothing may be written"


def _rank_pid(torchrun_pid: int, rank: int) -> int:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == torchrun_pid and f"RANK={rank}".encode() in environ:
            return int(entry)
    raise AssertionError(f"no rank {rank} under torchrun {torchrun_pid}")


def _start_and_hurt(scene, tmp_path, hurt, env_extra=None, timeout=300, after_hurt=None):
    """Starts a long 2-rank run, waits for a checkpoint after step 0, applies ``hurt(pid of rank 1)``, then
    ``after_hurt(pid of rank 0, pid of rank 1)`` if given; returns (exit code, output, seconds from the
    hurt to torchrun's exit, run dir)."""
    out = tmp_path / "out"
    args = [*_torchrun(2), *_ns_train_args(scene["scene"], out, "hurt", max_num_iterations=100000, steps_per_save=5)]
    log_path = tmp_path / "hurt.log"
    run = run_dir(out, "hurt")
    with open(log_path, "w+") as log:
        proc = subprocess.Popen([str(a) for a in args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=_env(scene["out"], **(env_extra or {})),
                                start_new_session=True)  # fmt: skip
        try:
            deadline = time.monotonic() + 600
            # a checkpoint past step 0: the run is in its steady loop of collectives (right after step 0
            # rank 0 caches the eval images, no collective, and torchrun's SIGTERM could reach it first)
            while not (run.exists() and any(int(c.stem.split("-")[1]) > 0 for c in checkpoints(run))):
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.05)
            survivor, victim = _rank_pid(proc.pid, 0), _rank_pid(proc.pid, 1)
            hurt(victim)
            hurt_at = time.monotonic()
            if after_hurt is not None:
                after_hurt(survivor, victim)
            proc.wait(timeout=timeout)
            took = time.monotonic() - hurt_at
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.seek(0)
        return proc.returncode, log.read(), took, run


def _intact(run: Path) -> None:
    ckpts = checkpoints(run)
    assert ckpts, "the checkpoint written before the failure must stay"
    state = torch.load(ckpts[-1], map_location="cpu")
    n = state["pipeline"]["_model.gauss_params.means"].shape[0]
    assert n > 0 and state["optimizers"]["means"]["state"][0]["exp_avg"].shape[0] == n


def _sigterm_until_ended(rank_0: int, rank_1: int) -> None:
    """torchrun SIGTERMs the surviving ranks as soon as it sees rank 1 gone, which may be while rank 0 is
    still writing what failed; this sends SIGTERM again and again until rank 0 has exited, so the
    message must survive a SIGTERM at any moment (a fresh-clone suite once lost it to that race)."""
    deadline = time.monotonic() + 120
    while not _ended(rank_0) and time.monotonic() < deadline:
        try:
            os.kill(rank_0, signal.SIGTERM)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def test_a_killed_rank_stops_the_others_with_a_message_naming_it(scene, tmp_path):
    code, text, took, run = _start_and_hurt(
        scene, tmp_path, lambda pid: os.kill(pid, signal.SIGKILL), after_hurt=_sigterm_until_ended
    )
    flat = " ".join(text.split())
    assert code != 0 and took < 120, (code, took)
    assert re.search(r"rank : 0 \(local_rank: 0\) exitcode : 1 ", flat), text[-3000:]  # its own exit, not SIGTERM
    assert "a collective with the other ranks failed" in flat, text[-3000:]
    assert re.search(r"Root Cause .*? rank : 1 \(local_rank: 1\) exitcode : -9", flat), text[-3000:]  # torchrun's
    _intact(run)


def _ended(pid: int) -> bool:
    """The process has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_hung_rank_is_a_timeout_not_a_hang(scene, tmp_path):
    """SIGSTOP: rank 1 neither dies nor answers; rank 0 gives up after SPLAT_METAL_COLLECTIVE_TIMEOUT.
    Once rank 0 has exited, rank 1 is let go on (SIGCONT) so that it takes torchrun's SIGTERM: a stopped
    process would hold torchrun for its whole shutdown grace period (30 s), which tests nothing of ours."""
    rank_0_ended_while_rank_1_hung = []

    def let_go_once_rank_0_ended(rank_0: int, rank_1: int) -> None:
        deadline = time.monotonic() + 240
        while not _ended(rank_0) and time.monotonic() < deadline:
            time.sleep(0.05)
        rank_0_ended_while_rank_1_hung.append(_ended(rank_0) and not _ended(rank_1))
        try:
            os.kill(rank_1, signal.SIGCONT)
        except ProcessLookupError:
            pass

    code, text, took, run = _start_and_hurt(scene, tmp_path, lambda pid: os.kill(pid, signal.SIGSTOP),
                                            env_extra={"SPLAT_METAL_COLLECTIVE_TIMEOUT": "15"}, timeout=240,
                                            after_hurt=let_go_once_rank_0_ended)  # fmt: skip
    print(f"torchrun exited {took:.1f} s after rank 1 stopped (collective timeout 15 s)")
    flat = " ".join(text.split())
    assert rank_0_ended_while_rank_1_hung == [True], "rank 0 must give up on its own while rank 1 is stopped"
    assert code != 0, code
    assert "rank 0 stopped at step" in flat and "a collective with the other ranks failed" in flat, text[-3000:]
    _intact(run)


MCMC_CAP = 333  # odd: the ranks' shares are 167 and 166, and they must sum to the cap, not 2 x 167
MCMC_STEPS, MCMC_FIRST = 60, 30  # refines at steps 30, 40, 50 (from 20, every 10): all after the resume point


def test_mcmc_on_two_processes_keeps_cap_max_resumes_bit_identical_and_exports(tmp_path):
    """`torchrun ... ns-train splat-metal-mcmc`: cap-max is the whole scene's budget, split exactly over the
    ranks; growth runs to it (300 seed points, +5% per refine) and never past it; a run continued on 2 ranks
    from the checkpoint of step 29 ends with the uninterrupted run's bits (MCMC's state and every rank's
    generators carry over); the gathered checkpoint is the whole scene and ns-export writes it."""
    out, scene = tmp_path, small_scene(tmp_path, 48, 36)

    def train(timestamp, steps, *extra):
        # schedule-scale off: the continued run's first part is a MCMC_FIRST-step run, whose auto-scaled
        # schedule (the means' lr decay) would not be the whole run's
        args = _ns_train_args(scene, out, timestamp, "splat-metal-mcmc", max_num_iterations=steps,
                              pipeline__model__cap_max=MCMC_CAP, pipeline__model__schedule_scale="off")  # fmt: skip
        result = run_cli(*_torchrun(2), *args, *extra, timeout=900, env=_env(out))
        assert result.returncode == 0, result.tail()
        return result, run_dir(out, timestamp, "splat-metal-mcmc")

    with ThreadPoolExecutor(2) as pool:
        whole, first = pool.submit(train, "mcmc", MCMC_STEPS), pool.submit(train, "first", MCMC_FIRST)
        (result, run), (_, first_run) = whole.result(), first.result()
    _, continued = train("continued", MCMC_STEPS - MCMC_FIRST, "--load-dir", first_run / "nerfstudio_models")
    starts = START_LINE.findall(result.output)
    assert len(starts) == 1 and starts[0][0] == "2", starts
    state = final_checkpoint(run)
    counts = state["splat_metal_resume"]["distributed"]["counts"]
    n = state["pipeline"]["_model.gauss_params.means"].shape[0]
    assert sum(counts) == n == MCMC_CAP, (counts, n)  # grown to the cap (3 refines), not past it
    assert sorted(counts) == [166, 167], counts
    assert (
        final_checkpoint(first_run)["pipeline"]["_model.gauss_params.means"].shape[0] == 300
    )  # no refine before the resume
    differences = checkpoint_differences(state, final_checkpoint(continued))
    assert differences == [], differences[:20]
    exported = run_cli("ns-export", "gaussian-splat", "--load-config", run / "config.yml", "--output-dir",
                       tmp_path / "export", timeout=600, env=_env(out))  # fmt: skip
    assert exported.returncode == 0, exported.tail()
    from plyfile import PlyData

    assert PlyData.read(str(tmp_path / "export" / "splat.ply"))["vertex"].count == n


POST_STEPS, POST_STOP = 45, 32  # a refine at step 30 (warm-up 20, every 10): the strategy reads steps 0..31


def test_two_processes_past_refine_stop_end_with_the_bits_of_a_run_computing_the_statistics(tmp_path):
    """From refine stop on, a step computes no absgrad and no statistics (model.py strategy_reads_stats): a run on
    2 ranks past it ends with the bits of the same run computing them at every step
    (--pipeline.model.stats-after-refine-stop True, as before issue 38)."""
    out, scene = tmp_path, small_scene(tmp_path, 48, 36)

    def train(timestamp, keep):
        result = _train(out, _torchrun(2), timestamp, scene, max_num_iterations=POST_STEPS,
                        pipeline__model__stop_split_at=POST_STOP, pipeline__model__stats_after_refine_stop=keep)  # fmt: skip
        assert result.returncode == 0, result.tail()
        return final_checkpoint(run_dir(out, timestamp))

    with ThreadPoolExecutor(2) as pool:
        skip, keep = pool.submit(train, "skip", False), pool.submit(train, "keep", True)
        skip, keep = skip.result(), keep.result()
    assert skip["step"] == keep["step"] == POST_STEPS - 1
    differences = checkpoint_differences(skip, keep)
    assert differences == [], differences[:20]

"""splat_metal_method/engine/distributed.py's shard bookkeeping, in real gloo process groups of 2 and 3 ranks:
rows moved with one all_to_all keep their global order (balancing, gathering on rank 0), including
empty shards and every dtype a checkpoint holds; a model's parameters, Adam moments and
densification statistics move together and the optimizers step the moved parameters."""

from __future__ import annotations

import math
import os
import socket
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from splat_metal_method.engine import distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, result_dir: str, check, timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    distributed._current = distributed.Distributed(rank, world, rank, world, "gloo", timeout_s)
    try:
        check(rank, world)
        open(os.path.join(result_dir, f"ok{rank}"), "w").close()
    finally:
        distributed.settle_collectives()  # as at the exit of a run: no abort in gloo's teardown
        dist.destroy_process_group()


def _spawn(world: int, check, timeout_s: float = 60.0) -> None:
    with tempfile.TemporaryDirectory() as result_dir:
        mp.spawn(_worker, args=(world, _free_port(), result_dir, check, timeout_s), nprocs=world, join=True)
        assert sorted(os.listdir(result_dir)) == [f"ok{r}" for r in range(world)]


def _global_rows(n: int, dtype: torch.dtype) -> torch.Tensor:  # [n, 2, 3], every row distinct
    values = torch.arange(n * 6).reshape(n, 2, 3)
    return (values % 2 == 0) if dtype == torch.bool else values.to(dtype)


def _check_exchange(rank: int, world: int) -> None:
    cases = [[5, 0, 3][:world], [0, 7, 1][:world], [4, 4, 4][:world], [0, 0, 2][:world], [1, 9, 0][:world]]
    for counts in cases:
        n = sum(counts)
        for dtype in (torch.float32, torch.int64, torch.bool):
            full = _global_rows(n, dtype)
            start = sum(counts[:rank])
            mine = full[start : start + counts[rank]]
            for targets in (distributed.balanced_counts(n, world), [n] + [0] * (world - 1), counts[::-1]):
                if sum(targets) != n:
                    continue
                got = distributed.exchange_rows(mine, counts, targets)
                t0 = sum(targets[:rank])
                assert torch.equal(got, full[t0 : t0 + targets[rank]]), (counts, targets, dtype)
            gathered = distributed.gather_rows(mine, counts)
            if rank == 0:
                assert torch.equal(gathered, full)
            else:
                assert gathered is None


class _Model(torch.nn.Module):
    """The parts of a SplatfactoModel that sharding touches: gauss_params and strategy_state."""

    def __init__(self, n: int):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gauss_params = torch.nn.ParameterDict(
            {
                "means": torch.nn.Parameter(torch.randn(n, 3, generator=g)),
                "opacities": torch.nn.Parameter(torch.randn(n, 1, generator=g)),
            }
        )
        self.strategy_state = {
            "grad2d": torch.rand(n, generator=g),
            "count": torch.arange(n).float(),
            "scene_scale": 1.5,
        }


def _check_model_moves(rank: int, world: int) -> None:
    n = 10
    full = _Model(n)
    model = _Model(n)
    optimizers = {k: torch.optim.Adam([p], lr=0.1) for k, p in model.gauss_params.items()}
    counts = distributed.shard(model, optimizers)  # balanced
    assert counts == distributed.balanced_counts(n, world)
    start = sum(counts[:rank])
    rows = slice(start, start + counts[rank])
    assert torch.equal(model.gauss_params["means"], full.gauss_params["means"][rows])
    assert torch.equal(model.strategy_state["grad2d"], full.strategy_state["grad2d"][rows])
    assert model.strategy_state["scene_scale"] == 1.5
    # one step: Adam moments exist and belong to the new parameter objects
    loss = sum((p * (rank + 1)).sum() for p in model.gauss_params.values())
    loss.backward()
    for opt in optimizers.values():
        opt.step()
    # an uneven split (as densification leaves it), then the rebalance
    uneven = [n] + [0] * (world - 1)
    moved = _Model(n)
    moved_opts = {k: torch.optim.Adam([p], lr=0.1) for k, p in moved.gauss_params.items()}
    distributed.shard(moved, moved_opts, counts=uneven)
    assert moved.gauss_params["means"].shape[0] == uneven[rank]
    assert distributed.imbalanced(uneven) and not distributed.imbalanced(distributed.balanced_counts(n, world))
    targets = distributed.rebalance(moved, moved_opts, uneven)
    assert targets == distributed.balanced_counts(n, world)
    assert torch.equal(moved.gauss_params["means"], full.gauss_params["means"][rows])
    assert torch.equal(moved.strategy_state["count"], full.strategy_state["count"][rows])
    # the optimizers follow: a step on the rebalanced shard changes exactly its parameters
    before = {k: p.detach().clone() for k, p in moved.gauss_params.items()}
    sum(p.sum() for p in moved.gauss_params.values()).backward()
    for k, opt in moved_opts.items():
        assert opt.param_groups[0]["params"][0] is moved.gauss_params[k]
        opt.step()
        assert not torch.equal(moved.gauss_params[k], before[k])
    # moments gathered on rank 0 in global order
    sd = distributed.gathered_optimizer_state(optimizers["means"], counts, counts[rank])
    local = optimizers["means"].state[model.gauss_params["means"]]["exp_avg"]
    assert local.shape[0] == counts[rank]  # the live state is untouched
    if rank == 0:
        assert sd["state"][0]["exp_avg"].shape[0] == n


def _check_all(rank: int, world: int) -> None:
    _check_exchange(rank, world)
    _check_model_moves(rank, world)


@pytest.mark.parametrize("world", [2, 3])
def test_rows_parameters_moments_and_statistics_keep_their_global_order(world):
    """One process group per world size (starting one costs seconds) runs both checks."""
    _spawn(world, _check_all)


def test_shard_ranges_cover_every_row_once():
    for n in (0, 1, 5, 10, 11):
        for world in (1, 2, 3, 4):
            ranges = [distributed.shard_range(n, r, world) for r in range(world)]
            assert [i for rg in ranges for i in rg] == list(range(n))
            assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_batch_scaled_adam_follows_gsplats_rule():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.Adam([p], lr=0.01, eps=1e-15)
    distributed.batch_scaled_adam(opt, 4)
    group = opt.param_groups[0]
    assert group["lr"] == pytest.approx(0.01 * math.sqrt(4))
    assert group["eps"] == pytest.approx(1e-15 / math.sqrt(4))
    assert group["betas"] == pytest.approx((1 - 4 * 0.1, 1 - 4 * 0.001))
    one = torch.optim.Adam([p], lr=0.01)
    distributed.batch_scaled_adam(one, 1)
    assert one.param_groups[0]["lr"] == 0.01 and one.param_groups[0]["betas"] == (0.9, 0.999)


def _check_pause(rank: int, world: int) -> None:
    """Rank 0's viewer pauses training for longer than the collective timeout (2 s here): every rank waits
    in step_end, rank 0's train lock is free meanwhile (its viewer renders), nobody times out, and a
    stop request during the pause ends it with the stop agreed."""
    import threading
    import time
    import types

    model = _Model(4)
    stops = []
    trainer = types.SimpleNamespace(
        config=types.SimpleNamespace(is_viewer_enabled=lambda: False, logging=types.SimpleNamespace(steps_per_log=10**9)),
        pipeline=types.SimpleNamespace(model=model), optimizers=types.SimpleNamespace(optimizers={}),
        training_state="paused" if rank == 0 else "training", train_lock=threading.Lock(), stop_training=False,
        agree_to_stop=lambda ranks: stops.append(list(ranks)),
    )  # fmt: skip
    run = distributed.ShardedRun(trainer, distributed.current())
    run.counts = [4] * world
    took_lock = []
    if rank == 0:

        def viewer():  # takes the lock while training is paused, then resumes training
            time.sleep(0.5)
            with trainer.train_lock:
                took_lock.append(time.monotonic())
            time.sleep(2.5)
            trainer.training_state = "training"

        threading.Thread(target=viewer, daemon=True).start()
    trainer.train_lock.acquire()  # step_end runs inside the training step's lock
    started = time.monotonic()
    run.step_end(1)
    waited = time.monotonic() - started
    assert trainer.train_lock.locked(), "step_end must give the lock back"
    trainer.train_lock.release()
    assert waited > 2.5, f"rank {rank} did not wait for the pause ({waited:.2f} s)"
    assert stops == []
    if rank == 0:
        assert took_lock, "the viewer could not take the train lock during the pause"
    # a Ctrl-C on the last rank while paused: every rank leaves the pause with the stop agreed
    trainer.training_state = "paused" if rank == 0 else "training"
    if rank == world - 1:
        threading.Timer(1.5, lambda: setattr(run, "stop_requested", True)).start()
    trainer.train_lock.acquire()
    run.step_end(2)
    trainer.train_lock.release()
    assert stops == [[world - 1]], stops


def test_a_pause_longer_than_the_collective_timeout_is_waited_out_together():
    _spawn(2, _check_pause, timeout_s=2.0)


def test_rank_share_splits_a_budget_exactly():
    from splat_metal_method.engine.distributed import rank_share

    for world_size in (1, 2, 3, 4, 7):
        for total in (0, 1, 2, 6, 333, 1_000_001):
            shares = [rank_share(total, r, world_size) for r in range(world_size)]
            assert sum(shares) == total and max(shares) - min(shares) <= 1, (total, world_size, shares)

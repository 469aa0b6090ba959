"""One scene trained by several processes with torch.distributed: ``torchrun ... ns-train splat-metal``.

What lives here (the Trainer and the model call it; ops/distributed.py renders):

* ``setup``: under torchrun (its WORLD_SIZE/RANK/... environment) splat-metal starts the process
  group itself -- NCCL for CUDA, gloo for CPU -- with a timeout on every collective
  (SPLAT_METAL_COLLECTIVE_TIMEOUT seconds, default 600), before ns-train writes anything. nerfstudio
  itself is left at one process (world_size 1), so its DDP never wraps the gaussians. Every rank but
  0 is silenced (nerfstudio's CONSOLE) and writes nothing: config, logs, checkpoints and the viewer
  are rank 0's.
* ``check_same_options``: every rank must have been started with the same options (the config,
  timestamp aside); a mismatch stops every rank at start, naming the rank and the first option that
  differs.
* Shards: each rank owns a contiguous, disjoint slice of the gaussians in rank order (parameters,
  their Adam moments, the densification statistics). ``shard`` cuts a full model into this rank's
  slice at start (every rank built or loaded the same full model), ``gather_rows`` collects every
  shard on rank 0 in rank order (checkpoints, the viewer's and eval's copy), ``rebalance`` moves
  rows between neighbouring ranks after densification so that the shards stay within
  ``REBALANCE_AT`` of their mean (the global order is kept, so a gathered model does not depend on
  when rows moved).
* ``strided_next_train``: every rank sees the same shuffled epoch of training cameras and takes
  every world-size-th one, so one distributed step trains on world-size different cameras, as one
  process would with that batch.

A single process (no torchrun, or torchrun with one process) runs exactly today's code path.
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from nerfstudio.utils.misc import step_check
from torch import Tensor

TIMEOUT_ENV = "SPLAT_METAL_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
REBALANCE_AT = 0.10  # rebalance when a shard is more than 10% above or below the mean
STRATEGY_ROWS = ("grad2d", "count", "radii")  # DefaultStrategy's per-gaussian statistics


class DistributedError(RuntimeError):
    """A distributed run cannot start or go on; the message says why and what to do."""


class CollectiveFailed(SystemExit):
    """Training stopped because a collective with the other ranks failed (a rank died, hung, stopped)."""


_COLLECTIVE_FAILURES = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout",
                        "broken pipe")  # fmt: skip


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is torch.distributed's report of a failed collective (gloo raises plain RuntimeErrors)."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    text = str(error).lower()
    return any(word in text for word in _COLLECTIVE_FAILURES)


@dataclass(frozen=True)
class Distributed:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str  # "gloo" or "nccl"
    timeout_s: float

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_current: Optional[Distributed] = None


def current() -> Optional[Distributed]:
    """The distributed run this process is part of (None: a plain single-process run)."""
    return _current


def active() -> Optional[Distributed]:
    """``current()`` when it has more than one process (the only case that changes anything)."""
    return _current if _current is not None and _current.world_size > 1 else None


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("WORLD_SIZE" in os.environ and "RANK" in os.environ)


def _env_int(name: str, default: Optional[int] = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise DistributedError(f"torchrun's environment variable {name} is missing: start with torchrun")
        return default
    return int(value)


def setup(device_type: str, num_devices: int = 1) -> Optional[Distributed]:
    """Starts the process group when launched by torchrun (idempotent); None otherwise."""
    global _current
    if _current is not None or not launched_by_torchrun():
        return _current
    world_size, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if num_devices != 1:
        raise DistributedError(
            f"--machine.num-devices {num_devices} starts nerfstudio's own processes; under torchrun every process "
            "is one rank: leave --machine.num-devices at 1 and set the count with torchrun --nproc-per-node"
        )
    if device_type == "mps":
        raise DistributedError(
            "torch.distributed has no collective backend for MPS tensors (NCCL is CUDA-only, gloo is CPU-only): "
            "train on one Mac with plain ns-train, or across processes with --machine.device-type cpu"
        )
    backend = "nccl" if device_type == "cuda" else "gloo"
    timeout_s = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise DistributedError(
                f"rank {rank} is local rank {local_rank} but this machine has {torch.cuda.device_count()} CUDA "
                "device(s): start at most that many processes per machine (--nproc-per-node)"
            )
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        atexit.register(settle_collectives)
    _current = Distributed(rank, world_size, local_rank, local_world_size, backend, timeout_s)
    if rank != 0:
        from nerfstudio.utils.rich_utils import CONSOLE

        CONSOLE.quiet = True  # one voice: rank 0's
    return _current


def settle_collectives(seconds: float = 0.2) -> None:
    """Lets the collective backend's worker threads finish before the interpreter finalizes (at exit).
    A gloo worker thread drops its reference to a finished collective's tensors after the caller has
    moved on; if that is the last one it needs the GIL to free the tensors' Python objects, and once
    finalization has begun a thread that asks for the GIL is ended mid-destructor: the process aborts
    with "terminate called without an active exception" (pytorch/pytorch#190489). Here 14 of 40
    spawned 2- and 3-rank shard tests died so; with this pause before exit, 0 of 30. No collective is
    run here (a rank that died must not make the others wait at exit)."""
    if dist.is_available() and dist.is_initialized():
        time.sleep(seconds)  # releases the GIL to those threads


# ---- agreement at start
def broadcast_object(value, src: int = 0):
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def check_same_options(config_yaml: str) -> None:
    """Stops every rank when they were started with different options (``config_yaml``: this rank's
    config dumped with the timestamp already agreed)."""
    ctx = active()
    if ctx is None:
        return
    digest = hashlib.sha256(config_yaml.encode()).hexdigest()
    texts: List[Optional[str]] = [None] * ctx.world_size
    digests: List[Optional[str]] = [None] * ctx.world_size
    dist.all_gather_object(digests, digest)
    if len(set(digests)) == 1:
        return
    dist.all_gather_object(texts, config_yaml)
    first = texts[0].splitlines()  # type: ignore[union-attr]
    for r, text in enumerate(texts):
        if digests[r] == digests[0]:
            continue
        lines = text.splitlines()  # type: ignore[union-attr]
        diff = next((i for i, (a, b) in enumerate(zip(first, lines)) if a != b), min(len(first), len(lines)))
        ours = lines[diff].strip() if diff < len(lines) else "(end of config)"
        theirs = first[diff].strip() if diff < len(first) else "(end of config)"
        raise DistributedError(
            f"rank {r} was started with other options than rank 0 (config line {diff + 1}: rank {r} has "
            f"{ours!r}, rank 0 has {theirs!r}); start every rank with the same command"
        )


# ---- rows of per-gaussian tensors
def all_counts(n_local: int, device: torch.device) -> List[int]:
    ctx = active()
    assert ctx is not None
    counts = torch.zeros(ctx.world_size, dtype=torch.int64, device=device)
    counts[ctx.rank] = n_local
    dist.all_reduce(counts)
    return [int(c) for c in counts.tolist()]


def shard_range(n_total: int, rank: int, world_size: int) -> range:
    """Rank ``rank``'s contiguous share of ``n_total`` rows (the first n_total % world_size ranks get one more)."""
    base, extra = divmod(n_total, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def balanced_counts(n_total: int, world_size: int) -> List[int]:
    return [len(shard_range(n_total, r, world_size)) for r in range(world_size)]


def exchange_rows(rows: Tensor, counts: Sequence[int], targets: Sequence[int]) -> Tensor:
    """Moves rows so that rank r ends with rows ``[sum(targets[:r]), sum(targets[:r+1]))`` of the
    concatenation (in rank order) of every rank's ``rows`` (rank r holds ``counts[r]`` of them):
    one all_to_all, the global order kept. Collective: every rank calls it with the same counts/targets."""
    ctx = active()
    assert ctx is not None and sum(counts) == sum(targets)
    r = ctx.rank
    start = sum(counts[:r])
    mine = range(start, start + counts[r])
    send = []
    recv = []
    t_start = 0
    for dst in range(ctx.world_size):
        dst_range = range(t_start, t_start + targets[dst])
        send.append(max(0, min(mine.stop, dst_range.stop) - max(mine.start, dst_range.start)))
        t_start += targets[dst]
    my_target = range(sum(targets[:r]), sum(targets[: r + 1]))
    s_start = 0
    for src in range(ctx.world_size):
        src_range = range(s_start, s_start + counts[src])
        recv.append(max(0, min(my_target.stop, src_range.stop) - max(my_target.start, src_range.start)))
        s_start += counts[src]
    flat = rows.detach().reshape(rows.shape[0], math.prod(rows.shape[1:])).contiguous()  # [n, row size]
    out = flat.new_empty((sum(recv), flat.shape[1]))
    if ctx.backend == "gloo" and flat.dtype == torch.bool:  # gloo has no bool all_to_all
        out_u8 = out.to(torch.uint8)
        dist.all_to_all_single(out_u8, flat.to(torch.uint8), recv, send)
        out = out_u8.bool()
    else:
        dist.all_to_all_single(out, flat, recv, send)
    return out.reshape(sum(recv), *rows.shape[1:])


def gather_rows(rows: Tensor, counts: Sequence[int]) -> Optional[Tensor]:
    """Every rank's rows, in rank order, on rank 0 (None elsewhere). Collective."""
    ctx = active()
    assert ctx is not None
    targets = [sum(counts)] + [0] * (ctx.world_size - 1)
    out = exchange_rows(rows, counts, targets)
    return out if ctx.is_main else None


# ---- the model's shard (parameters, Adam moments, densification statistics)
def _move_gaussians(model, optimizers: Dict[str, torch.optim.Optimizer], move: Callable[[Tensor], Tensor]) -> None:
    """Replaces every per-gaussian tensor of ``model`` by ``move(tensor)``, in a fixed order on every rank
    (``move`` may be a collective): parameters (new Parameter objects, as gsplat's strategy ops make them,
    with the optimizers pointed at them), their optimizer state, the strategy's per-gaussian statistics."""
    from gsplat.strategy.ops import _update_param_with_optimizer

    params = model.gauss_params
    n = params["means"].shape[0]
    names = sorted(params.keys())

    def param_fn(name: str, p: Tensor) -> Tensor:
        return torch.nn.Parameter(move(p.data), requires_grad=p.requires_grad)

    def optimizer_fn(key: str, v: Tensor) -> Tensor:
        return move(v)

    for name in names:  # one parameter at a time, state keys in a fixed order
        optimizer = optimizers[name]
        p = optimizer.param_groups[0]["params"][0]
        state = optimizer.state.get(p, {})
        ordered = {k: state[k] for k in sorted(state)} if state else {}
        if state:
            optimizer.state[p] = ordered
        _update_param_with_optimizer(param_fn, optimizer_fn, params, optimizers, names=[name])
    state = model.strategy_state
    for key in STRATEGY_ROWS:
        value = state.get(key)
        if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == n:
            state[key] = move(value)


def shard(model, optimizers: Dict[str, torch.optim.Optimizer], counts: Optional[Sequence[int]] = None) -> List[int]:
    """Cuts the full model every rank holds into this rank's contiguous share: ``counts`` rows per rank
    (a resumed run: the shards it had) or balanced ones. Returns the counts per rank."""
    ctx = active()
    assert ctx is not None
    n_total = model.gauss_params["means"].shape[0]
    if counts is None or len(counts) != ctx.world_size or sum(counts) != n_total:
        counts = balanced_counts(n_total, ctx.world_size)
    start = sum(counts[: ctx.rank])
    mine = range(start, start + counts[ctx.rank])
    _move_gaussians(model, optimizers, lambda t: t[mine.start : mine.stop].clone())
    return list(counts)


def imbalanced(counts: Sequence[int]) -> bool:
    mean = sum(counts) / len(counts)
    return mean > 0 and max(abs(c - mean) for c in counts) > REBALANCE_AT * mean + 1


def rebalance(model, optimizers: Dict[str, torch.optim.Optimizer], counts: Sequence[int]) -> List[int]:
    """Moves rows between ranks (keeping their global order) so that every shard has its balanced count."""
    ctx = active()
    assert ctx is not None
    targets = balanced_counts(sum(counts), ctx.world_size)
    _move_gaussians(model, optimizers, lambda t: exchange_rows(t, counts, targets))
    return targets


def gathered_state_dict(state_dict: Dict[str, Tensor], counts: Sequence[int], n_local: int) -> Dict[str, Tensor]:
    """A module state dict with every per-gaussian entry (``gauss_params.*``) gathered on rank 0. Collective."""
    out = {}
    for key in sorted(state_dict):
        value = state_dict[key]
        if (
            ".gauss_params." in f".{key}"
            and isinstance(value, Tensor)
            and value.dim() >= 1
            and value.shape[0] == n_local
        ):
            value = gather_rows(value, counts)
        out[key] = value
    return out


def gathered_optimizer_state(optimizer: torch.optim.Optimizer, counts: Sequence[int], n_local: int) -> Dict:
    """``optimizer.state_dict()`` with its per-gaussian moments gathered on rank 0. Collective."""
    sd = optimizer.state_dict()
    for idx in sorted(sd["state"]):
        entry = sd["state"][idx] = dict(sd["state"][idx])  # state_dict() shares the live state's dicts
        for key in sorted(entry):
            value = entry[key]
            if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == n_local:
                entry[key] = gather_rows(value, counts)
    return sd


def gathered_strategy_state(state: Dict, counts: Sequence[int], n_local: int) -> Dict:
    out = dict(state)
    for key in STRATEGY_ROWS:
        value = state.get(key)
        if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == n_local:
            out[key] = gather_rows(value, counts)
    return out


def rank_share(total: int, rank: int, world_size: int) -> int:
    """Rank ``rank``'s part of ``total`` split as evenly as possible; the parts sum to ``total``."""
    return total // world_size + (1 if rank < total % world_size else 0)


def gathered_params(model, counts: Sequence[int]) -> Optional[Dict[str, Tensor]]:
    """Detached copies of every shard's parameters on rank 0 (None elsewhere). Collective."""
    out = {}
    for name in sorted(model.gauss_params.keys()):
        out[name] = gather_rows(model.gauss_params[name].detach(), counts)
    return out if active().is_main else None  # type: ignore[union-attr]


# ---- cameras
def strided_next_train(next_train: Callable, rank: int, world_size: int) -> Callable:
    """``datamanager.next_train`` for rank ``rank``: draws world_size cameras from the epoch every rank
    shuffles identically, and keeps the rank-th."""

    def next_train_for_rank(step: int):
        batches = [next_train(step) for _ in range(world_size)]
        return batches[rank]

    return next_train_for_rank


# ---- learning rates
def batch_scaled_adam(optimizer: torch.optim.Optimizer, batch: int) -> None:
    """gsplat's distributed trainer's rule for a batch of ``batch`` images per step (its simple_trainer:
    lr * sqrt(B), eps / sqrt(B), betas 1 - B * (1 - beta)); applied to the optimizer's groups in place."""
    if batch <= 1:
        return
    root = math.sqrt(batch)
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * root
        if "initial_lr" in group:
            group["initial_lr"] = group["initial_lr"] * root
        group["eps"] = group["eps"] / root
        b1, b2 = group["betas"]
        group["betas"] = (max(0.0, 1 - batch * (1 - b1)), max(0.0, 1 - batch * (1 - b2)))


def format_counts(counts: Sequence[int]) -> str:
    return " / ".join(f"{c:,}" for c in counts)


# ---- the Trainer's side (trainer.py calls these hooks)
VIEWER_SYNC_EVERY = 10  # steps between refreshes of rank 0's gathered copy while the viewer is on


class ShardedRun:
    """What a SplatMetalTrainer does differently in a distributed run (``active()`` is not None)."""

    def __init__(self, trainer, ctx: Distributed) -> None:
        self.trainer = trainer
        self.ctx = ctx
        self.viewer_on_rank0 = trainer.config.is_viewer_enabled()
        self.counts: List[int] = []
        self.stop_requested = False

    @property
    def model(self):
        return self.trainer.pipeline.model

    @property
    def optimizers(self) -> Dict[str, torch.optim.Optimizer]:
        return self.trainer.optimizers.optimizers

    def n_local(self) -> int:
        return int(self.model.gauss_params["means"].shape[0])

    # -- start
    def check_model(self) -> None:
        cfg = self.model.config
        if cfg.camera_optimizer.mode != "off" or cfg.use_bilateral_grid:
            raise DistributedError(
                "a distributed run shards only the gaussians: --pipeline.model.camera-optimizer.mode must be off and "
                "--pipeline.model.use-bilateral-grid False (their parameters would need an all-reduce, not built)"
            )

    def scale_optimizers(self, optimizers) -> None:
        """gsplat's learning-rate rule for a batch of world_size images, on the gaussians' optimizers."""
        for name in self.model.gauss_params.keys():
            if name not in optimizers.optimizers:
                continue
            batch_scaled_adam(optimizers.optimizers[name], self.ctx.world_size)
            scheduler = optimizers.schedulers.get(name)
            if scheduler is not None:
                root = math.sqrt(self.ctx.world_size)
                scheduler.base_lrs = [lr * root for lr in scheduler.base_lrs]

    def start(self, resume: Optional[Dict]) -> Optional[Dict]:
        """After the Trainer's setup (full model built or loaded on every rank): keep this rank's shard,
        strided cameras, per-rank generators. Returns the generator state to restore at step one."""
        trainer, ctx, model = self.trainer, self.ctx, self.model
        cap = getattr(model.strategy, "cap_max", None)
        if isinstance(cap, int) and cap > 0:  # MCMC: cap_max is the scene's budget, split exactly over the ranks
            model.strategy.cap_max = rank_share(cap, ctx.rank, ctx.world_size)
        resumed = (resume or {}).get("distributed", {})
        same_world = resume is not None and resumed.get("world_size") == ctx.world_size
        # A resume on as many ranks keeps each rank's rows (its generator draws for them): exact.
        self.counts = shard(model, self.optimizers, resumed.get("counts") if same_world else None)
        if not ctx.is_main and hasattr(model.strategy, "verbose"):
            model.strategy.verbose = False  # gsplat prints each refine with print(): rank 0's say it
        dm = trainer.pipeline.datamanager
        dm.next_train = strided_next_train(dm.next_train, ctx.rank, ctx.world_size)
        if not ctx.is_main and hasattr(dm, "train_dataparser_outputs"):
            dm.train_dataparser_outputs.save_dataparser_transform = lambda *args, **kwargs: None
        from nerfstudio.utils.rich_utils import CONSOLE

        CONSOLE.print(
            f"splat-metal distributed: world size {ctx.world_size}, backend {ctx.backend}, gaussians per rank "
            f"{format_counts(self.counts)}",
            highlight=False,
            soft_wrap=True,
        )
        ranks = resumed.get("ranks")
        if same_world and ranks is not None:
            return {"rng": ranks[ctx.rank]["rng"]}
        if resume is not None:
            CONSOLE.print(
                f"splat-metal distributed: the checkpoint was written by a run with "
                f"{len(ranks) if ranks else 1} process(es), this one has {ctx.world_size}: the gaussians and "
                "optimizer state carry over, the random generators start afresh per rank.",
                highlight=False,
                soft_wrap=True,
            )
        seed = trainer.config.machine.seed + ctx.rank
        torch.manual_seed(seed)
        import random

        import numpy as np

        random.seed(seed)
        np.random.seed(seed)
        return None

    # -- every step (an AFTER_TRAIN_ITERATION callback after densification and the NaN guard)
    def _paused(self) -> bool:
        return self.ctx.is_main and self.trainer.training_state == "paused"  # rank 0's viewer pauses the run

    def step_end(self, step: int) -> None:
        device = self.model.gauss_params["means"].device
        flags = torch.zeros(3 * self.ctx.world_size, dtype=torch.int64, device=device)
        flags[3 * self.ctx.rank] = int(self.stop_requested)
        flags[3 * self.ctx.rank + 1] = self.n_local()
        flags[3 * self.ctx.rank + 2] = int(self._paused())
        dist.all_reduce(flags)
        stops, counts = flags[0::3].tolist(), [int(c) for c in flags[1::3].tolist()]
        self.counts = counts
        if flags[2] and not any(stops):
            stops = self.wait_while_paused(device)
        if any(stops) and not self.trainer.stop_training:
            self.trainer.agree_to_stop([r for r, s in enumerate(stops) if s])
        if imbalanced(counts):
            self.counts = rebalance(self.model, self.optimizers, counts)
        if self.viewer_on_rank0 and step % VIEWER_SYNC_EVERY == 0:
            self.refresh_view()
        if self.ctx.is_main and step_check(step, self.trainer.config.logging.steps_per_log):
            self.log(step)

    def log(self, step: int) -> None:
        """Rank 0's view of the run in nerfstudio's writer (tensorboard/wandb/comet)."""
        from nerfstudio.utils import writer

        info = getattr(self.model, "info", None) or {}
        params = self.model.gauss_params
        row_bytes = sum(p[:1].numel() * p.element_size() for p in params.values())  # one gaussian's parameters
        writer.put_dict(
            name="Distributed",
            scalar_dict={
                "gaussians (max rank)": float(max(self.counts)),
                "gaussians (min rank)": float(min(self.counts)),
                "parameter MB (max rank)": max(self.counts) * row_bytes / 2**20,
                "all_to_all MB (rank 0, forward)": float(info.get("all_to_all_bytes", 0)) / 2**20,
            },
            step=step,
        )

    def wait_while_paused(self, device: torch.device) -> List[int]:
        """Rank 0's viewer paused training: every rank waits here together, checking in with a small
        collective a few times a second (a pause longer than the collective timeout must not look like a
        dead rank), with the train lock released so that rank 0's viewer renders meanwhile. Returns the
        stop requests seen (a Ctrl-C while paused)."""
        lock = self.trainer.train_lock
        lock.release()  # step_end runs inside the training step's `with train_lock`
        try:
            while True:
                time.sleep(0.25)
                flags = torch.zeros(self.ctx.world_size + 1, dtype=torch.int64, device=device)
                flags[self.ctx.rank] = int(self.stop_requested)
                flags[-1] = int(self._paused())
                dist.all_reduce(flags)
                stops = flags[:-1].tolist()
                if any(stops) or not flags[-1]:
                    return stops
        finally:
            lock.acquire()

    # -- rank 0's whole-scene copy (viewer, eval, the render after training)
    def refresh_view(self) -> None:
        self.counts = all_counts(self.n_local(), self.model.gauss_params["means"].device)
        self.model.gathered_params = gathered_params(self.model, self.counts)

    # -- checkpoints
    def checkpoint_state(self, step: int, local_state: Callable[[], Dict]) -> Optional[Dict]:
        """The checkpoint of the whole scene on rank 0 (None elsewhere), the same format a single process
        writes: gathered parameters, Adam moments and densification statistics; the per-rank generators
        under ``splat_metal_resume.distributed``. Collective."""
        from . import resume_state

        trainer, model = self.trainer, self.model
        n = self.n_local()
        counts = all_counts(n, model.gauss_params["means"].device)
        pipeline_sd = gathered_state_dict(trainer.pipeline.state_dict(), counts, n)
        optimizers = {}
        for name in sorted(trainer.optimizers.optimizers):
            opt = trainer.optimizers.optimizers[name]
            optimizers[name] = (
                gathered_optimizer_state(opt, counts, n) if name in model.gauss_params else opt.state_dict()
            )
        resume = local_state()
        strategy = resume.get("strategy")
        if strategy is not None:
            strategy = dict(strategy, state=gathered_strategy_state(strategy["state"], counts, n))
        per_rank: List[Optional[Dict]] = [None] * self.ctx.world_size
        dist.all_gather_object(per_rank, {"rng": resume["rng"]})
        if not self.ctx.is_main:
            return None
        if strategy is not None:
            resume["strategy"] = strategy
        resume["distributed"] = {"world_size": self.ctx.world_size, "counts": list(counts), "ranks": per_rank}
        return {
            "step": step,
            "pipeline": pipeline_sd,
            "optimizers": optimizers,
            "schedulers": {k: v.state_dict() for (k, v) in trainer.optimizers.schedulers.items()},
            "scalers": trainer.grad_scaler.state_dict(),
            resume_state.KEY: resume,
        }

    def resume_prefix(self) -> str:
        """How the run was launched, for the printed resume command."""
        nodes = self.ctx.world_size // max(1, self.ctx.local_world_size)
        prefix = f"torchrun --nproc-per-node {self.ctx.local_world_size}"
        if nodes > 1:
            prefix += f" --nnodes {nodes} (and your rendezvous options)"
        return prefix

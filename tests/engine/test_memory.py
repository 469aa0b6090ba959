"""Memory management (splat_metal_method/engine/memory.py, ops/workspace.py, ops/chunked.py): hooks fire at
the right steps, the max-gaussians cap holds (in the strategy and in a real ns-train run), depth-
chunked rasterization equals the unchunked render forward and backward, and the workspace reuses
its buffers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from gsplat.strategy import DefaultStrategy
from scenes import random_scene

from splat_metal_method.engine import memory
from splat_metal_method.ops import chunked, rasterization, reference
from splat_metal_method.ops.workspace import Workspace, workspace, workspace_stats


# ------------------------------------------------------------------------------------------------
# Workspace
# ------------------------------------------------------------------------------------------------
def test_workspace_reuses_its_buffer_when_sizes_shrink_or_fit():
    ws = Workspace(growth=1.5)
    a = ws.get("keys", (1000,), torch.int32, "cpu")
    ptr = a.data_ptr()
    assert ws.allocations == 1 and ws.capacity("keys", torch.int32, "cpu") == 1000
    for n in (1000, 10, 999, 0, 500, 1000):  # shrink, stay within capacity: never reallocate
        v = ws.get("keys", (n,), torch.int32, "cpu")
        assert v.shape == (n,) and v.is_contiguous()
        assert n == 0 or v.data_ptr() == ptr
    assert ws.allocations == 1
    b = ws.get("keys", (2, 600), torch.int32, "cpu")  # grows geometrically: max(1200, 1.5 * 1000)
    assert b.shape == (2, 600) and ws.allocations == 2
    assert ws.capacity("keys", torch.int32, "cpu") == 1500
    ws.get("keys", (1400,), torch.int32, "cpu")  # fits the grown buffer
    assert ws.allocations == 2
    ws.get("keys", (1000,), torch.int64, "cpu")  # another dtype is another buffer
    ws.get("ids", (10,), torch.int32, "cpu")  # another name too
    assert ws.allocations == 4
    assert ws.nbytes() == 1500 * 4 + 1000 * 8 + 10 * 4


def test_workspace_at_least_hands_out_the_whole_buffer_without_an_aten_op():
    """For kernels told their count (the radix sort's ping-pong buffers): the buffer itself, at least
    the size asked, sharing storage with get() of the same name, and no slice or view to encode."""
    from splat_metal_method.bench import step_ledger

    ws = Workspace(growth=1.5)
    ws.get("keys", (1000,), torch.int32, "cpu")
    with step_ledger.count("t") as led:
        buf = ws.at_least("keys", 600, torch.int32, "cpu")
    assert buf.numel() == 1000 and led.aten_dispatches == 0 and ws.allocations == 1
    grown = ws.at_least("keys", 1200, torch.int32, "cpu")  # grows as get() does
    assert grown.numel() == 1500 and ws.allocations == 2
    assert ws.get("keys", (10,), torch.int32, "cpu").data_ptr() == grown.data_ptr()
    with pytest.raises(ValueError, match="negative"):
        ws.at_least("keys", -1, torch.int32, "cpu")


def test_workspace_growth_is_geometric_for_slowly_growing_requests():
    ws = Workspace(growth=1.5)
    for n in range(1000, 100_000, 1000):  # 99 increasing sizes
        ws.get("isect", (n,), torch.int32, "cpu")
    assert ws.allocations <= 13  # log_1.5(100) + 1 ~ 12.4, not 99


def test_workspace_is_per_thread():
    main = workspace()
    assert workspace() is main
    other = []
    t = threading.Thread(target=lambda: other.append(workspace()))
    t.start()
    t.join()
    assert other[0] is not main
    main.get("stats_probe", (10,), torch.float32, "cpu")
    assert workspace_stats()["bytes"] >= 40


def test_metal_isect_takes_its_scratch_from_the_workspace():
    """The Metal isect stage (emulated on CPU here) reuses its per-step scratch: a smaller render
    after a larger one allocates nothing new, and the results still equal the reference's."""
    from splat_metal_method.ops.metal.isect import isect_tiles_fwd

    ws = workspace()
    scene = random_scene(n=400, C=2, width=64, height=40, seed=5)
    radii, means2d, depths, _, _ = reference.project(
        scene.means, scene.quats, scene.scales, scene.viewmats, scene.Ks, scene.width, scene.height
    )
    allocations = None
    for n in (400, 250, 400, 100):  # sizes shrink and return within capacity
        args = (means2d[:, :n].contiguous(), radii[:, :n].contiguous(), depths[:, :n].contiguous(), 16, 4, 3)
        got = isect_tiles_fwd(*args)
        want = reference.isect_tiles(*args)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
        if allocations is None:
            allocations = ws.allocations
            assert ws.capacity("isect.tile_keys", torch.int32, "cpu") >= want[1].numel()
        assert ws.allocations == allocations


# ------------------------------------------------------------------------------------------------
# Stats and empty_cache
# ------------------------------------------------------------------------------------------------
def test_empty_cache_and_stats_on_cpu():
    assert memory.empty_cache("cpu") is False  # no-op on cpu
    stats = memory.memory_stats("cpu")
    assert stats.device == "cpu" and stats.rss and stats.rss > 0
    if memory.malloc_stats() is not None:  # glibc
        x = torch.empty(64 * memory.MiB, dtype=torch.uint8)
        after = memory.memory_stats("cpu")
        assert after.allocated >= stats.allocated + 60 * memory.MiB
        del x
    assert set(stats.as_mb()) >= {"rss"}


def test_default_budgets_come_from_device_memory():
    total = memory.device_memory("cpu")
    cap, why = memory.default_max_gaussians("cpu")
    assert cap == int(total * memory.GAUSSIAN_MEMORY_FRACTION) // memory.BYTES_PER_GAUSSIAN and "GiB" in why
    budget, _ = memory.default_max_intersections("cpu")
    assert budget == int(total * memory.INTERSECTION_MEMORY_FRACTION) // memory.BYTES_PER_INTERSECTION
    assert memory.resolve_budget(-1, memory.default_max_gaussians, "cpu")[0] == cap
    assert memory.resolve_budget(0, memory.default_max_gaussians, "cpu")[0] is None


def test_the_gaussian_cap_counts_the_sh_degree():
    """A degree-4 gaussian holds 25 SH coefficients, not 16: 9 x 3 floats more of parameter, gradient
    and two Adam moments, so the derived cap is lower (it was degree 3's, ~20% too high)."""
    assert memory.bytes_per_gaussian(3) == memory.BYTES_PER_GAUSSIAN
    assert memory.bytes_per_gaussian(4) == memory.BYTES_PER_GAUSSIAN + 9 * 3 * 4 * 4
    assert memory.bytes_per_gaussian(0) < memory.bytes_per_gaussian(3)
    total = memory.device_memory("cpu")
    cap4, why = memory.default_max_gaussians("cpu", sh_degree=4)
    assert cap4 == int(total * memory.GAUSSIAN_MEMORY_FRACTION) // memory.bytes_per_gaussian(4)
    assert cap4 < memory.default_max_gaussians("cpu")[0] and str(memory.bytes_per_gaussian(4)) in why
    assert memory.resolve_budget(1234, memory.default_max_gaussians, "cpu")[0] == 1234


# ------------------------------------------------------------------------------------------------
# The strategy with a cap, driven like splatfacto drives it
# ------------------------------------------------------------------------------------------------
def _gaussians(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    params = {
        "means": torch.randn(n, 3, generator=g),
        "scales": torch.log(torch.rand(n, 3, generator=g) * 0.02 + 0.001),  # some small, some large
        "quats": torch.randn(n, 4, generator=g),
        "opacities": torch.logit(torch.rand(n, generator=g) * 0.8 + 0.1),
        "features_dc": torch.randn(n, 3, generator=g),
    }
    params = torch.nn.ParameterDict({k: torch.nn.Parameter(v) for k, v in params.items()})
    optimizers = {k: torch.optim.Adam([p], lr=1e-3) for k, p in params.items()}
    return params, optimizers


def _info(n: int, step: int, grad_scale: float = 1e-3, radii=None):
    g = torch.Generator().manual_seed(1000 + step)
    means2d = torch.zeros(1, n, 2, requires_grad=True)
    means2d.grad = torch.rand(1, n, 2, generator=g) * grad_scale
    if radii is None:
        radii = torch.randint(1, 5, (1, n), generator=g, dtype=torch.int32)
    return {"width": 40, "height": 30, "n_cameras": 1, "radii": radii, "gaussian_ids": None, "means2d": means2d}


def _strategy(cls=memory.BudgetedStrategy, **kw):
    settings = dict(
        refine_start_iter=2, refine_every=3, reset_every=9, refine_stop_iter=20, pause_refine_after_reset=0,
        grow_grad2d=2e-4, grow_scale3d=0.01, prune_opa=0.005, verbose=False,
    )  # fmt: skip
    settings.update(kw)
    return cls(**settings)


def _run_steps(strategy, params, optimizers, steps, manager=None, n_fn=None, on_step=None):
    state = strategy.initialize_state(scene_scale=1.0)
    for step in steps:
        if manager is not None:
            manager.before_iteration(step)
        n = len(params["means"])
        strategy.step_post_backward(params, optimizers, state, step, _info(n, step))
        if manager is not None:
            manager.after_iteration(step)
        if on_step is not None:
            on_step(step)
    return state


def test_hooks_fire_after_refine_reset_eval_every_n_and_end(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "empty_cache", lambda device: calls.append(str(device)) or False)
    strategy = _strategy()
    params, optimizers = _gaussians(60)
    manager = memory.MemoryManager(
        "cpu", strategy=strategy, num_gaussians=lambda: len(params["means"]), empty_cache_every=7,
        log_every=0, say=lambda msg: None,
    )  # fmt: skip

    def on_step(step):
        if step in (4, 13):  # an eval pass after these steps (main thread)
            manager.note_render(training=False)
        if step == 5:  # a viewer render (own thread): not an eval pass
            t = threading.Thread(target=manager.note_render, args=(False,))
            t.start()
            t.join()
        manager.note_render(training=True)  # training renders never count

    _run_steps(strategy, params, optimizers, range(25), manager, on_step=on_step)

    # gsplat's rules, spelled out: refine when step > 2, step % 3 == 0 (pause 0), reset when step % 9 == 0,
    # both only before refine_stop_iter (20)
    expected = {}
    for step in range(25):
        reasons = []
        if step < 20 and step > 2 and step % 3 == 0:
            reasons.append("refine")
        if step < 20 and step % 9 == 0:
            reasons.append("reset")
        if step % 7 == 0:
            reasons.append("every")
        if reasons:
            expected.setdefault(step, []).append("+".join(reasons))
    expected.setdefault(5, []).insert(0, "eval")  # eval after step 4 -> released before step 5
    expected.setdefault(14, []).insert(0, "eval")
    got = {}
    for step, reason in manager.releases:
        got.setdefault(step, []).append(reason)
    assert got == expected
    assert len(calls) == sum(len(v) for v in expected.values()) and set(calls) == {"cpu"}

    class RecordingLock:
        def __init__(self):
            self.entered = 0

        def __enter__(self):
            self.entered += 1

        def __exit__(self, *exc):
            return False

    class Attrs:  # TrainingCallbackAttributes with a trainer holding the train lock
        trainer = type("T", (), {"train_lock": RecordingLock()})()

    callbacks = manager.training_callbacks(Attrs())
    assert len(callbacks) == 3
    manager.after_training(step=24)  # runs outside the training loop: takes the lock the viewer uses
    assert Attrs.trainer.train_lock.entered == 1 and manager.releases[-1] == (24, "end")


@pytest.mark.parametrize("device, collections", [("cpu", 0), ("cuda", 1), ("mps", 1)])
def test_releases_collect_garbage_only_where_a_device_cache_is_emptied(monkeypatch, device, collections):
    """A full gc.collect takes ~0.2 s on nerfstudio's heap; it runs before a device cache is emptied
    (tensors in reference cycles hold device memory) and not on cpu, where there is no cache."""
    import gc

    emptied, collected = [], []
    monkeypatch.setattr(memory, "empty_cache", lambda d: emptied.append(torch.device(d).type) or False)
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(a) or 0)
    manager = memory.MemoryManager(device, log_every=0, say=lambda msg: None)
    manager.release(3, "refine")
    manager.release(7, "eval")
    assert emptied == [device, device] and len(collected) == 2 * collections
    assert list(manager.releases) == [(3, "refine"), (7, "eval")]
    off = memory.MemoryManager(device, log_every=0, collect_garbage=False, say=lambda msg: None)
    off.release(1, "refine")
    assert len(collected) == 2 * collections


def test_hooks_can_be_switched_off(monkeypatch):
    monkeypatch.setattr(memory, "empty_cache", lambda device: False)
    strategy = _strategy()
    params, optimizers = _gaussians(40)
    manager = memory.MemoryManager(
        "cpu", strategy=strategy, empty_cache_after_refine=False, empty_cache_after_eval=False, log_every=0,
        say=lambda msg: None,
    )  # fmt: skip
    _run_steps(strategy, params, optimizers, range(20), manager, on_step=lambda s: manager.note_render(False))
    assert list(manager.releases) == []


def test_stats_go_to_the_writer_every_k_steps(monkeypatch):
    from nerfstudio.utils import writer

    monkeypatch.setattr(writer, "EVENT_STORAGE", [])
    params, _ = _gaussians(10)
    manager = memory.MemoryManager("cpu", num_gaussians=lambda: len(params["means"]), log_every=5, say=lambda m: None)
    for step in range(11):
        manager.after_iteration(step)
    logged = {}
    for event in writer.EVENT_STORAGE:
        logged.setdefault(event["name"], []).append(event["step"])
    assert logged["Memory/RSS (MB)"] == [0, 5, 10]
    assert logged["Memory/gaussians"] == [0, 5, 10]
    assert {"Memory/workspace (MB)", "Memory/cache releases"} <= set(logged)
    if memory.malloc_stats() is not None:
        assert {"Memory/allocated (MB)", "Memory/reserved (MB)", "Memory/peak (MB)"} <= set(logged)


def test_budgeted_strategy_without_cap_equals_default_strategy():
    results = []
    for cls in (DefaultStrategy, memory.BudgetedStrategy):
        params, optimizers = _gaussians(80)
        torch.manual_seed(0)  # split samples positions
        _run_steps(_strategy(cls), params, optimizers, range(19))
        results.append({k: v.detach().clone() for k, v in params.items()})
    assert results[0].keys() == results[1].keys()
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]), k


@pytest.mark.parametrize("absgrad", [False, True])
def test_running_statistics_without_host_read_equal_gsplat(absgrad):
    """BudgetedStrategy._update_state (dense, no torch.where) leaves grad2d, count and radii exactly as
    gsplat's (which gathers the visible gaussians on the host), one camera at a time, non-square."""
    g = torch.Generator().manual_seed(3)
    N = 50
    states = []
    for cls in (DefaultStrategy, memory.BudgetedStrategy):
        strategy = cls(absgrad=absgrad, refine_scale2d_stop_iter=100)
        state = strategy.initialize_state(scene_scale=1.0)
        params = {"means": torch.zeros(N, 3)}
        g.manual_seed(3)
        for _ in range(3):
            means2d = torch.zeros(1, N, 2, requires_grad=True)
            means2d.grad = torch.randn(1, N, 2, generator=g)
            means2d.absgrad = means2d.grad.abs() * 2
            radii = torch.randint(-1, 9, (1, N), generator=g, dtype=torch.int32).clamp_min(0)  # some culled
            info = {"width": 96, "height": 64, "n_cameras": 1, "radii": radii, "gaussian_ids": None, "means2d": means2d}
            strategy._update_state(params, state, info)
        states.append(state)
    for key in ("grad2d", "count", "radii"):
        assert torch.equal(states[0][key], states[1][key]), key
    assert states[1]["count"].max() >= 2 and (states[1]["count"] < 3).any()  # visibility varied


@pytest.mark.parametrize("absgrad", [False, True])
@pytest.mark.parametrize("C", [1, 2])
def test_running_statistics_kernel_equals_the_torch_ops(absgrad, C):
    """With the metal backend (info["backend"]), _update_state runs one kernel (train.metal
    densify_stats) for its 12 aten ops: count and radii are the same bits, grad2d within float32 rounding,
    several cameras too (culled and non-square), and the first update allocates the state as the torch path
    does."""
    g = torch.Generator().manual_seed(5)
    N = 70
    states = []
    for backend in ("reference", "metal"):
        strategy = memory.BudgetedStrategy(absgrad=absgrad, refine_scale2d_stop_iter=100)
        state = strategy.initialize_state(scene_scale=1.0)
        params = {"means": torch.zeros(N, 3)}
        g.manual_seed(5)
        for step in range(3):
            means2d = torch.zeros(C, N, 2, requires_grad=True)
            means2d.grad = torch.randn(C, N, 2, generator=g) * 10.0 ** (step - 2)
            means2d.absgrad = means2d.grad.abs() * 2
            radii = torch.randint(-1, 9, (C, N), generator=g, dtype=torch.int32).clamp_min(0)
            info = {"width": 96, "height": 64, "n_cameras": C, "radii": radii, "gaussian_ids": None,
                    "means2d": means2d, "backend": backend}  # fmt: skip
            strategy._update_state(params, state, info)
        states.append(state)
    assert torch.equal(states[0]["count"], states[1]["count"]) and torch.equal(states[0]["radii"], states[1]["radii"])
    # the norm: float32 sqrt(x * x + y * y) in the kernel (as MPS computes it), PyTorch's CPU norm accumulates
    # in double: at most an ulp or two apart
    torch.testing.assert_close(states[1]["grad2d"], states[0]["grad2d"], rtol=3e-7, atol=0)
    assert (states[1]["count"] > 0).any() and (states[1]["count"] < 3 * C).any()


def test_depth_chunk_plan_is_skipped_only_well_under_the_budget():
    """render_budget: a training render skips chunked.plan (its host read) when the previous one used
    at most 1/PLAN_HEADROOM of the budget; first render, eval, after a refine, near the budget: plans."""
    strategy = memory.BudgetedStrategy()
    manager = memory.MemoryManager("cpu", strategy=strategy, max_intersections=4000, say=lambda m: None)
    ids = lambda n: {"flatten_ids": torch.zeros(n, dtype=torch.int32)}  # noqa: E731
    assert manager.render_budget(training=True) == 4000  # nothing known yet
    manager.note_render(True, ids(1000))
    assert manager.render_budget(training=True) is None and manager.render_budget(training=False) == 4000
    manager.note_render(True, ids(1001))
    assert manager.render_budget(training=True) == 4000  # too close to the budget
    manager.note_render(True, {"flatten_ids": None})  # a depth-chunked render
    assert manager.render_budget(training=True) == 4000
    manager.note_render(True, ids(10))
    strategy.events.append((100, "refine"))
    manager.after_iteration(100)
    assert manager.render_budget(training=True) == 4000  # the gaussians changed
    assert memory.MemoryManager("cpu", max_intersections=None).render_budget(training=True) is None


@pytest.mark.parametrize("screen_size_rule", [False, True], ids=["grad-only", "screen-size-split"])
def test_cap_holds_and_pruning_continues(screen_size_rule):
    cap = 100
    strategy = _strategy(max_gaussians=cap, refine_scale2d_stop_iter=100 if screen_size_rule else 0)
    messages = []
    strategy.on_cap = messages.append
    params, optimizers = _gaussians(80)
    counts = []
    _run_steps(strategy, params, optimizers, range(19), on_step=lambda s: counts.append(len(params["means"])))
    assert max(counts) <= cap
    assert max(counts) >= cap - 1  # growth did fill up to the cap (each candidate adds 1 or 2)
    assert strategy.growth_skipped > 0 and strategy.cap_hit_step is not None
    assert len(messages) == 1 and "max-gaussians cap 100" in messages[0]

    # At the cap: growth is skipped, pruning still runs.
    state = strategy.initialize_state()
    n = len(params["means"])
    with torch.no_grad():
        params["opacities"][:10] = -10.0  # sigmoid < prune_opa: pruned
    radii = torch.full((1, n), 3, dtype=torch.int32)
    step = 12  # a refine step (> reset_every, so the too-big rules apply too)
    strategy.step_post_backward(params, optimizers, state, step, _info(n, step, grad_scale=1.0, radii=radii))
    assert len(params["means"]) <= cap - 10  # grown at most to the cap, then 10 pruned


def test_capped_growth_keeps_the_screen_size_record_for_pruning():
    """A gaussian hidden from growth by the cap must still be pruned as too big on screen."""
    n, cap = 50, 51
    strategy = _strategy(max_gaussians=cap, refine_scale2d_stop_iter=100, reset_every=5, prune_scale2d=0.15)
    strategy.on_cap = lambda m: None
    params, optimizers = _gaussians(n, seed=3)
    with torch.no_grad():
        params["scales"][:] = -8.0  # tiny in 3D: only the screen-size rule can prune
        params["opacities"][:] = 2.0
    state = strategy.initialize_state()
    step = 12  # refine (12 % 3 == 0, > 2) and > reset_every: screen-size pruning active
    info = _info(n, step, grad_scale=1.0, radii=torch.full((1, n), 2, dtype=torch.int32))
    info["radii"][0, 7] = 30  # 30 / max(40, 30) = 0.75 > prune_scale2d: must be pruned
    info["means2d"].grad[0, 7] = 0.0  # lowest priority: hidden from growth by the cap
    strategy.step_post_backward(params, optimizers, state, step, info)
    assert strategy.growth_skipped > 0
    assert len(params["means"]) == cap - 1  # one grown, the too-big one pruned


# ------------------------------------------------------------------------------------------------
# Depth-chunked rasterization
# ------------------------------------------------------------------------------------------------
def _dense_scene(width=37, height=23, C=2, seed=1):
    # Opaque, large gaussians: many pixels hit the transmittance floor, so the stop rule matters.
    return random_scene(
        n=300, C=C, width=width, height=height, seed=seed, sh_degree=2, backgrounds=True,
        opacity_range=(0.6, 0.99), scale_range=(0.05, 0.4),
    )  # fmt: skip


def _render(scene, backend, budget, grad=True):
    leaves = {k: v.clone().requires_grad_(grad) for k, v in scene.tensors().items()}
    with torch.set_grad_enabled(grad):
        colors, alphas, meta = rasterization(
            **scene.kwargs(**leaves), render_mode="RGB+ED", absgrad=grad, backend=backend, max_intersections=budget
        )
    out = {"colors": colors.detach(), "alphas": alphas.detach(), "meta": meta}
    if grad:
        g = torch.Generator().manual_seed(0)
        loss = (colors * torch.rand(colors.shape, generator=g)).sum() + (
            alphas * torch.rand(alphas.shape, generator=g)
        ).sum()
        loss.backward()
        out["grads"] = {k: v.grad for k, v in leaves.items() if v.grad is not None}
        out["absgrad"] = meta["means2d"].absgrad
    return out


def _assert_same_render(got, want):
    torch.testing.assert_close(got["colors"], want["colors"], rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(got["alphas"], want["alphas"], rtol=1e-5, atol=1e-6)
    if "grads" in want:
        assert got["grads"].keys() == want["grads"].keys()
        for k, g in want["grads"].items():
            scale = g.abs().max().item() + 1e-12
            assert (got["grads"][k] - g).abs().max().item() <= 1e-5 * scale, k
        scale = want["absgrad"].abs().max().item()
        assert scale > 0 and (got["absgrad"] - want["absgrad"]).abs().max().item() <= 1e-5 * scale


def test_dense_scene_exercises_the_stop_rule():
    scene = _dense_scene()
    radii, means2d, depths, conics, _ = reference.project(
        scene.means, scene.quats, scene.scales, scene.viewmats, scene.Ks, scene.width, scene.height
    )
    tw, th = (scene.width + 15) // 16, (scene.height + 15) // 16
    _, isect_ids, flatten_ids = reference.isect_tiles(means2d, radii, depths, 16, tw, th)
    offsets = reference.isect_offset_encode(isect_ids, scene.C, tw, th)
    colors = torch.rand(scene.C, scene.N, 3)
    T0 = torch.ones(scene.C, scene.height, scene.width)
    _, _, stopped = reference.rasterize_depth_chunk(
        means2d, conics, colors, scene.opacities.expand(scene.C, -1), scene.width, scene.height, 16, offsets,
        flatten_ids, T0, torch.zeros_like(T0, dtype=torch.bool),
    )  # fmt: skip
    assert 0.05 < stopped.float().mean() < 0.95  # some pixels stop, some do not


@pytest.mark.parametrize("backend", ["reference", "cpu", "metal"])
@pytest.mark.parametrize("budget", [900, 150, 7])
def test_chunked_equals_unchunked_reference_forward_and_backward(budget, backend, monkeypatch):
    """Against the unchunked reference. The cpu and metal (emulated here) backends intersect and
    composite each chunk with their own code: the reference's chunk compositor is made to fail for
    them, so a fallback to it would show."""
    scene = _dense_scene()
    want = _render(scene, "reference", None)
    total = want["meta"]["isect_ids"].numel()
    assert total > 900 and want["meta"]["depth_chunks"] == 1
    if backend == "cpu":
        from splat_metal_method.ops.cpu import available

        if not available():
            pytest.skip("no C++ compiler here to build the native CPU backend")
    if backend != "reference":

        def refuse(*args, **kwargs):
            raise AssertionError(f"the {backend} backend fell back to the reference's chunk compositor")

        monkeypatch.setattr(reference, "rasterize_depth_chunk", refuse)
    got = _render(scene, backend, budget)
    assert got["meta"]["depth_chunks"] > 1 and got["meta"]["isect_ids"] is None
    assert torch.equal(got["meta"]["tiles_per_gauss"], want["meta"]["tiles_per_gauss"])
    _assert_same_render(got, want)


def test_metal_chunks_resume_across_several_passes(monkeypatch):
    """Metal bounds the gaussians of a tile per dispatch (RASTER_CHUNK); a resumed depth chunk whose
    tiles need several dispatches carries T and the stop state from pass to pass."""
    import splat_metal_method.ops.metal.rasterize as metal_rasterize

    monkeypatch.setattr(metal_rasterize, "RASTER_CHUNK", 16)
    monkeypatch.setattr(reference, "rasterize_depth_chunk", None)  # no fallback: calling it fails
    scene = _dense_scene()
    want = _render(scene, "reference", None)
    got = _render(scene, "metal", 150)
    assert got["meta"]["depth_chunks"] > 1
    _assert_same_render(got, want)


def test_chunked_equals_unchunked_with_the_reference_own_checkpointing(monkeypatch):
    """Large renders: the reference also cuts its tiles into blocks recomputed in backward; that
    checkpointing then nests inside the depth chunks' own."""
    scene = _dense_scene(C=1, seed=3)
    want = _render(scene, "reference", None)
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 4096)
    monkeypatch.setattr(reference, "CHECKPOINT_ELEMENTS", 1024)
    got = _render(scene, "reference", 200)
    assert got["meta"]["depth_chunks"] > 1
    _assert_same_render(got, want)


@pytest.mark.parametrize("size", [(16, 16), (23, 41)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_chunked_equals_unchunked_without_grad(size):
    scene = _dense_scene(*size, C=1, seed=2)
    want = _render(scene, "reference", None, grad=False)
    got = _render(scene, "reference", 50, grad=False)
    assert got["meta"]["depth_chunks"] > 1
    _assert_same_render(got, want)


def test_chunks_are_depth_ordered_and_bounded():
    scene = _dense_scene(C=2)
    radii, means2d, depths, _, _ = reference.project(
        scene.means, scene.quats, scene.scales, scene.viewmats, scene.Ks, scene.width, scene.height
    )
    tw, th = (scene.width + 15) // 16, (scene.height + 15) // 16
    budget = 100
    plan = chunked.plan(means2d, radii, depths, 16, tw, th, budget)
    counts = plan.tiles_per_gauss.long()
    assert plan.n_intersections == int(counts.sum()) > budget
    assert torch.equal(counts, reference.isect_tiles(means2d, radii, depths, 16, tw, th)[0].long())
    for c in range(scene.C):
        visible = counts[c] > 0
        assert bool((plan.chunk_ids[c][~visible] == -1).all())
        ids, d = plan.chunk_ids[c][visible], depths[c][visible]
        for k in range(plan.n_chunks):
            in_k = ids == k
            assert int(counts[c][visible][in_k].sum()) <= budget + int(counts[c].max()) - 1
            if in_k.any() and (ids > k).any():
                assert d[in_k].max() <= d[ids > k].min()  # chunk k lies in front of later chunks
    assert chunked.plan(means2d, radii, depths, 16, tw, th, plan.n_intersections) is None  # fits: no chunks


# ------------------------------------------------------------------------------------------------
# The cap in a real ns-train run
# ------------------------------------------------------------------------------------------------
def test_max_gaussians_cap_holds_in_ns_train(tmp_path):
    from splat_metal_method.data import demo_scene

    data = tmp_path / "demo"
    demo_scene.generate(data, width=48, height=32, views=10, seed=0)  # 1,500 seed points
    cap = 1600
    out = tmp_path / "outputs"
    ns_train = Path(sys.executable).parent / "ns-train"
    args = [
        str(ns_train), "splat-metal", "--data", str(data), "--output-dir", str(out),
        "--machine.device-type", "cpu", "--max-num-iterations", "60", "--steps-per-save", "1000",
        "--vis", "tensorboard", "--logging.local-writer.enable", "False", "--viewer.quit-on-train-completion", "True",
        "--pipeline.model.warmup-length", "10", "--pipeline.model.refine-every", "10",
        "--pipeline.model.reset-alpha-every", "30", "--pipeline.model.densify-grad-thresh", "0.00002",
        "--pipeline.model.max-gaussians", str(cap), "--pipeline.model.memory-log-every", "10",
    ]  # fmt: skip
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", COLUMNS="250")
    env.pop("SPLAT_METAL_BACKEND", None)
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert f"max gaussians {cap:,} (set in the config)" in re.sub(r"\s+", " ", log), log[-4000:]
    assert "max-gaussians cap 1,600 reached" in re.sub(r"\s+", " ", log), "the run never reached the cap"
    counts = [int(n) for n in re.findall(r"Now having (\d+) GSs", log)]
    assert counts and max(counts) <= cap
    ckpts = sorted(out.rglob("step-*.ckpt"))
    assert ckpts, log[-2000:]
    state = torch.load(ckpts[-1], map_location="cpu", weights_only=False)["pipeline"]
    n_final = state["_model.gauss_params.means"].shape[0]
    assert 0 < n_final <= cap

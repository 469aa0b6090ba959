"""A refine on the Metal backend (engine/memory.py KnownRows, BudgetedStrategy.rows_on_device): the same
duplicate / split / prune as gsplat 1.4's DefaultStrategy, bit for bit, with the rows found on the
device (ops/metal/scan.py select_rows) instead of by nonzero, one host read per grow and per prune."""

from __future__ import annotations

import pytest
import torch
from gsplat.strategy import DefaultStrategy

from splat_metal_method.engine.memory import BudgetedStrategy, KnownRows
from splat_metal_method.ops.metal.scan import select_rows


def _setup(n=400, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = torch.nn.ParameterDict({
        "means": torch.randn(n, 3, generator=gen),
        "scales": torch.randn(n, 3, generator=gen) * 1.5 - 4.0,
        "quats": torch.randn(n, 4, generator=gen),
        "opacities": torch.randn(n, generator=gen) * 2.0,
        "features_dc": torch.rand(n, 3, generator=gen),
    })  # fmt: skip
    optimizers = {k: torch.optim.Adam([p], lr=1e-3) for k, p in params.items()}
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=gen)
    for opt in optimizers.values():
        opt.step()
    state = {
        "grad2d": torch.rand(n, generator=gen) * 0.0006,
        "count": torch.randint(0, 5, (n,), generator=gen).float(),
        "radii": torch.rand(n, generator=gen) * 0.1,
        "scene_scale": 1.0,
    }
    return params, optimizers, state


def _snapshot(params, optimizers, state):
    out = {f"param.{k}": p.detach().clone() for k, p in params.items()}
    for k, opt in optimizers.items():
        for name, v in opt.state[opt.param_groups[0]["params"][0]].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[f"adam.{k}.{name}"] = v.clone()
    out.update({f"state.{k}": v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)})
    return out


@pytest.mark.parametrize("step", [600, 3100])  # before and after the first opacity reset (pruning by size)
@pytest.mark.parametrize("scale2d", [0, 4000])  # gsplat's screen-size rules off (its default) and on
def test_refine_with_known_rows_is_gsplats(step, scale2d, monkeypatch):
    results = []
    for on_device in (False, True):
        if on_device:  # the known-rows path runs, not gsplat's (which reads every count and mask)

            def gsplats(*args, **kwargs):
                raise AssertionError("gsplat's _grow_gs/_prune_gs ran")

            monkeypatch.setattr(DefaultStrategy, "_grow_gs", gsplats)
            monkeypatch.setattr(DefaultStrategy, "_prune_gs", gsplats)
        params, optimizers, state = _setup()
        strategy = BudgetedStrategy.from_strategy(DefaultStrategy(refine_scale2d_stop_iter=scale2d), 0)
        strategy.rows_on_device = on_device
        torch.manual_seed(7)  # split samples positions
        grown = strategy._grow_gs(params, optimizers, state, step)
        pruned = strategy._prune_gs(params, optimizers, state, step)
        results.append((grown, pruned, _snapshot(params, optimizers, state)))
    (g0, p0, s0), (g1, p1, s1) = results
    assert g0 == g1 and p0 == p1 and g0[0] > 0 and g0[1] > 0 and p0 > 0, (g0, p0)
    assert s0.keys() == s1.keys()
    for k in s0:
        assert torch.equal(s0[k], s1[k]), k


def test_known_rows_answers_where_and_invert_and_nothing_else():
    mask = torch.tensor([True, False, True, True, False])
    known = KnownRows.of(mask, 3)
    assert torch.equal(torch.where(known)[0], torch.tensor([0, 2, 3]))
    assert torch.equal(torch.where(~known)[0], torch.tensor([1, 4]))
    assert torch.equal(torch.where(~~known)[0], torch.tensor([0, 2, 3]))
    assert known.device == mask.device and type(known.sum()) is torch.Tensor and int(known.sum()) == 3
    assert torch.equal(torch.where(known, 1, 0), torch.tensor([1, 0, 1, 1, 0]))  # the 3-argument where


@pytest.mark.parametrize("n", [0, 1, 255, 4096, 4097, 70_000])
def test_select_rows_is_torch_where(n):
    mask = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.37
    sel, rest = select_rows(mask, int(mask.sum()), with_rest=True)
    assert torch.equal(sel, torch.where(mask)[0]) and torch.equal(rest, torch.where(~mask)[0])
    with pytest.raises(ValueError):
        select_rows(mask, n + 1)

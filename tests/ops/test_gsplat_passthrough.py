"""Backend "gsplat" is a passthrough that costs nothing: ``rasterization(..., backend="gsplat")`` hands gsplat's
``rasterization`` the caller's call with no device work of its own (no aten op, no host sync, no copy).

gsplat's CUDA kernels cannot run here, so gsplat's entry point is replaced by a recorder that only keeps its
arguments (it stands in for the kernel launch); what is under test is our layer around it, run on CPU
tensors under a TorchDispatchMode that counts every aten op it dispatches, with the host reads a CPU tensor
would not dispatch (.item(), .tolist(), .cpu(), .numpy(), torch.cuda.synchronize) counted beside it.
Backend resolution is told the tensors are CUDA ones: its gsplat check reads ``device.type`` only (it
raises on CPU tensors: tests/ops/test_rasterization_api.py)."""

from __future__ import annotations

import importlib

import gsplat.rendering
import pytest
import torch
from aten_counter import AtenCounter
from scenes import random_scene

from splat_metal_method.ops import rasterization

LAYER = importlib.import_module("splat_metal_method.ops.rasterization")  # the module, not the function
HOST_READS = ("item", "tolist", "cpu", "numpy")


def count_layer_work(monkeypatch, call: dict):
    """(aten ops, host reads, what reached gsplat as (args, kwargs)) of one ``rasterization(**call,
    backend="gsplat")``."""
    reached, reads = [], []
    outputs = (object(), object(), {})  # made before the count: the recorder itself dispatches nothing

    def recorder(*args, **kwargs):
        reached.append((args, kwargs))
        return outputs

    def reading(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            reads.append(name)
            return original(self, *args, **kwargs)

        return read

    monkeypatch.setattr(gsplat.rendering, "rasterization", recorder)
    monkeypatch.setattr(LAYER, "_check_gsplat", lambda device: None)
    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, reading(name))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: reads.append("cuda.synchronize"))
    with AtenCounter() as counter:
        result = rasterization(**call, backend="gsplat")
    assert result is outputs  # gsplat's results, as they are
    assert len(reached) == 1
    return counter.ops, reads, reached[0]


CALLS = {
    "rgb": dict(sh_degree=None, render_mode="RGB", grad=False, backgrounds=False, kwargs={}),
    "training-step": dict(
        sh_degree=3, render_mode="RGB", grad=True, backgrounds=False, kwargs={"absgrad": True, "packed": False}
    ),  # fmt: skip
    "depth-backgrounds-antialiased": dict(
        sh_degree=1,
        render_mode="RGB+ED",
        grad=True,
        backgrounds=True,
        kwargs={"rasterize_mode": "antialiased", "tile_size": 8, "max_intersections": 10},
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(CALLS))
def test_gsplat_backend_passes_the_call_through_with_no_work(case, monkeypatch):
    spec = CALLS[case]
    scene = random_scene(n=40, C=2, width=37, height=23, seed=5, sh_degree=spec["sh_degree"],
                         backgrounds=spec["backgrounds"])  # fmt: skip
    call = scene.kwargs(render_mode=spec["render_mode"], **spec["kwargs"])
    if spec["grad"]:
        for name in ("means", "quats", "scales", "opacities", "colors"):
            call[name] = call[name].detach().clone().requires_grad_(True)
    call["quats"] = call["quats"].detach().clone()
    call["quats"][0] = 0.0  # a zero quaternion reaches gsplat as given: no guard launches on the device
    ops, reads, (args, kwargs) = count_layer_work(monkeypatch, call)
    assert ops == [], f"the op layer dispatched {len(ops)} aten ops around gsplat's call: {ops}"
    assert reads == [], f"the op layer read the device from the host: {reads}"
    # what reaches gsplat is the caller's call: the same tensors (no copy, no view) and the same options
    names = ("means", "quats", "scales", "opacities", "colors", "viewmats", "Ks")
    for name, value in zip(names, args):
        assert value is call[name], name
    assert args[7:] == (call["width"], call["height"])
    expected = {k: v for k, v in call.items() if k not in names + ("width", "height", "max_intersections")}
    for name, value in expected.items():
        assert kwargs[name] is value or kwargs[name] == value, name
    assert set(kwargs) >= set(expected)


def test_the_counter_sees_device_work(monkeypatch):
    """The counter fails the layer on one aten op or host read: a guard of the kind that was removed (the zero
    quaternion's torch.where) planted in front of gsplat is counted."""
    scene = random_scene(n=8, C=1, width=16, height=16, seed=1)
    original = LAYER.check_inputs

    def guarded(call):
        original(call)
        quats = call.quats
        torch.where((quats * quats).sum(dim=-1, keepdim=True) == 0, quats.new_ones(1), quats)
        quats.sum().item()

    monkeypatch.setattr(LAYER, "check_inputs", guarded)
    ops, reads, _ = count_layer_work(monkeypatch, scene.kwargs())
    assert len(ops) >= 5 and "aten.where.self" in ops
    assert reads == ["item"]

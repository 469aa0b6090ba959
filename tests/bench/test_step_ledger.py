"""The step ledger (splat_metal_method/bench/step_ledger.py): host syncs counted as a Mac runs a step, aten
dispatches, and our kernels' launches with the emulator's work counters inside them. Its budgets on a real
Trainer's steps are benchmarks/tests/test_step_ledger_budgets.py.
"""

from __future__ import annotations

import pytest
import torch

from splat_metal_method.bench import step_ledger


def test_host_syncs_counted_as_on_a_mac():
    x = torch.arange(6.0)
    step = torch.tensor(3.0)  # like Adam's step counter: a host tensor on a Mac too
    with step_ledger.count("t", host_tensors=[step]) as led:
        x.sum().item()  # device -> host
        x[x > 2]  # boolean mask: nonzero on the device
        torch.where(x > 4)  # nonzero
        x.tolist()
        torch.tensor([1.0, 2.0], device=x.device)  # Python -> device
        torch.tensor([1.0, 2.0]).to(x.device)  # host tensor -> device
        step.item()  # host scalar: no sync
        torch.tensor([5.0], device="cpu").item()  # made on the host on purpose: no sync
    reads = [what for what, _ in led.host_reads]
    assert reads == ["_local_scalar_dense", "index.Tensor (boolean mask)", "nonzero", "Tensor.tolist"], reads
    assert [w for w, _ in led.host_writes] == ["torch.tensor(data, device=...)", "host_tensor.to(device)"]
    assert len(led.host_local) == 2 and led.host_syncs == 6
    assert led.aten_ops["nonzero"] == 1 and led.aten_dispatches >= 8


SRC = """
#include <metal_stdlib>
using namespace metal;
kernel void work(device const float* x [[buffer(0)]], device atomic_float* acc [[buffer(1)]],
                 uint i [[thread_position_in_grid]], uint l [[thread_index_in_threadgroup]]) {
  threadgroup float t[64];
  t[l] = x[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float4 s = simd_sum(float4(t[l]));
  float y = simd_shuffle_xor(s.x, 1u);
  if (l % 2 == 0) atomic_fetch_add_explicit(acc, y, memory_order_relaxed);
}
"""


@pytest.mark.parametrize("threads", [128, 100])  # 100: a partial last group (36 threads, 2 simdgroups)
def test_emulator_work_counters(threads):
    from splat_metal_method.ops.metal.runtime import get_library

    lib = get_library(SRC, "ledger_counters", "emulator")
    x, acc = torch.ones(threads), torch.zeros(1)
    with step_ledger.count("k") as led:
        lib.work(x, acc, threads=threads, group_size=64)
    w = led.kernels["work"]
    groups = -(-threads // 64)
    simdgroups = sum(-(-min(64, threads - g * 64) // 32) for g in range(groups))
    assert (w.launches, w.threads, w.threadgroups) == (1, threads, groups)
    assert w.simd_reductions == 4 * simdgroups  # one float4 simd_sum per simdgroup: 4 scalar reductions
    assert w.simd_shuffles == simdgroups
    assert w.device_atomics == (threads + 1) // 2 and w.threadgroup_atomics == 0
    assert w.barriers == groups and w.threadgroup_bytes == 64 * 4
    assert w.buffer_bytes == threads * 4 + 4


def test_the_launch_observer_runs_counts_or_skips_a_launch():
    """The runtime's one counting hook: an observer is given each launch and decides; one that does not launch
    leaves the outputs unwritten (the benchmarks' count-only mode), while the runtime still counts the launch."""
    from splat_metal_method.ops.metal import runtime

    lib = runtime.get_library(SRC, "ledger_counters", "emulator")
    x, acc = torch.ones(64), torch.zeros(1)
    seen = []
    previous = runtime.set_launch_observer(lambda name, kernel, args, launch: seen.append((name, launch["threads"])))
    try:
        runtime.reset_launch_counts()
        lib.work(x, acc, threads=64, group_size=64)
    finally:
        assert runtime.set_launch_observer(previous) is not None
    assert seen == [("work", 64)] and float(acc) == 0.0 and runtime.launch_counts() == {"work": 1}
    with step_ledger.count("k") as led:  # the step ledger's observer runs it
        lib.work(x, acc, threads=64, group_size=64)
    assert float(acc) == 32 * 32 and led.kernels["work"].launches == 1  # 32 even lanes add a 32-lane sum


def test_non_blocking_copy_to_the_host_is_not_a_sync():
    x = torch.arange(6.0)
    with step_ledger.count("t") as led:
        host = x.sum().to("cpu", non_blocking=True)  # queued behind the device's work: no wait
        x.max().cpu()  # waits for the device
    assert [what for what, _ in led.host_reads] == ["Tensor.cpu"] and led.host_syncs == 1, led.host_reads
    with step_ledger.count("later", host_tensors=[host]) as led:  # a later step reads the host copy
        assert float(host) == 15.0
    assert led.host_syncs == 0 and [what for what, _ in led.host_local] == ["_local_scalar_dense"]


def test_a_foreach_op_counts_once_per_tensor():
    """MPS has no foreach kernels: torch runs a _foreach_ op tensor by tensor there."""
    ts = [torch.ones(3), torch.ones(2), torch.ones(5)]
    with step_ledger.count("t") as led:
        torch._foreach_norm(ts)
        ts[0].sum()
    assert led.aten_ops["_foreach_norm.Scalar"] == 3 and led.aten_dispatches == 4, dict(led.aten_ops)


def test_ops_on_a_host_copy_stay_on_the_host():
    """What is computed from a host copy only (a pass plan from tile lengths read once) reads no device."""
    from splat_metal_method.ops.metal import runtime

    x = torch.arange(6, dtype=torch.int32)
    with step_ledger.count("t") as led:
        lengths = runtime.host_read(x + 0).view(2, 3).long()  # one read
        assert int(lengths.max()) == 5 and int(lengths.sum()) == 15  # of the host copy: no read
        int((x + 1).max())  # of a device tensor: a read
    assert led.host_syncs == 2 and len(led.host_local) == 2, (led.host_reads, led.host_writes, led.host_local)

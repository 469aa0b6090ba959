"""AtenCounter: every aten op dispatched inside a ``with`` block, by name, for tests that count a path's device work
(tests/ops/test_gsplat_passthrough.py, tests/method/test_model_loss_dict.py)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class AtenCounter(TorchDispatchMode):
    """``with AtenCounter() as counter: ...``, then ``counter.ops``: the aten ops dispatched, in order, by name."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

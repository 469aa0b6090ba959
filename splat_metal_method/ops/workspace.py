"""Reusable scratch buffers for per-step tensors whose size changes every step.

The number of tile intersections (and with it the intersection keys, ids and sort buffers) is
different for every view and every step. Allocating those freshly each step asks the caching
allocator for a new size every time; on MPS such churn is a prime suspect for memory that grows
far beyond what the scene needs. A workspace keeps one flat buffer per (name, dtype, device),
grows it geometrically when a request does not fit, never shrinks it, and hands out views:

    ws = workspace()                                   # this thread's workspace
    keys = ws.get("isect.tile_keys", (M,), torch.int32, device)

A view stays valid until the next ``get`` of the same name on the same thread. Use it only for
scratch that does not leave the stage: never return it, never let autograd save it.
Each thread has its own workspace, so a viewer render on another thread never shares a buffer
with the training step.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Dict, Sequence, Tuple, Union

import torch
from torch import Tensor

GROWTH = 1.5  # capacity multiplier when a request does not fit (>= 1.5 keeps regrowth rare)


class Workspace:
    """Flat buffers keyed by (name, dtype, device) that grow by ``growth`` and never shrink."""

    def __init__(self, growth: float = GROWTH):
        if growth < 1.0:
            raise ValueError(f"[Workspace] growth must be >= 1, got {growth}")
        self.growth = float(growth)
        self._buffers: Dict[Tuple[str, torch.dtype, torch.device], Tensor] = {}
        self.allocations = 0  # buffers allocated (first use or regrowth) since creation
        self.requests = 0  # get() calls since creation

    def get(
        self, name: str, shape: Union[int, Sequence[int]], dtype: torch.dtype, device: Union[str, torch.device]
    ) -> Tensor:
        """A contiguous, uninitialised view of ``shape`` into the buffer for (name, dtype, device)."""
        shape = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"[Workspace] {name}: negative shape {list(shape)}")
        numel = math.prod(shape)
        buf = self._grown(name, numel, dtype, device)
        # as few aten ops as the request allows (each is an encode on MPS): the buffer itself when it
        # has the requested size and rank 1, one slice or one view otherwise
        if buf.numel() != numel:
            buf = buf[:numel]
        return buf if buf.shape == shape else buf.view(shape)

    def at_least(self, name: str, numel: int, dtype: torch.dtype, device: Union[str, torch.device]) -> Tensor:
        """The whole flat buffer for (name, dtype, device), grown to hold at least ``numel`` elements and
        possibly longer: no slice (an aten op) for a kernel that is told how many elements to use."""
        if numel < 0:
            raise ValueError(f"[Workspace] {name}: negative size {numel}")
        return self._grown(name, int(numel), dtype, device)

    def _grown(self, name: str, numel: int, dtype: torch.dtype, device: Union[str, torch.device]) -> Tensor:
        key = (name, dtype, torch.device(device))
        self.requests += 1
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            capacity = numel if buf is None else max(numel, math.ceil(buf.numel() * self.growth))
            self._buffers[key] = buf = None  # drop the old buffer before allocating the new one
            buf = torch.empty((max(capacity, 1),), dtype=dtype, device=key[2])
            self._buffers[key] = buf
            self.allocations += 1
        return buf

    def capacity(self, name: str, dtype: torch.dtype, device: Union[str, torch.device]) -> int:
        """Elements the buffer for (name, dtype, device) holds now (0 if never requested)."""
        buf = self._buffers.get((name, dtype, torch.device(device)))
        return 0 if buf is None else buf.numel()

    def nbytes(self) -> int:
        """Bytes held by all buffers of this workspace."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        """Releases every buffer (the next request allocates again)."""
        self._buffers.clear()


_local = threading.local()
_all: "weakref.WeakSet[Workspace]" = weakref.WeakSet()
_all_lock = threading.Lock()


def workspace() -> Workspace:
    """The calling thread's workspace (created on first use)."""
    ws = getattr(_local, "ws", None)
    if ws is None:
        ws = _local.ws = Workspace()
        with _all_lock:
            _all.add(ws)
    return ws


def workspace_stats() -> Dict[str, int]:
    """Totals over every live thread's workspace: bytes held, allocations, requests."""
    with _all_lock:
        spaces = list(_all)
    return {
        "bytes": sum(w.nbytes() for w in spaces),
        "allocations": sum(w.allocations for w in spaces),
        "requests": sum(w.requests for w in spaces),
    }

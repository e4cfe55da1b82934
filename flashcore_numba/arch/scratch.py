"""Scratch memory that kernels need beside their arguments, with one owner.

Two kernels need memory the caller does not pass:

- phase 09's persistent blocks take their query blocks from a work counter (one int32);
- phase 10's key splits write their partial outputs and log-sum-exps and count, per row tile, the
  blocks that have finished, so that the last one merges them (phases/common.Splits: their shapes).

No launch needs what another left there: each kernel leaves its counters at zero when it ends, and
writes every partial before it reads it. So launches that run one after another may share it, and
scratch is kept per (device, stream, shapes, allocator): launches on one stream run in order, and
launches on different streams never share. It is made on the first launch that needs it on a
stream, its counters zeroed there in stream order (a CUDA graph that captures that first launch
captures the zeroing too), from torch's caching allocator for calls on torch tensors (so a call
allocates nothing outside it, and a capture takes the memory from the graph's pool) and from
Numba's otherwise.

At most KEPT sets are kept, the least recently used forgotten first. A CUDA graph goes on using
the scratch its capture used: a graph captured on a stream where calls ran before stays valid as
long as fewer than KEPT other (stream, shape) sets are made after it (`torch.cuda.graph` captures
on a stream of its own, whose scratch comes from the graph's own pool).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from . import launch as driver
from .sim import simulator_enabled

KEPT = 256
_KEPT: OrderedDict = OrderedDict()  # key -> Scratch
_LOCK = threading.Lock()


class Scratch:
    """The buffers of one (device, stream, shapes) key: `arrays` as the allocator gives them (torch
    tensors or Numba device arrays) and `addresses`, their device pointers, in the same order."""

    __slots__ = ("arrays", "addresses")

    def __init__(self, arrays, addresses):
        self.arrays, self.addresses = tuple(arrays), tuple(addresses)


def _allocate(specs, device_index: int, stream: int, torch_device):
    """New buffers of `specs` ((shape, "float32" | "int32", zeroed) each), int32 ones zeroed on `stream`."""
    if torch_device is not None:
        import torch

        arrays = [torch.empty(shape, dtype=getattr(torch, dtype), device=torch_device) for shape, dtype, _ in specs]
        addresses = [a.data_ptr() for a in arrays]
    else:
        from numba import cuda

        with cuda.gpus[device_index]:
            arrays = [cuda.device_array(shape, dtype=np.dtype(dtype)) for shape, dtype, _ in specs]
        addresses = [a.device_ctypes_pointer.value or 0 for a in arrays]
    for (shape, _, zeroed), address in zip(specs, addresses):
        if zeroed:
            driver.memset32(address, 0, int(np.prod(shape)), stream)
    return Scratch(arrays, addresses)


def scratch(key, specs, device_index: int, stream: int, torch_device=None) -> Scratch:
    """The scratch of `key` ((what, shapes...)) on this device and stream, made on first use."""
    if simulator_enabled():  # no streams to order by: fresh buffers, the counters zeroed
        from numba import cuda

        return Scratch([cuda.to_device(np.zeros(shape, np.dtype(dtype))) for shape, dtype, _ in specs], ())
    full = (key, device_index, stream, torch_device is not None)
    with _LOCK:
        found = _KEPT.get(full)
        if found is not None:
            _KEPT.move_to_end(full)
            return found
        found = _KEPT[full] = _allocate(specs, device_index, stream, torch_device)
        while len(_KEPT) > KEPT:
            _KEPT.popitem(last=False)
        return found


def split_workspace(splits, device_index: int, stream: int, torch_device=None) -> Scratch:
    """Phase 10's workspace for `splits` (phases/common.Splits): partial outputs, their LSEs, counters."""
    specs = ((splits.o_part, "float32", False), (splits.lse_part, "float32", False),
             ((splits.counters,), "int32", True))
    return scratch(("splits", splits.o_part, splits.lse_part, splits.counters), specs, device_index, stream,
                   torch_device)


def work_counter(device_index: int, stream: int, torch_device=None) -> Scratch:
    """Phase 09's work counter: one int32 at zero."""
    return scratch(("counter",), (((1,), "int32", True),), device_index, stream, torch_device)


def clear() -> None:
    """Forget every set (tests)."""
    with _LOCK:
        _KEPT.clear()

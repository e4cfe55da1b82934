"""The simulator's bulk copies: Python versions of the functions in ptx/bulk.ptx.

Addresses are the simulator's `Pointer`s (array, byte offset), as `operands.shared_address` and
`operands.global_address` hand them out there. The hardware faults on a size that is not a
multiple of 16 or an address that is not 16-byte aligned; so does each emulation here, with the
numbers in the message, so that a kernel that would fault on the GPU fails in the CPU tests.

As with cp.async (sim_mma), a bulk operation is done when its call returns: the load copies its
bytes and then completes them on its mbarrier, as a TMA load does (sim_tma.complete_tx), so the
threads waiting on that barrier go on; the reduction adds its floats into global memory at once.
Commit, wait and the proxy fence have nothing left to do. A kernel that overwrites a reduction's
source before waiting for it, or forgets the fence, therefore runs correctly here: only the GPU
tests can catch that.
"""

from __future__ import annotations

import threading

import numpy as np

from .emulation import emulation
from .sim_tma import complete_tx

_ADD_LOCK = threading.Lock()  # the simulator's threads: one block's additions at a time, none lost


def _check(what: str, nbytes: int, **pointers):
    if nbytes % 16:
        raise ValueError(f"bytes: {what} moves a multiple of 16 bytes, got {nbytes}")
    for name, pointer in pointers.items():
        if pointer.offset % 16:
            raise ValueError(f"{name}: {what} needs a 16-byte aligned address, "
                             f"got byte offset {pointer.offset}")


@emulation("flashcore_bulk_load_1d")
def bulk_load_1d(dst, src, nbytes, bar):
    """cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], nbytes, [bar]."""
    n = int(nbytes)
    _check("cp.async.bulk", n, dst=dst, src=src)
    dst.view(np.uint8, 1, n, n)[0] = src.view(np.uint8, 1, n, n)[0]
    complete_tx(bar, n)


@emulation("flashcore_bulk_reduce_add_f32")
def bulk_reduce_add_f32(dst, src, nbytes):
    """cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [dst], [src], nbytes."""
    n = int(nbytes)
    _check("cp.reduce.async.bulk", n, dst=dst, src=src)
    with _ADD_LOCK:
        dst.view(np.float32, 1, n // 4, n // 4)[0] += src.view(np.float32, 1, n // 4, n // 4)[0]


@emulation("flashcore_bulk_commit_group")
def bulk_commit_group():
    """cp.async.bulk.commit_group: nothing to do, every reduction is done already."""


@emulation("flashcore_bulk_wait_group_read_0")
def bulk_wait_group_read_0():
    """cp.async.bulk.wait_group.read 0."""


@emulation("flashcore_fence_proxy_async_shared")
def fence_proxy_async_shared():
    """fence.proxy.async.shared::cta: nothing to order, the emulations read shared memory directly."""

"""The simulator's TMA and mbarriers: Python versions of the functions in ptx/tma.ptx.

An mbarrier is emulated as what the PTX ISA says it is: a pending-arrival count and a
transaction-byte count for the current phase, and the phase's parity. When both counts reach
zero the phase completes, the parity flips and the arrival count starts over. A thread that
waits for parity p blocks (on a condition variable, other simulated threads running on) until
the phase of parity p has completed, that is until the current parity is no longer p; on a fresh
barrier, waiting for parity 1 returns at once, as on the GPU. A wait that nothing can end stops
the block at once (sim.wait_until).

A TMA load copies its box at once (then completes its bytes on the barrier): the tensor's
elements, zeros where the box reaches past the tensor, and with 128-byte swizzle each 16-byte
chunk moved within its 128-byte line by the XOR the hardware applies to shared-memory address
bits 4-6 with bits 7-9.
"""

from __future__ import annotations

import threading

import numpy as np

from .emulation import emulation
from .sim import wait_until
from .tma import SWIZZLE_BYTES, sim_map


class _MBarrier:
    def __init__(self, count: int):
        self.count = count
        self.pending = count
        self.tx = 0
        self.parity = 0
        self.cond = threading.Condition()

    def _complete_if_done(self):
        if self.pending == 0 and self.tx <= 0:
            self.parity ^= 1
            self.pending = self.count
            self.tx = 0
            self.cond.notify_all()


_BARRIERS: dict = {}
_LOCK = threading.Lock()


def _key(pointer):
    """The barrier's memory address: every thread gets its own NumPy view of dynamic shared
    memory, so the view itself cannot name it."""
    array = getattr(pointer.array, "_ary", pointer.array)
    return array.__array_interface__["data"][0] + pointer.offset


def _barrier(pointer) -> _MBarrier:
    with _LOCK:
        bar = _BARRIERS.get(_key(pointer))
    if bar is None:
        raise RuntimeError(f"mbarrier at shared offset {pointer.offset} used before flashcore_mbarrier_init")
    return bar


@emulation("flashcore_mbarrier_init")
def mbarrier_init(bar, count):
    with _LOCK:
        _BARRIERS[_key(bar)] = _MBarrier(int(count))


@emulation("flashcore_fence_mbarrier_init")
def fence_mbarrier_init():
    """Nothing to order: the emulated barriers live in Python."""


@emulation("flashcore_mbarrier_arrive_expect_tx")
def mbarrier_arrive_expect_tx(bar, nbytes):
    b = _barrier(bar)
    with b.cond:
        b.tx += int(nbytes)
        b.pending -= 1
        b._complete_if_done()


@emulation("flashcore_mbarrier_arrive")
def mbarrier_arrive(bar):
    b = _barrier(bar)
    with b.cond:
        b.pending -= 1
        b._complete_if_done()


@emulation("flashcore_mbarrier_wait")
def mbarrier_wait(bar, parity):
    b = _barrier(bar)
    with b.cond:
        wait_until(b.cond, lambda: b.parity != int(parity),
                   f"an mbarrier wait (shared offset {bar.offset}, parity {int(parity)}, {b.count} arrivals a phase)")


def swizzled(offsets: np.ndarray, swizzle: str) -> np.ndarray:
    """Byte offsets (from a 1024-byte aligned base) after the shared-memory swizzle of a TMA copy."""
    if SWIZZLE_BYTES[swizzle] == 0:
        return offsets
    return offsets ^ (((offsets >> 7) & 7) << 4)


@emulation("flashcore_tma_load_3d")
def tma_load_3d(dst, tmap, col, row, plane, bar):
    m = sim_map(tmap)
    layout = m.layout
    if layout.swizzle != "none" and dst.offset % 1024:
        raise RuntimeError(f"TMA with {layout.swizzle} swizzle: destination offset {dst.offset} is not 1024-byte aligned")
    src = getattr(m.array, "_ary", m.array)
    box = np.zeros(layout.box, dtype=src.dtype)
    origin = (int(plane), int(row), int(col))  # array order: outermost first
    pieces = tuple(slice(o, min(o + side, size)) for o, side, size in zip(origin, layout.box, src.shape))
    inside = src[pieces]
    box[tuple(slice(0, n) for n in inside.shape)] = inside
    data = np.ascontiguousarray(box).view(np.uint8).reshape(-1)
    chunks = np.arange(data.size // 16) * 16
    target = swizzled(chunks, layout.swizzle)
    smem = getattr(dst.array, "_ary", dst.array)
    flat = smem.view(np.uint8).reshape(-1)
    for c, t in zip(chunks, target):
        flat[dst.offset + t:dst.offset + t + 16] = data[c:c + 16]
    complete_tx(bar, data.size)


def complete_tx(bar, nbytes: int):
    """`nbytes` of an asynchronous copy have landed: the transaction count of mbarrier `bar` goes
    down by them (the phase completes if nothing else is pending). The TMA loads here and the bulk
    loads of sim_bulk end with it."""
    b = _barrier(bar)
    with b.cond:
        b.tx -= int(nbytes)
        b._complete_if_done()

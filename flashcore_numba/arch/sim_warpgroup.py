"""The simulator's ptx/warpgroup.ptx: register hand-over between warpgroups, named barriers.

setmaxnreg has nothing to emulate: registers are not a resource in the simulator.

A named barrier is emulated as the PTX ISA describes it: arrivals are counted until `count`
threads have arrived (`bar.sync` and `bar.arrive` alike), then the barrier completes, the threads
waiting in `bar.sync` go on and the count starts over. Each simulated block has its own sixteen
barriers, kept on the simulator's block manager as the warp state of `sim.py` is.
"""

from __future__ import annotations

import threading

from .emulation import emulation
from .sim import wait_until

_LOCK = threading.Lock()


class _NamedBarrier:
    def __init__(self):
        self.arrived = 0
        self.generation = 0  # completions so far
        self.cond = threading.Condition()

    def arrive(self, count: int) -> int:
        """Count one arrival; returns the generation this arrival belongs to."""
        with self.cond:
            generation = self.generation
            self.arrived += 1
            if self.arrived == count:
                self.arrived = 0
                self.generation += 1
                self.cond.notify_all()
            return generation


def _barrier(bar_id) -> _NamedBarrier:
    manager = threading.current_thread()._manager  # one per running block
    with _LOCK:
        barriers = getattr(manager, "_flashcore_named_barriers", None)
        if barriers is None:
            barriers = manager._flashcore_named_barriers = {}
        bar = barriers.get(int(bar_id))
        if bar is None:
            bar = barriers[int(bar_id)] = _NamedBarrier()
    return bar


def _check(bar_id, count):
    if not 1 <= int(bar_id) < 16:
        raise RuntimeError(f"named barrier {int(bar_id)}: ids 1 .. 15 (0 is cuda.syncthreads)")
    if int(count) % 32:
        raise RuntimeError(f"named barrier {int(bar_id)}: count {int(count)} is not a multiple of 32 (whole warps)")


@emulation("flashcore_bar_sync")
def bar_sync(bar_id, count):
    _check(bar_id, count)
    bar = _barrier(bar_id)
    generation = bar.arrive(int(count))
    with bar.cond:
        wait_until(bar.cond, lambda: bar.generation != generation,
                   f"named barrier {int(bar_id)} (expects {int(count)} threads)")


@emulation("flashcore_bar_arrive")
def bar_arrive(bar_id, count):
    _check(bar_id, count)
    _barrier(bar_id).arrive(int(count))


@emulation("flashcore_setmaxnreg_inc_240")
def setmaxnreg_inc_240():
    """Registers are not a resource in the simulator."""


@emulation("flashcore_setmaxnreg_inc_160")
def setmaxnreg_inc_160():
    """Registers are not a resource in the simulator."""


@emulation("flashcore_setmaxnreg_dec_24")
def setmaxnreg_dec_24():
    """Registers are not a resource in the simulator."""

"""What the Numba CUDA simulator lacks, supplied so every phase runs there unchanged.

With `NUMBA_ENABLE_CUDASIM=1` Numba runs each CUDA thread as a Python thread. It has
shared memory and `syncthreads`, but no warp-level operations: no `shfl_*_sync`, no
`syncwarp`, no votes. Phases 03+ exchange values between the lanes of a warp, so this
module adds those functions to the simulator's fake `cuda` module. It also lets
`cuda.shared.array(..., alignment=16)` through (the simulator rejects the argument; the
GPU needs it so that four floats load in one 16-byte instruction). And it makes the loop
that runs a block pause between its rounds (`_run_block`).

How a warp collective is simulated: the 32 lanes of a warp meet at a barrier, each first
publishing its value in a per-warp slot; after the barrier every lane reads the slot of its
source lane; a second barrier keeps a fast lane from overwriting a slot before a slow lane
has read it. `warp_exchange` is that primitive; the tensor-core phases (mma.sync,
ldmatrix fragments) build their simulated instructions on it too.

It also says where kernels run (`kernel_target`: the GPU, the simulator or nowhere) and starts
a command again in the simulator when there is no GPU (`rerun_in_simulator`): `flashcore run`
and `flashcore grade` both do. On a real GPU `install()` is a no-op and the kernels see none
of this.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

WARP_SIZE = 32
_BARRIER_TIMEOUT_S = 600.0  # a lane that died leaves its warp waiting: fail instead of hanging


def simulator_enabled() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def kernel_target() -> str:
    """'simulator' (NUMBA_ENABLE_CUDASIM is set), 'gpu', or 'none': where a launch runs now.

    Importing this package already imported numba.cuda; with the simulator off that is the
    real CUDA module, whose is_available() answers without crashing on a machine with no
    driver. Turning the simulator on needs a new process (see `rerun_in_simulator`).
    """
    if simulator_enabled():
        return "simulator"
    from numba import cuda

    return "gpu" if cuda.is_available() else "none"


def rerun_in_simulator(module: str, argv) -> int:
    """Run `python -m <module> <argv>` again in a child process with NUMBA_ENABLE_CUDASIM=1.

    numba reads the variable once, when numba.cuda is first imported, and this process has
    imported it already. The child imports this same checkout, installed or not. Returns the
    child's exit status.
    """
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    package_parent = str(Path(__file__).resolve().parents[2])  # the checkout holding flashcore_numba/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    return subprocess.call([sys.executable, "-m", module, *argv], env=env)


class _WarpState:
    def __init__(self, n_lanes: int):
        self.slots = [None] * WARP_SIZE
        self.barrier = threading.Barrier(n_lanes, timeout=_BARRIER_TIMEOUT_S)


_state_lock = threading.Lock()


def _warp_of_current_thread():
    t = threading.current_thread()
    manager = t._manager  # the simulator's BlockManager: one per running block
    warp = t.thread_id // WARP_SIZE
    with _state_lock:
        warps = getattr(manager, "_flashcore_warps", None)
        if warps is None:
            warps = manager._flashcore_warps = {}
        state = warps.get(warp)
        if state is None:
            bx, by, bz = manager._block_dim
            n_threads = bx * by * bz
            n_lanes = min(WARP_SIZE, n_threads - warp * WARP_SIZE)
            state = warps[warp] = _WarpState(n_lanes)
    return state, t.thread_id % WARP_SIZE


def warp_exchange(value):
    """Collective over the calling warp: returns (all lanes' values as a list, this lane)."""
    state, lane = _warp_of_current_thread()
    state.slots[lane] = value
    state.barrier.wait()
    values = list(state.slots)
    state.barrier.wait()
    return values, lane


def _shfl(value, src_of_lane):
    values, lane = warp_exchange(value)
    src = src_of_lane(lane)
    if src is None or values[src] is None:  # out of range or inactive lane: keep own value
        return value
    return values[src]


def shfl_sync(mask, value, src_lane):
    return _shfl(value, lambda lane: src_lane % WARP_SIZE)


def shfl_xor_sync(mask, value, lane_mask):
    return _shfl(value, lambda lane: lane ^ lane_mask)


def shfl_down_sync(mask, value, delta):
    return _shfl(value, lambda lane: lane + delta if lane + delta < WARP_SIZE else None)


def shfl_up_sync(mask, value, delta):
    return _shfl(value, lambda lane: lane - delta if lane - delta >= 0 else None)


def syncwarp(mask=0xFFFFFFFF):  # numba's default; like every collective here, the mask is not read
    warp_exchange(None)


def all_sync(mask, predicate):
    values, _ = warp_exchange(bool(predicate))
    return int(all(v for v in values if v is not None))


def any_sync(mask, predicate):
    values, _ = warp_exchange(bool(predicate))
    return int(any(v for v in values if v is not None))


def ballot_sync(mask, predicate):
    values, _ = warp_exchange(bool(predicate))
    return sum(1 << lane for lane, v in enumerate(values) if v)


_WARP_FUNCTIONS = {
    "shfl_sync": shfl_sync,
    "shfl_xor_sync": shfl_xor_sync,
    "shfl_down_sync": shfl_down_sync,
    "shfl_up_sync": shfl_up_sync,
    "syncwarp": syncwarp,
    "all_sync": all_sync,
    "any_sync": any_sync,
    "ballot_sync": ballot_sync,
}


def arithmetic_device_function(fn):
    """A device function of plain arithmetic (no `cuda.*` inside), compiled inline on the GPU.

    In the simulator every call of a `cuda.jit` device function takes a lock and rewrites its
    module's globals; for a helper called on every shared-memory access that became a lock
    convoy (10-70x slower under load). There the plain Python function is used instead.
    """
    if simulator_enabled():
        return fn
    from numba import cuda

    return cuda.jit(device=True, inline=True)(fn)


@contextmanager
def simulator_pacing(interval_s: float = 5e-3):
    """The interpreter's switch interval during a launch: 5 ms, Python's default.

    The simulator runs one Python thread per CUDA thread plus a thread that polls them for
    barriers. A 0.5 ms interval once made the warp-tiled phases faster (7.2 s -> 2.6 s for one
    128-thread block), measured before the block loop paused between its rounds (`_run_block`).
    Measured again with the pause (2 cores), the shorter interval costs time: every hand-over of
    the lock is a pair of system calls, and at 0.5 ms a launch spent about as much CPU time in
    the kernel as in Python. One launch at S = 64: phase 09 7-8 s at 0.5 ms, 5 s at 5 ms; phase
    03 5.7 -> 3.8 s; phase 05 5.8 -> 3.8 s; 14 tests of tests/test_phases.py 63-75 s -> 52-57 s
    (user + system CPU time 67-94 s -> 48-62 s). The interval is still set here, so that a launch
    does not depend on what the calling program chose.
    """
    previous = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def _accept_alignment(shared_array):
    """The simulator refuses `alignment=` on shared arrays; NumPy memory needs none: drop it."""
    from numba.core import types
    from numba.np import numpy_support

    def array(self, shape, dtype, alignment=None):
        if shape == 0:  # dynamic shared memory: one buffer for the block
            return shared_array(self, shape, dtype)
        # A static array is identified by the line that declares it, as the simulator does; the
        # line is our caller's (calling through would make this wrapper's line the key of all).
        frame = sys._getframe(1)
        key = (frame.f_code.co_filename, frame.f_lineno)
        if key not in self._allocations:
            if isinstance(dtype, types.Type):
                dtype = numpy_support.as_dtype(dtype)
            self._allocations[key] = np.empty(shape, dtype)
        return self._allocations[key]

    array._flashcore = True
    return array


_POLL_PAUSE_S = 0.002  # between two rounds of the block loop (see _run_block)
_UNWIND_S = 30.0  # how long a failed block's other threads get to stop


def _run_block(self, grid_point, *args):
    """One block, as the simulator's BlockManager.run does it, with a pause between rounds.

    The simulator starts a Python thread per CUDA thread, then loops over them until all have
    finished: when every thread still running waits at `syncthreads`, it releases them. Its loop
    never pauses, so it holds the interpreter lock for a share of the time as large as that of
    the threads doing the work. Pausing 2 ms a round hands that time back (one causal launch at
    S = 70 each, 2 cores, another test run alongside): phase 07 8 s instead of 31, phase 05 9
    instead of 26, phase 03 8 instead of 23; the CPU suite 18 minutes instead of about 24. A
    barrier is released at most one pause late.
    """
    from numba.cuda.simulator.kernel import BlockThread

    threads = []
    for block_point in np.ndindex(*self._block_dim):
        thread = BlockThread(lambda: self._f(*args), self, grid_point, block_point, self._debug)
        thread.start()
        threads.append(thread)
    running = set(threads)
    while running:
        for thread in running:
            if not thread.syncthreads_blocked and thread.exception:
                for other in threads:  # stop the others, as the simulator does, and report it
                    other.abort = True
                    other.syncthreads_blocked = False
                    other.syncthreads_event.set()
                for state in getattr(self, "_flashcore_warps", {}).values():
                    state.barrier.abort()  # lanes waiting for the dead one at a warp collective
                # Wait for them to unwind: the last thread to leave a module's kernel or device function
                # gives the module its real `cuda` back, which the simulator swaps for a fake while
                # threads run it. A thread left waiting would keep the fake there for the rest of
                # the process (the host code of the same module, a phase's own launch helper, breaks).
                deadline = time.monotonic() + _UNWIND_S
                for other in threads:
                    other.join(max(0.0, deadline - time.monotonic()))
                raise thread.exception[0].with_traceback(thread.exception[1])
        if all(thread.syncthreads_blocked for thread in running):
            for thread in running:  # every running thread is at the barrier: let them all pass
                thread.syncthreads_blocked = False
                thread.syncthreads_event.set()
        running = {thread for thread in running if thread.is_alive()}
        if running:
            time.sleep(_POLL_PAUSE_S)
    for thread in threads:  # a thread may have failed after its last check
        if thread.exception:
            raise thread.exception[0].with_traceback(thread.exception[1])


def install() -> bool:
    """Add the warp functions to the simulator's fake `cuda` module. Returns True if installed."""
    if not simulator_enabled():
        return False
    from numba.cuda.simulator import kernelapi

    for name, fn in _WARP_FUNCTIONS.items():
        if not hasattr(kernelapi.FakeCUDAModule, name):
            setattr(kernelapi.FakeCUDAModule, name, staticmethod(fn))
    shared = kernelapi.FakeCUDAShared
    if not getattr(shared.array, "_flashcore", False):
        shared.array = _accept_alignment(shared.array)
    from numba.cuda.simulator import kernel

    kernel.BlockManager.run = _run_block
    return True


def _fast_fdividef():
    """libdevice's fast approximate division x / y (div.approx: no slow path, so no subroutine
    call), or in the simulator the same division in float32."""
    if simulator_enabled():
        return lambda x, y: np.float32(np.float32(x) / np.float32(y))
    from numba.cuda import libdevice

    return libdevice.fast_fdividef


fast_fdividef = _fast_fdividef()

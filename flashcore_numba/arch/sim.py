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

Barriers are watched (`_run_block`): a block whose threads wait at different barriers (two
`cuda.syncthreads()` lines, or a syncthreads and a warp collective), or some at a barrier while
others have left the kernel, or a wait nothing can end (a named barrier or an mbarrier short of
its arrivals), stops at once with a `BarrierError` naming each barrier's line and the threads at
it. On the GPU these are undefined behaviour or a hang; the simulator once let some pass (it
released a barrier when every thread still running had reached it) and timed others out after
minutes.

It also says where kernels run (`kernel_target`: the GPU, the simulator or nowhere) and starts
a command again in the simulator when there is no GPU (`rerun_in_simulator`): `flashcore run`
and `flashcore grade` both do. On a real GPU `install()` is a no-op and the kernels see none
of this.
"""

from __future__ import annotations

import linecache
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

WARP_SIZE = 32


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


class BarrierError(RuntimeError):
    """The threads of a block can never meet again: they wait at different barriers, or at a barrier
    that threads which have left the kernel never reach, or at waits that nothing can end.

    `groups` says where each thread is: (what it waits at, its site, its thread numbers), the site
    being the call chain in the kernel's code, innermost first, as (file, line) pairs, or None for
    threads that have left the kernel. `describe(where)` words it, `where(file, line)` naming a
    line (the grader names the line of the student's own file)."""

    def __init__(self, block: tuple[int, ...], groups: list, hint: str):
        self.block, self.groups, self.hint = block, groups, hint
        super().__init__(self.describe())

    def describe(self, where=None) -> str:
        where = where or file_line
        lines = [(f"block {list(self.block)} can never go on: its threads wait at different barriers, or "
                  f"for threads that never come")]
        for what, site, threads in self.groups:
            who = _numbers(threads)
            if site is None:
                lines.append(f"  {who} left the kernel (they never arrive)")
            else:
                calls = "".join(f", called from {where(*frame)}" for frame in site[1:])
                lines.append(f"  {who} {'wait' if len(threads) > 1 else 'waits'} at {what}: {where(*site[0])}{calls}")
        lines.append(self.hint)
        return "\n".join(lines)


def file_line(filename: str, line: int) -> str:
    """`path:line (`code`)`, the path relative to the current directory when it is inside it."""
    path = Path(filename)
    try:
        path = path.resolve().relative_to(Path.cwd())
    except ValueError:
        pass
    code = linecache.getline(filename, line).strip()
    return f"{path}:{line}" + (f" (`{code}`)" if code else "")


def _numbers(threads) -> str:
    """'thread 3', 'threads 0-3, 8': thread numbers (threadIdx.x in a one-dimensional block) as ranges."""
    threads = sorted(threads)
    runs, first, prev = [], threads[0], threads[0]
    for t in threads[1:]:
        if t != prev + 1:
            runs.append((first, prev))
            first = t
        prev = t
    runs.append((first, prev))
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"thread{'s' * (len(threads) != 1)} {text}"


SYNCTHREADS = "cuda.syncthreads()"
HINT_BLOCK = ("Every thread of a block must reach each cuda.syncthreads() of the kernel, at the same line, as "
              "many times as the others; on a GPU anything else is undefined (a hang, or wrong values). A "
              "barrier inside an `if` that some threads skip, or in a loop that some leave (or `return` from) "
              "sooner, waits for threads that never come: put the barrier where every thread passes, and keep "
              "only the work inside the `if`.")
HINT_WARP = ("A warp collective (a shuffle, a vote, an mma, a warp-wide sync) needs every lane of its warp, "
             "and a cuda.syncthreads() every thread of the block: a lane that skips one, or has left the "
             "kernel, leaves the others waiting forever. Put both where every thread passes.")
HINT_WAIT = ("Nothing can end these waits: an mbarrier or a named barrier whose expected arrivals (or bytes) "
             "never come, or threads that wait for each other. Check the arrival counts and that every thread "
             "that must arrive does.")


class _Wait:
    """What a simulated thread waits for in an emulated collective (see wait_until)."""

    __slots__ = ("cond", "released", "site", "what")

    def __init__(self, what, site, cond, released):
        self.what, self.site, self.cond, self.released = what, site, cond, released


def wait_until(cond: threading.Condition, released, what: str) -> None:
    """Wait, holding `cond`, until `released()` (another thread's notify_all on cond wakes this one).

    Every wait of an emulated collective goes through here, so that the block's loop (_run_block)
    sees it: when no thread of the block can go on, the loop stops the block with a BarrierError and
    wakes this thread, which then raises (so it does when another thread of the block has failed).
    `released` must stay true once true (a generation or a parity that has moved on).
    """
    thread = threading.current_thread()
    thread._flashcore_wait = _Wait(what, _kernel_site(), cond, released)
    try:
        while not released():
            if getattr(thread, "abort", False):
                raise RuntimeError(f"{what}: the block was stopped")
            cond.wait()
    finally:
        thread._flashcore_wait = None


_INTERNAL_FILES = None  # path prefixes of frames that are not the kernel's: the simulator, arch/, threading
_INTERNAL: dict = {}  # code object -> whether it is internal


def _kernel_site() -> tuple[tuple[str, int], ...]:
    """The calling thread's place in the kernel's code: (file, line) of each frame between the
    kernel and the simulator's or arch/'s code that called this, innermost first."""
    global _INTERNAL_FILES
    if _INTERNAL_FILES is None:
        from numba.cuda import simulator

        _INTERNAL_FILES = (str(Path(simulator.__file__).parent), str(Path(__file__).parent), threading.__file__)
    site = []
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        internal = _INTERNAL.get(code)
        if internal is None:
            internal = _INTERNAL[code] = code.co_filename.startswith(_INTERNAL_FILES)
        if not internal:
            site.append((code.co_filename, frame.f_lineno))
        frame = frame.f_back
    return tuple(site)


class _WarpState:
    """A warp's meeting point: its lanes' slots, and a barrier of its lanes (a count and a generation)."""

    def __init__(self, n_lanes: int):
        self.slots = [None] * WARP_SIZE
        self.n_lanes = n_lanes
        self.arrived = 0
        self.generation = 0  # meetings completed
        self.cond = threading.Condition()

    def meet(self) -> None:
        with self.cond:
            generation = self.generation
            self.arrived += 1
            if self.arrived == self.n_lanes:
                self.arrived = 0
                self.generation += 1
                self.cond.notify_all()
            else:
                wait_until(self.cond, lambda: self.generation != generation,
                           "a warp collective (shuffle, vote, mma)")


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
    state.meet()
    values = list(state.slots)
    state.meet()
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
_SYNC = object()  # a thread's state in _run_block: waiting at cuda.syncthreads()


def _syncthreads(self):
    """The simulator's BlockThread.syncthreads, noting first where in the kernel the thread waits."""
    self._flashcore_site = _kernel_site()
    _simulator_syncthreads(self)


_simulator_syncthreads = None  # the simulator's own, kept by install()


def _waiting(thread):
    """_SYNC, the _Wait of an emulated collective that has not ended, or None (the thread runs)."""
    if thread.syncthreads_blocked:
        return _SYNC
    wait = getattr(thread, "_flashcore_wait", None)
    return wait if wait is not None and not wait.released() else None


def _stop_block(threads) -> None:
    """Stop every thread of the block, as the simulator does on a failure, and wait for them to unwind.

    The last thread to leave a module's kernel or device function gives the module its real `cuda`
    back, which the simulator swaps for a fake while threads run it. A thread left waiting would
    keep the fake there for the rest of the process (the host code of the same module, a phase's
    own launch helper, breaks). A thread that enters a wait just after being told to stop misses
    the notification: it is woken again until it has gone.
    """
    for thread in threads:
        thread.abort = True
        thread.syncthreads_blocked = False
        thread.syncthreads_event.set()
    deadline = time.monotonic() + _UNWIND_S
    for thread in threads:
        while thread.is_alive() and time.monotonic() < deadline:
            wait = getattr(thread, "_flashcore_wait", None)
            if wait is not None:
                with wait.cond:
                    wait.cond.notify_all()
            thread.join(0.05)


def _barrier_error(block, threads, waits) -> BarrierError:
    """Where every thread of a block that can never go on is: grouped by what and where it waits."""
    groups: dict = {}
    for thread in threads:
        wait = waits.get(thread)
        if wait is None:
            key = ("", None)  # left the kernel
        elif wait is _SYNC:
            key = (SYNCTHREADS, thread._flashcore_site)
        else:
            key = (wait.what, wait.site)
        groups.setdefault(key, []).append(thread.thread_id)
    kinds = {what for what, _ in groups if what}
    hint = HINT_BLOCK if kinds == {SYNCTHREADS} else HINT_WARP if any("warp" in k for k in kinds) else HINT_WAIT
    ordered = sorted(groups.items(), key=lambda item: min(item[1]))
    return BarrierError(block, [(what, site, tids) for (what, site), tids in ordered], hint)


def _run_block(self, grid_point, *args):
    """One block, as the simulator's BlockManager.run does it, with a pause between rounds, and its
    barriers watched.

    The simulator starts a Python thread per CUDA thread, then loops over them until all have
    finished: when every thread still running waits at `syncthreads`, it releases them. Its loop
    never pauses, so it holds the interpreter lock for a share of the time as large as that of
    the threads doing the work. Pausing 2 ms a round hands that time back (one causal launch at
    S = 70 each, 2 cores, another test run alongside): phase 07 8 s instead of 31, phase 05 9
    instead of 26, phase 03 8 instead of 23; the CPU suite 18 minutes instead of about 24. A
    barrier is released at most one pause late.

    A barrier is released only when every thread of the block waits at the same `syncthreads`
    (the same line, called from the same lines). When no thread can go on otherwise (threads at
    two barriers, some at a barrier while others have left the kernel, or waits of the emulated
    collectives that nothing can end: `wait_until`), the block stops with a BarrierError saying
    where each thread is. An emulated wait is judged stuck only when the same waits are seen in
    two rounds in a row: a thread just released from one may not have cleared it yet.
    """
    from numba.cuda.simulator.kernel import BlockThread

    threads = []
    for block_point in np.ndindex(*self._block_dim):
        thread = BlockThread(lambda: self._f(*args), self, grid_point, block_point, self._debug)
        thread.start()
        threads.append(thread)
    running = set(threads)
    stuck = None  # the waits of the last round in which no thread could go on
    while running:
        for thread in running:
            if not thread.syncthreads_blocked and thread.exception:
                _stop_block(threads)  # stop the others, as the simulator does, and report it
                raise thread.exception[0].with_traceback(thread.exception[1])
        waits = {thread: _waiting(thread) for thread in running}
        if all(wait is not None for wait in waits.values()):  # no thread runs
            if all(wait is _SYNC for wait in waits.values()):
                sites = {thread._flashcore_site for thread in running}
                if len(sites) > 1 or len(running) < len(threads):
                    error = _barrier_error(grid_point, threads, waits)
                    _stop_block(threads)
                    raise error
                for thread in running:  # every thread is at the same barrier: let them all pass
                    thread.syncthreads_blocked = False
                    thread.syncthreads_event.set()
                stuck = None
            elif stuck is not None and stuck.keys() == waits.keys() and all(stuck[t] is w for t, w in waits.items()):
                error = _barrier_error(grid_point, threads, waits)
                _stop_block(threads)
                raise error
            else:
                stuck = waits
        else:
            stuck = None
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
    global _simulator_syncthreads
    if kernel.BlockThread.syncthreads is not _syncthreads:
        _simulator_syncthreads = kernel.BlockThread.syncthreads
        kernel.BlockThread.syncthreads = _syncthreads
    return True


def _fast_fdividef():
    """libdevice's fast approximate division x / y (div.approx: no slow path, so no subroutine
    call), or in the simulator the same division in float32."""
    if simulator_enabled():
        return lambda x, y: np.float32(np.float32(x) / np.float32(y))
    from numba.cuda import libdevice

    return libdevice.fast_fdividef


fast_fdividef = _fast_fdividef()

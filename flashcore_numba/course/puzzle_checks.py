"""Lesson 00's puzzles: how each is launched, checked and drawn.

The kernels (the solutions) are in course/puzzles.py, and the stub students fill in,
lessons/exercises/00_numba_cuda.py, is generated from it like every phase's. `flashcore grade 00`
runs `checks()`: one check per puzzle, each launching the student's kernel on fresh random float32
inputs with the output filled with NaN first, and comparing with NumPy. The pictures show which
thread touches which cell, and `read_error` explains an error the simulator raised, for the lesson
notebook.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import puzzles

TPB = puzzles.TPB
TOLERANCE = 1e-4  # relative; float32 sums of a dozen terms are far closer than this


@dataclass(frozen=True)
class Puzzle:
    label: str  # the exercise region's label, "00-a"
    kernel: str  # the kernel's name in the student's module
    title: str
    blocks: int
    threads: int
    make_inputs: Callable  # rng -> the input arrays
    expected: Callable  # inputs -> the expected output
    extra_args: tuple = ()  # scalars after the arrays (scale's alpha)

    @property
    def launch(self) -> str:
        return f"{self.kernel}[{self.blocks}, {self.threads}]"


def _vector(n):
    return lambda rng: (rng.uniform(-4, 4, n).astype(np.float32),)


PUZZLES = (
    Puzzle("00-a", "add_ten", "map: add 10 to every element, one thread each", 2, 4,
           _vector(8), lambda a: a + 10),
    Puzzle("00-b", "scale", "guard: 12 threads for 10 elements", 3, 4,
           _vector(10), lambda a: np.float32(2.5) * a, extra_args=(2.5,)),
    Puzzle("00-c", "block_sum", "reduce: a block sums its elements in shared memory", 2, TPB,
           _vector(13), lambda a: np.add.reduceat(np.pad(a, (0, 2 * TPB - a.size)), [0, TPB])),
    Puzzle("00-d", "matvec", "tiled dot products: y = A·x with x in shared-memory tiles", 2, TPB,
           lambda rng: (rng.uniform(-2, 2, (10, 13)).astype(np.float32),
                        rng.uniform(-2, 2, 13).astype(np.float32)),
           lambda A, x: A.astype(np.float64) @ x),
)
BY_LABEL = {p.label: p for p in PUZZLES}


class MissingKernel(Exception):
    """The student's file has no kernel of the puzzle's name."""


def output_shape(p: Puzzle, inputs) -> tuple[int, ...]:
    return np.shape(p.expected(*inputs))


def run(p: Puzzle, module, inputs) -> np.ndarray:
    """Launch `module`'s kernel for puzzle p on `inputs`; returns the output (NaN where never written)."""
    from numba import cuda

    kernel = getattr(module, p.kernel, None)
    if kernel is None:
        raise MissingKernel(f"the file has no kernel named {p.kernel}")
    d_inputs = [cuda.to_device(x) for x in inputs]  # host -> device
    d_out = cuda.to_device(np.full(output_shape(p, inputs), np.nan, dtype=np.float32))
    kernel[p.blocks, p.threads](*d_inputs, d_out, *p.extra_args)
    cuda.synchronize()
    return d_out.copy_to_host()  # device -> host


def judge(p: Puzzle, inputs, got: np.ndarray) -> tuple[bool, str]:
    """(passed, the reason), with expected and got side by side when they differ."""
    want = np.asarray(p.expected(*inputs), dtype=np.float32)
    side_by_side = f"expected {np.array2string(want, precision=3)}, got {np.array2string(got, precision=3)}"
    nan = np.isnan(got)
    if nan.any():
        first = int(np.flatnonzero(nan)[0])
        return False, (f"{int(nan.sum())} of {got.size} outputs never written (the output was filled with "
                       f"NaN before the launch), the first at index {first}; {side_by_side}")
    close = np.isclose(got, want, rtol=TOLERANCE, atol=TOLERANCE)
    if not close.all():
        first = int(np.flatnonzero(~close)[0])
        return False, f"{int((~close).sum())} of {got.size} outputs wrong, the first at index {first}; {side_by_side}"
    return True, f"{got.size} outputs correct"


def diagnose(p: Puzzle, error: BaseException) -> str:
    """A hint for the usual mistakes, from what the launch raised."""
    text = str(error)
    if isinstance(error, IndexError) or "out of bounds" in text or "out of range" in text:
        return (" (a thread indexed past the end of an array: the launch has "
                f"{p.blocks * p.threads} threads; guard with `if i < a.size:`)")
    return ""


# ---------------------------------------------------------------------------------------------
# The graded checks (flashcore_numba.course.grade runs them)
# ---------------------------------------------------------------------------------------------
def checks() -> list:
    """One check per puzzle, in order; the grader's Check and Outcome, built here."""
    from .checks import Check, Outcome
    from .diagnose import describe_exception

    def make(p: Puzzle, points: int):
        def run_check(g, check) -> Outcome:
            rng = np.random.default_rng(g.case_seed(check, 0))
            inputs = p.make_inputs(rng)
            try:
                got = run(p, g.student, inputs)
            except MissingKernel as e:
                return Outcome("fail", str(e))
            except Exception as e:  # noqa: BLE001 - whatever the student's kernel raises fails the check
                return Outcome("fail", f"{p.launch}: {describe_exception(e, g.path)}{diagnose(p, e)}")
            ok, reason = judge(p, inputs, got)
            return Outcome("pass" if ok else "fail", f"{p.launch}: {reason}")

        # named by its region's label, as every region's check is; the kernel's name still works with --only
        return Check(p.label, p.title, points, run_check, region=p.label, seeded=True, aliases=(p.kernel,))

    return [make(p, 1 if p.label in ("00-a", "00-b") else 2) for p in PUZZLES]


# ---------------------------------------------------------------------------------------------
# Pictures: which thread touches which cell
# ---------------------------------------------------------------------------------------------
def _cells(values, width=3) -> str:
    return "".join(f"{v:>{width}}" for v in values)


def picture_map(p: Puzzle = BY_LABEL["00-b"], n: int = 10) -> str:
    """The global index of every thread of a 1-D launch, and which element it owns."""
    threads = p.blocks * p.threads
    block = [b for b in range(p.blocks) for _ in range(p.threads)]
    thread = [t for _ in range(p.blocks) for t in range(p.threads)]
    owns = [f"a{i}" if i < n else "--" for i in range(threads)]
    lines = [f"{p.launch}: {p.blocks} blocks of {p.threads} threads, {threads} threads, a.size = {n}",
             "blockIdx.x   " + _cells(block, 4),
             "threadIdx.x  " + _cells(thread, 4),
             "i            " + _cells(range(threads), 4),
             "element      " + _cells(owns, 4)]
    if threads > n:
        lines.append(f"threads {n}..{threads - 1} have no element: they must not touch a or out")
    return "\n".join(lines)


def picture_reduction(size: int = TPB) -> str:
    """Which thread adds which cell of the shared array, step by step, in one block."""
    lines = [f"cache (shared, {size} cells), one block of {size} threads; thread t adds cell t + stride to cell t",
             "cell         " + _cells(range(size), 5)]
    stride = size // 2
    while stride > 0:
        row = [f"t{t}" if t < stride else "" for t in range(size)]
        src = ", ".join(f"{t}+={t + stride}" for t in range(stride))
        lines.append(f"stride {stride:<5} " + _cells(row, 5) + f"     ({src})")
        lines.append(" " * 13 + "syncthreads()")
        stride //= 2
    lines.append("cell 0 holds the block's sum: thread 0 writes it to partial[blockIdx.x]")
    return "\n".join(lines)


def picture_tiles(rows: int = 10, cols: int = 13, size: int = TPB) -> str:
    """y = A·x in tiles: which thread loads which element of x, and which row each thread reads."""
    tiles = (cols + size - 1) // size
    lines = [(f"A is {rows} × {cols}, x has {cols} elements, tiles of {size}: {tiles} tiles, "
              f"{(rows + size - 1) // size} blocks of {size} threads"),
             "x tile       " + "".join(f"|{'tile ' + str(k):^{3 * size - 1}}" for k in range(tiles)) + "|"]
    loads = []
    for k in range(tiles):
        loads += [f"t{j - k * size}" if j < cols else "0" for j in range(k * size, (k + 1) * size)]
    lines.append("loaded by    " + _cells(loads, 3))
    for r in range(min(rows, 3)):
        block, thread = divmod(r, size)
        lines.append(f"row {r:<2} of A  " + _cells(["*"] * cols, 3) + f"   read by thread {thread} of block {block}")
    lines.append("  ...")
    blocks = (rows + size - 1) // size
    idle = blocks * size - rows
    if idle:
        lines.append(f"threads {size - idle}..{size - 1} of block {blocks - 1} have no row: they skip the products "
                     f"but still load x and reach every syncthreads()")
    lines.append("per tile: every thread loads one x element -> syncthreads -> every thread adds "
                 f"its row's {size} products -> syncthreads")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Reading an error the simulator raised
# ---------------------------------------------------------------------------------------------
SIM_THREAD = re.compile(r"tid=\[(\d+), (\d+), (\d+)\] ctaid=\[(\d+), (\d+), (\d+)\]: ")


def read_error(error: BaseException, kernel) -> str:
    """What a simulator error says: which thread (tid is threadIdx, ctaid is blockIdx), which line
    of which kernel, and the message itself."""
    name = getattr(kernel, "py_func", kernel).__name__
    message = str(error)
    lines = [f"{type(error).__name__}: {message}"]
    m = SIM_THREAD.match(message)
    if m:
        tx, ty, tz, bx, by, bz = map(int, m.groups())
        lines.append(f"  tid=[{tx}, {ty}, {tz}]    threadIdx (x, y, z): thread {tx} of its block")
        lines.append(f"  ctaid=[{bx}, {by}, {bz}]  blockIdx (x, y, z): block {bx} (CTA is CUDA's name for a block)")
        lines.append(f"  the rest: {message[m.end():]}")
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.name == name]
    if frames:
        lines.append(f"  in kernel {name}, line {frames[-1].lineno} of its cell: {frames[-1].line}")
    return "\n".join(lines)

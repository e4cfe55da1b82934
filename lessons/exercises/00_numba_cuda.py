# Exercise 00: Numba CUDA for Python programmers
#
# This is lesson 00's puzzles with 4 marked regions emptied:
#   00-a: compute this thread's global index i from the block and thread indices, then out[i]
#   00-b: out[i] = alpha * a[i], only in the threads that have an element (i < a.size)
#   00-c: load a[i] (or 0) into cache[t]; halve the stride: cache[t] += cache[t + stride]
#   00-d: for each tile of x: load it into x_tile, syncthreads, add its products to acc, syncthreads
# Write the missing lines between each `# >>> exercise` line and its `# <<< exercise` line.
# Change nothing else: solving only adds lines. The docstring below is the lesson.
#
# Grade it (hidden random inputs; points and reasons per check):
#     flashcore grade 00                         this file
#     flashcore grade 00 path/to/copy.py         a copy of it
#     pytest lessons/exercises --grade 00        the same checks, as pytest tests
# Without a GPU the kernels run in Numba's CUDA simulator.
# Stuck? `flashcore grade 00 --hint` gives a hint per region (--hint 2, 3: more);
# the solution is flashcore_numba/course/puzzles.py.
#
# Generated from that file by `python -m flashcore_numba.course.exercises --write`:
# improve the puzzles, not this copy.
"""Lesson 00 — Numba CUDA for Python programmers: four small kernels before the first phase.

What they teach
    00-a map       one thread per element: the global index blockIdx.x * blockDim.x + threadIdx.x
    00-b guard     a launch has more threads than elements: the extra threads must do nothing
    00-c reduce    a block sums its elements in shared memory, halving the active threads per
                   step, with cuda.syncthreads() between the steps
    00-d matvec    y = A·x, one thread per row (a dot product each); x is read in tiles staged
                   in shared memory, each tile loaded once and read by every thread of the block

These are the ideas the attention kernels are built from: phase 01 gives each query row a
thread (00-a, 00-b), phase 02 stages K and V in shared-memory tiles exactly as 00-d stages x,
and phase 03 reduces across threads as 00-c does (there with warp shuffles).

How they are launched (flashcore_numba.course.puzzle_checks does it, with these sizes)
    add_ten[2, 4](a, out)          a.size == 8
    scale[3, 4](a, out, alpha)     a.size == 10: 12 threads for 10 elements
    block_sum[2, TPB](a, partial)  a.size == 13: partial[b] = the sum of block b's elements
    matvec[2, TPB](A, x, y)        A is 10 × 13: 16 threads for 10 rows, x in two tiles

Every array is float32. The grader fills the output with NaN before each launch, so an element
that no thread writes cannot pass.
"""

from numba import cuda, float32

ID = "00"
NAME = "numba_cuda"
TITLE = "Numba CUDA for Python programmers"

TPB = 8  # threads per block of block_sum and matvec, and the size of their shared arrays


@cuda.jit
def add_ten(a, out):
    """out[i] = a[i] + 10, one thread per element (there are exactly as many threads as elements)."""
    # >>> exercise 00-a: compute this thread's global index i from the block and thread indices, then out[i]
    # <<< exercise


@cuda.jit
def scale(a, out, alpha):
    """out[i] = alpha * a[i]; the launch has more threads than elements."""
    i = cuda.grid(1)  # the same global index as in add_ten, computed by Numba
    # >>> exercise 00-b: out[i] = alpha * a[i], only in the threads that have an element (i < a.size)
    # <<< exercise


@cuda.jit
def block_sum(a, partial):
    """partial[b] = the sum of the TPB elements of block b (elements past the end count as 0)."""
    cache = cuda.shared.array(TPB, float32)  # one per block, seen by all its threads
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * TPB + t
    # >>> exercise 00-c: load a[i] (or 0) into cache[t]; halve the stride: cache[t] += cache[t + stride]
    # <<< exercise


@cuda.jit
def matvec(A, x, y):
    """y = A·x: thread `row` computes the dot product of row `row` of A with x.

    x is walked in tiles of TPB elements: the block loads a tile into shared memory (thread t
    loads element t of it), waits, and every thread reads the whole tile from there.
    """
    x_tile = cuda.shared.array(TPB, float32)
    t = cuda.threadIdx.x
    row = cuda.blockIdx.x * TPB + t
    acc = float32(0.0)  # this thread's running dot product: a local variable, in a register
    # >>> exercise 00-d: for each tile of x: load it into x_tile, syncthreads, add its products to acc, syncthreads
    # <<< exercise
    if row < y.size:
        y[row] = acc

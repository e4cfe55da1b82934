# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lesson 00 — Numba CUDA for Python programmers
#
# *Next: [01 naive](01_naive.ipynb). Course map: [README](README.md). Hardware background:
# [docs/hardware.md](../docs/hardware.md).*
#
# A GPU runs one function in thousands of [threads](../docs/glossary.md#thread) at once. You write what **one** thread does
# (a *[kernel](../docs/glossary.md#kernel)*); the *[launch](../docs/glossary.md#launch)* says how many threads run it. Each thread asks "which one am I?"
# and picks its own piece of the data from the answer.
#
# Numba turns a Python function into a kernel with `@cuda.jit`. Without an NVIDIA GPU, Numba's
# **CUDA [simulator](../docs/glossary.md#simulator)** (`NUMBA_ENABLE_CUDASIM=1`) runs every thread as a Python thread on the
# CPU: slow, but the results are the same, and its errors name the thread that failed. Every
# cell of this lesson runs either way.
#
# The lesson teaches the few pieces the attention kernels are built from: a kernel, thread and
# [block](../docs/glossary.md#block) indices, a launch, device arrays, local and shared arrays, `cuda.syncthreads()`. Four
# small puzzles practise them; you write them in
# [exercises/00_numba_cuda.py](exercises/00_numba_cuda.py) and grade them with
# `flashcore grade 00`. A linked word goes to its entry in the [glossary](../docs/glossary.md).

# %%
# Where the kernels run is decided before numba.cuda is first imported: on the CUDA GPU when the
# driver shows one, else in Numba's CUDA simulator on the CPU. Set NUMBA_ENABLE_CUDASIM to choose.
import os

if "NUMBA_ENABLE_CUDASIM" not in os.environ:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if os.path.exists("/dev/nvidiactl") else "1"

# %%
import numpy as np
from numba import cuda, float32

from flashcore_numba.arch.sim import simulator_enabled
from flashcore_numba.course import puzzle_checks

print("kernels run in", "Numba's CUDA simulator, on the CPU" if simulator_enabled() else "the CUDA GPU")

# %% [markdown]
# ## 1. A kernel, a launch, device arrays
#
# A kernel is a function decorated with `@cuda.jit`. It returns nothing: it writes its results
# into arrays it is given. Inside, `cuda.threadIdx.x` is the number of the thread running it.
#
# The GPU has its own memory ([HBM](../docs/glossary.md#hbm), high-bandwidth memory, next to the chip). `cuda.to_device`
# copies a NumPy array there, `cuda.device_array` makes room for a result there, and
# `copy_to_host` brings a result back. (Numba also accepts NumPy arrays in a launch, but then it
# copies them both ways at every launch; the attention kernels keep their data on the GPU.)
#
# `double[1, 8](...)` launches the kernel: **1 block of 8 threads**, so 8 threads run `double`,
# with `cuda.threadIdx.x` = 0, 1, …, 7.

# %%
@cuda.jit
def double(a, out):
    t = cuda.threadIdx.x  # which thread am I? 0 .. 7
    out[t] = 2 * a[t]


a = np.arange(8, dtype=np.float32)
d_a = cuda.to_device(a)  # host (CPU) -> device (GPU)
d_out = cuda.device_array_like(d_a)  # uninitialised room for the result, on the device
double[1, 8](d_a, d_out)  # launch: 1 block of 8 threads
print(d_out.copy_to_host())  # device -> host

# %% [markdown]
# ## 2. Blocks and threads: the global index
#
# One block holds at most 1024 threads, so a launch asks for a **[grid](../docs/glossary.md#grid)** of blocks:
# `kernel[blocks, threads_per_block]`. The blocks are independent (the GPU runs them in any
# order, on any of its [SMs](../docs/glossary.md#sm), the streaming multiprocessors); the threads of one block run on the
# same SM and can share memory and wait for each other (sections 4 and 5). CUDA's name for a
# block is a [CTA](../docs/glossary.md#cta) (cooperative thread array).
#
# Each thread knows `cuda.blockIdx.x` (its block), `cuda.threadIdx.x` (its place in the block)
# and `cuda.blockDim.x` (threads per block). Its **global index** is
#
# ```
# i = blockIdx.x * blockDim.x + threadIdx.x        # cuda.grid(1) computes the same
# ```

# %%
@cuda.jit
def who_am_i(block, thread, index):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    block[i] = cuda.blockIdx.x
    thread[i] = cuda.threadIdx.x
    index[i] = i


blocks, threads = 3, 4
arrays = [cuda.device_array(blocks * threads, dtype=np.int32) for _ in range(3)]
who_am_i[blocks, threads](*arrays)
for name, array in zip(("blockIdx.x", "threadIdx.x", "i"), arrays):
    print(f"{name:<12}", array.copy_to_host())

# %% [markdown]
# ### Puzzle 00-a — map
#
# In [exercises/00_numba_cuda.py](exercises/00_numba_cuda.py), complete `add_ten`: each thread
# computes its global index `i` and writes `out[i] = a[i] + 10`. The grader launches it as
# `add_ten[2, 4]` on 8 elements:

# %%
print(puzzle_checks.picture_map(puzzle_checks.BY_LABEL["00-a"], n=8))

# %% [markdown]
# ## 3. More threads than elements: the guard, and reading an error
#
# Sizes rarely divide by the block size, so a launch rounds the number of blocks up:
# `blocks = (n + threads - 1) // threads`. The threads past the end must touch nothing. Here is a
# kernel without that guard, launched with 12 threads on 10 elements.
#
# In the simulator the launch raises an `IndexError`, and the message names the failing thread:
# `tid` is its `threadIdx` and `ctaid` its `blockIdx`, each as (x, y, z). On a GPU the same
# launch raises **nothing**: the extra threads read and write whatever memory lies past the
# array. That is one reason to try every new kernel in the simulator first.

# %%
@cuda.jit
def double_unguarded(a, out):
    i = cuda.grid(1)
    out[i] = 2 * a[i]  # threads 10 and 11 have no element


a = np.arange(10, dtype=np.float32)
if simulator_enabled():
    try:
        double_unguarded[3, 4](cuda.to_device(a), cuda.device_array_like(a))
    except IndexError as error:
        print(puzzle_checks.read_error(error, double_unguarded))
else:
    print("On the GPU this launch would raise nothing while writing past the end of `out`: not run here.")

# %% [markdown]
# A second kind of error only a GPU shows. The simulator runs your kernel as Python, so it
# accepts Python that Numba's compiler refuses (a list, a dict, a string method): on a GPU the
# first launch compiles the kernel and raises a `TypingError` naming the line. Keep to numbers,
# arrays and `range` loops inside a kernel, and run it on a GPU once before you trust it.
#
# ### Puzzle 00-b — guard
#
# Complete `scale` (`out[i] = alpha * a[i]`) so that only the threads with an element write. The
# grader launches `scale[3, 4]` on 10 elements:

# %%
print(puzzle_checks.picture_map(puzzle_checks.BY_LABEL["00-b"], n=10))

# %% [markdown]
# ## 4. What a thread keeps: registers and local arrays
#
# A scalar variable in a kernel (`i`, `acc`) lives in a **[register](../docs/glossary.md#register)**, the fastest storage there
# is, private to its thread. For a small array of its own, a thread asks for a **local array**,
# `cuda.local.array(size, dtype)`, whose size must be a constant the compiler knows. Phase 01
# keeps its query row and its output row in two of them.

# %%
@cuda.jit
def powers_sum(out):
    t = cuda.threadIdx.x
    powers = cuda.local.array(4, float32)  # this thread's own 4 numbers
    for k in range(4):
        powers[k] = t**k
    out[t] = powers[0] + powers[1] + powers[2] + powers[3]  # 1 + t + t² + t³


out = cuda.device_array(4, dtype=np.float32)
powers_sum[1, 4](out)
print(out.copy_to_host())

# %% [markdown]
# ## 5. What a block shares: shared arrays and `cuda.syncthreads()`
#
# `cuda.shared.array(size, dtype)` is one array per **block**, seen by all its threads, in fast
# memory on the SM (**[shared memory](../docs/glossary.md#shared-memory)**: a few cycles away, where [global memory](../docs/glossary.md#global-memory) is hundreds). It is
# how the threads of a block hand data to each other.
#
# The threads of a block do not run in step. Before a thread reads what another one wrote, the
# writer must be done: `cuda.syncthreads()` is a [barrier](../docs/glossary.md#barrier) that no thread of the block passes until
# all of them have reached it. Every thread of the block must reach it (never put it inside an
# `if` that only some threads take, nor after a `return` of some): on a GPU that hangs or gives
# wrong values, and the simulator stops the launch with a `BarrierError` naming the barrier's
# line and the threads that never came. Below, each block reverses its 8 elements: thread t writes
# cell t, waits, then reads cell 7 − t, written by another thread.

# %%
@cuda.jit
def reverse_each_block(a, out):
    buffer = cuda.shared.array(8, float32)  # one per block
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * 8 + t
    buffer[t] = a[i]
    cuda.syncthreads()  # every cell is written before anyone reads
    out[i] = buffer[7 - t]


a = np.arange(16, dtype=np.float32)
out = cuda.device_array_like(a)
reverse_each_block[2, 8](cuda.to_device(a), out)
print(out.copy_to_host())

# %% [markdown]
# ### Puzzle 00-c — a shared-memory reduction
#
# Complete `block_sum`: each block adds up its 8 elements. Every thread loads one element into
# the shared array `cache` (a 0 past the end of `a`); then, at each step, the threads
# `t < stride` add cell `t + stride` into cell `t`, the stride halves, and a `cuda.syncthreads()`
# separates the steps. After log₂ 8 = 3 steps cell 0 holds the sum, and thread 0 writes it. Phase 03
# reduces a row's maximum across threads with the same halving, there with [warp shuffles](../docs/glossary.md#warp-shuffle).

# %%
print(puzzle_checks.picture_reduction())

# %% [markdown]
# ### Puzzle 00-d — tiled dot products
#
# Complete `matvec`, `y = A·x`: thread `row` computes the dot product of its row of A with x.
# Every thread needs all of x, so the block reads x **once**, a [tile](../docs/glossary.md#tile) of 8 elements at a time,
# into the shared array `x_tile` (thread t loads element t of the tile), waits, and then every
# thread reads the whole tile from shared memory. A second `cuda.syncthreads()` keeps the next
# tile from overwriting this one while a thread still reads it. This is phase 02's idea exactly:
# there the tiles are K and V, and the rows are queries.

# %%
print(puzzle_checks.picture_tiles())

# %% [markdown]
# ## Grade your puzzles
#
# Edit [exercises/00_numba_cuda.py](exercises/00_numba_cuda.py), then run, in a terminal,
# `flashcore grade 00` (or `pytest lessons/exercises --grade 00`), or the cell below. Each check
# launches your kernel on fresh random numbers, with the output filled with NaN first, and
# shows what it expected beside what it got. Until you write them the puzzles fail, saying why.

# %%
from rich.console import Console

from flashcore_numba.course import grade

graded = grade.start("00")  # lessons/exercises/00_numba_cuda.py
for check in grade.checks_for("00"):
    graded.run(check)
grade.render(graded, Console(width=110, soft_wrap=True, color_system=None, force_jupyter=False))

# %% [markdown]
# With full marks, go on to [phase 01](01_naive.ipynb): attention with one thread per query row.

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
# # Phase 08 — Hopper's wgmma: tiles multiplied from shared-memory descriptors
#
# *Previous: [07 mma.sync](07_mma_sync.ipynb). Hardware background:
# [docs/hardware.md](../docs/hardware.md#tensor-cores-phases-06-09). Course map: [README](README.md).*
#
# ## The idea
#
# Phase 07 fed the tensor cores one warp at a time: every 16×8×16 product needed its operands in
# registers first, and `ldmatrix` moved K and V there. Hopper (sm_90a) adds `wgmma.mma_async`:
#
# 1. **A warpgroup** — four consecutive warps, 128 threads — issues one instruction for a 64×N×16
#    product. Four warps, four tensor cores, one instruction.
# 2. **Operands straight from shared memory** — the tensor cores fetch B (K or V), and for S = Q·Kᵀ
#    also A (Q), themselves. The instruction names a tile by a 64-bit **matrix descriptor**: its
#    address, and two strides, LBO and SBO.
# 3. **Core matrices** — the descriptor describes a tile made of 8×8 *core matrices*, each 8 rows of
#    16 bytes stored as 128 contiguous bytes. Phase 08 stores Q, K and V that way; `cp.async` can write
#    each 16-byte piece anywhere, so the reordering costs nothing.
# 4. **P from registers** — the second product takes A from registers, in mma.sync's A layout: phase
#    07's conversion of S's accumulators into P's fragments is unchanged.
# 5. **V "MN-major"** — V's 16-byte rows run along d, not along the keys (the reduction dimension):
#    the instruction's transpose flag reads it that way, with LBO and SBO swapped.
#
# The accumulator of a wgmma is four mma.sync accumulators stacked: warp w holds rows 16w .. 16w+15,
# in the C layout phase 07 already uses. So the online softmax is the same code.
#
# Each wgmma call of this phase ends with `wgmma.wait_group 0`: the instruction is asynchronous, but
# nothing is overlapped with it yet. That is phase 09's subject.

# %%
# Where the kernels run is decided before numba.cuda is first imported: on the CUDA GPU when the
# driver shows one, else in Numba's CUDA simulator on the CPU. Set NUMBA_ENABLE_CUDASIM to choose.
import os

if "NUMBA_ENABLE_CUDASIM" not in os.environ:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if os.path.exists("/dev/nvidiactl") else "1"

# %%
from flashcore_numba.course import notebooks
from flashcore_numba.phases import p07_mma_sync
from flashcore_numba.phases import p08_wgmma as phase

lesson = notebooks.Lesson("08")
lesson.intro()

# %%
lesson.changelog()

# %% [markdown]
# ## Core matrices and descriptors
#
# Left: a 32×32 fp16 tile stored row by row, as phase 07 stored it. Right: the same tile in core-matrix
# order. Each colour is one core matrix; the numbers are byte offsets. A descriptor gives the start
# address, LBO (the distance between core matrices next to each other along the reduction dimension,
# here 128 bytes) and SBO (along the rows: one row of core matrices, `D / 8 × 128` bytes). The bit
# fields are listed at the top of [ptx/wgmma.ptx](../ptx/wgmma.ptx).
#
# The PTX ISA also offers *swizzled* layouts (32-, 64- and 128-byte), which keep a tile row-major and
# XOR the 16-byte chunk index with the row; TMA (phase 09) writes tiles that way. Without TMA the
# core-matrix order is the simplest layout wgmma reads, and `cp.async` writes it for free.

# %%
notebooks.draw_core_matrices()

# %% [markdown]
# ## Who holds which result
#
# The accumulator of one `wgmma.m64nNk16`: phase 07's fragment layout, once per warp.

# %%
notebooks.draw_warpgroup_rows()

# %% [markdown]
# ## The kernel
#
# The PTX of S = Q·Kᵀ at D = 64: four wgmmas, the descriptors moved on by 256 bytes per 16 columns of d.

# %%
lesson.show_ptx("wgmma.ptx", "flashcore_wgmma_qk_d64_f16")

# %% [markdown]
# The copy of a tile into core-matrix order, and the kernel against phase 07's:

# %%
lesson.show_source(phase.make_copy_tile)

# %%
lesson.show_diff(p07_mma_sync.build_kernel, phase.build_kernel)

# %% [markdown]
# ## Is it correct?
#
# In the simulator the wgmma functions are emulated at the level of a tile
# ([`arch/sim_wgmma.py`](../flashcore_numba/arch/sim_wgmma.py)): the emulation reads shared memory
# through the descriptor exactly as the PTX steps through it. On a GPU other than an H100-class
# (sm_90) card the phase cannot run at all, and says so.

# %%
lesson.check()

# %% [markdown]
# ## How fast is it?

# %%
timings = lesson.timing()

# %%
lesson.plot_timing(timings)

# %% [markdown]
# ## What changed in the machine code
#
# No spill, and no subroutine call: ptxas serializes every wgmma of a kernel that makes one (a 64-bit
# integer division or an IEEE float division is one), which is why the kernel computes the K/V head
# in 32-bit arithmetic and 1 / l_i by the fast division.

# %%
lesson.machine_code()

# %%
lesson.ptx(["wgmma.mma_async", "wgmma.wait_group", "fence.proxy.async", "cp.async", "ex2.approx"], max_lines=16)

# %%
lesson.sass(["HGMMA", "WARPGROUP", "LDGSTS", "SHFL", "MUFU.EX2", "STL", "LDL"])

# %% [markdown]
# ## Exercise
#
# The same two places as in phase 07, now inside a warpgroup: the row maximum over the quad (08-a) and
# P's A fragments from S's accumulators (08-b).

# %%
lesson.exercise()

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
# Phase 07 fed the [tensor cores](../docs/glossary.md#tensor-core) one [warp](../docs/glossary.md#warp) at a time: every 16×8×16 product needed its operands in
# [registers](../docs/glossary.md#register) first, and `ldmatrix` moved K and V there. [Hopper](../docs/glossary.md#hopper) ([sm_90a](../docs/glossary.md#compute-capability)) adds `wgmma.mma_async`,
# and with it five ideas, one at a time.
#
# **1. A [warpgroup](../docs/glossary.md#warpgroup) multiplies together.** Four consecutive warps, 128 [threads](../docs/glossary.md#thread), issue one
# instruction for a 64×N×16 product. Four warps, four tensor cores, one instruction: far fewer
# instructions to issue for the same work.
#
# **2. Operands straight from [shared memory](../docs/glossary.md#shared-memory).** The tensor cores fetch B (K or V), and for
# S = Q·Kᵀ also A (Q), themselves. No `ldmatrix`, and no registers spent on K and V. The instruction
# names a [tile](../docs/glossary.md#tile) by a 64-bit **matrix [descriptor](../docs/glossary.md#descriptor)**: its address, and two strides, LBO and SBO.
#
# **3. The 128-byte [swizzle](../docs/glossary.md#swizzle).** The descriptor also says how the tile is laid out. Phase 08 keeps
# Q, K and V the way [TMA](../docs/glossary.md#tma) (phase 09) will write them: rows of 128 bytes (64 values of d; D = 128
# takes two such *atoms*), where row r stores its 16-byte chunk c at chunk c ^ (r % 8). What it
# buys: the tensor cores read eight rows of a tile at once instead of one after another (the section
# on the swizzle below shows why). `cp.async` writes each 16-byte piece straight to its place, so the layout costs nothing.
#
# **4. P from registers.** The second product takes A from registers, in [mma.sync](../docs/glossary.md#mmasync)'s A layout:
# phase 07's conversion of S's [accumulators](../docs/glossary.md#accumulator) into P's [fragments](../docs/glossary.md#fragment) is unchanged.
#
# **5. V "MN-major".** V's 16-byte rows run along d, not along the keys (the reduction dimension).
# The instruction's transpose flag reads it that way, with LBO and SBO swapped, so V is stored just
# like K.
#
# What stays: the accumulator of a [wgmma](../docs/glossary.md#wgmma) is four mma.sync accumulators stacked, warp w holding rows
# 16w .. 16w+15 in the C layout phase 07 already uses. So the [online softmax](../docs/glossary.md#online-softmax) is the same code.
#
# What waits: each wgmma call of this phase ends with `wgmma.wait_group 0`. The instruction is
# asynchronous, but nothing is overlapped with it yet. That is phase 09's subject.

# %% [markdown]
# ## Where the data lives: phase 07 against phase 08
#
# Each line is one of attention's matrices and its path from HBM (the GPU's main memory) to where it
# is computed on. Lines marked `*` take a new path in this phase.
#
# ```text
#           phase 07: mma.sync, one warp           phase 08: wgmma, one warpgroup
# * Q       HBM -> shared -> registers             HBM -> shared (swizzled); the tensor cores
#           (ldmatrix)                             read it there, through a descriptor
# * K, V    HBM -> shared by cp.async (2 stages)   HBM -> shared by cp.async (2 stages, swizzled);
#           -> registers by ldmatrix               the tensor cores read them there
# * S       tensor cores -> registers of a warp    tensor cores -> registers of a warpgroup
#           (32 rows)                              (64 rows, warp w holds 16w .. 16w+15)
#   P       registers: S's fragments as fp16       the same
# * O       tensor cores add P·V into acc          tensor cores -> a fresh O tile in registers,
#                                                  then folded into acc
#           acc / l_i -> HBM                       the same
# ```
#
# One K/V tile through one warpgroup in phase 08. The arrows marked `desc` are the tensor cores
# reading shared memory themselves; registers hold only S, P and the output.
#
# ```text
#   HBM Q, K, V --cp.async--> shared Q, K, V (swizzled)
#                               |Q, K        |V
#                               |desc        |desc
#                               v            |
#               [tensor cores] S = Q·Kᵀ      |
#                      |                     |
#                      v                     v
#   registers:  S --> softmax --> P --> [tensor cores] O_tile = P·V --> acc = alpha·acc + O_tile
# ```
#
# Two warpgroups share each K/V tile: a block holds 128 query rows.

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
# ## The swizzle and the descriptors
#
# Why swizzle: the tensor cores read a tile eight rows at a time, the same 16 bytes of each row. In a
# plain row-major tile with 128-byte rows those eight chunks fall into the same four banks of shared
# memory, and the reads serialize eight ways. XOR-ing the chunk index with the row spreads them over all
# 32 banks, and the eight reads happen at once. The picture shows where each chunk goes. The hardware
# applies the XOR itself; the descriptor only says "swizzled". Its bit fields, and what an earlier
# version of the [kernel](../docs/glossary.md#kernel) without the swizzle measured, are in the [appendix](#appendix-tuning-notes).

# %%
notebooks.draw_swizzle()

# %% [markdown]
# ## Who holds which result
#
# The accumulator of one `wgmma.m64nNk16`: phase 07's fragment layout, once per warp.

# %%
notebooks.draw_warpgroup_rows()

# %% [markdown]
# ## The kernel
#
# The [PTX](../docs/glossary.md#ptx) of S = Q·Kᵀ at D = 64: four wgmmas, the descriptors moved on by 32 bytes per 16 columns of d.

# %%
lesson.show_ptx("wgmma.ptx", "flashcore_wgmma_qk_d64_f16")

# %% [markdown]
# The copy of a tile into the swizzled layout, and the kernel. It does what phase 07's roles do
# (`p07_mma_sync.make_products`, `make_softmax_tile`, `make_epilogue`), in one function: the
# products are one wgmma call each per tile, and the softmax calls the same fragment helpers
# (`common.mask_scores`, `row_max`, `exp_and_sum`), without phase 07's m-tiles and lazy rescale.

# %%
lesson.show_source(phase.make_copy_tile)

# %%
lesson.show_source(phase.build_kernel)

# %% [markdown]
# ## Is it correct?
#
# In the [simulator](../docs/glossary.md#simulator) the wgmma functions are emulated at the level of a tile
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
# No [spill](../docs/glossary.md#spill), and no subroutine call: a single call anywhere in the kernel makes the assembler
# run every wgmma one after the other ([appendix](#appendix-tuning-notes): what counts as a call).

# %%
lesson.machine_code()

# %%
lesson.ptx(["wgmma.mma_async", "wgmma.wait_group", "fence.proxy.async", "cp.async", "ex2.approx"], max_lines=16)

# %%
lesson.sass(["HGMMA", "WARPGROUP", "LDGSTS", "SHFL", "MUFU.EX2", "STL", "LDL"])

# %% [markdown]
# ## Exercise
#
# The same two places as in phase 07, now inside a warpgroup: the row maximum over the [quad](../docs/glossary.md#quad) (08-a) and
# P's A fragments from S's accumulators (08-b).

# %%
lesson.exercise()

# %% [markdown]
# ## The solution
#
# Try the exercise first. These are the lines the phase itself has in each region; the listings
# above show the regions empty, as your stub has them.

# %%
lesson.show_solution()

# %% [markdown]
# <a id="appendix-tuning-notes"></a>
# ## Appendix: tuning notes
#
# ### The descriptor's bits
#
# The hardware applies the swizzle's XOR to address bits 4-6 with bits 7-9, so a swizzled tile must
# start 1024-byte aligned, and the descriptor only says "swizzled" (mode 1 in bits 62-63), how far
# apart groups of eight rows are (SBO = 1024) and, for V, where the second 64-column atom is (LBO).
# The bit fields are listed at the top of [ptx/wgmma.ptx](../ptx/wgmma.ptx).
#
# ### Without the swizzle
#
# The first version of this phase used the other layout wgmma accepts without swizzle: 8×8 *[core
# matrices](../docs/glossary.md#core-matrix)* of 128 contiguous bytes. It was correct, and measured 250 [TFLOPS](../docs/glossary.md#tflops) at D = 64 and 240 at
# D = 128 (slower than phase 07 there); with the swizzle the same kernel runs the numbers above.
#
# ### No subroutine call
#
# [ptxas](../docs/glossary.md#ptxas) serializes every wgmma of a kernel that makes a subroutine call (a 64-bit integer division
# or an IEEE float division is one), which is why the kernel computes the K/V head in 32-bit
# arithmetic and 1 / l_i by the fast division.

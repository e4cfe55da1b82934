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
# # Phase 01 — Naive: one thread per query row
#
# *Next: [02 shared-memory tiling](02_smem_tiling.ipynb). Hardware background:
# [docs/hardware.md](../docs/hardware.md). Course map: [README](README.md).*
#
# Attention computes, for every batch element and head, `O = softmax(Q·Kᵀ·scale)·V`, with Q, K
# and V of shape S×D (sequence length × head dimension). The score matrix `Q·Kᵀ` is S×S: at
# S = 2048 that is four million numbers per head, which a fast [kernel](../docs/glossary.md#kernel) never writes to memory.
# FlashAttention's trick, which this first phase already uses, is the **[online softmax](../docs/glossary.md#online-softmax)**: walk
# over the keys once and keep, for each query row, three running quantities:
#
# | name | meaning |
# |---|---|
# | `m_i` | the largest score seen so far |
# | `l_i` | the sum of `exp(score − m_i)` so far |
# | `acc` | the sum of `exp(score − m_i) · v_j` so far (a row of D numbers) |
#
# When a new key j arrives with score `s`, a larger maximum may appear; everything accumulated
# so far is rescaled by `alpha = exp(m_old − m_new)`:
#
# ```
# m_new = max(m_i, s)
# alpha = exp2(m_i − m_new)         p = exp2(s − m_new)
# l_i   = alpha·l_i + p             acc = alpha·acc + p·v_j
# m_i   = m_new
# ```
#
# and at the end `o = acc / l_i`. The scores live in base 2 (`qk_scale = scale·log2 e` is folded
# in once), because `exp2` is a single GPU instruction, `ex2.approx.f32`.

# %% [markdown]
# ## The idea of this phase
#
# The simplest mapping of that loop onto a GPU: **one CUDA [thread](../docs/glossary.md#thread) per query row**. A [block](../docs/glossary.md#block) of 128
# threads owns 128 consecutive rows; each thread copies its row of q into [registers](../docs/glossary.md#register) and walks
# over every key it may see, one at a time.
#
# ```
#                  K and V in global memory (HBM)
#                  key 0      key 1      key 2           key S-1
#   thread 0   ──► q0·k0  ──► q0·k1  ──► q0·k2  ──► … ──► q0·k(S-1)     → o0
#   thread 1   ──► q1·k0  ──► q1·k1  ──► q1·k2  ──► … ──► q1·k(S-1)     → o1
#     …
#   thread 127 ──► …                                                    → o127
#
#   every thread reads every k_j and v_j itself: K and V are read S times per head
# ```
#
# ## Why it is slow
#
# * **Memory traffic.** Each query row reads all of K and V: per head that is S × S × D × 2 tensors
#   × 2 bytes, 1 GiB at S = 2048, D = 64, for 0.5 MiB of actual K and V. The 32 threads of a [warp](../docs/glossary.md#warp)
#   read the *same* `k_j[d]` at the same moment, so one memory transaction serves the whole warp
#   and the [L1](../docs/glossary.md#l1-cache) and [L2](../docs/glossary.md#l2-cache) caches absorb most of the rest, but every multiply-add still waits for a load.
# * **Little arithmetic per byte.** Per key a thread does 2·D [FLOPs](../docs/glossary.md#tflops) for the dot product and 2·D for
#   the `acc` update, for 2·D loaded [fp16](../docs/glossary.md#fp16) values (4·D bytes): about 1 FLOP per byte. An H100 needs
#   about 20 FLOPs per byte read from [HBM](../docs/glossary.md#hbm) before its [FP32](../docs/glossary.md#fp32) units, not memory, are the limit.
# * **Few warps.** `q` and `acc` are 2·D floats per thread, kept in registers because `HEAD_DIM` is
#   a compile-time constant and every loop over d is [unrolled](../docs/glossary.md#unrolling). Many registers per thread means few
#   threads per [SM](../docs/glossary.md#sm), so there are few other warps to run while one waits for memory (see the
#   [occupancy](../docs/glossary.md#occupancy) column below).
#
# The online softmax itself is already the FlashAttention idea; every later phase keeps it and
# changes only how the data moves.

# %%
# Where the kernels run is decided before numba.cuda is first imported: on the CUDA GPU when the
# driver shows one, else in Numba's CUDA simulator on the CPU. Set NUMBA_ENABLE_CUDASIM to choose.
import os

if "NUMBA_ENABLE_CUDASIM" not in os.environ:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if os.path.exists("/dev/nvidiactl") else "1"

# %%
from flashcore_numba.course import notebooks
from flashcore_numba.phases import common
from flashcore_numba.phases import p01_naive as phase

lesson = notebooks.Lesson("01")
lesson.intro()

# %% [markdown]
# The phase module's docstring is its changelog; its last block is written from the benchmark
# record by `flashcore report`.

# %%
lesson.changelog()

# %% [markdown]
# ## The kernel
#
# Shown straight from the package, so what you read is what runs. `build(HEAD_DIM)` returns a
# kernel specialized to one head dimension: `HEAD_DIM` becomes a constant inside it, which lets
# Numba size the per-thread arrays and unroll the loops over d.

# %%
lesson.show_source(phase.build)

# %% [markdown]
# The online-softmax update and the [epilogue](../docs/glossary.md#epilogue) are shared by every phase and written once in
# `flashcore_numba.phases.common`. Note the guard for rows that have seen only masked keys:
# measuring against 0 instead of `-inf` keeps `(-inf) − (-inf)` from producing NaN.

# %%
lesson.show_source(common.softmax_rescale, common.finalize, common.key_end)

# %% [markdown]
# ## Is it correct?
#
# Fresh random inputs, the output array filled with NaN before the [launch](../docs/glossary.md#launch) (so an element the
# kernel forgets to write is caught), and the result compared with the float64 reference. The
# oracle is FlashAttention's: the error may be at most twice that of plain fp16 attention, plus a
# small absolute slack. Causal masking and a sequence length that is not a multiple of the block
# size are both exercised.

# %%
lesson.check()

# %% [markdown]
# ## How fast is it?
#
# On a GPU this cell measures the kernel and torch's `scaled_dot_product_attention` on the course's
# reference shape (B=16, H=16, S=2048, D=64, fp16). On a CPU it shows the committed GPU record and
# says where it came from.
#
# Every lesson times the same thing: the **kernel** alone, each launch on an idle GPU with the L2
# cache flushed before it, so that no Python and no earlier launch enters the figure. That is what
# each phase changes. A user who calls `attention()` pays a little more: before the kernel starts,
# the host validates the call, finds the problem's plan (made on its first call), allocates the
# output and launches. At small shapes that host time is a large part of a call; at this shape the
# GPU's work hides it. The table "What a call costs" in [docs/performance.md](../docs/performance.md)
# has those figures from the benchmark records, and [the guide](../docs/guide.md#what-a-call-costs-beside-its-kernel) says what a call adds and why.

# %%
timings = lesson.timing()

# %%
lesson.plot_timing(timings)

# %% [markdown]
# ## What the compiler made of it
#
# The kernel compiled for the H100 ([sm_90a](../docs/glossary.md#compute-capability)), without needing one: registers per thread, bytes
# [spilled](../docs/glossary.md#spill) to [local memory](../docs/glossary.md#local-memory), the [stack frame](../docs/glossary.md#stack-frame), [shared memory](../docs/glossary.md#shared-memory) per block, and how many blocks of 128
# threads that lets one SM hold at a time.

# %%
lesson.machine_code()

# %% [markdown]
# The [PTX](../docs/glossary.md#ptx) (NVIDIA's virtual instruction set) shows the shape of the work: `ld.global.u16` loads of
# fp16 values straight from [global memory](../docs/glossary.md#global-memory), one `fma.rn.f32` per multiply-add, `ex2.approx.f32` for
# exp2 and a `div.rn.f32` per output element in the epilogue.

# %%
lesson.ptx(["ld.global.u16", "fma.rn.f32", "ex2.approx", "div.rn.f32"])

# %%
lesson.sass(["LDG", "FFMA", "MUFU.EX2"])

# %% [markdown]
# ## Exercise
#
# Write the online-softmax update for one key: `m_i`, `l_i`, then `acc`. The stub is the phase's
# source with the marked region removed; the grader runs your kernel in the [simulator](../docs/glossary.md#simulator) against the
# reference.

# %%
lesson.exercise()

# %% [markdown]
# ## The solution
#
# Try the exercise first. These are the lines the phase itself has in each region; the listings
# above show the regions empty, as your stub has them.

# %%
lesson.show_solution()

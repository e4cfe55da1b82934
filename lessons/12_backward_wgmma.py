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
# # Phase 12 — The backward on wgmma: warpgroups multiply the backward's products
#
# *Previous: [11 the backward pass](11_backward.ipynb), which this phase changes in one place; the
# instructions are [08 wgmma](08_wgmma.ipynb)'s. Hardware background: [docs/hardware.md](../docs/hardware.md).
# Course map: [README](README.md).*
#
# ## The idea
#
# Phase 11's `kv_kernel` is FlashAttention-2's backward on `mma.sync`: a block keeps 128 keys and
# their values in [shared memory](../docs/glossary.md#shared-memory), query tiles stream past, and
# each of its 8 [warps](../docs/glossary.md#warp) owns 16 of the keys. For every query tile each warp
# computes its share of five products: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, then dV += Pᵀ dO, dK += dSᵀ Q and its
# part of dQ = dS K.
#
# **1. Where phase 11's time goes.** `mma.sync` takes its operands from registers, so every warp
# first reads them out of shared memory with `ldmatrix`. Every warp needs the *whole* query tile
# (its 16 keys meet every query row), so the 8 warps read the same Q and dO tiles 8 times, twice
# over (once for Sᵀ and dPᵀ, once transposed for dK and dV): at D = 64, 96 `ldmatrix.x4` a warp and
# tile against 160 `mma.sync`. The profiler had the SM's shared-memory pipe busier than anything
# else (80 %, docs/tuning/11_history.md), the tensor cores waiting on it.
#
# **2. Four warps read their B operand once.** Hopper's `wgmma.mma_async` (phase 08) multiplies a
# 64-row tile for four warps together, a [warpgroup](../docs/glossary.md#warpgroup), and the tensor
# cores fetch the operands from shared memory themselves, named by a
# [descriptor](../docs/glossary.md#descriptor). So phase 12 gives each block two warpgroups
# of 64 keys instead of 8 warps of 16: the query tiles are read by 2 warpgroups, not by 8 warps.
#
# **3. The five products, as wgmma forms.** Each is one call of ptx/wgmma.ptx, all of them forms
# the forward already has, but the last:
#
#     Sᵀ  = K Qᵀ,  dPᵀ = V dOᵀ    qk:      A = the warpgroup's 64 keys of K (V), B = the query tile of Q (dO)
#     dV += Pᵀ dO, dK += dSᵀ Q    pv_acc:  A = Pᵀ (dSᵀ) from registers, B = dO (Q) read transposed
#     dQ  = dS K                  dq:      A = dSᵀ from shared memory, B = K, both read transposed
#
# The accumulators of a wgmma have `mma.sync`'s layout, warp w holding rows 16w .. 16w + 15 of the
# 64: exactly phase 11's layout of a warp's 16 keys. So the element-by-element step in between,
# Pᵀ recomputed from the log-sum-exp and dSᵀ = Pᵀ ∘ (dPᵀ − Δ), is phase 11's code, unchanged, and so
# is the repacking of Pᵀ and dSᵀ into A fragments (`common.make_pack_a`, which phases 09 and 10 use for P).
#
# **4. dSᵀ through shared memory.** dQ = dS K needs dS with the query rows as its rows, the
# transpose of what each warpgroup holds, and it needs both warpgroups' keys. So each warpgroup
# writes its dSᵀ to shared memory, a row per key, in the 128-byte
# [swizzle](../docs/glossary.md#swizzle) wgmma reads (chunk c of row r at chunk c ^ (r % 8)), and
# wgmma reads it back *MN-major*: `imm-trans-a = 1`, the transpose done by the tensor cores on the
# way in. K, kept for Sᵀ, is read transposed the same way. Each warpgroup then computes one
# 64 × 64 piece of the tile's dQ (at D = 64 half of the 128 query rows, at D = 128 half of the
# columns) and adds it to dQ in global memory by `red`, as phase 11 does.
#
# **5. The tiles.** A warpgroup holds Sᵀ and dPᵀ (BLOCK_M / 2 registers each per thread) and dK and
# dV (D / 2 each) at once: 192 of a thread's 255 registers either way, so the query tiles are 128
# rows at D = 64 and 64 rows at D = 128 (FlashAttention-3 chose the same for Hopper).
#
# What this first version does not do yet: it waits for each product before the next (phase 09
# overlaps them), and in the default build each tile has a barrier between the dSᵀ stores and dQ
# (the deterministic build at D = 128 adds dQ a tile late instead, as phase 11 does: `dq_late`;
# measured, the late form was faster only there). Even so it is faster than phase 11 on the H200
# (the changelog below has the records), and `attention()`'s autograd ran it on Hopper until phase
# 13 overtook it (its serial build still runs there for `deterministic=True`).

# %%
# Where the kernels run is decided before numba.cuda is first imported: on the CUDA GPU when the
# driver shows one, else in Numba's CUDA simulator on the CPU. Set NUMBA_ENABLE_CUDASIM to choose.
import os

if "NUMBA_ENABLE_CUDASIM" not in os.environ:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if os.path.exists("/dev/nvidiactl") else "1"

# %%
from flashcore_numba.course import notebooks
from flashcore_numba.phases import p11_backward
from flashcore_numba.phases import p12_backward_wgmma as phase

lesson = notebooks.Lesson("12")
lesson.intro()

# %%
lesson.changelog()

# %% [markdown]
# ## A block, two warpgroups
#
# Which warpgroup computes what of one query tile (D = 64: 128 keys by 128 query rows). Sᵀ and dPᵀ
# are split by keys, 64 a warpgroup, each warp 16 of them; dQ by query rows, a 64 × 64 piece a
# warpgroup, summed over all 128 keys, so both warpgroups' dSᵀ must be in shared memory first.

# %%
notebooks.draw_wgmma_backward()

# %% [markdown]
# ## The kernel, beside phase 11's
#
# It does what phase 11's `kv_kernel` and its roles (`p11_backward.make_tile_grads`, `make_dq`,
# `make_query_stream`) do, in one function: the ldmatrix addresses and the per-warp products give way
# to descriptors and warpgroup calls, the dSᵀ stores follow the swizzle, and the dQ of a tile is two
# calls per piece.

# %%
lesson.show_source(phase.build_kv_kernel)

# %% [markdown]
# The tiles reach shared memory in phase 08's layout (rows in tiles of 64, each D / 64 swizzled
# atoms), copied in passes as phase 07 copies: a pass moves every thread's destination by the same
# constant, so the compiler keeps one address a copy across the query-tile loop instead of one per
# chunk (phase 08's copy, kept there, cost this kernel spilled registers).

# %%
lesson.show_source(phase.make_copy_tile)

# %% [markdown]
# The new product, dQ = dS K, in ptx/wgmma.ptx: both operands from shared memory, both transposed
# (the last two immediates, `imm-trans-a` and `imm-trans-b`).

# %%
lesson.show_ptx("wgmma.ptx", "flashcore_wgmma_dq_f16")

# %% [markdown]
# ## Is it correct?
#
# Fresh random inputs, dQ, dK and dV poisoned with NaN first, each compared with the float64
# reference's gradients by the grader's rule.

# %%
lesson.check()

# %% [markdown]
# ## How fast is it?
#
# Beside phase 11 and torch SDPA's backward at the reference shape, where a record has the row
# (`flashcore bench --backward` times phase 12 on Hopper).

# %%
timings = lesson.timing()

# %%
lesson.plot_timing(timings)

# %% [markdown]
# ## What changed in the machine code
#
# Phase 11's `kv_kernel` and this one, compiled for the H100: `HGMMA` (wgmma) in place of `HMMA`
# (mma.sync), and no `LDSM` (ldmatrix) at all: the tensor cores read shared memory themselves. The
# `.tnspA` and `.tnspB` of dQ's HGMMA are the transposed reads.

# %%
lesson.machine_code()

# %%
lesson.ptx(["wgmma.mma_async", "mma.sync", "ldmatrix", "cp.async", "red.global.add.v2.f32", "ex2.approx"])

# %%
lesson.sass(["HGMMA", "HMMA", "LDSM", "LDGSTS", "REDG", "MUFU.EX2", "BAR.SYNC", "STL", "LDL"])

# %% [markdown]
# ## Exercise

# %%
lesson.exercise()

# %% [markdown]
# ## The solution
#
# Try the exercise first. These are the lines the phase itself has in each region; the listings
# above show the regions empty, as your stub has them.

# %%
lesson.show_solution()

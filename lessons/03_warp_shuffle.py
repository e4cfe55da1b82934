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
# # Phase 03 — Warp-shuffle softmax and register tiles
#
# *Previous: [02 shared-memory tiling](02_smem_tiling.ipynb). Next: [04 padding](04_padding.ipynb).
# Hardware background: [docs/hardware.md](../docs/hardware.md). Course map: [README](README.md).*
#
# ## The idea
#
# In phase 02 a [thread](../docs/glossary.md#thread) did all the work of one row, and every multiply-add needed its own load
# from [shared memory](../docs/glossary.md#shared-memory): one `ld.shared` per [FMA](../docs/glossary.md#fma). Shared memory is fast, but the [SM](../docs/glossary.md#sm) can issue far
# more FMAs per cycle than shared-memory loads, so the loads were the limit.
#
# Now the unit of work is the **[warp](../docs/glossary.md#warp)**, the 32 threads the SM schedules together. A warp owns
# `ROWS_PER_WARP = 16` query rows and splits them like a small matrix-multiply [tile](../docs/glossary.md#tile) (the layout's
# constants are printed below; the numbers here are those of head dim 64):
#
# * the 32 [lanes](../docs/glossary.md#lane) form two groups of `LANES_PER_ROW = 16`; a group shares `TM = 8` rows;
# * inside a group, lane `c` takes keys `c, c + 16, c + 32, c + 48` of the 64-key tile (`TN = 4`);
# * so each lane computes an 8 × 4 block of scores as an **outer product**: per step along d it
#   loads 8 values of q and 4 of k from shared memory into [registers](../docs/glossary.md#register) and does 8 · 4 = 32 FMAs.
#
# That is 32 FMAs for 12 loads instead of 1 for 1. The same trick computes `acc += p · v`: each
# lane keeps an 8 × 4 block of `acc` in registers.

# %% [markdown]
# ## Reducing a row across lanes: the butterfly
#
# A row's 64 scores are now spread over the 16 lanes of its group, so the row maximum needs values
# from other lanes. `cuda.shfl_xor_sync(mask, value, offset)` hands each lane the `value` of lane
# `lane ^ offset`, register to register, in one instruction: no shared memory, no [barrier](../docs/glossary.md#barrier).
#
# ```
#   16 lanes of one row group, each holding the max of its own 4 scores
#
#   offset 8:   0⇄8   1⇄9   2⇄10  …  7⇄15      each lane: m = max(m, partner's m)
#   offset 4:   0⇄4   1⇄5   2⇄6   …  11⇄15
#   offset 2:   0⇄2   1⇄3   4⇄6   …  13⇄15
#   offset 1:   0⇄1   2⇄3   4⇄5   …  14⇄15
#
#   after log2(16) = 4 steps every lane holds the maximum of all 16
# ```
#
# The row sum `l_i` needs no [shuffle](../docs/glossary.md#warp-shuffle) inside the loop: `alpha` is the same on every lane of a row,
# so each lane keeps a partial sum and the 16 partial sums are added once, in the [epilogue](../docs/glossary.md#epilogue). The
# probabilities `p` go through a per-warp slice of shared memory to the `p · v` product; only a
# `syncwarp()` separates the two products, because no other warp reads those rows.

# %%
# Where the kernels run is decided before numba.cuda is first imported: on the CUDA GPU when the
# driver shows one, else in Numba's CUDA simulator on the CPU. Set NUMBA_ENABLE_CUDASIM to choose.
import os

if "NUMBA_ENABLE_CUDASIM" not in os.environ:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if os.path.exists("/dev/nvidiactl") else "1"

# %%
from flashcore_numba.course import notebooks
from flashcore_numba.phases import p03_warp_shuffle as phase

lesson = notebooks.Lesson("03")
lesson.intro()

# %% [markdown]
# The constants of the warp tiling at head dim 64, from the layout every warp-tiled phase uses:

# %%
layout = phase.smem_layout(64)
print({name: layout[name] for name in ("BLOCK_M", "BLOCK_N", "NUM_WARPS", "ROWS_PER_WARP", "LANES_PER_ROW",
                                       "TM", "TN", "TD")})

# %% [markdown]
# Who computes what: warp 0's 16 × 64 block of scores, each cell labelled with its lane. Lanes
# 0-15 share rows 0-7, lanes 16-31 rows 8-15; a lane's four keys are 16 apart.

# %%
notebooks.draw_warp_tile(layout)

# %%
lesson.changelog()

# %% [markdown]
# ## The kernel
#
# The [kernel](../docs/glossary.md#kernel) body is short: it sets up each lane's rows and keys, then per K/V tile calls four
# steps. All the derived constants (`TM`, `TN`, strides and offsets of the shared-memory tiles)
# come from one `layout()` dictionary that phases 04 and 05 reuse.

# %%
lesson.show_source(phase.build_kernel)

# %% [markdown]
# The four steps, specialized to a layout. Look for the outer product in `scores_tile`, the
# [butterfly](../docs/glossary.md#butterfly) in `softmax_tile` and the final reduction of `l_i` in `store_output`.

# %%
lesson.show_source(phase.make_tile_functions)

# %% [markdown]
# ## Is it correct?
#
# The [simulator](../docs/glossary.md#simulator) has no warp shuffles of its own; `flashcore_numba.arch.sim` supplies them by letting
# the 32 lanes of a simulated warp meet at a barrier and exchange values.

# %%
lesson.check()

# %% [markdown]
# ## How fast is it?

# %%
timings = lesson.timing()

# %%
lesson.plot_timing(timings)

# %% [markdown]
# Compare with phase 02 above: on its own, this phase can lose. Its register tiles read K from
# shared memory with a [bank conflict](../docs/glossary.md#bank-conflict) on every load (see the end of this lesson), and that cost
# can eat the gain of the tiling. Phase 04 removes the conflicts and collects it.

# %% [markdown]
# ## What changed in the machine code
#
# The [stack frame](../docs/glossary.md#stack-frame) of phase 02 is gone: every per-lane array (`s`, `acc`, `m_i`, `l_i`, the q and k
# [fragments](../docs/glossary.md#fragment)) is indexed only by [unrolled](../docs/glossary.md#unrolling) loop counters, so the compiler keeps all of it in
# registers. The [PTX](../docs/glossary.md#ptx) gains `shfl.sync.bfly` (four per reduction) and `bar.warp.sync` (the
# `syncwarp`).

# %%
lesson.machine_code()

# %%
lesson.ptx(["ld.shared", "fma.rn.f32", "shfl.sync.bfly", "ex2.approx", "bar.warp.sync"], max_lines=18)

# %%
lesson.sass(["LDS", "FFMA", "SHFL.BFLY", "MUFU.EX2"])

# %% [markdown]
# ## What is still wrong
#
# Shared memory is split into 32 banks; lanes that read different words of the same bank in one
# instruction are served one after another. The lanes of a row group read the same column of
# different K rows, and the rows are `HEAD_DIM = 64` words apart, a multiple of 32: every one of
# those words sits in the same bank. `flashcore_numba.measure.banks` computes how many passes each
# shared-memory access of this layout needs (1 means conflict-free):

# %%
lesson.bank_conflicts()

# %% [markdown]
# Phase 04 removes the conflicts by padding every row with a few unused words.
#
# ## Exercise
#
# Two reductions across the 16 lanes of a row group: the row maximum in `softmax_tile` (with
# `max`) and the row sum in `store_output` (with `+`). Both are the butterfly above: offsets
# `LANES_PER_ROW // 2` down to 1.

# %%
lesson.exercise()

# %% [markdown]
# ## The solution
#
# Try the exercise first. These are the lines the phase itself has in each region; the listings
# above show the regions empty, as your stub has them.

# %%
lesson.show_solution()

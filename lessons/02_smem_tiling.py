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
# # Phase 02 — Shared-memory tiling of K and V
#
# *Previous: [01 naive](01_naive.ipynb). Next: [03 warp-shuffle softmax](03_warp_shuffle.ipynb).
# Hardware background: [docs/hardware.md](../docs/hardware.md). Course map: [README](README.md).*
#
# ## The idea
#
# In phase 01 each of the 128 [threads](../docs/glossary.md#thread) of a [block](../docs/glossary.md#block) read every key and value from [global memory](../docs/glossary.md#global-memory) on
# its own. The block's threads all need the *same* keys, so let them fetch each key once,
# together, into **[shared memory](../docs/glossary.md#shared-memory)**, a small scratchpad on the [SM](../docs/glossary.md#sm) that every thread of the block
# can read, and compute from there.
#
# The keys are walked one **[tile](../docs/glossary.md#tile)** of `BLOCK_N = 32` keys at a time:
#
# ```
#   block: BLOCK_M = 128 query rows, one per thread
#
#   for each tile of 32 keys:
#       syncthreads()                          everyone is done with the previous tile
#       all 128 threads copy K[tile], V[tile]  global (fp16) ──► shared memory (fp32)
#       syncthreads()                          the tile is complete
#       each thread, for its own row:
#           32 scores   q · k_j      (k_j read from shared memory)
#           one max, one rescale of acc for the whole tile
#           32 updates  acc += p_j · v_j
# ```
#
# The [online softmax](../docs/glossary.md#online-softmax) moves from per key to per tile: the row max is updated once per tile, and
# `acc` (D numbers) is rescaled once per tile instead of after every key.

# %% [markdown]
# ## Why the hardware rewards it
#
# * **Reuse.** Each K and V element is now loaded from global memory once per *block* instead of
#   once per *row*: 128 times fewer loads reach the caches and [HBM](../docs/glossary.md#hbm).
# * **Proximity.** Shared memory sits inside the SM, a few tens of cycles away; HBM is hundreds of
#   cycles away (see the figure below).
# * **[Coalescing](../docs/glossary.md#coalescing).** In `load_tile`, consecutive threads copy consecutive elements of a row, so the 32
#   loads of a [warp](../docs/glossary.md#warp) fall into one contiguous stretch of memory and are served by a few wide
#   transactions instead of 32 separate ones.
# * **[Broadcast](../docs/glossary.md#broadcast).** In the score loop every thread of a warp reads the same word `k_j[d]` at the same
#   moment. Shared memory serves a word that many [lanes](../docs/glossary.md#lane) ask for once, to all of them: a broadcast,
#   no [bank conflict](../docs/glossary.md#bank-conflict).

# %%
# Where the kernels run is decided before numba.cuda is first imported: on the CUDA GPU when the
# driver shows one, else in Numba's CUDA simulator on the CPU. Set NUMBA_ENABLE_CUDASIM to choose.
import os

if "NUMBA_ENABLE_CUDASIM" not in os.environ:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if os.path.exists("/dev/nvidiactl") else "1"

# %%
from flashcore_numba.course import notebooks
from flashcore_numba.phases import common
from flashcore_numba.phases import p02_smem_tiling as phase

lesson = notebooks.Lesson("02")
lesson.intro()

# %%
notebooks.draw_memory_hierarchy()

# %%
lesson.changelog()

# %% [markdown]
# ## The kernel
#
# The shared array is declared with size 0: its size is given at [launch](../docs/glossary.md#launch) ([dynamic shared memory](../docs/glossary.md#dynamic-shared-memory)),
# `2 · BLOCK_N · HEAD_DIM` floats for one K tile and one V tile. Threads whose row is past the end
# of the sequence still help with the loads and still reach every `syncthreads()`: a [barrier](../docs/glossary.md#barrier) that
# some threads of a block skip hangs or corrupts the block.

# %%
lesson.show_source(phase.build)

# %% [markdown]
# The tile copy, shared with the later phases. Rows past the end of the sequence are written as
# zeros so a tail tile never feeds garbage into a dot product; the scores of those keys are masked
# to `-inf` anyway.

# %%
lesson.show_source(common.load_tile)

# %% [markdown]
# ## Is it correct?

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
# Two things to look for. The `ld.global` loads of the score loop become `ld.shared` loads, and
# the block now asks for shared memory (`dynamic smem`). And a **[stack frame](../docs/glossary.md#stack-frame)** appears: the array
# `s` of the tile's `BLOCK_N` scores is indexed by a loop variable the compiler does not fully
# [unroll](../docs/glossary.md#unrolling), so it cannot live in [registers](../docs/glossary.md#register) and is placed in [local memory](../docs/glossary.md#local-memory) (per-thread memory backed
# by DRAM, cached in [L1](../docs/glossary.md#l1-cache)): the `ld.local` / `st.local` in the [PTX](../docs/glossary.md#ptx), `BLOCK_N` × 4 bytes of frame.
# Phase 03 removes it by giving each thread a fixed, small block of scores.

# %%
lesson.machine_code()

# %%
lesson.ptx(["ld.global", "ld.shared", "st.shared", "ld.local", "st.local", "bar.sync"])

# %%
lesson.sass(["LDG", "LDS", "STS", "LDL", "STL", "BAR"])

# %% [markdown]
# ## Exercise
#
# Stage the K and V tiles of the current key range in shared memory, using the shared
# `load_tile` helper. Think about which keys the tile starting at `start_n` holds, where in the
# shared array each tile goes, and what the `syncthreads()` on either side protect.

# %%
lesson.exercise()

# %% [markdown]
# ## The solution
#
# Try the exercise first. These are the lines the phase itself has in each region; the listings
# above show the regions empty, as your stub has them.

# %%
lesson.show_solution()

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
# # Phase 05 — Double buffering: prefetch the next tile
#
# *Previous: [04 padding](04_padding.ipynb). Hardware background: [docs/hardware.md](../docs/hardware.md).
# Course map: [README](README.md).*
#
# ## The idea
#
# Phase 04 loads a K/V [tile](../docs/glossary.md#tile) into [shared memory](../docs/glossary.md#shared-memory) and then waits at a [barrier](../docs/glossary.md#barrier) until it has arrived.
# While those loads travel from [L2](../docs/glossary.md#l2-cache) or [HBM](../docs/glossary.md#hbm), hundreds of cycles, the [warps](../docs/glossary.md#warp) of the [block](../docs/glossary.md#block) have
# nothing to compute. Phase 05 splits the load in two:
#
# 1. `prefetch_tile` issues the global loads of the **next** tile into [registers](../docs/glossary.md#register) and returns at once;
# 2. the scores of the **current** tile are computed while those loads are in flight;
# 3. `store_tile` writes the registers into the *other* of two shared-memory buffers (stages): [double
# buffering](../docs/glossary.md#double-buffering).
#
# The next V tile does the same behind the softmax and `p · v`. One barrier per tile instead of
# two: it both publishes tile j+1 and retires tile j.

# %% [markdown]
# ## Why the hardware rewards it: latency hiding
#
# A load instruction does not stall the warp that issues it; only the first instruction that
# *uses* the loaded register waits for it. A GPU normally hides memory latency by switching to
# another warp, but these [kernels](../docs/glossary.md#kernel) hold few warps per [SM](../docs/glossary.md#sm) (their registers and shared memory are
# large, see the [occupancy](../docs/glossary.md#occupancy) column below). So each warp has to hide its own latency by putting
# independent work between a load and its use: software pipelining.
#
# The price is paid in the same resources: a second K/V buffer in shared memory, and registers to
# carry a tile operand (`PER_THREAD` [fp16](../docs/glossary.md#fp16) values per [thread](../docs/glossary.md#thread), 32 at D = 64) across the score
# computation. Prefetching K and V separately, each behind half of the arithmetic, keeps only one
# operand in registers at a time.

# %%
# Where the kernels run is decided before numba.cuda is first imported: on the CUDA GPU when the
# driver shows one, else in Numba's CUDA simulator on the CPU. Set NUMBA_ENABLE_CUDASIM to choose.
import os

if "NUMBA_ENABLE_CUDASIM" not in os.environ:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if os.path.exists("/dev/nvidiactl") else "1"

# %%
from flashcore_numba.course import notebooks
from flashcore_numba.phases import p03_warp_shuffle
from flashcore_numba.phases import p05_double_buffer as phase

lesson = notebooks.Lesson("05")
lesson.intro()

# %% [markdown]
# A schematic timeline (not a measurement): with one buffer, every tile starts with a wait; with
# two, only the first does.

# %%
notebooks.draw_pipeline()

# %%
lesson.changelog()

# %% [markdown]
# ## The kernel
#
# The split load. Consecutive threads still take consecutive elements, so the global loads stay
# [coalesced](../docs/glossary.md#coalescing); the fp16 → [fp32](../docs/glossary.md#fp32) conversion, the first use of the loaded values, happens in
# `store_tile`, after the arithmetic.

# %%
lesson.show_source(phase.make_pipeline_functions)

# %% [markdown]
# What changed in the kernel body, as a diff against the single-buffered kernel of phases 03 and 04:
# a prologue that loads tile 0, the `stage` index that flips between the two buffers, the prefetch
# and store calls placed around the arithmetic, and one barrier per tile.

# %%
lesson.show_diff(p03_warp_shuffle.build_kernel, phase.build_kernel)

# %% [markdown]
# ## Is it correct?
#
# The sequence tails matter more here: the last tile must not prefetch past the end, and the
# first tile comes from the prologue.

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
# The second stage shows in shared memory and occupancy; the prefetch registers show in the
# register count. A thread has at most 255 registers. When a kernel needs more, the assembler
# *[spills](../docs/glossary.md#spill)*: it parks values in [local memory](../docs/glossary.md#local-memory) (`STL` / `LDL` in the [SASS](../docs/glossary.md#sass)), memory that is private to
# the thread but lives in DRAM behind the [L1](../docs/glossary.md#l1-cache) cache. The report below says whether this phase
# stays within its registers at D = 64.

# %%
lesson.machine_code()

# %%
lesson.ptx(["ld.global", "cvt.f32.f16", "st.shared", "ld.shared", "bar.sync"], max_lines=16)

# %%
lesson.sass(["LDG", "STS", "LDS", "BAR", "STL", "LDL"])

# %%
lesson.bank_conflicts()

# %% [markdown]
# ## Exercise
#
# Place the two prefetches: the next K tile before the scores of the current one, the next V tile
# before the softmax and `p · v`. Only when there is a next tile, and into the registers that
# `store_tile` later writes to the other stage.

# %%
lesson.exercise()

# %% [markdown]
# ## The solution
#
# Try the exercise first. These are the lines the phase itself has in each region; the listings
# above show the regions empty, as your stub has them.

# %%
lesson.show_solution()

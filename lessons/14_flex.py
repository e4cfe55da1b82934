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
# # Phase 14 — Your own attention: score_mod and mask_mod in the kernel, block-sparse
#
# *Previous: [07 mma.sync](07_mma_sync.ipynb), whose kernel this phase changes; the causal mask and
# the tiles it skips are [01](01_naive.ipynb) and [07](07_mma_sync.ipynb)'s. Hardware background:
# [docs/hardware.md](../docs/hardware.md). Course map: [README](README.md).*
#
# ## The idea
#
# Models rarely run plain attention. Mistral and Gemma let a row see only the last few thousand
# keys (a *sliding window*); Gemma 2 bends large scores towards a cap (*soft-capping*); ALiBi adds a
# bias that grows with the distance between row and key; a training batch packs several documents
# into one sequence, and a row must not see another document's keys. Each of these changes one of
# two things, for one (query row, key) pair at a time:
#
# - the **score** before the softmax: `score_mod(score, b, h, q_idx, kv_idx) -> score`;
# - whether the row **sees** the key at all: `mask_mod(b, h, q_idx, kv_idx) -> bool`.
#
# These are torch's FlexAttention conventions. Each is a small Python function of scalars, the way
# a kernel thread sees one element: the batch `b`, the query head `h`, the row `q_idx` and the key
# `kv_idx`. A mod that needs data (ALiBi's slopes, each token's document id) takes arrays as trailing
# parameters; `flex.score_mod(fn, slopes)` binds them.
#
# **1. The mods inside the kernel.** Numba compiles a plain Python function as a
# [device function](../docs/glossary.md#device-function) and inlines it where it is called. Phase
# 14's kernel is phase 07's with one call after S = Q·Kᵀ: each score of the tile goes through
# `score_mod`, in registers, where the score already is. No score matrix is ever written to memory,
# and no graph compiler is involved. The bound arrays are arguments of the kernel, so new slopes or
# new document ids need no new compile.
#
# **2. The units.** The kernel keeps its scores multiplied by qk_scale = scale · log2 e, so that the
# softmax can use `exp2`. A mod is written for the scaled score, as FlexAttention's are, so the
# kernel converts each score to the mod's units before the call and back after it.
#
# **3. The mask, per tile.** Calling `mask_mod` on every element would cost as much as the scores
# themselves, and would still compute the tiles no row sees. So the mask is looked at once per tile
# of BLOCK_M rows by BLOCK_N keys, before any kernel runs, into a
# [block mask](../docs/glossary.md#block-mask) (`flex.create_block_mask`): a tile is
# *empty* (no row sees any of its keys), *full* (every row sees every key) or *partial*. The kernel's
# loop over key tiles walks a list of the non-empty ones: an empty tile is never loaded, a full tile
# runs no mask code at all, and only a partial tile calls `mask_mod` per element, giving a hidden
# key the score -inf. The work follows what the mask leaves: a window of 1024 keys over 32768 costs a
# sixteenth of causal attention.
#
# The plain causal path (`attention(causal=True)`) stays the fast path; here causal is one mask_mod
# among others.

# %%
# Where the kernels run is decided before numba.cuda is first imported: on the CUDA GPU when the
# driver shows one, else in Numba's CUDA simulator on the CPU. Set NUMBA_ENABLE_CUDASIM to choose.
import os

if "NUMBA_ENABLE_CUDASIM" not in os.environ:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if os.path.exists("/dev/nvidiactl") else "1"

# %%
import numpy as np

from flashcore_numba import flex
from flashcore_numba.course import notebooks
from flashcore_numba.phases import p07_mma_sync
from flashcore_numba.phases import p14_flex as phase

lesson = notebooks.Lesson("14")
lesson.intro()

# %%
lesson.changelog()

# %% [markdown]
# ## Mods are Python functions
#
# The built-in mods live in the phase's module, written exactly as you would write your own. Two of
# them are your exercise (shown empty here, as your stub has them): the sliding window's mask and
# the soft-cap's score. A mod is checked before anything runs: its parameters, and one call on
# sample indices, which must give a bool for a mask and a number for a score.

# %%
lesson.show_source(phase.causal_mod, phase.sliding_window_mod, phase.document_causal_mod, phase.softcap_mod,
                   phase.alibi_mod)

# %% [markdown]
# Writing your own takes one function. Here, a mask where every head sees a window of its own width
# (wider for later heads), with the widths in a bound array:

# %%
def head_window(b, h, q_idx, kv_idx, widths):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= widths[h])


widths = np.array([16, 64], np.int32)
mine = flex.mask_mod(head_window, widths)
print(flex.mask_matrix(mine, 0, 1, 8, 8).astype(int))  # head 1, the first 8 rows and keys

# %% [markdown]
# ## A mask and its tiles
#
# Three masks over 256 rows and keys, at tiles of 32 × 32. The black dots are the (row, key) pairs a
# row sees; the colour under them is each tile's kind. Only the coloured tiles are computed, and only
# the orange ones call `mask_mod`.

# %%
documents = np.repeat(np.arange(4), [40, 90, 70, 56]).astype(np.int32)
notebooks.draw_block_masks({"sliding window of 48": flex.sliding_window(48),
                            "4 documents, causal": flex.document_mask(documents),
                            "prefix LM (64)": flex.prefix_lm(64)})

# %% [markdown]
# ## The kernel, beside phase 07's
#
# The diff of the two kernels' `attend`: the loop over key tiles walks the block mask's list
# (KV_COUNT, KV_INDEX) instead of a range, and after S = Q·Kᵀ one call, `apply_mods`, runs the mods
# on the tile. Phase 07's online softmax is untouched (it still masks the keys past the sequence).

# %%
lesson.show_diff(p07_mma_sync.build_kernel, phase.build_kernel)

# %% [markdown]
# `apply_mods`: `score_mod` on every score of the tile, in the mod's units; then, in a partial tile
# only, `mask_mod`, with -inf for the keys a row must not see. Each is unrolled over the tile's
# n-tiles, so that the scores stay in registers.

# %%
lesson.show_source(phase.make_apply_mods)

# %% [markdown]
# ## On Hopper: the same mods in phase 09's kernel
#
# Phase 07's kernel is the one to read, and it runs on any GPU. On an H100, `flex_attention` puts
# the same mods into phase 09's kernel instead: the TMA producer and the wgmma consumers of
# [lesson 09](09_warp_specialized.ipynb). Phase 09 keeps a seam for it, `Walk`: which key tiles a
# query block visits (`listed`, `tile_at`) and what happens to a tile's scores before the softmax
# (`apply`). Phase 09's own walk visits tiles 0 .. n - 1 and leaves the scores alone, and compiles to
# nothing. Phase 14's walks the block mask's list, in the producer (which tiles to load into the
# ring) and in each consumer (which tiles to compute), and runs `apply_mods` above on each consumer
# warpgroup's S: 64 rows, one 16-row m-tile a warp, the same accumulator layout as phase 07's. The
# list puts the full tiles first, so that they run in phase 09's loop without masking, where the
# mask pass is compiled out, and the partial ones after them (`hopper_lists`). At
# D = 64 it runs two consumer warpgroups, not phase 09's three: the mods' indices and arrays need
# the registers.

# %%
lesson.show_source(phase.make_walk)

# %% [markdown]
# ## Gradients through the mods
#
# Training needs dQ, dK and dV. The backward recomputes each tile's scores as
# [lesson 11](11_backward.ipynb) does, and the mods must meet those scores exactly as they met the
# forward's: the same `score_mod` on each score, the same `mask_mod` hiding the same keys. Then one
# step more. The softmax's gradient is by the *modded* score s' = score_mod(s); the products want it
# by the raw score s, so the chain rule multiplies dS by d s' / d s. torch's FlexAttention gets that
# derivative by tracing the mod's graph; here the mod's author writes it, a function of the same
# parameters: `flex.score_mod(fn, *arrays, grad=fn_grad)`. Soft-capping's is 1 − tanh²(s / cap),
# a bias's (ALiBi's) is 1; a score mod without one is refused by name when gradients are asked for.
# Phase 11 keeps a seam for it (`p11.Scores`, compiled out of its own kernel) and
# `phase.build_backward` puts the mods there. The oracle below is the same backward in float64,
# checked in the tests against the output's own finite differences.

# %%
from flashcore_numba.reference import reference_flex_gradients

lesson.show_source(phase.softcap_grad)
rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((1, 1, 6, 8)) for _ in range(4))
dq, dk, dv = reference_flex_gradients(q, k, v, do, score_mod=flex.softcap(2.0), mask_mod=flex.causal_mask())
print("dq of the first row (it sees only key 0, so its softmax is 1 and its gradient 0):", dq[0, 0, 0])

# %% [markdown]
# ## Is it correct?
#
# Fresh random inputs and mods (a window with tails and grouped heads, ALiBi with documents per batch,
# a soft-cap at large scores with a prefix-LM mask), the output poisoned with NaN first, against the
# float64 oracle applying the same mods.

# %%
lesson.check()

# %% [markdown]
# ## How fast is it?
#
# Beside torch's FlexAttention (torch.compile'd, with its own block mask) on the same masks, and
# causal written as a mask_mod beside `attention(causal=True)`, where a record has the rows
# (`flashcore bench --flex`). On an H100 the rows `14 ...` are the build `flex_attention` runs there:
# phase 09's kernel with the mods.

# %%
timings = lesson.timing()

# %%
lesson.plot_timing(timings)

# %% [markdown]
# ## What changed in the machine code
#
# Phase 07's kernel and this one with the lesson's mods (soft-cap and a sliding window) compiled in,
# for the H100. The mods are inlined: the window's comparisons are a few `setp` per score (the count
# doubles), and `math.tanh` is libdevice's `tanhf`, built from `ex2` (whose count doubles too), not
# the hardware's `tanh.approx`: accurate, and a dozen instructions a score, which the records show
# (the soft-cap case is the slowest). The registers the mods take are the few phase 07 had left.

# %%
lesson.machine_code()

# %%
lesson.ptx(["mma.sync", "cp.async.cg", "tanh.approx", "ex2.approx", "setp.", "bar.sync"])

# %%
lesson.sass(["HMMA", "LDGSTS", "MUFU.TANH", "MUFU.EX2", "BAR.SYNC", "STL", "LDL"])

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

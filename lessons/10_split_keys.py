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
# # Phase 10 — Split keys: one decode step across many blocks, merged by the log-sum-exp
#
# *Previous: [09 warp_specialized](09_warp_specialized.ipynb), though this phase builds on
# [07 mma.sync](07_mma_sync.ipynb). Hardware background: [docs/hardware.md](../docs/hardware.md).
# Course map: [README](README.md).*
#
# ## The idea
#
# Phases 01-09 made one kind of problem fast: many query rows against many keys (a model reading a
# prompt). A model that *writes* text calls attention once per new token, with **one query row** per
# sequence (S_q = 1) against every key it has so far (S_k in the thousands). That is a decode step.
#
# **1. One row leaves the GPU idle.** Phases 07-09 give each [block](../docs/glossary.md#block) 128 query rows of one head. At
# B = 1, H = 16, S_q = 1 that is 16 blocks, each using 1 of its 128 rows, on an H100 with 132
# [SMs](../docs/glossary.md#sm): 116 SMs have nothing to do, and each busy block reads its head's whole K and V alone.
#
# **2. The work is reading K and V.** A decode step reads K and V once (2 · B · H_kv · S_k · D · 2
# bytes) and does about 4 · B · H · S_k · D FLOPs: one FLOP per byte read. The GPU could do about
# 300 FLOPs in the time it reads a byte from [HBM](../docs/glossary.md#hbm), so the time of a decode step is the time to read K
# and V, and only many blocks reading at once, on every SM, reach the memory's bandwidth.
#
# **3. Split the keys.** Phase 10 cuts the keys of each head into ranges of whole [tiles](../docs/glossary.md#tile) and runs
# them on many blocks at once ([split keys](../docs/glossary.md#split-keys)): each block takes a share of the keys, and each of its
# four [warps](../docs/glossary.md#warp) a range of that share. Each warp runs phase 07's loop on its range and ends with a
# partial answer: its output o_s = acc / l_i, normalized over its own keys, and its
# [log-sum-exp](../docs/glossary.md#log-sum-exp) lse_s = m_i + log2(l_i), the log of its softmax denominator.
#
# **4. Merge by the log-sum-exp.** The whole row's denominator is the sum of the ranges'
# denominators, so lse = log2(Σ_s 2^lse_s), and range s contributes its output with weight
# 2^(lse_s − lse): o = Σ_s 2^(lse_s − lse) · o_s. The weights add up to 1. It is the
# [online softmax](../docs/glossary.md#online-softmax) again, applied to whole ranges instead of
# single tiles, and like it, the order does not matter.
#
# **5. The block merges its warps, then the last block merges the blocks, as a tree.** No second
# kernel. Every warp leaves its partials in its own shared memory, over its Q tile and the start of
# its first stage. Its lanes must all be done reading those before any lane writes there: a
# `cuda.syncwarp()` (the [barrier](../docs/glossary.md#barrier) of one warp) stands in between. The loop's own syncwarp comes
# before each tile's reads, not after the last tile's, and a warp with no keys runs no loop at all.
# A [shuffle](../docs/glossary.md#warp-shuffle) would not do: it waits for the lanes but orders no memory. (Compute-sanitizer's
# racecheck found the missing syncwarp: `docs/sanitizer/`.) After a barrier the block merges its
# four into one, a partial of its own with its own log-sum-exp, in a small float32 workspace.
# Then the block makes it visible to the whole GPU (a [memory fence](../docs/glossary.md#memory-fence), `cuda.threadfence()`) and
# adds 1 to a counter with an [atomic](../docs/glossary.md#atomic) addition. The blocks count in teams of 16: the block of a team that gets back 15 (or
# the team's size − 1) knows every other member has written and fenced its partial. It merges
# them into the team's first slot and sets the counter back to 0 for the next call. Teams of
# teams would merge the same way (merging merges is still the same merge, step 4); on an H100 the
# decode shapes here need one team per row tile: at most 16 blocks of 4 warps.
#
# **6. A group's query heads share one tile.** With grouped-query attention, the H / H_kv query
# heads of a group read the same K/V head. Their rows lie one after another in memory, so the kernel
# packs them into one tile of 16 rows ("packed rows": row p is query row p % S_q of head
# h_kv · group + p // S_q). Each K/V byte read serves the whole group, where phases 07-09 read it
# once per query head.
#
# The tile of 16 rows is one m-tile of one warp. Each warp has its own copy of the tile and its own
# three stages of K and V: four warps fill an SM's shared memory, so a block is one SM's work. The
# tensor cores waste most of the 16 rows on padding at S_q = 1; they are not the bottleneck here.
#
# How many blocks: as many as fill the GPU in one wave (an SM holds one; part of a second wave would
# double the time), at least four tiles per warp (a range has fixed costs: loading Q, waiting for
# its first tile), at most 256 ranges. Why blocks of four warps and not one warp alone, several to
# an SM: the last merges were the kernel's tail (docs/tuning/10_history.md); a block of four merges its
# own warps within the SM and leaves a quarter of the partials to merge across the GPU.

# %%
# Where the kernels run is decided before numba.cuda is first imported: on the CUDA GPU when the
# driver shows one, else in Numba's CUDA simulator on the CPU. Set NUMBA_ENABLE_CUDASIM to choose.
import os

if "NUMBA_ENABLE_CUDASIM" not in os.environ:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if os.path.exists("/dev/nvidiactl") else "1"

# %%
from flashcore_numba.course import notebooks
from flashcore_numba.phases import p10_split_keys as phase

lesson = notebooks.Lesson("10")
lesson.intro()

# %%
lesson.changelog()

# %% [markdown]
# ## Why one query row leaves most SMs idle
#
# The blocks each phase launches for one decode step, computed from the kernels' own grids (and
# phase 10's split rule for an H100): first 16 heads without grouping, then 32 query heads sharing
# 8 K/V heads.

# %%
print(notebooks.table(notebooks.decode_blocks((1, 16, 1, 128), kv_heads=16, seq_k=4096),
                      [(c, c) for c in ("phase", "block_m", "blocks", "rows used", "reads of each K/V head",
                                        "SMs busy")]))
print(notebooks.table(notebooks.decode_blocks((1, 32, 1, 128), kv_heads=8, seq_k=8192),
                      [(c, c) for c in ("phase", "block_m", "blocks", "rows used", "reads of each K/V head",
                                        "SMs busy")]))

# %% [markdown]
# ## The chunks and the merge
#
# One row tile of one K/V head: its key tiles cut into ranges, one warp each (four warps a block);
# each warp's partial result; the merge by the block, then by whichever block finishes last.

# %%
notebooks.draw_split_keys()

# %% [markdown]
# The merge is the only new arithmetic. Here it is in NumPy on random partials, against the softmax
# of all keys at once: two ranges of keys, each softmaxed on its own, merged by their log-sum-exps.

# %%
import numpy as np

rng = np.random.default_rng(0)
scores, values = rng.standard_normal(1000) * 3, rng.standard_normal((1000, 4))
whole = np.exp2(scores - scores.max()) @ values / np.exp2(scores - scores.max()).sum()
partials = []
for keys in (slice(0, 300), slice(300, 1000)):  # two splits
    s, v = scores[keys], values[keys]
    m = s.max()
    l = np.exp2(s - m).sum()
    partials.append((np.exp2(s - m) @ v / l, m + np.log2(l)))  # o_s, lse_s
lse = np.log2(sum(np.exp2(lse_s) for _, lse_s in partials))
merged = sum(np.exp2(lse_s - lse) * o_s for o_s, lse_s in partials)
print("merged:", merged.round(6), "\nwhole: ", whole.round(6))

# %% [markdown]
# ## The kernel
#
# Straight from the package: what runs is what you read.

# %%
lesson.show_source(phase.split_count, phase.make_splits)

# %% [markdown]
# The kernel itself: phase 07's loop on each warp's 16 packed rows and range of keys (three
# stages of K and V, two tiles in flight), then the partials, the count and the merge.
#
# One thing in it is laid out differently from phase 07: the rows of shared memory. Phase 07 pads
# each row by 8 elements so that the eight rows one `ldmatrix` reads start in different banks
# (lesson 04's trick). Phase 10 keeps rows of exactly D elements and
# [swizzles](../docs/glossary.md#swizzle) them instead: the 16-byte chunk c of row r is stored at
# chunk c XOR (r mod 8). The eight rows still land in eight different banks, and every row now
# starts on a 128-byte line, so a warp's `cp.async` of 512 bytes (two rows at D = 128, four at
# D = 64) is exactly the 16 sectors it reads rather than a copy split across lines. In phase 07 a
# tile's copy is a small part of its work beside the tensor cores' products; a decode step does
# little besides copying, and the swizzled rows made it 4-6 % faster at every decode shape
# measured (`at` in the source below, `split_layout` in the module; docs/tuning/10_history.md).
#
# Two more things in the key loop are not phase 07's, and they have one reason. An SM here runs
# four warps, one on each of its four schedulers, so a warp that waits for its own last
# instruction (an `mma.sync` whose result the next one adds to, a shuffle, an `exp2`) has no other
# warp to hand its turn to: Nsight Compute found phase 10's kernel 12 µs longer than a kernel
# that only reads the same K and V, while cuDNN's, doing attention, was not
# (docs/tuning/10_history.md). So the loop was made shorter to wait on:
#
# - **q · kᵀ in two chains.** At D = 128 each score is a sum over 8 k-steps, and each step's
#   `mma.sync` adds to the result of the one before. Summed as two halves of the head dim (`qk_half`
#   twice, into `s` and `s_hi`, added at the end), each chain is 4 steps long and the two overlap.
# - **The maximum moves only by more than 2^8.** The online softmax of lesson 01 rescales `acc`
#   and `l_i` by alpha = 2^(m_old - m_new) after every tile, even when alpha is 1. Here a warp vote
#   (`cuda.any_sync`) rescales only when some row's new scores pass its `m_i` by more than
#   `RESCALE_MARGIN` = 8; otherwise `m_i` stays, and the tile's p = 2^(s - m_i) may be as large as
#   2^8 = 256, which fp16 and bf16 hold. `acc`, `l_i` and the log-sum-exp are all measured against
#   the same `m_i`, so the result is the same: `m_i` only has to be *a* reference close to the
#   largest score, not the largest score itself.
#
# Together, 53.4 -> 50.5 µs at 32768 keys on an H200 (docs/tuning/10_history.md).
#
# What was tried after that, and did not help, teaches as much (docs/tuning/10_history.md, each
# a copy of this kernel timed against it in one run): fewer instructions a tile, the next tile's
# q · kᵀ issued before this tile's softmax, the softmax of the padding rows skipped (a decode step
# fills 4 of the tile's 16 rows), more of K and V asked for ahead of time, into L2 (0.8-2.3 µs
# slower at 32768 keys), and cuDNN's own shape of the work, two smaller blocks on each SM (4-7 µs
# slower: twice the blocks, and twice the partials to merge, for the same bytes). On the GPU's clock, between its first tile and its last, the kernel reads K and V at the
# pace of a plain copy: once the loop keeps up with the memory, the work around the copies no
# longer sets the time. What is left is how the one wave of blocks starts and ends (about 5 µs
# before the first tiles land, and the blocks' loops ending over 10 µs), where cuDNN is still
# 1-2 µs ahead.

# %% [markdown]
# The kernel, as the algorithm reads: `build_kernel`'s `attend` is one block's work (its rows and its
# warps' ranges of keys, the prologue, phase 07's loop over the tiles, each warp's partial, the merge),
# and each step is a role of its own, below it.

# %%
lesson.show_source(phase.build_kernel)

# %% [markdown]
# The roles: the copies (from a head, or from a KV cache's pages), the products and the softmax of a
# tile (phase 07's, for one warp of 16 rows), a warp's partial, and the merge of the partials as a tree.

# %%
lesson.show_source(phase.make_loads, phase.make_products, phase.make_softmax_tile)

# %%
lesson.show_source(phase.make_partial, phase.make_merge)

# %% [markdown]
# ## Is it correct?
#
# Fresh random inputs, the output poisoned with NaN first, compared with the float64 reference.

# %%
lesson.check()

# %% [markdown]
# ## How fast is it?
#
# At a decode shape, not the course's usual one: 32 query heads sharing 8 K/V heads, one query row,
# 8192 keys. The time is what counts here: the TFLOPS of a decode step are small by nature.

# %%
timings = lesson.timing()

# %%
lesson.plot_timing(timings)

# %% [markdown]
# ### When the batch alone fills the GPU: the variant "batch"
#
# A server decodes many sequences at once. At B = 64 with 8 K/V heads a step has 512 row tiles, more
# than an H100's 132 SMs, so `split_count` splits nothing: one block a row tile, its four warps each
# on a quarter of the keys. Four warps with three stages each fill an SM's shared memory, so such a
# block runs alone on its SM: while it waits for its first tiles, and while it merges its warps'
# partials, nothing else there reads memory. Built with two warps a block (`BATCH_WARPS`), two blocks
# share each SM and each warp's range of keys is twice as long; one block's waits are the other's
# reading time. It is the same kernel (`build_kernel`'s `warps`), a variant of the phase, and
# `attention(phase="best")` and `attention_kvcache` run it where the row tiles are at least the SMs.
# At this lesson's single sequence it would split the keys further and run slower (the timing above,
# where it was measured); the serving table in [docs/performance.md](../docs/performance.md) has the
# batches, and the [tuning history](../docs/tuning/10_history.md) ("Two warps a block") the A/B of
# seven tile shapes that chose it.

# %%
lesson.show_source(phase.row_tile_count, phase.batch_fills_gpu, phase.build)

# %% [markdown]
# ## What changed in the machine code

# %%
lesson.machine_code()

# %%
lesson.ptx(["mma.sync", "cp.async", "membar.gl", "atom.global.add", "ex2.approx"])

# %%
lesson.sass(["HMMA", "LDGSTS", "MEMBAR", "ATOMG", "RED", "MUFU.EX2", "STL", "LDL"])

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

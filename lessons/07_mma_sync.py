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
# # Phase 07 — FlashAttention-2: mma.sync fragments in registers
#
# *Previous: [06 WMMA](06_wmma.ipynb). Hardware background:
# [docs/hardware.md](../docs/hardware.md#tensor-cores-phases-06-09). Course map: [README](README.md).*
#
# ## The idea
#
# Phase 06 put the matrix products on the [tensor cores](../docs/glossary.md#tensor-core) but kept everything else in [shared memory](../docs/glossary.md#shared-memory):
# S was stored, read back for the softmax, P written, O stored and read again. [WMMA](../docs/glossary.md#wmma) left no choice,
# because [PTX](../docs/glossary.md#ptx) does not say which [lane](../docs/glossary.md#lane) holds which element of a WMMA [fragment](../docs/glossary.md#fragment). `mma.sync` does say,
# and that changes the whole [kernel](../docs/glossary.md#kernel): every value of the loop can now stay in
# [registers](../docs/glossary.md#register). The ideas one at a time:
#
# **1. Q in registers.** [`ldmatrix`](../docs/glossary.md#ldmatrix) reads the [warp](../docs/glossary.md#warp)'s query rows into A fragments once, before the loop
# over K/V [tiles](../docs/glossary.md#tile). What it buys: Q is no longer read from shared memory for every tile.
#
# **2. S = Q·Kᵀ in registers.** One `mma.sync.m16n8k16` computes 16 rows × 8 keys over 16 dims; K's
# fragments are read by `ldmatrix`, four 8×8 matrices per instruction. The scores land in the
# registers of the warp's lanes and never go to shared memory.
#
# **3. The softmax on the fragments.** A lane holds two rows (g and g + 8) of every 8-key tile, and
# the four lanes of a [quad](../docs/glossary.md#quad) together hold the whole row. So a row's max and sum are two
# [shuffles](../docs/glossary.md#warp-shuffle) each: no shared memory, no [barrier](../docs/glossary.md#barrier).
#
# **4. P stays in registers.** The [accumulator](../docs/glossary.md#accumulator) layout of two adjacent 8-key tiles *is* the A-fragment
# layout of one 16-key step (the picture below shows it). Packing pairs of [fp32](../docs/glossary.md#fp32) values into fp16x2 is
# the whole conversion from S to P.
#
# **5. O += P·V in registers.** V's fragments are read by `ldmatrix.trans`, and the product adds straight
# into `acc`, which leaves registers only at the very end.
#
# **6. [cp.async](../docs/glossary.md#cpasync).** K and V are copied global → shared without passing through registers, into the
# other of two stages while the current tile is computed; rows past the end are zero-filled by the
# copy. What it buys: the registers phase 05 spent carrying the next tile are free for fragments.
#
# **7. Two m-tiles per warp.** As in FlashAttention-2, a warp owns 32 query rows: two 16-row
# *m-tiles* (`M_TILES` in the code). Every K or V fragment that `ldmatrix` brings then feeds two
# `mma`s instead of one, which halves the shared-memory reads per product, and the two m-tiles' work
# is independent, so the warp scheduler can interleave it. In the code every fragment and every
# row's m_i and l_i has an index `[mt]`. A [block](../docs/glossary.md#block) is FlashAttention-2's: 128 rows in 4 warps.
#
# The price is registers: fitting both m-tiles into a [thread](../docs/glossary.md#thread)'s 255 took some care, and the
# details (what [spilled](../docs/glossary.md#spill), what had to be [unrolled](../docs/glossary.md#unrolling)) are in the [appendix](#appendix-tuning-notes). This notebook's
# [simulator](../docs/glossary.md#simulator) runs one warp of two m-tiles.
#
# **8. A lazy running max.** When a row's max grows, acc and l_i are rescaled by
# alpha = exp2(m_old − m_new): one multiply per accumulator, 64 per thread and tile at D = 128, for
# a factor that is 1 in almost every tile once the first tiles have set the max. So the warp votes
# (`cuda.any_sync`) and rescales only when one of its rows' max has grown by more than 8 (log2
# units). Until then m_i is stale and p = exp2(s − m_i) may reach 2^8 = 256. That is harmless:
# acc and l_i are measured against the same m_i, and o = acc / l_i does not depend on it.
#
# Every instruction is one inline PTX function from [`ptx/`](../ptx/) (no call: phase 06 measured
# what a call costs).

# %% [markdown]
# ## Where the data lives: phase 06 against phase 07
#
# Each line is one of attention's matrices and its path from HBM (the GPU's main memory) to where it
# is computed on. Lines marked `*` take a new path in this phase.
#
# ```text
#           phase 06: WMMA                       phase 07: mma.sync
# * Q       HBM -> shared                        HBM -> shared -> registers (ldmatrix, once;
#                                                at D = 128 again per k-step, see the appendix)
# * K, V    HBM -> registers -> shared           HBM -> shared by cp.async (2 stages)
#           (2 stages)                           -> registers by ldmatrix, per product
# * S       tensor cores -> shared (fp32)        tensor cores -> registers (fragments)
# * P       shared (fp16)                        registers: S's fragments packed to fp16
# * O       tensor cores -> shared -> acc        tensor cores add into acc in registers
#           acc / l_i -> HBM                     the same
# ```
#
# One K/V tile through one warp in phase 07. Below the dashed line everything is in the warp's
# registers; the only shared-memory traffic left is `ldmatrix` reading K and V.
#
# ```text
#   HBM K, V --cp.async--> shared K, V   (tile j+1 lands in the other stage while j is used)
#                             | ldmatrix           | ldmatrix.trans
#   - - - - - - - - - - - - - | - - - - - - - - - -| - - - - - - - - - - - - - - - - - - -
#                             v                    v
#   Q frags --> [tensor cores] S --> softmax --> P frags --> [tensor cores] acc += P·V
#                                (quad shuffles)
# ```

# %%
# Where the kernels run is decided before numba.cuda is first imported: on the CUDA GPU when the
# driver shows one, else in Numba's CUDA simulator on the CPU. Set NUMBA_ENABLE_CUDASIM to choose.
import os

if "NUMBA_ENABLE_CUDASIM" not in os.environ:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if os.path.exists("/dev/nvidiactl") else "1"

# %%
from flashcore_numba.course import notebooks
from flashcore_numba.phases import p06_wmma
from flashcore_numba.phases import p07_mma_sync as phase

lesson = notebooks.Lesson("07")
lesson.intro()

# %%
lesson.changelog()

# %% [markdown]
# ## Fragments: which lane holds what
#
# The layouts the PTX ISA documents for `mma.sync.m16n8k16`, drawn from the same formulas the
# simulator's emulation ([`arch/sim_mma.py`](../flashcore_numba/arch/sim_mma.py)) uses; a GPU test
# checks them against the hardware. Compare C (right) with A (left): the accumulators of two 8-column
# tiles, side by side, are exactly the registers of one 16-column A fragment.

# %%
notebooks.draw_mma_fragments()

# %% [markdown]
# ## The pipeline
#
# Two shared-memory stages: while the warps compute on tile j, `cp.async` brings tile j + 1 into the
# other stage; one `cp.async.wait_group 0` and one barrier per tile. The picture is phase 05's, and so
# is the idea; what changed is that the copies no longer pass through registers.

# %%
notebooks.draw_pipeline()

# %% [markdown]
# ## The kernel
#
# The PTX it is built from, one instruction per function:

# %%
lesson.show_ptx("mma_sync.ptx", "flashcore_mma_f16")

# %%
lesson.show_ptx("ldmatrix.ptx", "flashcore_ldmatrix_x4")

# %% [markdown]
# The copy of a tile by `cp.async`. A tile is 16-byte chunks; thread t copies chunk t % LANES of
# every ROWS_PER_PASS-th row (LANES is the row's chunks, CHUNKS, rounded up to a power of two: they
# differ at head dims such as 96, see the [appendix](#appendix-tuning-notes)). Only the last tile of a sequence can reach past its end, so only that
# tile checks each row (and zero-fills the rows past the end). Every other tile takes the first
# branch, where a thread's copies sit at fixed offsets from one address and the copy instruction adds
# the offset itself. Why that split matters: [appendix](#appendix-tuning-notes).

# %%
lesson.show_source(phase.make_copy_tile)

# %% [markdown]
# The kernel, as the algorithm reads: `build_kernel`'s `attend` is one block's work (the prologue
# that loads Q and the first tile, the loop over K/V tiles, the epilogue), and each step it calls is
# a role of its own, below it. Against phase 06, whose kernel was one function:

# %%
lesson.show_diff(p06_wmma.build_kernel, phase.build_kernel)

# %% [markdown]
# The roles. The products (ideas 1, 2 and 5: Q's fragments, S = Q·Kᵀ, O += P·V, one `mma.sync`
# at a time, the k-steps unrolled when the kernel is built):

# %%
lesson.show_source(phase.make_products)

# %% [markdown]
# The online softmax of a tile (ideas 3 and 4), on the fragments; and the epilogue:

# %%
lesson.show_source(phase.make_softmax_tile, phase.make_epilogue)

# %% [markdown]
# The fragment helpers the softmax calls are written once, in
# [`phases/common.py`](../flashcore_numba/phases/common.py), and phases 08 to 10 call the same ones:
# the mask of a tile, this lane's part of the rows' maxima, exp2 with the rows' sums, the rescale of O.

# %%
from flashcore_numba.phases import common

lesson.show_source(common.mask_scores, common.row_max, common.make_exp_and_sum, common.rescale_rows)

# %% [markdown]
# One argument is new at the end of the diff: `LSE`. When a caller asks for it
# (`attention(q, k, v, return_lse=True)`), the kernel also writes each row's
# [log-sum-exp](../docs/glossary.md#log-sum-exp), `(m_i + log2 l_i) · ln 2`: the log of the row's
# softmax denominator, which it holds anyway at the end. Two results over different keys merge
# through it, and a backward pass recomputes the probabilities from it. Otherwise `LSE` is an empty
# array and the kernel writes nothing there.

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
# ## Against FlashAttention-2
#
# torch SDPA's flash backend (in the plot above) is FlashAttention-2 itself, and phase 07 runs its
# layout: the committed records put the two level at D = 128 and phase 07 ahead at D = 64 (README,
# docs/bench/).
#
# In plain words, what held phase 07 back before idea 7: the tensor cores were fast enough that
# shared memory could barely feed them. With one m-tile per warp, every warp read whole K and V tiles
# for just 16 rows. Two m-tiles per warp read each fragment once for 32 rows, half the traffic. The
# counts from the profiler that showed it, and the register trouble on the way, are in the
# [appendix](#appendix-tuning-notes).
#
# Phase 08 goes further at the root: `wgmma` reads its B operand from shared memory once for the 64
# rows of a whole [warpgroup](../docs/glossary.md#warpgroup).

# %% [markdown]
# ## What changed in the machine code
#
# The phase promises that every fragment lives in registers: no spill, no [stack frame](../docs/glossary.md#stack-frame).

# %%
lesson.machine_code()

# %%
lesson.ptx(["mma.sync", "ldmatrix", "cp.async", "shfl.sync.bfly", "ex2.approx", "st.shared"], max_lines=16)

# %%
lesson.sass(["HMMA", "LDSM", "LDGSTS", "SHFL", "MUFU.EX2", "STL", "LDL"])

# %% [markdown]
# ## Exercise
#
# Two places where the fragment layout does the work: the row maximum over the quad of lanes that
# hold a row (07-a), and P's A fragments built from S's accumulators (07-b).

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
# ### Registers for two m-tiles per warp
#
# At D = 64 Q's fragments stay in registers (242 in all, 64 keys per tile). At D = 128 two m-tiles'
# Q and O fragments would not fit in 255 registers, so Q's are read again from shared memory at every
# k-step (FlashAttention-2's way), and a tile holds 48 keys: with 64 the kernel spills.
#
# Two more things make this layout pay. The k-steps of both products are unrolled when the
# kernel is built, one inlined call per k-step: [NVVM](../docs/glossary.md#nvvm) had left a loop of 16 `mma` per step
# rolled, each waiting on the `ldmatrix` just before it. And a tile's scores are straight-line code
# from the products to one vote per warp: the mask is one branch around the whole tile.
#
# ### Other head dims: how the tiles follow from D
#
# Models use head dims from 32 to 256 (ViTs 40 and 80, Phi-3 96, Gemma 256), and this kernel is
# built for any multiple of 8 up to 256. Two functions decide its tiles. The tiles are laid out for D
# rounded up to a multiple of 32, the extra columns zero; and the tile shape follows from the
# registers, since a lane holds M_TILES x D_TILE / 2 accumulators of O:

# %%
lesson.show_source(phase.tile_head_dim, phase.gpu_tiles)

# %% [markdown]
# The rest adapts by itself: `layout` derives every count from D_TILE, the copy gives a row
# CHUNKS rounded up to a power of two of lanes (at D = 96, 12 chunks and 16 lanes, four idle) and
# copies 0 bytes, which the copy fills with zeros, into the columns past D, and the epilogue stores
# only the output's D columns. On a GPU that runs phase 09, `attention(phase="best")` runs this
# phase at a head dim phase 09 is not built for.
#
# ### The copy's checks
#
# Checking every row of every tile costs more than it looks: at D = 128, before the last tile got a
# branch of its own, the few lines that issue the copies held about 15 % of the time the warps spent
# stalled (Nsight Compute, [docs/tuning/07_history.md](../docs/tuning/07_history.md)).
#
# ### Where the gap to FlashAttention-2 went
#
# torch SDPA's flash backend is FlashAttention-2 itself. Until the layout of idea 7, phase 07 ran 2-16 %
# behind it, and Nsight Compute beside it at D = 128
# ([docs/tuning/07_history.md](../docs/tuning/07_history.md)) said where, once you count the
# shared-memory traffic per tensor-core product. A warp of one m-tile reads a whole K tile and a
# whole V tile for its 16 rows, each of the block's four warps reads the same tiles, and cp.async
# writes them once. That makes 2.2 shared-memory wavefronts (128 bytes each) per m16n8k16 product,
# against FlashAttention-2's 1.3 with two m-tiles per warp. Shared memory serves one wavefront per
# cycle per [SM](../docs/glossary.md#sm), and at the best rate measured for [mma.sync](../docs/glossary.md#mmasync) from Numba (431 [TFLOPS](../docs/glossary.md#tflops), about 1.8 GHz)
# the tensor cores finish a product every 2.2 cycles per SM: the two budgets are equal, and phase
# 07's warps waited on shared memory (short scoreboard: 24 % of the stall samples, against 7 % for
# FlashAttention-2).
#
# Two m-tiles per warp halve that traffic, but at D = 128 they need every register a thread has.
# Built here ([docs/tuning/07_history.md](../docs/tuning/07_history.md)), FlashAttention-2's
# layout first ran level: NVVM had left its k-loop rolled. Unrolled at build time it ran 4-8 %
# faster, and spilled 32 bytes per thread on the GPU with 64 keys per tile; with 48 keys it fit,
# but one assembler or the other spilled at the slightest change. What made it both fit and run
# was the tile's scores as one block of straight-line code: one branch around the mask instead of
# one per score, one vote for the warp's two m-tiles instead of one each. The records now put phase
# 07 level with FlashAttention-2 at D = 128 and ahead of it at D = 64 ([docs/performance.md](../docs/performance.md)).

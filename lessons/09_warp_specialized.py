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
# # Phase 09 — warp specialization: a TMA producer and consumers taking turns
#
# *Previous: [08 wgmma](08_wgmma.ipynb). Hardware background:
# [docs/hardware.md](../docs/hardware.md#tensor-cores-phases-06-09). Course map: [README](README.md).*
#
# ## The idea
#
# In phase 08 every [warpgroup](../docs/glossary.md#warpgroup) did everything: computed the addresses of its share of the next K/V [tile](../docs/glossary.md#tile),
# issued the `cp.async` copies, waited for them, met every other [warp](../docs/glossary.md#warp) at a [block](../docs/glossary.md#block) [barrier](../docs/glossary.md#barrier), multiplied,
# ran the softmax. [Hopper](../docs/glossary.md#hopper) lets a block split those jobs by *role*. This phase has ten ideas, in four
# groups; each is told here in a few lines, and the measurements behind them are in the
# [appendix](#appendix-tuning-notes).
#
# ### Moving the data
#
# **1. [TMA](../docs/glossary.md#tma).** The Tensor Memory Accelerator copies a whole box (here 64 rows × 64 columns, 8 KB)
# from global to [shared memory](../docs/glossary.md#shared-memory) with *one* instruction issued by *one* [thread](../docs/glossary.md#thread). It writes the 128-byte
# [swizzle](../docs/glossary.md#swizzle) phase 08 already reads, and fills rows past the end of the tensor with zeros. It is told
# what the tensor looks like by a **[tensor map](../docs/glossary.md#tensor-map)**, a 128-byte [descriptor](../docs/glossary.md#descriptor) the driver builds on the host.
# What it buys: copying a tile no longer costs the computing warps any instructions.
#
# **2. [mbarriers](../docs/glossary.md#mbarrier).** A TMA copy reports completion by counting its bytes down on a barrier in shared
# memory. A ring of K/V *stages*, each with a "full" barrier (the bytes landed) and an "empty"
# barrier (every consumer is done with it), replaces the block-wide `syncthreads` of phase 08. What
# it buys: no one waits for the whole block, only for the one stage it needs.
#
# ### Splitting the work
#
# **3. [Warp specialization](../docs/glossary.md#warp-specialization).** Warpgroup 0 is the *[producer](../docs/glossary.md#producer-and-consumer)*: one of its threads streams tiles into the
# ring. The other warpgroups are *consumers*: they only wait on "full", compute, and arrive on "empty".
#
# **4. [setmaxnreg](../docs/glossary.md#setmaxnreg).** The producer needs almost no [registers](../docs/glossary.md#register), the consumers need many. A block
# starts with the same count for every thread; the producer gives its registers back, and the
# consumers take them.
#
# ### Keeping the tensor cores busy
#
# **5. Ping-pong.** The consumers take turns at the [tensor cores](../docs/glossary.md#tensor-core), fenced by *[named barriers](../docs/glossary.md#named-barrier)*: while
# one runs its two products, the others run their softmax on the [FP32](../docs/glossary.md#fp32) and exp2 units.
#
# **6. Bigger tiles, P·V in place.** Phase 08's P·V returned a fresh O-sized tile that the [kernel](../docs/glossary.md#kernel)
# then folded into `acc`; here the [wgmma](../docs/glossary.md#wgmma) adds into `acc` itself (its [accumulator](../docs/glossary.md#accumulator) goes in and comes
# out). The registers that saves hold S for 128 keys instead of 64, so every turn, barrier wait and
# drain of the tensor cores is paid once per 128 keys.
#
# **7. Overlap within a warpgroup.** A turn *issues* S = Q·Kᵀ of tile n and P·V of tile n − 1 and
# returns at once. The warpgroup waits for S alone (`wgmma.wait_group 1`), runs its softmax while the
# tensor cores are still adding P·V into O, and only then waits for O (`wait_group 0`). That is what
# the [PTX](../docs/glossary.md#ptx) asks for; what the assembler makes of it is in the appendix.
#
# ### Paying less at the edges
#
# **8. A loop for the masked tiles.** Only the last tiles of a causal row block, or the tile holding
# the end of the keys, need a mask. At D = 128 they run in a loop of their own, and the other tiles'
# softmax is compiled without the masking and its branches. (D = 64 does it differently: appendix.)
#
# **9. [Persistent blocks](../docs/glossary.md#persistent-kernel).** One block per [SM](../docs/glossary.md#sm) instead of one per query block. The producer takes
# the next query block from a counter in [global memory](../docs/glossary.md#global-memory) (an [atomic](../docs/glossary.md#atomic) addition), the longest
# first, and tells the consumers which one it is through a slot of shared memory. Q is released as
# soon as a block's last S is done, so the next block's Q and first K/V tiles are loading while the
# consumers finish and write O. What it buys: a block's start-up and its end are paid once per SM,
# not once per query block.
#
# **10. 16-byte stores of O.** The [epilogue](../docs/glossary.md#epilogue), where a block writes O, had each [lane](../docs/glossary.md#lane) of a [quad](../docs/glossary.md#quad) holding
# 4 bytes of every 8 columns of its row. Stored as they are, that is 32 stores per thread at
# D = 128. Three [shuffles](../docs/glossary.md#warp-shuffle) within the quad transpose the words, so that each lane holds 8 whole
# columns, 16 bytes, which one `st.global.v4.b32` writes: 8 stores per thread.

# %% [markdown]
# ## Where the data lives: phase 08 against phase 09
#
# Each line is one of attention's matrices and its path from HBM (the GPU's main memory) to where it
# is computed on. Lines marked `*` take a new path in this phase.
#
# ```text
#           phase 08: every warpgroup does it all      phase 09: a producer and consumers
# * K, V    HBM -> shared by cp.async: every thread    HBM -> shared by TMA: one thread of the
#           copies its share; a block barrier per     producer copies whole boxes into a ring of
#           tile                                       stages, each with "full" and "empty"
#                                                      mbarriers
# * Q       HBM -> shared by cp.async                  HBM -> shared by TMA, one tile per
#                                                      consumer, with barriers of its own
#   S       tensor cores -> registers (64 keys)        the same, in the consumers (128 keys)
#   P       registers                                  the same
# * O       tensor cores -> a fresh tile -> acc        tensor cores add into acc itself
# * O out   acc / l_i -> HBM, 4 bytes per store        quad shuffles, then 16 bytes per store
# ```
#
# Who moves what in phase 09, one stage s of the ring (the producer on the left, a consumer on the
# right; the tensor cores read K and V where they landed, as in phase 08):
#
# ```text
#   producer (1 thread)                shared memory               consumer warpgroup
#   wait "empty"[s] ---------------->  stage s is free
#   TMA: K, V tile n --- bytes -----> stage s: K, V   ---------->  wait "full"[s]
#                                     "full"[s] counts down        [tensor cores] S = Q·Kᵀ
#                                                                  softmax in registers
#                                                                  [tensor cores] acc += P·V
#                   <------------------------------- arrive "empty"[s]
#   next: stage s + 1 (the ring wraps after STAGES)
# ```

# %%
# Where the kernels run is decided before numba.cuda is first imported: on the CUDA GPU when the
# driver shows one, else in Numba's CUDA simulator on the CPU. Set NUMBA_ENABLE_CUDASIM to choose.
import os

if "NUMBA_ENABLE_CUDASIM" not in os.environ:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if os.path.exists("/dev/nvidiactl") else "1"

# %%
from flashcore_numba.arch import tma
from flashcore_numba.course import notebooks
from flashcore_numba.phases import p08_wgmma
from flashcore_numba.phases import p09_warp_specialized as phase

lesson = notebooks.Lesson("09")
lesson.intro()

# %%
lesson.changelog()

# %% [markdown]
# ## The pipeline as a timeline
#
# A schematic (not measured) picture of one block at D = 128: the producer runs ahead of the consumers,
# as far as the ring lets it (its STAGES stages); the two consumers alternate at the tensor cores. Top:
# the turns alone (`09-turns`): a consumer waits for both its products, then runs its softmax. Bottom:
# with the overlap (`09`): it waits for S only, and its P·V of the previous tile runs under its softmax.

# %%
notebooks.draw_warp_specialization()

# %% [markdown]
# ## The ring and its parities
#
# An mbarrier counts arrivals (and, for TMA, bytes). When the count reaches zero its *phase* completes
# and its phase bit flips; a waiter asks "has the phase of parity p completed?". Tile n uses stage
# `n % STAGES` for the `n // STAGES`-th time, so the consumers wait on "full" with parity
# `(n // STAGES) % 2`. The producer waits on "empty" with the opposite parity: on a fresh barrier the
# phase of parity 1 counts as completed, so the first round of stages is free without anyone arriving.
# The kernel counts the ring position rather than dividing a tile number: `stage`, and `phase`, the
# parity of this use of the stage, which flips each time the ring wraps (`advance`). A persistent
# block counts on across the query blocks it takes, and each consumer's tile of Q gets a pair of
# barriers of its own, "q_full" and "q_empty", used once per query block: a consumer's next Q loads
# as soon as it is done with its own, whatever the other consumers still do.
#
# The functions, from [ptx/tma.ptx](../ptx/tma.ptx) — the TMA load and the wait:

# %%
lesson.show_ptx("tma.ptx", "flashcore_tma_load_3d")

# %%
lesson.show_ptx("tma.ptx", "flashcore_mbarrier_wait")

# %% [markdown]
# and from [ptx/warpgroup.ptx](../ptx/warpgroup.ptx) the register hand-over and the named barriers of
# the turns (its header does the register arithmetic):

# %%
lesson.show_ptx("warpgroup.ptx", "flashcore_setmaxnreg_inc_240")

# %%
lesson.show_ptx("warpgroup.ptx", "flashcore_bar_arrive")

# %% [markdown]
# ## Registers in flight
#
# Between `wgmma.commit_group` and the `wgmma.wait_group` that covers it, the tensor cores are still
# writing the accumulators (and reading P's [fragments](../docs/glossary.md#fragment)). Nothing may touch those registers, not even a
# `mov` that copies them. So the functions that leave a product in flight, the `_issue` functions of
# [ptx/wgmma.ptx](../ptx/wgmma.ptx), are pasted with their registers renamed to the asm operands
# themselves: the wgmma writes straight into the kernel's own registers. The kernel passes those values,
# untouched, to a wait function, whose body waits *before* it reads its parameters. Here is the wait for
# S, then the inline text of the issue of P·V (`$0`… are O, tied in and out; `$32`… are P's fragments):

# %%
lesson.show_ptx("wgmma.ptx", "flashcore_wgmma_wait_s_n128")

# %%
from flashcore_numba.arch import ptx

print(ptx.load("wgmma.ptx")["flashcore_wgmma_pv_acc_issue_d64_n128_f16"].inline_asm()[0][:900], "...")

# %% [markdown]
# [ptxas](../docs/glossary.md#ptxas) checks it too: when an in-flight register is touched on some path, it makes every wgmma of the
# kernel wait for the one before. So the issue and the waits must be on one straight path (the
# appendix tells how a first version missed that).

# %% [markdown]
# The tensor maps are built on the host by `cuTensorMapEncodeTiled` (through cuda-bindings) and cached;
# the layouts TMA cannot describe are refused with the argument named:

# %%
lesson.show_source(tma.head_maps, tma.check_layout)

# %% [markdown]
# ## Writing O sixteen bytes at a time
#
# Numba stores an array element by element: the widest store it emits for O (viewed as packed pairs)
# is 4 bytes. [ptx/store.ptx](../ptx/store.ptx) has the vector store, and the epilogue in
# `phases/common.py` first moves the words where it needs them. In round k every lane sends the word
# that lane t + k needs and receives its own word from lane t − k; `rotate4` picks words by selects,
# since an array indexed by the lane number would live in [local memory](../docs/glossary.md#local-memory).

# %%
lesson.show_ptx("store.ptx", "flashcore_st_global_v4")

# %%
from flashcore_numba.phases import common

lesson.show_source(common.rotate4, common.fragment_epilogue_16b)

# %% [markdown]
# ## The kernel
#
# Each build is described by one frozen `Build`: which of the ideas above it has. Phase 09 has them all,
# and each variant leaves some out, so that every idea keeps its own row in the timings below.

# %%
lesson.show_source(phase.Build)
print(phase.BUILDS)

# %% [markdown]
# Against phase 08's kernel the `cp.async` copies and the block barriers are gone, and the kernel is
# split by role, as FlashAttention-3 splits its own, each role a function you can read alone. First
# the kernel itself: `build_kernel` makes the roles and wires them; its `attend` sets the barriers up
# and hands warpgroup 0 to the producer, the others to the consumer.

# %%
lesson.show_source(phase.build_kernel)

# %% [markdown]
# The producer: the work scheduler (`next_unit`, `query_block`: which query block comes next) and the
# TMA loads of Q, K and V into the ring of stages.

# %%
lesson.show_source(phase.make_scheduler, phase.make_producer)

# %% [markdown]
# A consumer's turns at the tensor cores: tile 0's S alone, then each `turn` (S of tile n and P·V of
# tile n − 1, issued together, then the softmax of tile n while P·V runs on). The softmax of a tile is
# phase 08's, on the same fragment helpers of `phases/common.py`.

# %%
lesson.show_source(phase.make_turns, phase.make_softmax_tile)

# %% [markdown]
# The consumer: query block after query block, its tiles in turns (those no row masks, then those
# that cross the diagonal), the tiles its rows never see passed, the last P·V, the epilogue.

# %%
lesson.show_source(phase.make_consumer)

# %% [markdown]
# ## Is it correct?
#
# In the [simulator](../docs/glossary.md#simulator) the mbarriers, TMA copies (with their zero fill and swizzle) and named barriers are
# emulated ([`arch/sim_tma.py`](../flashcore_numba/arch/sim_tma.py),
# [`arch/sim_warpgroup.py`](../flashcore_numba/arch/sim_warpgroup.py)), so the whole producer/consumer
# protocol runs: a wrong parity deadlocks there too, and the emulation says which barrier is stuck.

# %%
lesson.check()

# %% [markdown]
# ## How fast is it? One row per idea
#
# `09-ws` is the producer and the ring alone, consumers without turns; `09-turns` adds the turns, each
# product awaited before the softmax; `09-overlap` adds the overlap within a warpgroup; `09` runs that
# kernel on the persistent [grid](../docs/glossary.md#grid). Each row is measured in the same run.

# %%
timings = lesson.timing()

# %%
lesson.plot_timing(timings)

# %% [markdown]
# In short: each idea adds speed, most of all the overlap within a warpgroup and the persistent grid;
# the turns alone pay mainly at D = 128. What the rows say in detail, and how phase 09 compares with
# phase 08 and cuDNN, is in the [appendix](#appendix-tuning-notes).
#
# The timings are medians. A user running attention in a loop pays the mean, and a hunt for slow
# launches once found some; they turned out to be the benchmark's, not the kernel's. How that was
# told apart is the appendix's last section.

# %% [markdown]
# ## What changed in the machine code
#
# The kernel reports the registers of its [launch](../docs/glossary.md#launch), the count every thread starts with; after
# `setmaxnreg` the consumers run with more (the numbers are in the appendix).

# %%
lesson.machine_code()

# %%
lesson.ptx(["cp.async.bulk.tensor", "mbarrier.try_wait", "setmaxnreg", "bar.sync", "bar.arrive"], max_lines=16)

# %%
lesson.sass(["UTMALDG", "SYNCS", "USETMAXREG", "BAR.SYNC", "BAR.ARV", "HGMMA", "STG.E.128", "STL", "LDL"])

# %% [markdown]
# ## Exercise
#
# Where the boxes come from. A tensor map sees Q, K and V as (B·H, S, D): the plane is the head, the
# row is the query or key, the column is d, and a box is 64 rows × 64 columns. A K or V tile of
# BLOCK_N = 128 keys is cut into atoms of 64 columns of d, each atom two boxes of 64 keys one below the
# other. 09-a: the first query row of consumer c's Q tile. 09-b: the first column and first key of box
# `box` of atom a of K/V tile n. A wrong
# coordinate does not hang the kernel (the box still brings its bytes to the barrier); it brings the
# wrong rows, and the graded checks see it.

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
# ### Overlap within a warpgroup: what the assembler made of it
#
# The PTX of idea 7 waits for O after the softmax; the assembler moves the second wait up, ahead of
# the exp2s (the kernel's [tuning history](../docs/tuning/09_history.md) shows where), so on the H100 what this buys is mostly the two products
# issued back to back. A warpgroup barrier that reads the softmax's row sums does pin the wait after
# the exp2s; timed on the H100 it was no faster: while one warpgroup waits, the other consumers'
# products keep the tensor cores busy anyway.
#
# ### The masked tiles at D = 64
#
# At D = 64 a second copy of the softmax [spills](../docs/glossary.md#spill), so every tile runs one loop; there the question
# "does this tile need a mask?" is asked once, as one branch around the whole masking loop. Asked in
# each of S's 16 column blocks, it cost D = 64 8 % of its speed (the kernel's [tuning history](../docs/tuning/09_history.md) has the
# profile and the records).
#
# ### The epilogue before 16-byte stores
#
# A measured timeline of the blocks showed the epilogue taking 6-8 % of each block's time before
# the 16-byte stores of idea 10.
#
# ### Counting the ring position
#
# The kernel counts `stage` and `phase` instead of dividing a tile number by STAGES: with three
# stages the division cost some 40 instructions per tile.
#
# ### A wait on one path
#
# When an in-flight register is touched on some path, ptxas makes every wgmma of the kernel wait for
# the one before (warning C7518). A first version waited under `if n > 0:` in the loop and got
# exactly that; tile 0, which has no P·V before it, is now taken before the loop, so the issue and
# the waits are on one straight path.
#
# ### Registers of the launch
#
# The kernel reports the registers of its launch (168 per thread at D = 128: 384 threads in one block
# per SM); after `setmaxnreg` the consumers run with 240. ptxas honours `setmaxnreg` only when it knows
# the count at entry (the kernel's launch bounds) and compiles the whole program (Numba's [LTO](../docs/glossary.md#lto) route).
#
# ### Other head dims: how the tile configuration follows from D
#
# Models use head dims from 32 to 256 (ViTs 40 and 80, Phi-3 96, DeepSeek's MLA 192, Gemma 256).
# Phase 09 runs any multiple of 8 up to 256 on one of four tile configurations, by D_TILE, the first
# of 64, 128, 192 and 256 columns that holds D: TMA fills a box's columns past the tensor's last one
# with zeros, so the extra columns of Q and K add nothing to q·kᵀ, and V's give output columns the
# epilogue never stores. D = 96 costs what D = 128 costs on the tensor cores and in shared memory,
# though only its 96 columns are read from global memory.
#
# Each configuration is two budgets worked out by hand, the constants at the top of the module:
#
# * **Registers.** A consumer warpgroup (128 threads) keeps its 64 query rows of O in fp32 registers:
#   64 × D_TILE / 128 = D_TILE / 2 a thread. S of a tile of BLOCK_N keys takes BLOCK_N / 2 more, and P,
#   repacked to 16 bits, half of that. After `setmaxnreg` a consumer has 240 registers where there are
#   two consumers and 160 where there are three (`CONSUMER_REGISTERS`: what the block's 65536 leave
#   once the producer is down to 24). So D_TILE = 64 affords three consumers (192 query rows) with
#   tiles of 128 keys; 128 two consumers with 128 keys (O 64 + S 64); but at 192 and 256 O alone takes
#   96 and 128 registers, and S of 64 keys (`KEYS_PER_TILE`) is what fits beside it.
# * **Shared memory** (227 KB a block). Q is consumers × 64 rows × D_TILE × 2 bytes, and each stage of
#   the ring a K and a V tile, 2 × BLOCK_N × D_TILE × 2 bytes; the ring gets as many stages as fit
#   beside Q (`STAGES`): three of 64 KB at D_TILE = 128, three of 48 KB at 192, two of 64 KB at 256.
#   At 64 four stages; a fifth fits and was measured level ([tuning history](../docs/tuning/09_history.md)).
#
# The rest follows from D_TILE in `layout`: atoms of 64 columns per tile row (one TMA box each), the
# offsets of Q, the ring and the mbarriers, and the counts of the products' steps. At 256 the first
# build spilled: the fix (rescale O after its wait, `RESCALE_LATE`) and what still holds D = 256 behind
# cuDNN are in the tuning history's "Other head dims".

# %%
lesson.show_source(phase.tile_head_dim, phase.layout)

# %% [markdown]
# ### What the timing rows say
#
# What the rows say, and what is missing: the overlap within a warpgroup pays at both head dims
# (09-overlap against 09-turns), and the persistent grid more again (09 against 09-overlap), most at
# short sequences, where a block's start and end are a larger share of its work. The turns alone pay
# at D = 128 (09-turns against 09-ws) but hardly at D = 64: there 09-turns runs level with 09-ws
# without a mask and below it with one in the current records, so the turns pay mostly together
# with the overlap (the kernel's [tuning history](../docs/tuning/09_history.md) follows 09-turns'). Against phase 08 (the
# committed records, [docs/bench](../docs/bench/)) the rows to compare are D = 64 and D = 128,
# causal and not: phase 08 held its own at D = 64 until the tiles grew to 128 keys, since there the
# softmax costs as much as both products. Against cuDNN (the records' SDPA rows) phase 09 is ahead
# at the reference shape at both head dims, causal and not, by the most at D = 64 without a mask;
# the sweeps show where it is still behind (short sequences with a mask), and the kernel's
# [tuning history](../docs/tuning/09_history.md) says by how much and what was tried.
#
# ### The median is not the whole story: a tail that was not the kernel's
#
# A user runs attention in a loop, so what they pay is the *mean* launch, not the median. A test
# that timed phase 09 launch by launch once found 1 launch in 12 taking 10-20 times its median:
# if that were the kernel's, a loop would get half its speed. How to tell whose time it is:
#
# 1. **Time the device alone.** Queue a batch of launches behind a sleep kernel that outlasts the
#    host's queuing, with an event between launches: the GPU then never waits for Python, and each
#    interval is the kernel's. Check it: measure how long the host took to queue the batch and drop
#    the batch if that was longer than the sleep (`bench.queued_times` does both).
# 2. **Ask the kernel's own clock.** `%globaltimer` is one nanosecond clock for every SM. The trace
#    build of phase 09 (a `Build` with `trace=True`, phases/tracing.py) times every barrier wait
#    of every warpgroup and writes a record per block and role: when it started and ended, how long
#    each kind of wait took, and every wait longer than 50 us with its barrier, parity and query
#    block. If a launch is slow *on the GPU*, the records say which block waited on what; if the
#    events say slow and the records' span does not, the time was spent outside the kernel.
#
# What it found (docs/tuning/09_history.md, an H100 and an H200): 1000 device-only launches at six
# shapes, not one above 1.5 times its median, the mean within 0.3 % of the median; in 1200 traced
# launches the longest barrier wait anywhere was 6.5 us, and the events exceeded the kernel's span
# by 8-12 us at most. So no barrier phase was missed, no producer and consumer waited on each
# other across the ring's wrap, no warpgroup stalled in `setmaxnreg`. The spread came back the
# moment host time could enter: a sleep shorter than the host's launch call (50 us against
# 175-600 us) or launches back to back from Python. The bug was in the measurement, and the
# fix was in the benchmark: its kernel time is now device-only, every record keeps the mean, p99
# and max beside the median, `--tail N` counts slow launches, and `--calls N` measures what a
# user's call costs, host included (the call path has been made lean since: runtime/).

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
# # Phase 13 — The backward warp-specialized: a TMA producer warpgroup feeds the wgmma consumers
#
# *Previous: [12 the backward on wgmma](12_backward_wgmma.ipynb), whose kernel this phase splits
# into roles; the machinery (TMA, [mbarriers](../docs/glossary.md#mbarrier), `setmaxnreg`) is [09 warp
# specialization](09_warp_specialized.ipynb)'s. Hardware background: [docs/hardware.md](../docs/hardware.md).
# Course map: [README](README.md).*
#
# ## The idea
#
# Phase 12's block is two [warpgroups](../docs/glossary.md#warpgroup) that do everything. Each
# thread issues its share of the `cp.async` copies of the next query tile (Q and dO), waits for its
# own copies, and the whole block meets at a barrier before the tensor cores may read the tile. Phase
# 09 did to the forward what this phase does to the backward: it gives the copying to a warpgroup of
# its own.
#
# **1. A producer and two consumers.** The block gets a third warpgroup, the *producer*
# (warpgroup 0). One of its threads loads the block's K and V once, then each query tile's Q and dO,
# by TMA (ptx/tma.ptx, lesson 09): one instruction moves a box of 64 rows × 64
# columns, swizzled by the copy engine into exactly the layout phase 12's threads built by hand, with
# the rows past the sequence and the columns past D filled with zeros. The *consumers* (warpgroups 1
# and 2) are phase 12's two warpgroups: their products and their elementwise step are unchanged.
#
# **2. The ring.** The tiles go into a ring of two stages in shared memory, each guarded by two
# mbarriers. *full[s]* completes when stage s's bytes have landed
# (the producer announces how many with `expect_tx`, the copy engine counts them down); *empty[s]*
# completes when all 256 consumer threads have arrived, done with the tile. A wait names the
# *parity* of the phase it waits for, so the ring's count r alone tells everyone where they are:
# tile r is in stage r % 2, its use number r // 2 gives the parity. Producer and consumers walk the
# query tiles in the same order (the rows of one head, then the next head of the group), so the
# ring carries only bytes, no coordinates.
#
# **3. An early release.** A consumer is done with a tile's Q and dO once dK's product has read Q,
# before it computes dQ (which reads dSᵀ and K, not the tile). It arrives on *empty* there, and
# the producer refills the stage while the consumers compute dQ.
#
# **4. Named barriers.** The consumers still meet twice a tile (both warpgroups' dSᵀ must be in
# shared memory before dQ reads it). They meet at named barrier 1 of their 256 threads
# (`bar.sync 1, 256`), so the producer never waits there.
#
# **5. Registers follow the work.** The producer gives its registers back (`setmaxnreg.dec` to 24)
# and the consumers take them (`setmaxnreg.inc` to 240), as in phase 09: the 384 threads of one
# block share one SM's 65536 registers.
#
# The deterministic build walks a block's key blocks in turn: the producer reloads K and V once the
# consumers say they are done with the last (a barrier *kv_empty*), and the ring's count runs on
# across key blocks. FlashAttention-3 also adds dQ in bulk (each consumer stages its piece of dQ and
# one thread adds it by a bulk reduction); phase 13 has that as a build to compare (`bulk_dq=True`).
# The changelog below, and docs/tuning/12_history.md, say what each one measured.

# %%
# Where the kernels run is decided before numba.cuda is first imported: on the CUDA GPU when the
# driver shows one, else in Numba's CUDA simulator on the CPU. Set NUMBA_ENABLE_CUDASIM to choose.
import os

if "NUMBA_ENABLE_CUDASIM" not in os.environ:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if os.path.exists("/dev/nvidiactl") else "1"

# %%
from flashcore_numba.course import notebooks
from flashcore_numba.phases import p12_backward_wgmma
from flashcore_numba.phases import p13_backward_ws as phase

lesson = notebooks.Lesson("13")
lesson.intro()

# %%
lesson.changelog()

# %% [markdown]
# ## The ring, in time
#
# A schematic (not measured) of one block over a few query tiles. Above, phase 12: every thread
# copies, and the block waits at a barrier for the tile it copied. Below, phase 13: the producer's
# loads run ahead as far as the ring lets them, and a stage is released as soon as dK's product has
# read it.

# %%
notebooks.draw_backward_ring()

# %% [markdown]
# ## The kernel, beside phase 12's
#
# The diff of the two kernels: the block splits into the producer's branch and the consumers', the
# copies and their barrier give way to the ring's waits and arrivals, and the consumers' loop over
# the query tiles moved into `consume_block`: wait for the tile, phase 12's products, release the
# stage after dK's product, then dSᵀ and dQ between the two named barriers.

# %%
lesson.show_diff(p12_backward_wgmma.build_kv_kernel, phase.build_kv_kernel_ws)

# %% [markdown]
# The producer: one thread's TMA loads, K and V once, then the query tiles into the ring. Before it
# refills a stage it waits for that stage's *empty* barrier; `expect_tx` tells *full* how many
# bytes to wait for.

# %%
lesson.show_source(phase.make_producer)

# %% [markdown]
# The wait, in ptx/tma.ptx: `mbarrier.try_wait.parity` in a loop, true once the phase of the given
# parity has completed.

# %%
lesson.show_ptx("tma.ptx", "flashcore_mbarrier_wait")

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
# Beside phase 12 and torch SDPA's backward at the reference shape, where a record has the row
# (`flashcore bench --backward` times phase 13 on Hopper).

# %%
timings = lesson.timing()

# %%
lesson.plot_timing(timings)

# %% [markdown]
# ## What changed in the machine code
#
# Phase 12's `kv_kernel` and this one, compiled for the H100: `UTMALDG` (the TMA loads) in place of
# `LDGSTS` (cp.async), the mbarrier operations (`SYNCS`), and `USETMAXNREG`, the registers handed
# from the producer to the consumers.

# %%
lesson.machine_code()

# %%
lesson.ptx(["wgmma.mma_async", "cp.async.bulk.tensor", "cp.async.cg", "mbarrier.try_wait", "bar.sync",
            "setmaxnreg", "red.global.add.v2.f32"])

# %%
lesson.sass(["HGMMA", "UTMALDG", "LDGSTS", "SYNCS", "BAR.SYNC", "USETMAXREG", "REDG", "STL", "LDL"])

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

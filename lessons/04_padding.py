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
# # Phase 04 — Padding: bank-conflict-free shared memory
#
# *Previous: [03 warp-shuffle softmax](03_warp_shuffle.ipynb). Next: [05 double
# buffering](05_double_buffer.ipynb). Hardware background: [docs/hardware.md](../docs/hardware.md).
# Course map: [README](README.md).*
#
# ## The idea
#
# One number changes: every row of the Q, K and P [tiles](../docs/glossary.md#tile) in [shared memory](../docs/glossary.md#shared-memory) gets `SMEM_PAD` extra
# [fp32](../docs/glossary.md#fp32) words that nobody reads (its value is printed below). The [kernel](../docs/glossary.md#kernel) is phase 03's, built with
# the padded layout.
#
# ## Why the hardware rewards it: banks
#
# Shared memory is split into **32 banks**, each 4 bytes wide: 32-bit word `w` lives in bank
# `w mod 32`. Each bank delivers one word per cycle. When the [lanes](../docs/glossary.md#lane) of a [warp](../docs/glossary.md#warp) load in one
# instruction, words in different banks come back in the same pass; lanes asking for the *same*
# word share it (a [broadcast](../docs/glossary.md#broadcast)); but lanes asking for *different* words of the *same* bank are
# served one after another: a [bank conflict](../docs/glossary.md#bank-conflict), and the instruction takes as many passes as the
# busiest bank has distinct words.
#
# In `scores_tile` the lanes of a row group read the same column d of different K rows, one row
# per lane:
#
# ```
#   rows of 64 words (phase 03):       k[c][d] is word 64·c + d          → bank d, whatever c is:
#                                      every lane waits for the same bank
#
#   rows of 64 + pad words (phase 04): k[c][d] is word (64 + pad)·c + d  → bank (pad·c + d) mod 32:
#                                      row c is shifted by pad·c banks, the lanes spread out
# ```
#
# The cost is `pad` words per row of Q, K and P. Which pad is right depends on how wide each
# lane's access is: the kernel may read several consecutive words per lane in one instruction
# (a 16-byte `ld.shared.v4.f32`), and then a warp is served a quarter at a time, each lane
# covering several banks. `flashcore_numba.measure.banks` models exactly that, and the sweep below
# tries every pad the layout allows.

# %%
# Where the kernels run is decided before numba.cuda is first imported: on the CUDA GPU when the
# driver shows one, else in Numba's CUDA simulator on the CPU. Set NUMBA_ENABLE_CUDASIM to choose.
import os

if "NUMBA_ENABLE_CUDASIM" not in os.environ:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if os.path.exists("/dev/nvidiactl") else "1"

# %%
from flashcore_numba.course import notebooks
from flashcore_numba.phases import p03_warp_shuffle
from flashcore_numba.phases import p04_padding as phase

lesson = notebooks.Lesson("04")
lesson.intro()

# %%
print(f"phase 03 rows: {p03_warp_shuffle.smem_layout(64)['K_STRIDE']} words; "
      f"phase 04 rows: {phase.smem_layout(64)['K_STRIDE']} words (SMEM_PAD = {phase.SMEM_PAD})")

# %% [markdown]
# The banks the lanes of one pass hit when they read column 0 of their K rows, without and with
# the padding. A red number above a bank counts the different words waiting in line for it.

# %%
notebooks.draw_bank_map([("phase 03", p03_warp_shuffle.smem_layout(64)),
                         ("phase 04", phase.smem_layout(64))])

# %% [markdown]
# Every shared-memory access of the warp-tiled kernel, for each padding:
# `flashcore_numba.measure.banks` evaluates them from the layout alone, no GPU needed. The p writes
# happen once per tile element, the other accesses inside the inner loops, so those are the ones
# that must be conflict-free.

# %%
notebooks.pad_sweep(p03_warp_shuffle.smem_layout(64))

# %%
lesson.changelog()

# %% [markdown]
# ## The kernel
#
# The whole phase: a padded layout, handed to phase 03's `build_kernel`. The exercise region marks
# the one line that matters. The strides it changes are computed in `layout()`.

# %%
lesson.show_source(phase)

# %%
lesson.show_source(p03_warp_shuffle.layout)

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
# Almost nothing, and that is the point: the same [registers](../docs/glossary.md#register) and the same instructions. Only the
# address offsets differ (the K tile starts after 64 padded rows of Q), and the [block](../docs/glossary.md#block) asks for a
# little more shared memory. The speed-up is invisible in the code: it is in how many passes each
# shared-memory load takes.

# %%
lesson.machine_code()

# %%
lesson.bank_conflicts()

# %%
lesson.ptx(["ld.shared", "st.shared", "fma.rn.f32"], max_lines=12)

# %%
lesson.sass(["LDS", "STS", "FFMA"])

# %% [markdown]
# On a GPU, Nsight Compute measures the same thing: the counters
# `l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum` and `..._op_st.sum` count the extra
# passes, e.g. `ncu --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum
# python3 -m flashcore_numba run`.
#
# ## Exercise
#
# Choose the padding: the smallest `SMEM_PAD` for which every access of the inner loops is
# conflict-free. The sweep above lets you test a choice before you grade it.

# %%
lesson.exercise()

# %% [markdown]
# ## The solution
#
# Try the exercise first. These are the lines the phase itself has in each region; the listings
# above show the regions empty, as your stub has them.

# %%
lesson.show_solution()

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
# # Phase 06 — Tensor cores: WMMA from linked PTX
#
# *Previous: [05 double buffering](05_double_buffer.ipynb). Hardware background:
# [docs/hardware.md](../docs/hardware.md#tensor-cores-phases-06-09). Course map: [README](README.md).*
#
# ## The idea
#
# Phases 01–05 computed every score and every output element with fused multiply-adds on the
# ordinary [FP32](../docs/glossary.md#fp32) cores. An H100 has a second, much larger arithmetic engine: the **[tensor cores](../docs/glossary.md#tensor-core)**,
# which multiply small matrix [tiles](../docs/glossary.md#tile) in one instruction. Phase 06 moves both matrix products of
# attention onto them. Four ideas, one at a time.
#
# **1. The scores on the tensor cores.** A [warp](../docs/glossary.md#warp) now owns 16 query rows. One call computes its 16 × 64
# block of scores S = Q·Kᵀ as HEAD_DIM/16 steps of four 16×16×16 tile products (`wmma.mma.sync`),
# [fp16](../docs/glossary.md#fp16) in, fp32 out. What it buys: the bulk of the arithmetic now takes a few instructions per tile.
#
# **2. The [online softmax](../docs/glossary.md#online-softmax), unchanged in spirit.** It is phase 03's, but it reads S from [shared
# memory](../docs/glossary.md#shared-memory), two [lanes](../docs/glossary.md#lane) per row, and writes P back as fp16, the tensor cores' input type. Why the detour
# through shared memory is explained below, under "which lane holds what"; phase 07 removes it.
#
# **3. The output on the tensor cores.** O_tile = P·V is a second call, 64 output columns at a time.
# The lanes add it into `acc`, which stays in [registers](../docs/glossary.md#register) across the whole loop. Phase 05's
# pipelined K/V loads stay as they were.
#
# **4. Hand-written instructions, linked in.** The tensor-core instructions are not Python: they are
# hand-written [PTX](../docs/glossary.md#ptx) in [`ptx/wmma.ptx`](../ptx/wmma.ptx), and this phase is the first that links PTX into a
# Numba [kernel](../docs/glossary.md#kernel).

# %% [markdown]
# ## Where the data lives: phase 05 against phase 06
#
# Each line is one of attention's matrices, and the path it takes from HBM (the GPU's main memory)
# through shared memory to the place where it is computed on. Lines marked `*` take a new path in
# this phase.
#
# ```text
#           phase 05: FP32 cores                  phase 06: tensor cores (WMMA)
#   Q       HBM -> shared                         HBM -> shared (now fp16)
#   K, V    HBM -> registers -> shared            the same (now fp16)
#           (next tile in flight, 2 stages)
# * S       shared Q, K -> FMA on the FP32        shared Q, K -> tensor cores -> shared (fp32)
#           cores -> registers
# * P       registers                             shared (fp16), written by the softmax
# * O       acc in registers, p·v by FMA          shared P, V -> tensor cores -> shared
#                                                 -> added into acc in registers
#           acc / l_i -> HBM                      the same
# ```
#
# One K/V tile through one warp's 16 query rows in phase 06:
#
# ```text
#   shared Q, K --> [tensor cores] S = Q·Kᵀ --> shared S (fp32)
#                                                 |  softmax, 2 lanes per row
#                                                 v
#   shared V -----> [tensor cores] O_tile = P·V <-- shared P (fp16)
#                          |
#                          v
#                   shared O_tile --> registers: acc += O_tile
# ```
#
# Each trip of S, P and O_tile through shared memory is a store and a load that phase 07 takes away.

# %% [markdown]
# ## Why the hardware rewards it
#
# One `mma` instruction of a warp does 16 × 8 × 16 = 2048 multiply-adds; an FP32 [FMA](../docs/glossary.md#fma) instruction
# does 32. The H100's dense fp16 tensor throughput is roughly 16 times its FP32 FMA throughput,
# and the scores and outputs, which were nearly all of phase 05's arithmetic, now take a few
# instructions per tile. What remains on the ordinary cores is the softmax and the shared-memory
# traffic around it, which is why this phase is still far from torch's kernels: phase 07 keeps S in
# registers instead.
#
# ## How PTX gets into a Numba kernel: two routes
#
# [`flashcore_numba/arch/ptx.py`](../flashcore_numba/arch/ptx.py) reads `ptx/wmma.ptx` and offers each
# `.func` in it by two routes.
#
# The **link** route (`phase="06"`) hands the file to the linker as it is
# (`cuda.declare_device(..., link=["ptx/wmma.ptx"])`). Each use is then a real function call, which
# costs something every time. So each function here does a warp's *whole tile* (16 or 32 `mma`) per
# call, and the cost is paid once per tile.
#
# The **inline** route (`phase="06-inline"`) pastes the same function body into the kernel as inline
# assembly. No call at all.
#
# The two routes run identical instructions and give bit-identical results (a GPU test checks it).
# Their difference in speed is what the call costs. What exactly a call does on the GPU is in the
# [appendix](#appendix-tuning-notes).

# %%
# Where the kernels run is decided before numba.cuda is first imported: on the CUDA GPU when the
# driver shows one, else in Numba's CUDA simulator on the CPU. Set NUMBA_ENABLE_CUDASIM to choose.
import os

if "NUMBA_ENABLE_CUDASIM" not in os.environ:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if os.path.exists("/dev/nvidiactl") else "1"

# %%
from flashcore_numba.arch import ptx
from flashcore_numba.course import notebooks
from flashcore_numba.phases import p05_double_buffer
from flashcore_numba.phases import p06_wmma as phase

lesson = notebooks.Lesson("06")
lesson.intro()

# %%
lesson.changelog()

# %% [markdown]
# ## The PTX
#
# The file says its ABI at the top: every parameter a 32-bit value (shared-memory addresses and
# strides), nothing returned, [fragments](../docs/glossary.md#fragment) never leaving the function. Here is the score product,
# exactly as it runs:

# %%
lesson.show_ptx("wmma.ptx", "flashcore_wmma_abt")

# %% [markdown]
# And what the inline route makes of it: the same lines, with the seven `ld.param` turned into
# moves from the asm operands `$0`–`$6` and `ret;` dropped.

# %%
asm, constraints = ptx.load("wmma.ptx")["flashcore_wmma_abt"].inline_asm()
print("\n".join(asm.splitlines()[:24]), "\n    ...")
print("constraints:", constraints)

# %% [markdown]
# ## Fragments: which lane holds what
#
# A tensor-core instruction is *warp-collective*: the 16×16 tiles are spread over the 32 lanes'
# registers, eight values per lane. For `mma.sync` PTX documents the spread; the picture shows it
# for the fp32 [accumulators](../docs/glossary.md#accumulator). For [WMMA](../docs/glossary.md#wmma), PTX says nothing (it may differ between GPU generations).
# That is the reason this phase stores S to shared memory before the softmax: code that read a WMMA
# fragment's registers directly would rely on an unpromised layout. The [simulator](../docs/glossary.md#simulator)'s emulation
# ([`arch/sim_wmma.py`](../flashcore_numba/arch/sim_wmma.py)) therefore makes the simplest choice,
# a whole tile per warp, which phase 06 cannot tell apart from the hardware's.

# %%
notebooks.draw_fragment_layout()

# %% [markdown]
# ## The kernel
#
# The shared-memory layout, in bytes: Q, two stages of K and V (fp16 now), and per warp an fp32
# buffer for S (reused for O) and an fp16 buffer for P. Rows are padded by 16 bytes, as in phase 04.

# %%
lesson.show_source(phase.layout)

# %% [markdown]
# The kernel body against phase 05's: the scores and `p · v` become two calls; the softmax reads S
# from shared memory, two lanes per row; `acc` gains the P·V tile after each call.

# %%
lesson.show_diff(p05_double_buffer.build_kernel, phase.build_kernel)

# %% [markdown]
# ## Is it correct?

# %%
lesson.check()

# %% [markdown]
# ## How fast is it?
#
# Phase 05, phase 06 on the link route, the same kernel on the inline route, and torch.

# %%
timings = lesson.timing()

# %%
lesson.plot_timing(timings)

# %% [markdown]
# ## What a call costs
#
# The two routes side by side: registers, the [stack frame](../docs/glossary.md#stack-frame) ([local memory](../docs/glossary.md#local-memory)), the `CALL` sites into
# `ptx/wmma.ptx` in the [SASS](../docs/glossary.md#sass) (the GPU's own machine code), the tensor-core instructions (`HMMA`)
# visible in the kernel's own code, and speed. With one call per tile of work, the call's cost is the
# gap between the two [TFLOPS](../docs/glossary.md#tflops) figures below ([appendix](#appendix-tuning-notes): what one call per `mma` would cost).

# %%
lesson.call_cost()

# %% [markdown]
# ## What changed in the machine code

# %%
lesson.machine_code()

# %%
lesson.ptx(["wmma.mma", "call", "ld.shared", "st.shared", "ex2.approx", "bar.sync"], max_lines=16)

# %%
lesson.sass(["HMMA", "CALL", "LDS", "STS", "BAR"])

# %% [markdown]
# ## Exercise
#
# Put the tensor cores to work: the call that computes this warp's scores S = Q·Kᵀ into its S
# buffer (06-a), and the loop of calls that computes O = P·V, one 64-column strip per call (06-b).
# Every address is `smem` (the buffer's shared-memory address) plus a byte offset; the strides are
# in elements.

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
# **What a call costs, instruction by instruction.** On the link route the linker never inlines a
# function of `ptx/wmma.ptx`: each use is a real **call**. Its arguments travel through `.param`
# space, the SASS has a `CALL`, and the registers the function may overwrite are saved around it.
# Called once per `mma`, that cost would dominate: in a microbenchmark one call per `mma` cost a
# factor of 30. That is why each function does a warp's whole tile (16 or 32 `mma`) per call, and why
# the gap between the two routes in the table above is a few per cent, not a factor.
#
# **What the inline route changes.** The function body is the same; its seven `ld.param` loads of the
# arguments become moves from the asm operands `$0`–`$6`, and `ret;` is dropped (the cell under
# "The PTX" prints it). Phases 07–09 use the inline route only.

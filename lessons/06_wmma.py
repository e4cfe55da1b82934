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
# attention onto them:
#
# 1. **S = Q·Kᵀ** — a [warp](../docs/glossary.md#warp) owns 16 query rows. One call computes its 16 × 64 block of scores as
#    HEAD_DIM/16 steps of four 16×16×16 tile products (`wmma.mma.sync`), [fp16](../docs/glossary.md#fp16) in, fp32 out.
# 2. **The [online softmax](../docs/glossary.md#online-softmax)** — unchanged in spirit from phase 03, but it reads S from [shared
#    memory](../docs/glossary.md#shared-memory) (two [lanes](../docs/glossary.md#lane) per row) and writes P back as fp16, the tensor cores' input type.
# 3. **O_tile = P·V** — a second call, 64 output columns at a time; the lanes add it into `acc`,
#    which stays in [registers](../docs/glossary.md#register) across the whole loop. Phase 05's pipelined K/V loads stay.
#
# The tensor-core instructions are not Python: they are hand-written [PTX](../docs/glossary.md#ptx) in
# [`ptx/wmma.ptx`](../ptx/wmma.ptx), and this phase is the first that links PTX into a Numba [kernel](../docs/glossary.md#kernel).

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
# `.func` in it by two routes:
#
# - **link** (`phase="06"`): `cuda.declare_device(..., link=["ptx/wmma.ptx"])`. The file is linked as
#   written. The linker never inlines it: each use is a real **call** — arguments through `.param`
#   space, a [SASS](../docs/glossary.md#sass) `CALL`, and registers saved around it. Called once per `mma`, that cost would
#   dominate; so each function here does a warp's *whole tile* (16 or 32 `mma`) per call.
# - **inline** (`phase="06-inline"`): the same function body, pasted into the kernel as inline
#   assembly (the parameter loads become operand moves, nothing else changes). No call at all.
#
# The two routes run identical instructions and give bit-identical results (a GPU test checks it).
# Their difference in speed is what the call costs.

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
# The two routes side by side: registers, the [stack frame](../docs/glossary.md#stack-frame) ([local memory](../docs/glossary.md#local-memory)), the SASS `CALL` sites into
# `ptx/wmma.ptx`, the tensor-core instructions (`HMMA`) visible in the kernel's own code, and speed.
# With one call per tile of work, the call's cost is the gap between the two [TFLOPS](../docs/glossary.md#tflops) figures below,
# not the factor of 30 that one call per `mma` cost in a microbenchmark.

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

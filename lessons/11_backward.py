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
# # Phase 11 — The backward pass: dQ, dK and dV recomputed from the log-sum-exp
#
# *Previous: [10 split_keys](10_split_keys.ipynb), though this phase builds on
# [07 mma.sync](07_mma_sync.ipynb). Hardware background: [docs/hardware.md](../docs/hardware.md).
# Course map: [README](README.md).*
#
# ## The idea
#
# Phases 01-10 compute attention's output. Training a model also needs its
# [backward pass](../docs/glossary.md#backward-pass): given dO, how much the loss changes with each
# element of the output, the gradients dQ, dK and dV of the loss with respect to the inputs. With
# P = softmax(scale · Q Kᵀ) and O = P V, the chain rule gives five products of the forward's size:
#
#     dV = Pᵀ dO          dP = dO Vᵀ          dS = P ∘ (dP − Δ)
#     dQ = scale · dS K   dK = scale · dSᵀ Q   where Δ_i = Σ_j P_ij dP_ij
#
# (∘ multiplies element by element; the row sums Δ come from the softmax: each row of P sums to 1.)
#
# **1. P is recomputed, not stored.** The forward never wrote the S_q × S_k matrix P: that is the
# whole point of FlashAttention. The backward needs P again, and recomputing it is cheap because the
# forward saved one number per row, its [log-sum-exp](../docs/glossary.md#log-sum-exp)
# L_i = log Σ_j exp(scale · s_ij). Then P_ij = exp(scale · s_ij − L_i) exactly: no running max, no
# sum, no second pass. The kernels compute it in base 2, as the forward does:
# p = 2^(s · qk_scale − L_i · log2 e).
#
# **2. Δ needs no P either.** Δ_i = Σ_j P_ij dP_ij = Σ_j P_ij (dO_i · v_j) = dO_i · O_i: a dot product
# of two rows the forward and the loss already gave. A small first kernel computes it, each
# [warp](../docs/glossary.md#warp) taking a few rows (exercise 11-b).
#
# **3. Two gradients sum over queries, one over keys.** dK and dV of a key sum over every query row
# that sees it; dQ of a query row sums over every key. A kernel has to pick which sum stays inside a
# [block](../docs/glossary.md#block):
# - `kv_kernel` gives each block 128 keys (and their values), kept in
#   [shared memory](../docs/glossary.md#shared-memory), while tiles of 64 query rows stream past in two
#   stages, exactly as K and V stream past Q in phase 07 (one difference: the streamed rows are not
#   padded but [swizzled](../docs/glossary.md#swizzle), chunk c of row r stored at chunk c ^ (r % 8),
#   because cp.async splits a padded row that straddles 128-byte lines of shared memory: 24 L2
#   sectors a warp where 16 do, docs/tuning/11_layout/). Each warp owns 16 keys and computes its
#   products transposed (keys as rows): Sᵀ = K Qᵀ and dPᵀ = V dOᵀ on the tensor cores, then Pᵀ and dSᵀ
#   element by element (exercise 11-a), then dV += Pᵀ dO and dK += dSᵀ Q, which stay in
#   [registers](../docs/glossary.md#register) for the whole loop and are written once. With
#   grouped-query attention the group's query heads stream past one after another, so dK and dV are
#   summed over the group for free.
# - dQ then needs the sum over the key blocks, which other blocks own. Each block adds its share,
#   dQ += scale · dS K, to a float32 dQ in global memory by [atomic](../docs/glossary.md#atomic)
#   additions (exercise 11-c): the hardware makes each read-add-write indivisible. Numba's
#   `cuda.atomic.add` returns the old value, so each addition waits for an answer from memory that
#   nobody reads; PTX's `red` (ptx/red.ptx) adds without one, and on an H100 `red.global.add.v2.f32`
#   adds a lane's two neighbouring columns at once. Half the requests, none waited for.
#   The dQ of a tile needs every warp's dSᵀ (each warp has 16 keys of it), so the warps meet at a
#   [barrier](../docs/glossary.md#barrier) first. Rather than a barrier of its own, each tile's
#   dSᵀ goes to one of two buffers and its dQ is added during the next tile, behind the barrier
#   that ends every tile anyway: no warp waits for the slowest one's dSᵀ (3-6 % faster on an
#   H200, docs/tuning/11_history.md, run 11). The second buffer costs 18 KB of shared memory a block:
#   a GPU without that room (an A100 at D = 128) gets one buffer and the barrier back
#   (`ds_buffers_for`), which is why the kernel has both ways.
#
# **4. Atomics are not [deterministic](../docs/glossary.md#deterministic).** Blocks finish in
# whatever order the GPU runs them, and float32 addition is not associative: the last bits of dQ can
# change from run to run. `attention(..., deterministic=True)` keeps the same kernel and changes who
# adds: instead of a block per key block, one block per (batch, K/V head) takes its key blocks in
# turn. Each element of dQ is then added to by one thread alone, and one thread's additions to one
# address happen in its program order, so the sum comes out the same bit for bit on every run.
# Nothing is computed twice; what it costs is fewer blocks in flight (one per head instead of one
# per key block), so when there are fewer heads than SMs the key blocks are dealt out to a few
# blocks, each adding into its own copy of dQ, and the copies are summed in order at the end. The
# timing cell below shows what it costs.
#
# P and dS go to the tensor cores rounded to fp16 (or bf16), as the forward's P · V does; every sum
# is float32. `attention()` calls all of this through torch's autograd: `out.backward()` or
# `loss.backward()` on a tensor that requires grad.

# %%
# Where the kernels run is decided before numba.cuda is first imported: on the CUDA GPU when the
# driver shows one, else in Numba's CUDA simulator on the CPU. Set NUMBA_ENABLE_CUDASIM to choose.
import os

if "NUMBA_ENABLE_CUDASIM" not in os.environ:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if os.path.exists("/dev/nvidiactl") else "1"

# %%
from flashcore_numba.course import notebooks
from flashcore_numba.phases import p11_backward as phase

lesson = notebooks.Lesson("11")
lesson.intro()

# %%
lesson.changelog()

# %% [markdown]
# ## The formulas, checked in NumPy
#
# Before any kernel: the five products above, in float64 on one small head, against the gradient
# measured numerically (nudge one element of Q, K or V by ε and see how the loss Σ O ∘ dO moves).
# P comes from the log-sum-exp alone, and Δ from O and dO alone, as the kernels compute them.

# %%
import numpy as np

rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((6, 8)) for _ in range(4))
scale = 8 ** -0.5


def forward(q, k, v):
    s = scale * q @ k.T
    lse = np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)) + s.max(1)  # what the forward saves
    return np.exp(s - lse[:, None]) @ v, lse


o, lse = forward(q, k, v)
p = np.exp(scale * q @ k.T - lse[:, None])  # recomputed from the log-sum-exp
delta = (do * o).sum(1)  # Δ_i = dO_i · O_i
ds = p * (do @ v.T - delta[:, None])
grads = {"dq": scale * ds @ k, "dk": scale * ds.T @ q, "dv": p.T @ do}

eps = 1e-6
for name, x in (("dq", q), ("dk", k), ("dv", v)):
    numeric = np.zeros_like(x)
    for i in np.ndindex(*x.shape):
        nudged = [a.copy() for a in (q, k, v)]
        nudged[("dq", "dk", "dv").index(name)][i] += eps
        numeric[i] = ((forward(*nudged)[0] - o) * do).sum() / eps
    print(f"{name}: largest difference from the numerical gradient {np.abs(grads[name] - numeric).max():.1e}")

# %% [markdown]
# ## The two loops
#
# S has a tile for every (query tile, key block) pair. `kv_kernel` runs down a column of them per
# block. By default every column is a block of its own, all adding to dQ at once; with
# `deterministic=True` one block takes the columns one after another.

# %%
notebooks.draw_backward_loops()

# %% [markdown]
# ## The kernels
#
# Straight from the package: what runs is what you read. First Δ, a few rows a warp. A kernel that
# only reads is as fast as the loads it keeps in flight: a warp with one row of D = 64 has one word of
# O and one of dO per lane to wait for, so each warp takes 4 rows (2 at D = 128) and issues all
# their loads first.

# %%
lesson.show_source(phase.build_delta_kernel)

# %% [markdown]
# Then `kv_kernel`: the block's keys and values in shared memory, query tiles streaming past, Pᵀ
# and dSᵀ recomputed per tile, dV and dK in registers, dQ by atomics. `build_kv_kernel` wires its
# roles, which follow it: a query tile's gradients, dQ, and the stream of query tiles.

# %%
lesson.show_source(phase.build_kv_kernel)

# %%
lesson.show_source(phase.make_tile_grads, phase.make_dq, phase.make_query_stream)

# %% [markdown]
# The element-by-element step of a tile (exercise 11-a), which phase 12 shares: each lane's
# elements of Sᵀ become Pᵀ, recomputed from its rows' log-sum-exp, and those of dPᵀ become dSᵀ.

# %%
lesson.show_source(phase.make_p_and_ds)

# %% [markdown]
# ## Is it correct?
#
# Fresh random inputs, dQ, dK and dV poisoned with NaN first, each compared with the float64
# reference's gradients (two query heads sharing one K/V head, so dK and dV are summed over the group).

# %%
lesson.check()

# %% [markdown]
# ## How fast is it?
#
# Beside torch SDPA's backward at the reference shape. The backward rows count 2.5× the forward's
# FLOPs (five products where the forward has two), the `-step` rows a whole training step of
# attention, forward and backward, 3.5×: FlashAttention's benchmark counts them so. It is still
# behind SDPA's flash backend (the cell says by how much). What it costs, as the profiler tells
# (docs/tuning/11_history.md): with dK and dV in registers a thread needs all 255 of them, so an SM runs
# one block of 8 warps, 2 per scheduler, and most cycles no warp is ready to issue; every
# instruction that is not an mma.sync is paid in full. The last changes (the docstring lists them)
# removed more than a quarter of kv_kernel's instructions.

# %%
timings = lesson.timing()

# %%
lesson.plot_timing(timings)

# %% [markdown]
# ## What changed in the machine code
#
# The three kernels, compiled for the H100: `kv_kernel` holds dK and dV (16 keys × D per warp, in
# float32) in registers for its whole loop, besides the tiles of Sᵀ and dPᵀ.

# %%
lesson.machine_code()

# %%
lesson.ptx(["mma.sync", "ldmatrix", "cp.async", "red.global.add.f32", "atom.global.add.f32", "ex2.approx"])

# %%
lesson.sass(["HMMA", "LDSM", "LDGSTS", "RED", "MUFU.EX2", "STL", "LDL"])

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

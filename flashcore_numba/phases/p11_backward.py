"""Phase 11 (first step) — the backward pass: dQ, dK and dV from the saved log-sum-exp.

Not yet on the ladder: this module holds the backward's algorithm in plain CUDA-core
arithmetic, so that training works and every later version has a correct one to be checked
against. The tensor-core version (phase 07's mma.sync machinery), its lesson, exercise and
records are the next steps; until then phases/__init__ does not list it.

The algorithm (FlashAttention-2's backward)
    The forward saved only the output O and each row's log-sum-exp L_i (natural log). Given dO,
    with P = softmax(scale · Q Kᵀ) (masked as the forward masked it):
        dV = Pᵀ dO,   dP = dO Vᵀ,   dS = P ∘ (dP − Δ),   dQ = scale · dS K,   dK = scale · dSᵀ Q,
    where Δ_i = Σ_j P_ij dP_ij = Σ_d dO_id O_id (the second form needs no P: `delta_kernel`).
    P is never stored: a block recomputes its tile of it from Q, K and L as
    P_ij = 2^(S_ij · scale · log2 e − L_i · log2 e), exactly the forward's probabilities.
    - `kv_kernel`: a block owns BLOCK_N keys of one K/V head and keeps their dK and dV in
      registers while it walks every query row that sees them, the group's query heads one after
      another (grouped-query attention: dK and dV are sums over the group, so the block that
      owns them adds them up with no atomics). Each query tile's share of dQ, dS K, is added to a
      float32 dQ in global memory by atomics: other key blocks add to the same rows.
    - `dq_kernel` (deterministic=True): atomics add in whatever order the blocks arrive, so the
      float32 sums of dQ can differ in their last bits run to run. This kernel instead owns
      BLOCK_M query rows and walks every key tile in order, recomputing P and dS a second time:
      bit-identical gradients, for the cost of that second pass.
    The inputs are float32 copies (the caller converts q, k, v, o and dO), the gradients float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32

from ..arch.sim import simulator_enabled
from .common import LOG2E, cdiv, key_end, launch

ID = "11"
NAME = "backward"
TITLE = "The backward pass: dQ, dK and dV recomputed from the log-sum-exp"
HEAD_DIMS = (64, 128)

BLOCK_M = 16  # query rows of a tile
BLOCK_N = 16  # keys of a tile
THREADS = 128  # threads of a block; a thread owns BLOCK_N * D / THREADS elements of dK and of dV
SIM_THREADS = 32  # the simulator: fewer Python threads per block


@dataclass(frozen=True)
class Backward:
    """The three kernels of one head dim and how to launch them (`run`)."""

    head_dim: int
    threads: int
    delta_kernel: object
    kv_kernel: object
    dq_kernel: object

    def run(self, Q, K, V, O, dO, LSE, dQ, dK, dV, causal: bool, scale: float, deterministic: bool = False,
            stream=0, dLSE=None):
        """dQ, dK, dV (float32, zeroed here where atomics add to them) from float32 (B, H, S, D) device
        arrays Q, K, V, O, dO and the forward's LSE (B, H, S_q), natural log; dLSE, if the LSE was
        used too, its gradient (B, H, S_q): d LSE_i / d s_ij = P_ij, so it joins dS as P ∘ dLSE."""
        B, H, S_q, D = Q.shape
        H_kv, S_k = K.shape[1], K.shape[2]
        delta = cuda.device_array((B, H, S_q), np.float32, stream=stream)
        launch(self.delta_kernel, (cdiv(S_q, BLOCK_M), H, B), self.threads, 0,
               (O, dO, delta if dLSE is None else dLSE, dLSE is not None, delta), stream)
        if not deterministic:
            _zero(dQ, stream)
        launch(self.kv_kernel, (cdiv(S_k, BLOCK_N), H_kv, B), self.threads, 0,
               (Q, K, V, dO, LSE, delta, dQ, dK, dV, causal, float32(scale), not deterministic), stream)
        if deterministic:
            launch(self.dq_kernel, (cdiv(S_q, BLOCK_M), H, B), self.threads, 0,
                   (Q, K, V, dO, LSE, delta, dQ, causal, float32(scale)), stream)


def _zero(array, stream) -> None:
    """Fill a float32 device array with zeros (the simulator has no memset)."""
    flat = array.reshape(array.size)
    launch(_zero_kernel, cdiv(flat.size, 256), 256, 0, (flat,), stream)


@cuda.jit
def _zero_kernel(X):
    i = cuda.grid(1)
    if i < X.shape[0]:
        X[i] = float32(0.0)


@lru_cache(maxsize=None)
def build(HEAD_DIM: int) -> Backward:
    """The backward kernels for head dim HEAD_DIM (64 or 128)."""
    if HEAD_DIM not in HEAD_DIMS:
        raise ValueError(f"head dim: the backward is built for {HEAD_DIMS}, not {HEAD_DIM}")
    D = HEAD_DIM
    NT = SIM_THREADS if simulator_enabled() else THREADS
    assert BLOCK_M == BLOCK_N and BLOCK_N * D % NT == 0, "a thread keeps as many elements of dQ as of dK"
    PER_THREAD = BLOCK_N * D // NT  # elements of dK (and of dV, dQ) each thread keeps
    TILE = BLOCK_M * BLOCK_N

    @cuda.jit
    def delta_kernel(O, dO, DLSE, use_dlse, DELTA):
        """Δ_i = Σ_d dO_id · O_id for BLOCK_M rows of one head, a thread per row; minus dLSE_i where
        the LSE has a gradient (dS = P ∘ (dP − Δ + dLSE))."""
        b, h = cuda.blockIdx.z, cuda.blockIdx.y
        i = cuda.blockIdx.x * BLOCK_M + cuda.threadIdx.x
        if cuda.threadIdx.x < BLOCK_M and i < O.shape[2]:
            total = float32(0.0)
            for d in range(D):
                total += dO[b, h, i, d] * O[b, h, i, d]
            if use_dlse:
                total -= DLSE[b, h, i]
            DELTA[b, h, i] = total

    @cuda.jit(device=True, inline=True)
    def probabilities(Qs, Ks, Ps, lse2, m0, n0, seq_q, seq_k, causal, qk_scale, tid):
        """P of the tile (rows m0.., keys n0..), recomputed: 2^(s · qk_scale − lse2) where the row
        sees the key, else 0 (as the forward masked it); a row that saw no key has lse2 = −inf and
        P = 0."""
        for e in range(tid, TILE, NT):
            i, j = e // BLOCK_N, e % BLOCK_N
            p = float32(0.0)
            if m0 + i < seq_q and n0 + j < key_end(m0 + i, seq_q, seq_k, causal) and lse2[i] != -math.inf:
                s = float32(0.0)
                for d in range(D):
                    s += Qs[i, d] * Ks[j, d]
                p = math.exp2(s * qk_scale - lse2[i])
            Ps[i, j] = p

    @cuda.jit(device=True, inline=True)
    def score_grads(dOs, Vs, Ps, dSs, delta, tid):
        """dS = P ∘ (dP − Δ) of the tile, dP = dO Vᵀ (only where P is not 0)."""
        for e in range(tid, TILE, NT):
            i, j = e // BLOCK_N, e % BLOCK_N
            ds = float32(0.0)
            if Ps[i, j] != float32(0.0):
                dp = float32(0.0)
                for d in range(D):
                    dp += dOs[i, d] * Vs[j, d]
                ds = Ps[i, j] * (dp - delta[i])
            dSs[i, j] = ds

    @cuda.jit(device=True, inline=True)
    def load_row_stats(lse2, delta, LSE, DELTA, b, h, m0, seq_q, tid):
        """The tile's rows' log-sum-exps (in base 2) and Δ; a row past seq_q sees nothing (−inf)."""
        if tid < BLOCK_M:
            inside = m0 + tid < seq_q
            lse2[tid] = LSE[b, h, m0 + tid] * float32(LOG2E) if inside else float32(-math.inf)
            delta[tid] = DELTA[b, h, m0 + tid] if inside else float32(0.0)

    @cuda.jit(device=True, inline=True)
    def load_rows(dst, X, b, h, r0, rows, tid):
        """Rows r0 .. r0 + len(dst) − 1 of head h into shared memory, zeros past `rows`."""
        for e in range(tid, dst.shape[0] * D, NT):
            r, d = e // D, e % D
            dst[r, d] = X[b, h, r0 + r, d] if r0 + r < rows else float32(0.0)

    @cuda.jit
    def kv_kernel(Q, K, V, dO, LSE, DELTA, dQ, dK, dV, causal, scale, atomic_dq):
        """dK and dV of BLOCK_N keys of one K/V head, over every query row of its group that sees
        them; with atomic_dq, each tile's dS K is added to dQ too."""
        b, h_kv, n0 = cuda.blockIdx.z, cuda.blockIdx.y, cuda.blockIdx.x * BLOCK_N
        tid = cuda.threadIdx.x
        H, seq_q, seq_k = Q.shape[1], Q.shape[2], K.shape[2]
        group = H // K.shape[1]
        qk_scale = scale * float32(LOG2E)
        Ks = cuda.shared.array((BLOCK_N, D), float32)
        Vs = cuda.shared.array((BLOCK_N, D), float32)
        Qs = cuda.shared.array((BLOCK_M, D), float32)
        dOs = cuda.shared.array((BLOCK_M, D), float32)
        Ps = cuda.shared.array((BLOCK_M, BLOCK_N), float32)
        dSs = cuda.shared.array((BLOCK_M, BLOCK_N), float32)
        lse2 = cuda.shared.array(BLOCK_M, float32)
        delta = cuda.shared.array(BLOCK_M, float32)
        dk = cuda.local.array(PER_THREAD, float32)  # element tid + e·NT of the (BLOCK_N, D) tile
        dv = cuda.local.array(PER_THREAD, float32)
        for e in range(PER_THREAD):
            dk[e] = float32(0.0)
            dv[e] = float32(0.0)
        load_rows(Ks, K, b, h_kv, n0, seq_k, tid)
        load_rows(Vs, V, b, h_kv, n0, seq_k, tid)
        # the first query row that sees key n0 (causal: row i sees keys up to i + seq_k − seq_q)
        first = max(0, n0 - (seq_k - seq_q)) if causal else 0
        for h in range(h_kv * group, (h_kv + 1) * group):
            for m0 in range(first - first % BLOCK_M, seq_q, BLOCK_M):
                cuda.syncthreads()  # the previous tile's P and dS are used up
                load_rows(Qs, Q, b, h, m0, seq_q, tid)
                load_rows(dOs, dO, b, h, m0, seq_q, tid)
                load_row_stats(lse2, delta, LSE, DELTA, b, h, m0, seq_q, tid)
                cuda.syncthreads()
                probabilities(Qs, Ks, Ps, lse2, m0, n0, seq_q, seq_k, causal, qk_scale, tid)
                score_grads(dOs, Vs, Ps, dSs, delta, tid)
                cuda.syncthreads()
                for e in range(PER_THREAD):  # dV += Pᵀ dO, dK += dSᵀ Q
                    j, d = (tid + e * NT) // D, (tid + e * NT) % D
                    for i in range(BLOCK_M):
                        dv[e] += Ps[i, j] * dOs[i, d]
                        dk[e] += dSs[i, j] * Qs[i, d]
                if atomic_dq:  # dQ += scale · dS K, this tile's share of rows m0..
                    for e in range(tid, BLOCK_M * D, NT):
                        i, d = e // D, e % D
                        if m0 + i < seq_q:
                            total = float32(0.0)
                            for j in range(BLOCK_N):
                                total += dSs[i, j] * Ks[j, d]
                            cuda.atomic.add(dQ, (b, h, m0 + i, d), total * scale)
        for e in range(PER_THREAD):
            j, d = (tid + e * NT) // D, (tid + e * NT) % D
            if n0 + j < seq_k:
                dK[b, h_kv, n0 + j, d] = dk[e] * scale
                dV[b, h_kv, n0 + j, d] = dv[e]

    @cuda.jit
    def dq_kernel(Q, K, V, dO, LSE, DELTA, dQ, causal, scale):
        """(deterministic) dQ of BLOCK_M rows of one query head, over every key tile in order."""
        b, h, m0 = cuda.blockIdx.z, cuda.blockIdx.y, cuda.blockIdx.x * BLOCK_M
        tid = cuda.threadIdx.x
        seq_q, seq_k = Q.shape[2], K.shape[2]
        h_kv = h // (Q.shape[1] // K.shape[1])
        qk_scale = scale * float32(LOG2E)
        Ks = cuda.shared.array((BLOCK_N, D), float32)
        Vs = cuda.shared.array((BLOCK_N, D), float32)
        Qs = cuda.shared.array((BLOCK_M, D), float32)
        dOs = cuda.shared.array((BLOCK_M, D), float32)
        Ps = cuda.shared.array((BLOCK_M, BLOCK_N), float32)
        dSs = cuda.shared.array((BLOCK_M, BLOCK_N), float32)
        lse2 = cuda.shared.array(BLOCK_M, float32)
        delta = cuda.shared.array(BLOCK_M, float32)
        dq = cuda.local.array(PER_THREAD, float32)  # element tid + e·NT of the (BLOCK_M, D) tile
        for e in range(PER_THREAD):
            dq[e] = float32(0.0)
        load_rows(Qs, Q, b, h, m0, seq_q, tid)
        load_rows(dOs, dO, b, h, m0, seq_q, tid)
        load_row_stats(lse2, delta, LSE, DELTA, b, h, m0, seq_q, tid)
        k_end = key_end(min(m0 + BLOCK_M, seq_q) - 1, seq_q, seq_k, causal)  # the block's last row sees most
        for n0 in range(0, k_end, BLOCK_N):
            cuda.syncthreads()  # the previous tile's K and dS are used up
            load_rows(Ks, K, b, h_kv, n0, seq_k, tid)
            load_rows(Vs, V, b, h_kv, n0, seq_k, tid)
            cuda.syncthreads()
            probabilities(Qs, Ks, Ps, lse2, m0, n0, seq_q, seq_k, causal, qk_scale, tid)
            score_grads(dOs, Vs, Ps, dSs, delta, tid)
            cuda.syncthreads()
            for e in range(PER_THREAD):  # dQ += dS K, the keys in order
                i, d = (tid + e * NT) // D, (tid + e * NT) % D
                for j in range(BLOCK_N):
                    dq[e] += dSs[i, j] * Ks[j, d]
        for e in range(PER_THREAD):
            i, d = (tid + e * NT) // D, (tid + e * NT) % D
            if m0 + i < seq_q:
                dQ[b, h, m0 + i, d] = dq[e] * scale

    return Backward(D, NT, delta_kernel, kv_kernel, dq_kernel)


def backward(q, k, v, o, do, lse, *, causal: bool = False, scale: float | None = None,
             deterministic: bool = False, dlse=None):
    """(dq, dk, dv) as float32 NumPy arrays from NumPy arrays: q (B, H, S_q, D), k and v (B, H_kv,
    S_k, D), the forward's output o and its lse (B, H, S_q, natural log), and the gradient of the
    output do. What the tests and the simulator use; attention()'s autograd calls Backward.run on
    torch tensors."""
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)  # attention's default
    arrays = [cuda.to_device(np.ascontiguousarray(x, dtype=np.float32)) for x in (q, k, v, o, do, lse)]
    dq = cuda.device_array(q.shape, np.float32)
    dk = cuda.device_array(k.shape, np.float32)
    dv = cuda.device_array(v.shape, np.float32)
    build(D).run(*arrays, dq, dk, dv, causal, scale, deterministic,
                 dLSE=None if dlse is None else cuda.to_device(np.ascontiguousarray(dlse, dtype=np.float32)))
    return dq.copy_to_host(), dk.copy_to_host(), dv.copy_to_host()


"""Phase 01 — naive: one thread per query row, online softmax, fp32 arithmetic.

What it does
    Each thread owns one query row. It keeps that row of q and its output accumulator `acc`
    in per-thread arrays and walks over every key it may see, one key at a time: a dot
    product q·k_j, an online-softmax update of the running max m_i and sum l_i, and
    acc = acc * alpha + p * v_j. Nothing is shared between threads; K and V are read
    straight from global memory for every query row.

Why it is slow
    Every K and V element is fetched from memory once per query row: S times over. The
    threads of a warp read the same k_j at the same time, so caches absorb much of it, but
    each FMA still waits on a load, and the accumulator is rescaled after every single key.
    The online softmax itself (never materializing the S×S score matrix) is already the
    FlashAttention idea; every later phase keeps it and changes only how data moves.

    This naive kernel measures faster than FlashCore's C++ naive kernel (0.65-1.6 TFLOPS):
    HEAD_DIM is a compile-time constant, so the loops over d unroll and q and acc live in
    registers (the record shows 0 bytes of local memory), and since all threads of a warp
    read the same k_j[d] together, one cached load serves the whole warp.

Measured effect (written by `flashcore report` from the committed record; do not edit by hand)
    [measured:begin]
    NVIDIA H100 80GB HBM3, 2026-12-06, B=16 H=16 S=2048 D=64 fp16: 5.79 TFLOPS, causal 5.25 TFLOPS;
    168 registers, 0 B local memory. At B=16 H=16 S=2048 D=128 fp16: 3.03 TFLOPS, causal 2.83 TFLOPS
    (nvidia-h100-80gb-hbm3_b16h16s2048d64_fp16[_causal].json,
    nvidia-h100-80gb-hbm3_b16h16s2048d128_fp16[_causal].json). Every shape and dtype measured:
    docs/performance.md.
    [measured:end]
"""

from __future__ import annotations

import math
from functools import lru_cache

from numba import cuda, float32

from .common import KernelConfig, finalize, key_end, softmax_rescale

ID = "01"
NAME = "naive"
TITLE = "Naive: one thread per query row"
HEAD_DIMS = (64, 128)

BLOCK_M = 128  # query rows (= threads) per block


@lru_cache(maxsize=None)
def build(HEAD_DIM: int) -> KernelConfig:
    """Compile-time specialization: HEAD_DIM is baked into the kernel as a constant."""

    @cuda.jit
    def naive_attention(Q, K, V, O, causal, qk_scale):
        b = cuda.blockIdx.z
        h = cuda.blockIdx.y
        row = cuda.blockIdx.x * BLOCK_M + cuda.threadIdx.x
        seq_q = Q.shape[2]
        seq_k = K.shape[2]
        if row >= seq_q:
            return

        # -- load this thread's query row, convert to fp32
        q = cuda.local.array(HEAD_DIM, float32)
        acc = cuda.local.array(HEAD_DIM, float32)
        for d in range(HEAD_DIM):
            q[d] = float32(Q[b, h, row, d])
            acc[d] = float32(0.0)
        m_i = float32(-math.inf)
        l_i = float32(0.0)

        # -- walk over the keys this row may see, one at a time
        for j in range(key_end(row, seq_q, seq_k, causal)):
            s = float32(0.0)
            for d in range(HEAD_DIM):
                s += q[d] * float32(K[b, h, j, d])
            s *= qk_scale
            # >>> exercise 01: the online-softmax update for key j (m_i, l_i, then acc)
            # -- update m_i and l_i
            m_new, m_ref, alpha = softmax_rescale(m_i, s)
            p = math.exp2(s - m_ref)
            l_i = l_i * alpha + p
            # -- update acc: rescale to the new max, add p * v_j
            for d in range(HEAD_DIM):
                acc[d] = acc[d] * alpha + p * float32(V[b, h, j, d])
            m_i = m_new
            # <<< exercise

        # -- epilogue
        for d in range(HEAD_DIM):
            O[b, h, row, d] = finalize(acc[d], l_i)

    return KernelConfig(naive_attention, block_m=BLOCK_M, n_threads=BLOCK_M, smem_bytes=0)

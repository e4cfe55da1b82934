# Exercise 08: Hopper wgmma: tiles multiplied from shared-memory descriptors
#
# This is the finished phase 08 kernel with 2 marked regions emptied:
#   08-a: the row maxima m_ij_a, m_ij_b over the quad of lanes that hold the rows
#   08-b: p_frag[kk, a0..a3] = pack(x, y) of s: rows g, g+8 of column block 2kk, then of 2kk+1
# Write the missing lines between each `# >>> exercise` line and its `# <<< exercise` line.
# Change nothing else: solving only adds lines. The lesson is lessons/08_wgmma.ipynb.
#
# Grade it (hidden random inputs and adversarial shapes; points and reasons per check):
#     flashcore grade 08                         this file
#     flashcore grade 08 path/to/copy.py         a copy of it
#     pytest lessons/exercises --grade 08        the same checks, as pytest tests
# Without a GPU the kernel runs in Numba's CUDA simulator (slow) and the timing checks are skipped.
# Stuck? `flashcore grade 08 --hint` gives a hint per region (--hint 2, 3: more);
# the solution is flashcore_numba/phases/p08_wgmma.py.
#
# Generated from that file by `python -m flashcore_numba.course.exercises --write`:
# improve the phase, not this copy.
"""Phase 08 — Hopper's wgmma: warpgroups multiply tiles straight from shared memory.

The whole account of this phase (what it changes, why the hardware rewards it, what each
change bought) is the docstring of flashcore_numba/phases/p08_wgmma.py; the lesson is
lessons/08_wgmma.ipynb.
"""

from __future__ import annotations

import math
from functools import lru_cache

from numba import cuda, float32, uint32, uint64

from flashcore_numba.arch import operands, ptx
from flashcore_numba.arch.sim import simulator_enabled
from flashcore_numba.phases.common import (FULL_MASK, MMA_N, PTX_TYPE, KernelConfig, fragment_epilogue, key_end, make_exp_and_sum,
                     mask_scores, row_max, softmax_rescale, store_lse)

ID = "08"
NAME = "wgmma"
TITLE = "Hopper wgmma: tiles multiplied from shared-memory descriptors"
HEAD_DIMS = (64, 128)
DTYPES = ("float16", "bfloat16")
GQA = True
LSE = True  # return_lse: the kernel can write each row's log-sum-exp (common.store_lse)
MIN_CC = MAX_CC = (9, 0)  # wgmma exists on Hopper alone (sm_90a): not before, not after

WG_M = 64  # rows of one wgmma: a warpgroup's share of the query block
BLOCK_N = 64  # keys per tile (the n of S's wgmma, the k of P·V's)
ROW = 128  # bytes of one row of a 128-byte-swizzle atom (64 fp16)
ATOM = WG_M * ROW  # one atom of a 64-row tile: 64 columns of d, 8192 bytes
GROUP = 8 * ROW  # eight rows: the SBO of every descriptor here
MMA_K = 16  # the k-step of P's A fragments (MMA_N, the accumulator's 8-column blocks: common.py)

SIM_WARPGROUPS = 1  # 128 threads per block in the simulator (one Python thread each)
WARPGROUPS = 2


def layout(HEAD_DIM, warpgroups):
    """Every derived constant. Shared memory holds Q (BLOCK_M rows, one 64-row tile per warpgroup),
    then two stages of K and V (BLOCK_N rows each), every 64-row tile as D / 64 swizzled atoms;
    offsets in bytes, all multiples of 1024 (the swizzle's alignment)."""
    L = dict(HEAD_DIM=HEAD_DIM, WARPGROUPS=warpgroups, BLOCK_M=WG_M * warpgroups, BLOCK_N=BLOCK_N)
    L["N_THREADS"] = 128 * warpgroups
    assert (BLOCK_N * HEAD_DIM // 8) % L["N_THREADS"] == 0, "every thread copies the same number of chunks"
    L["CHUNKS"] = HEAD_DIM // 8  # 16-byte chunks per row
    L["Q_OFF"] = 0
    L["K_OFF"] = L["BLOCK_M"] * HEAD_DIM * 2
    L["V_OFF"] = L["K_OFF"] + BLOCK_N * HEAD_DIM * 2
    L["STAGE_BYTES"] = 2 * BLOCK_N * HEAD_DIM * 2
    L["SMEM_BYTES"] = L["K_OFF"] + 2 * L["STAGE_BYTES"]
    L["NT"] = BLOCK_N // MMA_N  # 8-column blocks of S per thread
    L["KP"] = BLOCK_N // MMA_K  # k-steps of P·V
    L["NO"] = HEAD_DIM // MMA_N  # 8-column blocks of O
    return L


def make_copy_tile(L):
    """Global -> shared by cp.async into the 128-byte swizzle layout: chunk c of row r of a
    64-row tile lands in atom c // 8, row r, chunk (c % 8) ^ (r % 8). Consecutive threads take
    consecutive chunks of a row: 128-byte global reads, and writes to the eight different
    chunks of one 128-byte row, which never share a bank."""
    copy16 = ptx.function("cp_async.ptx", "flashcore_cp_async_16", "inline")
    CHUNKS, N_THREADS = L["CHUNKS"], L["N_THREADS"]
    TILE_BYTES = WG_M * L["HEAD_DIM"] * 2

    @cuda.jit(device=True, inline=True)
    def copy_tile(smem, offset, src_base, head_bytes, row0, n_rows, seq_len, tid):
        """Start copying rows row0 .. row0+n_rows-1 of one head (at src_base + head_bytes) to smem+offset.

        A row past seq_len copies 0 bytes and is zero-filled (its address is clamped to a real row).
        """
        for i in range(n_rows * CHUNKS // N_THREADS):
            c = tid + i * N_THREADS
            r, chunk = c // CHUNKS, c % CHUNKS
            row = row0 + r
            n_bytes = uint32(16) if row < seq_len else uint32(0)
            src = src_base + head_bytes + uint64(min(row, seq_len - 1)) * uint64(CHUNKS * 16) + uint64(chunk * 16)
            tile, r64 = r // WG_M, r % WG_M  # Q holds one 64-row tile per warpgroup
            dst = tile * TILE_BYTES + (chunk // 8) * ATOM + r64 * ROW + ((chunk % 8) ^ (r64 % 8)) * 16
            copy16(smem + offset + dst, src, n_bytes)

    return copy_tile


def build_kernel(L, dtype="float16") -> KernelConfig:
    kind = PTX_TYPE[dtype]
    HEAD_DIM = L["HEAD_DIM"]
    qk = ptx.function("wgmma.ptx", f"flashcore_wgmma_qk_d{HEAD_DIM}_{kind}", "inline")
    pv = ptx.function("wgmma.ptx", f"flashcore_wgmma_pv_d{HEAD_DIM}_{kind}", "inline")
    fence_proxy_async = ptx.function("wgmma.ptx", "flashcore_fence_proxy_async", "inline")
    pack = ptx.function("mma_sync.ptx", f"flashcore_pack_{kind}x2", "inline")
    # p = exp2(s · scale - m) by one MUFU.EX2 a score, no subnormal fix-ups (common.py)
    exp_and_sum = make_exp_and_sum(ptx.function("exp2.ptx", "flashcore_exp2", "inline"))
    commit = ptx.function("cp_async.ptx", "flashcore_cp_async_commit", "inline")
    wait_all = ptx.function("cp_async.ptx", "flashcore_cp_async_wait_0", "inline")
    shared_address, global_address = operands.shared_address, operands.global_address
    descriptor = operands.matrix_descriptor
    copy_tile = make_copy_tile(L)
    BLOCK_M = L["BLOCK_M"]
    SW128 = operands.SWIZZLE_128B
    K_OFF, V_OFF, STAGE_BYTES = L["K_OFF"], L["V_OFF"], L["STAGE_BYTES"]
    NT, KP, NO = L["NT"], L["KP"], L["NO"]
    store_rows = fragment_epilogue(pack, NO)  # the epilogue (common.py)
    Q_WG_BYTES = WG_M * HEAD_DIM * 2  # one warpgroup's 64 rows of Q
    Q_WORDS, N_THREADS = BLOCK_M * HEAD_DIM // 2, L["N_THREADS"]

    @cuda.jit
    def wgmma_attention(Q, K, V, O, LSE, causal, qk_scale):
        smem_h = cuda.shared.array(0, uint32, alignment=1024)
        smem = shared_address(smem_h)
        b = cuda.blockIdx.z
        h = cuda.blockIdx.y
        # grouped-query attention: several q heads per k/v head. In 32-bit unsigned arithmetic: a
        # 64-bit division is a subroutine call in SASS, and ptxas serializes every wgmma of a
        # kernel that makes a call
        h_kv = uint32(uint32(h) * uint32(K.shape[1])) // uint32(Q.shape[1])
        tid = cuda.threadIdx.x
        wg = tid // 128  # this thread's warpgroup
        warp = (tid % 128) // 32  # and its warp in it: rows 16 warp .. 16 warp + 15 of the 64
        lane = tid % 32
        g = lane // 4  # this lane's rows of every fragment: g and g + 8
        t = lane % 4  # and its columns: 2t, 2t + 1 of every 8-column block
        row0 = cuda.blockIdx.x * BLOCK_M
        seq_q = Q.shape[2]
        seq_k = K.shape[2]
        head_q = uint64(((b * Q.shape[1] + h) * seq_q) * HEAD_DIM * 2)
        head_kv = uint64(((b * K.shape[1] + h_kv) * seq_k) * HEAD_DIM * 2)
        row_a = row0 + wg * WG_M + warp * 16 + g  # the lane's two query rows
        row_b = row_a + 8
        k_end_a = key_end(min(row_a, seq_q - 1), seq_q, seq_k, causal)
        k_end_b = key_end(min(row_b, seq_q - 1), seq_q, seq_k, causal)

        s = cuda.local.array((NT, 4), float32)
        p_frag = cuda.local.array((KP, 4), uint32)
        acc = cuda.local.array((NO, 4), float32)
        for j in range(NO):
            for e in range(4):
                acc[j, e] = float32(0.0)
        m_a = float32(-math.inf)
        m_b = float32(-math.inf)
        l_a = float32(0.0)
        l_b = float32(0.0)
        # qk_scale folded into exp2 as in phase 07: a negative one flips the sign of q (below)
        scale = max(abs(qk_scale), float32(1e-30))

        # -- descriptors, 128-byte swizzle: K-major Q and K (SBO between groups of eight rows; LBO
        # unused), MN-major V (SBO between groups of eight keys, LBO between atoms of d)
        desc_q = descriptor(smem + wg * Q_WG_BYTES, 16, GROUP, SW128)

        # -- prologue: Q and the first K/V tile, one cp.async group
        block_k_end = key_end(min(row0 + BLOCK_M, seq_q) - 1, seq_q, seq_k, causal)
        copy_tile(smem, 0, global_address(Q), head_q, row0, BLOCK_M, seq_q, tid)
        copy_tile(smem, K_OFF, global_address(K), head_kv, 0, BLOCK_N, seq_k, tid)
        copy_tile(smem, V_OFF, global_address(V), head_kv, 0, BLOCK_N, seq_k, tid)
        commit()
        wait_all()
        if qk_scale < 0:  # flip the sign bit of every 16-bit value of Q, once
            cuda.syncthreads()
            for i in range(Q_WORDS // N_THREADS):
                smem_h[tid + i * N_THREADS] ^= uint32(0x80008000)
        fence_proxy_async()  # this thread's writes become visible to the tensor cores' reads...
        cuda.syncthreads()  # ...once every thread has made them

        stage = 0
        for start_n in range(0, block_k_end, BLOCK_N):
            next_n = start_n + BLOCK_N
            if next_n < block_k_end:  # -- the next tile flies into the other stage meanwhile
                copy_tile(smem, K_OFF + (1 - stage) * STAGE_BYTES, global_address(K), head_kv, next_n, BLOCK_N,
                          seq_k, tid)
                copy_tile(smem, V_OFF + (1 - stage) * STAGE_BYTES, global_address(V), head_kv, next_n, BLOCK_N,
                          seq_k, tid)
                commit()
            desc_k = descriptor(smem + K_OFF + stage * STAGE_BYTES, 16, GROUP, SW128)
            desc_v = descriptor(smem + V_OFF + stage * STAGE_BYTES, ATOM, GROUP, SW128)

            # -- s = q · kᵀ: one warpgroup-wide call, HEAD_DIM / 16 wgmmas
            s_tile = qk(desc_q, desc_k)
            for j in range(NT):
                for e in range(4):
                    s[j, e] = s_tile[4 * j + e]

            # -- mask only a tile that crosses the diagonal or the end of the keys; raw row maxima
            masked = start_n + BLOCK_N > min(k_end_a, k_end_b)
            if masked:  # one branch around the loop, not one per column block (see the changelog)
                mask_scores(s, 0, NT, start_n, t, k_end_a, k_end_b)
            m_ij_a, m_ij_b = row_max(s, 0, NT, float32(-math.inf), float32(-math.inf))  # this lane's columns
            # >>> exercise 08-a: the row maxima m_ij_a, m_ij_b over the quad of lanes that hold the rows
            # <<< exercise
            m_ij_a *= scale  # the max of the scaled scores (scale > 0; -inf stays -inf)
            m_ij_b *= scale

            # -- update m_i and l_i (per-lane partial sums)
            m_new_a, m_ref_a, alpha_a = softmax_rescale(m_a, m_ij_a)
            m_new_b, m_ref_b, alpha_b = softmax_rescale(m_b, m_ij_b)
            # p = exp2(s · scale - m_ref): one FFMA, one MUFU.EX2 (ptx/exp2.ptx) a score
            sum_a, sum_b = exp_and_sum(s, 0, NT, scale, m_ref_a, m_ref_b, float32(0.0), float32(0.0))
            l_a = l_a * alpha_a + sum_a
            l_b = l_b * alpha_b + sum_b
            m_a = m_new_a
            m_b = m_new_b

            # -- p as A fragments: the accumulators of 8-column blocks 2kk and 2kk+1 are k-step kk's A
            # >>> exercise 08-b: p_frag[kk, a0..a3] = pack(x, y) of s: rows g, g+8 of column block 2kk, then of 2kk+1
            # <<< exercise

            # -- acc = alpha · acc + p · v: one warpgroup-wide call, 4 wgmmas of 16 keys
            o_tile = pv(p_frag[0, 0], p_frag[0, 1], p_frag[0, 2], p_frag[0, 3],
                        p_frag[1, 0], p_frag[1, 1], p_frag[1, 2], p_frag[1, 3],
                        p_frag[2, 0], p_frag[2, 1], p_frag[2, 2], p_frag[2, 3],
                        p_frag[3, 0], p_frag[3, 1], p_frag[3, 2], p_frag[3, 3], desc_v)
            for j in range(NO):
                acc[j, 0] = cuda.fma(acc[j, 0], alpha_a, o_tile[4 * j + 0])
                acc[j, 1] = cuda.fma(acc[j, 1], alpha_a, o_tile[4 * j + 1])
                acc[j, 2] = cuda.fma(acc[j, 2], alpha_b, o_tile[4 * j + 2])
                acc[j, 3] = cuda.fma(acc[j, 3], alpha_b, o_tile[4 * j + 3])

            # -- the next tile has landed (this thread's copies), and every warp is done with this one
            wait_all()
            fence_proxy_async()
            cuda.syncthreads()
            stage = 1 - stage

        # -- epilogue: the rows' sums over the quad, o = acc / l_i, packed pairs (common.py)
        store_rows(O, b, h, row_a, row_b, seq_q, t, acc, l_a, l_b)
        if LSE.shape[2] != 0:  # return_lse: each row's log-sum-exp too (common.py)
            store_lse(LSE, b, h, row_a, row_b, seq_q, t, l_a, l_b, m_a, m_b)

    return KernelConfig(wgmma_attention, block_m=BLOCK_M, n_threads=L["N_THREADS"], smem_bytes=L["SMEM_BYTES"],
                        packed_output=True, lse=True)


@lru_cache(maxsize=None)
def build(HEAD_DIM: int, dtype: str = "float16") -> KernelConfig:
    """The kernel for head dim HEAD_DIM and `dtype` ("float16" or "bfloat16")."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: phase 08 builds {' and '.join(DTYPES)}, not {dtype!r}")
    warpgroups = SIM_WARPGROUPS if simulator_enabled() else WARPGROUPS
    return build_kernel(layout(HEAD_DIM, warpgroups), dtype)

"""Phase 05 — double buffering: load tile j+1 while computing tile j.

What changed from phase 04
    Phase 04 loads a K/V tile straight into shared memory and then waits at a barrier until
    it has arrived: while the loads travel (hundreds of cycles), the FP32 units idle. Now
    the load is split in two. `prefetch_tile` issues the global loads of the *next* K tile
    into registers and returns at once; the scores of the current tile are computed while
    those loads are in flight; `store_tile` then writes the registers into the other of two
    shared-memory buffers (stages). The next V tile does the same behind the softmax and P·V.
    One barrier per tile instead of two: it both publishes the next tile and retires the
    current one.

Why the hardware rewards it
    A load instruction does not block; only the first use of its result does. Issuing the
    loads a whole tile of arithmetic before their use hides global-memory latency behind
    compute (software pipelining), even with few warps per SM. The price: two K/V buffers
    in shared memory and PER_THREAD extra registers. Prefetching K and V separately, each
    behind half of the arithmetic, keeps only one tile operand in registers at a time:
    prefetching both at the top of the loop needed twice the registers and spilled.

    Phase 04 already hides some latency across blocks: while one block waits for its tile,
    another block on the same SM computes. Double buffering hides it inside each block, which
    pays most when few blocks fit on an SM (here the larger shared-memory footprint leaves one).

Measured effect (written by `flashcore report` from the committed record; do not edit by hand)
    [measured:begin]
    NVIDIA H100 80GB HBM3, 2026-12-06, B=16 H=16 S=2048 D=64 fp16: 29.7 TFLOPS (1.27x phase 04),
    causal 26.1 TFLOPS (1.27x phase 04); 244 registers, 0 B local memory. At B=16 H=16 S=2048 D=128
    fp16: 28.6 TFLOPS (1.43x phase 04), causal 25.6 TFLOPS (1.44x phase 04)
    (nvidia-h100-80gb-hbm3_b16h16s2048d64_fp16[_causal].json,
    nvidia-h100-80gb-hbm3_b16h16s2048d128_fp16[_causal].json). Every shape and dtype measured:
    docs/performance.md.
    [measured:end]
"""

from __future__ import annotations

from functools import lru_cache

from numba import cuda, float32
from numba.types import float16

from .common import KernelConfig, key_end, load_tile, uidx
from .p03_warp_shuffle import TILES, layout, make_tile_functions, tiles
from .p04_padding import SMEM_PAD

ID = "05"
NAME = "double_buffer"
TITLE = "Double buffering: prefetch the next tile"
HEAD_DIMS = (64, 128)

STAGES = 2  # shared-memory buffers for K/V: one being computed on, one being filled


def make_pipeline_functions(L):
    """Split tile load: global -> registers (prefetch), registers -> shared (store)."""
    HEAD_DIM, BLOCK_N, N_THREADS = L["HEAD_DIM"], L["BLOCK_N"], L["N_THREADS"]
    PER_THREAD = BLOCK_N * HEAD_DIM // N_THREADS  # tile elements each thread carries
    assert PER_THREAD * N_THREADS == BLOCK_N * HEAD_DIM

    @cuda.jit(device=True, inline=True)
    def prefetch_tile(regs, src, b, h, row0, seq_len, tid):
        """Issue the global loads of one tile into registers; nothing waits for them here.

        Rows past the end of the sequence re-read its last row: finite values, and the mask
        gives their keys p = 0, so they add nothing (no branch, no zero to materialize).
        """
        for i in range(PER_THREAD):
            idx = tid + i * N_THREADS  # consecutive threads, consecutive elements: coalesced
            row = min(row0 + idx // HEAD_DIM, seq_len - 1)
            regs[i] = src[uidx(b), uidx(h), uidx(row), uidx(idx % HEAD_DIM)]

    @cuda.jit(device=True, inline=True)
    def store_tile(smem, base, row_stride, regs, tid):
        """Write a prefetched tile into shared memory as fp32 (first use of the loaded values)."""
        for i in range(PER_THREAD):
            idx = tid + i * N_THREADS
            smem[uidx(base + (idx // HEAD_DIM) * row_stride + idx % HEAD_DIM)] = float32(regs[i])

    return PER_THREAD, prefetch_tile, store_tile


def build_kernel(L) -> KernelConfig:
    lane_of, init_rows, scores_tile, softmax_tile, pv_tile, store_output = make_tile_functions(L)
    PER_THREAD, prefetch_tile, store_tile = make_pipeline_functions(L)
    HEAD_DIM, BLOCK_M, BLOCK_N, N_THREADS = L["HEAD_DIM"], L["BLOCK_M"], L["BLOCK_N"], L["N_THREADS"]
    TM, TD, TN = L["TM"], L["TD"], L["TN"]
    Q_OFF, K_OFF, V_OFF, STAGE_FLOATS = L["Q_OFF"], L["K_OFF"], L["V_OFF"], L["STAGE_FLOATS"]
    Q_STRIDE, K_STRIDE, V_STRIDE = L["Q_STRIDE"], L["K_STRIDE"], L["V_STRIDE"]

    @cuda.jit
    def double_buffered_attention(Q, K, V, O, causal, qk_scale):
        smem = cuda.shared.array(0, float32, alignment=16)
        b = cuda.blockIdx.z
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        row0 = cuda.blockIdx.x * BLOCK_M
        seq_q = Q.shape[2]
        seq_k = K.shape[2]
        lane_row, lane_col = lane_of(tid)

        m_i = cuda.local.array(TM, float32)
        l_i = cuda.local.array(TM, float32)
        acc = cuda.local.array((TM, TD), float32)
        s = cuda.local.array((TM, TN), float32)
        regs = cuda.local.array(PER_THREAD, float16)  # one tile operand in flight
        init_rows(m_i, l_i, acc)

        load_tile(smem, Q_OFF, Q_STRIDE, Q, b, h, row0, seq_q, tid, N_THREADS, BLOCK_M, HEAD_DIM)
        block_k_end = key_end(min(row0 + BLOCK_M, seq_q) - 1, seq_q, seq_k, causal)
        # -- prologue: tile 0 into stage 0
        load_tile(smem, K_OFF, K_STRIDE, K, b, h, 0, seq_k, tid, N_THREADS, BLOCK_N, HEAD_DIM)
        load_tile(smem, V_OFF, V_STRIDE, V, b, h, 0, seq_k, tid, N_THREADS, BLOCK_N, HEAD_DIM)
        cuda.syncthreads()

        stage = 0
        for start_n in range(0, block_k_end, BLOCK_N):
            has_next = start_n + BLOCK_N < block_k_end
            next_n = start_n + BLOCK_N
            k_next = K_OFF + (1 - stage) * STAGE_FLOATS  # the other stage: nobody reads it now
            v_next = V_OFF + (1 - stage) * STAGE_FLOATS
            # >>> exercise 05-a: prefetch the next K tile (keys next_n ..) into regs
            if has_next:
                prefetch_tile(regs, K, b, h, next_n, seq_k, tid)
            # <<< exercise
            # -- s = q · kᵀ while the K loads travel; then they land in the other stage
            scores_tile(s, smem, K_OFF + stage * STAGE_FLOATS, lane_row, lane_col)
            if has_next:
                store_tile(smem, k_next, K_STRIDE, regs, tid)
            # >>> exercise 05-b: prefetch the next V tile into regs
            if has_next:
                prefetch_tile(regs, V, b, h, next_n, seq_k, tid)
            # <<< exercise
            # -- softmax and acc += p · v while the V loads travel
            softmax_tile(s, m_i, l_i, acc, smem, row0, lane_row, lane_col, start_n, seq_q, seq_k,
                         causal, qk_scale)
            cuda.syncwarp()
            pv_tile(acc, smem, V_OFF + stage * STAGE_FLOATS, lane_row, lane_col)
            if has_next:
                store_tile(smem, v_next, V_STRIDE, regs, tid)
            # -- one barrier publishes tile j+1 and retires tile j
            cuda.syncthreads()
            stage = 1 - stage
        store_output(O, b, h, row0, lane_row, lane_col, acc, l_i, seq_q)

    return KernelConfig(double_buffered_attention, block_m=BLOCK_M, n_threads=N_THREADS,
                        smem_bytes=L["SMEM_FLOATS"] * 4)


def smem_layout(HEAD_DIM: int, tile_shape=None) -> dict:
    """The shared-memory layout of this phase (the GPU's tiles unless `tile_shape` is given)."""
    return layout(HEAD_DIM, SMEM_PAD, **(tile_shape or TILES[HEAD_DIM]), stages=STAGES)


@lru_cache(maxsize=None)
def build(HEAD_DIM: int) -> KernelConfig:
    return build_kernel(smem_layout(HEAD_DIM, tiles(HEAD_DIM)))

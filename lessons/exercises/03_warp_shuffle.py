# Exercise 03: Warp-shuffle softmax and register tiles
#
# This is the finished phase 03 kernel with 2 marked regions emptied:
#   03-a: reduce m_ij to the max over the LANES_PER_ROW lanes of this row
#   03-b: sum the per-lane partial row sums over the LANES_PER_ROW lanes
# Write the missing lines between each `# >>> exercise` line and its `# <<< exercise` line.
# Change nothing else: solving only adds lines. The docstring below is the lesson.
#
# Grade it (hidden random inputs and adversarial shapes; points and reasons per check):
#     flashcore grade 03                         this file
#     flashcore grade 03 path/to/copy.py         a copy of it
#     pytest lessons/exercises --grade 03        the same checks, as pytest tests
# Without a GPU the kernel runs in Numba's CUDA simulator (slow) and the timing checks are skipped.
# Stuck? `flashcore grade 03 --hint` gives a hint per region (--hint 2, 3: more);
# the solution is flashcore_numba/phases/p03_warp_shuffle.py.
#
# Generated from that file by `python -m flashcore_numba.course.exercises --write`:
# improve the phase, not this copy.
"""Phase 03 — warp-shuffle softmax: warps own rows, lanes split the keys, registers hold the tiles.

What changed from phase 02
    In phase 02 one thread did all the work of one row: one shared-memory load for every FMA.
    Now a warp owns ROWS_PER_WARP rows and its 32 lanes split them like a small
    matrix-multiply tile: the lanes form 32/LANES_PER_ROW groups, a group shares TM rows, and
    inside a group each of the LANES_PER_ROW lanes takes every LANES_PER_ROW-th key of the
    tile. Each lane therefore computes a TM×TN block of scores as an outer product: per
    VEC = 4 steps along d it loads 4 values of each of its TM q rows and TN k rows, one
    16-byte instruction per row (rows start on 16-byte boundaries, and the shared array is
    declared with alignment=16 so the compiler may use ld.shared.v4), and does 4·TM·TN FMAs,
    all in registers.

    A row's scores are now spread over the LANES_PER_ROW lanes of its group, so the row max
    is a warp reduction: `shfl_xor_sync` with offsets LANES_PER_ROW/2 .. 1 exchanges
    registers directly between lanes, no shared memory, no block barrier. The row sum l_i
    needs no shuffle inside the loop: each lane keeps a partial sum (alpha is the same on all
    lanes of a row), reduced once in the epilogue. p goes through a per-warp slice of shared
    memory to the P·V product, where each lane accumulates a TM×TD block of acc in registers.
    Only `syncwarp` separates the two products: no other warp reads those rows.

Why the hardware rewards it
    Register tiling: 4·TM·TN FMAs per TM+TN shared-memory instructions (64 per 12 at D = 64)
    instead of 1 per 1, so the FP32 units, not the load/store units, can become the limit.
    Shuffles move 4 bytes between lanes in one instruction without touching shared memory.

What is still wrong (phase 04 fixes it), and why this phase is slower than phase 02
    A 16-byte load is served a quarter-warp (8 lanes) at a time. The 8 lanes of a quarter
    read rows lane_col, lane_col + 1, ... of the K tile at the same d: addresses HEAD_DIM
    words apart. With HEAD_DIM = 64 (a multiple of the 32 banks) all 8 land in the same four
    banks, an 8-way bank conflict on every k load: the load takes 8 passes instead of one.
    `flashcore_numba.measure.banks.warp_tile_conflicts` counts it. That conflict costs more than
    the register tiling saves, so this phase is measured slower than phase 02 (the record
    says by how much): the price of the lesson, paid back in phase 04.

Measured effect (written by `flashcore report` from the committed record; do not edit by hand)
    [measured:begin]
    NVIDIA H100 80GB HBM3, 2026-12-06, B=16 H=16 S=2048 D=64 fp16: 14.8 TFLOPS (0.72x phase 02,
    SLOWER than phase 02), causal 13.3 TFLOPS (0.74x phase 02, SLOWER than phase 02); 168 registers,
    0 B local memory. At B=16 H=16 S=2048 D=128 fp16: 10.0 TFLOPS (1.37x phase 02), causal 9.20
    TFLOPS (1.39x phase 02) (nvidia-h100-80gb-hbm3_b16h16s2048d64_fp16[_causal].json,
    nvidia-h100-80gb-hbm3_b16h16s2048d128_fp16[_causal].json). Every shape and dtype measured:
    docs/performance.md.
    [measured:end]
"""

from __future__ import annotations

import math
from functools import lru_cache

from numba import cuda, float32

from flashcore_numba.arch.sim import arithmetic_device_function, simulator_enabled
from flashcore_numba.phases.common import FULL_MASK, KernelConfig, finalize, key_end, load_tile, softmax_rescale, uidx

ID = "03"
NAME = "warp_shuffle"
TITLE = "Warp-shuffle softmax and register tiles"
HEAD_DIMS = (64, 128)

SMEM_PAD = 0  # phase 04 pads shared-memory rows; here rows are packed

# Tile shape per head dim, shared by phases 03-05 so that their diffs show only their idea.
# Picked by a sweep on the H100 for the fastest phase 05; with D = 128 a 64-key tile would need
# 230 KB of shared memory in phase 05, over the 227 KB a block may have.
#   BLOCK_M        query rows per block
#   BLOCK_N        keys per tile
#   NUM_WARPS      warps per block; each owns BLOCK_M / NUM_WARPS rows
#   LANES_PER_ROW  lanes that share one row: its reduction takes log2(LANES_PER_ROW) shuffles
TILES = {
    64: dict(block_m=128, block_n=64, num_warps=8, lanes_per_row=16),
    128: dict(block_m=128, block_n=32, num_warps=8, lanes_per_row=8),
}
# The simulator runs one Python thread per CUDA thread: there the same kernels are built with small
# tiles (2 warps, 16-key tiles), so that a tiny test problem still spans several blocks and tiles.
# The GPU tests run the shapes above; `smem_layout` always describes the GPU's.
SIM_TILES = dict(block_m=32, block_n=16, num_warps=2, lanes_per_row=8)


def tiles(HEAD_DIM: int) -> dict:
    """The tile shape the kernels are built with here: TILES on a GPU, SIM_TILES in the simulator."""
    return SIM_TILES if simulator_enabled() else TILES[HEAD_DIM]


VEC = 4  # fp32 values per 16-byte shared-memory access (ld.shared.v4.f32)


def layout(HEAD_DIM, smem_pad, block_m, block_n, num_warps, lanes_per_row, stages=1):
    """Every derived constant of the warp-tiled kernels, in one place (phases 03-05 share it).

    Shared memory holds fp32 tiles, each row `*_STRIDE` words long (HEAD_DIM or BLOCK_N plus
    the padding of phase 04): Q (BLOCK_M rows), then `stages` pairs of K and V tiles (BLOCK_N
    rows each; phase 05 uses two), then P (BLOCK_M rows). Stage s's K tile starts at
    K_OFF + s*STAGE_FLOATS. Every row starts on a 16-byte boundary, so VEC consecutive values
    of a row load in one instruction: strides and offsets are multiples of VEC.
    """
    L = dict(HEAD_DIM=HEAD_DIM, BLOCK_M=block_m, BLOCK_N=block_n, NUM_WARPS=num_warps,
             LANES_PER_ROW=lanes_per_row, SMEM_PAD=smem_pad, STAGES=stages, VEC=VEC)
    L["N_THREADS"] = 32 * num_warps
    L["ROWS_PER_WARP"] = block_m // num_warps
    L["TM"] = L["ROWS_PER_WARP"] * lanes_per_row // 32  # rows per lane
    L["TN"] = block_n // lanes_per_row  # score columns per lane
    L["TD"] = HEAD_DIM // lanes_per_row  # output columns per lane
    L["Q_STRIDE"] = HEAD_DIM + smem_pad
    L["K_STRIDE"] = HEAD_DIM + smem_pad
    L["V_STRIDE"] = HEAD_DIM
    L["P_STRIDE"] = block_n + smem_pad
    L["Q_OFF"] = 0
    L["K_OFF"] = block_m * L["Q_STRIDE"]
    L["V_OFF"] = L["K_OFF"] + block_n * L["K_STRIDE"]
    L["STAGE_FLOATS"] = block_n * (L["K_STRIDE"] + L["V_STRIDE"])
    L["P_OFF"] = L["K_OFF"] + stages * L["STAGE_FLOATS"]
    L["SMEM_FLOATS"] = L["P_OFF"] + block_m * L["P_STRIDE"]
    assert L["TM"] * (32 // lanes_per_row) == L["ROWS_PER_WARP"], "rows must split evenly over lanes"
    assert L["TN"] * lanes_per_row == block_n and L["TD"] * lanes_per_row == HEAD_DIM
    assert smem_pad % VEC == 0 and L["TD"] % VEC == 0 and block_n % VEC == 0, "rows must stay 16-byte aligned"
    return L


def lane_position(tid, ROWS_PER_WARP, TM, LANES_PER_ROW):
    """(first of the TM rows this lane owns within the block, its column lane).

    Warp w owns rows w*ROWS_PER_WARP ..; inside it, each group of LANES_PER_ROW lanes shares TM
    rows. `flashcore_numba.measure.banks` calls this same function to model the kernel's accesses.
    """
    lane = tid % 32
    return (tid // 32) * ROWS_PER_WARP + (lane // LANES_PER_ROW) * TM, lane % LANES_PER_ROW


def acc_column(lane_col, c, LANES_PER_ROW):
    """Head-dim column of a lane's c-th accumulator: VEC-wide chunks, interleaved over the lanes.

    Lane l owns columns 4l..4l+3, then 4(l + LANES_PER_ROW).., so each lane reads V with 16-byte
    loads and the 8 lanes of a quarter-warp read 8 different 16-byte chunks (no bank conflict).
    """
    return (lane_col + LANES_PER_ROW * (c // VEC)) * VEC + c % VEC


def make_tile_functions(L):
    """The warp-tile steps, specialized to layout L. Phase 05 reuses them unchanged."""
    TM, TN, TD = L["TM"], L["TN"], L["TD"]
    HEAD_DIM, BLOCK_N, LANES_PER_ROW = L["HEAD_DIM"], L["BLOCK_N"], L["LANES_PER_ROW"]
    Q_STRIDE, K_STRIDE, V_STRIDE, P_STRIDE = L["Q_STRIDE"], L["K_STRIDE"], L["V_STRIDE"], L["P_STRIDE"]
    Q_OFF, P_OFF = L["Q_OFF"], L["P_OFF"]
    ROWS_PER_WARP, NUM_WARPS = L["ROWS_PER_WARP"], L["NUM_WARPS"]
    assert ROWS_PER_WARP * NUM_WARPS == L["BLOCK_M"]
    column = arithmetic_device_function(acc_column)
    position = arithmetic_device_function(lane_position)

    @cuda.jit(device=True, inline=True)
    def lane_of(tid):
        """This lane's first row in the block (it owns TM rows) and its column lane."""
        return position(tid, ROWS_PER_WARP, TM, LANES_PER_ROW)

    @cuda.jit(device=True, inline=True)
    def init_rows(m_i, l_i, acc):
        """-- before the first tile: m_i = -inf, l_i = 0, acc = 0 for this lane's rows."""
        for i in range(TM):
            m_i[i] = float32(-math.inf)
            l_i[i] = float32(0.0)
            for c in range(TD):
                acc[i, c] = float32(0.0)

    @cuda.jit(device=True, inline=True)
    def scores_tile(s, smem, k_off, lane_row, lane_col):
        """s[i, j] = q[lane_row + i] · k[lane_col + j*LANES_PER_ROW]: a TM×TN outer-product block."""
        for i in range(TM):
            for j in range(TN):
                s[i, j] = float32(0.0)
        q_frag = cuda.local.array((TM, VEC), float32)
        k_frag = cuda.local.array((TN, VEC), float32)
        for d0 in range(0, HEAD_DIM, VEC):
            # VEC consecutive values of each row: one 16-byte load per row
            for i in range(TM):
                for e in range(VEC):
                    q_frag[i, e] = smem[uidx(Q_OFF + (lane_row + i) * Q_STRIDE + d0 + e)]
            for j in range(TN):
                for e in range(VEC):
                    k_frag[j, e] = smem[uidx(k_off + (lane_col + j * LANES_PER_ROW) * K_STRIDE + d0 + e)]
            for e in range(VEC):
                for i in range(TM):
                    for j in range(TN):
                        s[i, j] += q_frag[i, e] * k_frag[j, e]

    @cuda.jit(device=True, inline=True)
    def softmax_tile(s, m_i, l_i, acc, smem, row0, lane_row, lane_col, start_n, seq_q, seq_k, causal,
                     qk_scale):
        """Online softmax of one tile: mask, row max over the lanes (shuffles), p to shared memory."""
        for i in range(TM):
            k_end = key_end(min(row0 + lane_row + i, seq_q - 1), seq_q, seq_k, causal)
            # -- scale to base 2, mask, and this lane's part of the row max
            m_ij = float32(-math.inf)
            for j in range(TN):
                s_ij = s[i, j] * qk_scale
                if start_n + lane_col + j * LANES_PER_ROW >= k_end:
                    s_ij = float32(-math.inf)
                s[i, j] = s_ij
                m_ij = max(m_ij, s_ij)
            # -- row max across the LANES_PER_ROW lanes of the group: butterfly shuffles
            # >>> exercise 03-a: reduce m_ij to the max over the LANES_PER_ROW lanes of this row
            # <<< exercise
            # -- update m_i and l_i (l_i stays a per-lane partial sum), rescale acc
            m_new, m_ref, alpha = softmax_rescale(m_i[i], m_ij)
            l_sum = float32(0.0)
            for j in range(TN):
                p = math.exp2(s[i, j] - m_ref)
                l_sum += p
                smem[uidx(P_OFF + (lane_row + i) * P_STRIDE + lane_col + j * LANES_PER_ROW)] = p
            l_i[i] = l_i[i] * alpha + l_sum
            for c in range(TD):
                acc[i, c] *= alpha
            m_i[i] = m_new

    @cuda.jit(device=True, inline=True)
    def pv_tile(acc, smem, v_off, lane_row, lane_col):
        """acc[i, c] += sum_j p[lane_row + i, j] * v[j, column(c)], VEC keys j at a time."""
        p_frag = cuda.local.array((TM, VEC), float32)
        v_frag = cuda.local.array((VEC, TD), float32)
        for j0 in range(0, BLOCK_N, VEC):
            for i in range(TM):
                for e in range(VEC):
                    p_frag[i, e] = smem[uidx(P_OFF + (lane_row + i) * P_STRIDE + j0 + e)]
            for e in range(VEC):
                for c in range(TD):
                    v_frag[e, c] = smem[uidx(v_off + (j0 + e) * V_STRIDE + column(lane_col, c, LANES_PER_ROW))]
            for e in range(VEC):
                for i in range(TM):
                    for c in range(TD):
                        acc[i, c] += p_frag[i, e] * v_frag[e, c]

    @cuda.jit(device=True, inline=True)
    def store_output(O, b, h, row0, lane_row, lane_col, acc, l_i, seq_q):
        """-- epilogue: reduce the partial row sums over the group's lanes, o = acc / l_i."""
        for i in range(TM):
            l_row = l_i[i]
            # >>> exercise 03-b: sum the per-lane partial row sums over the LANES_PER_ROW lanes
            # <<< exercise
            row = row0 + lane_row + i
            if row < seq_q:
                for c in range(TD):
                    O[b, h, row, column(lane_col, c, LANES_PER_ROW)] = finalize(acc[i, c], l_row)

    return lane_of, init_rows, scores_tile, softmax_tile, pv_tile, store_output


def build_kernel(L) -> KernelConfig:
    """The phase 03 kernel for layout L (phase 04 calls this with padded rows)."""
    lane_of, init_rows, scores_tile, softmax_tile, pv_tile, store_output = make_tile_functions(L)
    HEAD_DIM, BLOCK_M, BLOCK_N, N_THREADS = L["HEAD_DIM"], L["BLOCK_M"], L["BLOCK_N"], L["N_THREADS"]
    TM, TN, TD = L["TM"], L["TN"], L["TD"]
    Q_OFF, K_OFF, V_OFF = L["Q_OFF"], L["K_OFF"], L["V_OFF"]
    Q_STRIDE, K_STRIDE, V_STRIDE = L["Q_STRIDE"], L["K_STRIDE"], L["V_STRIDE"]

    @cuda.jit
    def warp_tiled_attention(Q, K, V, O, causal, qk_scale):
        smem = cuda.shared.array(0, float32, alignment=16)  # 16-byte rows: vector loads
        b = cuda.blockIdx.z
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        row0 = cuda.blockIdx.x * BLOCK_M
        seq_q = Q.shape[2]
        seq_k = K.shape[2]
        # this lane's rows: lane_row .. lane_row+TM-1; its keys: lane_col + j*LANES_PER_ROW
        lane_row, lane_col = lane_of(tid)

        m_i = cuda.local.array(TM, float32)
        l_i = cuda.local.array(TM, float32)
        acc = cuda.local.array((TM, TD), float32)
        s = cuda.local.array((TM, TN), float32)
        init_rows(m_i, l_i, acc)

        load_tile(smem, Q_OFF, Q_STRIDE, Q, b, h, row0, seq_q, tid, N_THREADS, BLOCK_M, HEAD_DIM)
        block_k_end = key_end(min(row0 + BLOCK_M, seq_q) - 1, seq_q, seq_k, causal)
        for start_n in range(0, block_k_end, BLOCK_N):
            cuda.syncthreads()  # every warp is done with the previous K/V tile
            load_tile(smem, K_OFF, K_STRIDE, K, b, h, start_n, seq_k, tid, N_THREADS, BLOCK_N, HEAD_DIM)
            load_tile(smem, V_OFF, V_STRIDE, V, b, h, start_n, seq_k, tid, N_THREADS, BLOCK_N, HEAD_DIM)
            cuda.syncthreads()  # the tiles are complete
            # -- s = q · kᵀ for this lane's TM×TN block
            scores_tile(s, smem, K_OFF, lane_row, lane_col)
            # -- online softmax with warp shuffles; p goes to this warp's rows of the P tile
            softmax_tile(s, m_i, l_i, acc, smem, row0, lane_row, lane_col, start_n, seq_q, seq_k,
                         causal, qk_scale)
            cuda.syncwarp()  # p of this warp's rows is complete (no other warp reads them)
            # -- acc += p · v
            pv_tile(acc, smem, V_OFF, lane_row, lane_col)
        store_output(O, b, h, row0, lane_row, lane_col, acc, l_i, seq_q)

    return KernelConfig(warp_tiled_attention, block_m=BLOCK_M, n_threads=N_THREADS,
                        smem_bytes=L["SMEM_FLOATS"] * 4)


def smem_layout(HEAD_DIM: int, tile_shape=None) -> dict:
    """The shared-memory layout of this phase (the GPU's tiles unless `tile_shape` is given)."""
    return layout(HEAD_DIM, SMEM_PAD, **(tile_shape or TILES[HEAD_DIM]))


@lru_cache(maxsize=None)
def build(HEAD_DIM: int) -> KernelConfig:
    return build_kernel(smem_layout(HEAD_DIM, tiles(HEAD_DIM)))

# Exercise 07: FlashAttention-2: mma.sync fragments in registers
#
# This is the finished phase 07 kernel with 2 marked regions emptied:
#   07-a: the row maxima m_ij_a, m_ij_b over the quad of lanes that hold the rows
#   07-b: p_frag[mt, kk, a0..a3] = pack(x, y) of s[mt]: rows g, g+8 of n-tile 2kk, then of 2kk+1
# Write the missing lines between each `# >>> exercise` line and its `# <<< exercise` line.
# Change nothing else: solving only adds lines. The lesson is lessons/07_mma_sync.ipynb.
#
# Grade it (hidden random inputs and adversarial shapes; points and reasons per check):
#     flashcore grade 07                         this file
#     flashcore grade 07 path/to/copy.py         a copy of it
#     pytest lessons/exercises --grade 07        the same checks, as pytest tests
# Without a GPU the kernel runs in Numba's CUDA simulator (slow) and the timing checks are skipped.
# Stuck? `flashcore grade 07 --hint` gives a hint per region (--hint 2, 3: more);
# the solution is flashcore_numba/phases/p07_mma_sync.py.
#
# Generated from that file by `python -m flashcore_numba.course.exercises --write`:
# improve the phase, not this copy.
"""Phase 07 — FlashAttention-2 from mma.sync: fragments in registers, ldmatrix and cp.async.

The whole account of this phase (what it changes, why the hardware rewards it, what each
change bought) is the docstring of flashcore_numba/phases/p07_mma_sync.py; the lesson is
lessons/07_mma_sync.ipynb.
"""

from __future__ import annotations

import math
from functools import lru_cache

from numba import cuda, float32, int32, uint32, uint64

from flashcore_numba.arch import operands, ptx
from flashcore_numba.arch.sim import simulator_enabled
from flashcore_numba.phases.common import (FULL_MASK, MMA_N, PTX_TYPE, KernelConfig, fragment_epilogue_16b, key_end,
                     make_exp_and_sum, mask_scores, packed_span, rescale_rows, row_max, softmax_rescale, store_lse)

ID = "07"
NAME = "mma_sync"
TITLE = "FlashAttention-2: mma.sync fragments in registers"
HEAD_DIMS = (64, 128)
DTYPES = ("float16", "bfloat16")
GQA = True
LSE = True  # return_lse: the kernel can write each row's log-sum-exp (common.store_lse)
MIN_CC = (8, 0)

MMA_M, MMA_K = 16, 16  # mma.sync.m16n8k16 (MMA_N: common.py)
LAZY = float32(8.0)  # how far (log2 units) a row's m_i may trail its max before the warp rescales
PAD = 8  # fp16 elements added to each shared-memory row: rows 16 bytes apart mod 128, so the
#          eight row addresses of an ldmatrix hit eight different 16-byte bank groups

# A warp owns M_TILES = block_m / (16 warps) m-tiles of 16 query rows: each K or V fragment it
# reads by ldmatrix then feeds M_TILES products instead of one. FlashAttention-2's layout at both
# head dims: 128 rows in 4 warps of two m-tiles; 64 keys per tile at D = 64, 48 at D = 128 (with 64
# the kernel needs more than 255 registers there and spills). Q's fragments stay in registers when
# they take at most Q_REGS per lane (D = 64: 2 m-tiles x 4 k-steps x 4 = 32); at D = 128 they would
# take 64 on top of 128 for O, so they are read again at every k-step.
TILES = {
    64: dict(block_m=128, block_n=64, warps=4),
    128: dict(block_m=128, block_n=48, warps=4),
}
Q_REGS = 32
SIM_TILES = {  # the simulator runs one Python thread per CUDA thread: one warp of two m-tiles,
    64: dict(block_m=32, block_n=32, warps=1),  # Q held in registers
    128: dict(block_m=32, block_n=32, warps=1),  # Q read again at every k-step
}

# Other head dims (models use 32 to 256: ViTs 40 and 80, Phi-3 96, Gemma 256): `gpu_tiles`.
MAX_HEAD_DIM = 256
HEAD_DIMS_TEXT = "any multiple of 8 from 8 to 256"
VALUE_HEAD_DIM = True  # v (and the output) may have a head dim of its own (MLA: 192 for q and k, 128 for v)


def runs_head_dim(HEAD_DIM: int) -> bool:
    """Whether the kernel is built for head dim HEAD_DIM: a multiple of 8 (rows of whole 16-byte
    chunks, the unit of every copy and store) up to MAX_HEAD_DIM."""
    return isinstance(HEAD_DIM, int) and 0 < HEAD_DIM <= MAX_HEAD_DIM and HEAD_DIM % 8 == 0


def tile_head_dim(HEAD_DIM: int) -> int:
    """D_TILE: the head dim the tiles are laid out for, HEAD_DIM rounded up to a multiple of 32 (as
    FlashAttention-2 rounds D up to its tile sizes). The columns past HEAD_DIM are zero in shared
    memory (the copies fill them with zeros), so they add nothing to q·kᵀ, and the output's columns
    past HEAD_DIM are never stored: D = 40 costs what D = 64 costs."""
    return -(-HEAD_DIM // 32) * 32


def gpu_tiles(HEAD_DIM: int, V_DIM: int | None = None) -> dict:
    """The tile shape on the GPU: block_m query rows in `warps` warps, block_n keys per tile.

    It follows from the registers. A lane holds M_TILES x D_TILE / 2 accumulators of O (M_TILES =
    block_m / (16 warps) m-tiles of 16 rows per warp), and 255 registers are all a thread has. Up to
    D_TILE = 128 a warp keeps two m-tiles (each K or V fragment it reads feeds two products), with
    D = 64's tiles below 64 and D = 128's above. Past 128, eight warps take one m-tile each of the
    block's 128 rows: at D_TILE = 256 that is 128 accumulators, as two m-tiles hold at D = 128, with
    48 keys per tile. Assembled for sm_90a (flashcore_numba.measure.machine_code), none spills: D = 32
    189 registers, 40 242, 96 235, 160 164, 192 169, 224 236, 256 240 (with 128 keys per tile D = 32
    spills 88 bytes; with 64, D = 96 takes 247). These shapes are chosen from registers alone: no
    other shape has been timed beside them (their records: docs/performance.md). With V_DIM (V's and
    O's head dim, MLA), the wider of the two decides (192 and 128: 167 registers)."""
    D_TILE = tile_head_dim(max(HEAD_DIM, V_DIM or HEAD_DIM))
    if D_TILE <= 128:
        return TILES[64 if D_TILE <= 64 else 128]
    return dict(block_m=128, block_n=48, warps=8)  # one m-tile per warp


def tiles(HEAD_DIM: int, V_DIM: int | None = None) -> dict:
    """The tile shape where the kernel runs: the GPU's (gpu_tiles), or in the simulator one warp of
    two m-tiles, 32 keys per tile."""
    D_TILE = tile_head_dim(HEAD_DIM)
    if simulator_enabled():
        return SIM_TILES.get(D_TILE, dict(block_m=32, block_n=32, warps=1))
    return gpu_tiles(HEAD_DIM, V_DIM)


def layout(HEAD_DIM, block_m, block_n, warps, V_DIM=None):
    """Every derived constant. Shared memory holds fp16 rows of STRIDE elements: Q (BLOCK_M rows),
    then two stages of K and V (BLOCK_N rows each); offsets are in bytes. The tiles are D_TILE
    columns wide (HEAD_DIM rounded up to a multiple of 32), of which HEAD_DIM come from global memory.
    V_DIM: the head dim of V and O where it differs from Q's and K's (MLA: 192 and 128), its rows
    V_STRIDE elements; L["V_COPY"] holds what copies V (make_copy_tile), or None where V's rows are K's."""
    D_TILE = tile_head_dim(HEAD_DIM)
    V_DIM = HEAD_DIM if V_DIM is None else V_DIM
    DV_TILE = tile_head_dim(V_DIM)
    assert block_m % (MMA_M * warps) == 0 and block_n % MMA_K == 0 and D_TILE % MMA_K == 0
    L = dict(HEAD_DIM=HEAD_DIM, D_TILE=D_TILE, V_DIM=V_DIM, DV_TILE=DV_TILE, BLOCK_M=block_m, BLOCK_N=block_n,
             NUM_WARPS=warps)
    L["M_TILES"] = block_m // (MMA_M * warps)  # m-tiles of 16 rows per warp
    L["WARP_ROWS"] = MMA_M * L["M_TILES"]
    L["N_THREADS"] = 32 * warps
    L["STRIDE"] = D_TILE + PAD  # fp16 elements per shared-memory row
    L["V_STRIDE"] = DV_TILE + PAD  # ... of V's rows
    row_bytes, v_row_bytes = L["STRIDE"] * 2, L["V_STRIDE"] * 2
    L["Q_OFF"] = 0
    L["K_OFF"] = block_m * row_bytes
    L["V_OFF"] = L["K_OFF"] + block_n * row_bytes
    L["STAGE_BYTES"] = block_n * (row_bytes + v_row_bytes)  # stage s: K at K_OFF + s*STAGE_BYTES, V at V_OFF + ...
    L["SMEM_BYTES"] = L["K_OFF"] + 2 * L["STAGE_BYTES"]
    L.update(copy_layout(HEAD_DIM, D_TILE, L["N_THREADS"], (block_m, block_n)))  # how the threads copy a row
    assert block_m % L["ROWS_PER_PASS"] == 0 and block_n % L["ROWS_PER_PASS"] == 0
    L["V_COPY"] = None
    if V_DIM != HEAD_DIM:
        L["V_COPY"] = dict(STRIDE=L["V_STRIDE"], **copy_layout(V_DIM, DV_TILE, L["N_THREADS"], (block_n,)))
        assert block_n % L["V_COPY"]["ROWS_PER_PASS"] == 0
    L["NT"] = block_n // MMA_N  # n-tiles of S per m-tile (8 keys each)
    L["KQ"] = D_TILE // MMA_K  # k-steps of Q·Kᵀ
    # k-steps of Q fragments a lane holds: all of them for the whole loop, or the current one
    L["Q_STEPS"] = L["KQ"] if L["M_TILES"] * L["KQ"] * 4 <= Q_REGS else 1
    L["KP"] = block_n // MMA_K  # k-steps of P·V
    L["NO"] = DV_TILE // MMA_N  # n-tiles of O (8 columns each)
    return L


def copy_layout(dim: int, tile_dim: int, n_threads: int, tile_rows: tuple) -> dict:
    """How make_copy_tile copies rows of `dim` elements into rows `tile_dim` wide: CHUNKS 16-byte chunks
    a row in shared memory, GLOBAL_CHUNKS of them from global memory (fewer where `dim` was rounded
    up), CHUNK_LANES threads a row (CHUNKS up to a power of two, or more where a pass of
    ROWS_PER_PASS rows would not divide the tiles' rows, `tile_rows`: a narrow V beside a wide K)."""
    chunks = tile_dim // 8
    lanes = 1 << (chunks - 1).bit_length()
    while any(rows % (n_threads // lanes) for rows in tile_rows):
        lanes *= 2
    return dict(CHUNKS=chunks, GLOBAL_CHUNKS=dim // 8, CHUNK_LANES=lanes, ROWS_PER_PASS=n_threads // lanes)


def make_copy_tile(L):
    """Global -> shared by cp.async, 16 bytes per copy, consecutive threads on consecutive chunks.

    With L["SWIZZLE"] (phases 10 and 11: rows of exactly D elements, no padding) chunk c of row r lands at
    chunk c ^ (r % 8) of its row instead of chunk c, which keeps ldmatrix free of bank conflicts
    without padding."""
    copy16 = ptx.function("cp_async.ptx", "flashcore_cp_async_16", "inline")
    CHUNKS, STRIDE, ROWS_PER_PASS = L["CHUNKS"], L["STRIDE"], L["ROWS_PER_PASS"]
    SWIZZLE = L.get("SWIZZLE", False)
    # a head dim that is not a power of two times 8 (96, 160, ...): CHUNK_LANES threads per row, the
    # lanes past CHUNKS idle; a head dim rounded up (D_TILE > HEAD_DIM): the chunks past
    # GLOBAL_CHUNKS copy 0 bytes, which fills them with zeros (from the row's first chunk, a real
    # address). Both are settled when the kernel is built: D = 64 and 128 have neither.
    LANES = L.get("CHUNK_LANES", CHUNKS)
    GLOBAL_CHUNKS = L.get("GLOBAL_CHUNKS", CHUNKS)
    IDLE_LANES, ZERO_CHUNKS = LANES > CHUNKS, GLOBAL_CHUNKS < CHUNKS
    # swizzled, a pass ROWS_PER_PASS rows on moves r % 8 by (i * ROWS_PER_PASS) % 8: 0 where
    # ROWS_PER_PASS is a multiple of 8 (phase 11's 8-warp blocks); else (phase 10's one-warp copies,
    # the simulator's blocks) that is a flip: r is less than ROWS_PER_PASS, a power of two, so
    # (r + i * ROWS_PER_PASS) % 8 == (r % 8) ^ ((i * ROWS_PER_PASS) % 8), which flips bits 4-6 of
    # the row's offset (rows of at least 128 bytes, `offset` a multiple of a row)
    assert not SWIZZLE or (STRIDE == CHUNKS * 8 and CHUNKS >= 8  # unpadded rows, 128 bytes or more
                           and ROWS_PER_PASS & (ROWS_PER_PASS - 1) == 0 and LANES == CHUNKS)
    FLIP = SWIZZLE and ROWS_PER_PASS % 8 != 0
    ROW_BYTES = STRIDE * 2  # a row in shared memory; in global memory a row is GLOBAL_CHUNKS * 16 bytes,
    # the next one row_stride bytes on

    @cuda.jit(device=True, inline=True)
    def pass_dst(smem, rel, i):
        """Where this thread's copy of pass i goes: ROWS_PER_PASS rows on from smem + rel, i times
        (rel: the offset of pass 0's copy)."""
        if FLIP:
            return smem + ((rel + i * ROWS_PER_PASS * ROW_BYTES) ^ (((i * ROWS_PER_PASS) % 8) * 16))
        return smem + rel + i * ROWS_PER_PASS * ROW_BYTES

    @cuda.jit(device=True, inline=True)
    def copy_tile(smem, offset, src_base, head_bytes, row0, n_rows, seq_len, tid, row_stride):
        """Start copying rows row0 .. row0+n_rows-1 of one head (at src_base + head_bytes, its rows
        row_stride bytes apart: D * 2 in a (B, H, S, D) array) to smem+offset.

        Thread tid copies chunk tid % LANES of rows tid // LANES, + ROWS_PER_PASS, + 2 ROWS_PER_PASS...
        A tile that lies inside the sequence needs no check: each copy is at a fixed offset from one
        address, which the copy instruction adds itself. In the last tile a row past seq_len copies
        0 bytes and is zero-filled (its address is clamped to a real row).
        """
        r, chunk = tid // LANES, tid % LANES
        if IDLE_LANES and chunk >= CHUNKS:  # (a lane past the row: nothing to copy)
            return
        col_bytes = uint32(16)
        src = src_base + head_bytes + uint64(chunk * 16)
        if ZERO_CHUNKS and chunk >= GLOBAL_CHUNKS:  # a column past D: 0 bytes, zero-filled
            col_bytes = uint32(0)
            src = src_base + head_bytes
        rel = offset + r * ROW_BYTES + ((chunk ^ (r % 8)) if SWIZZLE else chunk) * 16
        if row0 + n_rows <= seq_len:
            src += uint64(row0 + r) * uint64(row_stride)
            for i in range(n_rows // ROWS_PER_PASS):
                copy16(pass_dst(smem, rel, i), src + uint64(i * ROWS_PER_PASS * row_stride), col_bytes)
        else:
            for i in range(n_rows // ROWS_PER_PASS):
                row = row0 + r + i * ROWS_PER_PASS
                n_bytes = col_bytes if row < seq_len else uint32(0)
                row_src = src + uint64(min(row, seq_len - 1)) * uint64(row_stride)
                copy16(pass_dst(smem, rel, i), row_src, n_bytes)

    return copy_tile


def unrolled(step, n: int):
    """A device function `run(i, args)` that calls `step(i, args)`, `step(i + 1, args)`, ...,
    `step(i + n - 1, args)` one after another, with no loop: unrolled when the kernel is built.

    NVVM unrolls a loop of constant trip count only while the unrolled body stays small. A k-loop
    of many mma.sync and ldmatrix stays a loop, and then each ldmatrix feeds the mma right after
    it, with a branch and a counter per step (phase 07 at D = 128: 8 steps of 16 products). Built
    as a chain of inlined calls there is no loop to decide about: each step's index is a
    constant, so its shared-memory offsets are immediates and the compiler may move the loads of
    one step ahead of the products of the step before. `args` is a tuple (Numba does not inline
    a call with *args): each step unpacks what it needs.
    """
    if n == 1:
        return step
    rest = unrolled(step, n - 1)

    @cuda.jit(device=True, inline=True)
    def run(i, args):
        step(i, args)
        rest(i + 1, args)

    return run


def make_products(L, dtype="float16"):
    """The warp's two products on the tensor cores, `mma.sync` by `mma.sync`, for one tile of keys:
    returns (q_fragments, qk_steps, pv_steps).

    - `q_fragments(q_frag, q_warp)`: Q's A fragments of every k-step, read from shared memory by
      ldmatrix (lane l gives row l % 16 and column 8 (l // 16) of each 16 x 16 block), held in
      registers for the whole loop when they fit (Q_STEPS == KQ);
    - `qk_steps(0, (s, q_frag, q_warp, k_tile))`: s += q · kᵀ, KQ k-steps, K's B fragments by
      ldmatrix (Q's read again at every k-step when they are not held);
    - `pv_steps(0, (acc, p_frag, v_tile))`: acc += p · v, V's B fragments by ldmatrix.trans.
    Every K or V fragment read feeds the warp's M_TILES m-tiles. The k-steps are `unrolled`."""
    mma = ptx.function("mma_sync.ptx", f"flashcore_mma_{PTX_TYPE[dtype]}", "inline")
    ldsm = ptx.function("ldmatrix.ptx", "flashcore_ldmatrix_x4", "inline")
    ldsm_t = ptx.function("ldmatrix.ptx", "flashcore_ldmatrix_x4_trans", "inline")
    M_TILES, NT, KQ, KP, NO, Q_STEPS = L["M_TILES"], L["NT"], L["KQ"], L["KP"], L["NO"], L["Q_STEPS"]
    ROW_BYTES, V_ROW_BYTES = L["STRIDE"] * 2, L["V_STRIDE"] * 2

    @cuda.jit(device=True, inline=True)
    def mma_into(c, mt, j, a, kk, b0, b1):
        """c[mt, j] += a[mt, kk] · b: one m16n8k16 product into n-tile j of m-tile mt's accumulators."""
        c[mt, j, 0], c[mt, j, 1], c[mt, j, 2], c[mt, j, 3] = mma(
            a[mt, kk, 0], a[mt, kk, 1], a[mt, kk, 2], a[mt, kk, 3], b0, b1,
            c[mt, j, 0], c[mt, j, 1], c[mt, j, 2], c[mt, j, 3])

    @cuda.jit(device=True, inline=True)
    def q_fragments(q_frag, q_warp):
        """Q's A fragments of all KQ k-steps of the warp's m-tiles, when the lane holds them all."""
        if Q_STEPS == KQ:
            for mt in range(M_TILES):
                for kk in range(KQ):
                    a0, a1, a2, a3 = ldsm(q_warp + mt * MMA_M * ROW_BYTES + kk * 32)
                    q_frag[mt, kk, 0], q_frag[mt, kk, 1] = a0, a1
                    q_frag[mt, kk, 2], q_frag[mt, kk, 3] = a2, a3

    @cuda.jit(device=True, inline=True)
    def qk_step(kk, args):
        """k-step kk of s = q · kᵀ: NT n-tiles of 8 keys; each K fragment serves the M_TILES m-tiles."""
        s, q_frag, q_warp, k_tile = args
        if Q_STEPS == 1:  # Q's fragments of this k-step, read again from shared memory
            for mt in range(M_TILES):
                a0, a1, a2, a3 = ldsm(q_warp + mt * MMA_M * ROW_BYTES + kk * 32)
                q_frag[mt, 0, 0], q_frag[mt, 0, 1], q_frag[mt, 0, 2], q_frag[mt, 0, 3] = a0, a1, a2, a3
        for jj in range(NT // 2):
            b0, b1, b2, b3 = ldsm(k_tile + jj * 16 * ROW_BYTES + kk * 32)
            for mt in range(M_TILES):
                mma_into(s, mt, 2 * jj, q_frag, kk % Q_STEPS, b0, b1)
                mma_into(s, mt, 2 * jj + 1, q_frag, kk % Q_STEPS, b2, b3)

    @cuda.jit(device=True, inline=True)
    def pv_step(jj, args):
        """Output columns 16 jj .. 16 jj + 15 of acc += p · v: KP k-steps of 16 keys; each V
        fragment serves the M_TILES m-tiles."""
        acc, p_frag, v_tile = args
        for kk in range(KP):
            b0, b1, b2, b3 = ldsm_t(v_tile + kk * 16 * V_ROW_BYTES + jj * 32)
            for mt in range(M_TILES):
                mma_into(acc, mt, 2 * jj, p_frag, kk, b0, b1)
                mma_into(acc, mt, 2 * jj + 1, p_frag, kk, b2, b3)

    return q_fragments, unrolled(qk_step, KQ), unrolled(pv_step, NO // 2)  # straight-line code: see unrolled


def make_softmax_tile(L, dtype="float16"):
    """softmax_tile(...): the online softmax of one tile of scores, for all the warp's m-tiles."""
    pack = ptx.function("mma_sync.ptx", f"flashcore_pack_{PTX_TYPE[dtype]}x2", "inline")
    exp_and_sum = make_exp_and_sum(ptx.function("exp2.ptx", "flashcore_exp2", "inline"))  # one MUFU.EX2
    BLOCK_N, M_TILES, NT, KP, NO = L["BLOCK_N"], L["M_TILES"], L["NT"], L["KP"], L["NO"]

    @cuda.jit(device=True, inline=True)
    def softmax_tile(s, p_frag, acc, m_a, m_b, l_a, l_b, m_ij_a_scaled, m_ij_b_scaled, start_n, k_end_min,
                     warp_row0, g, t, seq_q, seq_k, causal, scale):
        """The scores s of the tile of keys from start_n become P, as A fragments in p_frag: the
        mask, the rows' maxima, m_i moved (and l_i, acc rescaled) when a row's max outgrew it,
        p = exp2(s · scale - m_i) with its sums added to l_i. The lane's rows of m-tile mt are
        row_a = warp_row0 + 16 mt + g and row_a + 8; m_i and l_i are per m-tile (m_a, l_a: of
        rows a). A tile's scores are one block of straight-line code from the products to the vote."""
        # -- mask only a tile that needs it, and in one branch for the whole tile
        masked = start_n + BLOCK_N > k_end_min  # the tile crosses the diagonal or the end of the keys
        if masked:
            for mt in range(M_TILES):  # k_end of the two rows, computed here rather than held
                row_a = warp_row0 + mt * MMA_M + g
                k_end_a = key_end(min(row_a, seq_q - 1), seq_q, seq_k, causal)
                k_end_b = key_end(min(row_a + 8, seq_q - 1), seq_q, seq_k, causal)
                mask_scores(s[mt], 0, NT, start_n, t, k_end_a, k_end_b)

        # -- raw row maxima of every m-tile, scaled (scale > 0; -inf stays -inf)
        grow = False
        for mt in range(M_TILES):
            m_ij_a, m_ij_b = row_max(s[mt], 0, NT, float32(-math.inf), float32(-math.inf))
            # >>> exercise 07-a: the row maxima m_ij_a, m_ij_b over the quad of lanes that hold the rows
            # <<< exercise
            m_ij_a_scaled[mt] = m_ij_a * scale
            m_ij_b_scaled[mt] = m_ij_b * scale
            grow = grow or m_ij_a_scaled[mt] > m_a[mt] + LAZY or m_ij_b_scaled[mt] > m_b[mt] + LAZY

        # -- move m_i only when a row's max grew by more than LAZY (log2 units), and then for the
        # whole warp, all its m-tiles at once (one vote, one branch, no divergence): otherwise
        # p = exp2(s - m_i) <= 2^LAZY and acc and l_i keep their scale, since both are measured
        # against the same m_i
        if cuda.any_sync(FULL_MASK, grow):
            for mt in range(M_TILES):
                m_new_a, _, alpha_a = softmax_rescale(m_a[mt], m_ij_a_scaled[mt])
                m_new_b, _, alpha_b = softmax_rescale(m_b[mt], m_ij_b_scaled[mt])
                m_a[mt] = m_new_a
                m_b[mt] = m_new_b
                l_a[mt] *= alpha_a
                l_b[mt] *= alpha_b
                rescale_rows(acc[mt], NO, alpha_a, alpha_b)

        # -- p = exp2(s * scale - m_i), and the rows' partial sums (this lane's columns)
        for mt in range(M_TILES):
            # a row that has seen only masked keys is measured against 0 (see softmax_rescale)
            m_ref_a = m_a[mt] if m_a[mt] != float32(-math.inf) else float32(0.0)
            m_ref_b = m_b[mt] if m_b[mt] != float32(-math.inf) else float32(0.0)
            sum_a, sum_b = exp_and_sum(s[mt], 0, NT, scale, m_ref_a, m_ref_b, float32(0.0), float32(0.0))
            l_a[mt] += sum_a
            l_b[mt] += sum_b

        # -- p as A fragments: the accumulators of n-tiles 2kk and 2kk+1 are k-step kk's A
        # >>> exercise 07-b: p_frag[mt, kk, a0..a3] = pack(x, y) of s[mt]: rows g, g+8 of n-tile 2kk, then of 2kk+1
        # <<< exercise

    return softmax_tile


def make_epilogue(L, dtype="float16", varlen=False):
    """store_block(...): the warp's rows of O, and of LSE when it is asked for."""
    pack = ptx.function("mma_sync.ptx", f"flashcore_pack_{PTX_TYPE[dtype]}x2", "inline")
    st_global_v4 = ptx.function("store.ptx", "flashcore_st_global_v4", "inline")  # one STG.E.128
    # 16-byte stores (common), of the V_DIM / 8 blocks of a row that O has
    store_rows, store_rows_at = fragment_epilogue_16b(pack, L["NO"], st_global_v4, L["V_DIM"] // MMA_N)
    global_address = operands.global_address
    M_TILES, VARLEN = L["M_TILES"], varlen

    @cuda.jit(device=True, inline=True)
    def store_block(O, LSE, b, h, warp_row0, g, t, seq_q, q_first, o_stride, head_o, acc, m_a, m_b, l_a, l_b):
        """-- epilogue (common.py): for each m-tile the rows' sums over the quad, 1 / l_i once per
        row, o = acc * (1 / l_i) packed in pairs, and a transpose within the quad so that each lane
        writes 16 bytes at once; then each row's log-sum-exp, when LSE has rows (return_lse)."""
        for mt in range(M_TILES):
            row_a = warp_row0 + mt * MMA_M + g
            if VARLEN:  # O (1, total_q, H, V_DIM / 2) and LSE (1, H, total_q): the sequence's rows from q_first
                store_rows_at(global_address(O) + head_o, uint64(o_stride), row_a, row_a + 8, seq_q, t,
                              acc[mt], l_a[mt], l_b[mt])
                if LSE.shape[2] != 0:
                    store_lse(LSE, 0, h, q_first + row_a, q_first + row_a + 8, q_first + seq_q, t,
                              l_a[mt], l_b[mt], m_a[mt], m_b[mt])
            else:
                store_rows(O, b, h, row_a, row_a + 8, seq_q, t, acc[mt], l_a[mt], l_b[mt])
                if LSE.shape[2] != 0:  # return_lse: each row's log-sum-exp too (common.py)
                    store_lse(LSE, b, h, row_a, row_a + 8, seq_q, t, l_a[mt], l_b[mt], m_a[mt], m_b[mt])

    return store_block


def build_kernel(L, dtype="float16", varlen=False) -> KernelConfig:
    """Phase 07's kernel; with `varlen`, the same kernel on sequences of their own lengths packed end
    to end (flashcore_numba.inference.attention_varlen): q (1, total_q, H, D), K and V (1, total_k,
    H_kv, D), sequence b's rows from CU_Q[b] (and CU_K[b]). Only where a head's rows lie and how
    many a sequence has differ (the branches on VARLEN, settled when the kernel is built).

    The roles, each a function of its own above: the copies (make_copy_tile), the products
    (make_products), the softmax of a tile (make_softmax_tile) and the epilogue (make_epilogue);
    `attend` below is the algorithm that wires them, one block's work."""
    VARLEN = varlen
    OWN_V = L["V_COPY"] is not None  # V's head dim differs from K's (MLA): copied by copy_v, rows of V_DIM
    commit = ptx.function("cp_async.ptx", "flashcore_cp_async_commit", "inline")
    wait_all = ptx.function("cp_async.ptx", "flashcore_cp_async_wait_0", "inline")
    shared_address, global_address = operands.shared_address, operands.global_address
    copy_tile = make_copy_tile(L)
    copy_v = make_copy_tile(dict(L, **L["V_COPY"])) if OWN_V else copy_tile
    q_fragments, qk_steps, pv_steps = make_products(L, dtype)
    softmax_tile = make_softmax_tile(L, dtype)
    store_block = make_epilogue(L, dtype, varlen)
    HEAD_DIM, V_DIM, BLOCK_M, BLOCK_N = L["HEAD_DIM"], L["V_DIM"], L["BLOCK_M"], L["BLOCK_N"]
    M_TILES, WARP_ROWS = L["M_TILES"], L["WARP_ROWS"]
    STRIDE, K_OFF, V_OFF, STAGE_BYTES = L["STRIDE"], L["K_OFF"], L["V_OFF"], L["STAGE_BYTES"]
    NT, KP, NO, Q_STEPS = L["NT"], L["KP"], L["NO"], L["Q_STEPS"]
    N_THREADS, ROW_BYTES, V_ROW_BYTES = L["N_THREADS"], STRIDE * 2, L["V_STRIDE"] * 2

    @cuda.jit(device=True, inline=True)
    def attend(Q, K, V, O, LSE, causal, qk_scale, CU_Q, CU_K):
        """The whole of one block's work (the kernels below only name their arguments)."""
        smem_h = cuda.shared.array(0, uint32, alignment=128)
        smem = shared_address(smem_h)
        b = cuda.blockIdx.z
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4  # this lane's rows of every m-tile: g and g + 8
        t = lane % 4  # and its columns: 2t, 2t + 1 of every 8-column tile
        row0 = cuda.blockIdx.x * BLOCK_M
        warp_row0 = row0 + warp * WARP_ROWS  # the warp's M_TILES m-tiles of 16 rows start here
        if VARLEN:  # sequence b: rows q_first .. q_first + seq_q - 1 of q (1, total_q, H, D), and so for K, V
            q_first, seq_q = packed_span(CU_Q, b, Q.shape[1])
            k_first, seq_k = packed_span(CU_K, b, K.shape[1])
            if row0 >= seq_q:  # the grid is sized for the longest sequence
                return
            h_kv = h * K.shape[2] // Q.shape[2]
            q_stride = Q.shape[2] * HEAD_DIM * 2  # bytes from a row of a head to its next row
            kv_stride = K.shape[2] * HEAD_DIM * 2
            head_q = uint64((q_first * Q.shape[2] + h) * HEAD_DIM * 2)
            head_kv = uint64((k_first * K.shape[2] + h_kv) * HEAD_DIM * 2)
        else:
            h_kv = h * K.shape[1] // Q.shape[1]  # grouped-query attention: several q heads per k/v head
            seq_q = Q.shape[2]
            seq_k = K.shape[2]
            q_stride = kv_stride = HEAD_DIM * 2
            head_q = uint64(((b * Q.shape[1] + h) * seq_q) * HEAD_DIM * 2)
            head_kv = uint64(((b * K.shape[1] + h_kv) * seq_k) * HEAD_DIM * 2)
            q_first = 0
        head_v, v_stride = head_kv, kv_stride
        head_o, o_stride = head_q, q_stride  # (varlen: O's rows as packed as q's)
        if OWN_V and VARLEN:  # V's and O's rows are V_DIM elements, packed as K's and q's
            head_v, v_stride = uint64((k_first * K.shape[2] + h_kv) * V_DIM * 2), K.shape[2] * V_DIM * 2
            head_o, o_stride = uint64((q_first * Q.shape[2] + h) * V_DIM * 2), Q.shape[2] * V_DIM * 2
        elif OWN_V:  # V's rows are V_DIM elements
            head_v, v_stride = uint64(((b * K.shape[1] + h_kv) * seq_k) * V_DIM * 2), V_DIM * 2

        # The lane's rows in m-tile mt: row_a = g and row_b = g + 8 of its 16 (elements 0, 1 and 2, 3
        # of every accumulator tile); m_i and l_i of each, per m-tile
        q_frag = cuda.local.array((M_TILES, Q_STEPS, 4), uint32)
        s = cuda.local.array((M_TILES, NT, 4), float32)
        p_frag = cuda.local.array((M_TILES, KP, 4), uint32)
        acc = cuda.local.array((M_TILES, NO, 4), float32)
        m_a = cuda.local.array(M_TILES, float32)
        m_b = cuda.local.array(M_TILES, float32)
        l_a = cuda.local.array(M_TILES, float32)
        l_b = cuda.local.array(M_TILES, float32)
        m_ij_a_scaled = cuda.local.array(M_TILES, float32)  # this tile's row maxima, scaled
        m_ij_b_scaled = cuda.local.array(M_TILES, float32)
        # the smallest k_end of the lane's rows, its first row's (k_end never falls as the row grows):
        # tiles from it on need the mask
        k_end_min = key_end(min(warp_row0 + g, seq_q - 1), seq_q, seq_k, causal)
        for mt in range(M_TILES):
            m_a[mt] = float32(-math.inf)
            m_b[mt] = float32(-math.inf)
            l_a[mt] = float32(0.0)
            l_b[mt] = float32(0.0)
            for j in range(NO):
                for e in range(4):
                    acc[mt, j, e] = float32(0.0)

        # -- prologue: Q and the first K/V tile, one cp.async group
        block_k_end = int32(key_end(min(row0 + BLOCK_M, seq_q) - 1, seq_q, seq_k, causal))
        copy_tile(smem, 0, global_address(Q), head_q, row0, BLOCK_M, seq_q, tid, q_stride)
        if not VARLEN or seq_k > 0:  # (a sequence with no key has no row to copy from)
            copy_tile(smem, K_OFF, global_address(K), head_kv, 0, BLOCK_N, seq_k, tid, kv_stride)
            copy_v(smem, V_OFF, global_address(V), head_v, 0, BLOCK_N, seq_k, tid, v_stride)
        commit()
        wait_all()
        cuda.syncthreads()
        # qk_scale is folded into exp2, p = exp2(s * scale - m_i): one FFMA per score, and the row
        # max is taken on the raw scores. Both need scale >= 0, so a negative qk_scale flips the
        # sign of q instead, once in shared memory (bit 15 of each 16-bit half, fp16 and bf16
        # alike), and a zero one becomes tiny: a masked -inf times 0 would be NaN, times 1e-30 it
        # stays -inf.
        if qk_scale < 0:
            for w in range(tid, BLOCK_M * STRIDE // 2, N_THREADS):
                smem_h[w] ^= uint32(0x80008000)
            cuda.syncthreads()
        scale = max(abs(qk_scale), float32(1e-30))
        # -- Q's A fragments: lane l gives row l % 16 and column 8 (l // 16) of each 16x16 block
        q_warp = smem + (warp * WARP_ROWS + lane % 16) * ROW_BYTES + (lane // 16) * 16
        q_fragments(q_frag, q_warp)

        # K fragments of two n-tiles per ldmatrix: lane l gives key 8 (l // 16) + l % 8, dims 8 ((l // 8) % 2)
        k_lane = ((lane // 16) * 8 + lane % 8) * ROW_BYTES + ((lane // 8) % 2) * 16
        # V fragments (transposed) of two n-tiles: key 8 ((l // 8) % 2) + l % 8, dims 8 (l // 16)
        v_lane = (((lane // 8) % 2) * 8 + lane % 8) * V_ROW_BYTES + (lane // 16) * 16

        stage = 0
        for start_n in range(int32(0), block_k_end, int32(BLOCK_N)):  # 32-bit: fewer registers
            next_n = start_n + int32(BLOCK_N)
            if next_n < block_k_end:  # -- the next tile flies into the other stage meanwhile
                copy_tile(smem, K_OFF + (1 - stage) * STAGE_BYTES, global_address(K), head_kv, next_n, BLOCK_N,
                          seq_k, tid, kv_stride)
                copy_v(smem, V_OFF + (1 - stage) * STAGE_BYTES, global_address(V), head_v, next_n, BLOCK_N,
                       seq_k, tid, v_stride)
                commit()
            k_tile = smem + K_OFF + stage * STAGE_BYTES + k_lane
            v_tile = smem + V_OFF + stage * STAGE_BYTES + v_lane

            # -- s = q · kᵀ in registers: KQ k-steps (qk_step)
            for mt in range(M_TILES):
                for j in range(NT):
                    for e in range(4):
                        s[mt, j, e] = float32(0.0)
            qk_steps(0, (s, q_frag, q_warp, k_tile))

            # -- the online softmax: s becomes P, as A fragments; m_i, l_i and acc move on
            softmax_tile(s, p_frag, acc, m_a, m_b, l_a, l_b, m_ij_a_scaled, m_ij_b_scaled, start_n, k_end_min,
                         warp_row0, g, t, seq_q, seq_k, causal, scale)

            # -- acc += p · v: NO n-tiles of 8 output columns, two per pv_step
            pv_steps(0, (acc, p_frag, v_tile))

            # -- the next tile has landed (this thread's copies), and every warp is done with this one
            wait_all()
            cuda.syncthreads()
            stage = 1 - stage

        store_block(O, LSE, b, h, warp_row0, g, t, seq_q, q_first, o_stride, head_o, acc, m_a, m_b,
                    l_a, l_b)

    @cuda.jit
    def mma_attention(Q, K, V, O, LSE, causal, qk_scale):
        attend(Q, K, V, O, LSE, causal, qk_scale, LSE, LSE)  # (no sequence offsets: LSE stands in, unread)

    @cuda.jit
    def mma_attention_varlen(Q, K, V, O, LSE, causal, qk_scale, CU_Q, CU_K):
        attend(Q, K, V, O, LSE, causal, qk_scale, CU_Q, CU_K)

    return KernelConfig(mma_attention_varlen if VARLEN else mma_attention, block_m=BLOCK_M,
                        n_threads=L["N_THREADS"], smem_bytes=L["SMEM_BYTES"], packed_output=True, out_alignment=16,
                        lse=True, varlen=VARLEN)  # 16-byte stores (ptx/store.ptx)


@lru_cache(maxsize=None)
def build(HEAD_DIM: int, dtype: str = "float16", varlen: bool = False, value_dim: int | None = None) -> KernelConfig:
    """The kernel for head dim HEAD_DIM and `dtype` ("float16" or "bfloat16"); with `varlen`, the same
    kernel on packed sequences of their own lengths (flashcore_numba.inference.attention_varlen); with
    `value_dim`, V and O of that head dim, Q and K of HEAD_DIM (MLA: 192 and 128)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: phase 07 builds {' and '.join(DTYPES)}, not {dtype!r}")
    for name, dim in (("head dim", HEAD_DIM), ("value head dim", value_dim)):
        if dim is not None and not runs_head_dim(dim):
            raise ValueError(f"{name}: phase 07 builds {HEAD_DIMS_TEXT}, not {dim!r}")
    value_dim = None if value_dim == HEAD_DIM else value_dim
    return build_kernel(layout(HEAD_DIM, **tiles(HEAD_DIM, value_dim), V_DIM=value_dim), dtype, varlen)

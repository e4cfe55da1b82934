# Exercise 10: Split keys: one decode step across many blocks, merged by the log-sum-exp
#
# This is the finished phase 10 kernel with 2 marked regions emptied:
#   10-a: lse = log2 of the sum over the members of 2^lse_i (lane i holds member i's lse_i; subtract their max first), and this lane's weight w = 2^(lse_i - lse) (0 when no member saw a key)
#   10-b: count this block as finished: thread 0 adds 1 to COUNTERS[counter] (cuda.atomic.add returns the old value) and leaves that value in done_s[0]; after a barrier every thread reads it as `done`
# Write the missing lines between each `# >>> exercise` line and its `# <<< exercise` line.
# Change nothing else: solving only adds lines. The lesson is lessons/10_split_keys.ipynb.
#
# Grade it (hidden random inputs and adversarial shapes; points and reasons per check):
#     flashcore grade 10                         this file
#     flashcore grade 10 path/to/copy.py         a copy of it
#     pytest lessons/exercises --grade 10        the same checks, as pytest tests
# Without a GPU the kernel runs in Numba's CUDA simulator (slow) and the timing checks are skipped.
# Stuck? `flashcore grade 10 --hint` gives a hint per region (--hint 2, 3: more);
# the solution is flashcore_numba/phases/p10_split_keys.py.
#
# Generated from that file by `python -m flashcore_numba.course.exercises --write`:
# improve the phase, not this copy.
"""Phase 10 — split keys (flash-decoding): one query row, many blocks, merged by the log-sum-exp.

The whole account of this phase (what it changes, why the hardware rewards it, what each
change bought) is the docstring of flashcore_numba/phases/p10_split_keys.py; the lesson is
lessons/10_split_keys.ipynb.
"""

from __future__ import annotations

import math
from functools import lru_cache

from numba import cuda, float32, int32, int64, uint32, uint64

from flashcore_numba.arch import operands, ptx
from flashcore_numba.arch.sim import simulator_enabled
from flashcore_numba.phases.common import (FULL_MASK, LN2, MMA_N, PTX_TYPE, KernelConfig, Splits, blocks_per_sm, cdiv, key_end,
                     make_exp_and_sum, make_pack_a, mask_scores, quad_max, quad_sum, rescale_rows, row_max,
                     sm_count, softmax_rescale, warp_max, warp_sum, zero_tiles)
from flashcore_numba.phases.p07_mma_sync import MMA_M, copy_layout, layout, make_copy_tile, unrolled

ID = "10"
NAME = "split_keys"
TITLE = "Split keys: one decode step across many blocks, merged by the log-sum-exp"
HEAD_DIMS = (64, 128)  # the course's head dims; any other multiple of 8 up to 256 runs too (runs_head_dim)
HEAD_DIMS_TEXT = "any multiple of 8 from 8 to 256"
DTYPES = ("float16", "bfloat16")
GQA = True
LSE = True
MIN_CC = (8, 0)
# Not the ladder's "best" for every shape: it serves decoding (few query rows per K/V head);
# `attention(phase="best")` hands it the shapes where the records have it faster (api.py)
DECODE = True
BUILDS_ON = "07"  # its tile loop is phase 07's: the lesson compares their machine code

# The lesson's timing problem (measure.bench.Problem's fields): a decode step of 32 query heads
# sharing 8 K/V heads, one query row against 8192 keys
LESSON_PROBLEM = dict(B=1, H=32, S_q=1, S_k=8192, D=128, H_kv=8)

BLOCK_M = MMA_M  # one m-tile of packed rows per block: one warp
# by D_TILE (tile_head_dim): a warp's Q and 3 stages of K and V, 50, 52 and 56 KB
TILES = {64: dict(block_n=64, stages=3), 128: dict(block_n=32, stages=3), 256: dict(block_n=16, stages=3)}
SIM_TILES = {d: dict(block_n=16, stages=3) for d in TILES}  # the simulator: short tiles
WARPS = 4  # warps per block, each on its own range of keys: one block an SM (its shared memory)
BATCH_WARPS = 2  # the variant "batch": two warps a block, two blocks an SM (batch_fills_gpu)
VARIANTS = {"batch": "Split keys, two warps a block: for batches whose row tiles fill the GPU"}
SIM_WARPS = 2  # the simulator: two, so that its blocks merge their warps too
MIN_TILES_PER_SPLIT = 4  # a warp's range at least: its fixed costs (Q's load, the first tile's wait)
SIM_MIN_TILES_PER_SPLIT = 1  # the simulator: any problem of two tiles or more splits (and merges)
MAX_SPLITS = 256  # at most so many ranges (one a warp) per row tile (its workspace: 256 x 16 x D floats)
FAN_IN = 16  # the merge gathers the blocks' partials 16 at a time: a lane holds one partial's log-sum-exp
SIM_FAN_IN = 2  # the simulator: teams of two, so that small problems merge over several levels
SIM_SLOTS = 8  # the simulator's "GPU": blocks it holds at once, so that small problems split too
# The running maxima move only when a score passes them by more than this (log2 units): until then
# p = 2^(s - m_ref) stays at most 2^8 = 256, which fp16 and bf16 hold, and acc is not rescaled
RESCALE_MARGIN = 8.0


def runs_head_dim(HEAD_DIM: int) -> bool:
    """Whether the kernel is built for head dim HEAD_DIM: a multiple of 8 (its copies move rows of
    whole 16-byte chunks) up to 256, the widest tiles (TILES)."""
    return isinstance(HEAD_DIM, int) and 0 < HEAD_DIM <= max(TILES) and HEAD_DIM % 8 == 0


def tile_head_dim(HEAD_DIM: int) -> int:
    """D_TILE: the columns a row of a tile has in shared memory, HEAD_DIM rounded up to 64, 128 or
    256. The swizzle moves a row's 16-byte chunks within groups of eight, so a row is a power of two
    of such groups (the copies' passes: rows of whole lanes). The columns past HEAD_DIM are copied
    as zeros, add nothing to q·kᵀ, and are never stored; a decode step reads only HEAD_DIM columns
    from memory, which is its time."""
    return max(64, 1 << (HEAD_DIM - 1).bit_length())


def tiles(HEAD_DIM: int) -> dict:
    return (SIM_TILES if simulator_enabled() else TILES)[tile_head_dim(HEAD_DIM)]


def fan_in() -> int:
    return SIM_FAN_IN if simulator_enabled() else FAN_IN


def block_warps() -> int:
    return SIM_WARPS if simulator_enabled() else WARPS


def row_tile_count(kv_heads: int, rows_per_kv_head: int) -> int:
    """The problem's row tiles, a block each before any split: `kv_heads` (B x H_kv) times the tiles
    of BLOCK_M packed rows of one K/V head (its query heads times S_q; a decode step has one)."""
    return kv_heads * cdiv(rows_per_kv_head, BLOCK_M)


def batch_fills_gpu(kv_heads: int, rows_per_kv_head: int) -> bool:
    """Whether a problem runs the variant "batch": where its row tiles are at least the GPU's SMs,
    so that the four-warp build would run one block per row tile, one an SM, unsplit. Below that the
    four-warp build splits the keys and is faster (an H100's A/B: docs/tuning/10_history.md)."""
    return row_tile_count(kv_heads, rows_per_kv_head) >= sm_count()


def merge_counters(n_splits: int, fan: int) -> int:
    """How many counters the merge of one row tile's n_splits partials uses: one per team of
    `fan` partials at each level of the tree, down to the one team that writes the output."""
    total, count = 0, n_splits
    while True:
        count = cdiv(count, fan)
        total += count
        if count == 1:
            return total


def split_count(blocks: int, key_tiles: int, slots: int, min_tiles: int = MIN_TILES_PER_SPLIT,
                warps: int = WARPS) -> int:
    """How many blocks to cut each row tile's keys across (each block's `warps` warps cut its share
    again, a range each): as many as the GPU's `slots` (blocks it holds at once) hold in one wave,
    never a partial second one (an SM holds one block: a second wave would double the time), each
    warp's range at least `min_tiles` tiles, at most MAX_SPLITS ranges; then evened out so that no
    block is left without keys."""
    if blocks >= slots:
        return 1
    splits = min(slots // blocks, key_tiles // (min_tiles * warps), MAX_SPLITS // warps)
    if splits <= 1:
        return 1
    per_range = cdiv(key_tiles, splits * warps)  # the same tiles per range, the last ones shorter
    return cdiv(cdiv(key_tiles, per_range), warps)


def make_splits(block_n: int, smem_bytes: int, fan: int, warps: int):
    """The kernel's `split_keys`: (q shape, k shape, causal) -> its grid and workspace (Splits);
    `fan`: the blocks' partials per merge (its counters); `warps`: ranges per block."""

    def splits_of(q_shape, k_shape, causal, splits=None) -> Splits:
        B, H, S_q, D = q_shape
        H_kv, S_k = k_shape[1], k_shape[2]
        tiles_per_head = cdiv((H // H_kv) * S_q, BLOCK_M)  # tiles of packed rows per K/V head
        blocks = row_tile_count(B * H_kv, (H // H_kv) * S_q)
        if splits is None:
            min_tiles = SIM_MIN_TILES_PER_SPLIT if simulator_enabled() else MIN_TILES_PER_SPLIT
            splits = split_count(blocks, cdiv(S_k, block_n), sm_count() * blocks_per_sm(smem_bytes), min_tiles,
                                 warps)
        # a partial per block in the workspace (a block merges its warps' in shared memory)
        return Splits((splits, tiles_per_head * H_kv, B), (splits, B * H * S_q, D), (splits, B * H * S_q),
                      blocks * merge_counters(splits, fan))

    return splits_of


def split_layout(HEAD_DIM: int, block_n: int, stages: int) -> dict:
    """Phase 07's layout for one warp of 16 rows, with `stages` stages of K and V (2 to 4), and its
    rows swizzled instead of padded: D elements a row, chunk c of row r at chunk c ^ (r % 8).

    A padded row (D + 8 elements) straddles 128-byte lines of shared memory, and a warp's
    cp.async of 512 bytes of such rows was split into more requests than those bytes need (phase 11
    counted 24 L2 sectors where 16 do, docs/tuning/11_layout/). Phase 10 does little but copy,
    and swizzled rows made it 4-6 % faster at every decode shape (docs/tuning/10_history.md)."""
    assert 2 <= stages <= 4, "cp.async.wait_group takes its count as an immediate: ptx/cp_async.ptx has 0 to 2"
    D_TILE = tile_head_dim(HEAD_DIM)
    L = layout(D_TILE, block_m=BLOCK_M, warps=1, block_n=block_n)
    L.update(copy_layout(HEAD_DIM, D_TILE, 32, (BLOCK_M, block_n)), HEAD_DIM=HEAD_DIM)  # HEAD_DIM from memory
    row = D_TILE * 2
    L.update(SWIZZLE=True, STRIDE=D_TILE, K_OFF=BLOCK_M * row, V_OFF=(BLOCK_M + block_n) * row,
             STAGE_BYTES=2 * block_n * row)
    # the products stop at D's columns: q·kᵀ's k-steps of 16 and O's n-tiles in pairs (one ldmatrix
    # of V a pair) past them would multiply only the zeros past D (D = 96: 6 k-steps of 8, 12 n-tiles
    # of 16)
    L.update(KQ=-(-HEAD_DIM // 16), NO=2 * -(-HEAD_DIM // 16))
    L["STAGES"] = stages
    L["SMEM_BYTES"] = L["K_OFF"] + stages * L["STAGE_BYTES"]
    return L


def smem_size(L, warps: int) -> int:
    """Dynamic shared memory per block: each warp's Q tile and stages of K and V, which then hold
    the warp's partial (and, in warp 0's, the merge's weights: build_kernel checks they fit)."""
    return warps * L["SMEM_BYTES"]


def gpu_layout(HEAD_DIM: int) -> dict:
    """The layout the GPU kernel has (the simulator's tiles are smaller)."""
    return split_layout(HEAD_DIM, **TILES[tile_head_dim(HEAD_DIM)])


@cuda.jit(device=True, inline=True)
def div32(a, b):
    """a // b for values never negative and far below 2^31, divided in 32 bits: Numba types
    shapes as int64, and a 64-bit division is a test of the high words, a 32-bit path and a
    call to a division routine (the changelog's "Divisions by run-time values in 32 bits")."""
    return int32(uint32(a) // uint32(b))


@cuda.jit(device=True, inline=True)
def mod32(a, b):
    """a % b, as div32 divides."""
    return int32(uint32(a) % uint32(b))


@cuda.jit(device=True, inline=True)
def packed_row(p, seq_q):
    """(query head within the group, query row) of packed row p."""
    hg = div32(p, seq_q)
    return hg, p - hg * seq_q


def make_loads(L, paged=False):
    """(copy_tile, copy_q_rows, tile_pages, copy_kv): the copies into a warp's shared memory, by
    cp.async. copy_tile is phase 07's (swizzled rows): Q's 16 packed rows, which in a (B, H, S_q, D)
    array are consecutive rows; copy_q_rows the same rows from q (B, S_q, H, D) of a KV cache (paged);
    copy_kv a tile of K and V into a stage, from a head or from the cache's pages (tile_pages: the
    pages of a tile, read a tile ahead)."""
    PAGED = paged
    copy_tile = make_copy_tile(L)
    copy16 = ptx.function("cp_async.ptx", "flashcore_cp_async_16", "inline")
    global_address = operands.global_address
    CHUNKS, ROWS_PER_PASS = L["CHUNKS"], L["ROWS_PER_PASS"]
    GLOBAL_CHUNKS = L["GLOBAL_CHUNKS"]  # a row's chunks in memory: CHUNKS, or fewer (D rounded up: D_TILE)
    ZERO_CHUNKS = GLOBAL_CHUNKS < CHUNKS
    HEAD_DIM, BLOCK_N = L["HEAD_DIM"], L["BLOCK_N"]
    ROW = HEAD_DIM * 2  # bytes from a row of q, K or V to the next (copy_tile)
    K_OFF, V_OFF, STAGE_BYTES = L["K_OFF"], L["V_OFF"], L["STAGE_BYTES"]
    ROW_BYTES = L["STRIDE"] * 2  # a row in shared memory: D_TILE columns, unpadded (split_layout)

    @cuda.jit(device=True, inline=True)
    def lane_chunk(lane):
        """(row of a pass, chunk of the row, its byte offset in memory's row, bytes to copy) of a
        lane: 16 bytes, or for a chunk past HEAD_DIM (D rounded up to D_TILE) 0 bytes from the row's
        first, which cp.async fills with zeros."""
        r, chunk = lane // CHUNKS, lane % CHUNKS
        if ZERO_CHUNKS and chunk >= GLOBAL_CHUNKS:
            return r, chunk, 0, uint32(0)
        return r, chunk, chunk * 16, uint32(16)

    @cuda.jit(device=True, inline=True)
    def row_dst(smem, offset, row, chunk):
        """Where chunk `chunk` (16 bytes) of row `row` of the tile at smem + offset goes: chunk ^
        (row % 8) of the row, swizzled (as make_copy_tile puts it)."""
        return smem + offset + row * ROW_BYTES + (chunk ^ (row % 8)) * 16

    @cuda.jit(device=True, inline=True)
    def copy_q_rows(smem, Q, b, h0, row0, rows, seq_q, lane):
        """(paged) The 16 packed rows from row0 of q (B, S_q, H, D): packed row p is q[b, p % S_q,
        h0 + p // S_q], D contiguous values; a row past `rows` is zero-filled (0 bytes copied)."""
        H = Q.shape[2]
        base = global_address(Q)
        r, chunk, chunk_bytes, size = lane_chunk(lane)
        for i in range(BLOCK_M // ROWS_PER_PASS):
            p = row0 + r + i * ROWS_PER_PASS
            hg, qi = packed_row(min(p, rows - 1), seq_q)
            src = base + uint64(((b * seq_q + qi) * H + h0 + hg) * HEAD_DIM * 2 + chunk_bytes)
            copy16(row_dst(smem, 0, r + i * ROWS_PER_PASS, chunk), src, size if p < rows else uint32(0))

    @cuda.jit(device=True, inline=True)
    def page_of(BLOCK_TABLE, b, i, num_pages):
        """(paged) Page i of sequence b, from the block table: the caller's promise, clamped to the
        pool's pages, so that a wrong page id reads a wrong page, never memory outside the cache."""
        return int64(min(max(BLOCK_TABLE[b, i], 0), num_pages - 1))

    @cuda.jit(device=True, inline=True)
    def tile_pages(BLOCK_TABLE, b, key0, seq_k, page_size, num_pages):
        """(paged, pages of at least BLOCK_N keys) The pages of keys key0 .. key0 + BLOCK_N - 1: at most
        two, p0 and p1, p0's keys from first, p1's from boundary. Read a tile ahead of its copy, so
        that the copy never waits for the block table."""
        last = min(key0 + BLOCK_N, seq_k) - 1
        first_page = div32(key0, page_size)
        first = first_page * page_size
        last_page = div32(last, page_size)
        return page_of(BLOCK_TABLE, b, first_page, num_pages), page_of(BLOCK_TABLE, b, last_page, num_pages), \
            int64(first), int64(first + page_size)

    @cuda.jit(device=True, inline=True)
    def copy_kv_tiles(smem, k_off, v_off, K, V, h_kv, key0, seq_k, lane, pages):
        """(paged, pages of at least BLOCK_N keys) The tile's keys of K and V, its pages known
        (tile_pages): no division and no read of the block table per key, and where a key's row
        lies worked out once for K and V. Key jj of page p (whose first key is `first`) is row
        p * page_size + jj - first of the pool, so its byte offset is at + jj * key_bytes, with
        `at` fixed for the page: one multiply-add a key."""
        page_size, H_kv = K.shape[1], K.shape[2]
        p0, p1, first, boundary = pages
        key_bytes = int64(H_kv * HEAD_DIM * 2)  # from a key's row to the next one's in the pool
        r, chunk, chunk_bytes, lane_size = lane_chunk(lane)
        lane_bytes = int64(h_kv * HEAD_DIM * 2 + chunk_bytes)  # this lane's 16 bytes of the key's head
        at0 = (p0 * page_size - first) * key_bytes + lane_bytes
        at1 = (p1 * page_size - boundary) * key_bytes + lane_bytes
        kb, vb = global_address(K), global_address(V)
        for i in range(BLOCK_N // ROWS_PER_PASS):
            j = key0 + r + i * ROWS_PER_PASS
            jj = min(j, seq_k - 1)
            at = uint64((at0 if jj < boundary else at1) + jj * key_bytes)
            size = lane_size if j < seq_k else uint32(0)
            copy16(row_dst(smem, k_off, r + i * ROWS_PER_PASS, chunk), kb + at, size)
            copy16(row_dst(smem, v_off, r + i * ROWS_PER_PASS, chunk), vb + at, size)

    @cuda.jit(device=True, inline=True)
    def copy_kv_pages(smem, k_off, v_off, K, V, BLOCK_TABLE, b, h_kv, key0, seq_k, lane):
        """(paged) Keys key0 .. key0 + BLOCK_N - 1 of a sequence from its pages, K and V: key j is row
        j % page_size of page BLOCK_TABLE[b, j // page_size] of the pool (num_pages, page_size, H_kv,
        D), any page size; a key past seq_k is zero-filled. Each key's page read once for both."""
        page_size, H_kv = K.shape[1], K.shape[2]
        key_bytes = int64(H_kv * HEAD_DIM * 2)
        r, chunk, chunk_bytes, lane_size = lane_chunk(lane)
        lane_bytes = int64(h_kv * HEAD_DIM * 2 + chunk_bytes)
        kb, vb = global_address(K), global_address(V)
        for i in range(BLOCK_N // ROWS_PER_PASS):
            j = key0 + r + i * ROWS_PER_PASS
            jj = min(j, seq_k - 1)
            logical = div32(jj, page_size)  # the key's page in the sequence
            page = page_of(BLOCK_TABLE, b, logical, K.shape[0])
            at = uint64((page * page_size + jj - logical * page_size) * key_bytes + lane_bytes)
            size = lane_size if j < seq_k else uint32(0)
            copy16(row_dst(smem, k_off, r + i * ROWS_PER_PASS, chunk), kb + at, size)
            copy16(row_dst(smem, v_off, r + i * ROWS_PER_PASS, chunk), vb + at, size)

    @cuda.jit(device=True, inline=True)
    def copy_kv(smem, stage, K, V, head_kv, h_kv, key0, seq_k, lane, BLOCK_TABLE, b, pages, whole_tiles):
        """Start copying keys key0 .. key0 + BLOCK_N - 1 of K and V into `stage`: from a (B, H_kv, S_k, D)
        head, or (PAGED) from the cache's pages, the tile's pages known (whole_tiles) or not."""
        k_off = K_OFF + stage * STAGE_BYTES
        v_off = V_OFF + stage * STAGE_BYTES
        if PAGED:
            if whole_tiles:
                copy_kv_tiles(smem, k_off, v_off, K, V, h_kv, key0, seq_k, lane, pages)
            else:
                copy_kv_pages(smem, k_off, v_off, K, V, BLOCK_TABLE, b, h_kv, key0, seq_k, lane)
        else:
            copy_tile(smem, k_off, global_address(K), head_kv, key0, BLOCK_N, seq_k, lane, ROW)
            copy_tile(smem, v_off, global_address(V), head_kv, key0, BLOCK_N, seq_k, lane, ROW)

    return copy_tile, copy_q_rows, tile_pages, copy_kv


def make_products(L, dtype="float16"):
    """(q_fragments, scores, pv_steps): phase 07's products for one warp of 16 rows, on swizzled rows.

    - `q_fragments(q_frag, smem, q_lane)`: Q's A fragments, all KQ k-steps, held for the whole loop;
    - `scores(s, s_hi, q_frag, smem, k_rel)`: s = q · kᵀ of the tile whose K is at smem + k_rel;
    - `pv_steps(0, (acc, p_frag, smem, v_rel))`: acc += p · v.
    The lane addresses (q_lane, k_rel, v_rel) are relative to the warp's memory, smem."""
    mma = ptx.function("mma_sync.ptx", f"flashcore_mma_{PTX_TYPE[dtype]}", "inline")
    ldsm = ptx.function("ldmatrix.ptx", "flashcore_ldmatrix_x4", "inline")
    ldsm_t = ptx.function("ldmatrix.ptx", "flashcore_ldmatrix_x4_trans", "inline")
    NT, KQ, KP, NO = L["NT"], L["KQ"], L["KP"], L["NO"]
    ROW_BYTES = L["STRIDE"] * 2

    @cuda.jit(device=True, inline=True)
    def mma_into(c, j, a, kk, b0, b1):
        """c[j] += a[kk] · b: one m16n8k16 product into n-tile j of the warp's accumulators."""
        c[j, 0], c[j, 1], c[j, 2], c[j, 3] = mma(a[kk, 0], a[kk, 1], a[kk, 2], a[kk, 3], b0, b1,
                                                 c[j, 0], c[j, 1], c[j, 2], c[j, 3])

    @cuda.jit(device=True, inline=True)
    def at(smem, rel, step):
        """The lane's ldmatrix address `step` 16-column steps on from smem + rel (rel: its address
        at step 0, from the start of the warp's memory). Unswizzled that would be 32 bytes on;
        in a swizzled row it is the same row's chunk XOR 2 step: rel's chunk is c ^ (row % 8)
        with c 0 or 1, and c + 2 step == c ^ 2 step (no carry). (As an XOR of rel, not of the
        address: the warp's memory need not start at a multiple of a row.)"""
        return smem + (rel ^ uint32(step * 32))

    @cuda.jit(device=True, inline=True)
    def q_fragments(q_frag, smem, q_lane):
        """Q's A fragments stay in registers: 16 rows are one m-tile."""
        for kk in range(KQ):
            a0, a1, a2, a3 = ldsm(at(smem, q_lane, kk))
            q_frag[kk, 0], q_frag[kk, 1], q_frag[kk, 2], q_frag[kk, 3] = a0, a1, a2, a3

    @cuda.jit(device=True, inline=True)
    def qk_step(kk, args):
        """k-step kk of s = q · kᵀ: NT n-tiles of 8 keys, two per ldmatrix (as phase 07)."""
        s, q_frag, smem, k_rel = args
        for jj in range(NT // 2):
            b0, b1, b2, b3 = ldsm(at(smem, k_rel + jj * 16 * ROW_BYTES, kk))
            mma_into(s, 2 * jj, q_frag, kk, b0, b1)
            mma_into(s, 2 * jj + 1, q_frag, kk, b2, b3)

    @cuda.jit(device=True, inline=True)
    def pv_step(jj, args):
        """Output columns 16 jj .. 16 jj + 15 of acc += p · v (as phase 07)."""
        acc, p_frag, smem, v_rel = args
        for kk in range(KP):
            b0, b1, b2, b3 = ldsm_t(at(smem, v_rel + kk * 16 * ROW_BYTES, jj))
            mma_into(acc, 2 * jj, p_frag, kk, b0, b1)
            mma_into(acc, 2 * jj + 1, p_frag, kk, b2, b3)

    # s = q · kᵀ as two chains of k-steps, into two sets of accumulators added at the end: each
    # chain of dependent mma.sync is half as long (the changelog's "Two chains for q · kᵀ"); where
    # KQ is odd (D = 40: 3) the first chain takes one more
    KQ_LO = (KQ + 1) // 2
    qk_lo = unrolled(qk_step, KQ_LO)
    qk_hi = unrolled(qk_step, max(KQ - KQ_LO, 1))  # (KQ = 1, D <= 16: not called)

    @cuda.jit(device=True, inline=True)
    def scores(s, s_hi, q_frag, smem, k_rel):
        """-- s = q · kᵀ: the lower half of the head dim into s, the upper into s_hi, then added."""
        for j in range(NT):
            for e in range(4):
                s[j, e] = float32(0.0)
                s_hi[j, e] = float32(0.0)
        qk_lo(0, (s, q_frag, smem, k_rel))
        if KQ > 1:
            qk_hi(KQ_LO, (s_hi, q_frag, smem, k_rel))
        for j in range(NT):
            for e in range(4):
                s[j, e] += s_hi[j, e]

    return q_fragments, scores, unrolled(pv_step, NO // 2)


def make_softmax_tile(L, dtype="float16"):
    """softmax_tile(...): the online softmax of one tile of scores of the warp's 16 rows."""
    pack = ptx.function("mma_sync.ptx", f"flashcore_pack_{PTX_TYPE[dtype]}x2", "inline")
    pack_a = make_pack_a(pack, L["KP"])
    exp_and_sum = make_exp_and_sum(ptx.function("exp2.ptx", "flashcore_exp2", "inline"))
    BLOCK_N, NT, NO = L["BLOCK_N"], L["NT"], L["NO"]

    @cuda.jit(device=True, inline=True)
    def softmax_tile(s, p_frag, acc, start_n, t, k_end_a, k_end_b, scale, m_a, m_b, l_a, l_b, m_ref_a,
                     m_ref_b):
        """The scores s of the tile of keys from start_n become P, as A fragments in p_frag: the mask,
        the rows' maxima, m_i moved (l_i and acc rescaled) when a row's max passed it by more than
        RESCALE_MARGIN, p = exp2(s · scale - m_ref) added to l_i. Returns (m_a, m_b, l_a, l_b,
        m_ref_a, m_ref_b): m_ref is what scores are measured against (softmax_rescale's)."""
        if start_n + BLOCK_N > min(k_end_a, k_end_b):  # a key past a row's end: mask it
            mask_scores(s, 0, NT, start_n, t, k_end_a, k_end_b)
        m_ij_a, m_ij_b = row_max(s, 0, NT, float32(-math.inf), float32(-math.inf))
        m_ij_a, m_ij_b = quad_max(m_ij_a, m_ij_b)
        # rescale only when a row of the warp sees a score more than RESCALE_MARGIN above its
        # m_i (a vote: the branch is the warp's, not a lane's); else m_i stays, and this tile's
        # p are measured against it (written `not <=`, so that a NaN score rescales, as before)
        grows = not (m_ij_a * scale <= m_a + float32(RESCALE_MARGIN)) or \
            not (m_ij_b * scale <= m_b + float32(RESCALE_MARGIN))
        if cuda.any_sync(FULL_MASK, int32(1) if grows else int32(0)) != 0:
            m_a, m_ref_a, alpha_a = softmax_rescale(m_a, m_ij_a * scale)
            m_b, m_ref_b, alpha_b = softmax_rescale(m_b, m_ij_b * scale)
            l_a *= alpha_a
            l_b *= alpha_b
            rescale_rows(acc, NO, alpha_a, alpha_b)
        l_a, l_b = exp_and_sum(s, 0, NT, scale, m_ref_a, m_ref_b, l_a, l_b)
        pack_a(p_frag, s)
        return m_a, m_b, l_a, l_b, m_ref_a, m_ref_b

    return softmax_tile


def make_partial(L, warps: int):
    """store_partial(...): a warp's result over its range of keys, as a partial for the merge."""
    HEAD_DIM = L["HEAD_DIM"]
    OUT_TILES = HEAD_DIM // MMA_N
    WARP_FLOATS = L["SMEM_BYTES"] // 4
    LSE_AT = BLOCK_M * HEAD_DIM  # in a warp's shared memory, after the loop: o (BLOCK_M, D), then lse

    @cuda.jit(device=True, inline=True)
    def store_partial(smem_f, warp, g, t, acc, m_a, m_b, l_a, l_b):
        """-- a partial result, o_s = acc / l_i and lse_s = m_i + log2(l_i), in the warp's own
        shared memory (its stages are done with; the block's other warps may still be in their
        loops): o (BLOCK_M, D) row by row, then lse (BLOCK_M). A row that saw no key: o = 0 and
        lse = -inf, which the merge weighs by 0."""
        # the rows' sums over the quad: each lane summed a quarter of each row's columns
        l_a, l_b = quad_sum(l_a, l_b)
        inv_a = float32(1.0) / l_a if l_a != float32(0.0) else float32(0.0)  # a row without keys: 0
        inv_b = float32(1.0) / l_b if l_b != float32(0.0) else float32(0.0)
        mine = warp * WARP_FLOATS  # the warp's partial
        # every lane done reading the warp's memory before any lane overwrites it. The partial
        # covers Q's tile and stage 0's first rows of K (16 and a part); the loop's syncwarp comes
        # before each tile's reads, none after the last, so a last tile in stage 0 (and Q, in a
        # warp with no keys, no loop) was read with nothing between those reads and these stores
        # but shuffles, which order no memory (racecheck found it: docs/sanitizer/README.md)
        cuda.syncwarp()
        for j in range(OUT_TILES):  # the n-tiles of O's HEAD_DIM columns (those past it are 0)
            col = j * MMA_N + 2 * t
            smem_f[mine + g * HEAD_DIM + col] = acc[j, 0] * inv_a
            smem_f[mine + g * HEAD_DIM + col + 1] = acc[j, 1] * inv_a
            smem_f[mine + (g + 8) * HEAD_DIM + col] = acc[j, 2] * inv_b
            smem_f[mine + (g + 8) * HEAD_DIM + col + 1] = acc[j, 3] * inv_b
        if t == 0:
            smem_f[mine + LSE_AT + g] = float32(-math.inf) if l_a == float32(0.0) else m_a + math.log2(l_a)
            smem_f[mine + LSE_AT + g + 8] = \
                float32(-math.inf) if l_b == float32(0.0) else m_b + math.log2(l_b)

    return store_partial


def make_merge(L, dtype="float16", paged=False, warps=WARPS):
    """(merge_warps, merge_blocks): the merge of the partials, as a tree. Level 0 is the block
    (`merge_warps`): once every warp has its partial in shared memory (a barrier), the block merges
    them into its own partial, in the workspace. Then (`merge_blocks`) the blocks' partials are
    gathered in teams of FAN_IN: the last block of a team to finish merges the team's partials into
    the team's first slot (a partial of its own, with its own log-sum-exp), then the teams are
    gathered in teams of FAN_IN in turn, and so on, until one team is left: its last block writes the
    output. The merge is associative, so merging merges gives the same result, and the teams of a
    level merge in parallel, each on its own SM."""
    PAGED, WARPS = paged, warps
    pack = ptx.function("mma_sync.ptx", f"flashcore_pack_{PTX_TYPE[dtype]}x2", "inline")
    HEAD_DIM = L["HEAD_DIM"]
    WARP_FLOATS = L["SMEM_BYTES"] // 4
    THREADS = 32 * WARPS
    PAIRS = HEAD_DIM // 2  # output columns are written two at a time (one packed 32-bit word)
    FAN_IN = fan_in()  # the blocks' partials per merge (the simulator's are fewer)
    TEAM = max(FAN_IN, WARPS)  # the most members a team has (level 0's are the block's warps)
    LSE_AT = BLOCK_M * HEAD_DIM  # in a warp's shared memory, after the loop: o (BLOCK_M, D), then lse
    WEIGHT_AT = WARP_FLOATS - TEAM * BLOCK_M  # the merge's weights: at the end of warp 0's memory
    assert LSE_AT + BLOCK_M <= WEIGHT_AT, "a warp's shared memory holds its partial and the weights"

    @cuda.jit(device=True, inline=True)
    def merge_member(i, args):
        """Member i of a team, times its weight, into sums: columns col and col + 1 of tile row r. A
        member past `last` reads the last one's slot again and adds nothing (a select, not 0 times
        the value: an inf of v stays inf, not NaN)."""
        sums, O_PART, weight, slot0, stride, last, row, r, col = args
        slot = slot0 + min(i, last) * stride
        w = weight[i * BLOCK_M + r]
        xi = w * O_PART[slot, row, col]
        yi = w * O_PART[slot, row, col + 1]
        sums[0] += xi if i <= last else float32(0.0)
        sums[1] += yi if i <= last else float32(0.0)

    chain = unrolled(merge_member, FAN_IN)

    @cuda.jit(device=True, inline=True)
    def merge_members(O_PART, weight, slot0, stride, last, row, r, col):
        """sum_i w_i o_i over a team's members 0 .. last, at columns col and col + 1 of tile row r
        (the row `row` of the workspace): FAN_IN steps with no loop (`unrolled`), so that every
        member's loads go out at once. (As a loop, NVVM unrolls it by four at most: the long decode
        step took 73.4 us against 69.0, docs/tuning/10_history.md.)"""
        sums = cuda.local.array(2, float32)  # registers: constant indices
        sums[0] = float32(0.0)
        sums[1] = float32(0.0)
        chain(0, (sums, O_PART, weight, slot0, stride, last, row, r, col))
        return sums[0], sums[1]

    @cuda.jit(device=True, inline=True)
    def merge_weights(lse_i):
        """(lse, w) of a row: lane i holds member i's lse_i (-inf past the team's members); lse =
        log2(sum_i 2^lse_i), and this lane's weight w = 2^(lse_i - lse)."""
        lse = float32(-math.inf)  # the log of an empty sum: no member saw a key of this row
        w = float32(0.0)
        # >>> exercise 10-a: lse = log2 of the sum over the members of 2^lse_i (lane i holds member i's lse_i; subtract their max first), and this lane's weight w = 2^(lse_i - lse) (0 when no member saw a key)
        # <<< exercise
        return lse, w

    @cuda.jit(device=True, inline=True)
    def put_lse(LSE, LSE_PART, lse, r, last_level, slot, out_row, b, h0, seq_q, row0):
        """A merged row's log-sum-exp: the output's (natural log) at the last level, if asked for,
        else the slot's in the workspace."""
        if not last_level:
            LSE_PART[slot, out_row + r] = lse
        elif LSE.shape[2] != 0:
            hg, qi = packed_row(row0 + r, seq_q)
            LSE[b, h0 + hg, qi] = lse * LN2

    @cuda.jit(device=True, inline=True)
    def put_merged(O, O_PART, x, y, r, col, last_level, slot, out_row, b, h0, seq_q, row0):
        """Merged columns col, col + 1 of tile row r: to the output at the last level (packed), else
        in the team's slot (this thread read the values it replaces already)."""
        if last_level:
            hg, qi = packed_row(row0 + r, seq_q)
            if PAGED:
                O[b, qi, h0 + hg, col // 2] = pack(x, y)
            else:
                O[b, h0 + hg, qi, col // 2] = pack(x, y)
        else:
            O_PART[slot, out_row + r, col] = x
            O_PART[slot, out_row + r, col + 1] = y

    @cuda.jit(device=True, inline=True)
    def arrive(COUNTERS, counter, members, tid, done_s):
        """Count this block as one of the `members` blocks that COUNTERS[counter] waits for; True in
        the block that counts last, which sets the counter back to 0 for the next launch. Each
        block made its partials visible to the whole GPU before it counted, so the block that
        counts last has seen every other block's fence: their partials are there to read.
        done_s: one int32 of shared memory, through which the block's threads learn the count."""
        cuda.threadfence()  # every thread's partials, before the block counts
        cuda.syncthreads()
        done = 0  # how many of the members had counted before this block
        # >>> exercise 10-b: count this block as finished: thread 0 adds 1 to COUNTERS[counter] (cuda.atomic.add returns the old value) and leaves that value in done_s[0]; after a barrier every thread reads it as `done`
        # <<< exercise
        if done != members - 1:
            return False
        cuda.threadfence()  # the other blocks' partials, read after their count
        if tid == 0:
            COUNTERS[counter] = 0  # every member of this launch has counted: ready for the next launch
        return True

    @cuda.jit(device=True, inline=True)
    def merge_warps(smem_f, weight, O, LSE, O_PART, LSE_PART, warp, lane, tid, n_rows, out_row, b, h0, seq_q,
                    row0):
        """Level 0: the block's warps' partials, in shared memory, merged into the block's own (its
        slot of the workspace), or into the output when the block is the only one. Returns whether
        this was the last level."""
        slot = cuda.blockIdx.x  # the block's partial in the workspace
        last_level = cuda.gridDim.x == 1  # one block: its merge is the output
        cuda.syncthreads()  # every warp's partial is written
        # each row's lse = log2(sum_w 2^lse_w) over the warps, lane w holding warp w's, and each
        # warp's weight 2^(lse_w - lse), into shared memory: row r by warp r % WARPS
        for r in range(warp, n_rows, WARPS):
            lse, w = merge_weights(smem_f[lane * WARP_FLOATS + LSE_AT + r] if lane < WARPS
                                   else float32(-math.inf))
            if lane < WARPS:
                weight[lane * BLOCK_M + r] = w
            if lane == 0:
                put_lse(LSE, LSE_PART, lse, r, last_level, slot, out_row, b, h0, seq_q, row0)
        cuda.syncthreads()
        # o = sum_w w_w o_w, two columns per thread
        for idx in range(tid, n_rows * PAIRS, THREADS):
            r, col = idx // PAIRS, 2 * (idx % PAIRS)
            x = float32(0.0)
            y = float32(0.0)
            for i in range(WARPS):
                w = weight[i * BLOCK_M + r]
                x += w * smem_f[i * WARP_FLOATS + r * HEAD_DIM + col]
                y += w * smem_f[i * WARP_FLOATS + r * HEAD_DIM + col + 1]
            put_merged(O, O_PART, x, y, r, col, last_level, slot, out_row, b, h0, seq_q, row0)
        return last_level

    @cuda.jit(device=True, inline=True)
    def merge_blocks(weight, done_s, O, LSE, O_PART, LSE_PART, COUNTERS, warp, lane, tid, n_rows, out_row, b,
                     h0, seq_q, row0, counters):
        """The levels across blocks, in teams of FAN_IN blocks' partials (counters: this row tile's
        first counter); the last block of the last team writes the output."""
        node = cuda.blockIdx.x  # this block's partial among this level's partials
        count = cuda.gridDim.x  # partials at this level
        stride = 1  # slots of O_PART from one partial of this level to the next
        while True:
            team = node // FAN_IN
            first = team * FAN_IN  # the team's first partial: where its merge goes
            members = min(FAN_IN, count - first)
            last_level = count <= FAN_IN  # one team: its merge is the output
            if not arrive(COUNTERS, counters + team, members, tid, done_s):
                return  # another block of the team merges it
            # each row's lse and the members' weights, as above: lane i holds member i's lse_i
            for r in range(warp, n_rows, WARPS):
                row = out_row + r
                lse, w = merge_weights(LSE_PART[(first + lane) * stride, row] if lane < members
                                       else float32(-math.inf))
                if lane < FAN_IN:
                    weight[lane * BLOCK_M + r] = w
                if lane == 0:  # every lane has read the team's first lse: overwritten in place
                    put_lse(LSE, LSE_PART, lse, r, last_level, first * stride, out_row, b, h0, seq_q, row0)
            cuda.syncthreads()
            # o = sum_i w_i o_i, two columns per thread, the members' loads all in flight (merge_members)
            for idx in range(tid, n_rows * PAIRS, THREADS):
                r, col = idx // PAIRS, 2 * (idx % PAIRS)
                x, y = merge_members(O_PART, weight, first * stride, stride, members - 1, out_row + r, r, col)
                put_merged(O, O_PART, x, y, r, col, last_level, first * stride, out_row, b, h0, seq_q, row0)
            if last_level:
                return
            # the next level: this level's teams are its partials (the barrier in `arrive` keeps the
            # next level's weights from being written before every thread has read these)
            teams = (count + FAN_IN - 1) // FAN_IN
            counters += teams  # past this level's counters
            node = team
            count = teams
            stride *= FAN_IN

    return merge_warps, merge_blocks, WEIGHT_AT, TEAM


def build_kernel(L, dtype="float16", paged=False, warps=None) -> KernelConfig:
    """Phase 10's kernel, `warps` warps a block (block_warps() if None); with `paged`, the same kernel
    on a KV cache (flashcore_numba.inference): q and the output as (B, S_q, H, D), K and V as pages
    (num_pages, page_size, H_kv, D) named by a block table (B, pages per sequence), and each
    sequence's own length. Only where rows live and how many keys a sequence has differ (the branches
    on PAGED, settled when the kernel is built).

    The roles, each a function of its own above: the copies (make_loads), the products
    (make_products), the softmax of a tile (make_softmax_tile), a warp's partial (make_partial) and
    the merge (make_merge); `attend` below is the algorithm that wires them, one block's work."""
    PAGED = paged
    STAGES = L["STAGES"]
    WARPS = block_warps() if warps is None else warps
    WARP_BYTES = L["SMEM_BYTES"]  # one warp's Q tile and stages of K and V; then its partial
    commit = ptx.function("cp_async.ptx", "flashcore_cp_async_commit", "inline")
    # wait until the oldest of the groups in flight has landed: STAGES - 2 newer ones may still fly
    wait_pending = ptx.function("cp_async.ptx", f"flashcore_cp_async_wait_{STAGES - 2}", "inline")
    shared_address, global_address = operands.shared_address, operands.global_address
    copy_tile, copy_q_rows, tile_pages, copy_kv = make_loads(L, paged)
    q_fragments, scores, pv_steps = make_products(L, dtype)
    softmax_tile = make_softmax_tile(L, dtype)
    store_partial = make_partial(L, WARPS)
    merge_warps, merge_blocks, WEIGHT_AT, TEAM = make_merge(L, dtype, paged, WARPS)
    HEAD_DIM, BLOCK_N = L["HEAD_DIM"], L["BLOCK_N"]
    ROW = HEAD_DIM * 2  # bytes from a row of q, K or V to the next (copy_tile)
    STRIDE, K_OFF, V_OFF, STAGE_BYTES = L["STRIDE"], L["K_OFF"], L["V_OFF"], L["STAGE_BYTES"]
    NT, KQ, KP, NO = L["NT"], L["KQ"], L["KP"], L["NO"]
    ROW_BYTES = STRIDE * 2  # a row in shared memory: D_TILE columns, unpadded (ROW where D is D_TILE)
    # swizzled rows: every tile of a warp's memory starts at a multiple of a row, so that an XOR of
    # an offset's bits within a row (`at`) moves it within the same row; and each warp's memory
    # starts on a 128-byte line, so that the eight rows ldmatrix reads fall in eight banks
    assert K_OFF % ROW_BYTES == 0 and V_OFF % ROW_BYTES == 0 and STAGE_BYTES % ROW_BYTES == 0
    assert WARP_BYTES % 128 == 0

    @cuda.jit(device=True, inline=True)
    def attend(Q, K, V, O, LSE, causal, qk_scale, O_PART, LSE_PART, COUNTERS, SEQLENS, BLOCK_TABLE):
        """The whole of one block's work (the kernels below only name their arguments)."""
        smem_h = cuda.shared.array(0, uint32, alignment=128)
        smem_f = cuda.shared.array(0, float32)  # the same memory, as floats: the merge's
        tid = cuda.threadIdx.x
        warp = tid // 32  # each warp runs phase 07's loop over a range of keys of its own
        lane = tid % 32
        smem = shared_address(smem_h) + uint32(warp * WARP_BYTES)  # the warp's Q tile and stages
        split = cuda.blockIdx.x * WARPS + warp  # which range of keys
        n_splits = cuda.gridDim.x * WARPS
        if PAGED:  # q (B, S_q, H, D), K and V (pages, page_size, H_kv, D), each sequence its length
            # the length is the caller's promise, clamped to what the cache holds (its pages times their keys)
            seq_k = int32(min(max(SEQLENS[cuda.blockIdx.z], 0), BLOCK_TABLE.shape[1] * K.shape[1]))
            H, H_kv, seq_q = Q.shape[2], K.shape[2], Q.shape[1]
        else:
            H, H_kv, seq_q, seq_k = Q.shape[1], K.shape[1], Q.shape[2], K.shape[2]
        group = div32(H, H_kv)  # query heads per K/V head
        rows = group * seq_q  # the packed rows of one K/V head
        row_tiles = (rows + BLOCK_M - 1) // BLOCK_M
        tile = div32(cuda.blockIdx.y, H_kv)
        h_kv = mod32(cuda.blockIdx.y, H_kv)
        b = cuda.blockIdx.z
        g = lane // 4  # this lane's packed rows: row0 + g and row0 + g + 8 (as phase 07's rows)
        t = lane % 4  # and its columns 2t, 2t + 1 of every 8-column tile
        row0 = tile * BLOCK_M
        # the group's packed rows are consecutive rows of q, starting at row 0 of head h_kv * group
        first_row = (b * H + h_kv * group) * seq_q  # as a row of the (B * H * S_q, D) matrix q is
        head_q = uint64(first_row * HEAD_DIM * 2)
        head_kv = uint64(((b * H_kv + h_kv) * seq_k) * HEAD_DIM * 2)

        # -- the keys this block's rows see (the one whose query row is last sees the most), and
        # this split's share of them, whole tiles
        last = min(row0 + BLOCK_M, rows) - 1
        q_last = seq_q - 1 if uint32(row0) // uint32(seq_q) != uint32(last) // uint32(seq_q) else \
            mod32(last, seq_q)  # (the heads compared unsigned: as div32's, ptxas laid out more code)
        block_k_end = int32(key_end(q_last, seq_q, seq_k, causal))
        tiles_per_split = div32(block_k_end + BLOCK_N * n_splits - 1, BLOCK_N * n_splits)
        k_start = int32(split * tiles_per_split * BLOCK_N)
        k_stop = min(block_k_end, k_start + int32(tiles_per_split * BLOCK_N))
        _, q_a = packed_row(min(row0 + g, rows - 1), seq_q)
        _, q_b = packed_row(min(row0 + g + 8, rows - 1), seq_q)
        k_end_a = key_end(q_a, seq_q, seq_k, causal)
        k_end_b = key_end(q_b, seq_q, seq_k, causal)

        q_frag = cuda.local.array((KQ, 4), uint32)
        s = cuda.local.array((NT, 4), float32)
        s_hi = cuda.local.array((NT, 4), float32)  # q · kᵀ over the upper half of the head dim
        p_frag = cuda.local.array((KP, 4), uint32)
        acc = cuda.local.array((NO, 4), float32)
        zero_tiles(acc, NO)
        m_a = float32(-math.inf)
        m_b = float32(-math.inf)
        l_a = float32(0.0)
        l_b = float32(0.0)
        m_ref_a = float32(0.0)  # what scores are measured against (softmax_rescale's m_ref)
        m_ref_b = float32(0.0)

        # -- prologue: the 16 packed rows of Q, then the range's first STAGES - 1 tiles of K and V,
        # a commit group each (a group past the range is empty: the count of groups stays the same)
        if PAGED:
            copy_q_rows(smem, Q, b, h_kv * group, row0, rows, seq_q, lane)
            # pages of at least a tile: each tile's (at most two) pages read once, a tile ahead of its
            # copy; smaller pages: the block table read for every key (copy_kv_pages)
            page_size = K.shape[1]
            whole_tiles = page_size >= BLOCK_N
        else:
            copy_tile(smem, 0, global_address(Q), head_q, row0, BLOCK_M, rows, lane, ROW)
            page_size = 1
            whole_tiles = False
        pages = (int64(0), int64(0), int64(0), int64(0))  # (paged, whole tiles) the next copy's pages
        for st in range(STAGES - 1):
            key0 = k_start + st * BLOCK_N
            if key0 < k_stop:
                if PAGED and whole_tiles:
                    pages = tile_pages(BLOCK_TABLE, b, key0, seq_k, page_size, K.shape[0])
                copy_kv(smem, st, K, V, head_kv, h_kv, key0, seq_k, lane, BLOCK_TABLE, b, pages, whole_tiles)
            commit()
        if PAGED and whole_tiles and k_start + (STAGES - 1) * BLOCK_N < k_stop:
            pages = tile_pages(BLOCK_TABLE, b, k_start + (STAGES - 1) * BLOCK_N, seq_k, page_size, K.shape[0])
        wait_pending()  # the first group, Q's rows with the first tile, has landed
        cuda.syncwarp()  # every lane's copies (no other warp reads this warp's shared memory)
        if qk_scale < 0:  # as phase 07: the sign goes into q, the max and exp2 need a scale >= 0
            for w in range(lane, BLOCK_M * STRIDE // 2, 32):
                smem_h[warp * (WARP_BYTES // 4) + w] ^= uint32(0x80008000)
            cuda.syncwarp()
        scale = max(abs(qk_scale), float32(1e-30))
        # ldmatrix lane addresses (phase 07's): A rows of Q's 16 rows, B rows of two n-tiles of K,
        # and of V transposed; in swizzled rows a lane's row % 8 is lane % 8 and its chunk c is at
        # c ^ (lane % 8)
        sw = lane % 8
        q_lane = uint32((lane % 16) * ROW_BYTES + ((lane // 16) ^ sw) * 16)
        q_fragments(q_frag, smem, q_lane)
        k_lane = uint32(((lane // 16) * 8 + lane % 8) * ROW_BYTES + (((lane // 8) % 2) ^ sw) * 16)
        v_lane = uint32((((lane // 8) % 2) * 8 + lane % 8) * ROW_BYTES + ((lane // 16) ^ sw) * 16)

        # -- phase 07's loop over this split's keys, STAGES - 1 tiles in flight while one is used
        stage = 0
        for start_n in range(k_start, k_stop, int32(BLOCK_N)):
            wait_pending()  # this tile's group has landed (the STAGES - 2 newer ones may still fly)
            cuda.syncwarp()  # every lane's copies, and every lane done with the stage the next copy
            # overwrites (the one used last time round)
            next_n = start_n + int32((STAGES - 1) * BLOCK_N)
            if next_n < k_stop:
                copy_kv(smem, (stage + STAGES - 1) % STAGES, K, V, head_kv, h_kv, next_n, seq_k, lane, BLOCK_TABLE,
                        b, pages, whole_tiles)
                if PAGED and whole_tiles and next_n + BLOCK_N < k_stop:  # the tile after: its pages now
                    pages = tile_pages(BLOCK_TABLE, b, next_n + BLOCK_N, seq_k, page_size, K.shape[0])
            commit()
            scores(s, s_hi, q_frag, smem, uint32(K_OFF + stage * STAGE_BYTES) + k_lane)
            m_a, m_b, l_a, l_b, m_ref_a, m_ref_b = softmax_tile(s, p_frag, acc, start_n, t, k_end_a, k_end_b,
                                                                scale, m_a, m_b, l_a, l_b, m_ref_a, m_ref_b)
            pv_steps(0, (acc, p_frag, smem, uint32(V_OFF + stage * STAGE_BYTES) + v_lane))
            stage = stage + 1 if stage + 1 < STAGES else 0

        store_partial(smem_f, warp, g, t, acc, m_a, m_b, l_a, l_b)

        # -- merge, as a tree (make_merge): the block's warps, then the blocks, in teams
        weight = smem_f[WEIGHT_AT:WEIGHT_AT + TEAM * BLOCK_M]  # (TEAM, BLOCK_M), past warp 0's partial
        done_s = cuda.shared.array(1, int32)  # arrive's count, for the whole block
        n_rows = min(BLOCK_M, rows - row0)
        out_row = first_row + row0
        if merge_warps(smem_f, weight, O, LSE, O_PART, LSE_PART, warp, lane, tid, n_rows, out_row, b,
                       h_kv * group, seq_q, row0):
            return
        per_tile = div32(COUNTERS.shape[0], cuda.gridDim.y * cuda.gridDim.z)  # merge_counters(blocks)
        counters = ((b * H_kv + h_kv) * row_tiles + tile) * per_tile  # this row tile's first counter
        merge_blocks(weight, done_s, O, LSE, O_PART, LSE_PART, COUNTERS, warp, lane, tid, n_rows, out_row, b,
                     h_kv * group, seq_q, row0, counters)

    @cuda.jit
    def split_keys_attention(Q, K, V, O, LSE, causal, qk_scale, O_PART, LSE_PART, COUNTERS):
        attend(Q, K, V, O, LSE, causal, qk_scale, O_PART, LSE_PART, COUNTERS, COUNTERS, COUNTERS)

    @cuda.jit
    def split_keys_kvcache(Q, K, V, O, LSE, causal, qk_scale, O_PART, LSE_PART, COUNTERS, SEQLENS, BLOCK_TABLE):
        attend(Q, K, V, O, LSE, causal, qk_scale, O_PART, LSE_PART, COUNTERS, SEQLENS, BLOCK_TABLE)

    smem_bytes = smem_size(L, WARPS)
    return KernelConfig(split_keys_kvcache if PAGED else split_keys_attention, block_m=BLOCK_M,
                        n_threads=32 * WARPS, smem_bytes=smem_bytes, packed_output=True, lse=True,
                        kv_cache=PAGED, split_keys=make_splits(BLOCK_N, smem_bytes, fan_in(), WARPS))


@lru_cache(maxsize=None)
def build(HEAD_DIM: int, variant: str | None = None, dtype: str = "float16", paged: bool = False) -> KernelConfig:
    """The kernel for head dim HEAD_DIM and `dtype` ("float16" or "bfloat16"), four warps a block, or
    BATCH_WARPS with `variant` "batch" (the simulator's blocks have SIM_WARPS either way); with
    `paged`, the same kernel reading a KV cache (flashcore_numba.inference.attention_kvcache)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: phase 10 builds {' and '.join(DTYPES)}, not {dtype!r}")
    if variant not in (None, *VARIANTS):
        raise ValueError(f"variant: expected None or one of {', '.join(VARIANTS)}, got {variant!r}")
    if not runs_head_dim(HEAD_DIM):
        raise ValueError(f"head dim: phase 10 builds {HEAD_DIMS_TEXT}, not {HEAD_DIM!r}")
    L = split_layout(HEAD_DIM, **tiles(HEAD_DIM))
    warps = BATCH_WARPS if variant == "batch" and not simulator_enabled() else None
    return build_kernel(L, dtype, paged, warps)

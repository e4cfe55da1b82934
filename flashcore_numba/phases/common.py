"""Pieces every phase shares, written once: masking, the online-softmax update, tile loads,
the tensor-core phases' epilogues and the kernel launch.

Vocabulary used in every phase (the names of the FlashAttention papers and Triton's
fused-attention tutorial):

    BLOCK_M   query rows handled by one thread block (CTA)
    BLOCK_N   keys per tile of K and V
    HEAD_DIM  D, the head dimension (a compile-time constant: each phase builds one kernel per D)
    qk_scale  softmax scale times log2(e): scores live in base 2 so the kernels call exp2,
              which is a single hardware instruction (ex2.approx.f32)
    m_i       running row maximum of the scores seen so far (base 2)
    l_i       running row sum of exp2(score - m_i)
    acc       running un-normalized output row: sum of exp2(score - m_i) * v
    k_end     one past the last key a query row may see (sequence end or causal limit)

Every kernel has the same signature, `kernel(Q, K, V, O, causal, qk_scale)`, with Q, K, V, O
of shape (B, H, S, D) fp16, and the same grid: x = block of BLOCK_M query rows, y = head,
z = batch (except a kernel that loops over its query blocks, `work_units`: phase 09 takes them
from a 1-D grid, one block per SM). A bf16 kernel (phase 07 on) gets the arrays as int16 bit
patterns (Numba has no bf16 type), and a kernel that stores two neighbouring output columns at once
(`packed_output`) gets O viewed as uint32 pairs, (B, H, S, D/2). A kernel that loads its
tiles by TMA (phase 09, `tma_box`) gets one argument more: the tensor maps of Q, K and V; and a
kernel with `work_units` one more, last: the counter that hands its query blocks out. The
tensor-core phases (07 on, `lse`) take LSE after O, (B, H, S_q) float32: each row's log-sum-exp
for `attention(..., return_lse=True)`, or an empty array when it is not asked for.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from ..arch import operands, scratch
from ..arch.sim import arithmetic_device_function, fast_fdividef, simulator_enabled, simulator_pacing
from ..arch.cache import cache_dir, install
from ..arch.smem import STATIC_SMEM_LIMIT, argument_types, raise_dynamic_smem_limit

LOG2E = 1.4426950408889634
FULL_MASK = 0xFFFFFFFF  # bit i is lane i: all 32 lanes of the warp take part in a shuffle or vote


# ---------------------------------------------------------------------------------------------
# Indexing
# ---------------------------------------------------------------------------------------------
@arithmetic_device_function
def uidx(i):
    """An array index as an unsigned integer, for the hot loops.

    Numba, like Python, lets a negative index count from the end of an array, so every
    `a[i]` with a signed i compiles to a sign test and a conditional add in 64-bit
    arithmetic: six extra instructions per access (see the PTX in lesson 03). With an
    unsigned index that code disappears and the address becomes base + constant offset.
    docs/tuning/02-05_history.md has the H100 sweeps before and after.
    """
    return uint64(i)


# ---------------------------------------------------------------------------------------------
# Masking: one rule for sequence tails and causal masks
# ---------------------------------------------------------------------------------------------
@cuda.jit(device=True, inline=True)
def key_end(row, seq_q, seq_k, causal):
    """One past the last key that query `row` may see.

    Without a causal mask that is seq_k (keys past the end of the sequence are masked).
    With one, row i sees keys j <= i + (seq_k - seq_q): the mask is aligned to the
    bottom-right corner, as FlashAttention-2 does, so it is the usual lower triangle
    when seq_q == seq_k. A key is visible exactly when `col < key_end(row, ...)`.
    """
    if causal:
        return min(seq_k, max(0, row + 1 + seq_k - seq_q))
    return seq_k


@cuda.jit(device=True, inline=True)
def packed_span(CU, b, total):
    """(first row, rows) of sequence b of packed sequences (attention_varlen) whose offsets are CU
    (B + 1 int32, the caller's promise): clamped to the `total` packed rows and never decreasing, so
    that wrong offsets give a wrong row, never a read or write outside the packed arrays."""
    first = int32(min(max(CU[b], 0), total))
    end = int32(min(max(CU[b + 1], first), total))
    return first, end - first


# ---------------------------------------------------------------------------------------------
# Online softmax
# ---------------------------------------------------------------------------------------------
@cuda.jit(device=True, inline=True)
def softmax_rescale(m_i, m_ij):
    """-- update m_i: returns (m_new, m_ref, alpha).

    m_new = max(m_i, m_ij) is the new running maximum; alpha = exp2(m_i - m_new) is the
    factor that rescales the old l_i and acc to the new maximum; m_ref is what scores are
    measured against, p = exp2(s - m_ref).

    A row that has seen only masked keys keeps m_new = -inf. Measuring against 0 instead
    keeps (-inf) - (-inf) from producing NaN; every p is exp2(-inf) = 0 anyway.
    """
    m_new = max(m_i, m_ij)
    m_ref = m_new
    if m_new == -math.inf:
        m_ref = float32(0.0)
    alpha = math.exp2(m_i - m_ref)
    return m_new, m_ref, alpha


# ---------------------------------------------------------------------------------------------
# Fragments: a warp's tiles of scores and of O, in the accumulator layout of mma.sync and wgmma
# ---------------------------------------------------------------------------------------------
# The tensor-core phases (07 on) keep S, P and O where the products leave them. Of every 16 rows
# of a tile, lane l of the warp holds two, row a = l // 4 and row b = a + 8, and of every block j
# of 8 columns (an n-tile) two columns, 2t and 2t + 1 (t = l % 4): a fragment s of shape (n, 4)
# holds s[j, 0], s[j, 1] of row a and s[j, 2], s[j, 3] of row b. The four lanes of a quad (the same
# l // 4) share their rows, so a row's max or sum is this lane's part, then two shuffles in the quad.
# A kernel indexes its fragments by constants alone (loops the compiler unrolls), so that they stay
# in registers: the helpers below walk n-tiles j0 .. j0 + n - 1 with j0 and n constants.
MMA_N = 8  # columns of an n-tile: the n of mma.sync's m16n8k16 and of wgmma's 8-column blocks


@cuda.jit(device=True, inline=True)
def zero_tiles(c, n):
    """n-tiles 0 .. n - 1 of the fragment c (four values each) set to 0: a product's accumulators
    before its first k-step."""
    for j in range(n):
        for e in range(4):
            c[j, e] = float32(0.0)


@cuda.jit(device=True, inline=True)
def mask_scores(s, j0, n, start_n, t, k_end_a, k_end_b):
    """-- mask: in n-tiles j0 .. j0 + n - 1 of s (a tile of scores whose column 0 is key start_n),
    the keys that rows a and b may not see set to -inf: those from the row's k_end on."""
    for j in range(j0, j0 + n):
        col = start_n + j * MMA_N + 2 * t
        if col >= k_end_a:
            s[j, 0] = float32(-math.inf)
        if col + 1 >= k_end_a:
            s[j, 1] = float32(-math.inf)
        if col >= k_end_b:
            s[j, 2] = float32(-math.inf)
        if col + 1 >= k_end_b:
            s[j, 3] = float32(-math.inf)


@cuda.jit(device=True, inline=True)
def row_max(s, j0, n, m_ij_a, m_ij_b):
    """-- row maxima: m_ij_a and m_ij_b (rows a and b) raised to the largest of this lane's scores
    in n-tiles j0 .. j0 + n - 1 of s. Only this lane's columns: `quad_max` takes the whole row's."""
    for j in range(j0, j0 + n):
        m_ij_a = max(m_ij_a, max(s[j, 0], s[j, 1]))
        m_ij_b = max(m_ij_b, max(s[j, 2], s[j, 3]))
    return m_ij_a, m_ij_b


@cuda.jit(device=True, inline=True)
def quad_max(m_ij_a, m_ij_b):
    """The maxima of rows a and b over the quad's four lanes, in each of them: every lane of the
    quad holds a quarter of the rows' columns (xor 1 and xor 2 stay within the quad)."""
    m_ij_a = max(m_ij_a, cuda.shfl_xor_sync(FULL_MASK, m_ij_a, 1))
    m_ij_a = max(m_ij_a, cuda.shfl_xor_sync(FULL_MASK, m_ij_a, 2))
    m_ij_b = max(m_ij_b, cuda.shfl_xor_sync(FULL_MASK, m_ij_b, 1))
    m_ij_b = max(m_ij_b, cuda.shfl_xor_sync(FULL_MASK, m_ij_b, 2))
    return m_ij_a, m_ij_b


@cuda.jit(device=True, inline=True)
def quad_sum(l_a, l_b):
    """The sums of rows a and b over the quad's four lanes, in each of them (as `quad_max`)."""
    l_a += cuda.shfl_xor_sync(FULL_MASK, l_a, 1)
    l_a += cuda.shfl_xor_sync(FULL_MASK, l_a, 2)
    l_b += cuda.shfl_xor_sync(FULL_MASK, l_b, 1)
    l_b += cuda.shfl_xor_sync(FULL_MASK, l_b, 2)
    return l_a, l_b


@cuda.jit(device=True, inline=True)
def warp_max(x):
    """The max of x over the 32 lanes, in every lane (a butterfly of shuffles, as phase 03's)."""
    for offset in (16, 8, 4, 2, 1):
        x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, offset))
    return x


@cuda.jit(device=True, inline=True)
def warp_sum(x):
    """The sum of x over the 32 lanes, in every lane."""
    for offset in (16, 8, 4, 2, 1):
        x += cuda.shfl_xor_sync(FULL_MASK, x, offset)
    return x


def make_exp_and_sum(exp2):
    """exp_and_sum(s, j0, n, scale, m_ref_a, m_ref_b, sum_a, sum_b), with `exp2` the kernel's
    (ptx/exp2.ptx: one MUFU.EX2)."""

    @cuda.jit(device=True, inline=True)
    def exp_and_sum(s, j0, n, scale, m_ref_a, m_ref_b, sum_a, sum_b):
        """-- p = exp2(s · scale - m_ref) in place of the scores of n-tiles j0 .. j0 + n - 1, and
        this lane's part of the rows' sums added to sum_a and sum_b (returned). The scale is
        folded into the exponent: one FFMA and one MUFU.EX2 a score (softmax_rescale: m_ref)."""
        for j in range(j0, j0 + n):
            s[j, 0] = exp2(cuda.fma(s[j, 0], scale, -m_ref_a))
            s[j, 1] = exp2(cuda.fma(s[j, 1], scale, -m_ref_a))
            s[j, 2] = exp2(cuda.fma(s[j, 2], scale, -m_ref_b))
            s[j, 3] = exp2(cuda.fma(s[j, 3], scale, -m_ref_b))
            sum_a += s[j, 0] + s[j, 1]
            sum_b += s[j, 2] + s[j, 3]
        return sum_a, sum_b

    return exp_and_sum


@cuda.jit(device=True, inline=True)
def rescale_rows(acc, n, alpha_a, alpha_b):
    """-- rescale: acc = alpha · acc over n-tiles 0 .. n - 1 (row a by alpha_a, row b by alpha_b),
    when the running max has moved and the next P·V is to be added at the new scale."""
    for j in range(n):
        acc[j, 0] *= alpha_a
        acc[j, 1] *= alpha_a
        acc[j, 2] *= alpha_b
        acc[j, 3] *= alpha_b


def make_pack_a(pack, k_steps: int):
    """pack_a(frag, c) for `k_steps` k-steps of 16, with `pack` the kernel's two fp32 -> one
    16-bit pair (fp16 or bf16)."""

    @cuda.jit(device=True, inline=True)
    def pack_a(frag, c):
        """-- P as A fragments: the accumulators c of n-tiles 2kk and 2kk + 1 are k-step kk's A
        fragment (rows a, b; columns 2t, 2t + 1 and 2t + 8, 2t + 9 of the k-step's 16), rounded to
        16 bits, two values a register. So P never leaves the registers on its way to P·V."""
        for kk in range(k_steps):
            frag[kk, 0] = pack(c[2 * kk, 0], c[2 * kk, 1])
            frag[kk, 1] = pack(c[2 * kk, 2], c[2 * kk, 3])
            frag[kk, 2] = pack(c[2 * kk + 1, 0], c[2 * kk + 1, 1])
            frag[kk, 3] = pack(c[2 * kk + 1, 2], c[2 * kk + 1, 3])

    return pack_a


@cuda.jit(device=True, inline=True)
def finalize(acc_value, l_i):
    """-- epilogue: o = acc / l_i; a row that saw no key (or only -inf scores) has l_i = 0 and
    outputs 0, never NaN. A NaN l_i (a +inf or NaN score) passes through: the row is NaN."""
    if l_i == float32(0.0):
        return float32(0.0)
    return acc_value / l_i


@cuda.jit(device=True, inline=True)
def quad_row_inverses(l_a, l_b):
    """1 / l_i of a thread's two rows (a and b), each of whose four quad lanes summed a quarter of
    the row's columns: the sums over the quad by shuffles, then the divisions (0 for a row that
    saw no key, l_i = 0; NaN for a NaN l_i, as `finalize`)."""
    l_a, l_b = quad_sum(l_a, l_b)
    # 1 / l_i by the fast approximate division: an IEEE division has a slow path that is a
    # subroutine call, and a call anywhere in a kernel serializes its wgmmas
    inv_a = fast_fdividef(float32(1.0), l_a) if l_a != float32(0.0) else float32(0.0)
    inv_b = fast_fdividef(float32(1.0), l_b) if l_b != float32(0.0) else float32(0.0)
    return inv_a, inv_b


LN2 = float32(math.log(2.0))


@cuda.jit(device=True, inline=True)
def row_lse(m_i, l_i):
    """A row's log-sum-exp in the natural-log convention of torch and FlashAttention,
    log(sum_j exp(score_j * scale)), from the kernel's base-2 state: l_i = sum_j exp2(s_j - m_i)
    with s_j = score_j * scale * log2(e), so the sum is 2^m_i * l_i and its natural log is
    (m_i + log2(l_i)) * ln 2. A row that saw no key (l_i = 0) gets -inf, the log of an empty sum
    (FlashAttention writes +inf there); a NaN l_i stays NaN."""
    if l_i == float32(0.0):
        return float32(-math.inf)
    return (m_i + math.log2(l_i)) * LN2


@cuda.jit(device=True, inline=True)
def store_lse(LSE, b, h, row_a, row_b, seq_q, t, l_a, l_b, m_a, m_b):
    """`return_lse`: the log-sum-exp of a thread's two rows (a and b, as in `store_rows`) into
    LSE (B, H, S_q) float32. The four lanes of a quad each hold a quarter of a row's l_i and the
    same m_i: the sums over the quad, then lane t = 0 writes. The whole warp calls it (shuffles)."""
    l_a, l_b = quad_sum(l_a, l_b)
    if t == 0:
        if row_a < seq_q:
            LSE[b, h, row_a] = row_lse(m_a, l_a)
        if row_b < seq_q:
            LSE[b, h, row_b] = row_lse(m_b, l_b)


def fragment_epilogue(pack, n_blocks):
    """The epilogue of phase 08, for its 16-bit type (`pack`: two fp32 -> one packed pair of
    fp16 or bf16) and an accumulator of `n_blocks` 8-column blocks (D / 8).

    Every thread holds, of its warp's 16 query rows, rows a (its group g) and b (g + 8), in
    columns 2t and 2t + 1 of each block j: the accumulator layout of mma.sync and wgmma alike.
    The device function it returns, `store_rows(O, b, h, row_a, row_b, seq_q, t, acc, l_a, l_b)`,
    sums l_i over the quad (each of its four threads summed a quarter of the row's columns), takes
    o = acc / l_i and writes columns 2t, 2t + 1 of block j as one store: O is viewed as uint32
    pairs, pair 4j + t. Rows past seq_q are not written; a row that saw no key writes 0.
    """

    @cuda.jit(device=True, inline=True)
    def store_rows(O, b, h, row_a, row_b, seq_q, t, acc, l_a, l_b):
        inv_a, inv_b = quad_row_inverses(l_a, l_b)
        # unsigned indices (uidx): with signed ones each store has its own negative-index test,
        # which in a loop over query blocks (phase 09) the compiler hoists and keeps in registers
        for j in range(n_blocks):
            pair = uidx(j * 4 + t)
            if row_a < seq_q:
                O[uidx(b), uidx(h), uidx(row_a), pair] = pack(acc[j, 0] * inv_a, acc[j, 1] * inv_a)
            if row_b < seq_q:
                O[uidx(b), uidx(h), uidx(row_b), pair] = pack(acc[j, 2] * inv_b, acc[j, 3] * inv_b)

    return store_rows


@cuda.jit(device=True, inline=True)
def rotate4(x0, x1, x2, x3, k):
    """(x_k, x_k+1, x_k+2, x_k+3), indices mod 4, for a k that differs between lanes: selects,
    not an indexed array (which would go to local memory)."""
    odd = (k & 1) != 0
    y0 = x1 if odd else x0
    y1 = x2 if odd else x1
    y2 = x3 if odd else x2
    y3 = x0 if odd else x3
    two = (k & 2) != 0
    return (y2 if two else y0), (y3 if two else y1), (y0 if two else y2), (y1 if two else y3)


def fragment_epilogue_16b(pack, n_blocks, st_global_v4, n_out=None):
    """The epilogue of phases 07 and 09: what `fragment_epilogue` writes, in 16-byte stores
    (`st_global_v4`: ptx/store.ptx's flashcore_st_global_v4, one STG.E.128).

    In the accumulator layout lane t of a quad holds 4 bytes of each 8-column block of its row
    (columns 2t, 2t + 1, packed). For each group of four blocks (4G .. 4G + 3) the quad
    transposes its 4 x 4 words, so that lane t ends up with all four words of block 4G + t, 16
    contiguous bytes, and stores them at once. The transpose takes three shuffles: in round k
    (1, 2, 3) every lane sends the word that lane t + k needs and receives, from lane t - k, its
    own word t - k. n_blocks must be a multiple of 4 (D = 64 and 128: 8 and 16 blocks). Where O's rows
    are narrower than the tiles (`n_out` blocks of 8 columns, fewer than n_blocks: a head dim rounded
    up), a lane whose block lies past them stores nothing.
    O is viewed as uint32 pairs and must start on a 16-byte boundary (the launch checks it).
    Returns (store_rows, store_rows_at): O's rows found from (b, h) in a (B, H, S, D / 2) array, or
    from an address and a stride.
    """
    assert n_blocks % 4 == 0, "the quad transposes groups of four 8-column blocks"
    N_OUT = n_blocks if n_out is None else n_out
    assert 0 < N_OUT <= n_blocks
    NARROW = N_OUT < n_blocks  # (settled when the kernel is built)

    @cuda.jit(device=True, inline=True)
    def store_row(row_address, valid, t, acc, e, inv):
        """One row, registers e and e + 1 of each block (0: row a, 2: row b), scaled by inv = 1 / l_i."""
        quad = (cuda.threadIdx.x % 32) - t  # lane of the quad's first thread
        for G in range(n_blocks // 4):
            x0 = pack(acc[4 * G, e] * inv, acc[4 * G, e + 1] * inv)
            x1 = pack(acc[4 * G + 1, e] * inv, acc[4 * G + 1, e + 1] * inv)
            x2 = pack(acc[4 * G + 2, e] * inv, acc[4 * G + 2, e + 1] * inv)
            x3 = pack(acc[4 * G + 3, e] * inv, acc[4 * G + 3, e + 1] * inv)
            # send[k] = x[(t + k) % 4], the word lane t + k needs; send[0] = x[t] stays here
            send0, send1, send2, send3 = rotate4(x0, x1, x2, x3, t)
            # got_k: lane (t - k)'s word t, i.e. word (t - k) % 4 of block 4G + t (shfl moves int32)
            got1 = uint32(cuda.shfl_sync(FULL_MASK, int32(send1), quad + ((t - 1) & 3)))
            got2 = uint32(cuda.shfl_sync(FULL_MASK, int32(send2), quad + ((t - 2) & 3)))
            got3 = uint32(cuda.shfl_sync(FULL_MASK, int32(send3), quad + ((t - 3) & 3)))
            # word s is got_((t - s) % 4): in order s = 0 .. 3 that is (got_0, got_3, got_2, got_1)
            # rotated by (4 - t) % 4
            w0, w1, w2, w3 = rotate4(send0, got3, got2, got1, (4 - t) & 3)
            if valid and (not NARROW or 4 * G + t < N_OUT):  # every lane shuffles above; only rows
                # before seq_q are written, and only O's columns
                st_global_v4(row_address + uint64(16 * (4 * G + t)), w0, w1, w2, w3)

    @cuda.jit(device=True, inline=True)
    def store_rows(O, b, h, row_a, row_b, seq_q, t, acc, l_a, l_b):
        inv_a, inv_b = quad_row_inverses(l_a, l_b)
        row_bytes = uint64(O.shape[3] * 4)  # O as uint32 pairs: D / 2 of them per row
        plane = (uint64(b) * uint64(O.shape[1]) + uint64(h)) * uint64(O.shape[2])  # row 0 of O[b, h]
        base = operands.global_address(O)
        store_row(base + (plane + uint64(row_a)) * row_bytes, row_a < seq_q, t, acc, 0, inv_a)
        store_row(base + (plane + uint64(row_b)) * row_bytes, row_b < seq_q, t, acc, 2, inv_b)

    @cuda.jit(device=True, inline=True)
    def store_rows_at(row0_address, row_stride, row_a, row_b, seq_q, t, acc, l_a, l_b):
        """store_rows where a head's rows are not one after another: row r at row0_address + r *
        row_stride bytes (packed sequences, (total, H, D): the stride is H * D * 2)."""
        inv_a, inv_b = quad_row_inverses(l_a, l_b)
        store_row(row0_address + uint64(row_a) * row_stride, row_a < seq_q, t, acc, 0, inv_a)
        store_row(row0_address + uint64(row_b) * row_stride, row_b < seq_q, t, acc, 2, inv_b)

    return store_rows, store_rows_at


# ---------------------------------------------------------------------------------------------
# Tile loads: global fp16 -> shared fp32
# ---------------------------------------------------------------------------------------------
@cuda.jit(device=True, inline=True)
def load_tile(smem, base, row_stride, src, b, h, row0, seq_len, tid, N_THREADS, N_ROWS, HEAD_DIM):
    """Copy rows row0 .. row0+N_ROWS-1 of src[b, h] into smem[base + r*row_stride + d].

    The value is stored as smem's element type: fp32 in phases 01-05, fp16 from phase 06 on.

    Consecutive threads take consecutive elements of a row: the global reads of a warp are
    coalesced and its shared-memory writes hit 32 different banks. Rows past seq_len are
    written as zeros, so a tail tile never feeds garbage into a dot product.

    The trip count is a compile-time constant (N_THREADS must divide the tile), so the loop
    unrolls and all of a thread's loads are issued back to back before the first store
    waits for one: a loop over range(tid, N, N_THREADS) would wait ~1 µs per element.
    """
    for i in range(N_ROWS * HEAD_DIM // N_THREADS):
        idx = tid + i * N_THREADS
        r = idx // HEAD_DIM
        d = idx % HEAD_DIM
        value = float32(0.0)
        if row0 + r < seq_len:
            value = float32(src[uidx(b), uidx(h), uidx(row0 + r), uidx(d)])
        smem[uidx(base + r * row_stride + d)] = value


# ---------------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------------
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def grid_for(q_shape, block_m: int):
    """Grid of every phase: (row blocks, heads, batch)."""
    B, H, S, _ = q_shape
    return (cdiv(S, block_m), H, B)


SIM_SMS = 2  # the simulator's "SMs": a persistent kernel there gets two blocks, each with several units

# Fewer "SMs" than the GPU has, for tests only: the GPU tests (by monkeypatch) and the children of
# tools/sanitize.py set it small, so that at their small shapes every block of a persistent grid
# takes several query blocks. The library itself never sets it: None, the GPU's own count.
sm_count_override: int | None = None


def sm_count() -> int:
    """The blocks of a persistent grid: the device's streaming multiprocessors, two in the
    simulator, or `sm_count_override` where a test has set it."""
    if sm_count_override is not None:
        if isinstance(sm_count_override, bool) or not isinstance(sm_count_override, int) or sm_count_override < 1:
            raise ValueError(f"sm_count_override: expected None or a positive number of blocks, "
                             f"got {sm_count_override!r}")
        return sm_count_override
    if simulator_enabled():
        return SIM_SMS
    return _multiprocessors(cuda.get_current_device().id)


@lru_cache(maxsize=None)
def _multiprocessors(device_id: int) -> int:
    """A driver query: asked once per device, not at every launch."""
    return cuda.get_current_device().MULTIPROCESSOR_COUNT


def _stream_handle(stream) -> int:
    """A Numba stream's CUstream as an int (0: the default stream)."""
    stream = stream or cuda.default_stream()
    _, handle = stream.__cuda_stream__()  # (version, the CUstream or its address)
    return int(handle)


def work_counter(stream=0):
    """A one-int32 counter at zero, for a kernel that hands out its work units by atomic additions
    (arch/scratch.py: one per device and stream, zeroed once there; the kernel's last request sets
    it back to zero, so a launch needs no memset before it)."""
    if simulator_enabled():
        return scratch.work_counter(0, 0).arrays[0]
    return scratch.work_counter(cuda.get_current_device().id, _stream_handle(stream)).arrays[0]


def split_workspace(splits, stream=0):
    """The workspace of a split-keys kernel (phase 10) for one problem: its partial outputs and
    log-sum-exps (float32, never read before written) and its counters at zero (arch/scratch.py:
    per device, stream and shape; the kernel's last block of each row tile sets its counter back
    to zero, so a launch needs no memset)."""
    if simulator_enabled():
        return scratch.split_workspace(splits, 0, 0).arrays
    return scratch.split_workspace(splits, cuda.get_current_device().id, _stream_handle(stream)).arrays


def no_lse():
    """The LSE argument of a call that did not ask for the log-sum-exp: an empty array (the
    kernel tests its size and writes nothing)."""
    return cuda.device_array((0, 0, 0), np.float32)


def launch(kernel, grid, block: int, smem_bytes: int, args, stream=0, cache_key=()) -> None:
    """Launch `kernel[grid, block, stream, smem_bytes](*args)`, raising the limit if needed.

    With a cache_key (a config from phases.build), Numba's dispatcher first gets the compiled
    kernel from the disk cache (arch/cache.py) when it has none for these argument types: a new
    process loads the cubin instead of compiling.

    Numba warns on every launch of fewer than 128 blocks ("Grid size N will likely result in
    GPU under-utilization"). For attention on a small problem that is expected, and a caller
    in a loop would get a wall of warnings, so our launches silence it, and only it. Setting
    NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=1 in the environment brings it back.
    """
    if simulator_enabled():
        with simulator_pacing():
            kernel[grid, block, stream, smem_bytes](*args)
        return
    if cache_key and cache_dir() is not None:
        argtypes = argument_types(kernel, args)
        if argtypes not in kernel.overloads:
            install(kernel, argtypes, cache_key)
    if smem_bytes > STATIC_SMEM_LIMIT:
        raise_dynamic_smem_limit(kernel, args, smem_bytes)
    if os.environ.get("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS"):
        kernel[grid, block, stream, smem_bytes](*args)
        return
    with warnings.catch_warnings():
        # by message: numba-cuda raises its own NumbaPerformanceWarning class, not numba's
        warnings.filterwarnings("ignore", message=LOW_OCCUPANCY_WARNING)
        kernel[grid, block, stream, smem_bytes](*args)


# numba wraps its messages in terminal highlighting, so the pattern allows a prefix
LOW_OCCUPANCY_WARNING = r".*Grid size \d+ will likely result in GPU under-utilization"


@dataclass(frozen=True)
class Splits:
    """How a split-keys kernel (phase 10) runs one problem: its grid, (splits, row tiles x K/V
    heads, batch), and the shapes of its workspace (`split_workspace`)."""

    grid: tuple
    o_part: tuple  # (splits, B * H * S_q, D) float32: each split's partial output
    lse_part: tuple  # (splits, B * H * S_q) float32: each split's log-sum-exp (base 2)
    counters: int  # int32 counters: per (batch, K/V head, row tile), one per team of its merge tree


H100_SM_LIMITS = (228 * 1024, 32)  # shared memory per SM (bytes) and blocks per SM of an H100


def blocks_per_sm(smem_bytes: int, limits=None) -> int:
    """How many blocks of `smem_bytes` dynamic shared memory one SM holds at once (by shared memory
    and the SM's block limit; registers are not counted): on this GPU, in the simulator an H100's,
    or by `limits` (shared memory per SM, blocks per SM)."""
    if limits is not None:
        per_sm, most = limits
    elif simulator_enabled():
        per_sm, most = H100_SM_LIMITS
    else:
        per_sm, most = _sm_limits(cuda.get_current_device().id)
    return max(1, min(most, per_sm // (smem_bytes + 1024)))  # the driver keeps 1 KB per block


@lru_cache(maxsize=None)
def _sm_limits(device_id: int) -> tuple[int, int]:
    device = cuda.get_current_device()
    return device.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, device.MAX_BLOCKS_PER_MULTIPROCESSOR


ELEMENT = {"float16": "float16", "bfloat16": "int16"}  # bf16 reaches a kernel as its int16 bit patterns
PTX_TYPE = {"float16": "f16", "bfloat16": "bf16"}  # the type's name in PTX, and in the ptx/ functions' names


@dataclass(frozen=True)
class KernelConfig:
    """A compiled-on-first-use kernel and how to launch it: what each phase's `build()` returns."""

    kernel: object
    block_m: int
    n_threads: int
    smem_bytes: int  # dynamic shared memory per block
    ptx_files: tuple = ()  # ptx/ files the kernel links (the link route): what machine_code must link too
    packed_output: bool = False  # the kernel writes O as uint32 pairs of 16-bit values
    tma_box: tuple | None = None  # the kernel loads Q, K, V by TMA: it also gets their tensor maps (this box)
    launch_bounds: tuple | None = None  # (threads, blocks per SM) the kernel was compiled for, if any
    # (q shape, causal) -> units of work, for a kernel that loops over them on a 1-D grid (phase 09):
    # block x takes unit x first, then the next one a counter hands out (the kernel's last argument)
    work_units: object = None
    persistent: bool = False  # with work_units: one block per SM, each looping over units
    out_alignment: int = 0  # bytes: O's address must be a multiple of this (the kernel's vector stores)
    # the kernel takes LSE, (B, H, S_q) float32, after O: `return_lse` (phase 07 on). It writes each
    # row's log-sum-exp there when LSE has rows, and nothing when it is the empty (0, 0, 0) array
    lse: bool = False
    # (q shape, k shape, causal) -> Splits, for a kernel that splits each block's keys into ranges
    # run as blocks of their own (phase 10): it takes, after qk_scale, its workspace (the partial
    # outputs, their log-sum-exps and the counters that tell the last block to merge them)
    split_keys: object = None
    # the kernel reads a KV cache (phase 10 built `paged`, flashcore_numba.inference): it also takes each
    # sequence's length (int32, B) and the block table (int32, B x pages per sequence), last
    kv_cache: bool = False
    # the kernel runs packed sequences of their own lengths (phases 07 and 09 built `varlen`,
    # flashcore_numba.inference): q, k, v, O as (1, total, heads, D) and LSE as (1, H, total_q); it also
    # takes the int32 offsets cu_seqlens_q and cu_seqlens_k (B + 1 each), last, and a kernel with work
    # units (09) then max_seqlen_q, which sizes them
    varlen: bool = False
    # (kernel id, head dim, dtype) when built through the registry (phases.build): a launch then
    # loads the compiled kernel from the disk cache (arch/cache.py) instead of compiling it
    cache_key: tuple = ()

    def signature(self, dtype: str = "float16") -> str:
        """The kernel's signature as a launch types it: Q, K, V (and O) of `dtype` (bf16 as its int16
        bit patterns), O as uint32 pairs when the kernel stores packed output, then the flag and the
        scale, the tensor maps of a TMA kernel and the work counter of a looping one; LSE after O for
        a kernel that can write the log-sum-exp."""
        element = ELEMENT[dtype]
        out = "uint32" if self.packed_output else element
        qkv = ", ".join(3 * [f"{element}[:,:,:,::1]"])
        lse = ", float32[:,:,::1]" if self.lse else ""
        maps = ", uint64[:,::1]" if self.tma_box else ""
        counter = ", int32[::1]" if self.work_units is not None else ""
        workspace = ", float32[:,:,::1], float32[:,::1], int32[::1]" if self.split_keys else ""
        cache = ", int32[::1], int32[:,::1]" if self.kv_cache else ""
        offsets = ", int32[::1], int32[::1]" + ", int32" * (self.work_units is not None) if self.varlen else ""
        return f"void({qkv}, {out}[:,:,:,::1]{lse}, boolean, float32{maps}{counter}{workspace}{cache}{offsets})"

    def grid(self, q_shape, causal: bool, k_shape=None) -> tuple:
        """The launch grid: every phase's (row blocks, heads, batch), or for a kernel with work
        units one block per unit, or per SM when it is persistent (never more blocks than units);
        for a split-keys kernel (splits, row tiles x K/V heads, batch), which needs k's shape."""
        if self.split_keys is not None:
            return self.split_keys(tuple(q_shape), tuple(k_shape), causal).grid
        if self.work_units is None:
            return grid_for(q_shape, self.block_m)
        units = max(1, self.work_units(q_shape, causal))
        return (min(units, sm_count()) if self.persistent else units,)

    def arguments(self, q, k, v, o, causal: bool, qk_scale: float, stream=0, lse=None) -> tuple:
        """The kernel's arguments, as `launch` passes them (the benchmark reads registers by them).
        lse: a (B, H, S_q) float32 device array for the rows' log-sum-exp, or None."""
        if lse is not None and not self.lse:
            raise ValueError("return_lse: this kernel does not write the log-sum-exp (phases 07 on do)")
        if self.out_alignment and not simulator_enabled():  # the simulator's store checks its own addresses
            offset = o.__cuda_array_interface__["data"][0] % self.out_alignment
            if offset:
                raise ValueError(f"o: this kernel writes the output in {self.out_alignment}-byte stores, so "
                                 f"its address must be a multiple of {self.out_alignment}; this one is {offset} "
                                 f"bytes past (a fresh allocation is aligned)")
        if self.packed_output:
            o = o.view(np.uint32)
        # float32 on purpose: a Python float would be typed float64 and drag fp64 math in.
        args = (q, k, v, o) + ((no_lse() if lse is None else lse,) if self.lse else ()) + (
            bool(causal), np.float32(qk_scale))
        if self.tma_box:
            from ..arch.tma import head_maps

            args += (head_maps((q, k, v), self.tma_box),)
        if self.work_units is not None:
            args += (work_counter(stream),)
        if self.split_keys is not None:
            args += split_workspace(self.split_keys(tuple(q.shape), tuple(k.shape), causal), stream)
        return args

    def launch(self, q, k, v, o, causal: bool, qk_scale: float, stream=0, lse=None) -> None:
        args = self.arguments(q, k, v, o, causal, qk_scale, stream, lse)
        launch(self.kernel, self.grid(q.shape, causal, k.shape), self.n_threads, self.smem_bytes, args, stream,
               self.cache_key)

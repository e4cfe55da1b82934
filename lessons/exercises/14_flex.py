# Exercise 14: score_mod and mask_mod in the kernel, block-sparse
#
# This is the finished phase 14 kernel with 4 marked regions emptied:
#   14-a: return whether row q_idx sees key kv_idx: at most window[0] keys before it and at most window[1] after it
#   14-b: return the score soft-capped: cap times the tanh of score / cap, cap = capped[0] (score times capped[1] is score / cap)
#   14-c: where mask_mod hides the key (mask_call(0.0, b, h, q_idx, kv_idx, mask_args) is False), set the score to -inf
#   14-d: n, the i-th key tile in this query block's list (KV_INDEX), and start_n, its first key
# Write the missing lines between each `# >>> exercise` line and its `# <<< exercise` line.
# Change nothing else: solving only adds lines. The lesson is lessons/14_flex.ipynb.
#
# Grade it (hidden random inputs and adversarial shapes; points and reasons per check):
#     flashcore grade 14                         this file
#     flashcore grade 14 path/to/copy.py         a copy of it
#     pytest lessons/exercises --grade 14        the same checks, as pytest tests
# Without a GPU the kernel runs in Numba's CUDA simulator (slow) and the timing checks are skipped.
# Stuck? `flashcore grade 14 --hint` gives a hint per region (--hint 2, 3: more);
# the solution is flashcore_numba/phases/p14_flex.py.
#
# Generated from that file by `python -m flashcore_numba.course.exercises --write`:
# improve the phase, not this copy.
"""Phase 14 — your own attention: score_mod and mask_mod compiled into the kernel, block-sparse.

The whole account of this phase (what it changes, why the hardware rewards it, what each
change bought) is the docstring of flashcore_numba/phases/p14_flex.py; the lesson is
lessons/14_flex.ipynb.
"""

from __future__ import annotations

import dataclasses
import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from flashcore_numba.arch import operands, ptx
from flashcore_numba.arch.cache import function_fingerprint
from flashcore_numba.phases import p07_mma_sync as p07
from flashcore_numba.phases import p09_warp_specialized as p09
from flashcore_numba.phases import p11_backward as p11
from flashcore_numba.phases.common import LOG2E, MMA_N, KernelConfig, key_end
from flashcore_numba.phases.p07_mma_sync import MMA_M

ID = "14"
NAME = "flex"
TITLE = "score_mod and mask_mod in the kernel, block-sparse"
DTYPES = p07.DTYPES
MIN_CC = p07.MIN_CC
HEAD_DIMS = (64, 128)  # the course's head dims; any other multiple of 8 up to 256 runs too (runs_head_dim)
HEAD_DIMS_TEXT = p07.HEAD_DIMS_TEXT
BUILDS_ON = "07"  # phase 07's kernel, its key-tile loop walking the block mask: the lesson compares the two
BASES = ("07", "09")  # the kernels the mods go into: phase 07's (any GPU, the simulator) and phase 09's (Hopper)
MODS = True  # graded with mods and a block mask (course/grade_flex.py), timed by `flashcore bench --flex`
MAX_BOUND_ARRAYS = 3  # arrays a mod may read (its parameters after the indices)
EMPTY = 0  # a tile of the block mask no row of which sees a key (flex.EMPTY)
PARTIAL = 1  # a tile of the block mask where mask_mod decides per element (flex.PARTIAL)
FULL = 2  # a tile where mask_mod sees every key (flex.FULL)


def runs_head_dim(HEAD_DIM: int) -> bool:
    return p07.runs_head_dim(HEAD_DIM)


def tiles(HEAD_DIM: int, base: str = "07") -> dict:
    """The tiles of the kernel the mods go into (phase 07's or phase 09's): the block mask is made at
    (block_m, block_n)."""
    if base == "09":
        L = hopper_layout(HEAD_DIM)
        return dict(block_m=L["BLOCK_M"], block_n=L["BLOCK_N"])
    return p07.tiles(HEAD_DIM)


# consumer warpgroups of phase 09's kernel with mods, where not phase 09's own count: at D = 64 phase 09
# runs three of 160 registers, and the mods' indices and arrays spilled there (ALiBi and a document
# mask: 1352 bytes a thread); two have 240
HOPPER_CONSUMERS = {64: 2}


def hopper_layout(HEAD_DIM: int) -> dict:
    """Phase 09's layout for the mods' build (HOPPER_CONSUMERS)."""
    return p09.layout(HEAD_DIM, consumers=HOPPER_CONSUMERS.get(p09.tile_head_dim(HEAD_DIM)))


# ---------------------------------------------------------------------------------------------
# The built-in mods (flex.py binds their arrays: flex.sliding_window, softcap, ...), written as a
# user writes one: a function of one element's scalars, the numbers it needs (a window, a cap,
# slopes, document ids) as arrays in its trailing parameters, so that they are arguments of the
# kernel and new values need no compile. They are functions of this module, not made per call: a
# kernel is compiled once per mod function.
# ---------------------------------------------------------------------------------------------
def causal_mod(b, h, q_idx, kv_idx):
    """Each row sees the keys up to its own position."""
    return q_idx >= kv_idx


def sliding_window_mod(b, h, q_idx, kv_idx, window):
    """FlashAttention's window_size=(left, right), window = [left, right]: row q_idx sees the keys
    q_idx - left .. q_idx + right."""
    # (each distance in 32 bits: Numba widens int32 - int32 to int64, two instructions a score where one does)
    # >>> exercise 14-a: return whether row q_idx sees key kv_idx: at most window[0] keys before it and at most window[1] after it
    # <<< exercise


def prefix_lm_mod(b, h, q_idx, kv_idx, prefix):
    """Every row sees the first prefix[0] keys, and causally after them."""
    return (kv_idx < prefix[0]) | (q_idx >= kv_idx)


def document_causal_mod(b, h, q_idx, kv_idx, ids):
    """Packed documents (ids[b, token]: its document), causal within each."""
    return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)


def document_mod(b, h, q_idx, kv_idx, ids):
    """Packed documents, each row seeing its whole document."""
    return ids[b, q_idx] == ids[b, kv_idx]


def softcap_mod(score, b, h, q_idx, kv_idx, capped):
    """Gemma 2's soft-capping at cap = capped[0]: the score bent smoothly into (-cap, cap). capped[1]
    is 1 / cap: a division on a GPU is a subroutine (a range check, a call), a product one
    instruction, and this runs for every score."""
    # >>> exercise 14-b: return the score soft-capped: cap times the tanh of score / cap, cap = capped[0] (score times capped[1] is score / cap)
    # <<< exercise


def alibi_mod(score, b, h, q_idx, kv_idx, slopes):
    """ALiBi: a bias by distance, one slope per query head."""
    # the distance in 32 bits, then as float32: Numba widens int32 - int32 to int64 and an int times
    # a float32 to float64, each two instructions or more a score on a GPU where this is one
    return score + slopes[h] * np.float32(np.int32(kv_idx - q_idx))


# The built-in score mods' derivatives by the score (flex.score_mod's grad=), for the backward's
# chain rule: dS = dS' · d score_mod / d score, where dS' is the softmax's gradient by the modded score
def softcap_grad(score, b, h, q_idx, kv_idx, capped):
    """d softcap_mod / d score: 1 - tanh(score / cap)²."""
    bent = math.tanh(score * capped[1])
    return np.float32(1.0) - bent * bent


def bias_grad(score, b, h, q_idx, kv_idx, slopes):
    """d alibi_mod / d score: a bias added to the score leaves its derivative 1."""
    return np.float32(1.0)


def device_mod(fn, n_arrays: int, kind: str):
    """fn compiled as a device function, and a call of it that takes its bound arrays from a tuple
    `a` (the kernel's argument; one stand-in array where the mod has none). Numba inlines a call of
    a closure only with its arguments spelled out (no *args), hence one form per count of arrays."""
    if n_arrays > MAX_BOUND_ARRAYS:
        raise ValueError(f"{kind}: at most {MAX_BOUND_ARRAYS} bound arrays, got {n_arrays}")
    f = cuda.jit(device=True, inline=True)(fn)
    if kind == "mask_mod":  # mask_mod(b, h, q_idx, kv_idx, *arrays): passed as score_mod's, its score unused
        if n_arrays == 0:
            @cuda.jit(device=True, inline=True)
            def call(x, b, h, q, kv, a):
                return f(b, h, q, kv)
        elif n_arrays == 1:
            @cuda.jit(device=True, inline=True)
            def call(x, b, h, q, kv, a):
                return f(b, h, q, kv, a[0])
        elif n_arrays == 2:
            @cuda.jit(device=True, inline=True)
            def call(x, b, h, q, kv, a):
                return f(b, h, q, kv, a[0], a[1])
        else:
            @cuda.jit(device=True, inline=True)
            def call(x, b, h, q, kv, a):
                return f(b, h, q, kv, a[0], a[1], a[2])
    elif n_arrays == 0:
        @cuda.jit(device=True, inline=True)
        def call(x, b, h, q, kv, a):
            return f(x, b, h, q, kv)
    elif n_arrays == 1:
        @cuda.jit(device=True, inline=True)
        def call(x, b, h, q, kv, a):
            return f(x, b, h, q, kv, a[0])
    elif n_arrays == 2:
        @cuda.jit(device=True, inline=True)
        def call(x, b, h, q, kv, a):
            return f(x, b, h, q, kv, a[0], a[1])
    else:
        @cuda.jit(device=True, inline=True)
        def call(x, b, h, q, kv, a):
            return f(x, b, h, q, kv, a[0], a[1], a[2])
    return call


def make_apply_mods(L, score_call, mask_call):
    """apply_mods(...): score_mod and mask_mod on a tile of scores in the accumulator layout."""
    NT = L["NT"]
    HAS_SCORE, HAS_MASK = score_call is not None, mask_call is not None

    @cuda.jit(device=True, inline=True)
    def indices(i, e, warp_row0, g, t, start_n, seq_q, seq_k, past_end):
        """(q_idx, kv_idx) of score e of n-tile i % NT of m-tile i // NT (mma's accumulator layout:
        rows g and g + 8, keys 2t and 2t + 1), clamped to the sequence: a mod may index its arrays by
        them even for the rows and keys past the end that a tile pads (the keys only where the tile
        may pass the last key: past_end, a constant where the kernel knows it). In 32 bits: Numba
        widens int32 arithmetic to int64, and a 64-bit add, minimum or conversion to float is two
        instructions or more where a 32-bit one is one, for every score."""
        q_idx = min(int32(warp_row0 + (i // NT) * MMA_M + g + 8 * (e // 2)), int32(seq_q - 1))
        kv_idx = int32(start_n + (i % NT) * MMA_N + 2 * t + e % 2)
        if past_end:
            kv_idx = min(kv_idx, int32(seq_k - 1))
        return q_idx, kv_idx

    @cuda.jit(device=True, inline=True)
    def score_n_tile(i, args):
        """score_mod on n-tile i's four scores, in the units FlexAttention's mods are written in (the
        scaled score, s · unit) and back to the kernel's (· inv_unit)."""
        s, b, h, warp_row0, g, t, start_n, seq_q, seq_k, past_end, unit, inv_unit, score_args = args
        for e in range(4):
            q_idx, kv_idx = indices(i, e, warp_row0, g, t, start_n, seq_q, seq_k, past_end)
            x = s[i // NT, i % NT, e] * unit
            s[i // NT, i % NT, e] = float32(score_call(x, int32(b), int32(h), q_idx, kv_idx, score_args)) * inv_unit

    @cuda.jit(device=True, inline=True)
    def mask_n_tile(i, args):
        """-inf where mask_mod hides the key, in n-tile i's four scores."""
        s, b, h, warp_row0, g, t, start_n, seq_q, seq_k, past_end, mask_args = args
        for e in range(4):
            q_idx, kv_idx = indices(i, e, warp_row0, g, t, start_n, seq_q, seq_k, past_end)
            # >>> exercise 14-c: where mask_mod hides the key (mask_call(0.0, b, h, q_idx, kv_idx, mask_args) is False), set the score to -inf
            # <<< exercise

    # unrolled when built (phase 07's `unrolled`): s is indexed by constants only, so it stays in
    # registers; a loop around the mods' calls was left rolled, and s went to local memory
    each_score = p07.unrolled(score_n_tile, L["M_TILES"] * NT)
    each_mask = p07.unrolled(mask_n_tile, L["M_TILES"] * NT)

    @cuda.jit(device=True, inline=True)
    def apply_mods(s, partial, b, h, warp_row0, g, t, start_n, seq_q, seq_k, past_end, unit, inv_unit, score_args,
                   mask_args):
        """score_mod on every score of the tile from key start_n; then, in a partial tile only, the
        mask: one branch around the whole of it (a full tile runs no mask_mod at all). past_end:
        whether the tile may pass the last key (its key indices then clamped)."""
        if HAS_SCORE:
            each_score(0, (s, b, h, warp_row0, g, t, start_n, seq_q, seq_k, past_end, unit, inv_unit, score_args))
        if HAS_MASK and partial:
            each_mask(0, (s, b, h, warp_row0, g, t, start_n, seq_q, seq_k, past_end, mask_args))

    return apply_mods


def build_kernel(L, dtype="float16", score_call=None, mask_call=None) -> KernelConfig:
    """Phase 07's kernel with the mods and the block mask's walk (see the module's docstring)."""
    commit = ptx.function("cp_async.ptx", "flashcore_cp_async_commit", "inline")
    wait_all = ptx.function("cp_async.ptx", "flashcore_cp_async_wait_0", "inline")
    shared_address, global_address = operands.shared_address, operands.global_address
    copy_tile = p07.make_copy_tile(L)
    q_fragments, qk_steps, pv_steps = p07.make_products(L, dtype)
    softmax_tile = p07.make_softmax_tile(L, dtype)
    store_block = p07.make_epilogue(L, dtype)
    apply_mods = make_apply_mods(L, score_call, mask_call)
    HEAD_DIM, BLOCK_M, BLOCK_N = L["HEAD_DIM"], L["BLOCK_M"], L["BLOCK_N"]
    M_TILES, WARP_ROWS, NO = L["M_TILES"], L["WARP_ROWS"], L["NO"]
    STRIDE, K_OFF, V_OFF, STAGE_BYTES = L["STRIDE"], L["K_OFF"], L["V_OFF"], L["STAGE_BYTES"]
    NT, KP, Q_STEPS, N_THREADS = L["NT"], L["KP"], L["Q_STEPS"], L["N_THREADS"]
    ROW_BYTES = STRIDE * 2

    @cuda.jit(device=True, inline=True)
    def attend(Q, K, V, O, LSE, qk_scale, KV_COUNT, KV_INDEX, KV_KIND, score_args, mask_args):
        """One block's work: phase 07's `attend`, its loop over the key tiles of the block mask."""
        smem_h = cuda.shared.array(0, uint32, alignment=128)
        smem = shared_address(smem_h)
        b = cuda.blockIdx.z
        h = cuda.blockIdx.y
        m = cuda.blockIdx.x  # the query block, as the block mask counts them
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        row0 = m * BLOCK_M
        warp_row0 = row0 + warp * WARP_ROWS
        h_kv = h * K.shape[1] // Q.shape[1]
        seq_q = Q.shape[2]
        seq_k = K.shape[2]
        head_q = uint64(((b * Q.shape[1] + h) * seq_q) * HEAD_DIM * 2)
        head_kv = uint64(((b * K.shape[1] + h_kv) * seq_k) * HEAD_DIM * 2)
        stride = HEAD_DIM * 2
        # the block mask's entry for this query block (its batch and head axes may be 1: broadcast)
        bm = b % KV_COUNT.shape[0]
        hm = h % KV_COUNT.shape[1]
        count = KV_COUNT[bm, hm, m]

        q_frag = cuda.local.array((M_TILES, Q_STEPS, 4), uint32)
        s = cuda.local.array((M_TILES, NT, 4), float32)
        p_frag = cuda.local.array((M_TILES, KP, 4), uint32)
        acc = cuda.local.array((M_TILES, NO, 4), float32)
        m_a = cuda.local.array(M_TILES, float32)
        m_b = cuda.local.array(M_TILES, float32)
        l_a = cuda.local.array(M_TILES, float32)
        l_b = cuda.local.array(M_TILES, float32)
        m_ij_a_scaled = cuda.local.array(M_TILES, float32)
        m_ij_b_scaled = cuda.local.array(M_TILES, float32)
        k_end_min = key_end(min(warp_row0 + g, seq_q - 1), seq_q, seq_k, False)  # the keys past seq_k
        for mt in range(M_TILES):
            m_a[mt] = float32(-math.inf)
            m_b[mt] = float32(-math.inf)
            l_a[mt] = float32(0.0)
            l_b[mt] = float32(0.0)
            for j in range(NO):
                for e in range(4):
                    acc[mt, j, e] = float32(0.0)

        # -- prologue: Q and the list's first K/V tile
        copy_tile(smem, 0, global_address(Q), head_q, row0, BLOCK_M, seq_q, tid, stride)
        if count > 0:
            first_n = KV_INDEX[bm, hm, m, 0] * BLOCK_N
            copy_tile(smem, K_OFF, global_address(K), head_kv, first_n, BLOCK_N, seq_k, tid, stride)
            copy_tile(smem, V_OFF, global_address(V), head_kv, first_n, BLOCK_N, seq_k, tid, stride)
        commit()
        wait_all()
        cuda.syncthreads()
        if qk_scale < 0:  # phase 07's sign flip of q: the scores below are then the scaled ones' sign
            for w in range(tid, BLOCK_M * STRIDE // 2, N_THREADS):
                smem_h[w] ^= uint32(0x80008000)
            cuda.syncthreads()
        scale = max(abs(qk_scale), float32(1e-30))
        unit = scale / float32(LOG2E)  # a raw score times unit is the score FlexAttention's mods see
        inv_unit = float32(1.0) / unit
        q_warp = smem + (warp * WARP_ROWS + lane % 16) * ROW_BYTES + (lane // 16) * 16
        q_fragments(q_frag, q_warp)
        k_lane = ((lane // 16) * 8 + lane % 8) * ROW_BYTES + ((lane // 8) % 2) * 16
        v_lane = (((lane // 8) % 2) * 8 + lane % 8) * ROW_BYTES + (lane // 16) * 16

        stage = 0
        for i in range(count):  # the key tiles this query block sees, in order
            # >>> exercise 14-d: n, the i-th key tile in this query block's list (KV_INDEX), and start_n, its first key
            # <<< exercise
            if i + 1 < count:  # -- the list's next tile flies into the other stage meanwhile
                next_n = int32(KV_INDEX[bm, hm, m, i + 1] * BLOCK_N)
                copy_tile(smem, K_OFF + (1 - stage) * STAGE_BYTES, global_address(K), head_kv, next_n, BLOCK_N,
                          seq_k, tid, stride)
                copy_tile(smem, V_OFF + (1 - stage) * STAGE_BYTES, global_address(V), head_kv, next_n, BLOCK_N,
                          seq_k, tid, stride)
                commit()
            k_tile = smem + K_OFF + stage * STAGE_BYTES + k_lane
            v_tile = smem + V_OFF + stage * STAGE_BYTES + v_lane
            for mt in range(M_TILES):
                for j in range(NT):
                    for e in range(4):
                        s[mt, j, e] = float32(0.0)
            qk_steps(0, (s, q_frag, q_warp, k_tile))
            # -- the mods, then phase 07's online softmax (which masks the keys past seq_k)
            apply_mods(s, KV_KIND[bm, hm, m, n] == PARTIAL, b, h, warp_row0, g, t, start_n, seq_q, seq_k, True,
                       unit, inv_unit, score_args, mask_args)
            softmax_tile(s, p_frag, acc, m_a, m_b, l_a, l_b, m_ij_a_scaled, m_ij_b_scaled, start_n, k_end_min,
                         warp_row0, g, t, seq_q, seq_k, False, scale)
            pv_steps(0, (acc, p_frag, v_tile))
            wait_all()
            cuda.syncthreads()
            stage = 1 - stage

        store_block(O, LSE, b, h, warp_row0, g, t, seq_q, 0, 0, uint64(0), acc, m_a, m_b, l_a, l_b)

    @cuda.jit
    def flex_attention(Q, K, V, O, LSE, qk_scale, KV_COUNT, KV_INDEX, KV_KIND, score_args, mask_args):
        attend(Q, K, V, O, LSE, qk_scale, KV_COUNT, KV_INDEX, KV_KIND, score_args, mask_args)

    return KernelConfig(flex_attention, block_m=BLOCK_M, n_threads=N_THREADS, smem_bytes=L["SMEM_BYTES"],
                        packed_output=True, out_alignment=16, lse=True)


# ---------------------------------------------------------------------------------------------
# On Hopper: the same mods in phase 09's kernel. Its producer and consumers walk the block mask's
# list through phase 09's seam (p09.Walk), and each tile's scores go through apply_mods above
# ---------------------------------------------------------------------------------------------
def make_walk(L, score_call, mask_call) -> p09.Walk:
    """Phase 09's walk for these mods: the tiles of the block mask's list as hopper_lists orders them,
    those that need no mask first (`lists`: the kernel's KV_COUNT, KV_INDEX, KV_KIND and the mods'
    arrays), and apply_mods on each tile's S. Phase 09's consumer runs the first ones in its loop
    without masking (the mask pass and the kind's load compiled out: may_mask is a constant there),
    the rest in its masked loop. A consumer warpgroup's S is one m-tile of 16 rows a warp, (NT, 4)
    in mma's accumulator layout (rows row_a and row_a + 8): apply_mods takes it as (1, NT, 4),
    copied in and out, which costs nothing once the copies are unrolled (registers renamed). With a
    score mod the scores stay in the units the mod returns them in (the scaled score), and the
    softmax takes them so (softmax_scale: log2(e) in place of the kernel's scale): no product back
    to the kernel's units, one instruction a score fewer."""
    NT, BLOCK_M, BLOCK_N = L["NT"], L["BLOCK_M"], L["BLOCK_N"]
    MOD_UNITS = score_call is not None  # every tile's scores then leave apply in the mod's units
    apply_mods = make_apply_mods(dict(NT=NT, M_TILES=1), score_call, mask_call)

    @cuda.jit(device=True, inline=True)
    def copy_in(j, args):
        s3, s = args
        for e in range(4):
            s3[0, j, e] = s[j, e]

    @cuda.jit(device=True, inline=True)
    def copy_out(j, args):
        s3, s = args
        for e in range(4):
            s[j, e] = s3[0, j, e]

    each_in = p07.unrolled(copy_in, NT)
    each_out = p07.unrolled(copy_out, NT)

    @cuda.jit(device=True, inline=True)
    def listed(lists, bh, n_heads, row0, n_tiles):
        """The query block's count of tiles, and where its list is: (batch, head, query block) of
        the block mask, whose batch and head axes may be 1 (broadcast)."""
        KV_COUNT = lists[0]
        bm = uint32(bh // uint32(n_heads)) % uint32(KV_COUNT.shape[0])
        hm = uint32(bh % uint32(n_heads)) % uint32(KV_COUNT.shape[1])
        m = uint32(row0) // uint32(BLOCK_M)
        return int32(KV_COUNT[bm, hm, m, 0]), (bm, hm, m)

    @cuda.jit(device=True, inline=True)
    def tile_at(lists, where, i):
        return int32(lists[1][where[0], where[1], where[2], i])

    @cuda.jit(device=True, inline=True)
    def unmasked(lists, where):
        return int32(lists[0][where[0], where[1], where[2], 1])

    @cuda.jit(device=True, inline=True)
    def apply(s, context, n, t, scale, may_mask):
        lists, where, b, h, row_a, seq_q, seq_k = context
        partial = may_mask and lists[2][where[0], where[1], where[2], n] == PARTIAL
        s3 = cuda.local.array((1, NT, 4), float32)
        each_in(0, (s3, s))
        unit = scale * float32(1.0 / LOG2E)  # a raw score times unit is the score the mods see
        back = float32(1.0) if MOD_UNITS else float32(1.0) / unit  # (x · 1.0 compiles to x)
        # (a tile of the unmasked loop ends at or before the last key: may_mask False, no clamp)
        apply_mods(s3, partial, b, h, row_a, 0, t, int32(n * BLOCK_N), seq_q, seq_k, may_mask, unit, back,
                   lists[3], lists[4])
        each_out(0, (s3, s))

    @cuda.jit(device=True, inline=True)
    def softmax_scale(scale):
        """exp2(s · log2(e)) = exp(s) of a score in the mod's units; else the kernel's own scale."""
        return float32(LOG2E) if MOD_UNITS else scale

    return p09.Walk(True, listed, tile_at, unmasked, apply, softmax_scale)


def hopper_lists(kinds: np.ndarray, seq_k: int, block_n: int) -> tuple[np.ndarray, np.ndarray]:
    """(KV_COUNT, KV_INDEX) for phase 09's walk: per query block the key blocks it visits, those that
    need no mask first (full, and not past the last key: the tile that crosses seq_k is masked for
    its tail), then the others, each group in key order; KV_COUNT (B', H', n_m, 2) holds how many
    it visits and how many of them come first."""
    clean = kinds == FULL
    if seq_k % block_n:
        clean[..., -1] = False
    count, index = block_lists(kinds, first=clean)
    return np.stack([count, clean.sum(axis=-1, dtype=np.int32)], axis=-1), index


@lru_cache(maxsize=None)
def build(HEAD_DIM: int, dtype: str = "float16", score_fn=None, n_score_arrays: int = 0, mask_fn=None,
          n_mask_arrays: int = 0, base: str = "07") -> KernelConfig:
    """The kernel for head dim HEAD_DIM and `dtype` with the mods' functions compiled in (None: none),
    on phase 07's kernel or (base "09", Hopper) phase 09's: one build per (functions, their arrays'
    count, head dim, dtype, base), kept for the process."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: phase 14 builds {' and '.join(DTYPES)}, not {dtype!r}")
    if not runs_head_dim(HEAD_DIM):
        raise ValueError(f"head dim: phase 14 builds {HEAD_DIMS_TEXT}, not {HEAD_DIM!r}")
    if base not in BASES:
        raise ValueError(f"base: phase 14 builds on phase {' or '.join(BASES)}, not {base!r}")
    score_call = None if score_fn is None else device_mod(score_fn, n_score_arrays, "score_mod")
    mask_call = None if mask_fn is None else device_mod(mask_fn, n_mask_arrays, "mask_mod")
    if base == "09":
        L = hopper_layout(HEAD_DIM)
        return p09.build_kernel(L, dtype, p09.BUILDS[None], False, make_walk(L, score_call, mask_call))
    return build_kernel(p07.layout(HEAD_DIM, **tiles(HEAD_DIM)), dtype, score_call, mask_call)


_BUILDS: dict = {}  # (head dim, dtype, each mod's code) -> its KernelConfig


def build_for(HEAD_DIM: int, dtype: str, score_mod=None, mask_mod=None, base: str = "07") -> KernelConfig:
    """build() for these mods (flex.ScoreMod, flex.MaskMod or None), once per distinct code: mods whose
    fingerprints agree share a build whatever function objects carry them (a lambda written in a
    loop is a new object each time, the same code); a mod without a fingerprint, by its function."""
    def code(mod):
        return None if mod is None else (_fingerprint(mod.fn) or mod.fn, len(mod.arrays))

    key = (HEAD_DIM, dtype, code(score_mod), code(mask_mod), base)
    config = _BUILDS.get(key)
    if config is None:
        config = _BUILDS[key] = build(HEAD_DIM, dtype, None if score_mod is None else score_mod.fn,
                                      0 if score_mod is None else len(score_mod.arrays),
                                      None if mask_mod is None else mask_mod.fn,
                                      0 if mask_mod is None else len(mask_mod.arrays), base)
    return config


@lru_cache(maxsize=256)
def _fingerprint(fn):
    """function_fingerprint, once per function in a process: Numba, too, takes the globals a function
    reads as constants when it first compiles it (build's kernel for these mods is that one)."""
    return function_fingerprint(fn)


# ---------------------------------------------------------------------------------------------
# The backward with the mods: phase 11's kernels, the mods on each tile's recomputed scores
# ---------------------------------------------------------------------------------------------
def make_backward_scores(NT: int, score_call, grad_call, mask_call, block_m: int = 1, block_n: int = 1) -> p11.Scores:
    """Phase 11's seam (p11.Scores) with the mods: in kv_kernel's tile, each score of Sᵀ (lane
    element e of n-tile j: query row m0 + 8 j + 2 t + e % 2, key key_a + 8 (e // 2)) as the forward
    made it, score_mod(score) in raw units (the kernel scales it again), or hidden where the mask
    hides its key or the row or key lies past the end; its slope, d score_mod / d score, for dS.
    Every query tile the key block visits runs it (rows: backward_rows's range for the block). The
    kernel's last argument is (rows, kinds): backward_rows's ranges and the block mask's kinds at
    the backward's tiles (block_m query rows by block_n keys), by which a full tile calls no
    mask_mod, as the forward's does not."""
    SCORE, MASK = score_call is not None, mask_call is not None

    @cuda.jit(device=True, inline=True)
    def modify_tile(s, slope, b, h, m0, t, key_a, last_q, last_k, unit, score_args, mask_args, masked):
        """The tile's scores modded; masked (a constant where it is inlined): mask_mod too."""
        back = float32(1.0) / unit
        # a raw score whose probability is 0 whatever the scale's sign: 2^(hidden · qk_scale − L) = 0
        hidden = float32(-math.inf) if unit > float32(0.0) else float32(math.inf)
        for j in range(NT):
            for e in range(4):
                row = int32(m0 + j * 8 + 2 * t + e % 2)
                key = int32(key_a + 8 * (e // 2))
                seen = row <= last_q and key <= last_k
                r = min(row, last_q)  # (in bounds for a mod's arrays)
                kk = min(key, last_k)
                x = s[j, e] * unit
                d = float32(1.0)
                if SCORE:
                    d = float32(grad_call(x, b, h, r, kk, score_args))
                    x = float32(score_call(x, b, h, r, kk, score_args))
                if masked:
                    seen = seen and mask_call(x, b, h, r, kk, mask_args)
                s[j, e] = x * back if seen else hidden
                slope[j, e] = d

    @cuda.jit(device=True, inline=True)
    def modify(s, slope, context, h, m0, t):
        b, key_a, seq_q, seq_k, mod_args, scale = context
        score_args, mask_args = mod_args[0], mod_args[1]
        unit = float32(scale)  # a raw score times unit is the score the mods see
        last_q, last_k = int32(seq_q - 1), int32(seq_k - 1)  # (32-bit comparisons, as the forward's)
        KINDS = mod_args[2][1]  # (B', H', query tiles, key blocks): the block mask at these tiles
        # two builds of the tile's loop, one branch between them: a branch on the kind inside the
        # loop kept it rolled, and s and slope went to local memory (256 bytes of stack at D = 64)
        if MASK and KINDS[b if KINDS.shape[0] > 1 else 0, h if KINDS.shape[1] > 1 else 0,
                          uint32(m0) // uint32(block_m), uint32(key_a) // uint32(block_n)] != FULL:
            modify_tile(s, slope, b, h, m0, t, key_a, last_q, last_k, unit, score_args, mask_args, True)
        else:  # a full tile's keys are all seen: no mask_mod
            modify_tile(s, slope, b, h, m0, t, key_a, last_q, last_k, unit, score_args, mask_args, False)

    @cuda.jit(device=True, inline=True)
    def rows(mod_args, b, h_kv, key_block):
        ROWS = mod_args[2][0]  # (B' , H_kv', key blocks, 2): backward_rows
        bb = b if ROWS.shape[0] > 1 else 0
        hh = h_kv if ROWS.shape[1] > 1 else 0
        return int32(ROWS[bb, hh, key_block, 0]), int32(ROWS[bb, hh, key_block, 1])

    return p11.Scores(True, modify, rows)


def backward_rows(kinds: np.ndarray, group: int, seq_q: int, block_m: int) -> np.ndarray:
    """For each key block of a block mask's kinds (B', H', n_m, n_n) at the backward's tiles (block_m
    query rows by its kv_kernel's keys), the query rows [m_first, m_stop) that kv_kernel visits for
    it: from the first to the last query tile that any head of the K/V head's group (H' = 1: every
    head) sees it in, the empty tiles between them computed (and masked), not skipped; (0, 0) where
    none does. int32 (B', H_kv' (1 or H' / group), n_n, 2)."""
    B_, H_, n_m, n_n = kinds.shape
    seen = kinds != EMPTY
    if H_ > 1:  # the heads of a group share kv_kernel's loop: the union of theirs
        seen = seen.reshape(B_, H_ // group, group, n_m, n_n).any(axis=2)
    out = np.zeros((seen.shape[0], seen.shape[1], n_n, 2), np.int32)
    any_tile = seen.any(axis=2)  # (B', H_kv', n_n)
    first = np.argmax(seen, axis=2)
    last = n_m - 1 - np.argmax(seen[:, :, ::-1], axis=2)
    out[..., 0] = np.where(any_tile, first * block_m, 0)
    out[..., 1] = np.where(any_tile, np.minimum((last + 1) * block_m, seq_q), 0)
    return out


def build_backward(HEAD_DIM: int, dtype: str = "float16", score_fn=None, grad_fn=None, n_score_arrays: int = 0,
                   mask_fn=None, n_mask_arrays: int = 0, cc: tuple | None = None, mods_id: tuple = ()) -> p11.Backward:
    """Phase 11's backward (p11.Backward: delta_kernel, kv_kernel and its serial build) with the mods'
    functions compiled into kv_kernel, which then takes their arrays' tuples last (Backward.run's
    mod_args); mods_id names them in the kernel cache (their fingerprints). backward_for keeps them."""
    if score_fn is not None and grad_fn is None:
        raise ValueError("score_mod: the backward needs its grad (flex.score_mod(fn, ..., grad=...))")
    plain = p11.build(HEAD_DIM, dtype, cc)
    L = plain.kv
    scores = make_backward_scores(
        L["NT"], None if score_fn is None else device_mod(score_fn, n_score_arrays, "score_mod"),
        None if grad_fn is None else device_mod(grad_fn, n_score_arrays, "score_mod"),
        None if mask_fn is None else device_mod(mask_fn, n_mask_arrays, "mask_mod"), L["STREAM_ROWS"], L["OWN_ROWS"])
    return dataclasses.replace(plain, kv_kernel=p11.build_kv_kernel(L, dtype, plain.wide_red, scores=scores),
                               kv_kernel_serial=p11.build_kv_kernel(L, dtype, plain.wide_red, serial=True,
                                                                    scores=scores),
                               mods=mods_id if mods_id == ("unkept",) else ("mods", *mods_id))


_BACKWARDS: dict = {}  # (head dim, dtype, each function's code, cc) -> its Backward


def backward_for(HEAD_DIM: int, dtype: str, score_mod=None, mask_mod=None, cc: tuple | None = None) -> p11.Backward:
    """build_backward for these mods (flex.ScoreMod with its grad, flex.MaskMod, or None), once per
    distinct code as build_for keeps the forward's (a lambda made anew each step shares one), named
    in the kernel cache by their functions' fingerprints; where one cannot be told, not cached on
    disk at all, and kept here by the function itself."""
    fns = (score_mod and score_mod.fn, score_mod and score_mod.grad, mask_mod and mask_mod.fn)
    prints = tuple(None if fn is None else _fingerprint(fn) for fn in fns)
    key = (HEAD_DIM, dtype, tuple(fp or fn for fp, fn in zip(prints, fns)),
           len(score_mod.arrays) if score_mod else 0, len(mask_mod.arrays) if mask_mod else 0,
           None if cc is None else tuple(cc))
    found = _BACKWARDS.get(key)
    if found is None:
        kept = all(fp is not None for fp, fn in zip(prints, fns) if fn is not None)
        found = _BACKWARDS[key] = build_backward(HEAD_DIM, dtype, *fns[:2], key[3], fns[2], key[4], key[5],
                                                 tuple(fp or "none" for fp in prints) if kept else ("unkept",))
    return found


def cache_identity(HEAD_DIM: int, dtype: str, score_mod=None, mask_mod=None, base: str = "07") -> tuple:
    """The kernel cache's identity of the build for these mods (arch/cache.py: with the argument types,
    the package's source and the toolchain): the mods' fingerprints (cache.function_fingerprint), or
    () where a mod's cannot be told, and its kernel is compiled in every process."""
    prints = [None if mod is None else _fingerprint(mod.fn) for mod in (score_mod, mask_mod)]
    if any(mod is not None and fp is None for mod, fp in zip((score_mod, mask_mod), prints)):
        return ()
    on = ("on 09",) if base == "09" else ()  # (phase 07's builds keep the keys they had)
    return (ID, HEAD_DIM, dtype, prints[0] or "no score_mod", prints[1] or "no mask_mod", *on)


def kernel_views(HEAD_DIM: int, dtype: str = "float16") -> dict:
    """{"14": the kernel with the lesson's mods compiled in (softcap_mod, sliding_window_mod), typed as
    a launch types it}: what measure/machine_code.py compiles for the lesson's registers and PTX."""
    from flashcore_numba.phases.common import ELEMENT
    from flashcore_numba.phases.p11_backward import CompiledView

    config = build(HEAD_DIM, dtype, softcap_mod, 1, sliding_window_mod, 1)
    four = f"{ELEMENT[dtype]}[:,:,:,::1]"
    types = (f"void({four}, {four}, {four}, uint32[:,:,:,::1], float32[:,:,::1], float32, int32[:,:,::1], "
             f"int32[:,:,:,::1], int8[:,:,:,::1], UniTuple(float32[::1], 1), UniTuple(int32[::1], 1))")
    return {ID: CompiledView(config.kernel, types, config.n_threads, config.smem_bytes)}


def block_lists(kinds: np.ndarray, first=None) -> tuple[np.ndarray, np.ndarray]:
    """(KV_COUNT, KV_INDEX) of a block mask's kinds (B', H', n_m, n_n): for each query block how many
    key blocks it visits and which, in order, the rest of each row padded with 0. first (boolean,
    kinds' shape): visited blocks to list before the others, each group in key order (hopper_lists)."""
    visited = kinds != 0
    count = visited.sum(axis=-1).astype(np.int32)
    rank = np.where(visited, 1, 2) if first is None else np.where(first & visited, 0, np.where(visited, 1, 2))
    # stable: within a rank the blocks keep their order; the unvisited (rank 2) last
    index = np.argsort(rank, axis=-1, kind="stable").astype(np.int32)
    index[np.take_along_axis(rank, index, axis=-1) == 2] = 0
    return count, index


# ---------------------------------------------------------------------------------------------
# The block mask on the GPU: each tile's kind from mask_mod, one block of threads per tile
# ---------------------------------------------------------------------------------------------
BLOCK_MASK_THREADS = 128


@lru_cache(maxsize=None)
def build_block_mask_kernel(mask_fn, n_mask_arrays: int):
    """kinds(KINDS, seq_q, seq_k, block_m, block_n, mask_args): KINDS (B', H', n_m, n_n) int8 gets
    each tile's kind, EMPTY, PARTIAL or FULL, as flex.create_block_mask defines them (rows and keys
    past the sequence do not count). Block (n, m, bh) takes tile (m, n) of batch bh // H' and head
    bh % H': its threads call mask_mod on the tile's elements in turn, and the block votes twice
    (any element seen, every real element seen). A mask over 32768 x 32768 keys is 10^9 calls:
    seconds on the host's NumPy, milliseconds here."""
    mask_call = device_mod(mask_fn, n_mask_arrays, "mask_mod")

    @cuda.jit
    def kinds(KINDS, seq_q, seq_k, block_m, block_n, mask_args):
        n = cuda.blockIdx.x
        m = cuda.blockIdx.y
        bh = cuda.blockIdx.z
        b = int32(bh // KINDS.shape[1])
        h = int32(bh % KINDS.shape[1])
        any_seen = False
        all_seen = True
        for e in range(cuda.threadIdx.x, block_m * block_n, BLOCK_MASK_THREADS):
            q_idx = int32(m * block_m + e // block_n)
            kv_idx = int32(n * block_n + e % block_n)
            if q_idx < seq_q and kv_idx < seq_k:
                seen = mask_call(float32(0.0), b, h, q_idx, kv_idx, mask_args)
                any_seen = any_seen or seen
                all_seen = all_seen and seen
        any_seen = cuda.syncthreads_or(int32(any_seen)) != 0
        all_seen = cuda.syncthreads_and(int32(all_seen)) != 0
        if cuda.threadIdx.x == 0:
            KINDS[b, h, m, n] = FULL if any_seen and all_seen else (PARTIAL if any_seen else 0)

    return kinds

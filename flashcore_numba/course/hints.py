"""The hints of every exercise region, in three tiers, and the diagnoses worded for each region.

This file is the one home of the hints: a region's entry is keyed by its label, the label of its
`# >>> exercise LABEL: ...` marker in the phase source (flashcore_numba/phases/pNN_*.py).
`flashcore grade NN --hint [K]` prints tiers 1..K (default 1) of every region of exercise NN;
`--only LABEL` narrows it to one region. A new region needs an entry here:
tests/test_grader.py checks that every region has one, and that no entry is left without a region.

    1 (idea)     what the region must achieve, in words
    2 (helpers)  the helpers to call and their signatures
    3 (pseudo)   the lines in pseudo-code, short of the answer itself

`diagnoses` replaces the generic message of a pattern (see flashcore_numba.course.diagnose) where
the region's own words say more; {factor}, {low}, {high} are filled in as there.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

TIERS = ("idea", "helpers", "pseudo")
TIER_NAMES = {1: "the idea", 2: "the helpers", 3: "pseudo-code"}


@dataclass(frozen=True)
class RegionHints:
    idea: str
    helpers: str
    pseudo: str
    diagnoses: dict[str, str] = field(default_factory=dict)

    def tier(self, k: int) -> str:
        return getattr(self, TIERS[k - 1])


HINTS: dict[str, RegionHints] = {
    # lesson 00's puzzles (flashcore_numba/course/puzzles.py)
    "00-a": RegionHints(
        idea="Each thread handles one element. Its global index counts the threads of the blocks before its "
             "own, then its place inside its block.",
        helpers="cuda.blockIdx.x: this block's number; cuda.blockDim.x: threads per block; cuda.threadIdx.x: "
                "this thread's number inside its block.",
        pseudo="i = block number * threads per block + thread number\n"
               "out[i] = a[i] + 10",
    ),
    "00-b": RegionHints(
        idea="The launch has more threads than elements: a thread whose index is past the end must do "
             "nothing, or it writes outside the array.",
        helpers="a.size: the number of elements; i is computed above the region as in 00-a.",
        pseudo="if i is inside the array:\n"
               "    out[i] = alpha * a[i]",
    ),
    "00-c": RegionHints(
        idea="Every thread puts one element (0 past the end) into the block's shared array; then, in rounds, "
             "the first half of the threads add the second half's values to their own, halving each round, "
             "until cache[0] holds the block's sum. Between rounds all threads must wait for each other.",
        helpers="cache: the block's shared array of TPB floats; t = cuda.threadIdx.x; "
                "cuda.syncthreads(): waits until every thread of the block has reached it.",
        pseudo="cache[t] = a[i] if i is inside the array else 0\n"
               "syncthreads\n"
               "stride = TPB // 2\n"
               "while stride > 0:\n"
               "    if t < stride: cache[t] += cache[t + stride]\n"
               "    syncthreads\n"
               "    stride = stride // 2",
    ),
    "00-d": RegionHints(
        idea="x is read by every row, so the block copies it into shared memory one tile of TPB elements at a "
             "time (thread t copies element t of the tile); once the tile is complete, each thread adds its "
             "row's products with the tile to acc. The block waits twice per tile: before reading it, and "
             "before the next tile overwrites it.",
        helpers="x_tile: the shared array of TPB floats; t, row and acc are set above the region; "
                "cuda.syncthreads(); A.shape[0]: the number of rows; x.size: the length of x.",
        pseudo="for start in 0, TPB, 2*TPB, ... below x.size:\n"
               "    x_tile[t] = x[start + t] (0 past the end)\n"
               "    syncthreads\n"
               "    if row is a row of A: for k in the tile: acc += A[row, start + k] * x_tile[k]\n"
               "    syncthreads",
    ),
    "01": RegionHints(
        idea="Keep a running max m_i, a running sum l_i and an accumulator acc for the row. For each key j, "
             "raise the max if s is larger, shrink the old l_i and acc by alpha = 2^(m_old - m_new), then add "
             "this key: p = 2^(s - m_new) to l_i and p * v_j to acc. The state carries over to the next key.",
        helpers="softmax_rescale(m_i, s) -> (m_new, m_ref, alpha)  (common.py): the new max, the value to "
                "measure p against (0 when everything so far was masked), and the rescale factor.\n"
                "math.exp2(x): 2^x (s is already in base 2: qk_scale includes log2(e)).\n"
                "V[b, h, j, d]: fp16; convert with float32(...).",
        pseudo="m_new, m_ref, alpha = softmax_rescale(m_i, s)\n"
               "p = exp2(s - m_ref)\n"
               "l_i = l_i * alpha + p\n"
               "for every d: acc[d] = acc[d] * alpha + p * V[b, h, j, d]\n"
               "m_i = m_new",
        diagnoses={"zeros": "all zeros: the running state is never updated (m_i, l_i and acc keep their initial "
                            "values)",
                   "s_one": "only S = 1 passes: one key is right, several are not: m_i, l_i and acc are not "
                            "carried from one key to the next (each key must rescale the old values by alpha "
                            "and add to them, and m_i must become m_new at the end)"},
    ),
    "02": RegionHints(
        idea="Before the scores of a tile are computed, the whole block copies BLOCK_N rows of K and of V, "
             "starting at key start_n, into shared memory: the K tile at K_OFF, the V tile at V_OFF, one row "
             "of HEAD_DIM words per key. Every thread takes part.",
        helpers="load_tile(smem, base, row_stride, src, b, h, row0, seq_len, tid, N_THREADS, N_ROWS, HEAD_DIM) "
                "(common.py): copies rows row0 .. row0 + N_ROWS - 1 of src[b, h] to smem[base + r * row_stride "
                "+ d]; rows past seq_len become zeros.",
        pseudo="load_tile(smem, K_OFF, <row stride>, K, b, h, <first key>, seq_k, tid, N_THREADS, <rows>, HEAD_DIM)\n"
               "the same for V at V_OFF",
        diagnoses={"zeros": "all zeros: the K and V tiles are never loaded (shared memory is zero-filled in "
                            "the simulator, so every score and value is 0)"},
    ),
    "03-a": RegionHints(
        idea="A row's scores are spread over LANES_PER_ROW neighbouring lanes; each lane has the max of its "
             "own columns in m_ij. Combine them so that every lane of the group holds the row's max: a "
             "butterfly, exchanging with the lane at distance LANES_PER_ROW/2, then /4, ... down to 1.",
        helpers="cuda.shfl_xor_sync(FULL_MASK, value, lane_mask) -> the value of lane (this lane XOR lane_mask). "
                "FULL_MASK: every lane of the warp takes part. LANES_PER_ROW is a power of two.",
        pseudo="offset = LANES_PER_ROW // 2\n"
               "while offset > 0:\n"
               "    m_ij = max(m_ij, <m_ij of the lane offset away>)\n"
               "    offset //= 2",
        diagnoses={"s_one": "only S = 1 passes: with one key a single lane holds a score and the others hold "
                            "-inf, so any lane's max happens to work; with more keys every lane of the row "
                            "must end with the max over all LANES_PER_ROW lanes"},
    ),
    "03-b": RegionHints(
        idea="Each lane summed p over its own columns only: l_i is a partial row sum. Before dividing, add "
             "up the partial sums of the LANES_PER_ROW lanes that share the row, with the same butterfly as "
             "the row max (a sum this time).",
        helpers="cuda.shfl_xor_sync(FULL_MASK, value, lane_mask) -> the value of lane (this lane XOR lane_mask).",
        pseudo="offset = LANES_PER_ROW // 2\n"
               "while offset > 0:\n"
               "    l_row = l_row + <l_row of the lane offset away>\n"
               "    offset //= 2",
        diagnoses={
            "rows": "each row is off by a factor of its own (from {low:.3g} to {high:.3g}): o = acc / l_row "
                    "divides by a wrong sum; add the partial sums of the row's lanes",
            "magnitude": "the signs are right but the outputs are too large (typically {factor:.3g} × expected): "
                         "each lane divides by its own partial sum l_row; add the partial sums of the row's "
                         "LANES_PER_ROW lanes first"},
    ),
    "04": RegionHints(
        idea="Shared memory has 32 banks of 4 bytes. When a row is 64 or 128 words long, every row starts "
             "in bank 0 and the lanes that read one column of several rows queue on the same bank. Add a few "
             "words to each row so consecutive rows start in different banks, keeping rows 16-byte aligned.",
        helpers="SMEM_PAD: fp32 words added to each row. flashcore_numba.measure.banks.warp_tile_conflicts"
                "(smem_layout(64)) counts the conflicts of a layout, no GPU needed.",
        pseudo="SMEM_PAD = <the smallest pad that keeps a row a multiple of 16 bytes>",
        diagnoses={},
    ),
    "05-a": RegionHints(
        idea="While this tile's scores are computed, the next tile's K should already be on its way: issue "
             "its global loads into the registers `regs` now (only when there is a next tile); store_tile "
             "writes them into the other stage after scores_tile.",
        helpers="prefetch_tile(regs, src, b, h, row0, seq_len, tid): issues the loads of rows row0 .. of src "
                "into regs, without waiting for them. has_next, next_n: is there a next tile, where it starts.",
        pseudo="if <there is a next tile>:\n"
               "    prefetch_tile(regs, <K>, b, h, <its first key>, seq_k, tid)",
        diagnoses={"s_one": "only the single-tile cases pass: from the second key tile on the K tile in "
                            "shared memory is not the right one (regs still hold what was loaded before)"},
    ),
    "05-b": RegionHints(
        idea="The same for V: once the next K tile is stored, reuse `regs` to start loading the next V tile, "
             "so it travels while the softmax and P·V of this tile run.",
        helpers="prefetch_tile(regs, src, b, h, row0, seq_len, tid) (see 05-a).",
        pseudo="if <there is a next tile>:\n"
               "    prefetch_tile(regs, <V>, b, h, <its first key>, seq_k, tid)",
        diagnoses={"s_one": "only the single-tile cases pass: from the second key tile on the V tile in "
                            "shared memory holds K's values (regs were not reloaded with V)"},
    ),
    "06-a": RegionHints(
        idea="The warp's 16 x BLOCK_N scores S = Q · Kᵀ come from one call of the WMMA function: A is the "
             "warp's 16 rows of Q, B is the K tile of this stage (one key per row: Kᵀ in column-major), C is "
             "the warp's fp32 buffer in shared memory.",
        helpers="mma_abt(c, a, b, c_ld, a_ld, b_ld, k_steps) (ptx/wmma.ptx): C (16 x 64, fp32) = A (16 x K) · "
                "Bᵀ; c, a, b are .shared addresses (smem + byte offset), strides in elements, k_steps = K / 16.\n"
                "Offsets here: c_warp, q_warp, k_cur; strides C_STRIDE, QKV_STRIDE; K_STEPS_QK.",
        pseudo="mma_abt(smem + <this warp's C>, smem + <its Q rows>, smem + <this stage's K>,\n"
               "        <C stride>, <Q stride>, <K stride>, <16-deep steps over HEAD_DIM>)",
        diagnoses={"s_one": "only S = 1 passes: a single key's output is its v whatever its score; with "
                            "several keys the scores matter, and S = Q · Kᵀ is not in the warp's buffer at "
                            "c_warp"},
    ),
    "06-b": RegionHints(
        idea="O = P · V on the tensor cores, into the same per-warp fp32 buffer: one call covers 64 output "
             "columns, so a head dim of 128 takes two calls, each on its own 64-column strip of V and of C.",
        helpers="mma_ab(c, a, b, c_ld, a_ld, b_ld, k_steps) (ptx/wmma.ptx): C (16 x 64, fp32) = A (16 x K) · "
                "B (K x 64), addresses as for mma_abt. A strip moves C by STRIP * 4 bytes (fp32) and V by "
                "STRIP * 2 bytes (fp16). Offsets: c_warp, p_warp, v_cur; strides C_STRIDE, P_STRIDE, "
                "QKV_STRIDE; K_STEPS_PV; N_STRIPS strips.",
        pseudo="for strip in range(N_STRIPS):\n"
               "    mma_ab(smem + c_warp + <strip's byte offset in C>, smem + p_warp,\n"
               "           smem + v_cur + <strip's byte offset in V>, <strides>, K_STEPS_PV)",
        diagnoses={"columns": "only columns {first}..{last} are wrong: at D = 128 the output has two 64-column "
                              "strips, and that one is never multiplied (one mma_ab per strip, each moving C by "
                              "STRIP * 4 bytes and V by STRIP * 2 bytes)"},
    ),
    "07-a": RegionHints(
        idea="In an mma.sync accumulator a row's 8·NT columns are held by the 4 lanes of a quad (lanes "
             "4g .. 4g+3), two columns per n-tile each. m_ij_a (row g) and m_ij_b (row g + 8) are so far "
             "this lane's max only: combine them over the quad, lanes 1 and 2 apart.",
        helpers="cuda.shfl_xor_sync(FULL_MASK, value, lane_mask) -> the value of lane (this lane XOR lane_mask). "
                "Lanes t = 0..3 of a quad differ in the two lowest bits of the lane id.",
        pseudo="m_ij_a = max(m_ij_a, <m_ij_a of the lane 1 away>)\n"
               "m_ij_a = max(m_ij_a, <m_ij_a of the lane 2 away>)\n"
               "the same two lines for m_ij_b",
        diagnoses={"s_one": "only S = 1 passes: with one key a single lane of the quad holds a score, so any "
                            "lane's max happens to work; with more keys each lane must end with the max over "
                            "the 4 lanes of its quad"},
    ),
    "07-b": RegionHints(
        idea="P·V is an mma.sync whose A operand is P. An accumulator tile (c0..c3: row g columns 2t, 2t+1; "
             "row g+8 the same columns) of two neighbouring n-tiles 2kk, 2kk+1 covers 16 keys: exactly one "
             "A fragment (a0..a3) of k-step kk, once converted to fp16 pairs. No data moves between lanes.",
        helpers="pack(lo, hi) -> uint32: two fp32 values as one register of two fp16 (lo in the low half). "
                "The A fragment's register order: a0 = row g, keys 0-7 of the step (n-tile 2kk); a1 = row g+8, "
                "n-tile 2kk; a2 = row g, keys 8-15 (n-tile 2kk+1); a3 = row g+8, n-tile 2kk+1. In s[mt, j, e], "
                "e = 0, 1 are row g and e = 2, 3 row g + 8.",
        pseudo="for mt, kk:\n"
               "    p_frag[mt, kk, 0] = pack(<row g of n-tile 2kk>)\n"
               "    p_frag[mt, kk, 1] = pack(<row g+8 of n-tile 2kk>)\n"
               "    p_frag[mt, kk, 2] = pack(<row g of n-tile 2kk+1>)\n"
               "    p_frag[mt, kk, 3] = pack(<row g+8 of n-tile 2kk+1>)",
        diagnoses={"zeros": "all zeros: p_frag holds no probabilities (P · V adds nothing): fill p_frag[mt, kk, "
                            "0..3] with pack(...) of s"},
    ),
    "08-a": RegionHints(
        idea="As in 07-a: the wgmma accumulator spreads a row's columns over the 4 lanes of a quad; reduce "
             "m_ij_a (row g) and m_ij_b (row g + 8) over the quad, lanes 1 and 2 apart.",
        helpers="cuda.shfl_xor_sync(FULL_MASK, value, lane_mask) -> the value of lane (this lane XOR lane_mask).",
        pseudo="m_ij_a = max(m_ij_a, <m_ij_a of the lane 1 away>)\n"
               "m_ij_a = max(m_ij_a, <m_ij_a of the lane 2 away>)\n"
               "the same two lines for m_ij_b",
        diagnoses={"s_one": "only S = 1 passes: with one key a single lane of the quad holds a score; with "
                            "more keys each lane must end with the max over the 4 lanes of its quad"},
    ),
    "08-b": RegionHints(
        idea="As in 07-b: the accumulators of 8-column blocks 2kk and 2kk+1 are k-step kk's A fragment of "
             "P · V, converted to fp16 pairs.",
        helpers="pack(lo, hi) -> uint32 of two fp16. Register order a0 = row g of block 2kk, a1 = row g+8 of "
                "block 2kk, a2 = row g of block 2kk+1, a3 = row g+8 of block 2kk+1; in s[j, e], e = 0, 1 are "
                "row g and e = 2, 3 row g + 8.",
        pseudo="for kk:\n"
               "    p_frag[kk, 0] = pack(<row g of block 2kk>)\n"
               "    p_frag[kk, 1] = pack(<row g+8 of block 2kk>)\n"
               "    p_frag[kk, 2] = pack(<row g of block 2kk+1>)\n"
               "    p_frag[kk, 3] = pack(<row g+8 of block 2kk+1>)",
    ),
    "09-a": RegionHints(
        idea="The query block of BLOCK_M rows starting at row0 is split between the consumer warpgroups, "
             "WG_M rows each: consumer c's Q tile starts c tiles further on.",
        helpers="row0: the block's first query row; WG_M: rows per consumer; q_row is an int32 TMA coordinate.",
        pseudo="q_row = int32(<row0 plus c consumer tiles>)",
        diagnoses={"s_one": "only S = 1 passes: its single row is the block's first, which any start gets right; "
                            "the rows of the other consumers (see the picture) read the wrong rows of Q: "
                            "consumer c's tile starts WG_M rows per consumer after row0"},
    ),
    "09-b": RegionHints(
        idea="A K/V tile of BLOCK_N keys is loaded as boxes of 64 columns x 64 keys: atom a holds columns "
             "64a .. 64a + 63 of the head dim, box `box` keys 64·box .. of tile n.",
        helpers="col, row: int32 TMA coordinates (column = element of d, row = key); BLOCK_N keys per tile.",
        pseudo="col = int32(<first column of atom a>)\n"
               "row = int32(<first key of tile n> + <first key of box `box`>)",
        diagnoses={"s_one": "only S = 1 passes: a single key's output is its v whatever the scores; with more "
                            "keys, the boxes past the first (keys 64 on, the next tile, the columns of atom 1 "
                            "at D = 128) bring the wrong part of K and V"},
    ),
    "10-a": RegionHints(
        idea="Each member i of a team left its partial output o_i (normalized over its own keys) and lse_i, "
             "the log2 of its softmax denominator. The whole denominator is the sum of theirs: lse = "
             "log2(sum_i 2^lse_i), and member i's share of the output is 2^(lse_i - lse) (the shares add up "
             "to 1). Lane i holds member i's lse_i (-inf in a lane past the team's members); the max and the "
             "sum run over the whole warp. Subtract the max before exponentiating, as the online softmax "
             "subtracts m_i; a member that saw no key has lse_i = -inf and weight 0.",
        helpers="warp_max(x), warp_sum(x): the max and the sum of x over the 32 lanes, in every lane; "
                "math.exp2, math.log2. lse and w start as -inf and 0 (a row without keys).",
        pseudo="top = warp_max(lse_i)\n"
               "ref = top, or 0 if top is -inf\n"
               "total = warp_sum(<2^(lse_i - ref)>)\n"
               "if total != 0:\n"
               "    lse = ref + log2(total)\n"
               "    w = 2^(lse_i - lse)",
        diagnoses={"zeros": "all zeros: every member's weight is still 0 (w keeps its initial value), so the "
                            "merge adds nothing: compute lse, then w = 2^(lse_i - lse)",
                   "s_one": "only S = 1 passes: with one key there is one split, whose weight 2^(lse_i - lse) "
                            "is 1 however lse is summed; with several, the weights are wrong: they are "
                            "2^(lse_i - lse) with lse = log2 of the sum of the 2^lse_i, and they add up to 1"},
    ),
    "10-b": RegionHints(
        idea="Every block of a merge team ends by counting itself on the team's counter. Only the block that "
             "counts last may merge (every other member's partials are written by then): it is the one that "
             "finds members - 1 blocks counted before it. Count once per block, not once per thread, and "
             "let every thread of the block know the count: a warp's shuffle reaches only its own 32 lanes, "
             "so the block shares it through shared memory, after a barrier.",
        helpers="cuda.atomic.add(array, index, value) adds value to array[index] and returns the value it "
                "held before, in one indivisible step (two blocks never get the same one). done_s is one "
                "int32 of shared memory; cuda.syncthreads() waits until every thread of the block is there "
                "(and what thread 0 wrote before it is then seen by all).",
        pseudo="if tid == 0:\n"
               "    done_s[0] = <add 1 to COUNTERS[counter]; keep what it held>\n"
               "<a barrier>\n"
               "done = done_s[0]",
        diagnoses={"s_one": "only S = 1 passes: with one key there is one block, whose warps merge after a "
                            "barrier and write the output without counting; with several blocks, no block "
                            "found that it finished last, so none merged the blocks' partials and the "
                            "output stayed as it was before the launch (NaN)"},
    ),
    "11-a": RegionHints(
        idea="The forward saved each row's log-sum-exp L_i instead of P: P_ij = exp(scale · s_ij − L_i), "
             "exactly the forward's probabilities, no max or sum to recompute. In base 2, as the kernels "
             "compute: p = 2^(s · qk_scale − L_i · log2 e), and lse2_s holds L_i · log2 e for the tile's rows. "
             "A key the row does not see (past its causal diagonal, or past the end of the keys) has p = 0. "
             "It replaces the score in s (the products after the region read Pᵀ there); then dSᵀ = Pᵀ ∘ "
             "(dPᵀ − Δ_i) replaces dPᵀ in dp.",
        helpers="s[j, e]: the score of key key_a + 8 (e // 2) and query row row_t + col; exp2(x) = 2^x; "
                "cuda.fma(a, b, c) = a * b + c; lse2_s[stats + uint32(col)] and delta_s[stats + uint32(col)]: "
                "the row's L_i · log2 e and Δ_i; limit_a and limit_b: the first query row that sees key key_a "
                "and key key_a + 8 (a row below its key's limit does not see it; in a tile without a mask the "
                "limits are below every row). Compare int32(row_t + col) with the limit and index with "
                "uint32(col): 32-bit arithmetic, as the lines around it (col, from range, is an int64, "
                "so row_t + col would be an int64 compare; and a signed index gets extra code that adds "
                "the array's length to a negative index, NumPy's wraparound).",
        pseudo="p = exp2(s[j, e] * qk_scale - <the row's L_i log2 e>)\n"
               "if <the row> < <the limit of this element's key>:\n"
               "    p = 0\n"
               "s[j, e] = p\n"
               "dp[j, e] = p * (dp[j, e] - <the row's Δ>)",
        diagnoses={"wrong:dq+dk+dv": "every gradient is wrong, so P is (dV = Pᵀ dO needs nothing else): is s[j, e] "
                                     "replaced by p = 2^(s · qk_scale − L_i log2 e), 0 for keys the row does "
                                     "not see?",
                   "wrong:dq+dk": "dV is right, so P is; dK and dQ are not: dS = P ∘ (dP − Δ) is wrong"},
    ),
    "11-b": RegionHints(
        idea="Δ_i = Σ_j P_ij dP_ij is what dS = P ∘ (dP − Δ) subtracts, and it equals Σ_d dO_id O_id: a dot "
             "product of two rows the forward and the loss already gave, no P needed. A warp takes a few "
             "rows, one after another (the loop around the region): for row i, each lane adds up the "
             "products of its own words of the row (a 32-bit word holds two 16-bit values), then the 32 "
             "lanes' partial sums are added by shuffles, so that every lane ends with the whole sum "
             "(lane r keeps row r's after the region: a butterfly of shfl_xor_sync, not shfl_down, "
             "which leaves it in lane 0 alone).",
        helpers="O[b, h, i, w] and dO[b, h, i, w]: word w (0 .. HEAD_DIM / 2 − 1) of row i, two values; "
                "each lane reads WORDS of them (1 at D = 64, 2 at D = 128): w = lane + 32 j; "
                "unpack(word) -> (x0, x1) as float32; cuda.shfl_xor_sync(FULL_MASK, x, width): x of the lane "
                "whose number differs from this one's in the bit `width`. total starts at 0.",
        pseudo="for j in range(WORDS):  w = lane + 32 j\n"
               "    o0, o1 = <unpack word w of O's row>;  d0, d1 = <the same of dO>\n"
               "    total += o0 * d0 + o1 * d1\n"
               "for width in 16, 8, 4, 2, 1:\n"
               "    total += <total of the lane `width` away>",
        diagnoses={"wrong:dq+dk": "dV is right, so P is; dK and dQ are not: they come from dS = P ∘ (dP − Δ), "
                                  "and Δ is this region's: is every word of the row summed, by every lane, "
                                  "and then over all 32 lanes, so that every lane holds the sum?"},
    ),
    "11-c": RegionHints(
        idea="Other blocks own the other keys, and each adds its share of dQ = scale · dS K for the same "
             "query rows: the shares must be summed in global memory, where blocks run in any order. An "
             "atomic addition reads, adds and writes in one step that no other block can split; a reduction "
             "(PTX `red`) is one whose old value nobody reads back. Each lane holds four values of the 16 x 8 "
             "accumulator tile c[n]: rows row_a and row_a + 8, columns col and col + 1, side by side in "
             "memory, so one red_pair adds two of them; a row past the end of the sequence does not exist "
             "and must not be written.",
        helpers="red_pair(address, x0, x1): adds x0 to the float32 at `address` and x1 to the one after it; "
                "at: the address of dQ[b, h, row_a, col] (dQ is float32 (B, H, S_q, D)), and row_a + 8 is "
                "8 * DQ_ROW bytes further; c[n, 0..3]: rows row_a, row_a, row_a + 8, row_a + 8 and columns "
                "col, col + 1, col, col + 1; seq_q: the rows that exist; scale: the softmax scale (dQ = "
                "scale · dS K).",
        pseudo="if row_a < seq_q:\n"
               "    <add c[n, 0] * scale and c[n, 1] * scale at `at`>\n"
               "if row_a + 8 < seq_q:\n"
               "    <the same with c[n, 2], c[n, 3], 8 rows further>",
        diagnoses={"zeros": "all zeros: nothing is added to dQ (it is set to 0 before the kernel): add each "
                            "lane's four values with red_pair",
                   "wrong:dq": "dK and dV are right, so dS is; dQ is not: are all four values of the lane added, "
                               "at their rows and columns, times scale, and only for rows that exist?"},
    ),
    "12-a": RegionHints(
        idea="The piece of dQ this warpgroup owns (64 query rows by 64 columns of d) sums over the block's "
             "keys. dq multiplies 64 keys' worth, A = dSᵀ read transposed and B = K read transposed, both "
             "through descriptors, and overwrites; dq_acc adds the next 64 keys to the registers it is given. "
             "dSᵀ's next 64 keys are 64 rows (of ROW bytes) further in its atom, K's are the next warpgroup's "
             "tile, KV_TILE bytes on.",
        helpers="dq_first(desc_ds, desc_k) -> the tuple of this thread's 32 registers; dq_acc(desc_ds, desc_k, "
                "registers) -> the sum; descriptor(address, ATOM, GROUP, SW128): an MN-major tile; ds_atom, "
                "k_atom: where the piece's query rows of dSᵀ and its columns of K start; KEY_HALVES: the block's "
                "keys in 64s; as_tuple(dq, N_DQ), store_tuple(dq, values).",
        pseudo="store_tuple(dq, dq_first(<descriptor of ds_atom>, <descriptor of k_atom>))\n"
               "for half in range(1, KEY_HALVES):\n"
               "    store_tuple(dq, dq_acc(<ds_atom, half * 64 rows on>, <k_atom, half tiles on>, as_tuple(dq, N_DQ)))",
        diagnoses={"nan": "NaN everywhere: dq is never written (a local array starts as NaN here): dq_first's "
                          "product goes into it with store_tuple",
                   "wrong:dq": "dK and dV are right, so dS is; dQ is not: is every 64 keys of the block in the "
                               "sum (dq_first, then dq_acc for each further half), each half's dSᵀ rows with "
                               "the same half's K?"},
    ),
    "12-b": RegionHints(
        idea="Sᵀ = K Qᵀ has the form of the forward's S = Q Kᵀ (phase 08's qk call): A is the warpgroup's "
             "64 rows of K (its keys), B is the query tile, both K-major (d along their 128-byte rows) in the "
             "swizzle, so both go in through descriptors; the call returns the warpgroup's accumulators, one "
             "register per element this thread holds. dPᵀ = V dOᵀ is the same call with V and dO.",
        helpers="qk(desc_a, desc_b): the tuple of this thread's registers of A · Bᵀ (64 rows by BLOCK_M); "
                "desc_k, desc_v: the descriptors of this warpgroup's rows of K and V, made above; "
                "descriptor(address, lbo, sbo, swizzle): a descriptor of the tile at `address` (K-major: "
                "lbo 16, unused; sbo GROUP, eight rows; swizzle SW128); q_tile, do_tile: where this tile's Q "
                "and dO are; store_tuple(array, values): the tuple into the local array.",
        pseudo="store_tuple(s, qk(desc_k, <descriptor of q_tile>))\n"
               "store_tuple(dp, qk(desc_v, <descriptor of do_tile>))",
        diagnoses={"nan": "NaN everywhere: s and dp are never written (a local array starts as NaN here): the "
                          "two qk calls go into them with store_tuple",
                   "wrong:dq+dk+dv": "every gradient is wrong, so P is (dV = Pᵀ dO needs nothing else): is Sᵀ "
                                     "= K Qᵀ in s (K's rows against the tile of Q), and dPᵀ = V dOᵀ in dp?",
                   "wrong:dq+dk": "dV is right, so Sᵀ and P are; dK and dQ are not: they come from dS = P ∘ "
                                  "(dP − Δ): is dPᵀ = V dOᵀ in dp, V's rows against the tile of dO?"},
    ),
    "12-c": RegionHints(
        idea="dQ = dS K needs dS with the query rows as its rows and both warpgroups' keys, so each thread "
             "stores its part of dSᵀ to shared memory, a row of 128 bytes per key in each atom of 64 query "
             "rows, in the 128-byte swizzle the tensor cores read: chunk c of row r at chunk c ^ (r % 8). "
             "k-step kk's A fragment holds rows g and g + 8 of the thread's warp, query rows 16 kk + 2t and "
             "16 kk + 2t + 1 (a0, a1: chunk 2 kk % 8 of atom kk // 4) and 8 further (a2, a3: the next chunk); "
             "g is the row % 8 of both rows.",
        helpers="smem_h: shared memory as 32-bit words; ds_row: the word of row g's first chunk, this "
                "thread's word t of it (ROW_WORDS words a row, 8 rows further is 8 * ROW_WORDS); "
                "DS_ATOM_WORDS: the words of one atom of dSᵀ; ds_frag[kk, 0..3]: a0..a3; a 16-byte chunk is 4 "
                "words. Keep the indices uint32, as the code around does.",
        pseudo="atom = uint32(<the atom of k-step kk> * DS_ATOM_WORDS)\n"
               "lo = uint32(<chunk 2 kk % 8, swizzled by g>) * 4;  hi = <the next chunk, swizzled>\n"
               "smem_h[ds_row + atom + lo] = ds_frag[kk, 0]\n"
               "smem_h[<8 rows further> + atom + lo] = ds_frag[kk, 1]\n"
               "<a2 and a3 the same at hi>",
        diagnoses={"zeros": "all zeros: dQ = dS K adds nothing, so the dSᵀ it reads is still the zeros shared "
                            "memory starts with here: store each k-step's four words of ds_frag",
                   "wrong:dq": "dK and dV are right, so dS is; dQ is not: the dSᵀ it reads from shared memory "
                               "is not where the descriptor says: every word at row g (a1, a3: g + 8), in "
                               "its atom, its chunk XOR g?"},
    ),
    "13-a": RegionHints(
        idea="A TMA load names the box it copies by coordinates in the tensor map: the column (an element of "
             "d), the row (a token of the sequence) and the plane (batch and head). A tile of n_rows rows and "
             "D_TILE columns is loaded as boxes of 64 rows by 64 columns: atom a holds columns 64a .. 64a + 63, "
             "box r the rows 64r .. of the tile, which starts at row row0.",
        helpers="col, row: int32 TMA coordinates; row0: the tile's first row (a key for K and V, a query row "
                "for Q and dO); r, a: the box and the atom of this load.",
        pseudo="col = int32(<first column of atom a>)\n"
               "row = int32(<the tile's first row> + <first row of box r>)",
        diagnoses={"wrong:dq+dk+dv": "every gradient is wrong: the boxes past the first (rows 64 on of a key "
                                     "block or a query tile, the columns of atom 1 at D = 128) bring the wrong "
                                     "part of K, V, Q and dO: box r of atom a starts at column 64a and row "
                                     "row0 + 64r"},
    ),
    "13-b": RegionHints(
        idea="The producer loads the query tiles in exactly the order the consumers take them off the ring: "
             "the rows of head h BLOCK_M at a time, from m_first (the first tile that sees the block's keys) "
             "to the end of the sequence, then the next head of the group (h + 1) from m_first again. The "
             "consumers walk the same order themselves; the ring carries no coordinates, only bytes.",
        helpers="h, m0: the head and first query row of the tile just loaded; BLOCK_M: rows a tile; seq_q: the "
                "query rows of a head; m_first: where every head's walk starts.",
        pseudo="if <the next tile of head h still starts inside the sequence>:\n"
               "    m0 = <the next tile's first row>\n"
               "else:\n"
               "    h, m0 = <the next head>, <its first tile's row>",
        diagnoses={"wrong:dq+dk+dv": "every gradient is wrong, yet a single query tile would be right: the "
                                     "walk never moves, so every tile after the first is loaded from the "
                                     "first one's rows again and the consumers compute with the wrong Q and "
                                     "dO: step m0 by BLOCK_M while it stays inside the sequence, then go on "
                                     "to the next head from m_first"},
    ),
    "14-a": RegionHints(
        idea="A mask mod answers one question for one element: does query row q_idx see key kv_idx? With a "
             "window of window[0] keys before the row and window[1] after it, the key may be at most window[0] "
             "positions before the row and at most window[1] after it. Return a bool.",
        helpers="q_idx, kv_idx: whole numbers (the row and the key); window: an array of two whole numbers "
                "(left, right). `&` of two comparisons gives their and, on scalars and on NumPy arrays alike. "
                "np.int32(x): x in 32 bits (Numba widens int32 - int32 to int64, on a GPU twice the instructions "
                "for every score).",
        pseudo="return (<how far the key is before the row> <= left) & (<how far it is after the row> <= right)",
        diagnoses={"rows": "each row is off by a factor of its own: the rows see a different set of keys than "
                           "the window's: row q_idx sees q_idx - window[0] .. q_idx + window[1]"},
    ),
    "14-b": RegionHints(
        idea="Soft-capping keeps a score inside (-cap, cap) without a hard edge: small scores pass almost "
             "unchanged, large ones bend towards ±cap. tanh does that between -1 and 1: scale the score down "
             "by cap, take tanh, scale back up. The mod sees the scaled score, as FlexAttention's do.",
        helpers="math.tanh(x): the hyperbolic tangent; capped[0]: the cap, capped[1]: 1 / cap (an array of two "
                "float32, bound to the mod so that a new cap needs no new compile; multiply by capped[1] rather "
                "than divide by capped[0]: on a GPU a division is a subroutine, for every score).",
        pseudo="return <the cap> * math.tanh(score * <one over the cap>)",
        diagnoses={"rows": "each row is off by a factor of its own: the soft-capped scores are wrong, and with "
                           "them each row's weights: cap · tanh(score / cap), cap = capped[0], 1 / cap = capped[1]"},
    ),
    "14-c": RegionHints(
        idea="In a partial tile the mask decides per score. A key the row must not see gets a score of -inf: "
             "the online softmax then gives it a weight of exp(-inf) = 0, and the row's maximum and sum "
             "ignore it. A key the row sees keeps its score.",
        helpers="mask_call(x, b, h, q_idx, kv_idx, mask_args) -> bool: the user's mask_mod (x is unused: pass "
                "float32(0.0)); s[i // NT, i % NT, e]: score e of this n-tile; float32(-math.inf); int32(b), "
                "int32(h): the batch and head as the mod takes them.",
        pseudo="if not <mask_mod of this score's row and key>:\n"
               "    <this score> = -inf",
        diagnoses={"rows": "each row is off by a factor of its own: the keys a row must not see still count in "
                           "its softmax: set their scores to -inf where mask_call is False"},
    ),
    "14-d": RegionHints(
        idea="The block mask gives each query block a list of the key tiles it sees, in order: KV_INDEX[bm, hm, "
             "m, i] is the i-th, for i below KV_COUNT. Iteration i computes that tile, not tile i: the tiles "
             "the mask leaves empty are not in the list and are never loaded. Its first key is the tile's "
             "number times the keys a tile has.",
        helpers="KV_INDEX[bm, hm, m, i]: the number of the i-th key tile (bm, hm: the block mask's batch and "
                "head, m: this query block); BLOCK_N: keys a tile; int32(...).",
        pseudo="n = <the i-th key tile of the list>\n"
               "start_n = int32(<its first key>)",
        diagnoses={"rows": "each row is off by a factor of its own: the rows attend to the wrong keys: iteration "
                           "i must compute key tile KV_INDEX[bm, hm, m, i], from key n * BLOCK_N"},
    ),
}


def hints_for(label: str) -> RegionHints:
    try:
        return HINTS[label]
    except KeyError:
        raise KeyError(f"no hints for exercise region {label!r}: add them to flashcore_numba/course/hints.py") from None


def worded_by(labels) -> dict[str, str]:
    """Each pattern's diagnosis in the words of the regions `labels` that word it (see diagnoses), each
    followed by its label; where several do, one after the other. A whole-kernel check knows the
    pattern of a wrong output, not the region it comes from."""
    worded: dict[str, list[str]] = {}
    for label in labels:
        for pattern, text in hints_for(label).diagnoses.items():
            worded.setdefault(pattern, []).append(f"{text} (region {label})")
    return {pattern: "; or ".join(texts) for pattern, texts in worded.items()}


def render_hints(regions, upto: int) -> str:
    """Tiers 1..upto of the hints of `regions` (exercises.Region), as text."""
    out = []
    for region in regions:
        out.append(f"{region.label}: {region.instruction}")
        hints = hints_for(region.label)
        for k in range(1, upto + 1):
            body = hints.tier(k).splitlines()
            out.append(f"  hint {k} ({TIER_NAMES[k]}):")
            for line in body:  # prose is wrapped; pseudo-code lines are short and keep their indent
                out += textwrap.wrap(line, 100, initial_indent="    ", subsequent_indent="      ") if len(line) > 96 \
                    else [f"    {line}"]
        out.append("")
    return "\n".join(out).rstrip() + "\n"

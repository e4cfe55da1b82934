"""Phase 09 — warp specialization: a TMA producer and consumer warpgroups taking turns.

What changed from phase 08
    Phase 08's warpgroups did everything: each thread computed addresses and issued cp.async
    copies, then every warp met at a block barrier once per tile before the tensor cores could
    read it. Here the work is split by role (FlashAttention-3's design):
    - a *producer* warpgroup; one of its threads issues TMA loads (ptx/tma.ptx): one instruction
      copies a 64 x 64 box of Q, K or V, in the 128-byte swizzle phase 08 already reads, and
      counts its bytes on an mbarrier. It fills a ring of STAGES K/V stages ahead of the
      consumers, each stage guarded by two mbarriers: "full" (its bytes landed) and "empty" (every
      consumer is done with it). No block barrier is left in the loop;
    - *consumer* warpgroups (two at D = 128, three at D = 64), 64 query rows each, run phase 08's
      math: S = Q·Kᵀ and P·V by wgmma, the online softmax on the accumulators;
    - registers follow the work (ptx/warpgroup.ptx): one block per SM (launch bounds), the producer
      gives most of its registers back (setmaxnreg.dec 24) and the consumers take them
      (setmaxnreg.inc 240 at D = 128, 160 at D = 64);
    - ping-pong: the consumers take turns at the tensor cores (named barriers in a circle). While
      one warpgroup runs its products, the others run their softmax, so the tensor cores and the
      exp2 units work at the same time. A turn issues S = Q·Kᵀ of tile n and P·V of tile n - 1;
    - overlap within a warpgroup: a turn's products are issued and not awaited (ptx/wgmma.ptx, the
      _issue functions), S first. `wait_s` (wait_group 1) returns once S is done, and the softmax
      of tile n runs while the tensor cores still add P·V of tile n - 1 into O; `wait_o`
      (wait_group 0) then hands O back. Until its wait an in-flight register may not be touched,
      not even copied, and the issue and the waits must lie on one straight path (under
      `if n > 0` ptxas serialized every wgmma of the kernel, warning C7518): tile 0 is taken
      before the loop;
    - persistent blocks: one block per SM, each taking query blocks from a counter in global
      memory (one atomic addition each; the last request sets it back to zero, so no memset
      precedes a launch), the blocks with the most keys first. A block's start and end are paid
      once per SM, the K/V ring runs on from one query block to the next, and a consumer releases
      its Q at its last S, so that its next Q and the next block's first K/V tile load while it
      finishes. A counter, not a fixed share per SM: under a causal mask blocks differ in length;
    - the tiles a row must mask (the causal diagonal, the end of the keys) come last, in a loop
      of their own (as in FlashAttention-3): the other tiles' softmax has no masking and no
      branches. A consumer passes the tiles its rows never see (PASS_UNSEEN: a causal block of 192
      rows at D = 64 streams tiles only its later consumers need): it takes its turn and releases
      the stage without computing;
    - tiles of 128 keys (phase 08: 64), P·V added into the accumulator in place (`pv_acc`, the
      wgmma's scale-d = 1; P and O travel as tuples, `ptx.function(..., tuples=True)`): the
      registers phase 08 spent on a fresh P·V tile pay for S of 128 keys, which halves the turns,
      barrier waits and wgmma waits per key;
    - O leaves in 16-byte stores (ptx/store.ptx, common.fragment_epilogue_16b): three shuffles per
      four column blocks give each lane 8 whole columns, written by one STG.E.128: 8 stores per
      thread at D = 128, where phase 08 makes 32.
    VARIANTS keep each idea measurable: "ws" is the producer and the ring without turns, "turns"
    adds the turns but awaits each product before the softmax, "overlap" adds the overlap within
    a warpgroup, and phase 09 is "overlap" on the persistent grid. The variants launch one block
    per query block; the records carry their rows beside phase 09's (the block below).

Why the hardware rewards it
    A TMA load is one instruction for 8 KB; the producer costs the consumers nothing but the
    registers it hands over. Without a block-wide barrier per tile the consumer warpgroups drift
    apart, and the turns keep them apart on purpose: the SM's tensor cores see one warpgroup's
    products while the others' softmax, which the tensor cores cannot help with, runs on the FP32
    and MUFU units. The ring must be deep enough that the consumers never wait for TMA: four
    stages at D = 64, three at D = 128 (all that shared memory holds). Without the overlap every
    turn ends in a drained tensor-core pipeline; with it the next warpgroup's products queue behind
    this one's. (ptxas does not keep `wait_o` after the exp2s, so what phase 09 gains over
    09-turns comes mostly from issuing a turn's two products back to back.)
    As much came from instructions the compiler could drop, in the records (fp16, B=16 H=16
    S=2048, non-causal TFLOPS, each change against the records just before it): one branch
    around the masking instead of one in each of S's 16 column blocks (beside cuDNN's kernel, 6 %
    of phase 09's instructions were branches), D = 64 408 -> 446; the ring's stage and parity
    counted instead of divided out of a tile count (some 40 instructions a tile), D = 128
    542 -> 590; the consumer index broadcast from lane 0, so that ptxas knows it is warp-uniform
    and keeps the ring's addresses in uniform registers, D = 64 466 -> 479, D = 128 588 -> 619;
    16-byte stores of O, D = 64 505 -> 521, D = 128 631 -> 660. Every change with its A/B, the
    profiles, and what was tried and not kept (a block's last P·V in the next block's first turn,
    five K/V stages, ex2.approx.f16x2, two consumers at D = 64, a share of the exp2s on the FMA
    pipe): docs/tuning/09_history.md.

Other head dims
    Any multiple of 8 up to 256 runs on the first tile configuration that holds it (64, 128, 192 or
    256 columns, `tile_head_dim`), TMA's zero fill past D; at 192 and 256, O takes 96 and 128
    registers a thread, so a tile has 64 keys and the ring what shared memory leaves beside Q
    (`KEYS_PER_TILE`, `STAGES`, `RESCALE_LATE`; docs/tuning/09_history.md, "Other head dims").

Measured effect (written by `flashcore report` from the committed record; do not edit by hand)
    [measured:begin]
    NVIDIA H100 80GB HBM3, 2026-12-06, B=16 H=16 S=2048 D=64 fp16: 519 TFLOPS (1.38x phase 08),
    causal 409 TFLOPS (1.31x phase 08); 128 registers, 0 B local memory. 09-overlap: 477 TFLOPS
    (0.92x phase 09, SLOWER than phase 09), causal 357 TFLOPS (0.87x phase 09, SLOWER than phase
    09). 09-turns: 408 TFLOPS (0.86x 09-overlap, SLOWER than 09-overlap), causal 315 TFLOPS (0.88x
    09-overlap, SLOWER than 09-overlap). 09-ws: 451 TFLOPS (1.10x 09-turns), causal 347 TFLOPS
    (1.10x 09-turns). At B=16 H=16 S=2048 D=96 fp16: 526 TFLOPS (1.49x phase 07), causal 433 TFLOPS
    (1.46x phase 07). At B=16 H=16 S=2048 D=128 fp16: 659 TFLOPS (1.73x phase 08), causal 556 TFLOPS
    (1.73x phase 08). At B=16 H=16 S=2048 D=192 fp16: 657 TFLOPS (2.71x phase 07), causal 551 TFLOPS
    (2.55x phase 07). At B=16 H=16 S=2048 D=192 D_v=128 fp16: 625 TFLOPS (2.41x phase 07), causal
    532 TFLOPS (2.30x phase 07). At B=16 H=16 S=2048 D=256 fp16: 472 TFLOPS (1.68x phase 07), causal
    440 TFLOPS (1.73x phase 07). At B=16 H=32 H_kv=8 S=2048 D=64 fp16: 539 TFLOPS (1.40x phase 08),
    causal 426 TFLOPS (1.31x phase 08) (nvidia-h100-80gb-hbm3_b16h16s2048d64_fp16[_causal].json,
    nvidia-h100-80gb-hbm3_b16h16s2048d96_fp16[_causal]_p07-09.json,
    nvidia-h100-80gb-hbm3_b16h16s2048d128_fp16[_causal].json,
    nvidia-h100-80gb-hbm3_b16h16s2048d192_fp16[_causal]_p07-09.json,
    nvidia-h100-80gb-hbm3_b16h16s2048d192v128_fp16[_causal]_p07-09.json,
    nvidia-h100-80gb-hbm3_b16h16s2048d256_fp16[_causal]_p07-09.json,
    nvidia-h100-80gb-hbm3_b16h32kv8s2048d64_fp16[_causal].json). Every shape and dtype measured:
    docs/performance.md.
    [measured:end]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache, partial

from numba import cuda, float32, int32, uint32, uint64

from ..arch import operands, ptx
from ..arch.sim import simulator_enabled
from .common import (FULL_MASK, MMA_N, PTX_TYPE, KernelConfig, fragment_epilogue_16b, key_end,
                     make_exp_and_sum, make_pack_a, mask_scores, packed_span, quad_max, rescale_rows, row_max,
                     softmax_rescale, store_lse, uidx, zero_tiles)
from .tracing import wait_hooks

ID = "09"
NAME = "warp_specialized"
TITLE = "Hopper TMA + warp specialization: a producer warpgroup, consumers taking turns"
HEAD_DIMS = (64, 128)  # the course's head dims; any other multiple of 8 up to 256 runs too (runs_head_dim)
HEAD_DIMS_TEXT = "any multiple of 8 from 8 to 256"
# v (and the output) with a head dim of its own where runs_value_dim says so (MLA's 128 beside 192)
VALUE_HEAD_DIM = True
DTYPES = ("float16", "bfloat16")
GQA = True
LSE = True  # return_lse: the kernel can write each row's log-sum-exp (common.store_lse)
MIN_CC = MAX_CC = (9, 0)  # wgmma, setmaxnreg: Hopper alone (sm_90a)
VARIANTS = {
    "ws": "TMA producer + mbarrier ring, consumers without turns",
    "turns": "warp specialization + turns, each product awaited before the softmax",
    "overlap": "warp specialization + turns + overlap, one block per query block (not persistent)",
}

WG_M = 64  # rows of one wgmma: a consumer warpgroup's share of the query block
# The tile configurations, by D_TILE (the head dim a tile holds; tile_head_dim), and their keys
# per tile, BLOCK_N: at D = 64 and 128 twice phase 08's, which halves the turns, barrier waits and
# wgmma waits per key. It fits in registers because P·V adds into the accumulator in place (no
# second O-sized tile). At D = 192 and 256 a consumer's O takes D / 2 registers a thread (96, 128):
# there S of 64 keys (32 registers) is what fits beside it, and K/V tiles of 64 keys fit shared memory
KEYS_PER_TILE = {64: 128, 128: 128, 192: 64, 256: 64}
ROW = 128  # bytes of one row of a 128-byte-swizzle atom (64 fp16)
ATOM = WG_M * ROW  # 64 rows of one atom, 8192 bytes: a Q atom, and one TMA box
GROUP = 8 * ROW  # eight rows: the SBO of every descriptor here
MMA_K = 16  # the k-step of P's A fragments (MMA_N, 8 columns: common.py)
# The tile configurations that rescale O (acc *= alpha, when the running max moves) late: at the end
# of the turn that computed alpha, right after O's wait (as FlashAttention-3 does), instead of just
# before the next P·V is issued. There, between the two issues, S (32 registers) and P (16) are
# already held by the tensor cores and the rescaled O is a new value that must land in the wgmma's
# accumulator registers: ptxas kept the loop's O in other registers and copied it out and back in
# every tile (128 moves), which at D = 256 did not fit in 240 registers (432 B of spills). Rescaled
# after the wait, O goes from one wgmma to the next in the same registers. D <= 192 keeps the
# rescale where its records were measured
RESCALE_LATE = (256,)
# per head dim: consumer warpgroups (warpgroup 0 is the producer), and the registers per thread a
# consumer raises itself to (the most the block's 65536 leave once the producer is down to 24)
CONSUMERS = {64: 3, 128: 2, 192: 2, 256: 2}
CONSUMER_REGISTERS = {2: 240, 3: 160}
SIM_CONSUMERS = 2  # in the simulator (one Python thread per CUDA thread): 384 threads at any D
# K/V ring depth: as many stages as shared memory holds beside Q (227 KB): at D = 128 three of
# 64 KB, at D = 192 three of 48 KB, at D = 256 two of 64 KB
STAGES = {64: 4, 128: 3, 192: 3, 256: 2}
TURN = 1  # named barriers TURN + c: consumer c's turn at the tensor cores
TURN_THREADS = 256  # a turn barrier completes with its consumer (sync) and the one before (arrive)
WG_SYNC = 4  # named barriers WG_SYNC + c: consumer c's 128 threads only


def runs_head_dim(HEAD_DIM: int) -> bool:
    """Whether the kernel is built for head dim HEAD_DIM: a multiple of 8 (TMA reads rows of whole
    16-byte chunks, and the epilogue stores them) up to 256, the widest tile configuration."""
    return isinstance(HEAD_DIM, int) and 0 < HEAD_DIM <= max(KEYS_PER_TILE) and HEAD_DIM % 8 == 0


def runs_value_dim(HEAD_DIM: int, V_DIM: int) -> bool:
    """Whether the kernel is built for V (and O) of head dim V_DIM beside Q and K of HEAD_DIM, as
    DeepSeek's MLA has (192 and 128): where Q and K need the 192- or 256-column tiles (64-key tiles)
    and V's tile is 128 columns or more, but no wider than K's. The tile configuration is K's."""
    if not (runs_head_dim(HEAD_DIM) and runs_head_dim(V_DIM)):
        return False
    d_tile, v_tile = tile_head_dim(HEAD_DIM), tile_head_dim(V_DIM)
    return V_DIM == HEAD_DIM or (d_tile > 128 and 128 <= v_tile <= d_tile)


def tile_head_dim(HEAD_DIM: int) -> int:
    """D_TILE: the tile configuration a head dim runs on, the first (64, 128, 192, 256) that holds it. TMA
    fills the columns of a box past the tensor's last one with zeros, so Q and K's extra columns add
    nothing to q·kᵀ, and V's give output columns the epilogue never stores: D = 96 costs what
    D = 128 costs in tensor-core work and shared memory (as FlashAttention-2 rounds D up to its
    tiles), though TMA reads only its 96 columns from global memory."""
    return min(d for d in KEYS_PER_TILE if d >= HEAD_DIM)


def tiles(HEAD_DIM: int) -> dict:
    """The tile shape built at head dim HEAD_DIM: query rows per block (WG_M per consumer) and keys per
    tile, as phase 07's `tiles` names them (the grader sizes its cases by them)."""
    L = layout(HEAD_DIM)
    return dict(block_m=L["BLOCK_M"], block_n=L["BLOCK_N"])


def layout(HEAD_DIM, V_DIM=None, consumers=None):
    """Every derived constant. Shared memory: Q (BLOCK_M rows, one 64-row tile per consumer), the
    ring of STAGES K/V stages, then the mbarriers; tiles are D_TILE / 64 swizzled atoms, 1024-aligned
    (an atom of a K or V tile has BLOCK_N rows: BLOCK_N / 64 TMA boxes one below the other).
    V_DIM: V's and O's head dim where it is not Q's and K's (runs_value_dim): V's tile is DV_TILE
    columns, its V_ATOMS atoms after K's in a stage. consumers: other than CONSUMERS' count (phase 14's
    mods at D = 64 take two, for their registers; the simulator always runs SIM_CONSUMERS)."""
    V_DIM = HEAD_DIM if V_DIM is None else V_DIM
    D_TILE, DV_TILE = tile_head_dim(HEAD_DIM), tile_head_dim(V_DIM)
    consumers = SIM_CONSUMERS if simulator_enabled() else (consumers or CONSUMERS[D_TILE])
    BLOCK_N = KEYS_PER_TILE[D_TILE]
    L = dict(HEAD_DIM=HEAD_DIM, D_TILE=D_TILE, V_DIM=V_DIM, DV_TILE=DV_TILE, CONSUMERS=consumers,
             BLOCK_M=WG_M * consumers, BLOCK_N=BLOCK_N, N_THREADS=128 * (1 + consumers))
    L["LAUNCH_BOUNDS"] = (L["N_THREADS"], 1)  # one block per SM: 65536 / N_THREADS registers at launch
    L["CONSUMER_REGISTERS"] = CONSUMER_REGISTERS[consumers]
    L["ATOMS"] = D_TILE // 64  # TMA boxes (64 columns) per tile row
    L["V_ATOMS"] = DV_TILE // 64  # of V's
    L["TILE_BYTES"] = WG_M * D_TILE * 2  # one consumer's 64-row tile of Q
    L["KV_BYTES"] = BLOCK_N * D_TILE * 2  # one K tile (or V tile: V_BYTES), where V's starts in a stage
    L["V_BYTES"] = BLOCK_N * DV_TILE * 2
    L["KV_ATOM"] = BLOCK_N * ROW  # one atom of a K or V tile: BLOCK_N rows of 128 bytes
    L["STAGES"] = STAGES[D_TILE]
    L["RESCALE_LATE"] = D_TILE in RESCALE_LATE
    # a consumer passes the tiles its rows never see: under a causal mask, a block with more rows
    # than a tile has keys streams tiles that only its later consumers need (D = 64: 192 rows, 128
    # keys; D = 256: 128 rows, 64 keys). Kept in the simulator (BLOCK_M = BLOCK_N there at D <= 128)
    # so that the pass stays tested
    L["PASS_UNSEEN"] = L["BLOCK_M"] > BLOCK_N or simulator_enabled()
    L["Q_OFF"] = 0
    L["RING_OFF"] = consumers * L["TILE_BYTES"]
    L["STAGE_BYTES"] = L["KV_BYTES"] + L["V_BYTES"]  # K, then V
    L["BARS_OFF"] = L["RING_OFF"] + L["STAGES"] * L["STAGE_BYTES"]
    L["INFO_OFF"] = L["BARS_OFF"] + 8 * (2 * L["STAGES"] + 2 * consumers)  # full[], empty[], q_full[], q_empty[]
    L["SMEM_BYTES"] = L["INFO_OFF"] + 8 * consumers  # per consumer: its query block's first row and plane
    L["NT"] = BLOCK_N // MMA_N  # 8-column blocks of S
    L["KP"] = BLOCK_N // MMA_K  # k-steps of P·V
    L["NO"] = DV_TILE // MMA_N  # 8-column blocks of O's tile
    L["N_OUT"] = V_DIM // MMA_N  # of them, those O has (the epilogue stores these)
    return L


def work_units(q_shape, causal, block_m) -> int:
    """The kernel's units of work, one query block each: B * H * ceil(S_q / BLOCK_M)."""
    B, H, S, _ = q_shape
    return B * H * (-(-S // block_m))


@dataclass(frozen=True)
class Build:
    """Which of phase 09's ideas one build of its kernel has. Phase 09 has them all; each variant
    (VARIANTS, BUILDS) leaves some out, so that what each idea buys stays measurable: every build
    is its own benchmark row and its own `phase=` value ("09-ws", "09-turns", "09-overlap")."""

    turns: bool = True  # ping-pong: the consumers take turns at the tensor cores (named barriers)
    overlap: bool = True  # a turn's two products issued, not awaited: S waited for alone, P·V later
    persistent: bool = True  # one block per SM, taking query blocks from a counter (else one per block)
    trace: bool = False  # the diagnostic build of phases/tracing.py: every barrier wait timed

    @property
    def release_q_early(self) -> bool:
        """A consumer releases Q (q_empty) as soon as its last S is done, not after that tile's
        softmax and P·V: the next block's Q then loads under them. Only with the overlap (phase 09
        and 09-overlap): 09-turns spilled 48 B at D = 64 with it, and the variants run one block
        per query block, with no next Q to load."""
        return self.overlap

    @property
    def uniform_c(self) -> bool:
        """The consumer index broadcast from lane 0 (warp-uniform to ptxas) for the turns and the
        loops. 09-turns keeps tid // 128 there: with c uniform ptxas moved its turn's hand-over
        (bar.arrive) below two dozen exp2s, and the variant lost a quarter of its speed
        (docs/tuning/09_history.md). 09-ws has no hand-over to move and keeps the broadcast."""
        return self.overlap or not self.turns


BUILDS = {
    None: Build(),  # phase 09
    "overlap": Build(persistent=False),
    "turns": Build(overlap=False, persistent=False),
    "ws": Build(turns=False, overlap=False, persistent=False),
}


# The walk over a query block's key tiles. Phase 09 visits every tile up to the block's last key, in
# order, and takes the scores as the product leaves them. Phase 14 (p14_flex.py) builds this same
# kernel with a walk of its own: the tiles its block mask lists, and the user's mods applied to each
# tile's scores. The plain walk's functions compile to nothing: phase 09's PTX at D = 64 and 128, and
# its varlen build's, were the same text with the seam as without it (but for Numba's serial numbers
# in the kernel's name).
@dataclass(frozen=True)
class Walk:
    mods: bool  # phase 14's: every consumer computes every listed tile (none passed)
    listed: object  # listed(lists, bh, n_heads, row0, n_tiles) -> (tiles visited, where: the list's entry)
    tile_at: object  # tile_at(lists, where, i) -> the key block of the i-th tile visited
    unmasked: object  # unmasked(lists, where) -> n_full: the list's tiles 1 .. n_full - 1 need no mask
    apply: object  # apply(s, context, n, t, scale, may_mask): the mods on the scores of key block n
    softmax_scale: object  # softmax_scale(scale) -> the softmax's scale of the scores apply leaves


def plain_walk() -> Walk:
    """Phase 09's own walk: tiles 0 .. n_tiles - 1, the scores left as they are."""
    @cuda.jit(device=True, inline=True)
    def listed(lists, bh, n_heads, row0, n_tiles):
        return n_tiles, 0

    @cuda.jit(device=True, inline=True)
    def tile_at(lists, where, i):
        return i

    @cuda.jit(device=True, inline=True)
    def unmasked(lists, where):
        return 1

    @cuda.jit(device=True, inline=True)
    def apply(s, context, n, t, scale, may_mask):
        pass

    @cuda.jit(device=True, inline=True)
    def softmax_scale(scale):
        return scale

    return Walk(False, listed, tile_at, unmasked, apply, softmax_scale)


def make_softmax_tile(L, dtype="float16"):
    """(softmax_tile, pack_a): phase 08's online softmax on S of BLOCK_N keys, and P's fragments."""
    BLOCK_N = L["BLOCK_N"]
    pack = ptx.function("mma_sync.ptx", f"flashcore_pack_{PTX_TYPE[dtype]}x2", "inline")
    pack_a = make_pack_a(pack, L["KP"])
    # p = exp2(s · scale - m) by one MUFU.EX2 a score, no subnormal fix-ups (common.py)
    exp_and_sum = make_exp_and_sum(ptx.function("exp2.ptx", "flashcore_exp2", "inline"))
    HALF = L["NT"] // 2  # S's column blocks are walked in two halves: see mask_and_max

    @cuda.jit(device=True, inline=True)
    def mask_and_max(s, j0, masked, start_n, t, k_end_a, k_end_b, m_ij_a, m_ij_b):
        """Column blocks j0 .. j0 + HALF - 1 of S: keys past a row's last one set to -inf, the
        rows' maxima taken. Why halves: LLVM unrolls a loop of 8 blocks fully, one of 16 (128
        keys) it leaves a loop; s indexed at run time would be put in local memory. The masking
        is one branch around its whole loop: a branch in each block (16 per tile, taken or not)
        cost D = 64, which runs every tile through this code, 8 % of its speed
        (docs/tuning/09_history.md)."""
        if masked:
            mask_scores(s, j0, HALF, start_n, t, k_end_a, k_end_b)
        return row_max(s, j0, HALF, m_ij_a, m_ij_b)

    @cuda.jit(device=True, inline=True)
    def softmax_tile(s, start_n, t, k_end_a, k_end_b, scale, m_a, m_b, l_a, l_b, may_mask):
        """Phase 08's online softmax on S of the tile starting at key start_n (masking, row maxima,
        exp2 with the scale folded in): S holds P in fp32; returns the rows' new m_i, l_i and alpha.
        may_mask is a constant of the caller: False in the loop over tiles no row masks, where the
        masking, and its branches, are compiled out (see the loops of the consumer)."""
        masked = may_mask and start_n + BLOCK_N > min(k_end_a, k_end_b)
        m_ij_a, m_ij_b = mask_and_max(s, 0, masked, start_n, t, k_end_a, k_end_b,
                                      float32(-math.inf), float32(-math.inf))
        m_ij_a, m_ij_b = mask_and_max(s, HALF, masked, start_n, t, k_end_a, k_end_b, m_ij_a, m_ij_b)
        m_ij_a, m_ij_b = quad_max(m_ij_a, m_ij_b)
        m_ij_a *= scale
        m_ij_b *= scale
        m_new_a, m_ref_a, alpha_a = softmax_rescale(m_a, m_ij_a)
        m_new_b, m_ref_b, alpha_b = softmax_rescale(m_b, m_ij_b)
        sum_a, sum_b = exp_and_sum(s, 0, HALF, scale, m_ref_a, m_ref_b, float32(0.0), float32(0.0))
        sum_a, sum_b = exp_and_sum(s, HALF, HALF, scale, m_ref_a, m_ref_b, sum_a, sum_b)
        return m_new_a, m_new_b, l_a * alpha_a + sum_a, l_b * alpha_b + sum_b, alpha_a, alpha_b

    return softmax_tile, pack_a


def make_ring(L):
    """(advance, barriers): the ring of K/V stages, and where its mbarriers (and Q's) are."""
    STAGES, CONSUMERS, BARS_OFF = L["STAGES"], L["CONSUMERS"], L["BARS_OFF"]

    @cuda.jit(device=True, inline=True)
    def advance(stage, phase):
        """The ring position after (stage, phase): the next stage, and the parity of its use, which
        flips each time the ring wraps around. Counted, not computed from a tile count r as
        r % STAGES and (r // STAGES) % 2: with STAGES = 3 that took some 40 instructions of 64-bit
        division per tile, in front of the wait."""
        stage = uint32(stage + uint32(1))
        if stage == uint32(STAGES):
            return uint32(0), uint32(phase ^ uint32(1))
        return stage, phase

    @cuda.jit(device=True, inline=True)
    def barriers(smem):
        """The mbarriers' shared-memory addresses: full[s] at full + 8 s (stage s holds its tile),
        empty[s] (every consumer is done with stage s), q_full[c] at q_full + 8 c (consumer c's
        tile of Q for its next query block has landed), q_empty[c] (consumer c is done with its Q:
        its next one may come). Q has a pair per consumer, so that a consumer's next Q loads once
        it is done with its own, not once the last consumer is (two turns later at D = 64)."""
        full = smem + BARS_OFF
        empty = full + 8 * STAGES
        q_full = empty + 8 * STAGES
        return full, empty, q_full, q_full + 8 * CONSUMERS

    return advance, barriers


def make_scheduler(L):
    """(next_unit, query_block): which query block comes next.

    The work is units of one query block, numbered head after head and within a head from the last
    block down (under a causal mask the last query rows see the most keys: the longest units go
    first). Block x takes unit x, then whichever unit the counter hands out next: a grid of one
    block per SM when persistent, else of one block per unit (which then finds no unit left). The
    producer asks; a consumer learns which query block comes from its info slot. (32-bit unsigned
    arithmetic throughout: after setmaxnreg.dec the producer has 24 registers, and Numba's default
    64-bit integers take two each)"""
    BLOCK_M = L["BLOCK_M"]

    @cuda.jit(device=True, inline=True)
    def next_unit(counter, n_units):
        """The unit this block takes after its current one: one atomic addition on the counter in
        global memory, past the grid's first units. Every unit makes one request, so the request
        handed n_units - 1 is the launch's last: no block asks again, and it sets the counter back
        to zero for the next launch (no memset before a launch, and a replayed CUDA graph finds it
        at zero too)."""
        handed = uint32(cuda.atomic.add(counter, 0, 1))
        if handed == n_units - uint32(1):
            counter[0] = 0
        return handed + uint32(cuda.gridDim.x)

    @cuda.jit(device=True, inline=True)
    def query_block(unit, n_m):
        """Unit `unit` as a query block (n_m per head): its plane b * H + h of Q, and its first row."""
        bh = uint32(unit // n_m)
        row0 = int32((n_m - uint32(1) - unit % n_m) * uint32(BLOCK_M))
        return bh, row0

    return next_unit, query_block


def make_producer(L, varlen, hooks, tail_off, walk):
    """producer(...): the TMA loads, by one thread of warpgroup 0. hooks: the kernel's barrier waits
    and trace marks (tracing.wait_hooks); tail_off: (varlen) where the producer's own barrier is;
    walk: which key tiles a query block visits (Walk)."""
    VARLEN = varlen
    wait, _, trace_mark, trace_save = hooks
    expect_tx = ptx.function("tma.ptx", "flashcore_mbarrier_arrive_expect_tx", "inline")
    tma_load = ptx.function("tma.ptx", "flashcore_tma_load_3d", "inline")
    map_address = operands.map_address
    advance, _ = make_ring(L)
    next_unit, query_block = make_scheduler(L)
    BLOCK_M, BLOCK_N, CONSUMERS, ATOMS, V_ATOMS = L["BLOCK_M"], L["BLOCK_N"], L["CONSUMERS"], L["ATOMS"], L["V_ATOMS"]
    TILE_BYTES, RING_OFF, STAGE_BYTES = L["TILE_BYTES"], L["RING_OFF"], L["STAGE_BYTES"]
    KV_BYTES, KV_ATOM = L["KV_BYTES"], L["KV_ATOM"]
    INFO = L["INFO_OFF"] // 4  # the info slots (two words per consumer), in words of smem_h
    TAIL_OFF = tail_off
    listed, tile_at = walk.listed, walk.tile_at
    fence_proxy_async = ptx.function("wgmma.ptx", "flashcore_fence_proxy_async", "inline")
    arrive = ptx.function("tma.ptx", "flashcore_mbarrier_arrive", "inline")

    @cuda.jit(device=True, inline=True)
    def load_q(smem_h, smem, q_full, q_empty, q_uses, row0, bh, map_q, q_first, plane_q):
        """The query block's Q by TMA, consumer after consumer, each tile once its consumer has
        released the last one (q_empty[c]), and which block it is in the consumer's info slot
        (published by the same barrier, q_full[c]); returns q_uses + 1. Q's rows are those of plane
        plane_q (b * H + h; varlen: h), from row q_first (varlen: the sequence's first row)."""
        for c in range(CONSUMERS):  # consumer c's 64 rows of Q, D / 64 boxes
            wait(q_empty + 8 * c, uint32(q_uses % uint32(2)) ^ uint32(1))  # consumer c is done with its last Q
            smem_h[INFO + 2 * c] = uint32(row0)
            smem_h[INFO + 2 * c + 1] = uint32(bh)
            expect_tx(q_full + 8 * c, uint32(TILE_BYTES))
            q_row = int32(0)
            # >>> exercise 09-a: the first query row of consumer c's tile
            q_row = int32(row0 + c * WG_M)
            # <<< exercise
            if VARLEN:
                q_row += int32(q_first)
            for a in range(ATOMS):
                tma_load(smem + c * TILE_BYTES + a * ATOM, map_q, int32(64 * a), q_row, int32(plane_q),
                         q_full + 8 * c)
        return uint32(q_uses + uint32(1))

    @cuda.jit(device=True, inline=True)
    def load_kv(smem, bar, stage, n, plane_kv, map_k, map_v, k_first):
        """Tile n's K and V by TMA into ring stage `stage`, counted on barrier `bar` (the stage's full
        barrier; varlen: the sequence's keys start at row k_first)."""
        expect_tx(bar, uint32(STAGE_BYTES))
        k_tile = smem + RING_OFF + stage * STAGE_BYTES
        for a in range(ATOMS):  # atom a holds columns 64a .. 64a + 63 of d
            for box in range(BLOCK_N // 64):  # its rows, 64 keys per box
                col = int32(0)
                row = int32(0)
                # >>> exercise 09-b: the first column and first row (key) of box `box` of atom a of tile n
                col = int32(64 * a)
                row = int32(n * BLOCK_N + 64 * box)
                # <<< exercise
                if VARLEN:
                    row += int32(k_first)
                at = a * KV_ATOM + box * ATOM
                tma_load(k_tile + at, map_k, col, row, plane_kv, bar)
                if a < V_ATOMS:  # (V narrower than K, as MLA's: fewer atoms)
                    tma_load(k_tile + KV_BYTES + at, map_v, col, row, plane_kv, bar)

    @cuda.jit(device=True, inline=True)
    def load_kv_alone(smem, smem_d, full, stage, n, plane_kv, map_k, map_v, k_first, seq_k, tail_parity):
        """(varlen) Tile n of a sequence whose last rows are the next sequence's keys: its keys are
        masked out of S, but P·V multiplies their P of 0 by their V, and 0 · NaN is NaN. So the tile
        lands on the producer's own barrier first; the producer sets V's rows past the sequence's
        last key to zero, makes its stores visible to the tensor cores, and only then arrives on the
        stage's full barrier. Once per unit of work, at its last tile (causal: only where the unit
        reaches the sequence's end). Returns the parity of the producer's barrier's next phase."""
        tail = smem + TAIL_OFF
        load_kv(smem, tail, stage, n, plane_kv, map_k, map_v, k_first)
        wait(tail, tail_parity)
        v_words = (RING_OFF + stage * STAGE_BYTES + KV_BYTES) // 8  # the stage's V tile, in 8-byte words
        for a in range(V_ATOMS):  # atom a: columns 64a .. 64a + 63, a row of 128 bytes each (any swizzle)
            for r in range(seq_k - n * BLOCK_N, BLOCK_N):
                row = v_words + (a * KV_ATOM + r * ROW) // 8
                for w in range(ROW // 8):
                    smem_d[row + w] = uint64(0)
        fence_proxy_async()
        arrive(full + 8 * stage)
        return tail_parity ^ uint32(1)

    @cuda.jit(device=True, inline=True)
    def producer(smem_h, smem, smem_d, full, empty, q_full, q_empty, Q, K, causal, maps, counter, n_heads, seq_q,
                 seq_k, CU_Q, CU_K, lists):
        """The producer: for each query block the scheduler hands out, its K and V tile after tile
        into the ring (a stage once every consumer has released it), each consumer's Q behind tile
        0; then it tells the consumers that no block is left. varlen: seq_q is the longest sequence's."""
        trace_mark(1)
        map_q, map_k, map_v = map_address(maps[0]), map_address(maps[1]), map_address(maps[2])
        n_m = uint32((seq_q + BLOCK_M - 1) // BLOCK_M)  # query blocks per head
        n_units = uint32((CU_Q.shape[0] - 1 if VARLEN else Q.shape[0]) * n_heads) * n_m
        stage = uint32(0)  # the ring position of the next tile: its stage, and the parity of this use
        phase = uint32(0)
        q_uses = uint32(0)  # query blocks so far: Q's barriers are in phase q_uses % 2
        tail_parity = uint32(0)  # (varlen) the phase of the producer's own barrier (load_kv_alone)
        unit = uint32(cuda.blockIdx.x)
        while unit < n_units:
            trace_mark(3)
            # ask for the next unit now: the atomic's latency passes while this one's loads go out
            unit_after = next_unit(counter, n_units)
            bh, row0 = query_block(unit, n_m)
            if VARLEN:  # (1, total, heads, D): sequence b's rows from CU_Q[b], plane h of the maps
                b = bh // uint32(n_heads)
                q_first, seq_q = packed_span(CU_Q, b, Q.shape[1])  # clamped to the packed rows
                k_first, seq_k = packed_span(CU_K, b, K.shape[1])
                if row0 >= seq_q:  # a query block past its sequence's rows: nothing to load
                    unit = unit_after
                    continue
                plane_q = bh % uint32(n_heads)
                plane_kv = int32(uint32(plane_q * uint32(K.shape[2])) // uint32(n_heads))
            else:
                q_first = k_first = 0
                plane_q = bh
                h_kv = uint32(uint32(bh % uint32(n_heads)) * uint32(K.shape[1])) // uint32(n_heads)  # see phase 08
                plane_kv = int32(uint32(bh // uint32(n_heads)) * uint32(K.shape[1]) + h_kv)
            block_k_end = key_end(min(row0 + BLOCK_M, seq_q) - 1, seq_q, seq_k, causal)
            n_tiles = int32((block_k_end + BLOCK_N - 1) // BLOCK_N)
            n_tiles, where = listed(lists, bh, n_heads, row0, n_tiles)
            # Tile 0's K and V go out before Q: their stage is freed by the consumers of the last
            # block whatever Q does, so they load while those finish. Each consumer's tile of Q
            # waits for that consumer's release (its last S of the last block), then comes in
            # behind tile 0 (n_tiles = 0: at once)
            if n_tiles == 0:
                q_uses = load_q(smem_h, smem, q_full, q_empty, q_uses, row0, bh, map_q, q_first, plane_q)
            for i in range(n_tiles):  # fill the next stage once it is free
                n = tile_at(lists, where, i)
                wait(empty + 8 * stage, phase ^ uint32(1))  # the use before this one was released
                # (varlen) a tile past the sequence's last key whose rows there are another sequence's
                if VARLEN and (n + 1) * BLOCK_N > seq_k and k_first + seq_k < K.shape[1]:
                    tail_parity = load_kv_alone(smem, smem_d, full, stage, n, plane_kv, map_k, map_v, k_first, seq_k,
                                                tail_parity)
                else:
                    load_kv(smem, full + 8 * stage, stage, n, plane_kv, map_k, map_v, k_first)
                stage, phase = advance(stage, phase)
                if i == 0:
                    q_uses = load_q(smem_h, smem, q_full, q_empty, q_uses, row0, bh, map_q, q_first, plane_q)
            unit = unit_after
        for i in range(CONSUMERS):
            wait(q_empty + 8 * i, uint32(q_uses % uint32(2)) ^ uint32(1))
            smem_h[INFO + 2 * i] = uint32(0xFFFFFFFF)  # no query block left: the consumers stop
            expect_tx(q_full + 8 * i, uint32(0))
        trace_save(counter)

    return producer


def make_turns(L, dtype="float16", build=None, hooks=None, walk=None):
    """(first_tile, turn, add_pv): a consumer warpgroup's steps through its tiles, each a turn at the
    tensor cores (wgmma from shared memory, ptx/wgmma.ptx) and the softmax of the tile. hooks: the
    kernel's barrier waits and trace marks (tracing.wait_hooks); walk: the mods on each tile's
    scores (Walk.apply: none in phase 09)."""
    kind = PTX_TYPE[dtype]
    BLOCK_N = L["BLOCK_N"]
    shape = f"d{L['D_TILE']}_n{BLOCK_N}"  # the functions' tile shape: 64 query rows, BLOCK_N keys, D_TILE
    v_shape = f"d{L['DV_TILE']}_n{BLOCK_N}"  # P·V's: DV_TILE, V's columns (MLA's 128 beside 192)
    qk = ptx.function("wgmma.ptx", f"flashcore_wgmma_qk_{shape}_{kind}", "inline")
    # P·V adds into O in place: P's fragments and O's registers travel as two tuples
    pv_acc = ptx.function("wgmma.ptx", f"flashcore_wgmma_pv_acc_{v_shape}_{kind}", "inline", tuples=True)
    # intra-warpgroup overlap: the products issued, not awaited; the waits come later (see `turn`)
    qk_issue = ptx.function("wgmma.ptx", f"flashcore_wgmma_qk_issue_{shape}_{kind}", "inline")
    pv_acc_issue = ptx.function("wgmma.ptx", f"flashcore_wgmma_pv_acc_issue_{v_shape}_{kind}", "inline",
                                tuples=True)
    wait_s = ptx.function("wgmma.ptx", f"flashcore_wgmma_wait_s_n{BLOCK_N}", "inline", tuples=True)
    wait_o = ptx.function("wgmma.ptx", f"flashcore_wgmma_wait_o_{v_shape}", "inline", tuples=True)
    arrive = ptx.function("tma.ptx", "flashcore_mbarrier_arrive", "inline")
    bar_arrive = ptx.function("warpgroup.ptx", "flashcore_bar_arrive", "inline")
    wait, bar_sync, _, _ = hooks
    RESCALE_LATE = L["RESCALE_LATE"]  # O rescaled at the end of a turn, not before a P·V (see RESCALE_LATE)
    descriptor, as_tuple, store_tuple = operands.matrix_descriptor, operands.as_tuple, operands.store_tuple
    SW128 = operands.SWIZZLE_128B
    softmax_tile, pack_a = make_softmax_tile(L, dtype)
    _, barriers = make_ring(L)
    CONSUMERS, RING_OFF, STAGE_BYTES = L["CONSUMERS"], L["RING_OFF"], L["STAGE_BYTES"]
    KV_BYTES, KV_ATOM, NO = L["KV_BYTES"], L["KV_ATOM"], L["NO"]
    N_P, N_O = 4 * L["KP"], 4 * NO  # registers per thread of P's fragments, of O
    # the build's choices, as constants the compiler folds (a branch on one is compiled out)
    TURNS, OVERLAP, RELEASE_Q_EARLY = build.turns, build.overlap, build.release_q_early
    apply_mods, softmax_scale = walk.apply, walk.softmax_scale

    @cuda.jit(device=True, inline=True)
    def add_pv(acc, p_frag, desc_v, alpha_a, alpha_b):
        """acc = alpha · acc + P·V of one tile: the rescale, then the wgmma adds into acc in place
        (RESCALE_LATE: acc += P·V, the rescale was done at the end of the tile's turn)."""
        if not RESCALE_LATE:
            rescale_rows(acc, NO, alpha_a, alpha_b)
        store_tuple(acc, pv_acc(as_tuple(p_frag, N_P), desc_v, as_tuple(acc, N_O)))

    @cuda.jit(device=True, inline=True)
    def first_tile(smem, full, q_empty, stage, phase, c, desc_q, t, k_end_a, k_end_b, scale, s, p_frag, m_a,
                   m_b, l_a, l_b, n_mine, n, context):
        """-- the first tile of a query block (key block n: 0 in phase 09), in ring stage `stage`: its
        S alone (there is no P·V before it), in this warpgroup's turn, then its softmax; returns the
        rows' new m_i, l_i and alpha."""
        wait(full + 8 * stage, phase)
        if TURNS:
            bar_sync(uint32(TURN + c), uint32(TURN_THREADS))
        s_tile = qk(desc_q, descriptor(smem + RING_OFF + stage * STAGE_BYTES, 16, GROUP, SW128))
        if TURNS:
            bar_arrive(uint32(TURN + (c + 1) % CONSUMERS), uint32(TURN_THREADS))
        if RELEASE_Q_EARLY and n_mine == 1:
            arrive(q_empty)  # the block's only S is done
        store_tuple(s, s_tile)
        apply_mods(s, context, n, t, scale, True)
        m_a, m_b, l_a, l_b, alpha_a, alpha_b = softmax_tile(s, n * BLOCK_N, t, k_end_a, k_end_b, softmax_scale(scale),
                                                            m_a, m_b, l_a, l_b, True)
        pack_a(p_frag, s)
        return m_a, m_b, l_a, l_b, alpha_a, alpha_b

    @cuda.jit(device=True, inline=True)
    def turn(smem, q_empty, n, stage, phase, prev, c, desc_q, t, k_end_a, k_end_b, scale, s, p_frag, acc, m_a, m_b, l_a,
             l_b, alpha_a, alpha_b, may_mask, last, context):
        """A consumer's step through its tiles: tile n >= 1 of a query block, in ring stage `stage`
        (`phase`: the parity of this use of it), tile n - 1 in stage `prev`: wait for it, take the
        turn (S of tile n, P·V of tile n - 1), the softmax of tile n; returns the rows' new m_i, l_i
        and alpha. `last`: tile n is the last this warpgroup computes S of, so its Q is released
        (q_empty: this consumer's barrier) as soon as that S is done. (Phase 14 walks a list: n is
        then the key block of the list's next tile, and "tile n - 1" the list's tile before it.)"""
        full, empty, _, _ = barriers(smem)
        wait(full + 8 * stage, phase)  # tile n has landed
        desc_k = descriptor(smem + RING_OFF + stage * STAGE_BYTES, 16, GROUP, SW128)
        desc_v = descriptor(smem + RING_OFF + prev * STAGE_BYTES + KV_BYTES, KV_ATOM, GROUP, SW128)

        # -- this warpgroup's turn: S of tile n, and P·V of tile n - 1
        if TURNS:
            bar_sync(uint32(TURN + c), uint32(TURN_THREADS))
        if OVERLAP:  # both issued, neither awaited: S first, so that it is the first to finish
            s_tile = qk_issue(desc_q, desc_k)
            if not RESCALE_LATE:
                rescale_rows(acc, NO, alpha_a, alpha_b)
            p_prev = as_tuple(p_frag, N_P)  # read by the tensor cores until wait_o
            o_tile = pv_acc_issue(p_prev, desc_v, as_tuple(acc, N_O))
        else:
            add_pv(acc, p_frag, desc_v, alpha_a, alpha_b)
            s_tile = qk(desc_q, desc_k)
        if TURNS:
            bar_arrive(uint32(TURN + (c + 1) % CONSUMERS), uint32(TURN_THREADS))  # the next one's turn
        if OVERLAP:
            s_tile = wait_s(s_tile)  # S is done; P·V of tile n - 1 runs on under the softmax
        else:
            arrive(empty + 8 * prev)  # tile n - 1 is used up: its stage may be refilled
        if RELEASE_Q_EARLY and last:  # Q is not read again: the next block's may load under this softmax
            arrive(q_empty)
        store_tuple(s, s_tile)
        apply_mods(s, context, n, t, scale, may_mask)
        m_a, m_b, l_a, l_b, alpha_a, alpha_b = softmax_tile(s, n * BLOCK_N, t, k_end_a, k_end_b,
                                                            softmax_scale(scale), m_a, m_b, l_a, l_b, may_mask)
        if OVERLAP:
            store_tuple(acc, wait_o(p_prev, o_tile))  # P·V of tile n - 1 is done
            arrive(empty + 8 * prev)
        if RESCALE_LATE:  # tile n's alpha, applied now that O holds tiles 0 .. n - 1; tile 0's never
            # is (first_tile): O is zero there
            rescale_rows(acc, NO, alpha_a, alpha_b)
        # P's fragments after the wait: tile n - 1's are read by the tensor cores until then, and
        # the assembler gives tile n's the same registers
        pack_a(p_frag, s)
        return m_a, m_b, l_a, l_b, alpha_a, alpha_b

    return first_tile, turn, add_pv


def make_consumer(L, dtype="float16", build=None, varlen=False, hooks=None, walk=None):
    """consumer(...): a consumer warpgroup, query block after query block. hooks: the kernel's
    barrier waits and trace marks (tracing.wait_hooks); walk: which key tiles a query block visits,
    and the mods on their scores (Walk)."""
    VARLEN = varlen
    wait, bar_sync, trace_mark, trace_save = hooks
    pack = ptx.function("mma_sync.ptx", f"flashcore_pack_{PTX_TYPE[dtype]}x2", "inline")
    st_global_v4 = ptx.function("store.ptx", "flashcore_st_global_v4", "inline")  # one STG.E.128
    # 16-byte stores (common.py), of O's columns only
    store_rows, store_rows_at = fragment_epilogue_16b(pack, L["NO"], st_global_v4, L["N_OUT"])
    fence_proxy_async = ptx.function("wgmma.ptx", "flashcore_fence_proxy_async", "inline")
    arrive = ptx.function("tma.ptx", "flashcore_mbarrier_arrive", "inline")
    bar_arrive = ptx.function("warpgroup.ptx", "flashcore_bar_arrive", "inline")
    descriptor, global_address = operands.matrix_descriptor, operands.global_address
    SW128 = operands.SWIZZLE_128B
    advance, _ = make_ring(L)
    first_tile, turn, add_pv = make_turns(L, dtype, build, hooks, walk)
    MODS, listed, tile_at, unmasked = walk.mods, walk.listed, walk.tile_at, walk.unmasked
    V_DIM, BLOCK_M, BLOCK_N = L["V_DIM"], L["BLOCK_M"], L["BLOCK_N"]
    CONSUMERS, PASS_UNSEEN = L["CONSUMERS"], L["PASS_UNSEEN"]
    TILE_BYTES, RING_OFF, STAGE_BYTES = L["TILE_BYTES"], L["RING_OFF"], L["STAGE_BYTES"]
    KV_BYTES, KV_ATOM, NT, KP, NO = L["KV_BYTES"], L["KV_ATOM"], L["NT"], L["KP"], L["NO"]
    INFO = L["INFO_OFF"] // 4  # the info slots (two words per consumer), in words of smem_h
    Q_WG_WORDS = TILE_BYTES // 4
    TURNS, RELEASE_Q_EARLY, UNIFORM_C = build.turns, build.release_q_early, build.uniform_c

    @cuda.jit(device=True, inline=True)
    def block_rows(row0, c, warp, g, seq_q, seq_k, causal):
        """This warpgroup's share of the query block from row0: the block's tiles (n_tiles), the
        lane's rows a and b and the keys each sees (k_end), and the tiles its rows see (n_mine)."""
        block_k_end = key_end(min(row0 + BLOCK_M, seq_q) - 1, seq_q, seq_k, causal)
        n_tiles = (block_k_end + BLOCK_N - 1) // BLOCK_N
        row_a = row0 + c * WG_M + warp * 16 + g
        row_b = row_a + 8
        k_end_a = key_end(min(row_a, seq_q - 1), seq_q, seq_k, causal)
        k_end_b = key_end(min(row_b, seq_q - 1), seq_q, seq_k, causal)
        n_mine = n_tiles  # the tiles this warpgroup's rows see: its last row sees the most keys
        if PASS_UNSEEN:
            last = min(row0 + c * WG_M + WG_M, seq_q) - 1
            n_mine = (key_end(last, seq_q, seq_k, causal) + BLOCK_N - 1) // BLOCK_N
            if row0 + c * WG_M >= seq_q:  # rows all past the last query row (the last block of a
                n_mine = 0  # head when BLOCK_M does not divide S_q): nothing to compute
        return n_tiles, row_a, row_b, k_end_a, k_end_b, n_mine

    @cuda.jit(device=True, inline=True)
    def pass_unseen(full, empty, n_mine, n_tiles, stage, phase, c):
        """-- tiles no row of this warpgroup sees (n_mine .. n_tiles - 1): pass the turn, free the
        stage; returns the ring position after them."""
        for n in range(n_mine, n_tiles):
            if TURNS:
                bar_sync(uint32(TURN + c), uint32(TURN_THREADS))
                bar_arrive(uint32(TURN + (c + 1) % CONSUMERS), uint32(TURN_THREADS))
            # not read, but waited for: without turns (09-ws) nothing else keeps a consumer from
            # running a whole ring ahead, and an arrival for the stage's next use would count
            # towards this one
            wait(full + 8 * stage, phase)
            arrive(empty + 8 * stage)
            stage, phase = advance(stage, phase)
        return stage, phase

    @cuda.jit(device=True, inline=True)
    def store_block(O, LSE, b, h, n_heads, q_first, row_a, row_b, seq_q, t, acc, m_a, m_b, l_a, l_b):
        """-- epilogue (common.py): phase 08's sums over the quad and o = acc / l_i, then a transpose
        within the quad and one 16-byte store per 8 columns; the other consumers' turns go on
        meanwhile, and the producer loads the next block. Then each row's log-sum-exp, when LSE has
        rows (return_lse)."""
        if VARLEN:  # O (1, total_q, H, D / 2) and LSE (1, H, total_q): the sequence's rows from q_first
            store_rows_at(global_address(O) + uint64((q_first * n_heads + h) * V_DIM * 2),
                          uint64(n_heads * V_DIM * 2), row_a, row_b, seq_q, t, acc, l_a, l_b)
            if LSE.shape[2] != 0:
                store_lse(LSE, 0, h, q_first + row_a, q_first + row_b, q_first + seq_q, t, l_a, l_b, m_a, m_b)
        else:
            store_rows(O, b, h, row_a, row_b, seq_q, t, acc, l_a, l_b)
            if LSE.shape[2] != 0:  # return_lse: each row's log-sum-exp too (common.py)
                store_lse(LSE, b, h, row_a, row_b, seq_q, t, l_a, l_b, m_a, m_b)

    @cuda.jit(device=True, inline=True)
    def consumer(smem_h, smem, full, empty, q_full, q_empty, O, LSE, causal, qk_scale, counter, tid, wg, n_heads,
                 seq_q, seq_k, CU_Q, CU_K, total_k, lists):
        """A consumer warpgroup: for each query block the producer announces in its info slot, its
        64 rows of O. Tile 0's S alone, then a turn per tile (the loop without masks, then the one
        with), the tiles its rows never see passed, the last tile's P·V, and the epilogue."""
        trace_mark(1)
        # c is the same for the 128 threads of a warpgroup, but the assembler cannot tell that from
        # tid // 128: broadcast from lane 0, it is warp-uniform to ptxas, and so are the loop bounds
        # and ring addresses computed from it. Without this the tile loops below (whose bounds
        # depend on c) spilled at D = 64, and the loop of the masked tiles was left out there.
        # 09-turns keeps tid // 128 (Build.uniform_c says why)
        c = wg - 1
        c_uniform = cuda.shfl_sync(FULL_MASK, c, 0)
        if UNIFORM_C:
            c = c_uniform
        warp = (tid % 128) // 32
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        s = cuda.local.array((NT, 4), float32)
        p_frag = cuda.local.array((KP, 4), uint32)
        acc = cuda.local.array((NO, 4), float32)
        scale = max(abs(qk_scale), float32(1e-30))
        # this consumer's Q, its pair of Q barriers and its info slot: addressed through the uniform
        # index in 09-turns too (with tid // 128 they took it 32 to 40 B of local memory)
        desc_q = descriptor(smem + c_uniform * TILE_BYTES, 16, GROUP, SW128)
        q_full = q_full + 8 * c_uniform
        q_empty = q_empty + 8 * c_uniform
        info = INFO + 2 * c_uniform
        if TURNS and c == CONSUMERS - 1:
            bar_arrive(uint32(TURN), uint32(TURN_THREADS))  # consumer 0 takes the first turn

        stage = uint32(0)  # the ring position of the next tile, counted as the producer counts it
        phase = uint32(0)
        q_uses = 0
        while True:  # one query block after the other, as the producer announces them
            wait(q_full, uint32(q_uses % 2))
            q_uses += 1
            row0 = int32(smem_h[info])
            if row0 < 0:
                break
            trace_mark(3)
            bh = smem_h[info + 1]
            b = bh // uint32(n_heads)
            h = bh % uint32(n_heads)
            if VARLEN:  # the block's sequence: its rows from q_first, its own lengths (clamped as the producer's)
                q_first, seq_q = packed_span(CU_Q, b, O.shape[1])
                _, seq_k = packed_span(CU_K, b, total_k)
            else:
                q_first = 0
            n_tiles, row_a, row_b, k_end_a, k_end_b, n_mine = block_rows(row0, c, warp, g, seq_q, seq_k,
                                                                         causal)
            count, where = listed(lists, bh, n_heads, row0, n_tiles)
            if MODS:  # phase 14: the tiles of the block mask's list, every consumer each of them
                n_tiles = count
                n_mine = count
            context = (lists, where, b, h, row_a, seq_q, seq_k)  # what the mods read (phase 14)
            zero_tiles(acc, NO)
            m_a = float32(-math.inf)
            m_b = float32(-math.inf)
            l_a = float32(0.0)
            l_b = float32(0.0)
            alpha_a = float32(1.0)  # the rescale of the previous tile, applied before its P·V is added
            alpha_b = float32(1.0)

            if qk_scale < 0:  # flip the sign of this warpgroup's Q, once (phase 07's trick)
                for i in range(Q_WG_WORDS // 128):  # unsigned indices: see the epilogue
                    smem_h[uidx(c * Q_WG_WORDS + tid % 128) + uidx(i * 128)] ^= uint32(0x80008000)
                fence_proxy_async()
                bar_sync(uint32(WG_SYNC + c), uint32(128))

            prev = stage  # the stage of the tile before (of the last tile, after the loops)
            if n_mine > 0:  # -- tile 0: S alone, there is no P·V before it
                m_a, m_b, l_a, l_b, alpha_a, alpha_b = first_tile(
                    smem, full, q_empty, stage, phase, c, desc_q, t, k_end_a, k_end_b, scale, s, p_frag, m_a,
                    m_b, l_a, l_b, n_mine, tile_at(lists, where, 0), context)
                prev = stage
                stage, phase = advance(stage, phase)

            # Tiles 1 .. n_full - 1 need no mask for any row of this warpgroup (its first row sees the
            # fewest keys): their softmax is compiled without the masking and its branches, one
            # straight path from the issue of the products to their waits, and the tiles that cross
            # the causal diagonal or the end of the keys follow in a loop of their own
            n_full = min(key_end(min(row0 + c * WG_M, seq_q - 1), seq_q, seq_k, causal) // BLOCK_N, n_mine)
            if MODS:  # (phase 14) the list's tiles that need no mask come first
                n_full = unmasked(lists, where)
            for i in range(1, n_full):
                n = tile_at(lists, where, i)
                m_a, m_b, l_a, l_b, alpha_a, alpha_b = turn(smem, q_empty, n, stage, phase, prev, c, desc_q, t, k_end_a,
                                                            k_end_b, scale, s, p_frag, acc, m_a, m_b, l_a, l_b,
                                                            alpha_a, alpha_b, False, i == n_mine - 1, context)
                prev = stage
                stage, phase = advance(stage, phase)
            for i in range(max(n_full, 1), n_mine):
                n = tile_at(lists, where, i)
                m_a, m_b, l_a, l_b, alpha_a, alpha_b = turn(smem, q_empty, n, stage, phase, prev, c, desc_q, t, k_end_a,
                                                            k_end_b, scale, s, p_frag, acc, m_a, m_b, l_a, l_b,
                                                            alpha_a, alpha_b, True, i == n_mine - 1, context)
                prev = stage
                stage, phase = advance(stage, phase)
            stage, phase = pass_unseen(full, empty, n_mine, n_tiles, stage, phase, c)
            if not RELEASE_Q_EARLY or n_mine == 0:  # every S of this block is done (here: none)
                arrive(q_empty)

            if n_mine > 0:  # -- the last tile's P·V (outside the turns: nobody is left to wait for it)
                desc_v = descriptor(smem + RING_OFF + prev * STAGE_BYTES + KV_BYTES, KV_ATOM, GROUP, SW128)
                add_pv(acc, p_frag, desc_v, alpha_a, alpha_b)
                arrive(empty + 8 * prev)

            store_block(O, LSE, b, h, n_heads, q_first, row_a, row_b, seq_q, t, acc, m_a, m_b, l_a, l_b)

        if TURNS and c == 0:
            # the last consumer opened one turn more than consumer 0 took (its first arrival): take
            # it, so that no barrier is left half-arrived when the block exits
            bar_sync(uint32(TURN), uint32(TURN_THREADS))
        trace_save(counter)

    return consumer


def build_kernel(L, dtype="float16", build=BUILDS[None], varlen=False, walk=None) -> KernelConfig:
    """The kernel of layout L, with the ideas `build` (a Build) names. Its roles are functions of
    their own, above: the softmax of a tile (make_softmax_tile, as in phase 08), the ring's position
    (make_ring), the work scheduler (make_scheduler: which query block comes next), the producer
    (make_producer: TMA loads of Q, K and V), a consumer's turns (make_turns) and the consumer
    (make_consumer: the products, the softmax, the epilogue). Here they are wired together: `attend`
    sets up the barriers and hands warpgroup 0 to the producer and the others to the consumer.
    build.trace: the diagnostic build of phases/tracing.py, every barrier wait timed
    (docs/tuning/09_history.md); it computes what the plain build computes. With `varlen`, the same
    kernel on sequences of their own lengths packed end to end
    (flashcore_numba.inference.attention_varlen, as phase 07's): a unit past its sequence's rows is
    passed over, and each sequence's rows are found from its offsets (the branches on VARLEN).
    walk: phase 14's (p14_flex.py), the tiles of a block mask and the user's mods; the kernel then
    takes the block mask's lists and the mods' arrays after the counter."""
    VARLEN = varlen
    walk = plain_walk() if walk is None else walk
    mbar_init = ptx.function("tma.ptx", "flashcore_mbarrier_init", "inline")
    fence_mbar_init = ptx.function("tma.ptx", "flashcore_fence_mbarrier_init", "inline")
    regs_inc = ptx.function("warpgroup.ptx", f"flashcore_setmaxnreg_inc_{L['CONSUMER_REGISTERS']}", "inline")
    regs_dec = ptx.function("warpgroup.ptx", "flashcore_setmaxnreg_dec_24", "inline")
    shared_address = operands.shared_address
    BLOCK_M, STAGES, CONSUMERS = L["BLOCK_M"], L["STAGES"], L["CONSUMERS"]
    CONSUMER_THREADS = 128 * CONSUMERS
    LAUNCH_BOUNDS = L["LAUNCH_BOUNDS"]
    # the barrier waits, timed in the trace build (tracing.py; docs/tuning/09_history.md), and the
    # trace's marks, which compile to nothing in every other build
    wait, bar_sync, trace_mark, trace_save, SMEM_BYTES = wait_hooks(
        ptx.function("tma.ptx", "flashcore_mbarrier_wait", "inline"),
        ptx.function("warpgroup.ptx", "flashcore_bar_sync", "inline"), build.trace, L["SMEM_BYTES"],
        L["BARS_OFF"], STAGES, CONSUMERS)
    hooks = (wait, bar_sync, trace_mark, trace_save)
    TAIL_OFF = (SMEM_BYTES + 7) // 8 * 8  # (varlen) the producer's own barrier, last (load_kv_alone)
    if VARLEN:
        SMEM_BYTES = TAIL_OFF + 8
    _, barriers = make_ring(L)
    producer = make_producer(L, varlen, hooks, TAIL_OFF, walk)
    consumer = make_consumer(L, dtype, build, varlen, hooks, walk)

    # ---------------- the kernel: warpgroup 0 produces, the others consume --------------------------
    @cuda.jit(device=True, inline=True)
    def attend(Q, K, V, O, LSE, causal, qk_scale, maps, counter, CU_Q, CU_K, max_seqlen_q, lists):
        """The whole of one block's work (the kernels below only name their arguments)."""
        smem_h = cuda.shared.array(0, uint32, alignment=1024)
        smem_d = cuda.shared.array(0, uint64)  # the same memory in 8-byte words (load_kv_alone's stores)
        smem = shared_address(smem_h)
        full, empty, q_full, q_empty = barriers(smem)
        if VARLEN:  # (1, total, heads, D); the lengths are each sequence's, read per query block
            n_heads = Q.shape[2]
            seq_q = max_seqlen_q
            seq_k = max_seqlen_q
        else:
            n_heads = Q.shape[1]
            seq_q = Q.shape[2]
            seq_k = K.shape[2]
        tid = cuda.threadIdx.x
        wg = tid // 128

        if tid == 0:  # one thread sets the barriers up; the block barrier publishes them
            for i in range(CONSUMERS):
                mbar_init(q_full + 8 * i, uint32(1))
                mbar_init(q_empty + 8 * i, uint32(128))  # consumer i's threads
            for s in range(STAGES):
                mbar_init(full + 8 * s, uint32(1))  # the producer's arrival (and the TMA bytes)
                mbar_init(empty + 8 * s, uint32(CONSUMER_THREADS))  # every consumer thread's
            if VARLEN:
                mbar_init(smem + TAIL_OFF, uint32(1))  # the producer's own (load_kv_alone)
            fence_mbar_init()
        cuda.syncthreads()
        trace_mark(0)

        if wg == 0:  # the producer's warpgroup: one thread streams the tiles, all give registers back
            regs_dec()
            if tid == 0:
                producer(smem_h, smem, smem_d, full, empty, q_full, q_empty, Q, K, causal, maps, counter, n_heads,
                         seq_q, seq_k, CU_Q, CU_K, lists)
            return
        regs_inc()  # the consumers take those registers
        consumer(smem_h, smem, full, empty, q_full, q_empty, O, LSE, causal, qk_scale, counter, tid, wg, n_heads,
                 seq_q, seq_k, CU_Q, CU_K, K.shape[1], lists)

    def kernel(Q, K, V, O, LSE, causal, qk_scale, maps, counter):
        attend(Q, K, V, O, LSE, causal, qk_scale, maps, counter, counter, counter, 0, counter)  # (no offsets: unread)

    def kernel_varlen(Q, K, V, O, LSE, causal, qk_scale, maps, counter, CU_Q, CU_K, max_seqlen_q):
        attend(Q, K, V, O, LSE, causal, qk_scale, maps, counter, CU_Q, CU_K, max_seqlen_q, counter)

    def kernel_mods(Q, K, V, O, LSE, causal, qk_scale, maps, counter, KV_COUNT, KV_INDEX, KV_KIND, score_args,
                    mask_args):  # phase 14's: the block mask's lists and the mods' arrays
        attend(Q, K, V, O, LSE, causal, qk_scale, maps, counter, counter, counter, 0,
               (KV_COUNT, KV_INDEX, KV_KIND, score_args, mask_args))

    entry = kernel_mods if walk.mods else (kernel_varlen if VARLEN else kernel)
    if simulator_enabled():
        compiled = cuda.jit(entry)
    else:  # 384 threads, one block per SM: ptxas budgets 168 registers per thread, which setmaxnreg
        # then moves from the producer to the consumers (see ptx/warpgroup.ptx)
        compiled = cuda.jit(launch_bounds=LAUNCH_BOUNDS)(entry)
    return KernelConfig(compiled, block_m=BLOCK_M, n_threads=L["N_THREADS"], smem_bytes=SMEM_BYTES,
                        packed_output=True, out_alignment=16, lse=True,  # 16-byte stores (ptx/store.ptx)
                        tma_box=(1, WG_M, 64), launch_bounds=LAUNCH_BOUNDS,
                        work_units=partial(work_units, block_m=BLOCK_M), persistent=build.persistent, varlen=VARLEN)


@lru_cache(maxsize=None)
def build(HEAD_DIM: int, variant: str | None = None, dtype: str = "float16", varlen: bool = False,
          value_dim: int | None = None) -> KernelConfig:
    """The kernel for head dim HEAD_DIM and `dtype`; `variant` "ws" (no turns), "turns" (no overlap) or
    "overlap" (not persistent: one block per query block); with `varlen`, on packed sequences
    (flashcore_numba.inference.attention_varlen); with `value_dim`, V and O of that head dim
    (runs_value_dim: MLA's 128 beside 192)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: phase 09 builds {' and '.join(DTYPES)}, not {dtype!r}")
    if variant not in (None, *VARIANTS):
        raise ValueError(f"variant: expected None or one of {', '.join(VARIANTS)}, got {variant!r}")
    if not runs_head_dim(HEAD_DIM):
        raise ValueError(f"head dim: phase 09 builds {HEAD_DIMS_TEXT}, not {HEAD_DIM!r}")
    value_dim = None if value_dim == HEAD_DIM else value_dim
    if value_dim is not None:
        if not runs_value_dim(HEAD_DIM, value_dim):
            raise ValueError(f"value head dim: phase 09 takes v's head dim of its own where q's needs the "
                             f"192- or 256-column tiles and v's is 128 columns or more but no wider, not "
                             f"{value_dim} beside {HEAD_DIM}")
    return build_kernel(layout(HEAD_DIM, value_dim), dtype, BUILDS[variant], varlen)

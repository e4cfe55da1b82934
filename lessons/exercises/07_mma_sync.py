# Exercise 07: FlashAttention-2: mma.sync fragments in registers
#
# This is the finished phase 07 kernel with 2 marked regions emptied:
#   07-a: the row maxima m_ij_a, m_ij_b over the quad of lanes that hold the rows
#   07-b: p_frag[mt, kk, a0..a3] = pack(x, y) of s[mt]: rows g, g+8 of n-tile 2kk, then of 2kk+1
# Write the missing lines between each `# >>> exercise` line and its `# <<< exercise` line.
# Change nothing else: solving only adds lines. The docstring below is the lesson.
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

What changed from phase 06
    The scores never leave the registers. The tensor cores are driven one `mma.sync.m16n8k16`
    at a time, inline (no call), and mma.sync's fragment layout is documented: lane l holds
    rows l/4 and l/4 + 8 of every accumulator tile, columns 2(l%4) and 2(l%4)+1. So:
    - Q is read from shared memory into A fragments (`ldmatrix`): once, before the loop, when
      they fit in registers (D = 64), else again at every k-step (D = 128, as FlashAttention-2);
    - S = Q·Kᵀ accumulates in registers, K's B fragments read by `ldmatrix`;
    - the online softmax runs on those accumulators: a row's max and sum are two shuffles
      inside the quad of lanes that hold it (xor 1, xor 2), nothing goes to shared memory;
      the scale is folded into the exponent, exp2(s * qk_scale - m_i): one FFMA and one
      MUFU.EX2 per score (ptx/exp2.ptx: Numba's math.exp2 costs three instructions more);
    - P is converted in registers from S's accumulator layout to A fragments (two fp32 ->
      one fp16x2 register: the C layout of two n-tiles is the A layout of one k-step);
    - O += P·V accumulates in registers, V's B fragments read by `ldmatrix.trans`;
    - a warp owns M_TILES m-tiles of 16 rows (FlashAttention-2 gives each warp 32 rows), so
      that every K or V fragment it reads feeds M_TILES products: half the ldmatrix traffic per
      product, and two independent chains of mma and of softmax to interleave. The kernel runs
      128 rows in four warps of two m-tiles, with 64 keys per tile at D = 64 (242 registers)
      and 48 at D = 128 (255: with 64 keys it spills). The simulator runs one warp of two;
    - the k-steps of both products are unrolled when the kernel is built (`unrolled`): NVVM
      left a k-loop of 16 mma.sync per step rolled, each ldmatrix waiting just before its mma;
    - a tile's scores are one block of straight-line code from the products to one vote: the
      mask is one branch around the whole tile, and the warp votes once for all its m-tiles;
    - the running max moves lazily: a warp rescales acc and l_i only when one of its rows' max
      has grown by more than LAZY = 8 (log2 units) since m_i was set; until then p = exp2(s -
      m_i) <= 256, and acc and l_i share the stale m_i, so o = acc / l_i is unchanged.
    K and V arrive by `cp.async`: 16-byte copies from global to shared memory that no
    register waits for, into the other of two stages while the current tile is computed;
    rows past the end of the sequence are zero-filled by the copy itself. Causal tiles above
    the diagonal are skipped; only tiles that cross it are masked. K/V heads may be fewer
    than Q heads (grouped-query attention): head h reads K/V head h // (H_q / H_kv).
    bf16 is the same kernel with the bf16 mma and conversions: the kernel never does
    arithmetic on 16-bit values itself, it only moves their bits to the tensor cores. The
    output is packed as the P fragments are and written 16 bytes at a time (below).

Why the hardware rewards it
    Phase 06 spent most of its time outside the tensor cores: storing S, reading it back
    for the softmax, writing P, storing and re-reading O. Here a tile costs its `mma`s, a
    few shuffles and exp2s per row, and the shared-memory reads of K and V by `ldmatrix`
    (one instruction fetches four 8×8 fragments for the warp). That last cost is why a warp
    could take two m-tiles: an ldmatrix.x4 brings 512 bytes for two products of 16 x 8 x 16,
    2 cycles of shared memory (128 bytes per cycle per SM) per product, and at half their rated
    ~1,000 TFLOPS (docs/hardware.md) the tensor cores finish a product every 2 cycles per SM.
    Measured, the registers decide first. At D = 64 (quick timings of tools/sweep_tiles.py 07,
    10 launches, no L2 flush; TFLOPS non-causal / causal): 128 rows in 8 warps of one m-tile
    242 / 191, in 4 warps of two m-tiles 233 / 178 (255 registers and 16 B of local memory per
    thread on the GPU), 64 rows in 4 warps 214 / 173. At D = 128 two m-tiles do not fit in 255
    registers at all; 64 rows in 4 warps 246 / 208 beat 128 rows in 8 warps, 232 / 196.
    The records of commit bc3c341 below against those of 38aa92d (64 rows in 4 warps at D = 64,
    Numba's math.exp2): D = 64 fp16 231 -> 269 TFLOPS, causal 203 -> 229 (exp2 and 8 warps);
    D = 128 255 -> 257, causal 220 -> 224 (exp2 alone). Still short of torch SDPA's flash
    backend in the same runs: 298 / 262 at D = 64, 354 / 304 at D = 128. The bf16 D = 128 and
    grouped-query records below are of commit 7d1070b (the kernels of bc3c341): bf16 D = 128
    251 -> 259, causal 220 -> 226; grouped queries 236 -> 279, causal 209 -> 239 (SDPA flash there:
    307 / 276).
    Why still short, from Nsight Compute beside SDPA flash's kernel at D = 128
    (docs/tuning/07_ncu_vs_sdpa_flash.txt): FA2 runs 128 rows in 4 warps, two m-tiles per warp,
    so every K or V fragment an ldmatrix brings feeds two products, and each block reads K and V
    for twice as many rows; 07 reads K/V for 64 rows and feeds one product per fragment, and its
    L2 throughput is 70 % against FA2's 31 %, its tensor pipe 40 % busy against 56 %. FA2 fits
    its layout in 255 registers by reading Q's fragments from shared memory at every k-step
    instead of holding them. That layout was built here (Q re-read, P·V written as two loops of
    half the columns so that NVVM unrolls them) and did not fit: quick timings of
    tools/sweep_tiles.py on the H100, D = 128 128 rows in 4 warps 245 / 201 TFLOPS with 56 B of
    local memory, against 250 / 213 for this kernel; D = 64 128 rows and 128 keys in 4 warps
    215 / 179 (72 B of local memory), 128 rows and 64 keys 227 / 189 (none), against 263 / 219.
    Not kept. Nor was one branch around the masking (as phase 09 now has): here it was slower at
    D = 64, 208 against 256 (ad hoc, queued launches), and level at D = 128.
    Tried again at commit 06e04ce (docs/tuning/07_ab_layouts.txt, ad hoc, L2 flushed, interleaved
    rounds): cp.async addressed from one base per thread with 32-bit row arithmetic, which cuts
    D = 128 from 237 to 175 registers. In this kernel's layout it was slower (213 against 251
    TFLOPS); with 32 keys per tile (163 registers, three blocks per SM) level to 5 % faster, causal
    5-7 % faster, over three runs; FlashAttention-2's layout with it spilled 52 B and ran level (258
    against 259), and without spills at D = 64 slower (231 against 273). SDPA flash ran 333-348 in
    the same runs. Not kept: no variant came near it.
    The epilogue of phase 09 (commit b30c6d2, its records against those of d5d15af;
    common.fragment_epilogue_16b, ptx/store.ptx). Until then each output element was divided by l_i
    (an IEEE division, a subroutine with a slow path: 64 per thread at D = 128) and stored 4 bytes
    at a time (32 stores per thread at D = 128). Now 1 / l_i is taken once per row and multiplied
    in, and after a transpose within the quad each lane writes 16 contiguous bytes: 8 STG.E.128 per
    thread at D = 128, 4 at D = 64 (242 registers at D = 128, was 237; 128 at D = 64; no spills).
    Ad hoc A/B first (docs/tuning/07_ab_epilogue.txt; L2 flushed, interleaved rounds, each launch timed
    alone; TFLOPS, old / new, SDPA flash in the same run): D = 128 249 / 269 (334), causal 213 / 243
    (291); D = 64 271 / 265 (302), causal 226 / 228 (259). A block of 64 rows at D = 128 is short
    (32 tiles at S = 2048, two blocks per SM), so its end weighs more than at D = 64. The records:
    D = 128 fp16 260 -> 281 TFLOPS, causal 225 -> 254 (0.80x and 0.83x SDPA flash in the same runs,
    were 0.74x and 0.73x); bf16 D = 128 258 -> 279, causal 224 -> 253 (0.79x, 0.82x); D = 64 fp16
    271 -> 264, causal 230 -> 232 (0.88x, 0.88x): 2.6 % slower without a mask, as in the A/B; bf16
    D = 64 271 -> 267 (0.88x; its causal record is of d5d15af, the device time of the session ran
    out before it); grouped queries 275 -> 270, causal 236 -> 238 (0.88x, 0.87x).
    The copies of a tile (docs/tuning/07_ab_copy.txt). Nsight Compute on the kernel of 06914a1 at
    D = 128 put about 15 % of the warps' stall samples on the code that issues a tile's cp.async
    copies: each of the 16 copies clamped its row and built its address in 64-bit arithmetic, about
    ten integer instructions per copy, and some of them waited for registers that the copies issued
    just before were still reading. A tile that lies inside the sequence needs no clamp: a thread's
    copies are then at fixed offsets from one address, which the copy instruction adds itself
    (make_copy_tile); only a tile that reaches past the sequence takes the clamped path. Registers
    at D = 128 fall from 242 to 164, so 32 keys per tile now fit three blocks of 4 warps per SM
    (64 keys per tile with the new copy ran slower, 212-220 TFLOPS against 260-262, as in 06e04ce;
    not understood). Ad hoc A/B, two runs (TFLOPS, before / after, SDPA flash in the same rounds):
    D = 64 264 / 283 and 258 / 276 (300, 293), causal 232 / 246 and 224 / 239 (263, 259); D = 128
    260 / 269 and 262 / 276 (331, 329), causal 241 / 258 and 243 / 254 (294, 291).
    The records of commit 2378a60 against those of b30c6d2: D = 128 fp16 281 -> 294 TFLOPS, causal
    254 -> 271 (0.83x and 0.88x SDPA flash in the same runs); bf16 D = 128 279 -> 296, causal
    253 -> 270 (0.83x, 0.87x); D = 64 fp16 264 -> 282, causal 232 -> 248 (0.94x, 0.95x); bf16 D = 64
    267 -> 285, causal 229 -> 247 (0.94x, 0.93x; the causal one against d5d15af); grouped queries
    270 -> 291, causal 238 -> 257 (0.95x, 0.94x). Still short of SDPA flash everywhere.
    Tried on top of it and not kept (same log): Q's fragments re-read from shared memory at every
    k-step (FlashAttention-2's way to free registers; 128 registers, but slower everywhere: 245 against
    280 at D = 128); the tile's work written once and compiled twice, with and without the mask
    (slower: 273 against 295 at D = 128, and 145 registers at D = 64); two m-tiles per warp again
    (D = 64 level at best, 279 against 285; D = 128 still spills).
    The lazy maximum (commit 5d649d6; docs/tuning/07_ab_copy.txt). Until then each tile
    rescaled acc by alpha = exp2(m_old - m_new) for every row: 64 FMULs per thread and tile at
    D = 128, on the path from the row max to P·V, for a factor that is 1 for almost every tile
    once the first tiles have set the max. Now the warp votes (one `vote.any`) and rescales only
    when some row's max has grown by more than 8, which with 2048 random keys happens in the
    first tile and then almost never; a stale m_i only lets p reach 256. The same idea is in
    FlashAttention-4. It also needs fewer registers at D = 64 with 64 rows and 32 keys per tile
    (122: four blocks of 4 warps per SM). Ad hoc A/B (TFLOPS, before / after, SDPA flash in the
    same rounds): D = 128 275 / 285 (325), causal 245 / 254 (277); D = 64 with 64 rows and 32
    keys, against the 128 rows and 64 keys of before: 269 / 283 (283), causal 238 / 252 (256).
    With 128 rows the lazy kernel needed 135 registers at D = 64 (one block of 8 warps per SM)
    and ran at 187.
    Records of 5d649d6 against those of 2378a60, three of the ten: D = 64 fp16 282 -> 286 TFLOPS,
    causal 248 -> 256 (0.95x and 0.97x SDPA flash in the same runs); D = 128 fp16 294 -> 301
    (0.84x). The other seven are of commit ebff494, whose kernel is that of 5d649d6: D = 128 fp16
    causal 271 -> 278 (0.91x); bf16 D = 128 296 -> 300, causal 270 -> 277 (0.85x, 0.90x); bf16
    D = 64 285 -> 287, causal 247 -> 258 (0.95x, 0.98x); grouped queries 291 -> 293, causal
    257 -> 268 (0.95x, 0.97x).
    Where the rest of the gap to SDPA flash lies (docs/tuning/07_ab_smem.txt, Nsight Compute at
    D = 128 with stall sampling): per 16 x 8 x 16 product this kernel moves 2.2 shared-memory
    wavefronts against FlashAttention-2's 1.3, because each warp reads a whole K and V tile for one
    m-tile, and its warps wait on shared memory (short scoreboard, 24 % of the stall samples
    against 7 %) where FA2's wait on the tensor pipe. Tried on the kernel of 5d649d6 and not kept
    (same log): two m-tiles per warp with Q's fragments re-read (FA2's layout; 255 registers and
    local memory here, 282 against 295 TFLOPS); three cp.async stages (level); blocks of 8 to 16
    warps, one per SM, which read K and V once for 128-256 rows (10-30 % slower); copies at
    immediate offsets of one address (level), or with their addresses carried from tile to tile
    (slower).
    FlashAttention-2's tiles at D = 64 (commit 86fdb12). With the kernel's copy and lazy maximum, 128
    rows in four warps of two m-tiles (Q's fragments still held: 2 m-tiles x 4 k-steps x 4 = 32
    registers), 64 keys per tile, 242 registers, no local memory: each K or V fragment feeds two
    products, and each block reads K and V for twice the rows. Ad hoc A/Bs, three runs
    (tools/ab_variants.py; TFLOPS, 64x32 / 128x64, SDPA flash in the same rounds): 281 / 294 (297), 279
    / 289 (290), 279 / 294 (294); causal 252 / 250 (260), 251 / 250 (259), 251 / 251 (260). The records
    of 86fdb12 against those of 5d649d6 / ebff494: D = 64 fp16 286 -> 297 TFLOPS, causal 256 -> 254
    (0.98x and 0.96x SDPA flash in the same runs); bf16 D = 64 287 -> 296, causal 258 -> 256 (0.98x,
    0.96x); grouped queries 293 -> 301, causal 268 -> 263 (0.98x, 0.96x). Faster without a mask, 1-2 %
    slower with one; likely (not measured) because a block of 128 rows computes twice the masked scores
    on the diagonal, and its last blocks are twice as long. The first fp16 causal record of this commit
    had launches from 0.54 to 1.49 ms (median 171 TFLOPS); a check on the same machine right after (40
    launches per kernel, twice) and the re-run record kept above spread by 2 % at most. The D = 64
    sweeps of 86fdb12: 07 level with SDPA flash or ahead from S = 8192 on (312 against 309 and 311) and,
    causal, at S = 512 and 1024 (173 against 154, 220 against 216).
    At D = 128, FlashAttention-2's layout again (docs/tuning/07_ab_unroll.txt): 128 rows and 64 keys,
    two m-tiles, Q read again at every k-step. Nsight Compute showed why it had run level: NVVM left its
    Q·Kᵀ k-loop rolled (8 steps of 16 products, each mma waiting on the ldmatrix just before it, short
    scoreboard and a branch per step). Unrolled at build time (a chain of inlined calls, one per k-step)
    it ran 307 against 296 TFLOPS (SDPA flash 342), causal 282 against 275 (299), bf16 325 against 302
    (349), causal 284 against 277 (302), but at 255 registers it keeps 24-36 B in local memory (32 B on
    the GPU), which this phase forbids (the spill test). Unrolled four k-steps at a time (a loop of
    two), it compiles here without spills, but the GPU's own compiler still keeps 32 B in local memory
    (303 against 292, causal 265 against 267; bf16 310 against 297, causal 271 against 270). Not kept.
    At D = 64 the same code (Q held, k-steps unrolled) ran 285 / 242 against 282 / 253 for the kernel of
    5d649d6 in its one run, where the loops kept above had run 289-294 / 250-251 against 279-281 /
    251-252. An earlier build of the D = 128 variant: 309 against 296 (SDPA flash 332), causal 272
    against 271 (295). With 48 keys per tile (docs/tuning/07_ab_unroll.txt, run 7) the GPU compiles it
    with 254 registers and no local memory and it ran 312 against 298 (SDPA flash 343), causal 273
    against 273 (289), bf16 325 against 301 (345), causal 278 against 271 (294); but nvJitLink 13.5 here
    spills 44 B of it, and the small changes that remove those spills make ptxas 13.0 (the GPU's) spill
    instead: at the edge of 255 registers, not landed.
    The scores of a tile as one block (commit 3f4f2d7; docs/tuning/07_ab_unroll.txt, run 8). Until
    then the mask was tested score by score inside the loops of the row maxima, and each m-tile had
    its own vote and branch for the lazy rescale. Now the mask is one branch around the whole tile,
    the maxima of both m-tiles come first, then one vote for the warp, then the exponentials of both
    m-tiles and the P·V products in one block of straight-line code that the assembler can schedule
    as a whole. With the unrolled k-steps above and 48 keys per tile at D = 128 it assembles to 255
    registers there with no spill under both nvJitLink 13.5 and ptxas 13.0 (242 at D = 64). Ad hoc
    A/B (TFLOPS; the kernels of 86fdb12 / unrolled with 48 keys / this; SDPA flash in the same
    rounds): D = 128 290 / 301 / 326 (331), causal 265 / 272 / 293 (290); bf16 D = 128 292 / - / 335
    (331), causal 266 / - / 290 (287); D = 64 287 / - / 323 (288), causal 250 / - / 281 (262).
    The records of 3f4f2d7 against those of 86fdb12 (D = 64) and 5d649d6 / ebff494 (D = 128): D = 64
    fp16 297 -> 334 TFLOPS, causal 254 -> 284 (1.11x and 1.07x SDPA flash in the same runs); bf16
    D = 64 296 -> 334, causal 256 -> 285 (1.10x, 1.08x); grouped queries 301 -> 345, causal 263 ->
    295 (1.12x, 1.08x); D = 128 fp16 301 -> 358, causal 278 -> 311 (1.00x, 1.01x); bf16 D = 128
    300 -> 358, causal 277 -> 309 (1.01x, 1.00x). At D = 128 the margin is within what SDPA flash
    moves between runs (331-357 over this session's runs). The sweeps of 3f4f2d7: at D = 64 phase 07
    is ahead of SDPA flash at every length, causal or not (S = 512 286 against 264, causal 185
    against 154); at D = 128 it is behind at S = 512 and 1024 (311 against 317, 336 against 341) and
    level or ahead from 2048 on; causal, ahead except at S = 8192 (336 against 340).
    Tried on top of it and not kept (same log): a warp's tiles past its own rows' keys copied but not
    computed (causal; slower at D = 64, 277 against 281, and it spills at D = 128).

Measured effect (written by `flashcore report` from the committed record; do not edit by hand)
    [measured:begin]
    NVIDIA H100 80GB HBM3, 2026-11-27, B=16 H=16 S=2048 D=64 fp16: 336 TFLOPS (4.71x 06-inline),
    causal 282 TFLOPS (4.60x 06-inline); 242 registers, 0 B local memory. At B=16 H=16 S=2048 D=128
    fp16: 07 358 TFLOPS (5.92x 06-inline), causal 311 TFLOPS (5.88x 06-inline). At B=16 H=16 S=2048
    D=64 bf16: 07 334 TFLOPS, causal 285 TFLOPS. At B=16 H=16 S=2048 D=128 bf16: 07 358 TFLOPS,
    causal 309 TFLOPS. At B=16 H=32 H_kv=8 S=2048 D=64 fp16: 07 345 TFLOPS, causal 295 TFLOPS
    (nvidia-h100-80gb-hbm3_b16h16s2048d64_fp16.json,
    nvidia-h100-80gb-hbm3_b16h16s2048d64_fp16_causal.json,
    nvidia-h100-80gb-hbm3_b16h16s2048d128_fp16.json,
    nvidia-h100-80gb-hbm3_b16h16s2048d128_fp16_causal.json,
    nvidia-h100-80gb-hbm3_b16h16s2048d64_bf16.json,
    nvidia-h100-80gb-hbm3_b16h16s2048d64_bf16_causal.json,
    nvidia-h100-80gb-hbm3_b16h16s2048d128_bf16.json,
    nvidia-h100-80gb-hbm3_b16h16s2048d128_bf16_causal.json,
    nvidia-h100-80gb-hbm3_b16h32kv8s2048d64_fp16.json,
    nvidia-h100-80gb-hbm3_b16h32kv8s2048d64_fp16_causal.json).
    [measured:end]
"""

from __future__ import annotations

import math
from functools import lru_cache

from numba import cuda, float32, int32, uint32, uint64

from flashcore_numba.arch import operands, ptx
from flashcore_numba.arch.sim import simulator_enabled
from flashcore_numba.phases.common import FULL_MASK, PTX_TYPE, KernelConfig, fragment_epilogue_16b, key_end, softmax_rescale

ID = "07"
NAME = "mma_sync"
TITLE = "FlashAttention-2: mma.sync fragments in registers"
HEAD_DIMS = (64, 128)
DTYPES = ("float16", "bfloat16")
GQA = True
MIN_CC = (8, 0)

MMA_M, MMA_N, MMA_K = 16, 8, 16  # mma.sync.m16n8k16
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


def tiles(HEAD_DIM: int) -> dict:
    return (SIM_TILES if simulator_enabled() else TILES)[HEAD_DIM]


def layout(HEAD_DIM, block_m, block_n, warps):
    """Every derived constant. Shared memory holds fp16 rows of STRIDE elements: Q (BLOCK_M rows),
    then two stages of K and V (BLOCK_N rows each); offsets are in bytes."""
    assert block_m % (MMA_M * warps) == 0 and block_n % MMA_K == 0 and HEAD_DIM % MMA_K == 0
    L = dict(HEAD_DIM=HEAD_DIM, BLOCK_M=block_m, BLOCK_N=block_n, NUM_WARPS=warps)
    L["M_TILES"] = block_m // (MMA_M * warps)  # m-tiles of 16 rows per warp
    L["WARP_ROWS"] = MMA_M * L["M_TILES"]
    L["N_THREADS"] = 32 * warps
    L["STRIDE"] = HEAD_DIM + PAD  # fp16 elements per shared-memory row
    row_bytes = L["STRIDE"] * 2
    L["Q_OFF"] = 0
    L["K_OFF"] = block_m * row_bytes
    L["V_OFF"] = L["K_OFF"] + block_n * row_bytes
    L["STAGE_BYTES"] = 2 * block_n * row_bytes  # stage s: K at K_OFF + s*STAGE_BYTES, V at V_OFF + ...
    L["SMEM_BYTES"] = L["K_OFF"] + 2 * L["STAGE_BYTES"]
    L["CHUNKS"] = HEAD_DIM // 8  # 16-byte chunks per row
    L["ROWS_PER_PASS"] = L["N_THREADS"] // L["CHUNKS"]  # rows the block's threads copy in one pass
    assert block_m % L["ROWS_PER_PASS"] == 0 and block_n % L["ROWS_PER_PASS"] == 0
    L["NT"] = block_n // MMA_N  # n-tiles of S per m-tile (8 keys each)
    L["KQ"] = HEAD_DIM // MMA_K  # k-steps of Q·Kᵀ
    # k-steps of Q fragments a lane holds: all of them for the whole loop, or the current one
    L["Q_STEPS"] = L["KQ"] if L["M_TILES"] * L["KQ"] * 4 <= Q_REGS else 1
    L["KP"] = block_n // MMA_K  # k-steps of P·V
    L["NO"] = HEAD_DIM // MMA_N  # n-tiles of O (8 columns each)
    return L


def make_copy_tile(L):
    """Global -> shared by cp.async, 16 bytes per copy, consecutive threads on consecutive chunks."""
    copy16 = ptx.function("cp_async.ptx", "flashcore_cp_async_16", "inline")
    CHUNKS, STRIDE, ROWS_PER_PASS = L["CHUNKS"], L["STRIDE"], L["ROWS_PER_PASS"]
    ROW_BYTES = STRIDE * 2  # a row in shared memory; in global memory a row is CHUNKS * 16 bytes

    @cuda.jit(device=True, inline=True)
    def copy_tile(smem, offset, src_base, head_bytes, row0, n_rows, seq_len, tid):
        """Start copying rows row0 .. row0+n_rows-1 of one head (at src_base + head_bytes) to smem+offset.

        Thread tid copies chunk tid % CHUNKS of rows tid // CHUNKS, + ROWS_PER_PASS, + 2 ROWS_PER_PASS...
        A tile that lies inside the sequence needs no check: each copy is at a fixed offset from one
        address, which the copy instruction adds itself. In the last tile a row past seq_len copies
        0 bytes and is zero-filled (its address is clamped to a real row).
        """
        r, chunk = tid // CHUNKS, tid % CHUNKS
        src = src_base + head_bytes + uint64(chunk * 16)
        dst = smem + offset + r * ROW_BYTES + chunk * 16
        if row0 + n_rows <= seq_len:
            src += uint64(row0 + r) * uint64(CHUNKS * 16)
            for i in range(n_rows // ROWS_PER_PASS):
                copy16(dst + i * ROWS_PER_PASS * ROW_BYTES, src + uint64(i * ROWS_PER_PASS * CHUNKS * 16),
                       uint32(16))
        else:
            for i in range(n_rows // ROWS_PER_PASS):
                row = row0 + r + i * ROWS_PER_PASS
                n_bytes = uint32(16) if row < seq_len else uint32(0)
                row_src = src + uint64(min(row, seq_len - 1)) * uint64(CHUNKS * 16)
                copy16(dst + i * ROWS_PER_PASS * ROW_BYTES, row_src, n_bytes)

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


def build_kernel(L, dtype="float16") -> KernelConfig:
    mma = ptx.function("mma_sync.ptx", f"flashcore_mma_{PTX_TYPE[dtype]}", "inline")
    pack = ptx.function("mma_sync.ptx", f"flashcore_pack_{PTX_TYPE[dtype]}x2", "inline")
    exp2 = ptx.function("exp2.ptx", "flashcore_exp2", "inline")  # one MUFU.EX2, no subnormal fix-ups
    st_global_v4 = ptx.function("store.ptx", "flashcore_st_global_v4", "inline")  # one STG.E.128
    ldsm = ptx.function("ldmatrix.ptx", "flashcore_ldmatrix_x4", "inline")
    ldsm_t = ptx.function("ldmatrix.ptx", "flashcore_ldmatrix_x4_trans", "inline")
    commit = ptx.function("cp_async.ptx", "flashcore_cp_async_commit", "inline")
    wait_all = ptx.function("cp_async.ptx", "flashcore_cp_async_wait_0", "inline")
    shared_address, global_address = operands.shared_address, operands.global_address
    copy_tile = make_copy_tile(L)
    HEAD_DIM, BLOCK_M, BLOCK_N = L["HEAD_DIM"], L["BLOCK_M"], L["BLOCK_N"]
    M_TILES, WARP_ROWS = L["M_TILES"], L["WARP_ROWS"]
    STRIDE, K_OFF, V_OFF, STAGE_BYTES = L["STRIDE"], L["K_OFF"], L["V_OFF"], L["STAGE_BYTES"]
    NT, KQ, KP, NO, Q_STEPS = L["NT"], L["KQ"], L["KP"], L["NO"], L["Q_STEPS"]
    N_THREADS, ROW_BYTES = L["N_THREADS"], STRIDE * 2
    store_rows = fragment_epilogue_16b(pack, NO, st_global_v4)  # O in 16-byte stores (common.py)

    @cuda.jit(device=True, inline=True)
    def mma_into(c, mt, j, a, kk, b0, b1):
        """c[mt, j] += a[mt, kk] · b: one m16n8k16 product into n-tile j of m-tile mt's accumulators."""
        c[mt, j, 0], c[mt, j, 1], c[mt, j, 2], c[mt, j, 3] = mma(
            a[mt, kk, 0], a[mt, kk, 1], a[mt, kk, 2], a[mt, kk, 3], b0, b1,
            c[mt, j, 0], c[mt, j, 1], c[mt, j, 2], c[mt, j, 3])

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
            b0, b1, b2, b3 = ldsm_t(v_tile + kk * 16 * ROW_BYTES + jj * 32)
            for mt in range(M_TILES):
                mma_into(acc, mt, 2 * jj, p_frag, kk, b0, b1)
                mma_into(acc, mt, 2 * jj + 1, p_frag, kk, b2, b3)

    qk_steps = unrolled(qk_step, KQ)  # straight-line code: see unrolled above
    pv_steps = unrolled(pv_step, NO // 2)

    @cuda.jit
    def mma_attention(Q, K, V, O, causal, qk_scale):
        smem_h = cuda.shared.array(0, uint32, alignment=128)
        smem = shared_address(smem_h)
        b = cuda.blockIdx.z
        h = cuda.blockIdx.y
        h_kv = h * K.shape[1] // Q.shape[1]  # grouped-query attention: several q heads per k/v head
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4  # this lane's rows of every m-tile: g and g + 8
        t = lane % 4  # and its columns: 2t, 2t + 1 of every 8-column tile
        row0 = cuda.blockIdx.x * BLOCK_M
        warp_row0 = row0 + warp * WARP_ROWS  # the warp's M_TILES m-tiles of 16 rows start here
        seq_q = Q.shape[2]
        seq_k = K.shape[2]
        head_q = uint64(((b * Q.shape[1] + h) * seq_q) * HEAD_DIM * 2)
        head_kv = uint64(((b * K.shape[1] + h_kv) * seq_k) * HEAD_DIM * 2)

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
        copy_tile(smem, 0, global_address(Q), head_q, row0, BLOCK_M, seq_q, tid)
        copy_tile(smem, K_OFF, global_address(K), head_kv, 0, BLOCK_N, seq_k, tid)
        copy_tile(smem, V_OFF, global_address(V), head_kv, 0, BLOCK_N, seq_k, tid)
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
        # -- Q's A fragments: lane l gives row l % 16 and column 8 (l // 16) of each 16x16 block;
        # held for the whole loop when they fit (Q_STEPS == KQ), else read at every k-step
        q_warp = smem + (warp * WARP_ROWS + lane % 16) * ROW_BYTES + (lane // 16) * 16
        if Q_STEPS == KQ:
            for mt in range(M_TILES):
                for kk in range(KQ):
                    a0, a1, a2, a3 = ldsm(q_warp + mt * MMA_M * ROW_BYTES + kk * 32)
                    q_frag[mt, kk, 0], q_frag[mt, kk, 1], q_frag[mt, kk, 2], q_frag[mt, kk, 3] = a0, a1, a2, a3

        # K fragments of two n-tiles per ldmatrix: lane l gives key 8 (l // 16) + l % 8, dims 8 ((l // 8) % 2)
        k_lane = ((lane // 16) * 8 + lane % 8) * ROW_BYTES + ((lane // 8) % 2) * 16
        # V fragments (transposed) of two n-tiles: key 8 ((l // 8) % 2) + l % 8, dims 8 (l // 16)
        v_lane = (((lane // 8) % 2) * 8 + lane % 8) * ROW_BYTES + (lane // 16) * 16

        stage = 0
        for start_n in range(int32(0), block_k_end, int32(BLOCK_N)):  # 32-bit: fewer registers
            next_n = start_n + int32(BLOCK_N)
            if next_n < block_k_end:  # -- the next tile flies into the other stage meanwhile
                copy_tile(smem, K_OFF + (1 - stage) * STAGE_BYTES, global_address(K), head_kv, next_n, BLOCK_N,
                          seq_k, tid)
                copy_tile(smem, V_OFF + (1 - stage) * STAGE_BYTES, global_address(V), head_kv, next_n, BLOCK_N,
                          seq_k, tid)
                commit()
            k_tile = smem + K_OFF + stage * STAGE_BYTES + k_lane
            v_tile = smem + V_OFF + stage * STAGE_BYTES + v_lane

            # -- s = q · kᵀ in registers: KQ k-steps (qk_step)
            for mt in range(M_TILES):
                for j in range(NT):
                    for e in range(4):
                        s[mt, j, e] = float32(0.0)
            qk_steps(0, (s, q_frag, q_warp, k_tile))

            # -- mask only a tile that needs it, and in one branch for the whole tile: its scores are
            # then one block of straight-line code from the products to the vote below
            masked = start_n + BLOCK_N > k_end_min  # the tile crosses the diagonal or the end of the keys
            if masked:
                for mt in range(M_TILES):  # k_end of the two rows, computed here rather than held
                    row_a = warp_row0 + mt * MMA_M + g
                    k_end_a = key_end(min(row_a, seq_q - 1), seq_q, seq_k, causal)
                    k_end_b = key_end(min(row_a + 8, seq_q - 1), seq_q, seq_k, causal)
                    for j in range(NT):
                        col = start_n + j * MMA_N + 2 * t
                        if col >= k_end_a:
                            s[mt, j, 0] = float32(-math.inf)
                        if col + 1 >= k_end_a:
                            s[mt, j, 1] = float32(-math.inf)
                        if col >= k_end_b:
                            s[mt, j, 2] = float32(-math.inf)
                        if col + 1 >= k_end_b:
                            s[mt, j, 3] = float32(-math.inf)

            # -- raw row maxima of every m-tile, scaled (scale > 0; -inf stays -inf)
            grow = False
            for mt in range(M_TILES):
                m_ij_a = float32(-math.inf)
                m_ij_b = float32(-math.inf)
                for j in range(NT):
                    m_ij_a = max(m_ij_a, max(s[mt, j, 0], s[mt, j, 1]))
                    m_ij_b = max(m_ij_b, max(s[mt, j, 2], s[mt, j, 3]))
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
                    for j in range(NO):
                        acc[mt, j, 0] *= alpha_a
                        acc[mt, j, 1] *= alpha_a
                        acc[mt, j, 2] *= alpha_b
                        acc[mt, j, 3] *= alpha_b

            # -- p = exp2(s * scale - m_i), and the rows' partial sums (this lane's columns)
            for mt in range(M_TILES):
                # a row that has seen only masked keys is measured against 0 (see softmax_rescale)
                m_ref_a = m_a[mt] if m_a[mt] != float32(-math.inf) else float32(0.0)
                m_ref_b = m_b[mt] if m_b[mt] != float32(-math.inf) else float32(0.0)
                sum_a = float32(0.0)
                sum_b = float32(0.0)
                for j in range(NT):
                    s[mt, j, 0] = exp2(cuda.fma(s[mt, j, 0], scale, -m_ref_a))  # one FFMA, one MUFU.EX2
                    s[mt, j, 1] = exp2(cuda.fma(s[mt, j, 1], scale, -m_ref_a))
                    s[mt, j, 2] = exp2(cuda.fma(s[mt, j, 2], scale, -m_ref_b))
                    s[mt, j, 3] = exp2(cuda.fma(s[mt, j, 3], scale, -m_ref_b))
                    sum_a += s[mt, j, 0] + s[mt, j, 1]
                    sum_b += s[mt, j, 2] + s[mt, j, 3]
                l_a[mt] += sum_a
                l_b[mt] += sum_b

            # -- p as A fragments: the accumulators of n-tiles 2kk and 2kk+1 are k-step kk's A
            # >>> exercise 07-b: p_frag[mt, kk, a0..a3] = pack(x, y) of s[mt]: rows g, g+8 of n-tile 2kk, then of 2kk+1
            # <<< exercise

            # -- acc += p · v: NO n-tiles of 8 output columns, two per pv_step
            pv_steps(0, (acc, p_frag, v_tile))

            # -- the next tile has landed (this thread's copies), and every warp is done with this one
            wait_all()
            cuda.syncthreads()
            stage = 1 - stage

        # -- epilogue (common.py): the rows' sums over the quad, 1 / l_i once per row, o = acc * (1 / l_i)
        # packed in pairs, and a transpose within the quad so that each lane writes 16 bytes at once
        for mt in range(M_TILES):
            row_a = warp_row0 + mt * MMA_M + g
            store_rows(O, b, h, row_a, row_a + 8, seq_q, t, acc[mt], l_a[mt], l_b[mt])

    return KernelConfig(mma_attention, block_m=BLOCK_M, n_threads=L["N_THREADS"], smem_bytes=L["SMEM_BYTES"],
                        packed_output=True, out_alignment=16)  # 16-byte stores (ptx/store.ptx)


@lru_cache(maxsize=None)
def build(HEAD_DIM: int, dtype: str = "float16") -> KernelConfig:
    """The kernel for head dim HEAD_DIM and `dtype` ("float16" or "bfloat16")."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: phase 07 builds {' and '.join(DTYPES)}, not {dtype!r}")
    return build_kernel(layout(HEAD_DIM, **tiles(HEAD_DIM)), dtype)

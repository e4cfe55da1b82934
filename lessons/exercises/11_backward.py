# Exercise 11: The backward pass: dQ, dK and dV recomputed from the log-sum-exp
#
# This is the finished phase 11 kernel with 3 marked regions emptied:
#   11-a: Pᵀ in place of Sᵀ, from the row's saved log-sum-exp (0 for a key the row does not see); dSᵀ in place of dPᵀ
#   11-b: Δ_i = Σ_d dO_id · O_id: each lane sums its words of row i, then the warp sums the lanes
#   11-c: add this lane's four dQ values (times scale) to dQ in global memory by reductions, only in the rows that exist (row < seq_q)
# Write the missing lines between each `# >>> exercise` line and its `# <<< exercise` line.
# Change nothing else: solving only adds lines. The lesson is lessons/11_backward.ipynb.
#
# Grade it (hidden random inputs and adversarial shapes; points and reasons per check):
#     flashcore grade 11                         this file
#     flashcore grade 11 path/to/copy.py         a copy of it
#     pytest lessons/exercises --grade 11        the same checks, as pytest tests
# Without a GPU the kernel runs in Numba's CUDA simulator (slow) and the timing checks are skipped.
# Stuck? `flashcore grade 11 --hint` gives a hint per region (--hint 2, 3: more);
# the solution is flashcore_numba/phases/p11_backward.py.
#
# Generated from that file by `python -m flashcore_numba.course.exercises --write`:
# improve the phase, not this copy.
"""Phase 11 — the backward pass: dQ, dK and dV on mma.sync, recomputed from the log-sum-exp.

The whole account of this phase (what it changes, why the hardware rewards it, what each
change bought) is the docstring of flashcore_numba/phases/p11_backward.py; the lesson is
lessons/11_backward.ipynb.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from flashcore_numba.arch import operands, ptx
from flashcore_numba.arch.sim import simulator_enabled
from flashcore_numba.arch.smem import smem_per_block
from flashcore_numba.phases.common import (ELEMENT, FULL_MASK, LOG2E, MMA_N, PTX_TYPE, cdiv, key_end, launch, make_pack_a,
                     zero_tiles)
from flashcore_numba.phases.p07_mma_sync import MMA_K, PAD, make_copy_tile, unrolled

ID = "11"
NAME = "backward"
TITLE = "The backward pass: dQ, dK and dV recomputed from the log-sum-exp"
HEAD_DIMS = (64, 128)  # the course's head dims
MAX_HEAD_DIM = 256  # the kernels build any multiple of 8 up to this, on 64-, 128- or 256-column tiles (tile_head_dim)
HEAD_DIMS_TEXT = "any multiple of 8 from 8 to 256"  # what attention()'s autograd takes (runs_head_dim)
DTYPES = ("float16", "bfloat16")
MIN_CC = (8, 0)
BACKWARD = True  # its exercise is graded by its gradients (course/grade_backward.py), not by an output

# Each warp owns 16 rows of what its block keeps: kv_kernel keeps KV_WARPS x 16 keys (BLOCK_N) and
# streams query tiles of KV_BLOCK_M rows past them. The warps then share one query tile's
# dQ = dS K, (KV_BLOCK_M / 16) row groups x (the rest) column groups.
KV_WARPS, KV_BLOCK_M = 8, 64
# Past D = 128 a block keeps half the keys (KV_WARPS_WIDE warps): its K and V rows are twice as long, and
# shared memory holds 64 of each beside two stages of 64-row query tiles (32 where a GPU has less room)
KV_WARPS_WIDE = 4
PART_COLS = 128  # the most gradient columns a warp accumulates: dK and dV, PART_COLS / 2 registers each
SIM = dict(kv_warps=2, kv_block_m=16)  # the simulator: fewer Python threads
DELTA_WARPS = 4  # delta_kernel: warps per block, each taking delta_rows_per_warp rows
# deterministic=True: a block per part of dQ, each part a float32 copy of dQ (see run): at most this
# many, so that the copies stay a few times dQ's size
MAX_DQ_PARTS = 8
SIM_SM_COUNT = 4  # the simulator's stand-in for the GPU's SM count (dq_parts)
SUM_THREADS = 256  # the parts' sum: threads per block, an element each
NO_ROW = 1 << 30  # kv_kernel's mask limits: a row index above (and, negated, below) every real row


STATIC_SMEM_BYTES = 2048  # kv_kernel's static shared memory (the rows' stats, prev_s) and then some


def runs_head_dim(HEAD_DIM: int) -> bool:
    """Whether the kernels build head dim HEAD_DIM: a multiple of 8 (rows of whole 16-byte chunks,
    the unit of every copy) up to MAX_HEAD_DIM (the widest tile, `tile_head_dim`)."""
    return isinstance(HEAD_DIM, int) and 0 < HEAD_DIM <= MAX_HEAD_DIM and HEAD_DIM % 8 == 0


def tile_head_dim(HEAD_DIM: int) -> int:
    """D_TILE: the columns a tile's rows hold in shared memory, HEAD_DIM rounded up to 64 or 128. The
    streamed tiles are swizzled within groups of eight 16-byte chunks, so a row is one or two such
    groups. The copies fill the columns past HEAD_DIM with zeros: they add nothing to Sᵀ, dPᵀ or dQ,
    and the gradients' columns past HEAD_DIM are never stored. D = 96 costs what D = 128 costs."""
    return 64 if HEAD_DIM <= 64 else 128 if HEAD_DIM <= 128 else 256


def column_parts(HEAD_DIM: int) -> int:
    """How many blocks share a key block's gradients by columns: 1 up to D = 128; past it 2, each
    taking PART_COLS columns of dK, dV and dQ. A warp's dK and dV are 16 keys x D float32, D / 2
    registers a thread each: at D = 256 they alone would fill a thread's 255. Each of the two
    blocks computes the whole Sᵀ and dPᵀ (every column of the head dim counts in them) and half
    of dV, dK and dQ: together 7 products of the size of one where one block would do 5, so the
    head dims past 128 cost 1.4 times their FLOPs. Splitting the gradients' columns across the
    warps of one block instead (Sᵀ and dPᵀ computed once, through shared memory) would not."""
    return max(1, tile_head_dim(HEAD_DIM) // PART_COLS)


def kv_shape(HEAD_DIM: int, cc: tuple) -> tuple[int, int, int]:
    """kv_kernel's (warps, query rows a streamed tile, dSᵀ buffers) on a GPU of compute capability
    cc: KV_WARPS, or KV_WARPS_WIDE past D = 128; KV_BLOCK_M rows, or half as many where not even
    one buffer fits then (an A100 past D = 128); and 2 buffers (dQ one tile late, kv_kernel's
    faster build) where they fit one block, else 1 (dQ behind a barrier of its own: an A100 at
    D = 128, a GeForce RTX card at D = 64). Where none fits (a GeForce card at D = 128 and past
    it), KV_BLOCK_M and 1 buffer: the launch then fails for want of shared memory."""
    warps = KV_WARPS if column_parts(HEAD_DIM) == 1 else KV_WARPS_WIDE
    for rows, buffers in ((KV_BLOCK_M, 2), (KV_BLOCK_M, 1), (KV_BLOCK_M // 2, 2), (KV_BLOCK_M // 2, 1)):
        if layout(HEAD_DIM, warps, rows, buffers)["SMEM_BYTES"] + STATIC_SMEM_BYTES <= smem_per_block(cc):
            return warps, rows, buffers
    return warps, KV_BLOCK_M, 1


def layout(HEAD_DIM: int, warps: int, stream_rows: int, ds_buffers: int) -> dict:
    """Every derived constant of kv_kernel, whose block keeps OWN_ROWS = 16 x warps rows of two
    tiles (A, B: K and V) while tiles of STREAM_ROWS rows stream past in two stages (Q and dO).
    Shared memory holds the own tiles' 16-bit rows of STRIDE elements (padded, as phase 07's),
    the streamed tiles' rows of HEAD_DIM elements (swizzled: chunk c of row r at chunk c ^ (r % 8),
    make_copy_tile), then `ds_buffers` buffers of dSᵀ (OWN_ROWS rows of STREAM_ROWS, padded;
    kv_kernel's dQ: two where the GPU has room for them, `kv_shape`); offsets are in bytes.
    Rows and products are D_TILE wide (tile_head_dim): HEAD_DIM of them come from global memory;
    the gradients a block accumulates are PART_COLS of them past D = 128 (column_parts)."""
    own = 16 * warps
    D_TILE = tile_head_dim(HEAD_DIM)
    L = dict(HEAD_DIM=HEAD_DIM, D_TILE=D_TILE, WARPS=warps, N_THREADS=32 * warps, OWN_ROWS=own, STREAM_ROWS=stream_rows,
             DS_BUFFERS=ds_buffers, COLUMN_PARTS=column_parts(HEAD_DIM))
    L["PART_COLS"] = D_TILE // L["COLUMN_PARTS"]  # the columns of dK, dV and dQ a block accumulates
    # The streamed tiles are copied every query tile, and padded rows (144 bytes at D = 64) cost
    # cp.async 24 L2 sectors and 10.5 shared-memory wavefronts a warp where 16 and 4 do: a row
    # that straddles 128-byte lines of shared memory is split (docs/tuning/11_layout/). So their
    # rows are D elements, swizzled. The own tiles are copied once a key block and read from the
    # same addresses every query tile: padded, each k-step is a constant offset from one register;
    # swizzled, each k-step's address is an XOR, which the compiler hoists out of the loop into
    # registers of their own (swizzling them too ran up to 5 % slower at D = 128: docs/tuning/11_history.md)
    L["STRIDE"] = D_TILE + PAD  # elements per own row (PAD: see phase 07)
    L["ROW_BYTES"] = row = L["STRIDE"] * 2
    L["STREAM_ROW_BYTES"] = srow = D_TILE * 2
    L["OWN_A"], L["OWN_B"] = 0, own * row
    L["STREAM_A"] = 2 * own * row  # stage s: tile A at STREAM_A + s * STAGE_BYTES, B at STREAM_B + ...
    L["STREAM_B"] = L["STREAM_A"] + stream_rows * srow
    L["STAGE_BYTES"] = 2 * stream_rows * srow
    # kv_kernel's ldmatrix addresses XOR their chunk: each streamed tile starts a multiple of 256 bytes on
    assert L["STREAM_A"] % 256 == 0 and L["STAGE_BYTES"] % 256 == 0 and stream_rows * srow % 256 == 0
    L["DS_OFF"] = L["STREAM_A"] + 2 * L["STAGE_BYTES"]
    L["DS_ROW_BYTES"] = (stream_rows + PAD) * 2
    L["DS_BYTES"] = own * L["DS_ROW_BYTES"]  # tile it's dSᵀ at DS_OFF + (it % ds_buffers) * DS_BYTES
    L["SMEM_BYTES"] = L["DS_OFF"] + ds_buffers * L["DS_BYTES"]
    L["CHUNKS"] = D_TILE // 8  # 16-byte chunks per row (make_copy_tile) ...
    L["GLOBAL_CHUNKS"] = HEAD_DIM // 8  # ... of which these come from global memory, the rest zeros
    L["ROWS_PER_PASS"] = L["N_THREADS"] // L["CHUNKS"]
    assert own % L["ROWS_PER_PASS"] == 0 and stream_rows % L["ROWS_PER_PASS"] == 0
    L["NT"] = stream_rows // MMA_N  # n-tiles of a warp's Sᵀ (or S): 8 streamed rows each
    L["KS"] = stream_rows // MMA_K  # k-steps over the streamed rows (dV, dK)
    L["KO"] = own // MMA_K  # k-steps over the own rows (kv_kernel's dQ = dS K)
    L["KD"] = D_TILE // MMA_K  # k-steps over the head dim
    L["ND"] = L["PART_COLS"] // MMA_N  # n-tiles of a gradient's row block (8 columns each)
    L["ROW_GROUPS"] = stream_rows // 16  # kv_kernel's dQ: warps by 16 query rows ...
    L["COL_GROUPS"] = warps // L["ROW_GROUPS"]  # ... and by PART_COLS / COL_GROUPS columns
    assert warps % L["ROW_GROUPS"] == 0 and L["PART_COLS"] % (16 * L["COL_GROUPS"]) == 0
    L["DQ_CHUNKS"] = L["PART_COLS"] // L["COL_GROUPS"] // 16  # a warp's 16-column chunks of dQ
    return L


@dataclass(frozen=True)
class Backward:
    """The kernels of one head dim and dtype, and how to launch them (`run`)."""

    head_dim: int
    dtype: str
    wide_red: bool  # kv_kernel adds a pair of dQ columns per instruction (sm_90 on: build's cc)
    kv: dict  # kv_kernel's layout
    delta_kernel: object
    kv_kernel: object  # a block per key block, dQ by atomics
    kv_kernel_serial: object  # deterministic=True: a block per part of dQ, its key blocks in turn
    phase: str = ID  # whose kv_kernel it is: "11", or "12" (phase 12 builds it on wgmma, the rest is this one's)
    # phase 12's build "bulk dQ" (an A/B, not yet what attention() runs): with atomics, kv_kernel adds
    # each dQ piece into a float32 workspace of whole tiles by one bulk reduction, and `dq_of_tiles`
    # (that build's) writes dQ from it
    dq_of_tiles: object = None
    # phase 14's backward (p14_flex.build_backward): its kv_kernel has the user's mods compiled in
    # and takes their arrays; this names them in the disk cache (their fingerprints)
    mods: tuple = ()

    def kv_id(self, deterministic: bool) -> str:
        """The id of the kv_kernel a backward launches: "11-kv", or its serial build "11-kv-serial"."""
        return f"{self.phase}-kv-serial" if deterministic else f"{self.phase}-kv"

    def cache_id(self, kernel_id: str) -> tuple:
        """A kernel's entry in the disk cache (arch/cache.py): "11-delta", "11-kv", "11-kv-serial" or
        "11-sum" (phase 12's "12-kv", "12-kv-serial"), its head dim and dtype, and for kv_kernel which
        reductions it adds dQ by."""
        if kernel_id == "11-sum":  # float32 sums: the same kernel for every head dim and dtype
            return (kernel_id,)
        if kernel_id.startswith(f"{self.phase}-kv"):
            if self.mods == ("unkept",):  # phase 14's mods whose code cannot be told: never cached
                return ()
            return (kernel_id, self.head_dim, self.dtype, "red.v2" if self.wide_red else "red",
                    f"dS x{self.kv['DS_BUFFERS']}") + (("bulk dQ",) if self.dq_of_tiles is not None else ()) \
                + (("overlap",) if self.kv.get("OVERLAP") else ()) \
                + (("tied",) if self.kv.get("TIED") else ()) \
                + self.mods  # phase 12's builds to A/B, phase 14's mods
        return (kernel_id, self.head_dim, self.dtype)

    def delta_grid(self, B: int, H: int, S_q: int) -> tuple:
        """delta_kernel's grid: a block per DELTA_WARPS x delta_rows_per_warp rows of a head."""
        return (cdiv(S_q, DELTA_WARPS * delta_rows_per_warp(self.head_dim)), H, B)

    def dq_parts(self, B: int, H_kv: int, S_k: int, deterministic: bool, sm_count: int | None = None) -> int:
        """How many float32 copies of dQ kv_kernel adds into (`run`): 1 with atomics. With
        deterministic=True a block walks all the key blocks of its part in order; one part per
        (batch, K/V head) leaves SMs idle when there are fewer of those than SMs, so the key
        blocks are then dealt out to up to MAX_DQ_PARTS parts, summed in order at the end."""
        if not deterministic:
            return 1
        if sm_count is None:
            sm_count = SIM_SM_COUNT if simulator_enabled() else cuda.get_current_device().MULTIPROCESSOR_COUNT
        key_blocks = cdiv(S_k, self.kv["OWN_ROWS"])
        return max(1, min(key_blocks, MAX_DQ_PARTS, sm_count // max(1, B * H_kv)))

    def run(self, Q, K, V, O, dO, LSE, dQ, dK, dV, causal: bool, scale: float, deterministic: bool = False,
            stream=0, dLSE=None, delta=None, dq_sums=None, parts: int | None = None, mod_args: tuple = ()):
        """dQ (float32), dK and dV (the inputs' type) from (B, H, S, D) device arrays Q, K, V, the
        forward's O and LSE (B, H, S_q, natural log) and dO, all 16-bit (bf16 as int16 bits) but
        LSE; dLSE, if the LSE was used too, its gradient (B, H, S_q) float32: d LSE_i / d s_ij =
        P_ij, so it joins dS as P ∘ dLSE. delta: a (B, H, S_q) float32 scratch array for Δ, or None
        to allocate one here. attention() passes one of torch's: an array Numba allocates is freed
        later by cuMemFree, which waits for the whole GPU, so a call would stall the host.

        dQ is summed over the key blocks. With atomics (the default) kv_kernel has a block per key
        block, and all of them add into dQ. With deterministic=True it has a block per part of
        dQ (parts, default `dq_parts`) and each block adds its key blocks in order; dq_sums: a
        (parts, B, H, S_q, D) float32 scratch array where there is more than one part (None:
        allocated here), whose parts are then summed in order into dQ. mod_args: phase 14's, what
        its kv_kernel takes last: the tuples of its mods' arrays (score_mod's, mask_mod's) and the
        query rows of each key block (p14_flex.backward_rows)."""
        B, H, S_q, D = Q.shape
        H_kv, S_k = K.shape[1], K.shape[2]
        if S_q == 0 or S_k == 0:  # nothing to recompute: every gradient is 0
            for x in (dQ, dK, dV):
                if x.size:
                    _zero(x.view(np.uint32) if x.dtype.itemsize == 2 else x, stream)
            return
        if delta is None:
            delta = cuda.device_array((B, H, S_q), np.float32, stream=stream)
        launch(self.delta_kernel, self.delta_grid(B, H, S_q), 32 * DELTA_WARPS, 0,
               (O.view(np.uint32), dO.view(np.uint32), delta if dLSE is None else dLSE, dLSE is not None, delta),
               stream, self.cache_id("11-delta"))
        kv = self.kv
        key_blocks = cdiv(S_k, kv["OWN_ROWS"])
        if parts is None or not deterministic:
            parts = self.dq_parts(B, H_kv, S_k, deterministic)
        if self.dq_of_tiles is not None and not deterministic:  # the build "bulk dQ": a workspace of whole tiles
            sums = self.dq_of_tiles.workspace(B, H, S_q, stream)
        elif parts == 1:
            sums = dQ.reshape((1, *dQ.shape))
        else:
            sums = dq_sums if dq_sums is not None else cuda.device_array((parts, *dQ.shape), np.float32, stream=stream)
            if tuple(sums.shape) != (parts, *dQ.shape):
                raise ValueError(f"dq_sums: expected shape {(parts, *dQ.shape)}, got {tuple(sums.shape)}")
        _zero(sums, stream)
        kernel = self.kv_kernel_serial if deterministic else self.kv_kernel
        args = (Q, K, V, dO, LSE, delta, sums, dK.view(np.uint32), dV.view(np.uint32), causal, float32(scale),
                *mod_args)
        if "TMA_BOX" in kv:  # phase 13: a producer warpgroup more, loading by TMA
            from flashcore_numba.arch.tma import head_maps

            args += (head_maps((Q, K, V, dO), kv["TMA_BOX"]),)
        launch(kernel, kv_grid(kv, parts if deterministic else key_blocks, H_kv, B), kv_threads(kv),
               kv["SMEM_BYTES"], args, stream, self.cache_id(self.kv_id(deterministic)))
        if self.dq_of_tiles is not None and not deterministic:
            self.dq_of_tiles.write(sums, dQ, stream)
        elif parts > 1:
            flat = dQ.reshape(dQ.size)
            launch(_sum_parts_kernel, cdiv(flat.size, SUM_THREADS), SUM_THREADS, 0,
                   (sums.reshape((parts, flat.size)), flat), stream, self.cache_id("11-sum"))


def _zero(array, stream) -> None:
    """Fill a 32-bit device array with zeros (the simulator has no memset): a kernel on the GPU; in
    the simulator, whose arrays live on the host, a copy (a kernel there starts a Python thread per
    CUDA thread, as long as a small backward's own kernels take)."""
    flat = array.reshape(array.size)
    if simulator_enabled():
        flat.copy_to_device(np.zeros(flat.size, flat.dtype))
        return
    launch(_zero_kernel, cdiv(flat.size, 256), 256, 0, (flat,), stream)


@cuda.jit
def _zero_kernel(X):
    i = cuda.grid(1)
    if i < X.shape[0]:
        X[i] = 0


@cuda.jit
def _sum_parts_kernel(PARTS, OUT):
    """OUT[i] = PARTS[0, i] + PARTS[1, i] + ..., always in that order (deterministic=True)."""
    i = cuda.grid(1)
    if i < OUT.shape[0]:
        total = PARTS[0, i]
        for p in range(1, PARTS.shape[0]):
            total += PARTS[p, i]
        OUT[i] = total


def build(HEAD_DIM: int, dtype: str = "float16", cc: tuple | None = None) -> Backward:
    """The backward kernels for head dim HEAD_DIM (64 or 128, or any other runs_head_dim takes) and
    `dtype` ("float16", "bfloat16"), for compute capability `cc` (default: the current GPU's; in the
    simulator, or with no GPU, where nothing launches, the H100's 9.0): from 9.0 on, kv_kernel adds
    two dQ columns per instruction (`red_pair`)."""
    if cc is None:
        on_gpu = not simulator_enabled() and cuda.is_available()
        cc = tuple(cuda.get_current_device().compute_capability) if on_gpu else (9, 0)
    if not runs_head_dim(HEAD_DIM):
        raise ValueError(f"head dim: the backward is built for multiples of 8 up to {MAX_HEAD_DIM}, not {HEAD_DIM}")
    return _build(HEAD_DIM, dtype, tuple(cc)[:2] >= (9, 0), kv_shape(HEAD_DIM, cc))


@lru_cache(maxsize=None)
def _build(HEAD_DIM: int, dtype: str, wide_red: bool, shape: tuple) -> Backward:
    if dtype not in DTYPES:
        raise ValueError(f"dtype: the backward builds {' and '.join(DTYPES)}, not {dtype!r}")
    warps, stream_rows, ds_buffers = shape
    # the simulator's small blocks take the full-size kernel's number of dSᵀ buffers (so its tests
    # run the build a GPU of that compute capability gets)
    if simulator_enabled():
        warps, stream_rows = SIM["kv_warps"], SIM["kv_block_m"]
    kv = layout(HEAD_DIM, warps, stream_rows, ds_buffers)
    return Backward(HEAD_DIM, dtype, wide_red, kv, build_delta_kernel(HEAD_DIM, dtype),
                    build_kv_kernel(kv, dtype, wide_red), build_kv_kernel(kv, dtype, wide_red, serial=True))


@dataclass(frozen=True)
class CompiledView:
    """One backward kernel as measure/machine_code.py compiles it for a report (as a forward phase's
    KernelConfig): the kernel, its signature, threads and dynamic shared memory per block."""

    kernel: object
    types: str
    n_threads: int
    smem_bytes: int
    ptx_files: tuple = ()
    launch_bounds: tuple | None = None

    def signature(self, dtype: str = "float16") -> str:
        return self.types


def kernel_views(HEAD_DIM: int, dtype: str = "float16", cc: tuple = (9, 0)) -> dict[str, CompiledView]:
    """"11-kv", "11-kv-serial", "11-delta" and "11-sum" of `build(HEAD_DIM, dtype, cc)`, typed as
    Backward.run launches them (by default the H100's, as measure/machine_code.py compiles)."""
    return views_of(build(HEAD_DIM, dtype, cc=cc))


def kv_grid(kv: dict, blocks: int, H_kv: int, B: int) -> tuple:
    """kv_kernel's grid: `blocks` (key blocks, or deterministic parts of dQ) x the K/V heads, each
    past D = 128 once per column part (column_parts), x the batch."""
    return (blocks, H_kv * kv.get("COLUMN_PARTS", 1), B)


def kv_threads(kv: dict) -> int:
    """kv_kernel's threads a block: its warps', and phase 13's producer warpgroup's (WS_THREADS)."""
    return kv.get("WS_THREADS", kv["N_THREADS"])


def views_of(bw: Backward) -> dict[str, CompiledView]:
    """The kernels of a Backward (this phase's, or phase 12's: its kv_kernel under "12-kv"), typed as
    Backward.run launches them."""
    e = ELEMENT[bw.dtype]
    four, three = f"{e}[:,:,:,::1]", "float32[:,:,::1]"
    inputs = f"{four}, {four}, {four}, {four}, {three}, {three}, float32[:,:,:,:,::1]"
    kv = f"void({inputs}, uint32[:,:,:,::1], uint32[:,:,:,::1], boolean, float32)"
    if "TMA_BOX" in bw.kv:  # phase 13's kv_kernel: the tensor maps too
        kv = kv[:-1] + ", uint64[:,::1])"
    threads, smem, bounds = kv_threads(bw.kv), bw.kv["SMEM_BYTES"], bw.kv.get("LAUNCH_BOUNDS")
    return {
        bw.kv_id(False): CompiledView(bw.kv_kernel, kv, threads, smem, launch_bounds=bounds),
        bw.kv_id(True): CompiledView(bw.kv_kernel_serial, kv, threads, smem, launch_bounds=bounds),
        "11-delta": CompiledView(bw.delta_kernel, f"void(uint32[:,:,:,::1], uint32[:,:,:,::1], {three}, boolean, "
                                                  f"{three})", 32 * DELTA_WARPS, 0),
        "11-sum": CompiledView(_sum_parts_kernel, "void(float32[:,::1], float32[::1])", SUM_THREADS, 0),
    }


class _Pieces:
    """What kv_kernel uses of a layout: the PTX functions and the warp's products."""

    def __init__(self, L: dict, dtype: str):
        mma = ptx.function("mma_sync.ptx", f"flashcore_mma_{PTX_TYPE[dtype]}", "inline")
        self.pack = pack = ptx.function("mma_sync.ptx", f"flashcore_pack_{PTX_TYPE[dtype]}x2", "inline")
        self.exp2 = ptx.function("exp2.ptx", "flashcore_exp2", "inline")
        ldsm = ptx.function("ldmatrix.ptx", "flashcore_ldmatrix_x4", "inline")
        self.ldsm_t = ldsm_t = ptx.function("ldmatrix.ptx", "flashcore_ldmatrix_x4_trans", "inline")
        self.commit = ptx.function("cp_async.ptx", "flashcore_cp_async_commit", "inline")
        self.wait_all = ptx.function("cp_async.ptx", "flashcore_cp_async_wait_0", "inline")
        self.copy_tile = make_copy_tile(L)  # the own tiles, padded
        self.copy_stream = make_copy_tile(dict(L, STRIDE=L["D_TILE"], SWIZZLE=True))  # streamed, swizzled
        NT, KS, SROW = L["NT"], L["KS"], L["STREAM_ROW_BYTES"]

        @cuda.jit(device=True, inline=True)
        def mma_into(c, j, a0, a1, a2, a3, b0, b1):
            """c[j] += a · b: one m16n8k16 product into n-tile j of the warp's accumulators."""
            c[j, 0], c[j, 1], c[j, 2], c[j, 3] = mma(a0, a1, a2, a3, b0, b1, c[j, 0], c[j, 1], c[j, 2], c[j, 3])

        @cuda.jit(device=True, inline=True)
        def abt_step(kk, args):
            """k-step kk (16 of the head dim) of c = a · bᵀ, both row-major tiles in shared memory:
            the warp's 16 own rows of a (ldmatrix, as phase 07 reads Q) against the NT n-tiles of 8
            streamed rows of b (ldmatrix, as phase 07 reads K): Sᵀ = K Qᵀ and dPᵀ = V dOᵀ."""
            c, a_rows, b_rows = args
            a0, a1, a2, a3 = ldsm(a_rows + kk * 32)
            # b swizzled, 16 kk columns on: XOR (kv_kernel's lane addresses) within 256 bytes, past
            # them (D_TILE = 256) an add: the streamed tiles start 256-byte aligned, not 512
            b_kk = (b_rows ^ uint32((kk % 8) * 32)) + (kk // 8) * 256
            for jj in range(NT // 2):
                b0, b1, b2, b3 = ldsm(b_kk + jj * 16 * SROW)
                mma_into(c, 2 * jj, a0, a1, a2, a3, b0, b1)
                mma_into(c, 2 * jj + 1, a0, a1, a2, a3, b2, b3)

        @cuda.jit(device=True, inline=True)
        def ab_step(jj, args):
            """Columns 16 jj .. 16 jj + 15 of c += a · b: a in registers as A fragments (KS k-steps of
            16 streamed rows), b a streamed row-major tile read by ldmatrix.trans (as phase 07 reads V).
            dV += Pᵀ dO and dK += dSᵀ Q."""
            c, a, b_rows = args
            for kk in range(KS):
                b0, b1, b2, b3 = ldsm_t((b_rows ^ uint32(jj * 32)) + kk * 16 * SROW)
                mma_into(c, 2 * jj, a[kk, 0], a[kk, 1], a[kk, 2], a[kk, 3], b0, b1)
                mma_into(c, 2 * jj + 1, a[kk, 0], a[kk, 1], a[kk, 2], a[kk, 3], b2, b3)

        self.mma_into, self.pack_a = mma_into, make_pack_a(pack, KS)
        self.abt_steps = unrolled(abt_step, L["KD"])
        self.ab_steps = unrolled(ab_step, L["ND"] // 2)


def make_red_pair(wide_red: bool):
    """red_pair(address, x0, x1): two float32 added to global memory by reductions (phase 12 too)."""
    red = ptx.function("red.ptx", "flashcore_red_add_f32", "inline")
    red_v2 = ptx.function("red.ptx", "flashcore_red_add_v2_f32", "inline")
    WIDE = wide_red

    @cuda.jit(device=True, inline=True)
    def red_pair(address, x0, x1):
        """x0 and x1 added to the float32 pair at `address` (8-byte aligned), nothing read back."""
        if WIDE:
            red_v2(address, x0, x1)
        else:
            red(address, x0)
            red(address + uint64(4), x1)

    return red_pair


def make_p_and_ds(exp2, NT: int, BLOCK_M: int, BLOCK_N: int):
    """p_and_ds(...): a tile's elementwise step, the same in phase 12 (its accumulators have this
    layout: a warp's 16 keys as rows, NT n-tiles of 8 query rows)."""

    @cuda.jit(device=True, inline=True)
    def p_and_ds(s, dp, lse2_s, delta_s, stage, m0, n0, seq_q, seq_k, causal, t, first_a, first_b, qk_scale):
        """Pᵀ = 2^(s · qk_scale − L_i log2 e) in place of Sᵀ (s) and dSᵀ = Pᵀ ∘ (dPᵀ − Δ_i) in place of dPᵀ
        (dp), for the tile of query rows m0 .. against the block's keys n0 ..: column 2t (+1) of n-tile
        j is query row m0 + 8 j + 2t (+1), whose stats lie at stats + 8 j (+1) of stage `stage`; a row
        before its key's first row (first_a: the lane's key of row g, first_b: of row g + 8) does not
        see the key: p = 0. Only a tile that crosses the diagonal or the end of the keys is masked;
        the others compare against a limit no row is below. The limits and rows are 32-bit, the row
        offsets constants: this runs 4 NT times a tile, so int32(...) keeps the sum and the compare
        32-bit (col, from range, is an int64, and Numba makes row_t + col an int64: two compares an
        element instead of one)."""
        masked = n0 + BLOCK_N > key_end(m0, seq_q, seq_k, causal)
        limit_a = first_a if masked else int32(-NO_ROW)
        limit_b = first_b if masked else int32(-NO_ROW)
        row_t = int32(m0 + 2 * t)  # this lane's first column's row
        stats = uint32(stage * BLOCK_M + 2 * t)
        for j in range(NT):
            for e in range(4):
                col = j * 8 + e % 2  # this element's column, from the lane's first
                # >>> exercise 11-a: Pᵀ in place of Sᵀ, from the row's saved log-sum-exp (0 for a key the row does not see); dSᵀ in place of dPᵀ
                # <<< exercise

    return p_and_ds


def make_store_dk_dv(pack, ND: int, HEAD_DIM: int | None = None):
    """store_dk_dv(...): a block's dK and dV written at the end of its key block (phase 12 too); with
    HEAD_DIM narrower than the ND n-tiles, the n-tiles past it (a rounded-up tile's) are not stored.
    Past D = 128 the ND n-tiles are one column part's (column_parts): those from column col0 on."""
    N_STORED = ND if HEAD_DIM is None else min(ND, HEAD_DIM // MMA_N)  # n-tiles of columns that exist
    PARTS = HEAD_DIM is not None and HEAD_DIM > ND * MMA_N  # col0 is a column part's; else 0

    @cuda.jit(device=True, inline=True)
    def store_dk_dv(dK, dV, b, h_kv, key_a, seq_k, t, dk, dv, scale, col0):
        """dK = scale · Σ dSᵀ Q and dV of the lane's keys key_a and key_a + 8 (rows g, g + 8 of its
        warp's accumulators), in the inputs' type, two columns per 32-bit store (an unsigned column:
        a signed one is checked for < 0, checks the serial build keeps in registers)."""
        for j in range(N_STORED):
            if PARTS and col0 + j * MMA_N >= HEAD_DIM:  # the last part's n-tiles past the head dim
                break
            # two columns a word; the index written out in each store (a variable for it, int64 or
            # uint32, changed ptxas's allocation of phase 11 at D = 128: 52 bytes spilled, not 40)
            if key_a < seq_k:
                dK[b, h_kv, key_a, uint32(col0 // 2 + j * 4 + t)] = pack(dk[j, 0] * scale, dk[j, 1] * scale)
                dV[b, h_kv, key_a, uint32(col0 // 2 + j * 4 + t)] = pack(dv[j, 0], dv[j, 1])
            if key_a + 8 < seq_k:
                dK[b, h_kv, key_a + 8, uint32(col0 // 2 + j * 4 + t)] = pack(dk[j, 2] * scale,
                                                                             dk[j, 3] * scale)
                dV[b, h_kv, key_a + 8, uint32(col0 // 2 + j * 4 + t)] = pack(dv[j, 2], dv[j, 3])

    return store_dk_dv


@cuda.jit(device=True, inline=True)
def load_row_stats(LSE, DELTA, b, h, row, seq_q):
    """A query row's saved L_i (natural log) and Δ_i as they are, −inf for a row past seq_q: two
    loads that nothing waits for until `row_stats` (the row is known to be ≥ 0: unsigned, it needs
    no negative-index check)."""
    if row < seq_q:
        return LSE[b, h, uint32(row)], DELTA[b, h, uint32(row)]
    return float32(-math.inf), float32(0.0)


@cuda.jit(device=True, inline=True)
def row_stats(lse, delta):
    """L_i in base 2 and Δ_i, as the tile's elementwise step reads them. A row that saw no key
    (L = −inf) or lies past seq_q gets +inf: every p = 2^(s · qk_scale − inf) of it is 0."""
    if lse != -math.inf:
        return lse * float32(LOG2E), delta
    return float32(math.inf), float32(0.0)


@cuda.jit(device=True, inline=True)
def first_row(key, seq_q, seq_k, causal):
    """The first query row that sees `key`, as a 32-bit limit: row i sees key j exactly when
    j < key_end(i, ...), that is when j < seq_k and (causal) i >= j - (seq_k - seq_q). A key past
    the end of the keys is seen by no row (a limit above every row), one without a mask by all."""
    if key >= seq_k:
        return int32(NO_ROW)
    if causal:
        return int32(key - (seq_k - seq_q))
    return int32(-NO_ROW)


@cuda.jit(device=True, inline=True)
def tile_count(n_rows, rows_per_tile):
    """⌈n_rows / rows_per_tile⌉, 0 when n_rows <= 0."""
    return (n_rows + rows_per_tile - 1) // rows_per_tile if n_rows > 0 else 0


def delta_rows_per_warp(HEAD_DIM: int) -> int:
    """delta_kernel's rows per warp: enough that each lane has 4 words of O and 4 of dO to load
    (2 rows at D = 128, 4 at D = 64). Loads in flight are what a kernel that only reads needs:
    with one row a warp, D = 64 read 1.65 TB/s (docs/tuning/11_history.md)."""
    return max(1, 256 // HEAD_DIM)


def build_delta_kernel(HEAD_DIM: int, dtype: str):
    """delta_kernel: Δ_i from O and dO, read as 32-bit pairs of 16-bit values."""
    unpack = ptx.function("mma_sync.ptx", f"flashcore_unpack_{PTX_TYPE[dtype]}x2", "inline")
    WORDS = -(-HEAD_DIM // 64)  # 32-bit words of a row each lane reads (two elements a word) ...
    ROW_WORDS = HEAD_DIM // 2
    PART_WORD = HEAD_DIM % 64 != 0  # ... the last of them only in lanes below ROW_WORDS % 32 (D = 96: 16)
    ROWS = delta_rows_per_warp(HEAD_DIM)

    @cuda.jit
    def delta_kernel(O, dO, DLSE, use_dlse, DELTA):
        """Δ_i = Σ_d dO_id · O_id for ROWS rows a warp, DELTA_WARPS warps a block, all of one head
        (two elements per 32-bit load, summed over the warp by shuffles); minus dLSE_i where the
        LSE has a gradient (dS = P ∘ (dP − Δ + dLSE))."""
        # indices built from unsigned block and lane numbers (no negative-index checks) and a
        # constant trip count (range(lane, HEAD_DIM // 2, 32) counts its trips by a division)
        b, h = uint32(cuda.blockIdx.z), uint32(cuda.blockIdx.y)
        lane = uint32(cuda.laneid)
        first = (uint32(cuda.blockIdx.x) * DELTA_WARPS + uint32(cuda.threadIdx.x) // 32) * ROWS
        last = uint32(O.shape[2] - 1)  # run() launches nothing where S_q = 0
        if first > last:
            return
        mine = float32(0.0)  # lane r keeps row first + r's Δ
        for r in range(ROWS):
            # a row past the end reads the last one again: no branch around the loads, so the
            # compiler issues all the warp's loads before the first sum waits for one (1.8x
            # faster at D = 64, 1.3x at D = 128 than a row per warp)
            i = min(first + uint32(r), last)
            total = float32(0.0)
            # >>> exercise 11-b: Δ_i = Σ_d dO_id · O_id: each lane sums its words of row i, then the warp sums the lanes
            # <<< exercise
            # every lane has the row's sum now (a butterfly, not shfl_down): lane r keeps it
            mine = total if lane == uint32(r) else mine  # a select, not a branch around shuffles
        i = first + lane  # lanes 0 .. ROWS - 1 write the warp's rows side by side
        if lane < ROWS and i <= last:
            DELTA[b, h, i] = mine - DLSE[b, h, i] if use_dlse else mine

    return delta_kernel


# The scores of a tile before the softmax is recomputed. Phase 11 leaves them as they are; phase 14
# (p14_flex.py) builds this kernel with its user's mods on them: each score modded (or hidden),
# and its derivative kept for the chain rule. The plain form compiles to nothing (phase 11's PTX
# unchanged), as phase 09's Walk does for its forward.
@dataclass(frozen=True)
class Scores:
    mods: bool  # phase 14's: kv_kernel takes the mods' arrays, and modify runs on every tile it visits
    modify: object  # modify(s, slope, context, h, m0, t): Sᵀ modded in place, d mod / d score into slope
    rows: object  # rows(mod_args, b, h_kv, key_block) -> (m_first, m_stop): the query rows to visit


def plain_scores() -> Scores:
    @cuda.jit(device=True, inline=True)
    def modify(s, slope, context, h, m0, t):
        pass

    @cuda.jit(device=True, inline=True)
    def rows(mod_args, b, h_kv, key_block):
        return 0, 0

    return Scores(False, modify, rows)


def make_tile_grads(L: dict, f: _Pieces, scores: Scores):
    """tile_grads(...): one query tile's part of the gradients of the warp's 16 keys."""
    p_and_ds = make_p_and_ds(f.exp2, L["NT"], L["STREAM_ROWS"], L["OWN_ROWS"])
    abt_steps, ab_steps, pack_a = f.abt_steps, f.ab_steps, f.pack_a
    NT = L["NT"]
    MODS, modify = scores.mods, scores.modify

    @cuda.jit(device=True, inline=True)
    def tile_grads(s, dp, p_frag, ds_frag, dk, dv, k_warp, v_warp, q_tile, do_tile, b_lane, bt_lane, lse2_s,
                   delta_s, stage, m0, n0, seq_q, seq_k, causal, t, first_a, first_b, qk_scale, part_bytes, slope,
                   h, context):
        """The query tile in `stage` (rows m0 .., Q at q_tile, dO at do_tile) against the warp's 16
        keys and values (k_warp, v_warp): Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, then Pᵀ from the rows' saved
        log-sum-exp and dSᵀ = Pᵀ ∘ (dPᵀ − Δ_i), then dV += Pᵀ dO and dK += dSᵀ Q in the block's
        columns (part_bytes into a row: 0 up to D = 128). Pᵀ and dSᵀ are left as A fragments in
        p_frag and ds_frag (dSᵀ's go on to dQ). Phase 14's build: the mods on Sᵀ first (query head
        h, `context`), and dSᵀ times each score's slope."""
        # -- Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, the warp's 16 keys against the tile's BLOCK_M rows
        zero_tiles(s, NT)
        zero_tiles(dp, NT)
        abt_steps(0, (s, k_warp, q_tile + b_lane))
        abt_steps(0, (dp, v_warp, do_tile + b_lane))
        if MODS:  # phase 14: each score as its mods make it (hidden: -inf), its slope d mod / d score
            modify(s, slope, context, h, m0, t)

        # -- Pᵀ = 2^(s · qk_scale − L_i log2 e) in place of Sᵀ, dSᵀ = Pᵀ ∘ (dPᵀ − Δ_i) in place of dPᵀ
        p_and_ds(s, dp, lse2_s, delta_s, stage, m0, n0, seq_q, seq_k, causal, t, first_a, first_b, qk_scale)
        if MODS:  # the chain rule through the score mod: the gradient by the raw score
            for j in range(NT):
                for e in range(4):
                    dp[j, e] *= slope[j, e]

        # -- dV += Pᵀ dO and dK += dSᵀ Q: Pᵀ and dSᵀ as A fragments, dO and Q by ldmatrix.trans
        pack_a(p_frag, s)
        pack_a(ds_frag, dp)
        ab_steps(0, (dv, p_frag, do_tile + part_bytes + bt_lane))
        ab_steps(0, (dk, ds_frag, q_tile + part_bytes + bt_lane))

    return tile_grads


def make_dq(L: dict, f: _Pieces, wide_red: bool):
    """(stash_ds, tile_dq): dQ += scale · dS K, the share of a query tile's dQ that the block's keys
    give, added to dQ in global memory by float32 reductions (ptx/red.ptx; wide_red: a lane's two
    adjacent columns in one, sm_90 and newer). Every warp computed dSᵀ for its own 16 keys; dQ needs
    all the block's keys for each query row, so dSᵀ goes through shared memory (`stash_ds`), and the
    warps then share the tile's dQ by row and column groups (`tile_dq`)."""
    mma_into, ldsm_t = f.mma_into, f.ldsm_t
    red_pair = make_red_pair(wide_red)
    ROW_BYTES, DS_ROW_BYTES, DS_OFF, DS_BYTES = L["ROW_BYTES"], L["DS_ROW_BYTES"], L["DS_OFF"], L["DS_BYTES"]
    KS, KO, ROW_GROUPS, DQ_CHUNKS = L["KS"], L["KO"], L["ROW_GROUPS"], L["DQ_CHUNKS"]
    OWN_A, DS_BUFFERS = L["OWN_A"], L["DS_BUFFERS"]
    DQ_ROW = L["HEAD_DIM"] * 4  # bytes from a row of dQ (float32) to the next
    HEAD_DIM, ROUNDED = L["HEAD_DIM"], L["D_TILE"] != L["HEAD_DIM"]  # dQ's columns past HEAD_DIM: not added

    @cuda.jit(device=True, inline=True)
    def stash_ds(smem_h, prev_s, ds_frag, stage, warp, g, t, tid, h, m0):
        """-- dSᵀ to shared memory, buffer `stage` (of two), for dQ = dS K by row and column groups of
        the warps during the next tile (tile_dq; the last tile's after the loop): its A fragments are
        already its 16-bit pairs (rows g and g + 8, columns 16 kk + 2t and 16 kk + 8 + 2t). 32-bit
        words, indexed unsigned: a signed index gets a negative-index check. prev_s[buffer] says whose
        dSᵀ it is (query head h, first row m0)."""
        buffer = stage if DS_BUFFERS == 2 else 0
        ds_row = uint32((DS_OFF + buffer * DS_BYTES + (warp * 16 + g) * DS_ROW_BYTES) // 4 + t)
        for kk in range(KS):
            smem_h[ds_row + uint32(kk * 8)] = ds_frag[kk, 0]
            smem_h[ds_row + uint32(8 * DS_ROW_BYTES // 4 + kk * 8)] = ds_frag[kk, 1]
            smem_h[ds_row + uint32(kk * 8 + 4)] = ds_frag[kk, 2]
            smem_h[ds_row + uint32(8 * DS_ROW_BYTES // 4 + kk * 8 + 4)] = ds_frag[kk, 3]
        if tid == 0:  # whose dSᵀ it is (a slot per buffer: the tile before's is still being read)
            prev_s[buffer, 0], prev_s[buffer, 1] = h, m0

    @cuda.jit(device=True, inline=True)
    def dq_columns(jj, args):
        """(atomics) Columns col0 + 16 jj .. + 15 of dQ += scale · dS K for the warp's 16 query rows,
        added to dQ in global memory: two pairs of float32 reductions per lane and n-tile."""
        dq_head, row_a, col0, seq_q, t, ds_frag, k_rows, scale = args
        c = cuda.local.array((2, 4), float32)
        zero_tiles(c, 2)
        for kk in range(KO):
            b0, b1, b2, b3 = ldsm_t(k_rows + kk * 16 * ROW_BYTES + jj * 32)
            mma_into(c, 0, ds_frag[kk, 0], ds_frag[kk, 1], ds_frag[kk, 2], ds_frag[kk, 3], b0, b1)
            mma_into(c, 1, ds_frag[kk, 0], ds_frag[kk, 1], ds_frag[kk, 2], ds_frag[kk, 3], b2, b3)
        for n in range(2):
            col = col0 + jj * 16 + n * 8 + 2 * t
            at = dq_head + uint64(row_a * DQ_ROW + col * 4)  # dQ[b, h, row_a, col]
            if ROUNDED and col >= HEAD_DIM:  # a column of the tile past the head dim
                continue
            # >>> exercise 11-c: add this lane's four dQ values (times scale) to dQ in global memory by reductions, only in the rows that exist (row < seq_q)
            # <<< exercise

    dq_steps = unrolled(dq_columns, DQ_CHUNKS)

    @cuda.jit(device=True, inline=True)
    def tile_dq(smem, buffer, prev_s, dq_address, b, H, seq_q, warp, lane, t, dsq_frag, bt_own, scale, col0):
        """dQ += scale · dS K for the query tile whose dSᵀ (every warp's rows) is in dSᵀ buffer
        `buffer` and whose query head and first row are prev_s[buffer]: this warp's row group and
        column group of it, of the block's columns from col0 on (0 up to D = 128). dS by
        ldmatrix.trans of dSᵀ, K by ldmatrix.trans. Everything it needs is read here, none of it
        kept across the tile in registers."""
        dq_rows, dq_cols = (warp % ROW_GROUPS) * 16, col0 + (warp // ROW_GROUPS) * DQ_CHUNKS * 16
        ds_lane = ((lane // 16) * 8 + lane % 8) * DS_ROW_BYTES + (dq_rows + ((lane // 8) % 2) * 8) * 2
        ds_tile = smem + DS_OFF + buffer * DS_BYTES + ds_lane
        for kk in range(KO):  # dS's A fragments: rows = the warp's 16 query rows, k = the keys
            a0, a1, a2, a3 = ldsm_t(ds_tile + kk * 16 * DS_ROW_BYTES)
            dsq_frag[kk, 0], dsq_frag[kk, 1], dsq_frag[kk, 2], dsq_frag[kk, 3] = a0, a1, a2, a3
        h, m0 = prev_s[buffer, 0], prev_s[buffer, 1]
        dq_head = dq_address + uint64(((b * H + h) * seq_q) * DQ_ROW)
        dq_steps(0, (dq_head, m0 + dq_rows + lane // 4, dq_cols, seq_q, t, dsq_frag,
                     smem + OWN_A + bt_own + dq_cols * 2, scale))

    return stash_ds, tile_dq


def make_query_stream(L: dict, f: _Pieces):
    """fetch_queries(...): the query tiles that stream past a block's keys, two stages of them."""
    copy_stream, commit = f.copy_stream, f.commit  # the streamed tiles: swizzled rows
    global_address = operands.global_address
    BLOCK_M, STREAM_A, STREAM_B, STAGE = L["STREAM_ROWS"], L["STREAM_A"], L["STREAM_B"], L["STAGE_BYTES"]
    GLOBAL_ROW = L["HEAD_DIM"] * 2  # bytes from a row of a head to the next in a (B, H, S, D) array

    @cuda.jit(device=True, inline=True)
    def fetch_queries(smem, stage, Q, dO, b, h, m0, tid):
        """Start copying rows m0 .. m0 + BLOCK_M − 1 of query head h, of Q and of dO, into `stage`."""
        seq_q = Q.shape[2]
        head_q = uint64(((b * Q.shape[1] + h) * seq_q) * GLOBAL_ROW)
        copy_stream(smem, STREAM_A + stage * STAGE, global_address(Q), head_q, m0, BLOCK_M, seq_q, tid, GLOBAL_ROW)
        copy_stream(smem, STREAM_B + stage * STAGE, global_address(dO), head_q, m0, BLOCK_M, seq_q, tid, GLOBAL_ROW)

    @cuda.jit(device=True, inline=True)
    def fetch_next(smem, it, n_tiles, stage, Q, dO, LSE, DELTA, b, h, m0, m_first, m_stop, seq_q, tid):
        """-- the query tile after tile `it` (rows m0 .. of head h) flies into the other stage while
        `it` is computed: the next rows of this head (up to m_stop), or the first of the group's next
        head. Its
        L_i and Δ_i are loaded into registers now and looked at only at the end of this tile: a
        load here that fed shared memory, or a compare, at once would stall the warp for the whole
        trip to global memory. Returns (h_next, m_next, lse_next, delta_next)."""
        h_next, m_next = (h, m0 + BLOCK_M) if m0 + BLOCK_M < m_stop else (h + 1, m_first)
        lse_next, delta_next = float32(0.0), float32(0.0)
        if it + 1 < n_tiles:
            fetch_queries(smem, 1 - stage, Q, dO, b, h_next, m_next, tid)
            commit()
            if tid < BLOCK_M:
                lse_next, delta_next = load_row_stats(LSE, DELTA, b, h_next, m_next + tid, seq_q)
        return h_next, m_next, lse_next, delta_next

    return fetch_queries, fetch_next


def build_kv_kernel(L: dict, dtype: str, wide_red: bool = True, serial: bool = False, scores: Scores | None = None):
    """kv_kernel for layout L: dK and dV of BLOCK_N keys, and their share of dQ; wide_red (sm_90 and
    newer): a lane's two adjacent dQ columns in one reduction (ptx/red.ptx). serial: the build for
    deterministic=True, whose blocks loop over key blocks; the default build has a block per key
    block and no loop (the loop costs instructions and registers where there are none to spare:
    ptxas, sm_90a, 2400 instructions against 2392 at D = 64, and at D = 128 140 bytes spilled
    per thread against 28 in run 9's measure; with today's nvJitLink 120 against 40 before dQ moved
    a tile late, 100 against 100 since).

    The roles, each a function of its own above: the warp's products (_Pieces), a query tile's
    gradients (make_tile_grads), dQ (make_dq) and the query stream (make_query_stream); kv_kernel
    below is the algorithm that wires them, one block's work. scores: phase 14's mods (Scores;
    None: phase 11's own, the scores as they are)."""
    f = _Pieces(L, dtype)
    copy_tile, commit, wait_all = f.copy_tile, f.commit, f.wait_all  # the own tiles (padded)
    scores = plain_scores() if scores is None else scores
    MODS, rows = scores.mods, scores.rows
    tile_grads = make_tile_grads(L, f, scores)
    stash_ds, tile_dq = make_dq(L, f, wide_red)
    fetch_queries, fetch_next = make_query_stream(L, f)
    store_dk_dv = make_store_dk_dv(f.pack, L["ND"], L["HEAD_DIM"])
    shared_address, global_address = operands.shared_address, operands.global_address
    D, BLOCK_N, BLOCK_M = L["HEAD_DIM"], L["OWN_ROWS"], L["STREAM_ROWS"]
    ROW_BYTES, SROW, DS_BUFFERS = L["ROW_BYTES"], L["STREAM_ROW_BYTES"], L["DS_BUFFERS"]
    OWN_A, OWN_B, NT, KS, KO, ND = L["OWN_A"], L["OWN_B"], L["NT"], L["KS"], L["KO"], L["ND"]
    STREAM_A, STREAM_B, STAGE = L["STREAM_A"], L["STREAM_B"], L["STAGE_BYTES"]
    GLOBAL_ROW = D * 2  # bytes from a row of a head to the next in a (B, H, S, D) array
    STATS = 2 * BLOCK_M  # lse2_s and delta_s: two stages of BLOCK_M rows
    SERIAL = serial
    PARTS, PART_COLS = L["COLUMN_PARTS"], L["PART_COLS"]

    @cuda.jit(device=True, inline=True)
    def attend(Q, K, V, dO, LSE, DELTA, dQ, dK, dV, causal, scale, mod_args):
        """dK and dV of blocks of BLOCK_N keys of one K/V head, over every query row of its group
        that sees them, and each query tile's dS K added to dQ. dK and dV: uint32 pairs; dQ:
        (parts, B, H, S_q, D) float32: one part with atomics, a part per block (blockIdx.x) in the
        serial build.

        Block x takes key blocks x, x + gridDim.x, x + 2 gridDim.x, ... in turn. With atomics
        (Backward.run) the grid has a block per key block and there is one part: every key block
        of a head adds to the same dQ, in whatever order the blocks get there. deterministic=True
        launches a block per part instead: each element of a part is then added to by one thread
        alone, key block after key block, and one thread's additions to one address take effect
        in its program order (PTX's memory model: coherence order follows program order), so the
        float32 sums come out the same bit for bit on every run."""
        smem_h = cuda.shared.array(0, uint32, alignment=256)  # streamed tiles 256-byte aligned (the lane addresses)
        smem = shared_address(smem_h)
        lse2_s = cuda.shared.array(STATS, float32)  # stage s, row r at s * BLOCK_M + r: L_i · log2 e
        delta_s = cuda.shared.array(STATS, float32)  # and Δ_i
        # (query head, first row) of the tile whose dSᵀ is in buffer i
        prev_s = cuda.shared.array((2, 2), int32)
        b, h_kv, col0 = cuda.blockIdx.z, cuda.blockIdx.y, 0  # col0: the first of the block's gradient columns
        if PARTS > 1:  # blockIdx.y: the K/V head and which columns of the gradients (column_parts)
            h_kv, col0 = cuda.blockIdx.y // PARTS, (cuda.blockIdx.y % PARTS) * PART_COLS
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4  # rows g, g + 8 and columns 2t, 2t + 1 of every accumulator tile
        H, seq_q, seq_k = Q.shape[1], Q.shape[2], K.shape[2]
        group = H // K.shape[1]
        qk_scale = scale * float32(LOG2E)
        dq_address = global_address(dQ)  # part 0, the only one with atomics; deterministic: part blockIdx.x
        if SERIAL:
            dq_address += uint64(cuda.blockIdx.x) * uint64(dQ.strides[0])
        s = cuda.local.array((NT, 4), float32)  # Sᵀ, then Pᵀ: the warp's 16 keys x BLOCK_M query rows
        dp = cuda.local.array((NT, 4), float32)  # dPᵀ, then dSᵀ
        p_frag = cuda.local.array((KS, 4), uint32)
        ds_frag = cuda.local.array((KS, 4), uint32)
        dsq_frag = cuda.local.array((KO, 4), uint32)
        dk = cuda.local.array((ND, 4), float32)  # the warp's 16 keys x D
        dv = cuda.local.array((ND, 4), float32)
        slope = cuda.local.array((NT, 4), float32)  # phase 14's: each score's d mod / d score
        # ldmatrix lane addresses (phase 07): A rows of a 16-row block (own tiles); B rows of two
        # n-tiles and B of two n-tiles transposed, in the streamed tiles and (bt_own) the own ones.
        # In the streamed tiles' swizzled rows each lane names a row, whose row % 8 is lane % 8, and
        # its 16-byte chunk c, 0 or 1, which lies at chunk c ^ (lane % 8). Chunk c + 2 k (16 k
        # columns on: abt_step's kk, ab_step's jj) then lies at the lane's address XOR 32 k: c + 2 k
        # never carries out of c's bit, and each streamed tile starts 256-byte aligned, so every row
        # starts at a multiple of its own length and XOR 32 k (less than a row) changes only its chunk
        sw = lane % 8
        a_lane = (lane % 16) * ROW_BYTES + (lane // 16) * 16
        b_lane = ((lane // 16) * 8 + lane % 8) * SROW + (((lane // 8) % 2) ^ sw) * 16
        bt_lane = (((lane // 8) % 2) * 8 + lane % 8) * SROW + ((lane // 16) ^ sw) * 16
        bt_own = (((lane // 8) % 2) * 8 + lane % 8) * ROW_BYTES + (lane // 16) * 16
        k_warp = smem + OWN_A + warp * 16 * ROW_BYTES + a_lane
        v_warp = smem + OWN_B + warp * 16 * ROW_BYTES + a_lane

        # Block x takes key blocks x, x + gridDim.x, x + 2 gridDim.x, ... The default build has a
        # block per key block and stops after its first (the break at the end); the serial build
        # walks its share. A while loop, not range(x, end, gridDim.x): Numba's range with a step
        # known only at run time keeps its trip count's values in registers across the loop, which
        # cost the serial build a spill at D = 64 (docs/tuning/11_history.md)
        key_block = cuda.blockIdx.x
        while key_block < tile_count(seq_k, BLOCK_N):
            n0 = key_block * BLOCK_N
            # -- the block's keys and values stay in shared memory; query tiles stream past. The first
            # query row that sees key n0 (causal: row i sees keys up to i + seq_k - seq_q)
            head_kv = uint64(((b * K.shape[1] + h_kv) * seq_k) * GLOBAL_ROW)
            copy_tile(smem, OWN_A, global_address(K), head_kv, n0, BLOCK_N, seq_k, tid, GLOBAL_ROW)
            copy_tile(smem, OWN_B, global_address(V), head_kv, n0, BLOCK_N, seq_k, tid, GLOBAL_ROW)
            first = max(0, n0 - (seq_k - seq_q)) if causal else 0
            m_first, m_stop = first - first % BLOCK_M, seq_q
            if MODS:  # phase 14's: the query rows whose tiles its block mask has not empty for these keys
                m_first, m_stop = rows(mod_args, b, h_kv, key_block)
            tiles_per_head = tile_count(m_stop - m_first, BLOCK_M)
            n_tiles = group * tiles_per_head  # (query head, query tile) pairs, the heads of the group in turn
            h, m0 = h_kv * group, m_first  # the tile in flight: query head h, rows m0 ..
            if n_tiles > 0:
                fetch_queries(smem, 0, Q, dO, b, h, m0, tid)
                if tid < BLOCK_M:
                    lse_0, delta_0 = load_row_stats(LSE, DELTA, b, h, m0 + tid, seq_q)
                    lse2_s[tid], delta_s[tid] = row_stats(lse_0, delta_0)
            commit()
            wait_all()
            cuda.syncthreads()

            zero_tiles(dk, ND)
            zero_tiles(dv, ND)
            key_a = n0 + warp * 16 + g  # this lane's keys (rows of Sᵀ): key_a and key_a + 8 ...
            first_a = first_row(key_a, seq_q, seq_k, causal)  # ... and the first query row that sees each
            first_b = first_row(key_a + 8, seq_q, seq_k, causal)
            context = 0
            if MODS:  # phase 14's mods: what they read besides the scores
                context = (b, key_a, seq_q, seq_k, mod_args, scale)

            for it in range(n_tiles):
                stage = it % 2
                h_next, m_next, lse_next, delta_next = fetch_next(smem, it, n_tiles, stage, Q, dO, LSE, DELTA,
                                                                  b, h, m0, m_first, m_stop, seq_q, tid)
                q_tile = smem + STREAM_A + stage * STAGE
                do_tile = smem + STREAM_B + stage * STAGE

                # -- this tile's Pᵀ and dSᵀ, and its part of dV and dK (Pᵀ dO, dSᵀ Q)
                tile_grads(s, dp, p_frag, ds_frag, dk, dv, k_warp, v_warp, q_tile, do_tile, b_lane, bt_lane,
                           lse2_s, delta_s, stage, m0, n0, seq_q, seq_k, causal, t, first_a, first_b,
                           qk_scale, col0 * 2, slope, h, context)
                stash_ds(smem_h, prev_s, ds_frag, stage, warp, g, t, tid, h, m0)
                if DS_BUFFERS == 2:
                    # -- dQ of the tile before, whose dSᵀ every warp stored before the barrier that
                    # ended it: added here, one tile late, not behind a barrier between this tile's
                    # dSᵀ and its dQ, where every warp waited for the slowest one's dSᵀ (7 % of
                    # kv_kernel's stall samples, docs/tuning/11_history.md). Its buffer is the other one
                    if it > 0:
                        tile_dq(smem, 1 - stage, prev_s, dq_address, b, H, seq_q, warp, lane, t, dsq_frag,
                                bt_own, scale, col0)
                else:
                    # -- one buffer (a GPU without room for two, kv_shape): this tile's dQ, once
                    # every warp has stored its rows of dSᵀ
                    cuda.syncthreads()
                    tile_dq(smem, 0, prev_s, dq_address, b, H, seq_q, warp, lane, t, dsq_frag, bt_own, scale, col0)

                # -- the next tile has landed (this thread's copies), and every warp is done with this one
                if it + 1 < n_tiles and tid < BLOCK_M:
                    at = uint32((1 - stage) * BLOCK_M + tid)
                    lse2_s[at], delta_s[at] = row_stats(lse_next, delta_next)
                wait_all()
                cuda.syncthreads()
                h, m0 = h_next, m_next

            # -- dQ of the last tile (its dSᵀ and prev_s, behind the loop's last barrier)
            if DS_BUFFERS == 2 and n_tiles > 0:
                tile_dq(smem, (n_tiles - 1) % 2, prev_s, dq_address, b, H, seq_q, warp, lane, t, dsq_frag,
                        bt_own, scale, col0)

            # -- dK = scale · Σ dSᵀ Q and dV, in the inputs' type
            store_dk_dv(dK, dV, b, h_kv, key_a, seq_k, t, dk, dv, scale, col0)
            if not SERIAL:
                break  # a block per key block: one trip (the compiler leaves no loop)
            cuda.syncthreads()  # every warp done with K (the last dQ) before the next key block's copies
            key_block += cuda.gridDim.x  # deterministic=True: this block's next key block

    def kv_kernel(Q, K, V, dO, LSE, DELTA, dQ, dK, dV, causal, scale):
        attend(Q, K, V, dO, LSE, DELTA, dQ, dK, dV, causal, scale, 0)

    def kv_kernel_mods(Q, K, V, dO, LSE, DELTA, dQ, dK, dV, causal, scale, score_args, mask_args, ROWS):
        # phase 14's: the mods' arrays, and each key block's query rows (its block mask, Scores.rows)
        attend(Q, K, V, dO, LSE, DELTA, dQ, dK, dV, causal, scale, (score_args, mask_args, ROWS))

    return cuda.jit(kv_kernel_mods if MODS else kv_kernel)


def backward(q, k, v, o, do, lse, *, causal: bool = False, scale: float | None = None,
             deterministic: bool = False, dlse=None, dtype: str = "float16", cc: tuple | None = None,
             parts: int | None = None):
    """(dq as float32, dk, dv as 16-bit) NumPy arrays from NumPy arrays of the kernels' element type
    (float16, or bf16 as its int16 bits): q (B, H, S_q, D), k and v (B, H_kv, S_k, D), the forward's
    output o and the gradient of the output do; lse (B, H, S_q, natural log) and dlse float32. What
    the tests and the simulator use; attention()'s autograd calls Backward.run on torch tensors. cc:
    the compute capability to build for (build(); e.g. (8, 0) runs sm_80's dQ reductions on a newer GPU).
    parts: with deterministic=True, how many parts dQ is summed in (Backward.run; default dq_parts())."""
    return run_on_host(build(q.shape[-1], dtype, cc), q, k, v, o, do, lse, causal=causal, scale=scale,
                       deterministic=deterministic, dlse=dlse, parts=parts)


def run_on_host(bw: Backward, q, k, v, o, do, lse, *, causal: bool = False, scale: float | None = None,
                deterministic: bool = False, dlse=None, parts: int | None = None, mod_args: tuple = ()):
    """`backward` with the kernels of `bw` (this phase's, phase 12's build of them, or phase 14's with
    its mods, whose arrays' tuples are `mod_args`)."""
    D, dtype = q.shape[-1], bw.dtype
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)  # attention's default
    element = np.dtype(ELEMENT[dtype])
    for name, x in zip(("q", "k", "v", "o", "do"), (q, k, v, o, do)):
        if x.dtype != element:
            raise TypeError(f"{name}: expected {element} for {dtype}, got {x.dtype}")
    arrays = [cuda.to_device(np.ascontiguousarray(x)) for x in (q, k, v, o, do)]
    arrays.append(cuda.to_device(np.ascontiguousarray(lse, dtype=np.float32)))
    dq = cuda.to_device(np.full(q.shape, np.nan, np.float32))  # poisoned: every element must be written
    nan_16 = np.float16(np.nan) if dtype == "float16" else np.int16(0x7FC0)  # (bf16's NaN bits)
    dk, dv = (cuda.to_device(np.full(x.shape, nan_16, element)) for x in (k, v))
    bw.run(*arrays, dq, dk, dv, causal, scale, deterministic, parts=parts, mod_args=mod_args,
           dLSE=None if dlse is None else cuda.to_device(np.ascontiguousarray(dlse, dtype=np.float32)))
    return dq.copy_to_host(), dk.copy_to_host(), dv.copy_to_host()

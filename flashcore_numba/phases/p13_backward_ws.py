"""Phase 13 — the backward warp-specialized: a TMA producer warpgroup feeds the wgmma consumers.

A phase of the course after phase 12 (lesson 13, exercise 13), like it no rung of the forward
ladder: phase 11's `Backward` with a kv_kernel of its own. Δ's kernel, the zeroing of dQ, the
deterministic parts and their sum, the plan are phase 11's; its A/B builds are in
docs/tuning/12_history.md.

What changed from phase 12
    Phase 12's block is two warpgroups that do everything: each thread issues its share of the
    cp.async copies of the next query tile (Q and dO), waits for its own, and the block meets at
    a barrier before the tensor cores may read them. Here a third warpgroup, the *producer*
    (warpgroup 0), does the copying, and phase 09's machinery carries it over to the backward:
    - one thread of the producer loads the block's K and V (once) and then each query tile's Q
      and dO by TMA (ptx/tma.ptx, boxes of 64 rows x 64 columns into phase 08's swizzled atoms:
      the layout phase 12's copies made by hand), into a ring of two stages guarded by mbarriers:
      "full" (the tile's bytes landed) and "empty" (every consumer thread is done with it);
    - the consumers (warpgroups 1 and 2, phase 12's two) run phase 12's products and elementwise
      step unchanged; they release a stage as soon as dK's product has read Q (before dQ), so the
      producer refills it while they compute dQ;
    - the barriers between the consumers (dSᵀ stored, the tile done) are named barriers of their
      256 threads: the producer never waits at them;
    - registers follow the work, as in phase 09: the producer drops to 24 (setmaxnreg.dec), the
      consumers rise to 240.
    The serial build (deterministic=True) is warp-specialized too: a block takes its part's key
    blocks in turn, and the producer loads the next K and V once the consumers say they are done
    with the last (kv_empty); the ring's count runs on across key blocks. With bulk_dq (FA3's dQ)
    the consumers no longer add dQ themselves: each stages its 64 x 64 piece in one of two slots
    of shared memory, and a thread of the producer's warpgroup (warp 1) adds it to a float32
    workspace by one bulk reduction (ptx/bulk.ptx) and frees the slot once the TMA unit has read
    it; phase 12's DqOfTiles writes dQ from the workspace after.

Why the hardware should reward it
    A TMA load is one instruction for 8 KB, issued by one thread, and the copy engine swizzles,
    zero-fills the rows past the sequence and the columns past D, and counts the bytes on the
    mbarrier: the consumers spend no instructions or registers on addresses, and no consumer waits
    at a block barrier for the slowest thread's copies. What it costs: the consumers' 240
    registers (phase 12 has 255 a thread), and the mbarrier handshakes.

Measured effect (written by `flashcore report` from the backward records' rows 13,
13-deterministic and 13-step, docs/bench/backward/; do not edit by hand)
    [measured:begin]
    The backward rows count 2.5 x the forward's FLOPs, the -step rows (forward and backward) 3.5 x,
    as FlashAttention's benchmark counts them. NVIDIA H100 80GB HBM3, 2026-12-07, TFLOPS: B=16 H=16
    S=2048 D=64 fp16: 13 323 (1.30x SDPA flash, 1.04x phase 12), 13-deterministic 220 (0.89x SDPA
    flash, 0.98x phase 12), 13-step not timed (autograd ran 12-step); B=16 H=16 S=2048 D=64 fp16
    causal: 13 268 (1.37x SDPA flash, 1.03x phase 12), 13-deterministic 197 (1.00x SDPA flash, 1.00x
    phase 12), 13-step not timed (autograd ran 12-step); B=16 H=16 S=2048 D=128 fp16: 13 362 (1.35x
    SDPA flash, 1.02x phase 12), 13-deterministic 213 (0.80x SDPA flash, 0.95x phase 12), 13-step
    not timed (autograd ran 12-step); B=16 H=16 S=2048 D=128 fp16 causal: 13 305 (1.37x SDPA flash,
    1.02x phase 12), 13-deterministic 189 (0.85x SDPA flash, 0.96x phase 12), 13-step not timed
    (autograd ran 12-step) (nvidia-h100-80gb-hbm3_backward_b16h16s2048d64_fp16[_causal].json,
    nvidia-h100-80gb-hbm3_backward_b16h16s2048d128_fp16[_causal].json).
    [measured:end]
    The A/B of its builds against phase 12's (the producer alone, bulk dQ, tied accumulators):
    docs/tuning/12_history.md and docs/tuning/12_builds/.
"""

from __future__ import annotations

from functools import lru_cache

from numba import cuda, float32, int32, uint32, uint64

from ..arch import operands, ptx
from ..arch.sim import simulator_enabled
from .common import LOG2E, PTX_TYPE, make_pack_a, zero_tiles
from .p08_wgmma import ATOM, GROUP, ROW, WG_M
from .p11_backward import (DTYPES, Backward, build_delta_kernel, first_row, load_row_stats, make_p_and_ds,
                           make_red_pair, make_store_dk_dv, row_stats, run_on_host, tile_count)
from .p11_backward import HEAD_DIMS  # noqa: F401 (the course's head dims, phase 11's: the grader reads them)
from .p12_backward_wgmma import (MAX_HEAD_DIM, PIECE, PIECE_BYTES, WARPGROUPS, DqOfTiles, layout, query_rows,
                                 runs_head_dim)

ID = "13"
NAME = "backward_ws"
TITLE = "The backward warp-specialized: a TMA producer warpgroup feeds the wgmma consumers"
MIN_CC = MAX_CC = (9, 0)  # wgmma, TMA, setmaxnreg: Hopper alone (sm_90a)
BACKWARD = True

CONSUMER_BAR = 1  # the named barrier of the consumers' 256 threads (0 is the block's)
CONSUMER_REGISTERS = 240  # what the block's 65536 leave the consumers once the producer is down to 24
STAGES = 2  # the ring of query tiles (Q and dO)
DQ_SLOTS = 2  # bulk_dq: staged pieces of dQ a consumer, so that it stages the next while one is read
DQ_WRITER = 32  # bulk_dq: the producer warpgroup's thread that adds the staged pieces (its warp 1)


def layout_ws(HEAD_DIM: int, bulk_dq: bool = False, tied: bool = True) -> dict:
    """Phase 12's layout, and this build's: the threads of three warpgroups, and the mbarriers
    after the rest of shared memory: kv_full (K and V landed) and kv_empty (the consumers are done
    with them: serial), then full[s] and empty[s] of each stage of the ring. bulk_dq: before the mbarriers, DQ_SLOTS float32 pieces of dQ a consumer
    (64 x 64, swizzled as p12_backward_wgmma.DqOfTiles stores them), and after them dq_full[c][i]
    (consumer c staged its piece in slot i) and dq_empty[c][i] (the writer has read it)."""
    L = layout(HEAD_DIM, WARPGROUPS, query_rows(HEAD_DIM), tied=tied)
    assert L["WG_PIECES"] == 1  # a piece of dQ a consumer and tile (the writer counts on it)
    L["WS_THREADS"] = 128 * (WARPGROUPS + 1)
    L["LAUNCH_BOUNDS"] = (L["WS_THREADS"], 1)  # one block per SM: 65536 / 384 = 168 registers at launch
    L["BULK_DQ"] = bulk_dq
    if bulk_dq:
        L["DQ_STAGE_OFF"] = L["SMEM_BYTES"]
        L["SMEM_BYTES"] += WARPGROUPS * DQ_SLOTS * PIECE_BYTES
    L["BARS_OFF"] = L["SMEM_BYTES"]
    L["DQ_BARS_OFF"] = L["BARS_OFF"] + 8 * (2 + 2 * STAGES)
    L["SMEM_BYTES"] = L["DQ_BARS_OFF"] + (8 * 2 * WARPGROUPS * DQ_SLOTS if bulk_dq else 0)
    L["KV_BYTES"] = 2 * L["OWN_ROWS"] * L["D_TILE"] * 2  # K and V of the block, as TMA counts them
    L["TMA_BOX"] = (1, 64, 64)  # the tensor maps' box (a head's 64 rows of 64 columns: one swizzled atom)
    return L


@lru_cache(maxsize=None)
def _build(HEAD_DIM: int, dtype: str, bulk_dq: bool, tied: bool = True) -> Backward:
    if dtype not in DTYPES:
        raise ValueError(f"dtype: the backward builds {' and '.join(DTYPES)}, not {dtype!r}")
    L = layout_ws(HEAD_DIM, bulk_dq, tied)
    return Backward(HEAD_DIM, dtype, True, L, build_delta_kernel(HEAD_DIM, dtype), build_kv_kernel_ws(L, dtype),
                    build_kv_kernel_ws(L, dtype, serial=True), phase=ID,
                    dq_of_tiles=DqOfTiles(L["D_TILE"]) if bulk_dq else None)


def build(HEAD_DIM: int, dtype: str = "float16", cc: tuple | None = None, bulk_dq: bool = False,
          tied: bool = True) -> Backward:
    """Phase 11's Backward with this phase's kv_kernel and its serial build, for any head
    dim runs_head_dim takes; cc, if given, must be Hopper's (9, 0). bulk_dq: each consumer stages
    its pieces of dQ in shared memory and a thread of the producer's warpgroup adds them to a
    workspace by bulk reductions (FA3's way; phase 12's DqOfTiles writes dQ from it after). tied:
    phase 12's build "tied", the products' accumulators named in place."""
    if not runs_head_dim(HEAD_DIM):
        raise ValueError(f"head dim: the backward is built for multiples of 8 up to {MAX_HEAD_DIM}, not {HEAD_DIM}")
    if cc is not None and tuple(cc)[:2] != MIN_CC:
        raise ValueError(f"cc: phase 13 runs on compute capability 9.0 only (wgmma, TMA), not {tuple(cc)[:2]}")
    return _build(HEAD_DIM, dtype, bool(bulk_dq), bool(tied))


def backward(q, k, v, o, do, lse, *, causal: bool = False, scale: float | None = None,
             deterministic: bool = False, dlse=None, dtype: str = "float16", parts: int | None = None,
             bulk_dq: bool = False, tied: bool = True):
    """p11_backward.backward with this phase's kv_kernel: (dq as float32, dk, dv as 16-bit) NumPy arrays."""
    return run_on_host(build(q.shape[-1], dtype, bulk_dq=bulk_dq, tied=tied), q, k, v, o, do, lse, causal=causal,
                       scale=scale, deterministic=deterministic, dlse=dlse, parts=parts)


def make_producer(L: dict):
    """producer(...): one thread's TMA loads: the block's K and V, then the query tiles' Q and dO
    into the ring, in the order the consumers take them (the heads of the group in turn)."""
    expect_tx = ptx.function("tma.ptx", "flashcore_mbarrier_arrive_expect_tx", "inline")
    tma_load = ptx.function("tma.ptx", "flashcore_tma_load_3d", "inline")
    wait = ptx.function("tma.ptx", "flashcore_mbarrier_wait", "inline")
    map_address = operands.map_address
    D_TILE, BLOCK_N, BLOCK_M = L["D_TILE"], L["OWN_ROWS"], L["BLOCK_M"]
    ATOMS = D_TILE // 64  # atoms (TMA boxes) across a row of a tile
    KV_TILE, K_OFF, V_OFF, Q_OFF = L["KV_TILE"], L["K_OFF"], L["V_OFF"], L["Q_OFF"]
    STREAM_TILE, STAGE, KV_BYTES = L["STREAM_TILE"], L["STAGE_BYTES"], L["KV_BYTES"]

    @cuda.jit(device=True, inline=True)
    def load_rows(dst, map_, row0, n_rows, plane, bar):
        """Rows row0 .. row0 + n_rows − 1 of plane `plane` into a tile at dst: 64 rows a box, each
        D_TILE / 64 atoms (rows past the sequence and columns past D arrive as zeros)."""
        for r in range(n_rows // 64):
            for a in range(ATOMS):
                col = int32(0)
                row = int32(0)
                # >>> exercise 13-a: the TMA coordinates of box r of atom a: its first column (of d) and its first row
                col = int32(64 * a)
                row = int32(row0 + 64 * r)
                # <<< exercise
                tma_load(dst + r * KV_TILE + a * ATOM, map_, col, row, int32(plane), bar)

    @cuda.jit(device=True, inline=True)
    def producer(smem, bars, maps, b, h_kv, n_heads, kv_heads, group, n0, m_first, n_tiles, seq_q, kb, done):
        """The kb-th key block of the block (n0: its first key): K and V once the consumers are done
        with the last ones, then its tiles, the ring's done + 0, 1, ...; returns the ring's count."""
        kv_full, kv_empty = bars, bars + 8
        full, empty = bars + 16, bars + 16 + 8 * STAGES
        map_q, map_k, map_v, map_do = (map_address(maps[0]), map_address(maps[1]), map_address(maps[2]),
                                       map_address(maps[3]))
        plane_kv = b * kv_heads + h_kv
        wait(kv_empty, uint32((kb % 2) ^ 1))  # (a new barrier's "previous" phase counts as done)
        expect_tx(kv_full, uint32(KV_BYTES))
        load_rows(smem + K_OFF, map_k, n0, BLOCK_N, plane_kv, kv_full)
        load_rows(smem + V_OFF, map_v, n0, BLOCK_N, plane_kv, kv_full)
        h, m0 = h_kv * group, m_first
        for it in range(n_tiles):
            stage, use = (done + it) % STAGES, (done + it) // STAGES
            # the consumers are done with this stage's last tile (a new barrier's "previous" phase,
            # parity 1, counts as done: the first use of each stage does not wait)
            wait(empty + 8 * stage, uint32((use % 2) ^ 1))
            expect_tx(full + 8 * stage, uint32(2 * STREAM_TILE))
            q_tile = smem + Q_OFF + stage * STAGE
            load_rows(q_tile, map_q, m0, BLOCK_M, b * n_heads + h, full + 8 * stage)
            load_rows(q_tile + STREAM_TILE, map_do, m0, BLOCK_M, b * n_heads + h, full + 8 * stage)
            # >>> exercise 13-b: the next tile's head h and first row m0, in the consumers' order: head h's rows BLOCK_M at a time, then the next head's from m_first
            if m0 + BLOCK_M < seq_q:
                m0 += BLOCK_M
            else:
                h, m0 = h + 1, m_first
            # <<< exercise
        return done + n_tiles

    return producer


def make_dq_writer(L: dict):
    """dq_writer(...) (bulk_dq): one thread of the producer's warpgroup adds each piece of dQ the
    consumers stage to the workspace by one bulk reduction (ptx/bulk.ptx), in the order they stage
    them, and frees its slot once the TMA unit has read it."""
    wait = ptx.function("tma.ptx", "flashcore_mbarrier_wait", "inline")
    arrive = ptx.function("tma.ptx", "flashcore_mbarrier_arrive", "inline")
    bulk_reduce = ptx.function("bulk.ptx", "flashcore_bulk_reduce_add_f32", "inline")
    bulk_commit = ptx.function("bulk.ptx", "flashcore_bulk_commit_group", "inline")
    bulk_wait_read = ptx.function("bulk.ptx", "flashcore_bulk_wait_group_read_0", "inline")
    BLOCK_M, COL_BLOCKS, DQ_STAGE_OFF, DQ_BARS_OFF = L["BLOCK_M"], L["COL_BLOCKS"], L["DQ_STAGE_OFF"], L["DQ_BARS_OFF"]
    EMPTY_OFF = DQ_BARS_OFF + 8 * WARPGROUPS * DQ_SLOTS

    @cuda.jit(device=True, inline=True)
    def add_piece(smem, dq_address, c, use, piece):
        """Consumer c's staged piece number `use` (slot use % DQ_SLOTS) into workspace piece `piece`."""
        slot = use % uint32(DQ_SLOTS)
        at = uint32(c * DQ_SLOTS) + slot
        wait(smem + uint32(DQ_BARS_OFF) + 8 * at, (use // uint32(DQ_SLOTS)) % uint32(2))
        bulk_reduce(dq_address + uint64(piece) * uint64(PIECE_BYTES), smem + uint32(DQ_STAGE_OFF) + at * uint32(PIECE_BYTES),
                    uint32(PIECE_BYTES))
        bulk_commit()
        bulk_wait_read()  # the slot is read: the consumer may stage into it again
        arrive(smem + uint32(EMPTY_OFF) + 8 * at)

    @cuda.jit(device=True, inline=True)
    def dq_writer(smem, dq_address, b, H, h0, m_first, n_tiles, seq_q):
        m_pieces = uint32((seq_q + PIECE - 1) // PIECE)  # a head's pieces down the rows
        h, m0 = uint32(h0), uint32(m_first)
        uses0, uses1 = uint32(0), uint32(0)  # pieces each consumer has staged so far
        for it in range(n_tiles):
            head = (uint32(b) * uint32(H) + h) * m_pieces
            for c in range(WARPGROUPS):  # consumer c's piece p_id = c: its rows and columns (tile_dq)
                r0, c0 = uint32((c // COL_BLOCKS) * 64), uint32((c % COL_BLOCKS) * 64)
                if m0 + r0 < uint32(seq_q):  # (a piece below the last row is not staged)
                    piece = (head + (m0 + r0) // uint32(PIECE)) * uint32(COL_BLOCKS) + c0 // uint32(64)
                    if c == 0:
                        add_piece(smem, dq_address, c, uses0, piece)
                        uses0 += uint32(1)
                    else:
                        add_piece(smem, dq_address, c, uses1, piece)
                        uses1 += uint32(1)
            if m0 + uint32(BLOCK_M) < uint32(seq_q):
                m0 += uint32(BLOCK_M)
            else:
                h, m0 = h + uint32(1), uint32(m_first)

    return dq_writer


def make_tile_dq(L: dict, dtype: str):
    """tile_dq(...): phase 12's dQ += scale · dS K of a tile, each consumer warpgroup its 64 x 64
    piece over all BLOCK_N keys; added by per-pair reductions (phase 12's default), or (bulk_dq)
    staged in a slot for the writer. Returns the consumer's count of staged pieces."""
    kind = PTX_TYPE[dtype]
    dq_first = ptx.function("wgmma.ptx", f"flashcore_wgmma_dq_{kind}", "inline", in_place=L["TIED"])
    dq_acc = ptx.function("wgmma.ptx", f"flashcore_wgmma_dq_acc_{kind}", "inline", tuples=True, in_place=L["TIED"])
    wait = ptx.function("tma.ptx", "flashcore_mbarrier_wait", "inline")
    arrive = ptx.function("tma.ptx", "flashcore_mbarrier_arrive", "inline")
    fence_shared = ptx.function("bulk.ptx", "flashcore_fence_proxy_async_shared", "inline")
    descriptor, SW128 = operands.matrix_descriptor, operands.SWIZZLE_128B
    as_tuple, store_tuple = operands.as_tuple, operands.store_tuple
    red_pair = make_red_pair(True)
    D, D_TILE = L["HEAD_DIM"], L["D_TILE"]
    DS_OFF, DS_ATOM, K_OFF, KV_TILE = L["DS_OFF"], L["DS_ATOM"], L["K_OFF"], L["KV_TILE"]
    COL_BLOCKS, KEY_HALVES = L["COL_BLOCKS"], L["OWN_ROWS"] // 64
    DQ_ROW, ROUNDED, BULK = D * 4, D_TILE != D, L["BULK_DQ"]
    if BULK:
        DQ_STAGE_OFF, DQ_BARS_OFF = L["DQ_STAGE_OFF"], L["DQ_BARS_OFF"]
        EMPTY_OFF = DQ_BARS_OFF + 8 * WARPGROUPS * DQ_SLOTS

    @cuda.jit(device=True, inline=True)
    def stage_piece(smem, stage_f, dq, wg, warp, g, t, scale, staged):
        """(bulk_dq) The piece into the consumer's next slot, once the writer has read what was there
        (p12's DqOfTiles layout: a row's 16-byte chunks swizzled by the row), then its arrival."""
        slot = staged % uint32(DQ_SLOTS)
        at = uint32(wg * DQ_SLOTS) + slot
        wait(smem + uint32(EMPTY_OFF) + 8 * at, ((staged // uint32(DQ_SLOTS)) % uint32(2)) ^ uint32(1))
        base = uint32((DQ_STAGE_OFF + wg * DQ_SLOTS * PIECE_BYTES) // 4) + slot * uint32(PIECE_BYTES // 4)
        row_a = base + uint32((warp * 16 + g) * PIECE + (t % 2) * 2)  # rows g and g + 8 (both r % 8 = g)
        for j in range(8):  # column 8 j + 2t of the piece: chunk 2 j + t // 2, swizzled by the row
            a = row_a + uint32(((2 * j + t // 2) ^ g) * 4)
            stage_f[a] = dq[j, 0] * scale
            stage_f[a + uint32(1)] = dq[j, 1] * scale
            stage_f[a + uint32(8 * PIECE)] = dq[j, 2] * scale
            stage_f[a + uint32(8 * PIECE + 1)] = dq[j, 3] * scale
        fence_shared()  # the stores, visible to the bulk reduction's reads
        arrive(smem + uint32(DQ_BARS_OFF) + 8 * at)

    @cuda.jit(device=True, inline=True)
    def tile_dq(smem, stage_f, h, m0, dq_address, b, H, seq_q, wg, warp, g, t, dq, scale, staged):
        r0, c0 = (wg // COL_BLOCKS) * 64, (wg % COL_BLOCKS) * 64  # its piece's query rows and columns
        ds_atom = smem + DS_OFF + (r0 // 64) * DS_ATOM
        k_atom = smem + K_OFF + (c0 // 64) * ATOM
        store_tuple(dq, dq_first(descriptor(ds_atom, ATOM, GROUP, SW128), descriptor(k_atom, ATOM, GROUP, SW128)))
        for half in range(1, KEY_HALVES):
            store_tuple(dq, dq_acc(descriptor(ds_atom + half * WG_M * ROW, ATOM, GROUP, SW128),
                                   descriptor(k_atom + half * KV_TILE, ATOM, GROUP, SW128), as_tuple(dq, 32)))
        if BULK:
            if m0 + r0 < seq_q:  # (the writer skips the same pieces)
                stage_piece(smem, stage_f, dq, wg, warp, g, t, scale, staged)
                staged += uint32(1)
            return staged
        dq_head = dq_address + uint64(((b * H + h) * seq_q) * DQ_ROW)
        row_a = m0 + r0 + warp * 16 + g  # register 4j + e: row 16 warp + g (+8), column 8 j + 2t (+1)
        if ROUNDED:
            n_cols = uint32(D - c0)
        for j in range(8):
            if ROUNDED and uint32(j * 8) >= n_cols:
                continue
            at = dq_head + uint64(row_a * DQ_ROW + (c0 + j * 8 + 2 * t) * 4)
            if row_a < seq_q:
                red_pair(at, dq[j, 0] * scale, dq[j, 1] * scale)
            if row_a + 8 < seq_q:
                red_pair(at + uint64(8 * DQ_ROW), dq[j, 2] * scale, dq[j, 3] * scale)
        return staged

    return tile_dq


def build_kv_kernel_ws(L: dict, dtype: str, serial: bool = False):
    """kv_kernel for layout L (layout_ws): warpgroup 0 produces (make_producer), warpgroups 1 and 2
    consume (consume_block): phase 12's products and elementwise step on the tiles the ring hands
    them. serial: the build for deterministic=True (phase 12's grid of dQ parts, a block's key
    blocks in turn: the producer reloads K and V once the consumers are done with the last ones)."""
    kind = PTX_TYPE[dtype]
    D, BLOCK_N, BLOCK_M, D_TILE = L["HEAD_DIM"], L["OWN_ROWS"], L["BLOCK_M"], L["D_TILE"]
    n_q = "" if BLOCK_M == 64 else f"_n{BLOCK_M}"
    qk = ptx.function("wgmma.ptx", f"flashcore_wgmma_qk_d{D_TILE}{n_q}_{kind}", "inline", in_place=L["TIED"])
    pv_acc = ptx.function("wgmma.ptx", f"flashcore_wgmma_pv_acc_d{D_TILE}_n{BLOCK_M}_{kind}", "inline", tuples=True,
                          in_place=L["TIED"])
    fence_proxy_async = ptx.function("wgmma.ptx", "flashcore_fence_proxy_async", "inline")
    pack = ptx.function("mma_sync.ptx", f"flashcore_pack_{kind}x2", "inline")
    exp2 = ptx.function("exp2.ptx", "flashcore_exp2", "inline")
    mbar_init = ptx.function("tma.ptx", "flashcore_mbarrier_init", "inline")
    fence_mbar_init = ptx.function("tma.ptx", "flashcore_fence_mbarrier_init", "inline")
    wait = ptx.function("tma.ptx", "flashcore_mbarrier_wait", "inline")
    arrive = ptx.function("tma.ptx", "flashcore_mbarrier_arrive", "inline")
    bar_sync = ptx.function("warpgroup.ptx", "flashcore_bar_sync", "inline")
    regs_inc = ptx.function("warpgroup.ptx", f"flashcore_setmaxnreg_inc_{CONSUMER_REGISTERS}", "inline")
    regs_dec = ptx.function("warpgroup.ptx", "flashcore_setmaxnreg_dec_24", "inline")
    shared_address, global_address = operands.shared_address, operands.global_address
    descriptor, SW128 = operands.matrix_descriptor, operands.SWIZZLE_128B
    as_tuple, store_tuple = operands.as_tuple, operands.store_tuple
    producer = make_producer(L)
    tile_dq = make_tile_dq(dict(L, BULK_DQ=L["BULK_DQ"] and not serial), dtype)
    BULK, SERIAL = L["BULK_DQ"] and not serial, serial
    if BULK:
        dq_writer = make_dq_writer(L)
    pack_a = make_pack_a(pack, L["KS"])
    p_and_ds = make_p_and_ds(exp2, L["NT"], BLOCK_M, BLOCK_N)
    store_dk_dv = make_store_dk_dv(pack, L["ND"], D)
    KV_TILE, K_OFF, V_OFF, Q_OFF = L["KV_TILE"], L["K_OFF"], L["V_OFF"], L["Q_OFF"]
    STREAM_TILE, STAGE, DS_OFF, DS_ATOM = L["STREAM_TILE"], L["STAGE_BYTES"], L["DS_OFF"], L["DS_ATOM"]
    NT, KS, ND, BARS_OFF, DQ_BARS_OFF = L["NT"], L["KS"], L["ND"], L["BARS_OFF"], L["DQ_BARS_OFF"]
    N_P, N_O = 4 * KS, 4 * ND
    STATS = 2 * BLOCK_M  # lse2_s and delta_s: two stages of BLOCK_M rows
    DS_ATOM_WORDS, ROW_WORDS = DS_ATOM // 4, ROW // 4
    CONSUMER_THREADS = 128 * WARPGROUPS
    FULL, EMPTY = 16, 16 + 8 * STAGES  # from bars: kv_full, kv_empty, then full[s] and empty[s]

    @cuda.jit(device=True, inline=True)
    def consume_block(smem, smem_h, stage_f, lse2_s, delta_s, bars, Q, LSE, DELTA, dK, dV, b, h_kv, group, n0,
                      m_first, n_tiles, seq_k, causal, scale, dq_address, tid, kb, done, staged):
        """A consumer thread's work on one key block (the kb-th of its block): dK and dV of its keys
        over the block's n_tiles query tiles, the ring's tiles done + 0, 1, ...; returns the ring's
        count after them, and (bulk_dq) of the pieces of dQ staged."""
        H, seq_q = Q.shape[1], Q.shape[2]
        wg, warp, lane = tid // 128, (tid % 128) // 32, tid % 32
        g, t = lane // 4, lane % 4
        qk_scale = scale * float32(LOG2E)
        s = cuda.local.array((NT, 4), float32)
        dp = cuda.local.array((NT, 4), float32)
        p_frag = cuda.local.array((KS, 4), uint32)
        ds_frag = cuda.local.array((KS, 4), uint32)
        dk = cuda.local.array((ND, 4), float32)
        dv = cuda.local.array((ND, 4), float32)
        dq = cuda.local.array((8, 4), float32)
        desc_k = descriptor(smem + K_OFF + wg * KV_TILE, 16, GROUP, SW128)
        desc_v = descriptor(smem + V_OFF + wg * KV_TILE, 16, GROUP, SW128)
        ds_row0 = uint32((DS_OFF + (wg * 64 + warp * 16 + g) * ROW) // 4 + t)
        h, m0 = h_kv * group, m_first
        if n_tiles > 0 and tid < BLOCK_M:  # tile 0's row stats, in its stage's slots
            lse_0, delta_0 = load_row_stats(LSE, DELTA, b, h, m0 + tid, seq_q)
            lse2_s[(done % STAGES) * BLOCK_M + tid], delta_s[(done % STAGES) * BLOCK_M + tid] = row_stats(lse_0, delta_0)
        zero_tiles(dk, ND)
        zero_tiles(dv, ND)
        key_a = n0 + wg * 64 + warp * 16 + g
        first_a = first_row(key_a, seq_q, seq_k, causal)
        first_b = first_row(key_a + 8, seq_q, seq_k, causal)
        bar_sync(uint32(CONSUMER_BAR), uint32(CONSUMER_THREADS))  # tile 0's row stats are stored
        wait(bars, uint32(kb % 2))  # this key block's K and V have landed
        for it in range(n_tiles):
            r = done + it  # the ring's count: stage r % 2, its use r // 2
            stage = r % STAGES
            h_next, m_next = (h, m0 + BLOCK_M) if m0 + BLOCK_M < seq_q else (h + 1, m_first)
            lse_next, delta_next = float32(0.0), float32(0.0)
            if it + 1 < n_tiles and tid < BLOCK_M:
                lse_next, delta_next = load_row_stats(LSE, DELTA, b, h_next, m_next + tid, seq_q)
            wait(bars + FULL + 8 * stage, uint32((r // STAGES) % 2))  # this tile's Q and dO have landed
            q_tile = smem + Q_OFF + stage * STAGE
            do_tile = q_tile + STREAM_TILE
            # -- phase 12's tile: Sᵀ, dPᵀ; Pᵀ, dSᵀ; dV += Pᵀ dO, dK += dSᵀ Q
            store_tuple(s, qk(desc_k, descriptor(q_tile, 16, GROUP, SW128)))
            store_tuple(dp, qk(desc_v, descriptor(do_tile, 16, GROUP, SW128)))
            p_and_ds(s, dp, lse2_s, delta_s, stage, m0, n0, seq_q, seq_k, causal, t, first_a, first_b, qk_scale)
            pack_a(p_frag, s)
            pack_a(ds_frag, dp)
            store_tuple(dv, pv_acc(as_tuple(p_frag, N_P), descriptor(do_tile, ATOM, GROUP, SW128), as_tuple(dv, N_O)))
            store_tuple(dk, pv_acc(as_tuple(ds_frag, N_P), descriptor(q_tile, ATOM, GROUP, SW128), as_tuple(dk, N_O)))
            arrive(bars + EMPTY + 8 * stage)  # done with Q and dO: the producer may refill the stage
            # -- dSᵀ to shared memory (phase 12's swizzle), then dQ += scale · dS K
            for kk in range(KS):
                atom = uint32((kk // 4) * DS_ATOM_WORDS)
                lo, hi = uint32(((2 * kk) % 8) ^ g) * 4, uint32(((2 * kk + 1) % 8) ^ g) * 4
                smem_h[ds_row0 + atom + lo] = ds_frag[kk, 0]
                smem_h[ds_row0 + uint32(8 * ROW_WORDS) + atom + lo] = ds_frag[kk, 1]
                smem_h[ds_row0 + atom + hi] = ds_frag[kk, 2]
                smem_h[ds_row0 + uint32(8 * ROW_WORDS) + atom + hi] = ds_frag[kk, 3]
            fence_proxy_async()  # the stores become visible to the tensor cores ...
            bar_sync(uint32(CONSUMER_BAR), uint32(CONSUMER_THREADS))  # ... once both consumers made them
            staged = tile_dq(smem, stage_f, h, m0, dq_address, b, H, seq_q, wg, warp, g, t, dq, scale, staged)
            if it + 1 < n_tiles and tid < BLOCK_M:
                at = uint32((1 - stage) * BLOCK_M + tid)
                lse2_s[at], delta_s[at] = row_stats(lse_next, delta_next)
            bar_sync(uint32(CONSUMER_BAR), uint32(CONSUMER_THREADS))  # dSᵀ read, the next stats stored
            h, m0 = h_next, m_next
        arrive(bars + 8)  # done with K and V (dQ's last product read K): the next key block may load
        store_dk_dv(dK, dV, b, h_kv, key_a, seq_k, t, dk, dv, scale, 0)
        return done + n_tiles, staged

    @cuda.jit(device=True, inline=True)
    def block_span(key_block, seq_q, seq_k, causal, group):
        """Key block key_block's first key, the first query tile that sees it, and its tiles (the
        heads of the group in turn)."""
        n0 = key_block * BLOCK_N
        first = max(0, n0 - (seq_k - seq_q)) if causal else 0
        m_first = first - first % BLOCK_M
        return n0, m_first, group * tile_count(seq_q - m_first, BLOCK_M)

    def kv_kernel(Q, K, V, dO, LSE, DELTA, dQ, dK, dV, causal, scale, maps):
        """phase 12's kv_kernel (its arguments and grid, and the tensor maps of Q, K, V and dO),
        warp-specialized: warpgroup 0 loads, warpgroups 1 and 2 compute."""
        smem_h = cuda.shared.array(0, uint32, alignment=1024)
        stage_f = cuda.shared.array(0, float32, alignment=1024)  # the same memory, as float32 (bulk_dq)
        smem = shared_address(smem_h)
        lse2_s = cuda.shared.array(STATS, float32)  # stage s, row r at s * BLOCK_M + r: L_i · log2 e
        delta_s = cuda.shared.array(STATS, float32)  # and Δ_i
        bars = smem + BARS_OFF
        b, h_kv = cuda.blockIdx.z, cuda.blockIdx.y
        H, seq_q, seq_k = Q.shape[1], Q.shape[2], K.shape[2]
        group = int32(uint32(H) // uint32(K.shape[1]))  # 32-bit: see phase 12
        n_key_blocks = tile_count(seq_k, BLOCK_N)
        if cuda.threadIdx.x == 0:  # one thread sets the barriers up; the block barrier publishes them
            mbar_init(bars, uint32(1))  # kv_full: the producer's arrival and the bytes
            mbar_init(bars + 8, uint32(CONSUMER_THREADS))  # kv_empty: every consumer thread's
            for s in range(STAGES):
                mbar_init(bars + FULL + 8 * s, uint32(1))
                mbar_init(bars + EMPTY + 8 * s, uint32(CONSUMER_THREADS))
            if BULK:
                for i in range(WARPGROUPS * DQ_SLOTS):
                    mbar_init(smem + DQ_BARS_OFF + 8 * i, uint32(128))  # dq_full: the consumer's threads
                    mbar_init(smem + DQ_BARS_OFF + 8 * (WARPGROUPS * DQ_SLOTS + i), uint32(1))  # dq_empty
            fence_mbar_init()
        cuda.syncthreads()
        key_block, kb, done = cuda.blockIdx.x, 0, 0  # (serial: this block's key blocks in turn)
        if cuda.threadIdx.x < 128:  # the producer's warpgroup: one thread loads, all give registers back
            regs_dec()
            while key_block < n_key_blocks:
                n0, m_first, n_tiles = block_span(key_block, seq_q, seq_k, causal, group)
                if cuda.threadIdx.x == 0:
                    done = producer(smem, bars, maps, b, h_kv, H, K.shape[1], group, n0, m_first, n_tiles, seq_q,
                                    kb, done)
                if BULK and cuda.threadIdx.x == DQ_WRITER:
                    dq_writer(smem, global_address(dQ), b, H, h_kv * group, m_first, n_tiles, seq_q)
                if not SERIAL:
                    break
                key_block, kb = key_block + cuda.gridDim.x, kb + 1
            return
        regs_inc()
        dq_address = global_address(dQ)
        if SERIAL:  # dQ's part blockIdx.x
            dq_address += uint64(cuda.blockIdx.x) * uint64(dQ.strides[0])
        staged = uint32(0)  # (bulk_dq) pieces of dQ this consumer has staged
        while key_block < n_key_blocks:
            n0, m_first, n_tiles = block_span(key_block, seq_q, seq_k, causal, group)
            done, staged = consume_block(smem, smem_h, stage_f, lse2_s, delta_s, bars, Q, LSE, DELTA, dK, dV, b, h_kv,
                                         group, n0, m_first, n_tiles, seq_k, causal, scale, dq_address,
                                         cuda.threadIdx.x - 128, kb, done, staged)
            if not SERIAL:
                break
            key_block, kb = key_block + cuda.gridDim.x, kb + 1

    if simulator_enabled():
        return cuda.jit(kv_kernel)
    # 384 threads, one block per SM: ptxas budgets 168 registers a thread, which setmaxnreg then
    # moves from the producer to the consumers (ptx/warpgroup.ptx)
    return cuda.jit(launch_bounds=L["LAUNCH_BOUNDS"])(kv_kernel)


def kernel_views(HEAD_DIM: int, dtype: str = "float16", cc: tuple = (9, 0)) -> dict:
    """"13-kv", "13-kv-serial" and phase 11's "11-delta" and "11-sum", typed as
    Backward.run launches them."""
    from .p11_backward import views_of

    return views_of(build(HEAD_DIM, dtype, cc))

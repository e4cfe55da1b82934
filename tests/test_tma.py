"""TMA, mbarriers and tensor maps (ptx/tma.ptx, flashcore_numba.arch.tma): the pieces phase 09 is
built from. A producer thread streams tiles through a two-stage ring guarded by "full" and
"empty" mbarriers; every thread reads each tile back. In the simulator the emulation runs it
(sim_tma); on an H100 the hardware does, and the same expectations hold: zero fill past the
tensor's end, the 128-byte swizzle as documented, and the ring's phase parities.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda, int32, uint16, uint32, uint64

from flashcore_numba.arch import operands, ptx
from flashcore_numba.arch.sim import simulator_enabled
from flashcore_numba.arch.tma import check_layout, tensor_map

ROWS, COLS, STAGES = 64, 64, 2  # a tile: 64 rows of 64 fp16 = 128 bytes each


def _on_hopper():
    return not simulator_enabled() and cuda.get_current_device().compute_capability == (9, 0)


def ring_kernel(n_tiles: int, planes_rows: int):
    init = ptx.function("tma.ptx", "flashcore_mbarrier_init", "inline")
    fence_init = ptx.function("tma.ptx", "flashcore_fence_mbarrier_init", "inline")
    expect_tx = ptx.function("tma.ptx", "flashcore_mbarrier_arrive_expect_tx", "inline")
    arrive = ptx.function("tma.ptx", "flashcore_mbarrier_arrive", "inline")
    wait = ptx.function("tma.ptx", "flashcore_mbarrier_wait", "inline")
    tma_load = ptx.function("tma.ptx", "flashcore_tma_load_3d", "inline")
    shared_address, map_address = operands.shared_address, operands.map_address
    TILE_BYTES = ROWS * COLS * 2
    RING_ELEMS, N_BARS = STAGES * ROWS * COLS, 2 * STAGES  # compile-time sizes of the shared arrays
    BLOCKS_PER_PLANE = -(-planes_rows // ROWS)

    @cuda.jit
    def ring(tmap, out):
        tiles = cuda.shared.array(RING_ELEMS, uint16, alignment=1024)
        bars = cuda.shared.array(N_BARS, uint64, alignment=8)  # full[0], full[1], empty[0], empty[1]
        tid = cuda.threadIdx.x
        n = cuda.blockDim.x
        base = shared_address(tiles)
        bar = shared_address(bars)
        if tid == 0:
            for s in range(STAGES):
                init(bar + 8 * s, uint32(1))  # full: the producer's one arrival (+ bytes)
                init(bar + 8 * (STAGES + s), uint32(n))  # empty: every thread
            fence_init()
        cuda.syncthreads()
        for t in range(n_tiles):
            s = t % STAGES
            parity = uint32((t // STAGES) % 2)
            if tid == 0:  # producer: wait until the stage is free (parity 1 passes on a fresh barrier)
                wait(bar + 8 * (STAGES + s), parity ^ uint32(1))
                expect_tx(bar + 8 * s, uint32(TILE_BYTES))
                plane, block = t // BLOCKS_PER_PLANE, t % BLOCKS_PER_PLANE
                tma_load(base + s * TILE_BYTES, map_address(tmap), int32(0), int32(block * ROWS), int32(plane),
                         bar + 8 * s)
            wait(bar + 8 * s, parity)  # consumers: the bytes have landed
            for i in range(ROWS * COLS // n):
                e = tid + i * n
                out[t, e] = tiles[s * ROWS * COLS + e]
            arrive(bar + 8 * (STAGES + s))  # this thread is done with the stage

    return ring


def unswizzle(tile_bytes: np.ndarray, swizzle: str) -> np.ndarray:
    """The 128-byte swizzle undone: chunk c of row r was stored at chunk c ^ (r % 8)."""
    from flashcore_numba.arch.sim_tma import swizzled

    offsets = np.arange(tile_bytes.size // 16) * 16
    where = swizzled(offsets, swizzle)
    return np.concatenate([tile_bytes[w:w + 16] for w in where])


@pytest.mark.parametrize("swizzle", ["none", "128B"])
def test_tma_ring_streams_tiles_with_zero_fill_and_swizzle(swizzle):
    if not simulator_enabled() and not _on_hopper():
        pytest.skip("TMA needs an sm_90 GPU")
    planes, rows = 2, 100  # 100 rows: the second tile of each plane reaches 28 rows past the end
    rng = np.random.default_rng()
    tensor = rng.integers(1, 1 << 15, size=(planes, rows, COLS), dtype=np.uint16).view(np.float16)
    n_tiles = planes * 2
    d_tensor = cuda.to_device(tensor)
    tmap = tensor_map(d_tensor, box=(1, ROWS, COLS), swizzle=swizzle)
    out = cuda.to_device(np.zeros((n_tiles, ROWS * COLS), np.uint16))
    ring_kernel(n_tiles, rows)[1, 128](tmap, out)
    got = out.copy_to_host()
    for t in range(n_tiles):
        plane, block = t // 2, t % 2
        expected = np.zeros((ROWS, COLS), np.uint16)
        part = tensor[plane, block * ROWS:(block + 1) * ROWS].view(np.uint16)
        expected[:len(part)] = part
        tile = unswizzle(got[t].view(np.uint8), swizzle).view(np.uint16).reshape(ROWS, COLS)
        np.testing.assert_array_equal(tile, expected, err_msg=f"tile {t} ({swizzle})")
    if swizzle == "128B":  # the swizzle moved the chunks: row 1's chunk 0 is stored in chunk 1
        raw = got[0].view(np.uint8)
        assert np.array_equal(raw[128 + 16:128 + 32], tensor[0, 1, :8].view(np.uint8))


@pytest.mark.parametrize("kwargs, message", [
    (dict(shape=(4, 60), strides_bytes=(120, 2), box=(4, 60)), "stride 120 bytes of dimension 0 is not a multiple of 16"),
    (dict(shape=(4, 64), strides_bytes=(128, 2), box=(4, 300)), "box: side 300 of dimension 1"),
    (dict(shape=(4, 64), strides_bytes=(128, 2), box=(4, 4)), "box: its innermost side is 8 bytes"),
    (dict(shape=(4, 128), strides_bytes=(256, 2), box=(4, 128)), "wider than the 128B swizzle"),
    (dict(shape=(4, 64), strides_bytes=(128, 4), box=(4, 64)), "innermost dimension must be contiguous"),
    (dict(shape=(4, 64), strides_bytes=(128, 2), box=(4, 64), address=8), "16-byte aligned address"),
    (dict(shape=(4, 64), strides_bytes=(128, 2), box=(64,)), "box: one side per dimension"),
])
def test_layouts_tma_cannot_describe_are_refused_by_name(kwargs, message):
    kwargs = dict(itemsize=2, swizzle="128B", **kwargs)
    with pytest.raises(ValueError, match=message):
        check_layout(**kwargs)


def test_a_describable_layout_is_accepted():
    layout = check_layout((32, 2048, 128), (2048 * 256, 256, 2), 2, (1, 64, 64), "128B")
    assert layout.box_bytes == 64 * 64 * 2


def test_tma_ptx_is_documented_and_assembles_for_hopper():
    from flashcore_numba.measure.machine_code import assemble

    path = ptx.ptx_dir() / "tma.ptx"
    _, cubin = assemble(path.read_text(), "sm_90a")
    assert cubin[:4] == b"\x7fELF"
    names = set(ptx.load("tma.ptx"))
    assert {"flashcore_tma_load_3d", "flashcore_mbarrier_wait", "flashcore_mbarrier_arrive_expect_tx"} <= names


# ---------------------------------------------------------------------------------------------
# Named barriers (ptx/warpgroup.ptx): the turns of phase 09's ping-pong
# ---------------------------------------------------------------------------------------------
def turns_kernel(rounds: int):
    bar_sync = ptx.function("warpgroup.ptx", "flashcore_bar_sync", "inline")
    bar_arrive = ptx.function("warpgroup.ptx", "flashcore_bar_arrive", "inline")

    @cuda.jit
    def turns(log):
        count = cuda.shared.array(1, int32)
        tid = cuda.threadIdx.x
        c = tid // 128  # two warpgroups take turns: c = 0 first
        if tid == 0:
            count[0] = 0
        cuda.syncthreads()
        if c == 1:
            bar_arrive(uint32(1), uint32(256))  # opens warpgroup 0's first turn
        for _ in range(rounds):
            bar_sync(uint32(1 + c), uint32(256))  # my turn
            if tid % 128 == 0:
                log[count[0]] = c
                count[0] += 1
            bar_arrive(uint32(1 + (1 - c)), uint32(256))  # the other's turn
        if c == 0:
            bar_sync(uint32(1), uint32(256))  # the last arrival of warpgroup 1: no barrier left half-full

    return turns


def test_named_barriers_make_two_warpgroups_alternate():
    if not simulator_enabled() and not _on_hopper():
        pytest.skip("the PTX of warpgroup.ptx is assembled for sm_90a")
    rounds = 5
    log = cuda.to_device(np.full(2 * rounds, -1, np.int32))
    turns_kernel(rounds)[1, 256](log)
    assert log.copy_to_host().tolist() == [0, 1] * rounds


def test_head_maps_refuse_what_is_not_one_head_after_another():
    from flashcore_numba.arch.tma import head_maps

    q = np.zeros((1, 2, 64, 64), np.float16)
    with pytest.raises(ValueError, match=r"array 0: expected \(B, H, S, D\)"):
        head_maps([cuda.to_device(q[0])], box=(1, 64, 64))
    if simulator_enabled():  # strides as NumPy has them: heads 64 * 2 bytes apart, rows 2 * 64 * 2
        heads_apart = np.zeros((1, 64, 2, 64), np.float16).transpose(0, 2, 1, 3)
        with pytest.raises(ValueError, match="array 0: its heads are not one after another"):
            head_maps([heads_apart], box=(1, 64, 64))


def test_head_maps_are_found_again_by_the_arrays_identity():
    """A launch on the same array objects reuses their maps without describing the arrays again;
    other arrays, and new objects at a recycled id, get maps of their own."""
    import gc

    from flashcore_numba.arch import tma

    # the cache starts over when it holds 16 entries: start from an empty one, so that the launches
    # of earlier tests cannot make it start over between the two calls below
    tma._LAST_MAPS.clear()
    arrays = [cuda.to_device(np.zeros((1, 2, 64, 64), np.float16)) for _ in range(3)]
    first = tma.head_maps(arrays, box=(1, 64, 64))
    assert tma.head_maps(arrays, box=(1, 64, 64)) is first
    assert tma.head_maps(arrays[::-1], box=(1, 64, 64)) is not first  # another order: other maps
    key = (*map(id, arrays), (1, 64, 64), "128B")
    refs, maps = tma._LAST_MAPS[key]
    assert maps is first and all(r() is a for r, a in zip(refs, arrays))
    del arrays, refs
    gc.collect()
    assert all(r() is None for r in tma._LAST_MAPS[key][0])  # the cache keeps no array alive

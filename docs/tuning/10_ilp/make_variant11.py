"""Writes p10v11.py beside this file: phase 10's module with each tile's copy issued before the
wait for the tile it is about to use, not after it.

The package's loop, at the top of iteration t: wait until tile t has landed (tile t + 1 may still
fly), then copy tile t + STAGES - 1 into the stage tile t - 1 used. So while a warp waits, only
STAGES - 1 of its tiles are in flight; its third stage, already read, stays empty until the wait
ends. Nsight Compute (../10_ncu_cudnn/, commit 1ceb7a8) has 44 % of the warps' samples at that
wait. Here the copy comes first: a barrier of the warp (every lane done with tile t - 1's stage),
the copy of tile t + STAGES - 1 and its commit, then the wait until at most STAGES - 1 groups are
pending, which is tile t landed. While the warp waits, all STAGES tiles are in flight; during the
tile's work, STAGES - 1, as before. No more shared memory; the prologue is unchanged."""
from pathlib import Path

here = Path(__file__).parent
src = (here / "../../../flashcore_numba/phases/p10_split_keys.py").read_text()
HEADER = [
    ("from ..arch import", "from flashcore_numba.arch import"),
    ("from ..arch.sim import", "from flashcore_numba.arch.sim import"),
    ("from .common import", "from flashcore_numba.phases.common import"),
    ("from .p07_mma_sync import", "from flashcore_numba.phases.p07_mma_sync import"),
]
AHEAD = [
    ('    wait_pending = ptx.function("cp_async.ptx", f"flashcore_cp_async_wait_{STAGES - 2}", "inline")\n',
     '    wait_pending = ptx.function("cp_async.ptx", f"flashcore_cp_async_wait_{STAGES - 2}", "inline")\n'
     '    wait_behind = ptx.function("cp_async.ptx", f"flashcore_cp_async_wait_{STAGES - 1}", "inline")\n'),
    ("""            wait_pending()  # this tile's group has landed (the STAGES - 2 newer ones may still fly)
            cuda.syncwarp()  # every lane's copies, and every lane done with the stage the next copy
            # overwrites (the one used last time round)
            next_n = start_n + int32((STAGES - 1) * BLOCK_N)
            if next_n < k_stop:
                copy_kv(smem, (stage + STAGES - 1) % STAGES, K, V, head_kv, h_kv, next_n, seq_k, lane, BLOCK_TABLE,
                        b, pages, whole_tiles)
                if PAGED and whole_tiles and next_n + BLOCK_N < k_stop:  # the tile after: its pages now
                    pages = tile_pages(BLOCK_TABLE, b, next_n + BLOCK_N, seq_k, page_size)
            commit()
""", """            cuda.syncwarp()  # every lane done with the stage the next copy overwrites (the one
            # used last time round)
            next_n = start_n + int32((STAGES - 1) * BLOCK_N)
            if next_n < k_stop:
                copy_kv(smem, (stage + STAGES - 1) % STAGES, K, V, head_kv, h_kv, next_n, seq_k, lane, BLOCK_TABLE,
                        b, pages, whole_tiles)
                if PAGED and whole_tiles and next_n + BLOCK_N < k_stop:  # the tile after: its pages now
                    pages = tile_pages(BLOCK_TABLE, b, next_n + BLOCK_N, seq_k, page_size)
            commit()
            wait_behind()  # this tile's group has landed (the STAGES - 1 newer ones may still fly)
            cuda.syncwarp()  # every lane's copies
"""),
]


def write(name, edits, source=src):
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    (here / f"{name}.py").write_text(source)
    return source


if __name__ == "__main__":
    write("p10v11", HEADER + AHEAD)

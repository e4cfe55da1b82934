"""Writes p10v12.py beside this file: phase 10's module with each warp's first K and V tiles (and
its block's rows of Q) asked of L2 at once, before the prologue's copies (dense caches only;
make_variant13.py: the first three tiles).

Nsight Compute at 1ceb7a8 (../10_ncu_cudnn/) has each warp executing about 750 instructions
before the prologue's wait for its first tile (the split's bounds, then Q's and two tiles'
cp.async, each a copy row by row with its bounds checked), 6 % of its stall samples there and
another 7 % at that wait: the kernel's first requests to DRAM go out over the first microseconds
while the memory is idle. Here lane 0 of each warp asks L2 for them as soon as the split's keys
are known: one bulk prefetch a tile of K and one of V (cp.async.bulk.prefetch.L2, prefetch.ptx),
and one for the warp's 16 rows of Q, so that the cp.asyncs that follow find them on their way.
Nothing waits for a prefetch and it cannot change a result."""
from make_variant7 import HEADER, write


def first_tiles_edits(TILES: int) -> list:
    """The edits for a prefetch of Q's rows and the first TILES tiles of the warp's keys."""
    return [
    ("""    copy_tile = make_copy_tile(L)
""", """    copy_tile = make_copy_tile(L)
    from flashcore_numba.arch.ptx import _inlined, parse
    from pathlib import Path as _Path
    prefetch_l2 = _inlined(parse(_Path(__file__).parent / "prefetch.ptx")["flashcore_prefetch_l2_bulk"])
    FIRST = %d
""" % TILES),
    ("""        k_stop = min(block_k_end, k_start + int32(tiles_per_split * BLOCK_N))
""", """        k_stop = min(block_k_end, k_start + int32(tiles_per_split * BLOCK_N))
        if not PAGED and lane == 0:
            for a in range(FIRST):
                far = k_start + int32(a * BLOCK_N)
                if far < k_stop:
                    nbytes = uint32(min(int32(BLOCK_N), int32(seq_k) - far) * ROW)
                    prefetch_l2(global_address(K) + head_kv + uint64(far) * uint64(ROW), nbytes)
                    prefetch_l2(global_address(V) + head_kv + uint64(far) * uint64(ROW), nbytes)
            prefetch_l2(global_address(Q) + head_q + uint64(row0) * uint64(ROW),
                        uint32(min(int32(BLOCK_M), rows - row0) * ROW))
"""),
]


if __name__ == "__main__":
    write("p10v12", HEADER + first_tiles_edits(2))

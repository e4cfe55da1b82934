"""Writes p10v9.py beside this file: phase 10's module with each warp's K and V tiles also
prefetched into L2, one tile past the newest cp.async (dense caches only; make_variant10.py: two).

The loop keeps STAGES - 1 = 2 tiles of its own in flight (16 KB of K and V each), issuing the next
copy only when a tile has landed and the warp is past its compute: on the GPU's clock the SMs
read at the copy's pace, but the kernel reads its 128 MiB in about 41 µs where a bare reader of
the same copies takes 35. Shared memory holds no more stages (four warps of three fill it). A
prefetch into L2 needs none: one lane asks for the whole tile (cp.async.bulk.prefetch.L2, one
instruction a tile for K and one for V), so that the cp.async AHEAD tiles later reads it from L2
instead of DRAM. Nothing waits for a prefetch and it cannot change a result."""
from make_variant7 import HEADER, write


def prefetch_edits(AHEAD: int) -> list:
    """The edits for a prefetch AHEAD tiles past the newest cp.async."""
    return [*loop_edits(AHEAD), *(prologue_edits(AHEAD) if AHEAD > 1 else [])]


def loop_edits(AHEAD):
    return [
    ("""    copy_tile = make_copy_tile(L)
""", """    copy_tile = make_copy_tile(L)
    from flashcore_numba.arch.ptx import _inlined, parse
    from pathlib import Path as _Path
    prefetch_l2 = _inlined(parse(_Path(__file__).parent / "prefetch.ptx")["flashcore_prefetch_l2_bulk"])
    AHEAD = %d
""" % AHEAD),
    ("""            commit()
            for j in range(NT):
                for e in range(4):
                    s[j, e] = float32(0.0)
""", """            commit()
            far = next_n + int32(AHEAD * BLOCK_N)
            if not PAGED and lane == 0 and far < k_stop:
                nbytes = uint32(min(int32(BLOCK_N), int32(seq_k) - far) * ROW)
                prefetch_l2(global_address(K) + head_kv + uint64(far) * uint64(ROW), nbytes)
                prefetch_l2(global_address(V) + head_kv + uint64(far) * uint64(ROW), nbytes)
            for j in range(NT):
                for e in range(4):
                    s[j, e] = float32(0.0)
"""),
]


def prologue_edits(AHEAD):  # the tiles the loop's first iterations would have prefetched
    return [("""        wait_pending()  # the first group, Q's rows with the first tile, has landed
""", """        if not PAGED and lane == 0:
            for a in range(AHEAD - 1):
                far = k_start + int32((STAGES + a) * BLOCK_N)
                if far < k_stop:
                    nbytes = uint32(min(int32(BLOCK_N), int32(seq_k) - far) * ROW)
                    prefetch_l2(global_address(K) + head_kv + uint64(far) * uint64(ROW), nbytes)
                    prefetch_l2(global_address(V) + head_kv + uint64(far) * uint64(ROW), nbytes)
        wait_pending()  # the first group, Q's rows with the first tile, has landed
""")]


if __name__ == "__main__":
    write("p10v9", HEADER + prefetch_edits(1))

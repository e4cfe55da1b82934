"""Writes p10v4.py beside this file: make_variant3.py's p10v3a.py (run that first) with the dense
build's whole-tile copies of K and V given their shared-memory destinations from four bases a warp
(for the next A/B, call3.sh). A lane's copy of pass i goes to chunk (c ^ (r % 8)) of row r + i R
(R rows a pass), and with R < 8 the row's swizzle (r + i R) % 8 is (r % 8) ^ ((i R) % 8): one of
8 / R patterns, i % (8 / R). So the warp keeps smem + r row + (chunk's swizzled offset ^ pattern m)
for each m, and a copy's destination is one of them plus the stage's offset plus whole rows (an
immediate), where it was an add, an XOR and an add every copy (p07's `copy_tile`, which the last
tile of a range, a row past the keys zero-filled, still takes). GPU only, as p10v3a."""
from pathlib import Path

here = Path(__file__).parent
src = (here / "p10v3a.py").read_text()
edits = [
    ("        smem = shared_address(smem_h) + uint32(warp * WARP_BYTES)  # the warp's Q tile and stages\n",
     """        smem = shared_address(smem_h) + uint32(warp * WARP_BYTES)  # the warp's Q tile and stages
        dbase = cuda.local.array(PATTERNS, uint32)  # where this lane's copies of a whole tile go
        for m in range(PATTERNS):
            dbase[m] = smem + uint32((lane // CHUNKS) * ROW_BYTES +
                                     ((((lane % CHUNKS) ^ ((lane // CHUNKS) % 8)) * 16) ^ (((m * ROWS_PER_PASS) % 8) * 16)))
"""),
    ("    def copy_kv(smem, stage, K, V, head_kv, h_kv, key0, seq_k, lane, BLOCK_TABLE, b, pages, whole_tiles):\n",
     "    def copy_kv(smem, stage, K, V, head_kv, h_kv, key0, seq_k, lane, BLOCK_TABLE, b, pages, whole_tiles, dbase):\n"),
    ("""        else:
            copy_tile(smem, k_off, global_address(K), head_kv, key0, BLOCK_N, seq_k, lane, ROW)
            copy_tile(smem, v_off, global_address(V), head_kv, key0, BLOCK_N, seq_k, lane, ROW)
""", """        elif key0 + BLOCK_N <= seq_k:  # a whole tile: every copy from one of the warp's bases
            off = head_kv + uint64((lane % CHUNKS) * 16) + uint64(key0 + lane // CHUNKS) * uint64(ROW)
            kb, vb = global_address(K) + off, global_address(V) + off
            for i in range(BLOCK_N // ROWS_PER_PASS):
                rows = uint32(i * ROWS_PER_PASS * ROW_BYTES)
                copy16(dbase[i % PATTERNS] + uint32(k_off) + rows, kb + uint64(i * ROWS_PER_PASS * ROW), uint32(16))
                copy16(dbase[i % PATTERNS] + uint32(v_off) + rows, vb + uint64(i * ROWS_PER_PASS * ROW), uint32(16))
        else:
            copy_tile(smem, k_off, global_address(K), head_kv, key0, BLOCK_N, seq_k, lane, ROW)
            copy_tile(smem, v_off, global_address(V), head_kv, key0, BLOCK_N, seq_k, lane, ROW)
"""),
    ("    CHUNKS, ROWS_PER_PASS = L[\"CHUNKS\"], L[\"ROWS_PER_PASS\"]\n",
     "    CHUNKS, ROWS_PER_PASS = L[\"CHUNKS\"], L[\"ROWS_PER_PASS\"]\n"
     "    assert ROWS_PER_PASS in (1, 2, 4, 8)\n    PATTERNS = 8 // ROWS_PER_PASS  # the row swizzles a lane's passes go through\n"),
    ("copy_kv(smem, st, K, V, head_kv, h_kv, key0, seq_k, lane, BLOCK_TABLE, b, pages, whole_tiles)",
     "copy_kv(smem, st, K, V, head_kv, h_kv, key0, seq_k, lane, BLOCK_TABLE, b, pages, whole_tiles, dbase)"),
]
for old, new in edits:
    assert src.count(old) == 1, old
    src = src.replace(old, new)
old = "copy_kv(smem, (stage + STAGES - 1) % STAGES, K, V, head_kv, h_kv, next_n, seq_k, lane, BLOCK_TABLE,\n                        b, pages, whole_tiles)"
assert src.count(old) == 1, old
src = src.replace(old, "copy_kv(smem, (stage + STAGES - 1) % STAGES, K, V, head_kv, h_kv, next_n, seq_k, lane, BLOCK_TABLE,\n                        b, pages, whole_tiles, dbase)")
(here / "p10v4.py").write_text(src)

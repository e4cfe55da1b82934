"""Writes p10v2.py beside this file: phase 10's module as it is at commit b98d182 (its edits match
that version) with the key loop's bookkeeping in 32 bits, for the next A/B (README.md, "What the
loop is made of now"): the stage indices without a `%` (the next stage is the one before this one),
and the loop's bounds and the next tile's first key as int32 (Numba types int32 + int32 as int64, so
each sum is taken back to int32). The same results; fewer instructions a tile (loop_sass.py on
p10v2, `python3 loop_sass.py p10v2`)."""
from pathlib import Path

here = Path(__file__).parent
src = (here / "../../../flashcore_numba/phases/p10_split_keys.py").read_text()
edits = [
    ("from ..arch import", "from flashcore_numba.arch import"),
    ("from ..arch.sim import", "from flashcore_numba.arch.sim import"),
    ("from .common import", "from flashcore_numba.phases.common import"),
    ("from .p07_mma_sync import", "from flashcore_numba.phases.p07_mma_sync import"),
    ("        k_stop = min(block_k_end, k_start + int32(tiles_per_split * BLOCK_N))\n",
     "        k_stop = int32(min(block_k_end, k_start + int32(tiles_per_split * BLOCK_N)))\n"),
    ("        stage = 0\n        for start_n in range(k_start, k_stop, int32(BLOCK_N)):\n",
     "        stage = int32(0)\n        for start_n in range(k_start, k_stop, int32(BLOCK_N)):\n"),
    ("            next_n = start_n + int32((STAGES - 1) * BLOCK_N)\n",
     "            next_n = int32(start_n + int32((STAGES - 1) * BLOCK_N))\n"),
    ("                copy_kv(smem, (stage + STAGES - 1) % STAGES, K, V,",
     "                copy_kv(smem, int32(stage - 1) if stage > 0 else int32(STAGES - 1), K, V,"),
    ("            stage = stage + 1 if stage + 1 < STAGES else 0\n",
     "            stage = int32(stage + 1) if stage < STAGES - 1 else int32(0)\n"),
]
for old, new in edits:
    assert src.count(old) == 1, old
    src = src.replace(old, new)
(here / "p10v2.py").write_text(src)

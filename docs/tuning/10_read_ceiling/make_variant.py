"""Writes p10v.py beside this file: phase 10's module (at the commit the tables name) with parts that
environment variables leave out, each folded away when Numba compiles it (module globals are
constants): NOMATH=1 no ldmatrix or mma in the key loop (the copies, waits and softmax stay);
NOMERGE=1 the block returns once its warps' partials are in shared memory; NOROOT=1 the block
returns after writing its own partial (no merge across blocks). Only NOMATH-free, merge-complete
builds give correct outputs; var.py times each."""
from pathlib import Path

here = Path(__file__).parent
src = (here / "../../../flashcore_numba/phases/p10_split_keys.py").read_text()
edits = [("from ..arch import", "from flashcore_numba.arch import"),
         ("from ..arch.sim import", "from flashcore_numba.arch.sim import"),
         ("from .common import", "from flashcore_numba.phases.common import"),
         ("from .p07_mma_sync import", "from flashcore_numba.phases.p07_mma_sync import"),
         ("            qk_steps(0, (", "            if not NOMATH: qk_steps(0, ("),
         ("            pv_steps(0, (", "            if not NOMATH: pv_steps(0, ("),
         ("        cuda.syncthreads()  # every warp's partial is written\n",
          "        cuda.syncthreads()  # every warp's partial is written\n        if NOMERGE:\n            return\n"),
         ("        if last_level:\n            return\n\n        # -- the levels across blocks",
          "        if last_level or NOROOT:\n            return\n\n        # -- the levels across blocks"),
         ('ID = "10"', 'import os\nNOMATH = os.environ.get("NOMATH") == "1"\nNOMERGE = os.environ.get("NOMERGE") == "1"\n'
                       'NOROOT = os.environ.get("NOROOT") == "1"\nID = "10"')]
for old, new in edits:
    assert src.count(old) == 1, old
    src = src.replace(old, new)
(here / "p10v.py").write_text(src)

"""Writes p10_old.py beside this file: phase 10's module at the commit given (default: the one before
its divisions moved to 32 bits), relative imports made absolute, for ab_divisions.py."""
import subprocess
import sys
from pathlib import Path

commit = sys.argv[1] if len(sys.argv) > 1 else "1ad01e7"
src = subprocess.check_output(["git", "show", f"{commit}:flashcore_numba/phases/p10_split_keys.py"], text=True)
for old, new in [("from ..arch import", "from flashcore_numba.arch import"),
                 ("from ..arch.sim import", "from flashcore_numba.arch.sim import"),
                 ("from .common import", "from flashcore_numba.phases.common import"),
                 ("from .p07_mma_sync import", "from flashcore_numba.phases.p07_mma_sync import")]:
    src = src.replace(old, new)
(Path(__file__).parent / "p10_old.py").write_text(src)

"""Writes p10_paged.py beside this file: the package's phase 10 with paged_copy.diff applied (the
paged build's K and V copies sharing one address computation a key, not yet in the package), its
relative imports made absolute, for ab_divisions.py's third variant ("paged")."""
import subprocess
import tempfile
from pathlib import Path

here = Path(__file__).parent
root = here.parents[2]
with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "p10.py"
    subprocess.run(["patch", "-p1", "--quiet", f"--output={out}", str(root / "flashcore_numba/phases/p10_split_keys.py"),
                    str(here / "paged_copy.diff")], check=True)
    src = out.read_text()
for old, new in [("from ..arch import", "from flashcore_numba.arch import"),
                 ("from ..arch.sim import", "from flashcore_numba.arch.sim import"),
                 ("from .common import", "from flashcore_numba.phases.common import"),
                 ("from .p07_mma_sync import", "from flashcore_numba.phases.p07_mma_sync import")]:
    src = src.replace(old, new)
(here / "p10_paged.py").write_text(src)

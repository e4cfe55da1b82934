"""Writes p10_paged.py beside this file: phase 10 at commit 119ffa9 (the diff's base) with
paged_copy.diff applied (the paged build's K and V copies sharing one address computation a key; in
the package since 066f7ba), its relative imports made absolute, for ab_divisions.py's third variant
("paged")."""
import subprocess
import tempfile
from pathlib import Path

here = Path(__file__).parent
root = here.parents[2]
BASE = "119ffa9"
with tempfile.TemporaryDirectory() as tmp:
    base, out = Path(tmp) / "base.py", Path(tmp) / "p10.py"
    base.write_text(subprocess.run(["git", "-C", str(root), "show", f"{BASE}:flashcore_numba/phases/p10_split_keys.py"],
                                   check=True, capture_output=True, text=True).stdout)
    subprocess.run(["patch", "-p1", "--quiet", f"--output={out}", str(base), str(here / "paged_copy.diff")], check=True)
    src = out.read_text()
for old, new in [("from ..arch import", "from flashcore_numba.arch import"),
                 ("from ..arch.sim import", "from flashcore_numba.arch.sim import"),
                 ("from .common import", "from flashcore_numba.phases.common import"),
                 ("from .p07_mma_sync import", "from flashcore_numba.phases.p07_mma_sync import")]:
    src = src.replace(old, new)
(here / "p10_paged.py").write_text(src)

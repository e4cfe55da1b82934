"""Writes p10v10.py: make_variant9.py's prefetch two tiles past the newest cp.async."""
import subprocess, sys
from pathlib import Path
here = Path(__file__).parent
subprocess.run([sys.executable, str(here / "make_variant9.py"), "2"], check=True, cwd=here)
(here / "p10v9_2.py").rename(here / "p10v10.py")

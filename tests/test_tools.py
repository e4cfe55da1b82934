"""The scripts in tools/ answer bad arguments clearly (their GPU work runs on a GPU machine)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_sanitize_names_an_unknown_kernel():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "sanitize.py"), "--kernels", "01,99"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--kernels: unknown 99" in done.stderr, done.stderr

"""Collecting the suite never fails for a missing optional dependency: those tests skip, saying why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

@pytest.mark.parametrize("missing", ["nbformat", "jupytext"])
def test_collection_without_an_optional_module(tmp_path, missing):
    # a module of that name that fails to import stands in for "not installed"
    (tmp_path / f"{missing}.py").write_text(f"raise ImportError({f'No module named {missing}'!r})\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-rs", str(ROOT / "tests")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "error" not in done.stdout.splitlines()[-1].lower(), done.stdout[-2000:]
    assert f"{missing} is not installed" in done.stdout, done.stdout[-2000:]

"""Test set-up shared by every test file.

CPU by default: unless FLASHCORE_GPU=1 is set, the whole session runs in Numba's CUDA
simulator (NUMBA_ENABLE_CUDASIM=1), which must be chosen before numba.cuda is imported.
Tests marked `gpu` need a real GPU and skip, with the reason, in the simulator. On a GPU
machine: `FLASHCORE_GPU=1 python -m pytest -m gpu`.
"""

import os

if os.environ.get("FLASHCORE_GPU", "0") in ("", "0"):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest  # noqa: E402

from flashcore_numba.arch.sim import simulator_enabled  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if not simulator_enabled():
        from numba import cuda

        if cuda.is_available():
            return
        reason = "no CUDA GPU is available"
    else:
        reason = "runs in the CUDA simulator (set FLASHCORE_GPU=1 on a GPU machine to run GPU tests)"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

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


def test_long_context_oracle_on_sampled_rows():
    """The row-sampled reference of the long-context record equals the full reference on those rows."""
    import numpy as np

    from flashcore_numba.measure.long_context import sampled_reference
    from flashcore_numba.reference import default_scale, lowp_attention, random_qkv, reference_attention

    for causal, s_k in ((False, None), (True, None), (True, 9), (True, 30)):
        q, k, v = random_qkv((1, 2, 20, 64), s_k)
        rows = [0, 3, 11, 19]
        ref, lowp = sampled_reference(q, k, v, rows, causal=causal, scale=default_scale(64))
        full = reference_attention(q, k, v, causal=causal)[:, :, rows]
        np.testing.assert_allclose(ref, full, rtol=1e-12, atol=1e-12)
        yardstick = lowp_attention(q, k, v, causal=causal)[:, :, rows]
        assert np.abs(lowp - full).max() < 4 * np.abs(yardstick - full).max() + 1e-3


def test_host_time_names_a_bad_shape():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "host_time.py"), "--shape", "1,2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--shape: expected four integers" in done.stderr, done.stderr


def test_ab_variants_names_a_bad_variant():
    for bad, says in (("nosuch.py", "the source must be `head` or an existing .py file"),
                      ("head:64,32", "expected BLOCK_M,BLOCK_N,WARPS[,BLOCKS_PER_SM]"),
                      ("head:64,x,4", "expected BLOCK_M,BLOCK_N,WARPS[,BLOCKS_PER_SM]")):
        done = subprocess.run([sys.executable, str(ROOT / "tools" / "ab_variants.py"), "head", bad],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and f"variant {bad!r}: {says}" in done.stderr, done.stderr

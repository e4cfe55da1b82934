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


def test_sanitize_says_what_each_mode_runs():
    """--backward and --inference run kernels of their own (not --kernels'), and each mode compiles
    into the cache what its children launch, so that no child compiles under the sanitizer."""
    import importlib.util

    for argv, says in ((["--inference", "--kernels", "07"], "--kernels: names forward kernels"),
                       (["--inference", "--backward"], "not allowed with argument"),
                       (["--inference", "--child"], "--child: runs the forward kernels")):
        done = subprocess.run([sys.executable, str(ROOT / "tools" / "sanitize.py"), *argv],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and says in done.stderr, done.stderr
    spec = importlib.util.spec_from_file_location("sanitize", ROOT / "tools" / "sanitize.py")
    sanitize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sanitize)
    from types import SimpleNamespace

    from flashcore_numba.runtime.precompile import kernel_ids

    def ids(**mode):
        return sanitize.kernels_to_prepare(SimpleNamespace(**{"backward": False, "inference": False, **mode}),
                                           ["07", "10"])

    assert ids() == ["07", "10"] and ids(backward=True) == ["11", "12"]
    assert ids(inference=True) == ["10-kvcache", "07-varlen", "09-varlen"]
    assert set(ids(inference=True)) <= set(kernel_ids())
    # a log is clean only when its summary has nothing in it: racecheck's warnings are hazards too
    assert sanitize.is_clean("========= ERROR SUMMARY: 0 errors")
    assert sanitize.is_clean("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)")
    assert not sanitize.is_clean("========= RACECHECK SUMMARY: 60 hazards displayed (0 errors, 60 warnings)")
    assert not sanitize.is_clean("========= ERROR SUMMARY: 10 errors")


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

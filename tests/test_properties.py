"""What every kernel must satisfy, whatever the phase: the guarantees written as tests.

- Property-based (hypothesis): random S_q, S_k (tails everywhere), causal or not, the softmax
  scale, D = 64 / 128, against the float64 reference (the output, and the log-sum-exp of the
  phases that write it). In the simulator (CPU) with a few tiny
  examples per phase; on a GPU (`gpu` marker) with many more, every kernel including the build
  variants ("06-inline").
- Numerics: rows that see no key give zeros (never NaN); logits far beyond fp16's range stay
  finite where the reference is; a single visible key returns its value row exactly.
- Determinism (GPU): the same inputs give bit-identical outputs, run after run.

Every new phase is covered by being in the registry.
"""

from __future__ import annotations

import numpy as np
import pytest

from flashcore_numba import check_close, lowp_attention, reference_attention
from flashcore_numba.arch.sim import simulator_enabled
from flashcore_numba.phases import KERNELS, PHASES, build
from flashcore_numba.phases.common import LOG2E
from flashcore_numba.reference import default_scale, random_qkv, reference_lse

pytestmark = pytest.mark.beside  # long simulator runs: a child pytest runs them on the second core (conftest.py)

ON_GPU = not simulator_enabled()
# the simulator runs every phase (variants share their phase's emulated code); a GPU every kernel
IDS = list(KERNELS) if ON_GPU else list(PHASES)


def run_with_lse(kernel_id, q, k, v, causal, scale=None):
    """Launch a kernel on poisoned (NaN) output memory; returns what it wrote: the output, and the
    rows' log-sum-exp for a kernel that writes it (return_lse, phases 07 on), else None."""
    from numba import cuda

    D = q.shape[-1]
    scale = default_scale(D) if scale is None else scale
    out = cuda.to_device(np.full(q.shape, np.nan, dtype=np.float16))
    config = build(KERNELS[kernel_id], D)  # keyed: on a GPU the kernel loads from the disk cache
    lse = cuda.to_device(np.full(q.shape[:3], np.nan, dtype=np.float32)) if config.lse else None
    config.launch(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), out, causal, scale * LOG2E, lse=lse)
    return out.copy_to_host(), (None if lse is None else lse.copy_to_host())


def run(kernel_id, q, k, v, causal, scale=None):
    return run_with_lse(kernel_id, q, k, v, causal, scale)[0]


def assert_matches_reference(kernel_id, q, k, v, causal, scale=None):
    """The output against the float64 reference, and where the kernel writes it, the log-sum-exp:
    -inf exactly for the rows that see no key, and within fp32 rounding elsewhere."""
    out, lse = run_with_lse(kernel_id, q, k, v, causal, scale)
    what = f"{kernel_id} q{q.shape} k{k.shape} causal={causal} scale={scale}"
    ref = reference_attention(q, k, v, causal=causal, scale=scale)
    verdict = check_close(out, ref, lowp_attention(q, k, v, causal=causal, scale=scale))
    assert verdict.ok, f"{what}: {verdict.message}"
    if lse is not None:
        ref_lse = reference_lse(q, k, causal=causal, scale=scale)
        empty = np.isneginf(ref_lse)
        np.testing.assert_array_equal(np.isneginf(lse), empty, err_msg=f"{what}: rows without keys")
        np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=1e-5, atol=1e-3, err_msg=f"{what}: LSE")


def require_hypothesis():
    """The property-based tests need hypothesis (the `dev` extra): without it they skip, saying
    why, and the other tests of this file run."""
    return pytest.importorskip("hypothesis", reason="hypothesis is not installed (pip install -e '.[dev]')",
                               exc_type=ImportError)


def problems(max_s: int):
    from hypothesis import strategies as st

    return st.tuples(st.integers(1, max_s), st.integers(1, max_s), st.booleans(),
                     st.sampled_from([None, 0.05, 0.3, 1.0, 2.0]), st.sampled_from([64, 128]))


# -- property-based ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kernel_id", IDS)
def test_random_problems_in_the_simulator(kernel_id):
    if ON_GPU:
        pytest.skip("the GPU variant of this test runs with more examples (test_random_problems_on_gpu)")
    require_hypothesis()
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=3, deadline=None, derandomize=False, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(problem=problems(max_s=70), seed=st.integers(0, 2**31 - 1))
    def check(problem, seed):
        s_q, s_k, causal, scale, D = problem
        q, k, v = random_qkv((1, 1, s_q, D), s_k, seed=seed)
        assert_matches_reference(kernel_id, q, k, v, causal, scale)

    check()


@pytest.mark.gpu
@pytest.mark.parametrize("kernel_id", IDS)
def test_random_problems_on_gpu(kernel_id):
    require_hypothesis()
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(problem=problems(max_s=400), batch=st.integers(1, 3), heads=st.integers(1, 3),
           seed=st.integers(0, 2**31 - 1))
    def check(problem, batch, heads, seed):
        s_q, s_k, causal, scale, D = problem
        q, k, v = random_qkv((batch, heads, s_q, D), s_k, seed=seed)
        assert_matches_reference(kernel_id, q, k, v, causal, scale)

    check()


# -- numerics ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel_id", IDS)
def test_rows_without_keys_are_zero(kernel_id):
    """Causal with S_q > S_k: the first S_q - S_k rows see no key (bottom-right alignment)."""
    q, k, v = random_qkv((1, 2, 12, 64), 5)
    out = run(kernel_id, q, k, v, causal=True)
    assert not np.isnan(out).any(), f"{kernel_id}: NaN in the output"
    assert np.array_equal(out[:, :, :7], np.zeros_like(out[:, :, :7])), f"{kernel_id}: rows without keys not 0"
    verdict = check_close(out, reference_attention(q, k, v, causal=True), lowp_attention(q, k, v, causal=True))
    assert verdict.ok, f"{kernel_id}: {verdict.message}"


@pytest.mark.parametrize("kernel_id", IDS)
def test_huge_logits_stay_finite(kernel_id):
    """|q·k| scale up to ~1e5, far beyond fp16's range: the running max keeps exp2 finite."""
    rng = np.random.default_rng()
    q = (rng.standard_normal((1, 1, 40, 64)) * 60).astype(np.float16)
    k = (rng.standard_normal((1, 1, 40, 64)) * 60).astype(np.float16)
    v = rng.standard_normal((1, 1, 40, 64)).astype(np.float16)
    ref = reference_attention(q, k, v)
    assert np.isfinite(ref).all()
    out = run(kernel_id, q, k, v, causal=False)
    assert np.isfinite(out).all(), f"{kernel_id}: non-finite output for finite reference"
    # one key dominates each row: the output is (nearly) that key's value row
    verdict = check_close(out, ref, lowp_attention(q, k, v))
    assert verdict.ok, f"{kernel_id}: {verdict.message}"


@pytest.mark.parametrize("kernel_id", IDS)
@pytest.mark.parametrize("rise", [pytest.param(6.0, marks=pytest.mark.slow), 300.0], ids=["gentle", "steep"])
def test_scores_that_rise_along_the_keys(kernel_id, rise):
    """The row max keeps growing from tile to tile: by a few units in all (a kernel whose running
    max may trail, as phase 07's does by up to 8 in log2 units, then never rescales after the first
    tile) or by far more than that in every tile (it must rescale each time). One launch each (the
    gentle rise without a mask, the steep one with the causal mask, bottom-right aligned, so each
    row sees at least 135 keys): two launches per kernel, the suite's budget. 16 query rows: one
    row tile of phase 10 (its 16-row tiles: 20 rows took it twice the blocks); the rise is along
    the keys, and every phase's other blocks of rows are test_phase_matches_reference's."""
    rng = np.random.default_rng()
    s_q, s_k, D = 16, 150, 64
    q = (rng.standard_normal((1, 1, s_q, D)) * 0.1).astype(np.float16)
    k = (rng.standard_normal((1, 1, s_k, D)) * 0.1).astype(np.float16)
    v = rng.standard_normal((1, 1, s_k, D)).astype(np.float16)
    q[..., 0] = 1.0
    k[..., 0] = np.linspace(0.0, rise, s_k)  # q·k grows with the key index, the same for every row
    assert_matches_reference(kernel_id, q, k, v, causal=rise > 10)


@pytest.mark.parametrize("kernel_id", IDS)
def test_single_visible_key_is_exact(kernel_id):
    """S_k = 1, and the first row of a causal problem: p = 1 exactly, so out = v bit for bit."""
    q, k, v = random_qkv((1, 2, 9, 64), 1)
    out = run(kernel_id, q, k, v, causal=False)
    assert np.array_equal(out, np.broadcast_to(v, out.shape)), f"{kernel_id}: S_k = 1 is not v"
    q, k, v = random_qkv((1, 1, 17, 128))
    out = run(kernel_id, q, k, v, causal=True)
    assert np.array_equal(out[:, :, 0], v[:, :, 0]), f"{kernel_id}: causal row 0 is not v[0]"


# -- determinism -------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kernel_id", IDS)
def test_bit_identical_across_runs(kernel_id):
    q, k, v = random_qkv((2, 3, 333, 64), 301)
    for causal in (False, True):
        first = run(kernel_id, q, k, v, causal)
        for _ in range(3):
            assert np.array_equal(run(kernel_id, q, k, v, causal).view(np.uint16), first.view(np.uint16)), (
                f"{kernel_id} causal={causal}: outputs differ between runs")

"""attention_kvcache (flashcore_numba/inference.py): phase 10 on a KV cache, contiguous or paged, in
the simulator (GPU: tests/test_gpu.py), against the float64 reference sequence by sequence."""

import numpy as np
import pytest

from flashcore_numba import attention_kvcache, check_close
from flashcore_numba.reference import reference_kvcache

pytestmark = pytest.mark.beside  # long simulator runs: a child pytest runs them on the second core (conftest.py)


def make_cache(B, S_q, H, H_kv, D, lengths, page_size=None, spare_pages=3, seed=0):
    """q (B, S_q, H, D) and a cache holding `lengths` keys per sequence: contiguous (B, capacity,
    H_kv, D), or paged with pages handed out in a shuffled order (plus spare pages never used)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, S_q, H, D)).astype(np.float16)
    lengths = np.asarray(lengths, np.int32)
    if page_size is None:
        capacity = max(int(lengths.max()), 1) + 5
        k = rng.standard_normal((B, capacity, H_kv, D)).astype(np.float16)
        v = rng.standard_normal((B, capacity, H_kv, D)).astype(np.float16)
        return q, k, v, lengths, None
    per_seq = max(1, -(-int(lengths.max()) // page_size))
    n_pages = B * per_seq + spare_pages
    k = rng.standard_normal((n_pages, page_size, H_kv, D)).astype(np.float16)
    v = rng.standard_normal((n_pages, page_size, H_kv, D)).astype(np.float16)
    table = rng.permutation(n_pages)[:B * per_seq].reshape(B, per_seq).astype(np.int32)
    return q, k, v, lengths, table


def check(q, k, v, lengths, table, causal=True, scale=None):
    out, lse = attention_kvcache(q, k, v, lengths, table, causal=causal, scale=scale, return_lse=True)
    ref, ref_lse, lowp = reference_kvcache(q, k, v, lengths, table, causal=causal, scale=scale,
                                           lowp_dtype=np.float16)
    assert out.shape == q.shape and out.dtype == np.float16 and lse.shape == ref_lse.shape
    verdict = check_close(out, ref, lowp)
    assert verdict.ok, verdict.message
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    seen = ~np.isneginf(ref_lse)
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", [
    pytest.param(dict(B=3, S_q=1, H=4, H_kv=2, D=64, lengths=[70, 1, 33]), id="contiguous, ragged, GQA 2"),
    pytest.param(dict(B=2, S_q=3, H=4, H_kv=1, D=64, lengths=[50, 0], page_size=16), id="paged 16, MQA, empty seq"),
    pytest.param(dict(B=2, S_q=1, H=2, H_kv=2, D=128, lengths=[45, 90], page_size=32), id="paged 32, D=128", marks=pytest.mark.slow),
    pytest.param(dict(B=1, S_q=2, H=8, H_kv=2, D=64, lengths=[37], page_size=48), id="page size not a tile's"),
    pytest.param(dict(B=3, S_q=1, H=2, H_kv=1, D=64, lengths=[5, 9, 0]), id="a cache shorter than a tile"),
])
def test_kvcache_matches_the_reference(case):
    """Ragged lengths (0, 1 and ones that divide no page or tile), pages in a shuffled order,
    grouped query heads, drafted rows under the causal mask aligned to each sequence's end."""
    check(*make_cache(**case))


def test_kvcache_without_the_causal_mask_and_with_a_scale():
    check(*make_cache(B=2, S_q=4, H=2, H_kv=1, D=64, lengths=[40, 3], page_size=16), causal=False, scale=0.3)


@pytest.mark.parametrize("page_size", [16, pytest.param(48, marks=pytest.mark.slow)],
                         ids=["pages of 16 (read per key)", "pages of 48 (a tile's pages)"])
def test_pages_smaller_than_a_tile(page_size, monkeypatch):
    """The simulator's tiles are 16 keys, so every page size holds a whole tile there, and the
    kernel's other copy (copy_kv_pages: a page smaller than a tile, the block table read for
    every key, as on the GPU at 16-key pages) would run only on a GPU. Built here with tiles of
    32 keys: pages of 16 take that copy, pages of 48 the whole-tile one with a tile across two
    pages; both against the reference, and bit for bit against the contiguous cache."""
    import dataclasses

    from flashcore_numba import inference
    from flashcore_numba.phases import p10_split_keys as p10

    config = p10.build_kernel(p10.split_layout(64, block_n=32, stages=3), "float16", paged=True)
    config = dataclasses.replace(config, cache_key=())
    monkeypatch.setattr(inference, "build_kvcache", lambda D, dtype: config)
    q, k, v, lengths, table = make_cache(B=2, S_q=2, H=4, H_kv=2, D=64, lengths=[75, 20], page_size=page_size)
    check(q, k, v, lengths, table)
    capacity = table.shape[1] * page_size
    dense_k, dense_v = (x[table].reshape(2, capacity, 2, 64) for x in (k, v))
    paged = attention_kvcache(q, k, v, lengths, table)
    np.testing.assert_array_equal(paged, attention_kvcache(q, dense_k, dense_v, lengths))


def test_paged_equals_contiguous():
    """The same keys in a contiguous cache and scattered over pages give the same output, bit for bit."""
    q, k, v, lengths, table = make_cache(B=2, S_q=1, H=4, H_kv=2, D=64, lengths=[60, 35], page_size=16)
    capacity = table.shape[1] * 16
    dense_k = np.stack([k[table[b]].reshape(capacity, 2, 64) for b in range(2)])
    dense_v = np.stack([v[table[b]].reshape(capacity, 2, 64) for b in range(2)])
    paged = attention_kvcache(q, k, v, lengths, table)
    dense = attention_kvcache(q, dense_k, dense_v, lengths)
    np.testing.assert_array_equal(paged, dense)


def _errors(**changes):
    q, k, v, lengths, table = make_cache(B=2, S_q=1, H=4, H_kv=2, D=64, lengths=[20, 10], page_size=16)
    args = dict(q=q, k_cache=k, v_cache=v, cache_seqlens=lengths, block_table=table)
    args.update(changes)
    return args


@pytest.mark.parametrize("changes,error,name", [
    (dict(cache_seqlens=np.array([20, 999], np.int32)), ValueError, "cache_seqlens"),
    (dict(cache_seqlens=np.array([20, -1], np.int32)), ValueError, "cache_seqlens"),
    (dict(cache_seqlens=np.array([20, 10], np.int64)), TypeError, "cache_seqlens"),
    (dict(cache_seqlens=np.array([20], np.int32)), ValueError, "cache_seqlens"),
    (dict(block_table=np.array([[0, 1], [999, 3]], np.int32)), ValueError, "block_table"),
    (dict(block_table=np.array([[0, 1], [2, 999]], np.int32)), None, "unused"),  # page 1 of a 10-key sequence: unread
    (dict(block_table=np.array([[0, 1], [2, 3]], np.int64)), TypeError, "block_table"),
    (dict(block_table=np.zeros((3, 2), np.int32)), ValueError, "block_table"),
    (dict(q=np.zeros((2, 1, 3, 64), np.float16)), ValueError, "k_cache"),
    (dict(q=np.zeros((2, 1, 4, 100), np.float16)), ValueError, "q"),  # no phase takes D = 100
    (dict(q=np.zeros((2, 1, 4, 64), np.float32)), TypeError, "q"),
    (dict(v_cache=np.zeros((3, 16, 2, 64), np.float16)), ValueError, "v_cache"),
    (dict(k_cache=np.zeros((20, 24, 2, 64), np.float16), v_cache=np.zeros((20, 24, 2, 64), np.float16)),
     ValueError, "k_cache"),
])
def test_bad_input_names_the_argument(changes, error, name):
    """validate=True (what FLASHCORE_VALIDATE=1 turns on) checks the index arrays' values too."""
    if error is None:  # not an error: a table entry past a sequence's pages is never read
        attention_kvcache(**_errors(**changes), validate=True)
        return
    with pytest.raises(error, match=rf"^{name}:"):
        attention_kvcache(**_errors(**changes), validate=True)


@pytest.mark.parametrize("changes,same_as", [
    pytest.param(dict(cache_seqlens=np.array([20, 999], np.int32)), dict(cache_seqlens=np.array([20, 32], np.int32)),
                 id="a length past the capacity reads the capacity"),
    pytest.param(dict(cache_seqlens=np.array([-7, 10], np.int32)), dict(cache_seqlens=np.array([0, 10], np.int32)),
                 id="a negative length is 0"),
    pytest.param(dict(block_table=np.array([[0, 1], [999, 3]], np.int32)),
                 dict(block_table=np.array([[0, 1], [6, 3]], np.int32)), id="a page id past the pool is its last"),
    pytest.param(dict(block_table=np.array([[-4, 1], [2, 3]], np.int32)),
                 dict(block_table=np.array([[0, 1], [2, 3]], np.int32)), id="a negative page id is page 0"),
])
def test_wrong_values_are_clamped_never_read_outside_the_cache(changes, same_as):
    """Without validate, the lengths and page ids are the caller's promise (nothing is copied back
    from the GPU to check them, as in FlashAttention): the kernel clamps what it reads, so a wrong
    value gives a wrong row, never a read outside the cache. The simulator raises IndexError on any
    read outside an array; the result is the clamped values' result, bit for bit."""
    got = attention_kvcache(**_errors(**changes), return_lse=True)
    expected = attention_kvcache(**_errors(**same_as), return_lse=True)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError):
        attention_kvcache(**_errors(**changes), validate=True)


def test_a_contiguous_cache_needs_a_row_per_sequence():
    q, k, v, lengths, _ = make_cache(B=2, S_q=1, H=2, H_kv=2, D=64, lengths=[5, 6])
    with pytest.raises(ValueError, match="^k_cache:.*block_table"):
        attention_kvcache(q, k[:1], v[:1], lengths)
    with pytest.raises(TypeError, match="^causal:"):
        attention_kvcache(q, k, v, lengths, causal=1)


def kvcache_problems(max_len: int, max_batch: int):
    from hypothesis import strategies as st

    return st.fixed_dictionaries(dict(
        B=st.integers(1, max_batch), S_q=st.integers(1, 3), group=st.sampled_from([1, 2, 4]),
        H_kv=st.integers(1, 2), D=st.sampled_from([64, 128]), page_size=st.sampled_from([None, 16, 48, 64]),
        causal=st.booleans(), seed=st.integers(0, 2**31 - 1),
        lengths=st.lists(st.integers(0, max_len), min_size=max_batch, max_size=max_batch)))


def check_problem(p):
    lengths = p["lengths"][:p["B"]]
    check(*make_cache(p["B"], p["S_q"], p["H_kv"] * p["group"], p["H_kv"], p["D"], lengths, p["page_size"],
                      seed=p["seed"]), causal=p["causal"])


@pytest.mark.slow
def test_random_caches_in_the_simulator():
    """Random ragged lengths (0 and 1 among them), page sizes that divide no length, GQA ratios,
    drafted rows, causal or not: a few examples in the simulator (many more on the GPU)."""
    pytest.importorskip("hypothesis", reason="hypothesis is not installed (pip install -e '.[dev]')",
                        exc_type=ImportError)
    from hypothesis import HealthCheck, given, settings

    from flashcore_numba.arch.sim import simulator_enabled

    if not simulator_enabled():
        pytest.skip("the GPU variant runs with more examples (test_random_caches_on_gpu)")

    @settings(max_examples=4, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(p=kvcache_problems(max_len=60, max_batch=3))
    def run(p):
        check_problem(p)

    run()


@pytest.mark.gpu
def test_random_caches_on_gpu():
    pytest.importorskip("hypothesis", reason="hypothesis is not installed (pip install -e '.[dev]')",
                        exc_type=ImportError)
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(p=kvcache_problems(max_len=3000, max_batch=6))
    def run(p):
        check_problem(p)

    run()


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 64])
def test_batches_that_fill_the_gpu_run_the_batch_build(page_size):
    """A decode batch whose K/V heads (a row tile each) are at least the GPU's SMs runs phase 10's
    variant "batch" (two warps a block), contiguous and paged, ragged and causal with 2 drafted rows:
    the plan says so, and the answer is the reference's."""
    from flashcore_numba.phases import p10_split_keys as p10
    from flashcore_numba.phases.common import sm_count
    from flashcore_numba.runtime.kvcache import KVCachePlan

    H_kv = 4
    B = -(-sm_count() // H_kv) + 1
    rows = 2 * 2  # a K/V head's rows: 2 query heads x S_q = 2
    assert p10.batch_fills_gpu(B * H_kv, rows) and not p10.batch_fills_gpu(2 * H_kv, rows)
    lengths = np.random.default_rng(1).integers(0, 300, B)
    q, k, v, lengths, table = make_cache(B=B, S_q=2, H=8, H_kv=H_kv, D=64, lengths=lengths, page_size=page_size)
    plan = KVCachePlan(64, "float16", q.shape, k.shape, None if table is None else table.shape, True, 0.1, 0,
                       torch_memory=False)
    assert plan.launch._dims[3] == 32 * p10.BATCH_WARPS, plan.launch._dims  # threads a block
    check(q, k, v, lengths, table, causal=True)



@pytest.mark.gpu
@pytest.mark.parametrize("D", [40, 96, 160, 192, 256])
def test_kvcache_kernel_at_other_head_dims_on_gpu(D):
    """attention_kvcache's kernels (four warps and "batch") at head dims rounded up to phase 10's
    tiles, on the GPU: ragged caches of up to 2000 keys, contiguous and paged, causal with drafted
    rows."""
    lengths = np.random.default_rng(D).integers(0, 2000, 5)
    check(*make_cache(B=5, S_q=3, H=8, H_kv=2, D=D, lengths=lengths, page_size=64), causal=True)
    check(*make_cache(B=5, S_q=1, H=8, H_kv=2, D=D, lengths=lengths), causal=False)

def test_the_readme_table_of_a_kvcache_record(tmp_path):
    """report.kvcache_table: each cache in µs, GB/s and % of the copy, the paged ones beside the contiguous."""
    from flashcore_numba.measure import bench, records, report

    problem = bench.Problem(4, 32, 1, 900, 128, causal=True, H_kv=8)
    rows = []
    for name, ms in (("10-kvcache", 0.010), ("10-kvcache-p64", 0.0105)):
        r = records.Result(name, "phase", f"title {name}", correct=True, message="ok", registers=1,
                           static_smem_bytes=0, dynamic_smem_bytes=0, local_bytes_per_thread=0)
        bench.set_timing(r, [ms], 10**6, None, kv_bytes=2 * 10**7, ceiling_gb_per_s=3000.0)
        rows.append(r)
    copy = {"what": "copy", "bytes": 2 * 10**7, "median_ms": 0.01, "gb_per_s": 3000.0}
    record = records.build_record(problem=problem, results=rows, provenance={"gpu_name": "Test GPU", "git_commit": "abc1234"},
                                  timing=bench.Timing(), ceiling=None, oracle={}, command=[], seed=1, bandwidth=copy)
    record["config"].update(lengths=[900, 10, 500, 3], page_sizes=[64], kv_bytes=2 * 10**7)
    assert records.validate_record(record) == []
    record["_path"] = str(tmp_path / "kvcache" / "r.json")
    text = "\n".join(report.kvcache_table([record], tmp_path))
    assert "#### A decode step against 4 KV caches of 3..900 keys, H=32 H_kv=8 D=128 fp16" in text, text
    assert "| title 10-kvcache | 10 | 2000 | 66.7% |  |" in text, text
    assert "| title 10-kvcache-p64 | 10 | 1905 | 63.5% | 1.05× its time |" in text, text
    assert "3000 GB/s" in text and "(kvcache/r.json)" in text


@pytest.mark.parametrize("D", [pytest.param(96, id="D=96"), pytest.param(40, id="D=40", marks=pytest.mark.slow)])
def test_kvcache_kernel_at_other_head_dims(D):
    """Phase 10's paged build at a head dim rounded up to its tiles (p10.tile_head_dim): the copies
    from q's and the cache's rows of D values fill the rest with zeros. attention_kvcache takes 64
    and 128 on the course's tiles, any other multiple of 8 up to 256 on these (runs_head_dim)."""
    check(*make_cache(B=2, S_q=2, H=4, H_kv=2, D=D, lengths=[45, 20], page_size=16), causal=True)
    check(*make_cache(B=2, S_q=1, H=2, H_kv=1, D=D, lengths=[33, 0]), causal=False)

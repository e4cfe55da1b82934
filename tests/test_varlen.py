"""attention_varlen (flashcore_numba/inference.py): phase 07 on sequences of their own lengths packed end
to end, in the simulator (GPU: tests/test_gpu.py), against the float64 reference sequence by sequence."""

import numpy as np
import pytest

from flashcore_numba import attention, attention_varlen, check_close
from flashcore_numba.reference import reference_varlen

pytestmark = pytest.mark.beside  # long simulator runs: a child pytest runs them on the second core (conftest.py)


def packed(lengths_q, lengths_k=None, H=4, H_kv=2, D=64, seed=0, Dv=None):
    """q (total_q, H, D), k (total_k, H_kv, D) and v (total_k, H_kv, Dv: D unless given), and the int32
    offsets of the lengths."""
    rng = np.random.default_rng(seed)
    lengths_k = lengths_q if lengths_k is None else lengths_k
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
    q = rng.standard_normal((int(cu_q[-1]), H, D)).astype(np.float16)
    k = rng.standard_normal((int(cu_k[-1]), H_kv, D)).astype(np.float16)
    v = rng.standard_normal((int(cu_k[-1]), H_kv, D if Dv is None else Dv)).astype(np.float16)
    return q, k, v, cu_q, cu_k, max(lengths_q, default=0), max(lengths_k, default=0)


def check(q, k, v, cu_q, cu_k, max_q, max_k, causal=False, scale=None, phase="07"):
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale, return_lse=True,
                                phase=phase)
    ref, ref_lse, lowp = reference_varlen(q, k, v, cu_q, cu_k, causal=causal, scale=scale, lowp_dtype=np.float16)
    assert out.shape == (*q.shape[:2], v.shape[2]) and out.dtype == np.float16 and lse.shape == (q.shape[1], q.shape[0])
    verdict = check_close(out, ref, lowp)
    assert verdict.ok, verdict.message
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    seen = ~np.isneginf(ref_lse)
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=1e-5, atol=1e-5)


def test_ragged_self_attention():
    """Lengths 37, 0, 1 and 40 (one empty sequence, one of a single row, ones longer than the
    simulator's block of 32 rows), grouped query heads, causal."""
    check(*packed([37, 0, 1, 40], H=2, H_kv=1), causal=True)


def test_more_keys_than_rows_and_rows_without_keys():
    """Each sequence its own S_q and S_k: the causal mask aligned to its last key; a sequence with rows
    but no key gives zeros and an LSE of -inf. D = 128, MQA."""
    check(*packed([5, 33, 3], [40, 20, 0], H=2, H_kv=1, D=128), causal=True)


def test_phase_09_passes_over_blocks_past_a_sequence():
    """Phase 09 (TMA maps over the packed heads, a persistent grid of units sized by the longest
    sequence): a sequence of two query blocks, an empty one, one shorter than a block; and rows of a
    TMA box that belong to the next sequence are never taken for this one's."""
    check(*packed([130, 0, 17], [100, 5, 40], H=2, H_kv=1), causal=True, phase="09")


def test_a_value_head_dim_of_its_own_on_phase_07():
    """MLA's shapes, packed: q and k of 192, v and the output of 128 (V's rows and O's packed by their
    own width), ragged lengths with an empty sequence, GQA, causal."""
    check(*packed([37, 0, 20], [40, 3, 20], H=2, H_kv=1, D=192, Dv=128), causal=True)


@pytest.mark.slow
def test_a_value_head_dim_of_its_own_on_phase_09():
    """The same on phase 09 (V's tensor map as wide as V, O's rows at its width): a sequence of two
    query blocks beside a short one."""
    check(*packed([70, 9], [80, 30], H=2, H_kv=1, D=192, Dv=128), causal=True, phase="09")


@pytest.mark.slow
def test_a_scale_and_no_grouping():
    check(*packed([20, 45], H=2, H_kv=2), scale=0.3)


def test_equal_lengths_give_the_dense_kernel_bit_for_bit():
    """Packed sequences of one length are the dense batch: the same blocks, the same arithmetic."""
    q, k, v, cu_q, cu_k, max_q, max_k = packed([24, 24], H=2, H_kv=1)
    out = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, phase="07")
    dense = attention(*(x.reshape(2, 24, *x.shape[1:]).transpose(0, 2, 1, 3).copy() for x in (q, k, v)),
                      causal=True, phase="07")
    np.testing.assert_array_equal(out.reshape(2, 24, 2, 64).transpose(0, 2, 1, 3), dense)


def test_nothing_to_attend():
    """No sequence, or only empty ones: an empty (or zero) output and no launch."""
    q, k, v, cu_q, cu_k, _, _ = packed([0, 0])
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, 0, 0, return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (4, 0)


def _args(heads=(4, 2), **changes):
    q, k, v, cu_q, cu_k, max_q, max_k = packed([10, 6], H=heads[0], H_kv=heads[1])
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, phase="07")
    args.update(changes)
    return args


@pytest.mark.parametrize("changes,error,name", [
    (dict(cu_seqlens_q=np.array([0, 10, 18], np.int32)), ValueError, "cu_seqlens_q"),  # not ending at total
    (dict(cu_seqlens_q=np.array([0, 7, 16], np.int32), max_seqlen_q=9), None, "valid"),  # other lengths, same total
    (dict(cu_seqlens_k=np.array([0, 12, 10], np.int32)), ValueError, "cu_seqlens_k"),  # decreasing
    (dict(cu_seqlens_k=np.array([1, 10, 16], np.int32)), ValueError, "cu_seqlens_k"),  # not from 0
    (dict(cu_seqlens_q=np.array([0, 10, 16], np.int64)), TypeError, "cu_seqlens_q"),
    (dict(cu_seqlens_k=np.array([0, 16], np.int32)), ValueError, "cu_seqlens_k"),  # a different batch
    (dict(max_seqlen_q=8), ValueError, "max_seqlen_q"),  # sequence 0 has 10 rows
    (dict(max_seqlen_k=2.5), TypeError, "max_seqlen_k"),
    (dict(q=np.zeros((16, 3, 64), np.float16)), ValueError, "k"),  # 2 K/V heads do not divide 3
    (dict(q=np.zeros((16, 4, 100), np.float16)), ValueError, "q"),
    (dict(q=np.zeros((16, 4, 64), np.float32)), TypeError, "q"),
    (dict(q=np.zeros((1, 16, 4, 64), np.float16)), ValueError, "q"),  # a dense layout
    (dict(v=np.zeros((15, 2, 64), np.float16)), ValueError, "v"),
])
def test_bad_input_names_the_argument(changes, error, name):
    """validate=True (what FLASHCORE_VALIDATE=1 turns on) checks the offsets' values too."""
    if error is None:
        attention_varlen(**_args(**changes), validate=True)
        return
    with pytest.raises(error, match=rf"^{name}:"):
        attention_varlen(**_args(**changes), validate=True)


@pytest.mark.parametrize("phase", ["07", "09"])
@pytest.mark.parametrize("changes,same_as", [
    pytest.param(dict(cu_seqlens_q=np.array([0, 10, 99], np.int32)), dict(cu_seqlens_q=np.array([0, 10, 16], np.int32)),
                 id="an offset past the packed rows is their end"),
    pytest.param(dict(cu_seqlens_k=np.array([0, 12, 10], np.int32)), dict(cu_seqlens_k=np.array([0, 12, 12], np.int32)),
                 id="a decreasing offset is an empty sequence"),
    pytest.param(dict(cu_seqlens_k=np.array([-5, 10, 16], np.int32)), dict(cu_seqlens_k=np.array([0, 10, 16], np.int32)),
                 id="a negative offset is 0"),
])
def test_wrong_offsets_are_clamped_never_read_outside(phase, changes, same_as):
    """Without validate, the offsets are the caller's promise (nothing is copied back from the GPU
    to check them, as in FlashAttention): the kernel clamps them to the packed rows, so wrong ones
    give wrong rows, never a read or write outside q, k, v or the output (the simulator raises
    IndexError on any); the result is the clamped offsets' result, bit for bit."""
    one = (1, 1)  # one head: the offsets are what is tested, and the simulator's time grows with heads
    got = attention_varlen(**_args(one, **changes, phase=phase), return_lse=True)
    expected = attention_varlen(**_args(one, **same_as, phase=phase), return_lse=True)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError):
        attention_varlen(**_args(one, **changes, phase=phase), validate=True)


@pytest.mark.parametrize("phase,poison", [  # each phase with one poison by default, the others with the long runs
    pytest.param("07", np.nan, id="nan-07"), pytest.param("09", np.inf, id="inf-09"),
    pytest.param("07", np.inf, id="inf-07", marks=pytest.mark.slow),
    pytest.param("09", np.nan, id="nan-09", marks=pytest.mark.slow)])
def test_packed_sequences_stay_apart(phase, poison):
    """NaN or inf in one sequence's keys and values (or in rows no sequence owns, between two) never
    reaches another sequence's output: the neighbours' rows are what they are with clean neighbours,
    bit for bit. Phase 09 loads whole tiles by TMA, past a sequence's last key into the next one's:
    its producer zeroes those rows of V before the tensor cores multiply their P of 0 by them."""
    lengths_q, lengths_k = [0, 20, 37, 0, 9, 24], [10, 20, 29, 0, 9, 40]
    q, k, v, cu_q, cu_k, max_q, max_k = packed(lengths_q, lengths_k, H=1, H_kv=1)
    clean = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, phase=phase)
    for b in (0, 2):  # sequence 0 has keys but no rows; sequence 2's keys lie between clean ones
        k[cu_k[b]:cu_k[b + 1]] = poison
        v[cu_k[b]:cu_k[b + 1]] = poison
    out = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, phase=phase)
    for b in (1, 4, 5):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        np.testing.assert_array_equal(out[rows], clean[rows], err_msg=f"sequence {b}")


def varlen_problems(max_len: int, max_batch: int, phases=("07", "09")):
    from hypothesis import strategies as st

    return st.fixed_dictionaries(dict(
        B=st.integers(1, max_batch), group=st.sampled_from([1, 2, 4]), H_kv=st.integers(1, 2),
        D=st.sampled_from([64, 128]), causal=st.booleans(), same=st.booleans(), seed=st.integers(0, 2**31 - 1),
        phase=st.sampled_from(phases),
        lengths_q=st.lists(st.integers(0, max_len), min_size=max_batch, max_size=max_batch),
        lengths_k=st.lists(st.integers(0, max_len), min_size=max_batch, max_size=max_batch)))


def check_problem(p):
    lengths_q = p["lengths_q"][:p["B"]]
    lengths_k = lengths_q if p["same"] else p["lengths_k"][:p["B"]]
    check(*packed(lengths_q, lengths_k, p["H_kv"] * p["group"], p["H_kv"], p["D"], seed=p["seed"]),
          causal=p["causal"], phase=p["phase"])


@pytest.mark.slow
def test_random_packings_in_the_simulator():
    """Random ragged lengths (0 and 1 among them, empty sequences beside long ones), S_q equal to S_k
    or not, GQA ratios, causal or not: a few examples of phase 07 in the simulator (many more, of 07
    and 09, on the GPU)."""
    pytest.importorskip("hypothesis", reason="hypothesis is not installed (pip install -e '.[dev]')",
                        exc_type=ImportError)
    from hypothesis import HealthCheck, given, settings

    from flashcore_numba.arch.sim import simulator_enabled

    if not simulator_enabled():
        pytest.skip("the GPU variant runs with more examples (test_random_packings_on_gpu)")

    @settings(max_examples=2, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(p=varlen_problems(max_len=40, max_batch=3, phases=("07",)))  # 09 has its own test here: it is slow
    def run(p):
        check_problem(p)

    run()


@pytest.mark.gpu
def test_random_packings_on_gpu():
    pytest.importorskip("hypothesis", reason="hypothesis is not installed (pip install -e '.[dev]')",
                        exc_type=ImportError)
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(p=varlen_problems(max_len=1500, max_batch=8))
    def run(p):
        check_problem(p)

    run()


@pytest.mark.gpu
@pytest.mark.parametrize("phase", ["07", "09", "best"])
def test_a_value_head_dim_of_its_own_on_gpu(phase):
    """MLA's 192 / 128 packed, on torch tensors (the plan's driver launch): ragged lengths with an
    empty sequence and one of several blocks, GQA 2, causal, against the float64 reference; the
    output (total_q, H, 128)."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")
    q, k, v, cu_q, cu_k, max_q, max_k = packed([300, 0, 77, 129], [310, 5, 77, 200], H=4, H_kv=2, D=192, Dv=128)
    on = [torch.tensor(x, device="cuda") for x in (q, k, v, cu_q, cu_k)]
    out = attention_varlen(*on, max_q, max_k, causal=True, phase=phase)
    assert tuple(out.shape) == (q.shape[0], 4, 128)
    ref, _, lowp = reference_varlen(q, k, v, cu_q, cu_k, causal=True, lowp_dtype=np.float16)
    verdict = check_close(out.float().cpu().numpy(), ref, lowp)
    assert verdict.ok, verdict.message


def test_the_readme_table_of_a_packed_sequence_record(tmp_path):
    """report.varlen_table: each packed phase beside the same phase on the dense batch, each SDPA
    row beside the fastest packed phase, what could not run with its reason."""
    from flashcore_numba.measure import bench, records, report

    problem = bench.Problem(3, 4, 300, 300, 64, causal=True)
    rows = []
    for name, kind, ms in (("07-varlen", "phase", 2.0), ("09-varlen", "phase", 1.0), ("07", "phase", 2.2),
                           ("09", "phase", 1.1), ("sdpa_flash", "peer", 1.5)):
        r = records.Result(name, kind, f"title {name}", correct=True, message="ok", registers=1, static_smem_bytes=0,
                           dynamic_smem_bytes=0, local_bytes_per_thread=0)
        bench.set_timing(r, [ms], 10**9 if name.endswith("varlen") or kind == "peer" else 10**9, None)
        rows.append(r)
    rows.append(records.unavailable("sdpa_cudnn", "peer", "title cudnn", "no cuDNN here"))
    record = records.build_record(problem=problem, results=rows, provenance={"gpu_name": "Test GPU", "git_commit": "abcdef0"},
                                  timing=bench.Timing(), ceiling=None, oracle={}, command=[], seed=1)
    record["config"].update(lengths=[100, 300, 250], packed_tokens=650, dense_batch=[3, 217])
    assert records.validate_record(record) == []
    record["_path"] = str(tmp_path / "varlen" / "r.json")
    text = "\n".join(report.varlen_table([record], tmp_path))
    assert "#### 3 packed sequences of 100..300 (650 tokens), H=4 D=64 fp16 causal" in text
    assert "| title 09-varlen | 1.000 | 1.00 | 1.10× the TFLOPS of 09 on the dense batch |" in text, text
    assert "| title sdpa_flash | 1.500 | 0.67 | 09-varlen on the packed sequences is 1.50× faster |" in text, text
    assert "| title cudnn | — | — | no cuDNN here |" in text
    assert "code at commit `abcdef0`" in text and "(varlen/r.json)" in text


@pytest.mark.parametrize("lowp_dtype", [np.float16, "bfloat16"], ids=["fp16", "bf16"])
def test_the_oracle_on_torch_tensors_is_the_numpy_oracle(lowp_dtype):
    """reference_varlen of torch tensors computes where they are (the GPU tests' oracle, on the GPU),
    through reference_attention's and lowp_attention's torch routes: here on torch's CPU build, the
    same output and LSE as on NumPy arrays, and the same fp16 or bf16 yardstick up to a rounding
    step of its dtype (float32 sums in another order may round a value the other way)."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")
    q, k, v, cu_q, cu_k, _, _ = packed([0, 1, 37, 70], [5, 3, 0, 90], H=4, H_kv=2)
    for causal in (False, True):
        want = reference_varlen(q, k, v, cu_q, cu_k, causal=causal, scale=0.2, lowp_dtype=lowp_dtype)
        got = reference_varlen(*(torch.from_numpy(x) for x in (q, k, v, cu_q, cu_k)), causal=causal, scale=0.2,
                               lowp_dtype=lowp_dtype)
        np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-12)
        np.testing.assert_array_equal(np.isneginf(got[1]), np.isneginf(want[1]))
        seen = ~np.isneginf(want[1])
        np.testing.assert_allclose(got[1][seen], want[1][seen], rtol=0, atol=1e-12)
        step = (2.0 ** -7 if lowp_dtype == "bfloat16" else 2.0 ** -10) * np.maximum(1.0, 2 * np.abs(want[2]))
        assert np.all(np.abs(got[2] - want[2]) <= step), np.max(np.abs(got[2] - want[2]))  # a step at most
        assert np.mean(got[2] == want[2]) > 0.95  # nearly every value rounded the same way
        assert np.max(np.abs(want[2] - want[0])) > 0  # the yardstick is not the reference itself


def test_varlen_bench_arguments_are_checked():
    from flashcore_numba.cli import main

    assert main(["bench", "--varlen", "4,100"]) == 2  # three numbers
    assert main(["bench", "--varlen", "4,300,100"]) == 2  # the simulator, or lo > hi: refused with a message

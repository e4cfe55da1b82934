"""attention(): every bad input raises TypeError/ValueError naming the argument; good input works."""

import sys

import numpy as np
import pytest

from flashcore_numba import PHASES, attention, check_close, get_phase, lowp_attention, reference_attention
from flashcore_numba.reference import random_qkv
from flashcore_numba.runtime.inputs import describe


def qkv(shape=(1, 1, 8, 64), seq_k=None, dtype=np.float16):
    return random_qkv(shape, seq_k, seed=0, dtype=dtype)


def raises(exc, arg, fn, *args, **kwargs):
    """Assert fn raises `exc` and that its message starts with the argument's name."""
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert message.startswith(f"{arg}:"), f"message does not name {arg!r}: {message}"
    return message


def test_wrong_rank():
    q, k, v = qkv()
    msg = raises(ValueError, "q", attention, q[0], k, v)
    assert "4 dimensions" in msg and "(1, 8, 64)" in msg
    raises(ValueError, "v", attention, q, k, v[0, 0])


def test_mismatched_batch_heads_head_dim():
    q, k, v = qkv((2, 2, 8, 64))
    raises(ValueError, "k", attention, q, k[:1], v[:1])  # batch
    raises(ValueError, "k", attention, q, k[:, :1], v[:, :1])  # heads (no GQA before phase 07)
    raises(ValueError, "k", attention, q, np.ascontiguousarray(k[..., :32]), v)  # head dim
    raises(ValueError, "v", attention, q, k, np.ascontiguousarray(v[:, :, :4]))  # v length != k length


def test_wrong_dtype():
    q, k, v = qkv(dtype=np.float32)
    msg = raises(TypeError, "q", attention, q, k, v)
    assert "float16" in msg and "float32" in msg
    q16, k16, v16 = qkv()
    raises(TypeError, "k", attention, q16, k16.astype(np.float32), v16)


def test_host_device_mix():
    from numba import cuda

    q, k, v = qkv()
    msg = raises(TypeError, "k", attention, q, cuda.to_device(k), v)
    assert "NumPy" in msg


def test_not_an_array():
    q, k, v = qkv()
    raises(TypeError, "v", attention, q, k, v.tolist())


def test_non_contiguous_refused():
    q, k, v = qkv((1, 1, 8, 128))
    msg = raises(ValueError, "q", attention, q[..., ::2], k[..., ::2].copy(), v[..., ::2].copy())
    assert "contiguous" in msg


def test_unsupported_head_dim():
    q, k, v = qkv((1, 1, 8, 100))  # no multiple of 8 (phase 07 takes every other up to 256: test_head_dims)
    msg = raises(ValueError, "q", attention, q, k, v)
    assert "100" in msg and "multiple of 8" in msg and "phase 07 takes" in msg
    q, k, v = qkv((1, 1, 8, 96))
    msg = raises(ValueError, "q", attention, q, k, v, phase="05")
    assert "96" in msg and "phase 05" in msg


def test_empty():
    q, k, v = qkv((1, 1, 0, 64))
    raises(ValueError, "q", attention, q, k, v)
    q, k, v = qkv((1, 1, 8, 64), seq_k=0)
    raises(ValueError, "k", attention, q, k, v)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scale(scale):
    q, k, v = qkv()
    raises(ValueError, "scale", attention, q, k, v, scale=scale)


def test_scale_and_causal_types():
    q, k, v = qkv()
    raises(TypeError, "scale", attention, q, k, v, scale="0.1")
    raises(TypeError, "causal", attention, q, k, v, causal="yes")


@pytest.mark.parametrize("phase", ["99", "fast", 0, 3.0])
def test_unknown_phase(phase):
    q, k, v = qkv()
    raises((ValueError, TypeError), "phase", attention, q, k, v, phase=phase)


def test_phase_lookup():
    from flashcore_numba.phases import BEST, KERNELS

    # "best" is the newest phase of the ladder for every shape; phase 10 (decoding) gets its shapes
    # from best_for_shape
    ladder = [i for i, p in PHASES.items() if not getattr(p, "DECODE", False)]
    assert get_phase("best") is KERNELS[BEST] and BEST.startswith(max(ladder)) and max(PHASES) == "10"
    assert get_phase("06-inline") is get_phase("wmma-inline") is KERNELS["06-inline"]
    assert get_phase("06-inline").phase is PHASES["06"]
    assert get_phase(3) is get_phase("03") is get_phase("warp_shuffle") is get_phase("p03_warp_shuffle")


def test_numpy_round_trip_and_scale():
    """NumPy in, NumPy out; a custom scale and differing query/key lengths are honoured."""
    q, k, v = qkv((1, 2, 5, 64), seq_k=9)
    out = attention(q, k, v, causal=True, scale=0.3, phase="02")
    assert isinstance(out, np.ndarray) and out.dtype == np.float16 and out.shape == q.shape
    ref = reference_attention(q, k, v, causal=True, scale=0.3)
    verdict = check_close(out, ref, lowp_attention(q, k, v, causal=True, scale=0.3))
    assert verdict.ok, verdict.message


def test_rows_without_keys_are_zero():
    """Causal with S_q > S_k: the first S_q - S_k rows see no key and must be 0, not NaN."""
    q, k, v = qkv((1, 1, 6, 64), seq_k=2)
    out = attention(q, k, v, causal=True, phase="01")
    assert np.all(out[0, 0, :4] == 0) and np.all(np.isfinite(out))
    assert np.allclose(reference_attention(q, k, v, causal=True)[0, 0, :4], 0)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_reference_treats_inf_and_nan_as_torch_sdpa(causal):
    """The rule of docs/guide.md, "Infinities and NaN in the inputs", is torch's: the reference (its
    NumPy and its torch route) puts NaN, inf and zeros where SDPA's flash backend does (float64, CPU),
    and the oracle for such inputs accepts the reference and refuses a zero where NaN belongs."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")
    from flashcore_numba.reference import check_nonfinite, nonfinite_qkv

    q, k, v = nonfinite_qkv((1, 2, 20, 64), causal=causal)
    ref = reference_attention(q, k, v, causal=causal)
    tq, tk, tv = (torch.from_numpy(x).double() for x in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        sdpa = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal).numpy()
    for got in (reference_attention(tq, tk, tv, causal=causal), sdpa):
        assert np.array_equal(np.isnan(got), np.isnan(ref)) and np.array_equal(np.isinf(got), np.isinf(ref))
        assert np.allclose(got, ref, equal_nan=True)
    assert np.isnan(ref).any() and np.isfinite(ref).any()
    lowp = lowp_attention(q, k, v, causal=causal)
    assert check_nonfinite(ref, ref, lowp).ok
    bad = np.where(np.isnan(ref), 0.0, ref)  # what phases 01-06 once returned
    assert not check_nonfinite(bad, ref, lowp).ok


def test_oracle_rejects_nan_and_wrong_values():
    q, k, v = qkv()
    ref = reference_attention(q, k, v)
    lowp = lowp_attention(q, k, v)
    bad = ref.copy()
    bad[0, 0, 3, 5] = np.nan
    assert not check_close(bad, ref, lowp).ok
    bad = ref.copy()
    bad[0, 0, 1, 1] += 0.05
    assert not check_close(bad, ref, lowp).ok
    assert check_close(lowp, ref, lowp).ok


class _TorchLike:
    """Just enough of a CUDA torch tensor for the validation (there is no torch on a CPU CI machine)."""

    __module__ = "torch"

    def __init__(self, requires_grad):
        self.requires_grad = requires_grad
        self.device, self.is_cuda, self.shape, self.dtype = "cuda:0", True, (1, 1, 8, 64), "torch.float16"

    def is_contiguous(self):
        return True


def test_requires_grad_on_a_phase_without_backward_is_refused_by_name(monkeypatch):
    """Grad enabled and an input that requires grad: the backward needs the forward's log-sum-exp,
    which phases 07 on write; an earlier phase is refused, said plainly. Without grad (or under
    no_grad) any phase is accepted. The refusal needs no torch: here torch cannot be imported."""
    from flashcore_numba import api

    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError, as without torch
    monkeypatch.setattr(api, "_grad_enabled", lambda: True)
    ops = [_TorchLike(requires_grad=r) for r in (True, False, False)]
    with pytest.raises(ValueError, match=r"^q: requires grad, but phase 03 has no backward pass.*07 on"):
        api.attention(*ops, phase="03")
    with pytest.raises(TypeError, match=r"^deterministic: expected True or False"):
        api.attention(*ops, phase="07", deterministic="yes")
    assert describe("k", _TorchLike(requires_grad=True)).kind == "torch"


def test_eager_gradients_go_through_one_forward_and_one_backward(monkeypatch):
    """Eagerly (not under torch.compile), attention() on tensors that need grad runs its forward once
    (with the LSE, grad off inside) and backward() runs the backward once, with the arguments of the
    call; an output that does not reach the loss sends no gradient (dlse None where only the output is
    used, dout zeros where only the LSE is). The launches are stood in for: no GPU here."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")
    from flashcore_numba import api
    from flashcore_numba.reference import default_scale
    from flashcore_numba.runtime import torch_ops

    calls = []

    def forward(q, k, v, causal, scale, phase, return_lse=False):
        calls.append(("forward", causal, scale, phase, return_lse, torch.is_grad_enabled()))
        return q * 2, q.float().sum(-1)

    def backward(q, k, v, out, lse, dout, dlse, causal, scale, deterministic):
        calls.append(("backward", dout.clone(), None if dlse is None else dlse.clone(), causal, scale,
                      deterministic))
        return torch.full_like(q, 1.0), torch.full_like(k, 2.0), torch.full_like(v, 3.0)

    monkeypatch.setattr(torch_ops, "_forward", forward)
    monkeypatch.setattr(torch_ops, "attention_backward", backward)
    monkeypatch.setattr(torch_ops, "_check_backward", lambda phase, device=None, head_dim=None, value_dim=None: calls.append(("check", phase)))
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float16, requires_grad=True) for _ in range(3))
    out = api.attention(q, k, v, causal=True, scale=0.5, phase="07", deterministic=True)
    assert out.grad_fn is not None and torch.equal(out, q.detach() * 2)
    out.float().sum().backward()
    assert [c[0] for c in calls] == ["check", "forward", "backward"]
    assert calls[1] == ("forward", True, 0.5, "07", True, False)
    _, dout, dlse, causal, scale, deterministic = calls[2]
    assert torch.equal(dout, torch.ones_like(q)) and dlse is None
    assert (causal, scale, deterministic) == (True, 0.5, True)
    assert all(torch.equal(x.grad, torch.full_like(x, c)) for x, c in zip((q, k, v), (1.0, 2.0, 3.0)))

    calls.clear()
    out, lse = api.attention(q, k, v, return_lse=True)
    (3 * lse).sum().backward()
    _, dout, dlse, causal, scale, deterministic = calls[2]
    assert torch.equal(dout, torch.zeros_like(q)) and torch.equal(dlse, torch.full(q.shape[:3], 3.0))
    assert (causal, scale, deterministic) == (False, default_scale(8), False)  # the default, resolved for the backward


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, True), (False, True, False)],
                         ids=["q only", "k and v", "k only"])
def test_only_the_inputs_that_require_grad_get_one(monkeypatch, needs):
    """A partial requires_grad (a frozen q projection, or frozen keys and values): the backward runs
    once, each input that requires grad gets its gradient, the others none. The launches are stood
    in for, as above; tests/test_backward.py checks the numbers on a GPU."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")
    from flashcore_numba import api
    from flashcore_numba.runtime import torch_ops

    calls = []
    monkeypatch.setattr(torch_ops, "_forward", lambda q, k, v, causal, scale, phase, return_lse=False:
                        (q * 2, q.float().sum(-1)))
    monkeypatch.setattr(torch_ops, "attention_backward", lambda q, k, v, out, lse, dout, dlse, *rest: calls.append(1)
                        or (torch.full_like(q, 1.0), torch.full_like(k, 2.0), torch.full_like(v, 3.0)))
    monkeypatch.setattr(torch_ops, "_check_backward", lambda *a, **kw: None)
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float16, requires_grad=r) for r in needs)
    api.attention(q, k, v, phase="07").float().sum().backward()
    assert calls == [1]
    for x, wants, c in zip((q, k, v), needs, (1.0, 2.0, 3.0)):
        assert (x.grad is not None) == wants and (not wants or torch.equal(x.grad, torch.full_like(x, c)))


def test_the_backward_check_asks_the_gpu_once_per_phase_and_device(monkeypatch):
    """require_backward remembers a phase that passed on a device (Numba's device query costs about
    9 us a call); a phase that fails is asked about, and refused, every time."""
    from flashcore_numba import api

    asked = []
    monkeypatch.setattr(api, "_BACKWARD_CHECKED", set())
    monkeypatch.setattr(api, "best_for_this_gpu", lambda *dims: asked.append("best") or api.get_phase("07"))
    for _ in range(3):
        api.require_backward("best", "cuda:0")
    api.require_backward("best", "cuda:1")
    assert asked == ["best", "best"]
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^q: requires grad, but phase 03"):
            api.require_backward("03", "cuda:0")
    assert ("03", "cuda:0") not in api._BACKWARD_CHECKED


def test_best_falls_back_on_an_older_gpu(monkeypatch):
    """'best' on a GPU below the best phase's compute capability: the newest phase it can run."""
    from types import SimpleNamespace

    from flashcore_numba import api
    from flashcore_numba.phases import PHASES, min_cc

    monkeypatch.setattr(api, "simulator_enabled", lambda: False)
    fake = SimpleNamespace(is_available=lambda: True,
                           get_current_device=lambda: SimpleNamespace(compute_capability=(7, 5)))
    import numba

    monkeypatch.setattr(numba, "cuda", fake, raising=False)
    monkeypatch.setitem(__import__("sys").modules, "numba.cuda", fake)
    chosen = api.best_for_this_gpu()
    assert min_cc(chosen) <= (7, 5)
    assert chosen.ID == max(pid for pid, p in PHASES.items() if min_cc(p) <= (7, 5))
    # a newer GPU than Hopper has no wgmma: 'best' is the newest phase without it (07 on sm_100)
    fake.get_current_device = lambda: SimpleNamespace(compute_capability=(10, 0))
    chosen = api.best_for_this_gpu()
    assert chosen.ID == "07"


def test_phases_say_which_gpus_they_need():
    from flashcore_numba.phases import PHASES, cc_reason

    assert cc_reason(PHASES["08"], (9, 0)) is None and cc_reason(PHASES["07"], (10, 0)) is None
    assert "needs compute capability 9.0, this GPU has 8.0" in cc_reason(PHASES["08"], (8, 0))
    assert "9.0 only" in cc_reason(PHASES["08"], (10, 0))


def _records_of_08_and_09():
    """(where, config, {kernel: result}) of every committed record point that timed phases 08 and 09."""
    from flashcore_numba.measure.records import load_records

    for record in load_records():
        points = record.get("sweep") or [record]
        for point in points:
            results = {r["name"]: r for r in point["results"]}
            if all(results.get(k, {}).get("median_ms") for k in ("08", "09")):
                where = f"{record['_path'].rsplit('/', 1)[-1]} S={point['config']['S_k']}"
                yield where, point["config"], results


def test_best_for_shape_agrees_with_the_committed_records():
    """Where "best" hands the H100's work to phase 08 (api.SHORT_SEQUENCES_TO_08), phase 08 was not
    slower in the records, and where it keeps phase 09, 09 was not slower (3 % either way: the
    run-to-run noise). Points where either kernel's median launch took more than 1.2x its fastest
    are not used to judge: there the median itself is in doubt (docs/tuning/09_history.md
    describes its spread). A single slow launch (a record of bc3c341 has one of 344 ms beside a
    median of 0.67 ms) leaves the median alone."""
    from flashcore_numba import api
    from flashcore_numba.phases import PHASES

    judged, unreliable, wrong = 0, [], []
    for where, config, results in _records_of_08_and_09():
        if any(results[k]["median_ms"] > 1.2 * results[k]["min_ms"] for k in ("08", "09")):
            unreliable.append(where)
            continue
        rows = config["H"] // config.get("H_kv", config["H"]) * config["S_q"]
        chosen = api.best_for_shape(PHASES["09"], config["D"], config["causal"], config["S_k"], rows).ID
        tflops = {k: results[k]["tflops"] for k in ("08", "09")}
        judged += 1
        if tflops[chosen] < 0.97 * max(tflops.values()):
            wrong.append(f"{where}: runs {chosen} at {tflops[chosen]:.0f} TFLOPS, the other ran "
                         f"{max(tflops.values()):.0f}")
    assert judged >= 30 and len(unreliable) <= 4, (judged, unreliable)
    assert not wrong, "\n".join(wrong)


def test_best_for_shape_keeps_09_everywhere_and_hands_over_only_where_the_table_says(monkeypatch):
    from flashcore_numba import api
    from flashcore_numba.phases import PHASES

    p09 = PHASES["09"]
    for head_dim in (64, 128):  # the records have 09 ahead of 08 at every sweep point
        for causal in (False, True):
            assert api.best_for_shape(p09, head_dim, causal, 512, 512).ID == "09"
    # the hand-over itself, for a table that asks for one
    monkeypatch.setattr(api, "SHORT_SEQUENCES_TO_08", {(64, True): 512})
    assert api.best_for_shape(p09, 64, True, 512, 512).ID == "08"
    assert api.best_for_shape(p09, 64, True, 1024, 1024).ID == "09"
    assert api.best_for_shape(p09, 64, False, 512, 512).ID == "09"
    assert api.best_for_shape(p09, 128, True, 512, 512).ID == "09"
    assert api.best_for_shape(PHASES["07"], 64, True, 512, 512).ID == "07", "only phase 09 hands over"


def test_best_hands_decoding_to_phase_10(monkeypatch):
    """Where a K/V head has at most DECODE_ROWS query rows (its group's heads times S_q), "best" runs
    phase 10 (split keys), on any GPU whose best phase is 07 or later: its variant "batch" (two warps
    a block) where the batch's K/V heads, a row tile each, are at least the SMs, the four-warp build
    below; with more rows, the ladder."""
    from flashcore_numba import api
    from flashcore_numba.phases import KERNELS, PHASES, common

    monkeypatch.setattr(common, "sm_count_override", 132)  # an H100's SMs
    assert api.DECODE_ROWS == 16
    for best in ("07", "08", "09", "09-ws"):
        for rows in (1, 4, 16):
            assert api.best_for_shape(KERNELS[best], 128, True, 4096, rows).ID == "10", (best, rows)
        assert api.best_for_shape(KERNELS[best], 128, True, 4096, 17).ID == best
        assert api.best_for_shape(KERNELS[best], 128, True, 4096, 17, kv_heads=512).ID == best
        assert api.best_for_shape(KERNELS[best], 128, False, 2048, 1, kv_heads=131).ID == "10"
        for kv_heads in (132, 512, 2048):  # the SMs; B = 64 and 256 at H_kv = 8
            assert api.best_for_shape(KERNELS[best], 128, False, 2048, 1, kv_heads=kv_heads).ID == "10-batch"
    assert api.best_for_shape(PHASES["05"], 64, False, 4096, 1, kv_heads=512).ID == "05", "phase 10 needs sm_80"


def _decode_records():
    """(file, config, {kernel: median ms}) of every committed record that times phases 09 and 10."""
    from flashcore_numba.measure.records import load_records

    for record in load_records():
        results = {r["name"]: r for r in record.get("results", []) if r.get("median_ms")}
        if "09" in results and "10" in results:
            yield record["_path"], record["config"], {k: results[k]["median_ms"] for k in ("09", "10")}


def test_best_between_09_and_10_agrees_with_the_committed_records():
    """Where "best" runs phase 10, its median was not above phase 09's, and where it keeps 09, 09's
    was not above 10's (3 % either way: run-to-run noise); the records are the H100's and the H200's,
    132 SMs each."""
    from flashcore_numba import api
    from flashcore_numba.phases import PHASES

    judged, wrong = 0, []
    for where, config, ms in _decode_records():
        rows = config["H"] // config.get("H_kv", config["H"]) * config["S_q"]
        chosen = api.best_for_shape(PHASES["09"], config["D"], config["causal"], config["S_k"], rows).ID
        judged += 1
        if ms[chosen] > 1.03 * min(ms.values()):
            wrong.append(f"{where}: runs {chosen} at {ms[chosen]:.4f} ms, the other took {min(ms.values()):.4f}")
    assert judged >= 3
    assert not wrong, "\n".join(wrong)


def test_attention_best_dispatches_by_shape_on_a_gpu(monkeypatch):
    """attention(phase="best") off the simulator: validation first, then best_for_shape picks the
    kernel that runs (stopped here at require_device, which sees the choice)."""
    from flashcore_numba import api
    from flashcore_numba.phases import common

    chosen = []

    def stop(phase):
        chosen.append(phase.ID)
        raise RuntimeError("stop")

    monkeypatch.setattr(api, "simulator_enabled", lambda: False)
    monkeypatch.setattr(api, "best_for_this_gpu", lambda *dims: api.get_phase("09"))
    monkeypatch.setattr(api, "require_device", stop)
    monkeypatch.setattr(common, "sm_count_override", 132)  # an H100's SMs
    shapes = ((512, True, 64), (4096, True, 64), (1024, False, 64), (512, False, 128), (1, True, 64))
    for table, expected in (({}, ["09", "09", "09", "09", "10"]), ({(64, True): 512}, ["08", "09", "09", "09", "10"])):
        monkeypatch.setattr(api, "SHORT_SEQUENCES_TO_08", table)  # today's (empty) and one that hands over
        chosen.clear()
        for seq, causal, head_dim in shapes:
            q = np.zeros((1, 2, seq, head_dim), np.float16)
            with pytest.raises(RuntimeError, match="stop"):
                api.attention(q, q, q, causal=causal)
        assert chosen == expected, table
    with pytest.raises(RuntimeError, match="stop"):
        api.attention(q, q, q, phase="09")  # a phase asked for by name is never swapped
    assert chosen[-1] == "09"
    q = np.zeros((66, 2, 1, 64), np.float16)  # a decode step of 132 K/V heads, as many as the SMs
    with pytest.raises(RuntimeError, match="stop"):
        api.attention(q, q, q)
    assert chosen[-1] == "10-batch"


# ---------------------------------------------------------------------------------------------
# return_lse: each row's log-sum-exp beside the output (phases 07 on)
# ---------------------------------------------------------------------------------------------
def test_return_lse_bad_input_names_the_argument():
    q, k, v = qkv()
    raises(TypeError, "return_lse", attention, q, k, v, phase="07", return_lse="yes")
    msg = raises(ValueError, "return_lse", attention, q, k, v, phase="03", return_lse=True)
    assert "phase 03" in msg and "07" in msg


def test_lse_flag_of_every_kernel_matches_its_phase():
    """A phase that says it writes the log-sum-exp builds kernels that take LSE, and only those."""
    from flashcore_numba.phases import KERNELS, build, supports_lse

    for kernel in KERNELS.values():
        for D in kernel.HEAD_DIMS:
            assert build(kernel, D).lse == supports_lse(kernel), (kernel.ID, D)
    assert [p for p in PHASES if supports_lse(PHASES[p])] == ["07", "08", "09", "10"]


@pytest.mark.parametrize("phase", ["07", "08", "09", pytest.param("10", marks=pytest.mark.slow)])  # 10's LSE: test_phases' splits
def test_return_lse_matches_the_float64_reference(phase):
    """One call covers the cases: grouped-query heads, S_q > S_k under a causal mask (the first
    rows see no key: LSE -inf, output 0), a scale of our own, and the output still right."""
    from flashcore_numba.reference import reference_lse

    q, k, v = random_qkv((1, 4, 40, 64), 24, seed=5, heads_kv=2)
    out, lse = attention(q, k, v, causal=True, scale=0.2, phase=phase, return_lse=True)
    assert isinstance(lse, np.ndarray) and lse.dtype == np.float32 and lse.shape == (1, 4, 40)
    ref = reference_lse(q, k, causal=True, scale=0.2)
    empty = np.isneginf(ref)
    assert empty[0, 0, :16].all() and not empty[0, 0, 16:].any()  # rows 0-15 see no key (40 - 24)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    np.testing.assert_allclose(lse[~empty], ref[~empty], rtol=1e-5, atol=1e-5)
    assert check_close(out, reference_attention(q, k, v, causal=True, scale=0.2),
                       lowp_attention(q, k, v, causal=True, scale=0.2)).ok


def test_lse_merges_attention_over_two_key_ranges():
    """What the log-sum-exp is for: attention over keys [0, n) and [n, S_k) computed apart and
    merged with their LSEs equals attention over all keys (split keys, phase 10, rests on it)."""
    q, k, v = random_qkv((1, 2, 16, 64), 48, seed=6)
    whole = reference_attention(q, k, v)
    n = 20
    o1, l1 = attention(q, k[:, :, :n].copy(), v[:, :, :n].copy(), phase="08", return_lse=True)
    o2, l2 = attention(q, k[:, :, n:].copy(), v[:, :, n:].copy(), phase="08", return_lse=True)
    lse = np.logaddexp(l1, l2)
    merged = np.exp(l1 - lse)[..., None] * o1.astype(np.float64) + np.exp(l2 - lse)[..., None] * o2
    np.testing.assert_allclose(merged, whole, atol=2e-3)


@pytest.mark.parametrize("D, phase", [(80, "09"), (200, "09")])
def test_varlen_runs_other_head_dims_on_the_newest_phase_built_for_them(D, phase):
    """(In this module, not test_head_dims.py, whose tests a child pytest runs on the second core: it
    is the longer of the two halves of the default run.) attention_varlen at D = 80 on phase 09 (rounded up to its 128-column tiles), at D = 200 (its
    256-column tiles, 64 keys a tile), an empty sequence beside the others."""
    from flashcore_numba.inference import _varlen_phase, attention_varlen
    from flashcore_numba.reference import reference_varlen

    rng = np.random.default_rng()
    lengths = [19, 0, 34]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    heads = 2 if D <= 128 else 1  # (one head past 128: the simulator's phase 09 at 256 columns is slow)
    q = rng.standard_normal((int(cu[-1]), heads, D)).astype(np.float16)
    k = rng.standard_normal((int(cu[-1]), 1, D)).astype(np.float16)
    v = rng.standard_normal((int(cu[-1]), 1, D)).astype(np.float16)
    assert _varlen_phase("best", D) == phase
    out = attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    ref, _, lowp = reference_varlen(q, k, v, cu, cu, causal=True, lowp_dtype=np.float16)
    verdict = check_close(out, ref, lowp)
    assert verdict.ok, verdict.message
    out07 = attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, phase="07")
    assert check_close(out07, ref, lowp).ok

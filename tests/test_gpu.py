"""GPU tests: every phase against the float64 reference on a real GPU.

Run on a GPU machine with `FLASHCORE_GPU=1 python3 -m pytest -m gpu`; in the simulator these
skip with the reason. Inputs are fresh random tensors every run, outputs are poisoned (NaN)
before each launch, and the reference shape of the benchmark (B=16 H=16 S=2048 D=64) is
checked too.
"""

import functools
import json

import numpy as np
import pytest

from flashcore_numba import attention, check_close, lowp_attention, reference_attention
from flashcore_numba.phases import KERNELS, build
from flashcore_numba.phases.common import LOG2E
from flashcore_numba.reference import random_qkv

pytestmark = pytest.mark.gpu
NO_TORCH = "torch is not installed (pip install -e '.[torch]')"  # the tests that need it skip

SHAPES = [
    pytest.param((2, 3, 257, 64), None, False, id="257 tail"),
    pytest.param((2, 3, 257, 64), None, True, id="257 tail causal"),
    pytest.param((1, 2, 100, 128), None, True, id="D=128 causal"),
    pytest.param((1, 1, 1, 64), None, False, id="S=1"),
    pytest.param((2, 2, 300, 64), 450, True, id="S_q=300 S_k=450 causal"),
    pytest.param((1, 2, 77, 64), 30, True, id="S_q=77 S_k=30 causal (rows without keys)"),
    pytest.param((1, 1, 512, 128), None, False, id="D=128 S=512"),
    # phase 09 at D = 64: the last block's last two consumers have no rows and pass 8 tiles, twice
    # round the ring of 4 stages (09-ws, without turns, once deadlocked here)
    pytest.param((1, 2, 1000, 64), None, False, id="S=1000 consumers without rows"),
]


def launch_poisoned(phase, q, k, v, causal):
    from numba import cuda

    out = cuda.to_device(np.full(q.shape, np.nan, dtype=np.float16))
    build(KERNELS[phase], q.shape[-1]).launch(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), out,
                                            causal, LOG2E / np.sqrt(q.shape[-1]))
    cuda.synchronize()
    return out.copy_to_host()


@pytest.mark.parametrize("phase", list(KERNELS))
@pytest.mark.parametrize("shape,seq_k,causal", SHAPES)
def test_phase_on_gpu(phase, shape, seq_k, causal):
    q, k, v = random_qkv(shape, seq_k)
    out = launch_poisoned(phase, q, k, v, causal)
    verdict = check_close(out, reference_attention(q, k, v, causal=causal), lowp_attention(q, k, v, causal=causal))
    assert verdict.ok, f"phase {phase}: {verdict.message}"


@pytest.mark.parametrize("phase", list(KERNELS))
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_infinities_and_nan_on_gpu(phase, causal):
    """The rule of docs/guide.md, "Infinities and NaN", on the GPU's own exp2, max and tensor cores:
    NaN rows where a score is +inf or NaN, zeros where a row's only score is -inf, inf and NaN of v in
    their columns, every other output finite and correct (the cases: reference.nonfinite_qkv)."""
    from flashcore_numba.reference import check_nonfinite, nonfinite_qkv

    q, k, v = nonfinite_qkv((1, 2, 200, 64), causal=causal, seed=None)  # tails in the key and query tiles
    out = launch_poisoned(phase, q, k, v, causal)
    verdict = check_nonfinite(out, reference_attention(q, k, v, causal=causal),
                              lowp_attention(q, k, v, causal=causal))
    assert verdict.ok, f"phase {phase} causal={causal}: {verdict.message}"


@pytest.mark.parametrize("shape,seq_k,causal", [
    pytest.param((2, 3, 700, 64), None, True, id="D=64 causal"),
    pytest.param((1, 3, 500, 128), 900, True, id="D=128 S_q=500 S_k=900 causal"),
    pytest.param((3, 2, 390, 64), None, False, id="D=64 tail"),
])
def test_persistent_blocks_take_several_query_blocks(shape, seq_k, causal, monkeypatch):
    """Phase 09 on a grid of 2 blocks (common.sm_count_override), so that each takes many query blocks
    from the counter: the ring and Q's barriers run on from one to the next."""
    from flashcore_numba.phases import common

    monkeypatch.setattr(common, "sm_count_override", 2)
    assert KERNELS["09"].build(shape[-1]).grid(shape, causal) == (2,)
    q, k, v = random_qkv(shape, seq_k)
    out = launch_poisoned("09", q, k, v, causal)
    verdict = check_close(out, reference_attention(q, k, v, causal=causal), lowp_attention(q, k, v, causal=causal))
    assert verdict.ok, verdict.message


@functools.lru_cache(maxsize=None)
def reference_shape_case(causal):
    """Inputs and the two reference results at the benchmark shape (computed once, on the GPU)."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    q, k, v = (torch.randn(16, 16, 2048, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    return (q, k, v, *_torch_oracle(q, k, v, causal))


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("phase", list(KERNELS))
def test_reference_shape_through_torch(phase, causal):
    """The benchmark shape, through the public API with torch tensors (zero-copy, torch's stream)."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)

    q, k, v, ref, lowp = reference_shape_case(causal)
    out = attention(q, k, v, causal=causal, phase=phase)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16 and out.is_cuda
    verdict = check_close(out.double().cpu().numpy(), ref, lowp)
    assert verdict.ok, f"phase {phase}: {verdict.message}"


def test_device_array_round_trip():
    from numba import cuda

    q, k, v = random_qkv((1, 2, 90, 64))
    out = attention(*(cuda.to_device(x) for x in (q, k, v)), causal=True)
    assert hasattr(out, "copy_to_host")
    verdict = check_close(out.copy_to_host(), reference_attention(q, k, v, causal=True),
                          lowp_attention(q, k, v, causal=True))
    assert verdict.ok, verdict.message


def test_requires_grad_under_no_grad_and_with_grad():
    """Activations inside a model require grad: under no_grad / inference_mode the output has no
    grad_fn; with grad it has one (tests/test_backward.py checks the gradients); the same output
    either way. A phase without the log-sum-exp has no backward: refused by name."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    host = random_qkv((1, 2, 70, 64))
    q, k, v = (torch.tensor(x, device="cuda").requires_grad_() for x in host)
    with pytest.raises(ValueError, match="q: requires grad, but phase 03 has no backward pass"):
        attention(q, k, v, phase="03")
    ref, lowp = reference_attention(*host), lowp_attention(*host)
    for context in (torch.no_grad, torch.inference_mode, torch.enable_grad):
        with context():
            out = attention(q, k, v)
        assert out.requires_grad == (context is torch.enable_grad)
        verdict = check_close(out.detach().double().cpu().numpy(), ref, lowp)
        assert verdict.ok, verdict.message


def test_small_launches_do_not_warn(monkeypatch):
    """No NumbaPerformanceWarning per call on a small grid: attention() on NumPy arrays launches
    through its plan (the driver's launch, which has no such warning); Numba's launch (the lessons'
    and the grader's, phases/common.launch) silences it, and the numba variable brings it back there."""
    import warnings

    from numba import cuda

    def low_occupancy(seen):  # by message: numba-cuda has its own warning classes
        return [w for w in seen if "under-utilization" in str(w.message)]

    # numba warns once per launch configuration: each part uses a grid no other test launches
    q, k, v = random_qkv((1, 5, 40, 64))
    config = build(KERNELS["07"], 64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            attention(q, k, v)
            config.launch(*(cuda.to_device(x) for x in (q, k, v)), cuda.device_array_like(q), False, LOG2E / 8)
    assert not low_occupancy(seen)
    monkeypatch.setenv("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "1")
    q, k, v = random_qkv((1, 7, 40, 64))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        attention(q, k, v)
        assert not low_occupancy(seen)  # the plan's launch
        config.launch(*(cuda.to_device(x) for x in (q, k, v)), cuda.device_array_like(q), False, LOG2E / 8)
    assert low_occupancy(seen)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_grouped_query_attention_on_gpu(causal):
    """H_q = 32 on H_kv = 8, through the API, for every phase that supports it."""
    from flashcore_numba.phases import PHASES, supports_gqa

    q, _, _ = random_qkv((1, 32, 300, 64))
    _, k, v = random_qkv((1, 8, 333, 64))
    k_rep, v_rep = np.repeat(k, 4, axis=1), np.repeat(v, 4, axis=1)
    ref, lowp = reference_attention(q, k_rep, v_rep, causal=causal), lowp_attention(q, k_rep, v_rep, causal=causal)
    for pid, phase in PHASES.items():
        if supports_gqa(phase):
            verdict = check_close(attention(q, k, v, causal=causal, phase=pid), ref, lowp)
            assert verdict.ok, f"phase {pid}: {verdict.message}"


BF16_KERNELS = [kid for kid, kernel in KERNELS.items() if "bfloat16" in getattr(kernel, "DTYPES", ())]


@pytest.mark.parametrize("phase", BF16_KERNELS)
@pytest.mark.parametrize("shape,seq_k,causal", [
    pytest.param((2, 3, 257, 64), None, True, id="257 tail causal"),
    pytest.param((1, 2, 300, 128), 450, False, id="D=128 S_q=300 S_k=450"),
    pytest.param((16, 16, 2048, 64), None, False, id="reference shape"),
    pytest.param((16, 16, 2048, 128), None, True, id="reference shape D=128 causal"),
])
def test_bf16_through_torch(phase, shape, seq_k, causal):
    """bf16 torch tensors in, bf16 out; the yardstick is torch's math SDPA in bf16."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    q, k, v, ref, lowp = bf16_case(shape, seq_k, causal)
    out = attention(q, k, v, causal=causal, phase=phase)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    verdict = check_close(out.double().cpu().numpy(), ref, lowp)
    assert verdict.ok, f"phase {phase} bf16: {verdict.message}"


@functools.lru_cache(maxsize=1)  # the tests of one shape run one after another, each phase in turn
def bf16_case(shape, seq_k, causal):
    """bf16 inputs and the two reference results of test_bf16_through_torch's case, made once for
    all its phases (at the reference shape they cost seconds: float64 on the GPU, copied back)."""
    import torch

    B, H, S, D = shape
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, H, seq_k or S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return (q, k, v, *_torch_oracle(q, k, v, causal))


def test_bf16_refused_by_fp16_phases_by_name():
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    q = torch.randn(1, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="q: expected dtype float16 for phase 06, got bfloat16"):
        attention(q, q, q, phase="06")


@pytest.mark.parametrize("phase", ["07", "09"])
def test_output_off_a_16_byte_boundary_is_refused(phase):
    """Phases 07 and 09 write O in 16-byte stores (ptx/store.ptx), which fault at an address that is
    not a multiple of 16: a launch on such an O is refused by name, and an aligned one runs."""
    from numba import cuda

    q, k, v = random_qkv((1, 2, 64, 64))
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    buf = cuda.to_device(np.full(q.size + 8, np.nan, dtype=np.float16))
    config = build(KERNELS[phase], 64)
    with pytest.raises(ValueError, match="o: this kernel writes the output in 16-byte stores"):
        config.launch(dq, dk, dv, buf[1:1 + q.size].reshape(q.shape), False, LOG2E / 8.0)
    out = buf[8:8 + q.size].reshape(q.shape)  # 16 bytes in: aligned
    config.launch(dq, dk, dv, out, False, LOG2E / 8.0)
    cuda.synchronize()
    verdict = check_close(out.copy_to_host(), reference_attention(q, k, v), lowp_attention(q, k, v))
    assert verdict.ok, verdict.message


# ---------------------------------------------------------------------------------------------
# The call path (runtime/): plans, CUDA graphs, torch.compile, the kernel cache
# ---------------------------------------------------------------------------------------------
def _torch_qkv(shape, seq_k=None, dtype="float16", heads_kv=None):
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    B, H, S, D = shape
    q = torch.randn(B, H, S, D, device="cuda", dtype=getattr(torch, dtype))
    k, v = (torch.randn(B, heads_kv or H, seq_k or S, D, device="cuda", dtype=q.dtype) for _ in range(2))
    return q, k, v


def _torch_oracle(q, k, v, causal):
    """(the float64 reference, torch's math SDPA in q's dtype as NumPy float64) of torch tensors on the
    GPU: grouped K/V heads spelled out per query head, the causal mask aligned to the last key."""
    import torch

    H, H_kv = q.shape[1], k.shape[1]
    k, v = (x.repeat_interleave(H // H_kv, dim=1) for x in (k, v)) if H != H_kv else (k, v)
    ref = reference_attention(q, k, v, causal=causal)
    mask = None
    if causal and k.shape[2] != q.shape[2]:
        from torch.nn.attention.bias import causal_lower_right
        mask = causal_lower_right(q.shape[2], k.shape[2])
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        lowp = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal and mask is None, attn_mask=mask).double().cpu().numpy()
    return ref, lowp


def _check_torch(out, q, k, v, causal, what=""):
    verdict = check_close(out.double().cpu().numpy(), *_torch_oracle(q, k, v, causal))
    assert verdict.ok, f"{what}: {verdict.message}"


@pytest.mark.parametrize("phase", ["07", "08", "09", "09-ws", "10"])
def test_a_plan_serves_new_tensors_of_its_problem(phase):
    """The second call of a problem reuses its plan (no new one is made) and launches on the new
    tensors' addresses: correct results for new inputs every time, GQA and a tail included."""
    from flashcore_numba import api

    shape, seq_k, heads_kv = (2, 4, 300, 64), 333, 2
    kept = []
    for i in range(3):
        q, k, v = _torch_qkv(shape, seq_k, heads_kv=heads_kv)
        kept.append((q, k, v))  # alive, so that each set has its own addresses
        plans = len(api._PLANS)
        out = attention(q, k, v, causal=True, phase=phase)
        assert len(api._PLANS) == plans + (1 if i == 0 else 0)
        _check_torch(out, q, k, v, True, f"phase {phase} call {i}")
    for i in (0, 2, 0, 1):  # back to earlier buffers, in another order (phase 09: their maps found again)
        q, k, v = kept[i]
        _check_torch(attention(q, k, v, causal=True, phase=phase), q, k, v, True, f"phase {phase} again {i}")


@pytest.mark.parametrize("phase,D,dtype", [("09", 64, "float16"), ("09", 128, "bfloat16"), ("07", 64, "float16"),
                                           ("10", 128, "float16")])
def test_cuda_graph_capture_and_replay(phase, D, dtype):
    """attention() captured in a CUDA graph, replayed on new data in the same buffers: right every
    time (phase 09's work counter is zeroed by a memset inside the captured work, its tensor maps
    copied on the stream; phase 10's workspace is the plan's, its counters left at zero by each
    launch's merging blocks)."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    q, k, v = _torch_qkv((2, 3, 500, D), dtype=dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch asks: the plan is made here
        attention(q, k, v, causal=True, phase=phase)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention(q, k, v, causal=True, phase=phase)
    for replay in range(3):
        for x in (q, k, v):
            x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_torch(out, q, k, v, True, f"phase {phase} replay {replay}")


def test_torch_compile_fullgraph_matches_eager():
    torch = pytest.importorskip("torch", reason=NO_TORCH)

    class Block(torch.nn.Module):
        def forward(self, q, k, v):
            return attention(q * 1.0, k, v, causal=True).float().sum(dim=-1) + 1

    q, k, v = _torch_qkv((2, 4, 256, 64))
    eager = Block()(q, k, v)
    compiled = torch.compile(Block(), fullgraph=True)(q, k, v)
    # the same attention; the row sums around it may add in another order once fused
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-3)


# ---------------------------------------------------------------------------------------------
# return_lse: the rows' log-sum-exp (phases 07 on)
# ---------------------------------------------------------------------------------------------
def _check_lse(lse, q, k, causal, scale=None, what=""):
    """The kernel's LSE against the float64 one: -inf exactly where a row sees no key, and
    elsewhere within what fp32 arithmetic on the scores leaves (the LSE is a log: its absolute
    error is the relative error of the row's sum)."""
    from flashcore_numba.reference import reference_lse

    got = lse.double().cpu().numpy() if hasattr(lse, "cpu") else np.asarray(lse, dtype=np.float64)
    ref = reference_lse(q, k, causal=causal, scale=scale)
    assert got.shape == ref.shape, what
    empty = np.isneginf(ref)
    assert not np.isnan(got).any(), f"{what}: NaN in the LSE"
    np.testing.assert_array_equal(np.isneginf(got), empty, err_msg=what)
    np.testing.assert_allclose(got[~empty], ref[~empty], rtol=0, atol=1e-3, err_msg=what)


@pytest.mark.parametrize("phase", ["07", "08", "09", "09-ws", "10"])
@pytest.mark.parametrize("shape,seq_k,causal,heads_kv,dtype", [
    pytest.param((2, 4, 300, 64), 333, True, 2, "float16", id="GQA tail causal"),
    pytest.param((1, 2, 77, 128), 30, True, None, "bfloat16", id="D=128 bf16 rows without keys"),
    pytest.param((1, 2, 1000, 64), None, False, None, "float16", id="S=1000"),
])
def test_return_lse_through_torch(phase, shape, seq_k, causal, heads_kv, dtype):
    """attention(..., return_lse=True) on torch tensors (the plan's launch): the output as without
    it, and the LSE against the float64 reference, poisoned beforehand by the allocator's reuse."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    q, k, v = _torch_qkv(shape, seq_k, dtype=dtype, heads_kv=heads_kv)
    torch.full(shape[:3], float("nan"), device="cuda")  # freed: the LSE below may reuse its memory
    out, lse = attention(q, k, v, causal=causal, phase=phase, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == shape[:3] and lse.device == q.device
    assert torch.equal(out, attention(q, k, v, causal=causal, phase=phase))
    _check_lse(lse, q, k, causal, what=f"phase {phase}")


@pytest.mark.parametrize("shape,seq_k,heads_kv,causal,dtype", [
    pytest.param((1, 16, 1, 128), 4096, None, False, "float16", id="one row, 16 heads, S_k=4096"),
    pytest.param((4, 32, 1, 128), 3001, 8, False, "bfloat16", id="GQA 4, S_k=3001 bf16"),
    pytest.param((2, 32, 4, 64), 2500, 4, True, "float16", id="4 drafted rows, GQA 8, causal: 2 row tiles"),
    pytest.param((3, 8, 1, 64), 1, 8, False, "float16", id="S_k=1"),
    pytest.param((1, 4, 1, 64), 100_000, 1, True, "float16", id="MQA, S_k=100000: the most splits"),
])
def test_split_keys_decoding_through_torch(shape, seq_k, heads_kv, causal, dtype):
    """Phase 10 at decode shapes, with the split count its rule gives on this GPU: output and LSE
    against the float64 reference; where "best" runs phase 10, the same output bit for bit."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    from flashcore_numba import api

    q, k, v = _torch_qkv(shape, seq_k, dtype=dtype, heads_kv=heads_kv)
    splits = build(KERNELS["10"], shape[-1], dtype).split_keys(tuple(q.shape), tuple(k.shape), causal)
    out, lse = attention(q, k, v, causal=causal, phase="10", return_lse=True)
    what = f"{shape} S_k={seq_k}: {splits.grid[0]} splits"
    _check_torch(out, q, k, v, causal, what)
    _check_lse(lse, q, k, causal, what=what)
    rows = shape[1] // k.shape[1] * shape[2]
    if rows <= api.DECODE_ROWS:  # a decode step "best" gives phase 10 (api.best_for_shape)
        assert api._resolve(q, k, v, causal, None, "best")[0].ID == "10", what
        assert torch.equal(attention(q, k, v, causal=causal), out), what
    if seq_k >= 4096:
        assert splits.grid[0] > 1, f"{what}: a long decode step must split"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_batched_decoding_runs_the_batch_build(dtype):
    """A decode step whose K/V heads (a row tile each) are at least the GPU's SMs: "best" runs phase
    10's variant "batch" (two warps a block, two blocks an SM), one block a row tile, unsplit; its
    output and LSE against the float64 reference."""
    pytest.importorskip("torch", reason=NO_TORCH)
    from flashcore_numba import api
    from flashcore_numba.phases.common import sm_count

    B = -(-sm_count() // 8) + 2  # K/V heads past the SMs, at H_kv = 8
    q, k, v = _torch_qkv((B, 32, 1, 128), 1000, dtype=dtype, heads_kv=8)
    assert api._resolve(q, k, v, True, None, "best")[0].ID == "10-batch"
    assert build(KERNELS["10-batch"], 128, dtype).split_keys(tuple(q.shape), tuple(k.shape), True).grid[0] == 1
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    _check_torch(out, q, k, v, True, f"B={B} H=32 H_kv=8 S_k=1000 {dtype}")
    _check_lse(lse, q, k, True, what=f"B={B} {dtype}")


def test_return_lse_at_the_reference_shape_and_with_a_scale():
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    q, k, v = _torch_qkv((16, 16, 2048, 64))
    out, lse = attention(q, k, v, causal=True, scale=0.3, return_lse=True)
    assert torch.equal(out, attention(q, k, v, causal=True, scale=0.3))  # the output as without the LSE
    _check_lse(lse, q, k, True, scale=0.3, what="reference shape, scale 0.3")


def test_return_lse_in_a_cuda_graph_and_under_torch_compile():
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    q, k, v = _torch_qkv((2, 3, 500, 64))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attention(q, k, v, causal=True, return_lse=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = attention(q, k, v, causal=True, return_lse=True)
    for x in (q, k, v):
        x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check_torch(out, q, k, v, True, "graph replay with the LSE")
    _check_lse(lse, q, k, True, what="graph replay")

    def step(q, k, v):
        o, l = attention(q, k, v, causal=True, return_lse=True)
        return o.float().sum(dim=-1) + l

    torch.testing.assert_close(torch.compile(step, fullgraph=True)(q, k, v), step(q, k, v), rtol=1e-5, atol=1e-3)


def _first_call_in_a_new_process(env, phase: str = "best") -> dict:
    import json
    import os
    import subprocess
    import sys

    script = (
        "import json, time, torch\n"
        "t0 = time.perf_counter()\n"
        "from flashcore_numba import attention, check_close, reference_attention, lowp_attention\n"
        "from flashcore_numba.arch import cache\n"
        "t1 = time.perf_counter()\n"
        "q, k, v = (torch.randn(1, 4, 256, 64, device='cuda', dtype=torch.float16) for _ in range(3))\n"
        "torch.cuda.synchronize(); t2 = time.perf_counter()\n"
        f"out = attention(q, k, v, causal=True, phase={phase!r})\n"
        "torch.cuda.synchronize(); t3 = time.perf_counter()\n"
        "ok = check_close(out.double().cpu().numpy(), reference_attention(q, k, v, causal=True),\n"
        "                 lowp_attention(q.cpu().numpy(), k.cpu().numpy(), v.cpu().numpy(), causal=True)).ok\n"
        "print(json.dumps(dict(cache.stats, ok=ok, import_s=t1 - t0, first_call_s=t3 - t2)))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def compiled_cache(tmp_path_factory):
    """An empty kernel cache filled by `flashcore compile` with the kernels of every entry point at
    D = 64, fp16 (the forward's best, attention_kvcache's, attention_varlen's, the backward's: "11"
    and "12", which autograd runs on Hopper and which has nothing to compile elsewhere): the one
    compile of these tests (the cores compile side by side), read by the tests below."""
    import os
    import subprocess
    import sys

    folder = tmp_path_factory.mktemp("kernel_cache")
    compiled = subprocess.run([sys.executable, "-m", "flashcore_numba", "compile", "--phases",
                               "07,09,10,10-kvcache,07-varlen,11,12", "--head-dims", "64", "--dtypes", "fp16"],
                              capture_output=True, text=True, timeout=900,
                              env={**os.environ, "FLASHCORE_CACHE_DIR": str(folder)})
    assert compiled.returncode == 0, compiled.stdout[-3000:] + compiled.stderr[-3000:]
    return folder


def test_a_warm_cache_first_call_does_not_compile(compiled_cache):
    """A new process whose cache holds the kernel (`flashcore compile` put it there) loads it:
    nothing compiles."""
    warm = _first_call_in_a_new_process({"FLASHCORE_CACHE_DIR": str(compiled_cache)})
    assert warm["ok"] and warm["built"] == 0 and warm["loaded"] == 1 and warm["rejected"] == 0, warm
    print(f"first call with a warm cache: {warm['first_call_s']:.2f} s (import {warm['import_s']:.2f} s)")


def test_a_corrupted_cache_entry_is_rebuilt(tmp_path):
    """The first process compiles and writes the entry; cut short, it is rejected and compiled again,
    and the next process loads it whole. Phase 01's kernel: it compiles in seconds, and what is
    tested is the cache's, the same for every kernel."""
    env = {"FLASHCORE_CACHE_DIR": str(tmp_path)}
    cold = _first_call_in_a_new_process(env, "01")
    assert cold["ok"] and cold["built"] == 1 and cold["loaded"] == 0, cold
    (entry,) = tmp_path.glob("*.cubin")
    data = entry.read_bytes()
    entry.write_bytes(data[:len(data) // 2])  # a write cut short
    again = _first_call_in_a_new_process(env, "01")
    assert again["ok"] and again["rejected"] == 1 and again["built"] == 1, again
    final = _first_call_in_a_new_process(env, "01")
    assert final["ok"] and final["built"] == 0 and final["loaded"] == 1, final  # written again, whole


def test_compile_fills_the_cache_for_every_entry_point(compiled_cache):
    """After `flashcore compile` of the forward, attention_kvcache's, attention_varlen's and the
    backward's kernels into an empty cache, a new process that calls each of them (a training step
    included; attention_kvcache on torch tensors, paged, and on NumPy arrays, contiguous) compiles
    nothing: every kernel it launches is loaded from the cache."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("torch", reason=NO_TORCH)
    env = {**os.environ, "FLASHCORE_CACHE_DIR": str(compiled_cache)}
    script = (
        "import json, numpy as np, torch\n"
        "from flashcore_numba import attention, attention_kvcache, attention_varlen\n"
        "from flashcore_numba.arch import cache\n"
        "f16 = dict(device='cuda', dtype=torch.float16)\n"
        "q, k, v = (torch.randn(1, 4, 256, 64, **f16, requires_grad=True) for _ in range(3))\n"
        "attention(q, k, v, causal=True).sum().backward()\n"
        "attention(q.detach()[:, :, :1].contiguous(), k.detach(), v.detach())\n"
        "pages = torch.randn(4, 64, 2, 64, **f16)\n"
        "attention_kvcache(torch.randn(2, 1, 4, 64, **f16), pages, pages,\n"
        "                  torch.tensor([100, 7], dtype=torch.int32, device='cuda'),\n"
        "                  torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device='cuda'))\n"
        "kv = np.ones((3, 50, 2, 64), np.float16)\n"
        "attention_kvcache(np.ones((3, 1, 4, 64), np.float16), kv, kv, np.array([50, 1, 0], np.int32))\n"
        "packed = torch.randn(300, 4, 64, **f16)\n"
        "offsets = torch.tensor([0, 100, 300], dtype=torch.int32, device='cuda')\n"
        "attention_varlen(packed, packed[:, :2].contiguous(), packed[:, :2].contiguous(), offsets, offsets,\n"
        "                 200, 200, phase='07')\n"
        "torch.cuda.synchronize()\n"
        "print(json.dumps(cache.stats))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    assert stats["built"] == 0 and stats["rejected"] == 0 and stats["loaded"] >= 5, stats


def test_trace_build_on_gpu():
    """Phase 09's trace build (docs/tuning/09_history.md): right output, and its records say the
    kernel ran on the GPU's clock for no longer than the events around the launch measured."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    from numba import cuda

    from flashcore_numba.api import torch_to_kernel
    from flashcore_numba.measure import trace

    q, k, v = _torch_qkv((2, 4, 700, 64))
    out = torch.full_like(q, float("nan"))
    config = trace.trace_config(64)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    arrays = [torch_to_kernel(x) for x in (q, k, v, out)]
    records = trace.traced_launch(config, *arrays, True, LOG2E / 8.0, stream)  # compiles: not timed
    out.fill_(float("nan"))
    tr = trace.trace_array(config, q.shape, True)
    start.record()
    trace.launch_with_trace(config, tr, *arrays, True, LOG2E / 8.0, stream)
    end.record()
    torch.cuda.synchronize()
    records = trace.records_of(tr, config)
    _check_torch(out, q, k, v, True, "trace build")
    s = trace.summary(records)
    assert 0 < s["span_ns"] * 1e-6 <= start.elapsed_time(end)
    assert sum(records[:, 0, 3]) == 2 * 4 * -(-700 // config.block_m)  # every query block taken once


@pytest.mark.parametrize("phase,B,H,H_kv,D,max_len,causal,dtype", [
    pytest.param("09", 16, 16, 16, 128, 4096, True, "float16", id="09, 16 sequences up to 4096, causal"),
    pytest.param("09", 6, 32, 8, 64, 3000, False, "bfloat16", id="09, GQA 4, bf16"),
    pytest.param("07", 6, 16, 4, 128, 3000, True, "float16", id="07, GQA 4, causal"),
    pytest.param("07", 5, 8, 8, 64, 2000, False, "bfloat16", id="07, bf16"),
])
def test_varlen_through_torch(phase, B, H, H_kv, D, max_len, causal, dtype):
    """attention_varlen on torch tensors against the float64 reference, sequence by sequence: random
    lengths with an empty sequence and one of a single row among them, keys as many as rows or not."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    from flashcore_numba import attention_varlen
    from flashcore_numba.reference import reference_varlen

    gen = torch.Generator().manual_seed(1)
    lengths_q = torch.randint(2, max_len + 1, (B,), generator=gen)
    lengths_q[0], lengths_q[-1] = 0, 1
    lengths_k = lengths_q if causal else torch.randint(1, max_len + 1, (B,), generator=gen)
    cu_q, cu_k = (torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)]).int().cuda()
                  for n in (lengths_q, lengths_k))
    t = getattr(torch, dtype)
    q = torch.randn(int(cu_q[-1]), H, D, device="cuda", dtype=t)
    k, v = (torch.randn(int(cu_k[-1]), H_kv, D, device="cuda", dtype=t) for _ in range(2))
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, int(lengths_q.max()), int(lengths_k.max()), causal=causal,
                                return_lse=True, phase=phase)
    ref, ref_lse, lowp = reference_varlen(q, k, v, cu_q, cu_k, causal=causal,
                                          lowp_dtype="bfloat16" if dtype == "bfloat16" else np.float16)
    verdict = check_close(out.double().cpu().numpy(), ref, lowp)
    assert verdict.ok, verdict.message
    got = lse.double().cpu().numpy()
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref_lse))
    seen = ~np.isneginf(ref_lse)
    np.testing.assert_allclose(got[seen], ref_lse[seen], rtol=0, atol=1e-3)


def test_varlen_benchmark_writes_a_valid_record(tmp_path):
    """`flashcore bench --varlen`: packed 07 and 09, dense 07 and 09, SDPA on the padded batch, each gated
    before it is timed; a record of the schema, with the lengths, that the README table reads."""
    pytest.importorskip("torch", reason=NO_TORCH)
    from flashcore_numba.cli import main
    from flashcore_numba.measure import records, report

    out = tmp_path / "varlen" / "r.json"
    assert main(["bench", "--varlen", "5,60,300", "--shape", "1,4,1,64", "--causal", "--repeats", "20",
                 "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert records.validate_record(record) == []
    assert len(record["config"]["lengths"]) == 5 and record["config"]["packed_tokens"] == sum(record["config"]["lengths"])
    names = [r["name"] for r in record["results"]]
    assert names == ["07-varlen", "09-varlen", "07", "09", "sdpa_flash", "sdpa_cudnn"]
    assert all(r["correct"] for r in record["results"] if r["kind"] == "phase"), record["results"]
    record["_path"] = str(out)
    lines = report.varlen_table([record], tmp_path)
    assert any("the TFLOPS of 09 on the dense batch" in line for line in lines), lines


def test_call_benchmark_times_the_call_and_the_plans_launch(tmp_path, monkeypatch):
    """`flashcore bench --calls`: attention()'s call back to back and, beside it, the kernel's launch
    timed the same way (`launch_loop`): a plan's driver launch of its own, not attention() again
    and not the lessons' launch through Numba's dispatcher. Every launch of a plan is counted: two
    plans launch (attention()'s and the loop's), each at least the 30 times it is timed, and the
    loop keeps the host for less time than the call, which also checks and allocates (Numba's
    dispatcher would keep it 10-20 times longer)."""
    pytest.importorskip("torch", reason=NO_TORCH)
    from flashcore_numba.cli import main
    from flashcore_numba.measure import records
    from flashcore_numba.runtime import plan as plan_module

    launches = {}
    plan_call = plan_module.Plan.__call__

    def counted(self, *args, **kwargs):
        launches[id(self)] = launches.get(id(self), 0) + 1
        return plan_call(self, *args, **kwargs)

    monkeypatch.setattr(plan_module.Plan, "__call__", counted)
    out = tmp_path / "calls.json"
    assert main(["bench", "--shape", "1,4,128,64", "--phases", "07", "--peers", "flash", "--repeats", "20",
                 "--calls", "30", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert records.validate_record(record) == []
    ours = next(r for r in record["results"] if r["name"] == "07")
    assert ours["correct"] and ours["launch_loop"]["launch"] == "plan", ours
    call, loop = ours["call"], ours["launch_loop"]
    assert call["n"] == loop["n"] == 30 and call["median_ms"] > 0 and loop["median_ms"] > 0
    assert len(launches) >= 2 and sorted(launches.values())[-2] >= 30, launches
    assert loop["host_median_us"] < call["host_median_us"], (call, loop)
    assert "launch_loop" not in next(r for r in record["results"] if r["name"] == "sdpa_flash")


def test_first_call_benchmark_writes_a_valid_record(tmp_path):
    """`flashcore bench --first-call`: new processes, the first of which fills the kernel cache, so
    that the measured one loads the kernel and compiles nothing; a valid record with its times."""
    pytest.importorskip("torch", reason=NO_TORCH)
    from flashcore_numba.cli import main
    from flashcore_numba.measure import first_call

    out = tmp_path / "first_call" / "r.json"
    assert main(["bench", "--first-call", "--shape", "1,4,128,64", "--phases", "09", "--processes", "1",
                 "--out", str(out)]) == 0
    (record,) = first_call.load(out.parent)
    (r,) = record["results"]
    assert r["ok"] and r["cache"] == "warm" and r["phase"] == "09"
    (run,) = r["runs"]
    assert run["built"] == 0 and run["loaded"] >= 1 and run["rejected"] == 0, run
    assert 0 < r["second_call_s"] < r["first_call_s"], r


@pytest.mark.parametrize("which", ["varlen 09", "varlen 07", "kvcache paged 64", "kvcache contiguous"])
def test_inference_calls_in_a_cuda_graph(which):
    """attention_varlen and attention_kvcache captured in a CUDA graph (after a warm-up, as torch asks)
    and replayed on new data in the same buffers: the same output as an eager call on that data. Their
    offsets and lengths are not read back while capturing; their workspaces come from torch."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    from flashcore_numba import attention_kvcache, attention_varlen

    if which.startswith("varlen"):
        lengths = torch.tensor([0, 300, 1, 129])
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).int().cuda()
        q, k, v = (torch.randn(int(cu[-1]), 4, 64, device="cuda", dtype=torch.float16) for _ in range(3))

        def call():
            return attention_varlen(q, k, v, cu, cu, 300, 300, causal=True, phase=which[-2:])
    else:
        page = 64 if "paged" in which else None
        seqlens = torch.tensor([0, 1, 700, 129], dtype=torch.int32, device="cuda")
        q = torch.randn(4, 1, 8, 64, device="cuda", dtype=torch.float16)
        if page:
            k, v = (torch.randn(4 * 11 + 2, page, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
            table = torch.randperm(4 * 11 + 2)[:44].reshape(4, 11).int().cuda()
        else:
            k, v = (torch.randn(4, 700, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
            table = None

        def call():
            return attention_kvcache(q, k, v, seqlens, table)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(3):
        for x in (q, k, v):
            x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, call()), which


def test_kvcache_benchmark_writes_a_valid_record(tmp_path):
    """`flashcore bench --kvcache`: the contiguous cache and two paged ones, gated, timed, with GB/s."""
    pytest.importorskip("torch", reason=NO_TORCH)
    from flashcore_numba.cli import main
    from flashcore_numba.measure import records

    out = tmp_path / "kvcache" / "r.json"
    assert main(["bench", "--kvcache", "6,1,3000", "--shape", "1,16,1,128", "--kv-heads", "4", "--page-sizes",
                 "16,64", "--repeats", "20", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert records.validate_record(record) == []
    assert [r["name"] for r in record["results"]] == ["10-kvcache", "10-kvcache-p16", "10-kvcache-p64"]
    assert all(r["correct"] and r["gb_per_s"] > 0 for r in record["results"]), record["results"]


@pytest.mark.parametrize("B,S_q,H,H_kv,D,max_len,page_size,dtype", [
    pytest.param(4, 1, 32, 8, 128, 5000, None, "float16", id="contiguous GQA 4, ragged up to 5000"),
    pytest.param(8, 1, 16, 16, 64, 3000, 16, "float16", id="paged 16"),
    pytest.param(3, 4, 32, 8, 128, 9000, 256, "bfloat16", id="paged 256, 4 drafted rows, bf16"),
    pytest.param(2, 1, 8, 1, 64, 40000, 64, "float16", id="MQA, paged 64, 40000 keys"),
])
def test_kvcache_through_torch(B, S_q, H, H_kv, D, max_len, page_size, dtype):
    """attention_kvcache on torch tensors against the float64 reference, sequence by sequence:
    ragged lengths with 0 and 1 among them, pages scattered through the pool, the causal mask at
    each sequence's end; the paged cache gives what the same keys give contiguous."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    from flashcore_numba import attention_kvcache
    from flashcore_numba.reference import reference_kvcache

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, max_len + 1, (B,), generator=gen, dtype=torch.int32)
    lengths[0], lengths[-1] = 0, 1
    lengths = lengths.cuda()
    t = getattr(torch, dtype)
    q = torch.randn(B, S_q, H, D, device="cuda", dtype=t)
    if page_size is None:
        k, v = (torch.randn(B, max_len, H_kv, D, device="cuda", dtype=t) for _ in range(2))
        table = None
    else:
        per_seq = -(-max_len // page_size)
        pool = B * per_seq + 5
        k, v = (torch.randn(pool, page_size, H_kv, D, device="cuda", dtype=t) for _ in range(2))
        table = torch.randperm(pool, generator=gen)[:B * per_seq].reshape(B, per_seq).int().cuda()
    out, lse = attention_kvcache(q, k, v, lengths, table, return_lse=True)
    ref, ref_lse, lowp = reference_kvcache(q, k, v, lengths, table, lowp_dtype="bfloat16" if dtype == "bfloat16"
                                           else np.float16)
    verdict = check_close(out.double().cpu().numpy(), ref, lowp)
    assert verdict.ok, verdict.message
    got = lse.double().cpu().numpy()
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref_lse))
    seen = ~np.isneginf(ref_lse)
    np.testing.assert_allclose(got[seen], ref_lse[seen], rtol=0, atol=1e-3)
    if table is not None:
        dense_k = torch.stack([k[table[b]].reshape(-1, H_kv, D) for b in range(B)])
        dense_v = torch.stack([v[table[b]].reshape(-1, H_kv, D) for b in range(B)])
        assert torch.equal(attention_kvcache(q, dense_k, dense_v, lengths), out)

"""The backward pass (phases/p11_backward.py): dQ, dK and dV against the float64 reference's
gradients, in the simulator on tiny shapes; on a GPU, through attention()'s autograd
against torch's own autograd in float64, deterministic gradients, torch.compile and one training
step beside SDPA's."""

import sys

import numpy as np
import pytest

from flashcore_numba.reference import (
    bf16_bits,
    bf16_to_float,
    check_close,
    gradient_atol,
    gradient_oracle,
    gradient_rounding,
    random_qkv,
    reference_attention,
    reference_gradients,
    reference_lse,
    round_to,
)

NO_TORCH = "torch is not installed (pip install -e '.[torch]')"  # the GPU tests need it

# (the property test below draws both dQ modes on random problems too); four run by default, the
# rest (marked slow) in .ci/run
CASES = [
    pytest.param((1, 2, 20, 64), 20, 2, True, False, id="causal, a partial tile"),
    pytest.param((1, 2, 20, 64), 20, 2, True, True, id="causal, a partial tile, deterministic",
                 marks=pytest.mark.slow),
    pytest.param((2, 2, 7, 64), 23, 2, False, False, id="S_q < S_k"),
    pytest.param((1, 4, 5, 64), 9, 2, True, False, id="GQA 2, causal, S_q < S_k", marks=pytest.mark.slow),
    pytest.param((1, 4, 5, 64), 9, 2, True, True, id="GQA 2, causal, S_q < S_k, deterministic"),
    pytest.param((1, 2, 26, 64), 11, 1, True, False, id="MQA, causal, rows without keys"),
    pytest.param((1, 2, 18, 128), 17, 2, False, False, id="D=128", marks=pytest.mark.slow),
    pytest.param((1, 2, 18, 128), 17, 2, False, True, id="D=128, deterministic", marks=pytest.mark.slow),
    pytest.param((1, 2, 33, 64), 40, 1, True, False, id="bf16, MQA, causal", marks=pytest.mark.slow),
]


def gradients_close(got, ref, yardstick, rounding=(0.0, 0.0, 0.0), names=("dq", "dk", "dv")):
    """Within twice what the same formulas err by when computed as the kernels compute them
    (`yardstick`: float32 sums of 16-bit P and dS, reference_gradients(lowp=...)), plus
    gradient_atol: 1e-3 of each gradient's largest value (the grader's rule too), plus `rounding`
    (gradient_rounding: float32's residue where dS cancels; both_references gives it)."""
    for name, g, r, y, floor in zip(names, got, ref, yardstick, rounding):
        assert g.shape == r.shape, (name, g.shape, r.shape)
        verdict = check_close(g, r, y, atol=gradient_atol(r, floor))
        assert verdict.ok, f"{name}: {verdict.message} (values up to {float(np.abs(r).max()):.2e})"


def run_backward(q, k, v, o, do, lse, dtype="float16", backward=None, **kw):
    """p11_backward.backward (or `backward`: phase 12's) on 16-bit copies (bf16 as its bits); the
    gradients as float32."""
    from flashcore_numba.phases import p11_backward

    def as_16(x):
        return np.asarray(x, np.float32).astype(np.float16) if dtype == "float16" else bf16_bits(x)

    def as_32(x):
        return x.astype(np.float32) if dtype == "float16" else bf16_to_float(x)

    backward = backward or p11_backward.backward
    dq, dk, dv = backward(*(as_16(x) for x in (q, k, v, o, do)), lse, dtype=dtype, **kw)
    return dq, as_32(dk), as_32(dv)


def both_references(q, k, v, do, dtype="float16", **kw):
    """(float64 gradients, the yardstick's: float32 with 16-bit P and dS, float32's rounding floor)."""
    rounding = gradient_rounding(q, k, v, do, causal=kw.get("causal", False), scale=kw.get("scale"))
    return (*gradient_oracle(q, k, v, do, lowp=dtype, **kw), rounding)


def test_one_visible_key_per_row_leaves_only_rounding_in_dq():
    """S_k = 1, causal, S_q = 13: only the last row sees the key, its softmax is exactly one-hot,
    so dS = P ∘ (dP − Δ) and the reference's dq are exactly 0, and the kernel's dq is float32's
    rounding residue of dP − Δ (1.07e-6 here: the property test below found it, against the
    oracle's old fixed floor of 1e-6). gradient_rounding bounds it from the inputs."""
    q, k, v = (round_to(x, "float16") for x in random_qkv((1, 1, 13, 64), 1, heads_kv=1, seed=1, dtype=np.float32))
    do = round_to(np.random.default_rng(1).standard_normal(q.shape), "float16")
    o = reference_attention(q, k, v, causal=True, scale=0.3)
    lse = reference_lse(q, k, causal=True, scale=0.3)
    got = run_backward(q, k, v, o, do, lse, causal=True, scale=0.3)
    ref, yardstick, rounding = both_references(q, k, v, do, causal=True, scale=0.3)
    assert not np.any(ref[0]) and np.abs(got[0]).max() <= rounding[0] < 1e-4  # dq: a small residue
    gradients_close(got, ref, yardstick, rounding)


@pytest.mark.parametrize("shape, seq_k, heads_kv, causal, deterministic", CASES)
def test_backward_matches_the_reference_gradients(shape, seq_k, heads_kv, causal, deterministic, request):
    """dQ (by atomics, or deterministic: key blocks in turn), dK and dV summed over each group, from the
    forward's output and log-sum-exp, with the causal mask of the forward (rows that see no key
    give nothing), S_q != S_k and a scale that is not 1/sqrt(D)."""
    dtype = "bfloat16" if "bf16" in request.node.callspec.id else "float16"
    q, k, v = (round_to(x, dtype) for x in random_qkv(shape, seq_k, heads_kv=heads_kv, dtype=np.float32))
    do = round_to(np.random.default_rng().standard_normal(q.shape), dtype)
    o = reference_attention(q, k, v, causal=causal, scale=0.3)
    lse = reference_lse(q, k, causal=causal, scale=0.3)
    got = run_backward(q, k, v, o, do, lse, dtype, causal=causal, scale=0.3, deterministic=deterministic)
    gradients_close(got, *both_references(q, k, v, do, dtype, causal=causal, scale=0.3))


@pytest.mark.slow
@pytest.mark.parametrize("parts", [3])
def test_deterministic_dq_in_parts(parts):
    """deterministic=True: one block per part of dQ takes its key blocks in turn; with three parts
    the key blocks are dealt out to three blocks, each adding into its own float32 copy of dQ, and
    the copies are summed in order. Right, and the same bits on a second run. In the simulator 4 key
    blocks of 32 (one part of three takes two: a block's walk over key blocks), two query tiles, and
    the causal mask's edge in the last two key blocks, the last of which no row of the first query
    tile sees (its walk starts at the second). One part (dQ itself, no sum) is CASES' deterministic
    cases'; the group's heads in turn are CASES' (GQA 2, deterministic) and the property test's."""
    q, k, v = (round_to(x, "float16") for x in random_qkv((1, 1, 21, 64), 100, heads_kv=1, dtype=np.float32))
    do = round_to(np.random.default_rng().standard_normal(q.shape), "float16")
    o, lse = reference_attention(q, k, v, causal=True), reference_lse(q, k, causal=True)
    got = run_backward(q, k, v, o, do, lse, causal=True, deterministic=True, parts=parts)
    gradients_close(got, *both_references(q, k, v, do, causal=True))
    again = run_backward(q, k, v, o, do, lse, causal=True, deterministic=True, parts=parts)
    assert all(np.array_equal(a, b) for a, b in zip(got, again))


@pytest.mark.parametrize("deterministic", [pytest.param(False, marks=pytest.mark.slow), True])
def test_backward_with_one_ds_buffer(deterministic):
    """A GPU without room for two dSᵀ buffers (kv_shape: an A100 at D = 128, a GeForce RTX
    card at D = 64) gets kv_kernel with one, each tile's dQ behind a barrier of its own instead of
    one tile late: right too, in both builds (the simulator runs what an RTX card gets at D = 64,
    its dQ by scalar `red`; its small blocks take the full-size kernel's choice). Three query
    tiles, two key blocks, the causal edge and GQA 2."""
    from flashcore_numba.phases import p11_backward

    assert [p11_backward.kv_shape(D, cc)[2] for D in (64, 128) for cc in ((8, 0), (8, 6), (9, 0))] == \
        [2, 1, 2, 1, 1, 2]
    # past D = 128 half the keys a block: 64-row query tiles where one buffer fits beside them, else 32
    assert [p11_backward.kv_shape(256, cc) for cc in ((8, 0), (9, 0))] == [(4, 32, 2), (4, 64, 2)]
    assert p11_backward.build(128, "float16", cc=(8, 0)).kv["DS_BUFFERS"] == 1
    assert p11_backward.build(64, "float16", cc=(8, 6)).kv["DS_BUFFERS"] == 1
    q, k, v = (round_to(x, "float16") for x in random_qkv((1, 2, 33, 64), 37, heads_kv=1, dtype=np.float32))
    do = round_to(np.random.default_rng().standard_normal(q.shape), "float16")
    o, lse = reference_attention(q, k, v, causal=True), reference_lse(q, k, causal=True)
    got = run_backward(q, k, v, o, do, lse, causal=True, deterministic=deterministic, cc=(8, 6))
    gradients_close(got, *both_references(q, k, v, do, causal=True))


def test_dq_parts_fill_the_gpu_within_a_bound():
    """One part (no copies of dQ) where the (batch, K/V head) pairs fill the SMs; fewer pairs share
    out their key blocks, up to MAX_DQ_PARTS copies and never more parts than key blocks; atomics
    always have one."""
    from flashcore_numba.phases import p11_backward

    bw = p11_backward.build(64)
    n = bw.kv["OWN_ROWS"]  # keys per block
    assert bw.dq_parts(16, 16, 2048, False, sm_count=132) == 1
    assert bw.dq_parts(16, 16, 2048, True, sm_count=132) == 1  # 256 blocks for 132 SMs
    assert bw.dq_parts(1, 16, 64 * n, True, sm_count=132) == 132 // 16 == 8
    assert bw.dq_parts(1, 1, 64 * n, True, sm_count=132) == p11_backward.MAX_DQ_PARTS
    assert bw.dq_parts(1, 1, 2 * n, True, sm_count=132) == 2
    assert bw.dq_parts(4, 16, 64 * n, True, sm_count=132) == 2


def test_backward_takes_the_gradient_of_the_lse():
    """Where the log-sum-exp was used too (attention(..., return_lse=True) in a loss), its gradient
    joins dS as P ∘ dLSE; without it the gradients differ (the test can fail)."""
    q, k, v = random_qkv((1, 2, 12, 64), 30, heads_kv=1)
    rng = np.random.default_rng()
    do = rng.standard_normal(q.shape).astype(np.float16)
    dlse = rng.standard_normal(q.shape[:3]).astype(np.float32)
    o, lse = reference_attention(q, k, v, causal=True), reference_lse(q, k, causal=True)
    got = run_backward(q, k, v, o, do, lse, causal=True, dlse=dlse)
    gradients_close(got, *both_references(q, k, v, do, causal=True, dlse=dlse))
    without = reference_gradients(q, k, v, do, causal=True)
    assert np.abs(got[0] - without[0]).max() > 1e-3


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seq_q", [1, 3, 10, pytest.param(37, marks=pytest.mark.slow)])
def test_delta_kernel_rows_of_a_warp(head_dim, seq_q):
    """delta_kernel: Δ = rowsum(dO ∘ O), minus dLSE where given, for heads whose rows fill a warp's
    delta_rows_per_warp, leave it partly empty, stop short of a block or span several blocks
    (37 rows: 3 blocks at D = 64, 5 at D = 128): every row written (the output starts as NaN),
    none past the end (the simulator raises on such a write)."""
    from flashcore_numba.phases import p11_backward as p11

    rng = np.random.default_rng()
    o, do = (rng.standard_normal((2, 3, seq_q, head_dim)).astype(np.float16) for _ in range(2))
    dlse = rng.standard_normal(o.shape[:3]).astype(np.float32)
    want = (o.astype(np.float64) * do.astype(np.float64)).sum(-1)
    bw = p11.build(head_dim)
    words = [np.ascontiguousarray(x).view(np.uint32) for x in (o, do)]
    for use_dlse in (False, True):
        delta = np.full(o.shape[:3], np.nan, np.float32)
        grid = bw.delta_grid(2, 3, seq_q)
        bw.delta_kernel[grid, 32 * p11.DELTA_WARPS](*words, dlse, use_dlse, delta)
        assert not np.isnan(delta).any()
        np.testing.assert_allclose(delta, want - dlse if use_dlse else want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("seq_q, seq_k", [(0, 9), (7, 0)])
def test_backward_of_an_empty_sequence_is_zero(seq_q, seq_k):
    """No query rows (dK = dV = 0) or no keys (dQ = 0, nothing to recompute): zeros, never the
    poison the outputs start with."""
    q, k, v = random_qkv((1, 2, seq_q, 64), seq_k, heads_kv=1, dtype=np.float32)
    o, lse = np.zeros(q.shape), np.full(q.shape[:3], -np.inf)
    got = run_backward(q, k, v, o, np.ones(q.shape), lse)
    for g, x in zip(got, (q, k, v)):
        assert g.shape == x.shape and not np.any(g), g


def _compile_backward():
    from flashcore_numba.measure.machine_code import kernel_reports

    return kernel_reports(["11-kv", "11-kv-serial", "11-delta", "11-sum"], 64)


def start_background(items, pool):
    """The sm_90a compile (a subprocess in the simulator, ~17 s this process would only wait for) in
    the session's pool of background jobs (conftest.py), if a selected test of this module reads it."""
    this_module = sys.modules[__name__]
    if any(getattr(item, "module", None) is this_module and "backward_reports" in item.fixturenames
           for item in items):
        return pool.submit(_compile_backward)
    return None


@pytest.fixture(scope="module")
def backward_reports(background):
    # compiled here in a GPU session (no background jobs), or if the job is still waiting for a
    # worker of the pool (cancel() then takes it off the queue: it never runs twice)
    if background is None or background.cancel():
        return _compile_backward()
    return background.result()


@pytest.mark.slow
def test_backward_kernels_compiled_for_the_h100(backward_reports):
    """sm_90a machine code, no GPU needed (measure/machine_code.py, as lesson 11 shows it): at D = 64
    no kernel spills or keeps a stack frame (kv_kernel keeps a warp's dK and dV, 16 keys x 64, in
    registers for its whole loop, in both builds); kv_kernel adds dQ by reductions that read nothing
    back, two columns at a time (ptx/red.ptx), and multiplies on mma.sync; only the serial build
    (deterministic=True) loops over key blocks."""
    reports = backward_reports
    for kernel_id, r in reports.items():
        assert (r["spill_store_bytes"], r["spill_load_bytes"], r["stack_frame_bytes"]) == (0, 0, 0), (
            f"{kernel_id}: {r['registers']} registers, {r['spill_store_bytes']} B spilled, "
            f"{r['stack_frame_bytes']} B stack")
    for kernel_id in ("11-kv", "11-kv-serial"):
        ptx = reports[kernel_id]["ptx"]
        assert "red.global.add.v2.f32" in ptx and "atom.global" not in ptx, kernel_id
        assert "mma.sync.aligned.m16n8k16" in ptx, kernel_id
    # the serial build reads its number of blocks (the key blocks' stride); the default has no loop
    assert "%nctaid.x" in reports["11-kv-serial"]["ptx"] and "%nctaid.x" not in reports["11-kv"]["ptx"]


def test_backward_refuses_other_head_dims():
    from flashcore_numba.phases import p11_backward

    for D in (100, 264):  # not a multiple of 8; wider than the widest tile
        with pytest.raises(ValueError, match=f"head dim: the backward is built for multiples of 8 up to 256, not {D}"):
            p11_backward.build(D)
    with pytest.raises(ValueError, match="dtype: the backward builds float16 and bfloat16, not 'float32'"):
        p11_backward.build(64, "float32")


# ---------------------------------------------------------------------------------------------
# On a GPU, through attention()'s autograd
# ---------------------------------------------------------------------------------------------
GPU_CASES = [
    pytest.param((2, 4, 300, 64), 300, 4, True, "float16", id="D=64 causal fp16"),
    pytest.param((1, 4, 200, 128), 450, 2, False, "bfloat16", id="D=128 GQA 2 S_q<S_k bf16"),
    pytest.param((1, 2, 130, 64), 70, 1, True, "float16", id="MQA causal S_q>S_k"),
    pytest.param((2, 4, 260, 96), 333, 2, True, "float16", id="D=96 GQA 2 causal fp16"),
    pytest.param((1, 4, 150, 40), 150, 4, False, "bfloat16", id="D=40 bf16"),
    pytest.param((1, 4, 200, 256), 260, 2, True, "bfloat16", id="D=256 GQA 2 causal S_q<S_k bf16"),
    pytest.param((2, 2, 150, 160), 150, 2, False, "float16", id="D=160 fp16"),
]


def torch_gradients(q, k, v, do, causal, scale, dtype):
    """(float64 reference, same-dtype yardstick) gradients from torch's own autograd: SDPA's math
    backend on float64 copies, and on the inputs' dtype (its error is the tolerance's yardstick)."""
    import torch

    def grads(q, k, v, do):
        q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
        group = q.shape[1] // k.shape[1]
        kk, vv = (x.repeat_interleave(group, dim=1) for x in (k, v))
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
            out = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=False, scale=scale,
                                                                   attn_mask=mask(q, k, causal))
        out.backward(do)
        return [x.grad for x in (q, k, v)]

    def mask(q, k, causal):
        if not causal:
            return None
        S_q, S_k = q.shape[2], k.shape[2]
        rows = torch.arange(S_q, device=q.device)[:, None]
        return torch.arange(S_k, device=q.device)[None, :] <= rows + (S_k - S_q)

    ref = grads(*(x.double() for x in (q, k, v, do)))
    lowp = grads(q, k, v, do)
    return ref, lowp


@pytest.mark.gpu
@pytest.mark.parametrize("shape, seq_k, heads_kv, causal, dtype", GPU_CASES)
def test_autograd_matches_torch_on_gpu(shape, seq_k, heads_kv, causal, dtype):
    """attention()'s output has a grad_fn; backward() gives dq, dk, dv that pass
    close_to_torchs_gradients (torch's float64 autograd the reference), fully masked rows (causal
    with S_q > S_k) included."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    from flashcore_numba import attention

    q, k, v = (torch.tensor(x, device="cuda").to(getattr(torch, dtype)).requires_grad_()
               for x in random_qkv(shape, seq_k, heads_kv=heads_kv, dtype=np.float32))
    do = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    out = attention(q, k, v, causal=causal, scale=0.2)
    assert out.grad_fn is not None
    out.backward(do)
    close_to_torchs_gradients([x.grad for x in (q, k, v)], q, k, v, do, causal, 0.2, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("D, Dv", [(192, 128), (64, 128)], ids=["MLA 192-128", "v wider 64-128"])
def test_autograd_with_a_value_head_dim_of_its_own_on_gpu(D, Dv):
    """v of a head dim of its own through autograd: the forward on phase 09 (07 for 64/128), the
    backward at the wider head dim on zero-padded operands (torch_ops._padded_backward), the
    gradients of q's, k's and v's widths close to torch's; GQA 2, causal, S_q < S_k."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    from flashcore_numba import attention

    host = random_qkv((1, 4, 200, D), 230, heads_kv=2, dtype=np.float32, value_dim=Dv)
    q, k, v = (torch.tensor(x, device="cuda").half().requires_grad_() for x in host)
    do = torch.randn(1, 4, 200, Dv, device="cuda", dtype=torch.float16)
    out = attention(q, k, v, causal=True, scale=0.2)
    assert tuple(out.shape) == (1, 4, 200, Dv)
    out.backward(do)
    assert [tuple(x.grad.shape) for x in (q, k, v)] == [tuple(x.shape) for x in (q, k, v)]
    close_to_torchs_gradients([x.grad for x in (q, k, v)], q, k, v, do, True, 0.2, "float16")


@pytest.mark.gpu
@pytest.mark.parametrize("needs", [(True, False, False), (False, True, True), (False, False, True)],
                         ids=["q only", "k and v", "v only"])
def test_partial_requires_grad_on_gpu(needs):
    """Only some inputs require grad (a frozen projection): each of those gets the gradient that a
    call with all three requiring grad gives, bit for bit (deterministic=True: dQ in a fixed order),
    the others none. GQA 2, causal, S_q != S_k, a scale of its own."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    from flashcore_numba import attention

    host = random_qkv((2, 4, 133, 64), 150, heads_kv=2, dtype=np.float32)
    do = torch.randn(2, 4, 133, 64, device="cuda", dtype=torch.float16)
    runs = []
    for wants in (needs, (True, True, True)):
        xs = [torch.tensor(x, device="cuda").half().requires_grad_(w) for x, w in zip(host, wants)]
        attention(*xs, causal=True, scale=0.3, deterministic=True).backward(do)
        runs.append([x.grad for x in xs])
    for got, every, wants in zip(*runs, needs):
        assert (got is not None) == wants and (not wants or torch.equal(got, every))


def close_to_torchs_gradients(got, q, k, v, do, causal, scale, dtype):
    """Torch tensors `got` (dq, dk, dv) against torch's float64 autograd: within twice what torch's
    own same-dtype autograd errs by (plus 1e-3), or within the CPU tests' rule (gradients_close: the
    same formulas computed as a tensor-core backward computes them, o stored in 16 bits), whichever
    allows more. Torch's softmax backward takes rowsum(dP ∘ P) from P; FlashAttention's takes
    Δ = rowsum(dO ∘ O) from the 16-bit O the forward stored, and in rows that see few keys
    dS = P ∘ (dP − Δ) cancels, so O's rounding is most of dq's error there: on 40 random problems
    of GPU_CASES' MQA case the tensor-core formulas alone err by up to 0.83 of torch's allowance (on
    the CPU), and one GPU run (at e4a013e) failed torch's rule there. A row that sees no key: SDPA's
    masked softmax may leave it NaN (older torch versions), so there both rules compare with the NumPy
    reference, which gives 0."""
    import torch

    ref, lowp = torch_gradients(q, k, v, do, causal, scale, dtype)
    host = [x.detach().float().cpu().numpy() for x in (q, k, v, do)]
    references, yardstick = gradient_oracle(*host, lowp=dtype, causal=causal, scale=scale)  # float64
    rounding = gradient_rounding(*host, causal=causal, scale=scale)
    for name, g, r, l, rn, y, floor in zip(("dq", "dk", "dv"), got, ref, lowp, references, yardstick, rounding):
        assert torch.isfinite(g).all(), name
        seen = torch.isfinite(r) & torch.isfinite(l)  # torch's own error where it has one
        r = torch.where(torch.isfinite(r), r, torch.as_tensor(rn, device=r.device))
        err = (g.double() - r).abs().max().item()
        allowed = 2 * ((l.double() - r)[seen].abs().max().item() if seen.any() else 0.0) + 1e-3
        verdict = check_close(g.float().cpu().numpy(), rn, y, atol=gradient_atol(rn, floor))
        assert err <= allowed or verdict.ok, \
            f"{name}: error {err:.2e}, torch's rule allows {allowed:.2e}; the tensor-core rule: {verdict.message}"


def test_the_gpu_tests_gradient_rule_in_the_simulator():
    """close_to_torchs_gradients (the GPU test's rule) on the simulated backward, torch on the CPU:
    it passes the kernel's gradients, rows without keys included, and fails them with one dq value
    off by a tenth, in a row that sees keys or in one that sees none."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    q, k, v = (round_to(x, "float16") for x in random_qkv((1, 2, 26, 64), 11, heads_kv=1, dtype=np.float32))
    do = round_to(np.random.default_rng().standard_normal(q.shape), "float16")
    o = reference_attention(q, k, v, causal=True, scale=0.2)
    lse = reference_lse(q, k, causal=True, scale=0.2)
    got = [torch.tensor(np.asarray(g, np.float32)) for g in run_backward(q, k, v, o, do, lse, causal=True, scale=0.2)]
    inputs = [torch.tensor(np.asarray(x, np.float32)).half() for x in (q, k, v, do)]
    close_to_torchs_gradients(got, *inputs, True, 0.2, "float16")
    bad = [g.clone() for g in got]
    bad[0][0, 1, 20, 3] += 0.1 * got[0].abs().max()  # row 20 sees keys 0..5
    with pytest.raises(AssertionError, match="dq: error"):
        close_to_torchs_gradients(bad, *inputs, True, 0.2, "float16")
    bad = [g.clone() for g in got]
    bad[0][0, 0, 5, 3] = 0.1 * got[0].abs().max()  # row 5 sees no key: its dq must be 0
    with pytest.raises(AssertionError, match="dq: error"):
        close_to_torchs_gradients(bad, *inputs, True, 0.2, "float16")


@pytest.mark.gpu
def test_deterministic_gradients_are_bit_identical_on_gpu():
    """deterministic=True: the same gradients bit for bit on every run (dQ summed in one order;
    8 (batch, K/V head) pairs and 3 key blocks: dQ in 3 parts, in torch's memory); and close to
    the default's (atomics)."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    from flashcore_numba import attention

    q, k, v = (torch.randn(2, 4, 257, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    runs = []
    for deterministic in (True, True, False):
        for x in (q, k, v):
            x.grad = None
        attention(q, k, v, causal=True, deterministic=deterministic).backward(do)
        runs.append([x.grad.clone() for x in (q, k, v)])
    for a, b in zip(runs[0], runs[1]):
        assert torch.equal(a, b)
    for a, c in zip(runs[0], runs[2]):
        assert (a.float() - c.float()).abs().max().item() < 1e-2


@pytest.mark.gpu
def test_training_step_matches_sdpa_on_gpu():
    """One training step of a small attention module (projections, attention, loss, backward, an
    optimizer step) with attention() and with SDPA: the same loss and close weights after it."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    from flashcore_numba import attention

    class Block(torch.nn.Module):
        def __init__(self, fn):
            super().__init__()
            torch.manual_seed(0)
            self.qkv = torch.nn.Linear(256, 3 * 256, device="cuda", dtype=torch.float16)
            self.fn = fn

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 128, 3, 4, 64).permute(2, 0, 3, 1, 4).contiguous().unbind(0)
            return self.fn(q, k, v).square().mean()

    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.float16)
    ours = Block(lambda q, k, v: attention(q, k, v, causal=True))
    theirs = Block(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    losses = []
    for model in (ours, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=10.0)
        loss = model(x)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 1e-3 * abs(losses[1]) + 1e-5
    moved = (theirs.qkv.weight.float() - ours.qkv.weight.float()).abs().max().item()
    assert moved < 1e-2, moved


@pytest.mark.gpu
def test_torch_compile_with_backward_on_gpu():
    """torch.compile(fullgraph=True) of a function that calls attention() on tensors that need
    grad, then backward(): no graph break (fullgraph) and the eager gradients."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    from flashcore_numba import attention

    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    fn = torch.compile(lambda q, k, v: attention(q, k, v, causal=True, deterministic=True).float().sum(),
                       fullgraph=True)
    fn(q, k, v).backward()
    compiled = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    attention(q, k, v, causal=True, deterministic=True).float().sum().backward()
    for a, b in zip(compiled, (q.grad, k.grad, v.grad)):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_random_backward_problems_in_the_simulator():
    """Property test: random S_q and S_k (tails, S_q > S_k with rows that see no key), causal or
    not, the scale, the GQA group, batch, D = 64 and 128, fp16 or bf16, atomics or the deterministic pass: the
    gradients of the float64 reference, every time."""
    pytest.importorskip("hypothesis", reason="hypothesis is not installed (pip install -e '.[dev]')",
                        exc_type=ImportError)
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    # 4 examples (the first is hypothesis's simplest, S_q = S_k = 1), 3 random: CASES above name each
    # path on its own (GQA, MQA, S_q < S_k, rows without keys, D = 128, bf16, deterministic), and every
    # run draws new problems (no database): the simulator's budget (~18 s an example)
    @settings(max_examples=4, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(seq_q=st.integers(1, 40), seq_k=st.integers(1, 40), causal=st.booleans(),
           scale=st.sampled_from([None, 0.05, 0.3, 2.0]), group=st.sampled_from([1, 2, 3]),
           batch=st.integers(1, 2), head_dim=st.sampled_from([64, 128]), deterministic=st.booleans(),
           dtype=st.sampled_from(["float16", "bfloat16"]), seed=st.integers(0, 2**31 - 1))
    def check(seq_q, seq_k, causal, scale, group, batch, head_dim, deterministic, dtype, seed):
        q, k, v = (round_to(x, dtype) for x in random_qkv((batch, group, seq_q, head_dim), seq_k, heads_kv=1,
                                                          seed=seed, dtype=np.float32))
        do = round_to(np.random.default_rng(seed).standard_normal(q.shape), dtype)
        o = reference_attention(q, k, v, causal=causal, scale=scale)
        lse = reference_lse(q, k, causal=causal, scale=scale)
        got = run_backward(q, k, v, o, do, lse, dtype, causal=causal, scale=scale, deterministic=deterministic)
        gradients_close(got, *both_references(q, k, v, do, dtype, causal=causal, scale=scale))

    check()


# ---------------------------------------------------------------------------------------------
# The benchmark record (measure/backward.py) and its README table
# ---------------------------------------------------------------------------------------------
def test_backward_record_table_sets_each_row_beside_sdpa_flash(tmp_path):
    """A record as `flashcore bench --backward` writes it (rows built here, not measured): valid by
    the schema, and the README table puts every backward row beside SDPA flash's backward and every
    step row beside its step, says why a row has no figure, and names the FLOP rule."""
    from flashcore_numba.measure import backward, bench, records, report

    problem = bench.Problem.from_shape((2, 2, 256, 64), causal=True)
    flops = int(backward.BACKWARD_FLOPS * problem.flops)
    rows = []
    for name, kind, ms in (("11", "phase", 2.0), ("11-deterministic", "phase", 2.5), ("sdpa_flash", "peer", 1.0),
                           ("11-step", "phase", 3.0), ("sdpa_flash-step", "peer", 1.5)):
        r = records.Result(name, kind, f"title of {name}", correct=True, message="ok", max_err=1e-4, allowed_err=1e-3)
        bench.set_timing(r, [ms] * 3, int(flops * (1.4 if "step" in name else 1.0)), None)
        if name == "11-step":  # --calls: the step back to back
            r.call = bench.distribution([3.1, 3.2, 3.3])
        rows.append(r)
    rows.append(records.Result("sdpa_cudnn", "peer", "cuDNN", correct=False, message="max error 1 > allowed 0.1",
                               max_err=1.0, allowed_err=0.1))
    record = records.build_record(problem=problem, results=rows, provenance={"gpu_name": "Test GPU", "git_commit": None},
                                  timing=bench.Timing(), ceiling=None, oracle={"reference": "t", "yardstick": "t"},
                                  command=["flashcore", "bench", "--backward"], seed=1)
    record["flops"], record["flops_rule"] = flops, backward.FLOPS_RULE
    record["config"]["pass"] = "backward"  # as run_backward_benchmark marks it
    assert records.validate_record(record) == []
    path = records.write_record(record, tmp_path / "backward" / "r.json")
    assert backward.record_path("Test GPU", problem).name == "test-gpu_backward_b2h2s256d64_fp16_causal.json"
    lines = report.backward_table(records.load_records(path.parent), tmp_path)
    text = "\n".join(lines)
    assert "| 11: title of 11 | 2.000 |" in text and "| 0.50× |" in text  # half SDPA flash's speed
    step = next(line for line in lines if "| 11-step:" in line)
    assert "| 3.000 |" in step and step.endswith("| 0.50× | 3.200 (3.298) |"), step  # beside SDPA flash's step
    assert next(line for line in lines if "| 11: " in line).endswith("| — |")  # no call time recorded
    assert "FAILED the gate: max error 1 > allowed 0.1" in text
    assert "count 2.5 x the forward's FLOPs" in text and "backward/r.json" in text
    block = " ".join(line.strip() for line in report.backward_measured_lines(records.load_records(path.parent)))
    assert "11 " in block and "(0.50x SDPA flash)" in block and "r.json" in block, block
    assert report.backward_measured_lines([]) == ["    not measured yet"]
    # records of two GPUs: a table each, the GPU measured last first, never one GPU's name over both
    other = dict(record, created="2999-01-01T00:00:00", provenance={"gpu_name": "Newer GPU", "git_commit": None})
    records.write_record(other, tmp_path / "backward" / "s.json")
    lines = report.backward_table(records.load_records(path.parent), tmp_path)
    headers = [line for line in lines if line.startswith("Measured on the ")]
    assert [h.split(":")[0] for h in headers] == ["Measured on the Newer GPU", "Measured on the Test GPU"]
    assert sum(line.startswith("Records: ") for line in lines) == 2
    block = " ".join(line.strip() for line in report.backward_measured_lines(records.load_records(path.parent)))
    assert "Newer GPU, " in block and "Test GPU, " in block, block


@pytest.mark.gpu
def test_backward_benchmark_writes_a_valid_record(tmp_path):
    """`flashcore bench --backward` on a small problem: phase 11 both ways, SDPA's backward and one
    training step each, every row gated before it is timed; a record of the schema."""
    pytest.importorskip("torch", reason=NO_TORCH)
    import json

    from numba import cuda

    from flashcore_numba.runtime.torch_ops import autograd_backward_phase
    from flashcore_numba.cli import main
    from flashcore_numba.measure import records

    out = tmp_path / "backward" / "r.json"
    assert main(["bench", "--backward", "--shape", "1,4,256,64", "--causal", "--repeats", "20",
                 "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert records.validate_record(record) == []
    names = [r["name"] for r in record["results"]]
    step = f"{autograd_backward_phase(cuda.get_current_device().compute_capability)}-step"  # 13-step on Hopper
    assert names[:2] == ["11", "11-deterministic"] and step in names and "sdpa_flash" in names, names
    assert all(r["correct"] for r in record["results"] if r["kind"] == "phase"), record["results"]


@pytest.mark.gpu
def test_backward_benchmark_flex_peer_on_gpu(tmp_path):
    """`--peers flex` with GQA and causal: FlexAttention's backward and its step pass the gradient
    oracle and are timed, or are recorded unavailable with the reason (no triton, a compile that
    fails); never a crash, never a figure for a gradient that failed."""
    pytest.importorskip("torch", reason=NO_TORCH)
    import json

    from flashcore_numba.cli import main

    out = tmp_path / "backward" / "flex.json"
    assert main(["bench", "--backward", "--shape", "1,4,256,64", "--kv-heads", "2", "--causal", "--repeats", "20",
                 "--peers", "flex", "--out", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    for name in ("flex_attention", "flex_attention-step"):
        r = rows[name]
        assert (r["correct"] and r["median_ms"]) if r["available"] else r["reason"], r


# ---------------------------------------------------------------------------------------------
# FlexAttention's backward as a peer (measure/backward.py), without a GPU: stand-ins for the device
# ---------------------------------------------------------------------------------------------
class StandInDevice:
    """What run_backward_benchmark asks of bench.TorchDevice, on the CPU: small float32 torch tensors,
    SDPA's math backend wherever a GPU backend would run (FlexAttention's too), fixed timings. Each
    sdpa call notes its backend and torch's donated_buffer setting at the call; `flex_raises` is
    raised by FlexAttention's call, as a compile that fails raises."""

    kind, name, cc, torch_cuda = "torch", "Stand-in GPU", (8, 0), None

    def __init__(self, flex_raises=None):
        import torch

        self.torch, self.flex_raises, self.calls = torch, flex_raises, []

    def inputs(self, problem, seed):
        g = self.torch.Generator().manual_seed(seed)
        kv = (problem.B, problem.heads_kv, problem.S_k, problem.D)
        return None, (self.torch.randn(problem.B, problem.H, problem.S_q, problem.D, generator=g),
                      self.torch.randn(kv, generator=g), self.torch.randn(kv, generator=g))

    def sdpa(self, backend, q, k, v, problem):
        from torch._functorch import config

        self.calls.append((backend, config.donated_buffer))
        if backend == "FLEX" and self.flex_raises is not None:
            raise self.flex_raises
        return self.torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=problem.causal, enable_gqa=k.shape[1] != q.shape[1])

    def time_ms(self, launch, timing):
        launch()  # a second backward on the peer's graph: retain_graph kept it
        return [1.0, 2.0, 3.0]

    def release(self):
        pass


@pytest.fixture
def stand_ins(monkeypatch):
    """attention() as SDPA's math (our kernels' rows need a GPU and are left out: backward_rows is
    empty), and triton reported installed, so that FlexAttention's rows are the peer's to pass or fail."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    import importlib.machinery
    import importlib.util

    import flashcore_numba.api
    from flashcore_numba.measure import backward

    def attention(q, k, v, causal=False, return_lse=False):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                               enable_gqa=k.shape[1] != q.shape[1])
        return (out, None) if return_lse else out

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: importlib.machinery.ModuleSpec(name, None)
                        if name == "triton" else find_spec(name, *a))
    monkeypatch.setattr(flashcore_numba.api, "attention", attention)
    monkeypatch.setattr(backward, "backward_rows", lambda device: [])
    return monkeypatch


def test_flex_backward_rows_are_gated_and_timed_with_stand_ins(stand_ins):
    """--peers flex adds flex_attention (the backward alone, on a retained graph compiled without
    donated buffers) and flex_attention-step, each gated by the gradient oracle and timed with the
    FLOPs the SDPA peers' rows count; a record of the schema."""
    from torch._functorch import config

    from flashcore_numba.measure import backward, bench, records

    problem = bench.Problem(1, 4, 24, 24, 64, causal=True, H_kv=2)  # GQA through enable_gqa
    device = StandInDevice()
    donated = config.donated_buffer
    record = backward.run_backward_benchmark(problem, peer_names=["sdpa_flash", "flex_attention"], device=device,
                                             command=["flashcore", "bench", "--backward"], seed=3)
    assert records.validate_record(record) == []
    rows = {r["name"]: r for r in record["results"]}
    assert list(rows) == ["sdpa_flash", "flex_attention", "11-step", "sdpa_flash-step", "flex_attention-step"]
    flex, step = rows["flex_attention"], rows["flex_attention-step"]
    assert flex["kind"] == step["kind"] == "peer" and flex["correct"] and step["correct"], (flex, step)
    assert flex["title"] == "torch FlexAttention, torch.compile'd, backward"
    assert flex["median_ms"] == 2.0 and flex["tflops"] == pytest.approx(rows["sdpa_flash"]["tflops"])
    assert step["tflops"] == pytest.approx(backward.STEP_FLOPS / backward.BACKWARD_FLOPS * flex["tflops"])
    assert "dq: " in flex["message"] and "dv: " in flex["message"]
    # the forward whose graph the backward row retains ran with donated buffers off; the setting is restored
    flex_calls = [setting for backend, setting in device.calls if backend == "FLEX"]
    assert flex_calls[0] is False and config.donated_buffer == donated, device.calls
    assert all(setting == donated for backend, setting in device.calls if backend != "FLEX")


def test_flex_backward_unavailable_says_why_and_the_run_goes_on(stand_ins):
    """Where FlexAttention cannot run, its two rows are recorded unavailable with the reason (a torch
    without it, no triton, a compile that fails), never a crash, and the other peers are timed."""
    import sys

    from flashcore_numba.measure import backward, bench, records

    problem = bench.Problem(1, 2, 16, 16, 64)
    peers = ["flex_attention", "sdpa_flash"]

    def run(device):
        record = backward.run_backward_benchmark(problem, peer_names=peers, device=device, command=["x"], seed=1)
        assert records.validate_record(record) == []
        rows = {r["name"]: r for r in record["results"]}
        assert rows["sdpa_flash"]["correct"] and rows["sdpa_flash-step"]["correct"], rows
        flex = [rows["flex_attention"], rows["flex_attention-step"]]
        assert all(r["available"] is False and r["median_ms"] is None for r in flex), flex
        return [r["reason"] for r in flex]

    # a compile that fails: the exception is the reason
    failed = run(StandInDevice(flex_raises=RuntimeError("BackendCompilerFailed: triton could not compile\nmore")))
    assert failed == ["RuntimeError: BackendCompilerFailed: triton could not compile"] * 2, failed
    # no triton: said before anything is compiled, and FlexAttention is never called
    stand_ins.setitem(sys.modules, "triton", None)
    device = StandInDevice()
    reasons = run(device)
    assert all(r.startswith("no triton: torch.compile builds FlexAttention's kernels") for r in reasons), reasons
    assert "FLEX" not in [backend for backend, _ in device.calls]
    forward, launch = bench.check_peer("flex_attention", device, None, problem, None, None)  # the forward's bench
    assert launch is None and forward.available is False and forward.reason == reasons[0]
    # a torch without FlexAttention (before 2.5)
    stand_ins.setitem(sys.modules, "torch.nn.attention.flex_attention", None)
    reasons = run(StandInDevice())
    assert all("has no FlexAttention (torch >= 2.5)" in r for r in reasons), reasons
    assert bench.flex_skip_reason(device.torch) == reasons[0]


def test_backward_peers_flex_by_name_through_the_cli(stand_ins, tmp_path):
    """`flashcore bench --backward` compares SDPA's flash and cuDNN backward by default (FlexAttention
    compiles per shape first, so it is asked for, as in the forward's bench); `--peers flash,flex` gives
    sdpa_flash and flex_attention, each with its step row, in the record the command writes."""
    import json

    from flashcore_numba import cli
    from flashcore_numba.measure import backward, bench

    assert backward.BACKWARD_PEERS == ("sdpa_flash", "sdpa_cudnn")
    assert cli.parse_peers("flash,flex") == ["sdpa_flash", "flex_attention"]
    stand_ins.setattr(cli, "kernel_target", lambda: "gpu")
    stand_ins.setattr(bench, "open_device", StandInDevice)
    stand_ins.setenv("COLUMNS", "250")
    names = {}
    for peers in ([], ["--peers", "flash,flex"]):
        out = tmp_path / f"{len(peers)}.json"
        assert cli.main(["bench", "--backward", "--shape", "1,2,16,64", *peers, "--out", str(out)]) == 0
        names[tuple(peers)] = [r["name"] for r in json.loads(out.read_text())["results"]]
    assert names[()] == ["sdpa_flash", "sdpa_cudnn", "11-step", "sdpa_flash-step", "sdpa_cudnn-step"]
    assert names["--peers", "flash,flex"] == ["sdpa_flash", "flex_attention", "11-step", "sdpa_flash-step",
                                              "flex_attention-step"]


def test_the_report_reads_flex_attention_from_backward_records(stand_ins, tmp_path):
    """A backward record with FlexAttention's rows (made by the run with stand-ins, its config then set
    to a reference problem): the README headline's backward row shows FlexAttention's figure where it
    said "not measured", the backward table lists both its rows beside SDPA flash's, and a phase's
    "Measured effect" never takes flex_attention-step for the step autograd ran. Without the rows, the
    cell says "not measured"."""
    import torch

    import flashcore_numba.api
    from flashcore_numba.measure import backward, bench, records, report
    from flashcore_numba.runtime import torch_ops

    def attention_backward(q, k, v, out, lse, do, dlse, causal, scale, deterministic, phase):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out = flashcore_numba.api.attention(*leaves, causal=causal)  # the stand-in: SDPA's math
        return torch.autograd.grad(out, leaves, do)

    stand_ins.setattr(torch_ops, "attention_backward", attention_backward)
    stand_ins.setattr(backward, "backward_rows", lambda device: [("13", False)])  # as on Hopper
    problem = bench.Problem(1, 2, 16, 16, 64)
    record = backward.run_backward_benchmark(problem, peer_names=["sdpa_flash", "sdpa_cudnn", "flex_attention"],
                                             device=StandInDevice(), command=["x"], seed=2)
    B, H, S, D = bench.REFERENCE_SHAPE
    record["config"].update(B=B, H=H, S_q=S, S_k=S, D=D)
    rows = {r["name"]: r for r in record["results"]}
    assert rows["13"]["correct"] and rows["flex_attention"]["correct"], record["results"]

    def headline(record):
        folder = tmp_path / record["created"].replace(":", "")
        records.write_record(record, folder / "backward" / "r.json")
        lines = report.headline_table([], records.load_records(folder / "backward"), folder, None,
                                      folder / "docs" / "performance.md")
        header = next(line for line in lines if line.startswith("| pass, phase"))
        row = next(line for line in lines if line.startswith("| backward, 13 (TFLOPS) | [B=16 H=16"))
        return dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in row.split("|")]))

    cells = headline(record)
    assert cells["FlexAttention"] == bench.format_tflops(rows["flex_attention"]["tflops"]), cells
    assert cells["SDPA cuDNN"] == bench.format_tflops(rows["sdpa_cudnn"]["tflops"]), cells
    without = dict(record, created="2026-01-02T00:00:00",
                   results=[r for r in record["results"] if not r["name"].startswith("flex_attention")])
    assert headline(without)["FlexAttention"] == report.NOT_MEASURED_CELL

    lines = report.backward_table(records.load_records(tmp_path / record["created"].replace(":", "") / "backward"),
                                  tmp_path)
    flex = [line for line in lines if "| flex_attention" in line]
    assert [line.split("|")[2].split(":")[0].strip() for line in flex] == ["flex_attention", "flex_attention-step"]
    assert all(line.endswith("| 1.00× | — |") for line in flex), flex  # the same stand-in time as SDPA flash's
    # a run whose autograd step (11's, off Hopper) did not pass: no step of a peer is named in its place
    failed = dict(record, results=[r for r in record["results"] if r["name"] != "11-step"], _path="r.json")
    block = " ".join(line.strip() for line in report.backward_measured_lines([failed], "13"))
    assert "13-step not timed (r.json)" in block and "flex_attention-step" not in block, block

"""The serving contract on a GPU: every entry point runs from any thread, never waits for the GPU,
is captured in a CUDA graph, refuses a misaligned tensor by name (never losing the CUDA context),
and keeps packed sequences apart (docs/guide.md, "Serving").

Run on a GPU machine with `FLASHCORE_GPU=1 python3 -m pytest -m gpu`; without one these skip with
the reason. The tests that need a fresh process (a thread that has never done CUDA work, autograd's
first backward) run their check in a new Python process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from flashcore_numba import check_close

pytestmark = pytest.mark.gpu
NO_TORCH = "torch is not installed (pip install -e '.[torch]')"
ROOT = Path(__file__).resolve().parents[1]


def _fresh_process(script: str) -> dict:
    """Run `script` in a new Python process on this checkout; it prints one JSON line last."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, env=env,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_first_backward_given_its_gradient():
    """autograd's device thread has done no CUDA work when attention's node is the first work it runs
    (torch.autograd.grad with an explicit gradient): the backward's launches must still find the
    device's context, and the gradients match SDPA's. The context stays current on that thread
    after them: q's projection (a matmul, cuBLAS) runs its backward there next, and cuBLAS warns
    when it finds no current context."""
    r = _fresh_process("""
        import json, warnings, torch
        from flashcore_numba import attention
        q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.float16, requires_grad=True)
                   for _ in range(3))
        w = torch.eye(64, device="cuda", dtype=torch.float16, requires_grad=True)  # q's projection
        out = attention(q @ w, k, v, causal=True)
        grad = torch.randn_like(out)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = torch.autograd.grad(out, (q, k, v), grad)
        qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
        want = torch.autograd.grad(ref, (qf, kf, vf), grad.float())
        errors = [float((g.float() - w).abs().max() / w.abs().max()) for g, w in zip(got, want)]
        print(json.dumps({"errors": errors, "warnings": [str(c.message) for c in caught]}))
    """)
    assert max(r["errors"]) < 1e-2, r  # relative to the largest gradient: fp16 against float32
    assert not [m for m in r["warnings"] if "context" in m], r["warnings"]


def test_every_entry_point_from_a_new_thread():
    """A server's worker thread that has never done CUDA work: attention() (prefill and decode),
    attention_kvcache, attention_varlen and the NumPy path, each against the same call made on the
    main thread."""
    r = _fresh_process("""
        import json, threading, numpy as np, torch
        from flashcore_numba import attention, attention_kvcache, attention_varlen
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 8, 200, 64, device="cuda", dtype=torch.float16) for _ in range(3))
        q1 = torch.randn(4, 32, 1, 128, device="cuda", dtype=torch.float16)
        k1, v1 = (torch.randn(4, 8, 2000, 128, device="cuda", dtype=torch.float16) for _ in range(2))
        qc = torch.randn(4, 1, 32, 128, device="cuda", dtype=torch.float16)
        kc, vc = (torch.randn(4, 2000, 8, 128, device="cuda", dtype=torch.float16) for _ in range(2))
        lens = torch.tensor([5, 2000, 1, 700], dtype=torch.int32, device="cuda")
        cu = torch.tensor([0, 100, 100, 350], dtype=torch.int32, device="cuda")
        qp, kp, vp = (torch.randn(350, 8, 64, device="cuda", dtype=torch.float16) for _ in range(3))
        qn, kn, vn = (np.random.default_rng(0).standard_normal((1, 2, 70, 64)).astype(np.float16)
                      for _ in range(3))
        calls = {
            "prefill": lambda: attention(q, k, v, causal=True),
            "decode": lambda: attention(q1, k1, v1),
            "kvcache": lambda: attention_kvcache(qc, kc, vc, lens),
            "varlen": lambda: attention_varlen(qp, kp, vp, cu, cu, 250, 250, causal=True),
            "numpy": lambda: torch.from_numpy(attention(qn, kn, vn, phase="07")),
        }
        results = {}
        def worker():
            for name, call in calls.items():
                try:
                    results[name] = call()
                    torch.cuda.synchronize()
                except Exception as e:
                    results[name] = f"{type(e).__name__}: {e}"
        t = threading.Thread(target=worker)
        t.start(); t.join()
        report = {}
        for name, call in calls.items():
            got = results[name]
            report[name] = got if isinstance(got, str) else bool(torch.equal(got.cpu(), call().cpu()))
        print(json.dumps(report))
    """)
    assert r == {name: True for name in ("prefill", "decode", "kvcache", "varlen", "numpy")}, r


def test_a_decode_step_in_a_cuda_graph_replayed_with_new_lengths():
    """A server captures a decode step once and replays it as the caches grow: the lengths are read on
    the GPU at each replay, so the replayed output is the eager output for the new lengths."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    from flashcore_numba import attention_kvcache

    B, H, H_kv, D, page = 4, 32, 8, 128, 256
    pool = B * 16
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(pool, page, H_kv, D, device="cuda", dtype=torch.float16) for _ in range(2))
    table = torch.randperm(pool).reshape(B, 16).int().cuda()
    lengths = torch.tensor([1, 100, 2000, 3000], dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attention_kvcache(q, k, v, lengths, table)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_kvcache(q, k, v, lengths, table)
    for step in range(3):
        lengths += torch.tensor([1, 7, 100, 1000], dtype=torch.int32, device="cuda")
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, attention_kvcache(q, k, v, lengths, table)), step


def test_inference_calls_never_wait_for_the_gpu():
    """torch's sync debug mode raises on any call that makes the host wait for the GPU (a copy of the
    lengths or offsets back to the host to check them, as these calls did): none of them does; with
    validate=True the check is made, and torch then sees the wait."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    from flashcore_numba import attention, attention_kvcache, attention_varlen

    qc = torch.randn(3, 1, 16, 64, device="cuda", dtype=torch.float16)
    kc, vc = (torch.randn(3, 500, 4, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    lens = torch.tensor([5, 500, 0], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
    qp, kp, vp = (torch.randn(300, 4, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    q, k, v = (torch.randn(1, 4, 300, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    calls = [lambda: attention_kvcache(qc, kc, vc, lens), lambda: attention_varlen(qp, kp, vp, cu, cu, 200, 200),
             lambda: attention(q, k, v, causal=True)]
    for call in calls:
        call()  # the first call makes the plan (allocations, the context): not what is checked
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls:
            for _ in range(3):
                call()
        with pytest.raises(RuntimeError, match="synchroniz"):
            attention_kvcache(qc, kc, vc, lens, validate=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def _misaligned(torch, shape, dtype=None):
    """A contiguous tensor of `shape` whose address is 2 bytes past a 16-byte boundary."""
    n = int(np.prod(shape))
    return torch.randn(n + 1, device="cuda", dtype=dtype or torch.float16)[1:].view(shape)


@pytest.mark.parametrize("case", ["attention prefill q", "attention decode k", "kvcache q", "kvcache k_cache",
                                  "varlen q", "varlen k", "varlen 07 v"])
def test_a_misaligned_tensor_is_refused_by_name_and_the_context_survives(case):
    """A tensor 2 bytes off a 16-byte boundary would stop a kernel's 16-byte copies with "misaligned
    address" and lose the process's CUDA context: every entry point refuses it first, naming the
    argument, and the next call runs."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    from flashcore_numba import attention, attention_kvcache, attention_varlen

    what, name = case.rsplit(" ", 1)
    if what.startswith("attention"):
        shapes = dict(q=(1, 4, 300, 64), k=(1, 4, 300, 64), v=(1, 4, 300, 64)) if "prefill" in what else \
            dict(q=(2, 32, 1, 128), k=(2, 8, 3000, 128), v=(2, 8, 3000, 128))

        def call(args):
            return attention(args["q"], args["k"], args["v"])
    elif what == "kvcache":
        shapes = dict(q=(2, 1, 32, 128), k_cache=(2, 3000, 8, 128), v_cache=(2, 3000, 8, 128))
        lens = torch.tensor([3000, 17], dtype=torch.int32, device="cuda")

        def call(args):
            return attention_kvcache(args["q"], args["k_cache"], args["v_cache"], lens)
    else:
        shapes = dict(q=(300, 8, 64), k=(300, 8, 64), v=(300, 8, 64))
        cu = torch.tensor([0, 120, 300], dtype=torch.int32, device="cuda")
        phase = "07" if "07" in what else "best"

        def call(args):
            return attention_varlen(args["q"], args["k"], args["v"], cu, cu, 180, 180, phase=phase)
    good = {n: torch.randn(s, device="cuda", dtype=torch.float16) for n, s in shapes.items()}
    expected = call(good)
    bad = dict(good, **{name: _misaligned(torch, shapes[name])})
    bad[name].copy_(good[name])
    with pytest.raises(ValueError, match=rf"^{name}: its address is 2 bytes past a 16-byte boundary"):
        call(bad)
    torch.cuda.synchronize()
    assert torch.equal(call(good), expected)  # the context is intact


@pytest.mark.parametrize("phase", ["07", "09"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_packed_sequences_stay_apart(phase, poison):
    """NaN or inf in the keys and values of one sequence (and in padding rows between sequences)
    never reaches another sequence's output: each sequence's rows equal the same call with that
    sequence alone, bit for bit, and match the reference. Empty sequences on either side."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    from flashcore_numba import attention_varlen
    from flashcore_numba.reference import reference_varlen

    lengths_q = [0, 70, 200, 0, 33, 130]
    lengths_k = [10, 70, 190, 0, 33, 300]
    cu_q, cu_k = (torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32, device="cuda")
                  for n in (lengths_q, lengths_k))
    H, H_kv, D = 4, 2, 64
    q = torch.randn(int(cu_q[-1]), H, D, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(int(cu_k[-1]), H_kv, D, device="cuda", dtype=torch.float16) for _ in range(2))
    poisoned = [0, 2]  # sequence 0 has keys but no rows; sequence 2's keys and values are all poison
    for b in poisoned:
        k[cu_k[b]:cu_k[b + 1]] = poison
        v[cu_k[b]:cu_k[b + 1]] = poison
    out = attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True, phase=phase)
    torch.cuda.synchronize()
    clean = [b for b in range(len(lengths_q)) if b not in poisoned]
    qh, kh, vh = (x.cpu().numpy() for x in (q, k, v))
    ref, _, lowp = reference_varlen(qh, kh, vh, cu_q.cpu().numpy(), cu_k.cpu().numpy(), causal=True,
                                    lowp_dtype=np.float16)
    got = out.cpu().numpy()
    for b in clean:
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        assert np.isfinite(got[rows]).all(), f"sequence {b} got non-finite values from a neighbour"
        verdict = check_close(got[rows], ref[rows], lowp[rows])
        assert verdict.ok, f"sequence {b}: {verdict.message}"

"""`flashcore bench --flex`: phase 14 (flex_attention) beside torch's FlexAttention, the same mods.

One problem (--shape, --dtype, --kv-heads; S_q = S_k), in one run, each of issue #77's cases written
twice, once with flashcore_numba.flex's mods and once as torch's FlexAttention takes them:

- `sliding_window`: a causal window of WINDOW keys (Mistral's), FlashAttention's window_size=(WINDOW, 0);
- `softcap`: Gemma 2's soft-capping at SOFTCAP, no mask;
- `alibi`: ALiBi's bias with the paper's slopes, no mask;
- `documents`: DOCUMENTS documents of equal length packed in each sequence, causal within each;
- `causal_mask`: causal attention written as a mask_mod, beside attention(causal=True) (row
  `attention causal=True`: the fast path it should come within 5 % of).

Rows `14 <case>` (flex_attention with its block mask made once, on the GPU) and
`flex_attention <case>` (torch.compile of torch's flex_attention with its own block mask, made once).
Each is first checked against the float64 oracle with the same mods (reference.reference_flex) on
batch 0's first heads (past S = 8192, their first and last 256 rows: oracle_rows): within twice the
error of the oracle's output rounded to the dtype, plus bench's atol (reference.check_close). Then
timed, kernel time, L2 flushed before each launch; with --calls N also the call time (bench.call_times:
the same call back to back, as a model's layers call it, median and p99, and the host's time a call). TFLOPS count the work the mask leaves: the
forward's FLOPs times the share of (query, key) pairs the mask keeps (batch 0, head 0). The record
has bench.py's schema, under docs/bench/flex/. `--cases` runs some of the cases: issue #77's long
window, S = 32768, is `--shape 1,16,32768,64 --cases sliding_window,causal_mask` (the window beside
attention(causal=True) at the same length).

With `--backward` (S up to ORACLE_ALL_ROWS) each case also gets its backward, rows `14 <case> backward`
(flex_attention's autograd: phase 11's kv_kernel with the same mods, p14_flex.backward_for) and
`flex_attention <case> backward` (torch's, compiled by torch.compile from the mods' graph): each
torch.autograd.grad of one forward's graph (retain_graph, as bench --backward times SDPA's), first
checked: dq, dk and dv of batch 0's first heads (a whole group of query heads for each K/V head)
against reference.reference_flex_gradients (float64), each within twice the error of the same
gradients taken by torch's autograd in the inputs' dtype (the products in the dtype, the softmax in
float32: backward_yardstick), plus bench's atol. FLOPs: 2.5 x the forward's, times the kept share.
"""

from __future__ import annotations

import sys

import numpy as np

from .. import flex
from ..reference import check_close, default_scale, reference_flex, reference_flex_gradients
from .backward import BACKWARD_FLOPS, retained_graph
from .backward import gate_gradients
from .bench import Problem, Timing, call_times, capped, flex_skip_reason, open_device, raised, set_timing
from .records import Result, build_record, default_records_dir, gpu_slug, nvidia_smi, provenance, unavailable

CASES = ("sliding_window", "softcap", "alibi", "documents", "causal_mask")
WINDOW, SOFTCAP, DOCUMENTS = 1024, 50.0, 4
ORACLE_HEADS = 2  # the oracle's heads of batch 0 (float64 on the host: S x S scores a head)
ORACLE_ALL_ROWS = 8192  # up to this S_q the oracle checks every row (oracle_rows)
ORACLE_EDGE_ROWS = 256  # past it, the first and the last this many


def record_path(gpu_name: str, problem: Problem):
    return default_records_dir() / "flex" / f"{gpu_slug(gpu_name)}_flex_{problem.tag}.json"


def case_mods(case: str, problem: Problem, torch, device):
    """(ours, theirs, per_batch) of a case: ours = (score_mod, mask_mod) of flashcore_numba.flex,
    theirs = the same two as torch's FlexAttention takes them (functions of tensors), per_batch:
    whether the mask depends on the batch (its block mask is made per batch)."""
    B, H, S = problem.B, problem.H, problem.S_q
    if case == "sliding_window":
        def window(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx <= WINDOW) & (kv_idx <= q_idx)

        return (None, flex.sliding_window(WINDOW)), (None, window), False
    if case == "softcap":
        def capped(score, b, h, q_idx, kv_idx):
            return SOFTCAP * torch.tanh(score / SOFTCAP)

        return (flex.softcap(SOFTCAP), None), (capped, None), False
    if case == "alibi":
        slopes = torch.tensor(flex.alibi_slopes(H), device=device)

        def bias(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        return (flex.alibi(slopes), None), (bias, None), False
    if case == "documents":
        ids = (torch.arange(S, device=device) * DOCUMENTS // S).to(torch.int32).repeat(B, 1)

        def documents(b, h, q_idx, kv_idx):
            return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)

        return (None, flex.document_mask(ids)), (None, documents), True
    if case == "causal_mask":
        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        return (None, flex.causal_mask()), (None, causal), False
    raise ValueError(f"case: expected one of {', '.join(CASES)}, got {case!r}")


def oracle_rows(S_q: int):
    """The query rows the oracle checks: every one up to ORACLE_ALL_ROWS, else the first and the last
    ORACLE_EDGE_ROWS (a window's first rows see few keys, its last rows the most; the float64 scores
    of every row of S = 32768 would be 8 GB a head)."""
    if S_q <= ORACLE_ALL_ROWS:
        return np.arange(S_q)
    return np.concatenate([np.arange(ORACLE_EDGE_ROWS), np.arange(S_q - ORACLE_EDGE_ROWS, S_q)])


def kept_share(mask_mod, S_q: int, S_k: int, chunk: int = 1024) -> float:
    """The share of (query, key) pairs of batch 0, head 0 the mask keeps, counted a chunk of rows at a
    time (the whole matrix of S = 32768 is a gigabyte)."""
    if mask_mod is None:
        return 1.0
    kept = sum(int(flex.mask_matrix(mask_mod, 0, 0, S_q, S_k, np.arange(r, min(r + chunk, S_q))).sum())
               for r in range(0, S_q, chunk))
    return kept / (S_q * S_k)


def _oracle(q, k, v, ours, problem: Problem):
    """Batch 0's first heads at oracle_rows: the float64 output with the mods, the same rounded to the
    dtype (the yardstick), the share of pairs the mask keeps (head 0), the heads and the rows."""
    score_mod, mask_mod = ours
    heads = min(ORACLE_HEADS, problem.H)
    group = problem.H // problem.heads_kv
    rows = oracle_rows(problem.S_q)
    host = [x[:1, :heads].float().cpu().numpy() if i == 0 else
            x[:1, :max(1, -(-heads // group))].float().cpu().numpy() for i, x in enumerate((q, k, v))]
    ref, _ = reference_flex(*host, score_mod=score_mod, mask_mod=mask_mod, rows=rows)
    lowp = ref.astype(problem.dtype if problem.dtype == "float16" else np.float32)
    if problem.dtype == "bfloat16":  # NumPy has no bf16: round the float32 mantissa to bf16's 8 bits
        bits = ref.astype(np.float32).view(np.uint32)
        lowp = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).view(np.float32)
    return ref, lowp.astype(np.float64), kept_share(mask_mod, problem.S_q, problem.S_k), heads, rows


def _gate(result: Result, out, ref, lowp, heads: int, rows) -> None:
    verdict = check_close(out[:1, :heads].float().cpu().numpy()[:, :, rows], ref, lowp)
    result.correct, result.message = bool(verdict.ok), verdict.message
    result.max_err, result.allowed_err = verdict.max_err, verdict.allowed


def run_flex_benchmark(problem: Problem, *, cases=CASES, peers: bool = True, timing=Timing(), seed: int | None = None,
                       device=None, command=None, progress=None, backward: bool = False) -> dict:
    """The protocol on one problem (see the module docstring), returned as a record."""
    from ..api import attention, flex_attention

    device = device or open_device()
    if device.kind != "torch":
        raise RuntimeError(f"the flex benchmark needs torch with CUDA: {getattr(device, 'no_peers_reason', '')}")
    if problem.S_q != problem.S_k or problem.causal or problem.D_v is not None:
        raise ValueError("the flex benchmark's cases are on S_q = S_k, without causal=True (a case says its mask) "
                         "and one head dim")
    if backward and problem.S_q > ORACLE_ALL_ROWS:
        raise ValueError(f"the flex benchmark's backward: S up to {ORACLE_ALL_ROWS} (its oracle takes every row), "
                         f"got {problem.S_q}")
    torch = device.torch
    step = progress or (lambda label: None)
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % 2**32)
    clock_start = nvidia_smi().get("sm_clock_mhz")
    _, (q, k, v) = device.inputs(problem, seed)
    skip = flex_skip_reason(torch) if peers else "not asked for"
    compiled = None
    results = []
    for case in cases:
        step(case)
        ours, theirs, per_batch = case_mods(case, problem, torch, q.device)
        ref, lowp, kept, heads, checked = _oracle(q, k, v, ours, problem)
        flops = int(problem.flops * kept)
        score_mod, mask_mod = ours
        blocks = None if mask_mod is None else flex.create_block_mask(
            mask_mod, problem.B if per_batch else None, None, problem.S_q, problem.S_k, device=True)
        rows = [(f"14 {case}", "phase", f"flex_attention (phase 14), {case}",
                 lambda score_mod=score_mod, blocks=blocks: flex_attention(q, k, v, score_mod=score_mod,
                                                                           block_mask=blocks), None)]
        if case == "causal_mask":
            rows.append(("attention causal=True", "phase", "attention(causal=True), the fast path",
                         lambda: attention(q, k, v, causal=True), None))
        if skip is None:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention as torch_flex

            compiled = compiled or torch.compile(torch_flex, dynamic=False)
            their_score, their_mask = theirs
            their_blocks = None if their_mask is None else create_block_mask(
                their_mask, problem.B if per_batch else None, None, problem.S_q, problem.S_k, device=q.device)
            gqa = problem.heads_kv != problem.H
            rows.append((f"flex_attention {case}", "peer", f"torch FlexAttention, torch.compile'd, {case}",
                         lambda s=their_score, m=their_blocks: compiled(q, k, v, score_mod=s, block_mask=m,
                                                                        enable_gqa=gqa), None))
        else:
            rows.append((f"flex_attention {case}", "peer", f"torch FlexAttention, {case}", None, skip))
        if backward:
            rows += backward_rows(case, problem, (q, k, v), ours, blocks, theirs if skip is None else None,
                                  compiled, skip, seed, device)
        for name, kind, title, launch, why in rows:
            if why:
                results.append(unavailable(name, kind, title, why))
                continue
            result = Result(name, kind, title)
            try:
                row_flops = flops
                if isinstance(launch, _Backward):  # the gradients against their oracle
                    launch.gate(result, launch())
                    row_flops = launch.flops
                else:
                    _gate(result, launch(), ref, lowp, heads, checked)
                if result.correct:
                    set_timing(result, device.time_ms(launch, timing), row_flops, None)
                    if timing.calls:  # the call as a model calls it: back to back, host time included
                        result.call = call_times(device, launch, capped(timing.calls, result.median_ms,
                                                                        timing.cap_seconds))
            except Exception as e:  # noqa: BLE001 - recorded in the result, the run goes on
                if kind == "peer":
                    results.append(unavailable(name, kind, title, raised(e)))
                    continue
                result.correct, result.message = False, f"raised {raised(e)}"
            results.append(result)
            device.release()
    rows = ("every row" if problem.S_q <= ORACLE_ALL_ROWS else
            f"its first and last {ORACLE_EDGE_ROWS} query rows")
    oracle = {"reference": f"reference_flex: float64 on the host, batch 0, its first {ORACLE_HEADS} heads, {rows}",
              "yardstick": f"the reference rounded to {problem.dtype}",
              "rule": "max|out - ref| <= 2 * max|yardstick - ref| + atol"}
    if backward:
        oracle["backward"] = ("dq, dk, dv of batch 0's first heads (whole groups): reference_flex_gradients, float64; "
                              "yardstick: torch's autograd in the inputs' dtype (backward_yardstick); the same rule")
    record = build_record(problem=problem, results=results, provenance=provenance(device, sm_clock_start=clock_start),
                          timing=timing, ceiling=None, oracle=oracle,
                          command=command if command is not None else ["flashcore", *sys.argv[1:]], seed=seed)
    record["flops"] = int(problem.flops)
    record["config"]["pass"] = "flex"
    record["config"]["cases"] = {"window": WINDOW, "softcap": SOFTCAP, "documents": DOCUMENTS}
    record["flops_rule"] = ("a row's TFLOPS count the forward's FLOPs times the share of (query, key) pairs its "
                            "case's mask keeps (batch 0, head 0); record.flops is the unmasked problem's" +
                            (f"; a backward row's, {BACKWARD_FLOPS} x that" if backward else ""))
    return record


class _Backward:
    """A backward row's launch: torch.autograd.grad of one forward's graph (kept: retain_graph), with
    the row's own gate (each gradient against the oracle) and FLOPs."""

    def __init__(self, torch, out, leaves, do, gate, flops):
        self.torch, self.out, self.leaves, self.do, self.gate, self.flops = torch, out, leaves, do, gate, flops

    def __call__(self):
        return self.torch.autograd.grad(self.out, self.leaves, self.do, retain_graph=True)


def backward_rows(case, problem: Problem, qkv, ours, blocks, theirs, compiled, skip, seed, device) -> list:
    """The rows (name, kind, title, launch, why) of a case's backward: phase 14's, and FlexAttention's
    where it runs (theirs: its mods, None when skipped, skip saying why)."""
    from ..api import flex_attention

    torch = device.torch
    q, k, v = qkv
    score_mod, mask_mod = ours
    do = torch.randn(q.shape, device=q.device, dtype=q.dtype, generator=torch.Generator(q.device).manual_seed(seed))
    group = problem.H // problem.heads_kv
    kv_heads = max(1, -(-min(ORACLE_HEADS, problem.H) // group))
    heads = (kv_heads * group, kv_heads, kv_heads)  # whole groups: each K/V head's gradient sums all its rows
    host = [x[:1, :n].float().cpu().numpy() for x, n in zip((q, k, v), heads)]
    ref = reference_flex_gradients(*host, do[:1, :heads[0]].float().cpu().numpy(), score_mod=score_mod,
                                   mask_mod=mask_mod)
    lowp = backward_yardstick(torch, [x[:1, :n] for x, n in zip((q, k, v), heads)], do[:1, :heads[0]],
                              case_mods(case, problem, torch, q.device)[1])
    flops = int(BACKWARD_FLOPS * problem.flops * kept_share(mask_mod, problem.S_q, problem.S_k))

    def gate(result, got):  # bench --backward's gate, on the oracle's heads
        gate_gradients(result, [g[:, :n] for g, n in zip(got, heads)], ref, lowp)

    rows = []
    leaves = tuple(x.detach().clone().requires_grad_() for x in qkv)
    out = flex_attention(*leaves, score_mod=score_mod, block_mask=blocks)
    rows.append((f"14 {case} backward", "phase", f"flex_attention's backward (phase 11 with the mods), {case}",
                 _Backward(torch, out, leaves, do, gate, flops), None))
    name, title = f"flex_attention {case} backward", f"torch FlexAttention's backward, torch.compile'd, {case}"
    if theirs is None:
        rows.append((name, "peer", title, None, skip))
        return rows
    from torch.nn.attention.flex_attention import create_block_mask

    their_score, their_mask = theirs
    their_blocks = None if their_mask is None else create_block_mask(
        their_mask, problem.B if case == "documents" else None, None, problem.S_q, problem.S_k, device=q.device)
    theirs_leaves = tuple(x.detach().clone().requires_grad_() for x in qkv)
    try:
        with retained_graph("FLEX"):  # its backward compiled (at the first grad) to be run again and again
            their_out = compiled(*theirs_leaves, score_mod=their_score, block_mask=their_blocks,
                                 enable_gqa=problem.heads_kv != problem.H)
            torch.autograd.grad(their_out, theirs_leaves, do, retain_graph=True)
    except Exception as e:  # noqa: BLE001 - a peer that cannot run says why
        rows.append((name, "peer", title, None, raised(e)))
        return rows
    rows.append((name, "peer", title, _Backward(torch, their_out, theirs_leaves, do, gate, flops), None))
    return rows


def backward_yardstick(torch, qkv, do, theirs) -> list:
    """dq, dk, dv (host float64) of batch 0's first heads as torch's autograd takes them in the inputs'
    dtype: the products in the dtype, the mods and the softmax in float32 (FlexAttention's own eager
    rule); what the oracle's tolerance scales: a kernel may err twice as much as this."""
    q, k, v = (x.detach().clone().requires_grad_() for x in qkv)
    score_mod, mask_mod = theirs
    H, S_q, D = q.shape[1], q.shape[2], q.shape[3]
    S_k = k.shape[2]
    group = H // k.shape[1]
    kk, vv = (x.repeat_interleave(group, dim=1) for x in (k, v))
    s = (q @ kk.transpose(-1, -2)).float() * default_scale(D)
    b = torch.zeros((), dtype=torch.int64, device=q.device)
    h = torch.arange(H, device=q.device).view(1, H, 1, 1)
    q_idx = torch.arange(S_q, device=q.device).view(S_q, 1)
    kv_idx = torch.arange(S_k, device=q.device).view(1, S_k)
    if score_mod is not None:
        s = score_mod(s, b, h, q_idx, kv_idx)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, q_idx, kv_idx), float("-inf"))
    out = torch.softmax(s, dim=-1).to(q.dtype) @ vv
    return [g.double().cpu().numpy() for g in torch.autograd.grad(out, (q, k, v), do)]


def check_flex(problem: Problem, seed: int | None = None) -> Result:
    """Phase 14 on `problem` from NumPy arrays (what `flashcore run` checks in the simulator, where
    nothing is timed), with a soft-cap of 20 and a mask: causal written as a mask_mod where the problem
    is causal, else a window of a quarter of the keys on each side. Against reference_flex with the same
    mods: within twice the error of the oracle rounded to fp16, plus bench's atol."""
    from ..phases import p14_flex as p14
    from ..reference import random_qkv

    result = Result(p14.ID, "phase", p14.TITLE)
    if problem.dtype != "float16" or not p14.runs_head_dim(problem.D) or problem.D_v is not None:
        result.available = False
        result.reason = f"phase 14 is checked here at fp16 and one head dim, {p14.HEAD_DIMS_TEXT}"
        return result
    q, k, v = random_qkv((problem.B, problem.H, problem.S_q, problem.D), problem.S_k, heads_kv=problem.H_kv,
                         seed=seed)
    score_mod = flex.softcap(20.0)
    mask_mod = flex.causal_mask() if problem.causal else flex.sliding_window(problem.S_k // 4, problem.S_k // 4)
    from ..api import flex_attention

    try:
        out = flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    except Exception as e:  # noqa: BLE001 - recorded in the result
        result.correct, result.message = False, f"raised {raised(e)}"
        return result
    ref, _ = reference_flex(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    verdict = check_close(np.asarray(out, np.float64), ref, ref.astype(np.float16).astype(np.float64))
    result.correct, result.message = bool(verdict.ok), verdict.message
    result.max_err, result.allowed_err = verdict.max_err, verdict.allowed
    return result

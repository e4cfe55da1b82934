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
"""

from __future__ import annotations

import sys

import numpy as np

from .. import flex
from ..reference import check_close, reference_flex
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
                       device=None, command=None, progress=None) -> dict:
    """The protocol on one problem (see the module docstring), returned as a record."""
    from ..api import attention, flex_attention

    device = device or open_device()
    if device.kind != "torch":
        raise RuntimeError(f"the flex benchmark needs torch with CUDA: {getattr(device, 'no_peers_reason', '')}")
    if problem.S_q != problem.S_k or problem.causal or problem.D_v is not None:
        raise ValueError("the flex benchmark's cases are on S_q = S_k, without causal=True (a case says its mask) "
                         "and one head dim")
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
        for name, kind, title, launch, why in rows:
            if why:
                results.append(unavailable(name, kind, title, why))
                continue
            result = Result(name, kind, title)
            try:
                _gate(result, launch(), ref, lowp, heads, checked)
                if result.correct:
                    set_timing(result, device.time_ms(launch, timing), flops, None)
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
    record = build_record(problem=problem, results=results, provenance=provenance(device, sm_clock_start=clock_start),
                          timing=timing, ceiling=None, oracle=oracle,
                          command=command if command is not None else ["flashcore", *sys.argv[1:]], seed=seed)
    record["flops"] = int(problem.flops)
    record["config"]["pass"] = "flex"
    record["config"]["cases"] = {"window": WINDOW, "softcap": SOFTCAP, "documents": DOCUMENTS}
    record["flops_rule"] = ("a row's TFLOPS count the forward's FLOPs times the share of (query, key) pairs its "
                            "case's mask keeps (batch 0, head 0); record.flops is the unmasked problem's")
    return record


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

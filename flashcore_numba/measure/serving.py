"""`flashcore bench --serving`: a decode step as a serving loop calls it, per call and per host.

For each batch B and cache length S (`--batches`, `--caches`), B sequences that each hold S keys,
one query row each, H query heads sharing H_kv K/V heads of D (`--shape 1,H,1,D --kv-heads H_kv`).
Each row is checked by bench.py's gate against a float64 reference (on the GPU, sequence by
sequence; at most CHECKED sequences of a large batch, spread across it) before it is timed:

- `10-kvcache`: attention_kvcache on the contiguous cache (B, S, H_kv, D);
- `10-kvcache-p256`: attention_kvcache on the same memory seen as a pool of pages of 256 keys, handed
  to the sequences in a shuffled order by a block table (so sequence b's keys are other keys);
- `attention`: attention() on the same keys as (B, H_kv, S, D) tensors (phase="best"), where a
  copy of the cache in that layout fits beside it;
- torch SDPA on the cache's keys seen as (B, H_kv, S, D) (a transposed view, no copy; grouped heads
  by enable_gqa): as torch picks its backend (`sdpa`), and its flash, cuDNN and memory-efficient
  backends each alone, where it runs.

Three times per row, each in ms or us as named:

- the kernel time, device only, L2 flushed before each launch (bench.py's protocol);
- the call time: the call back to back as a model's loop makes it, GPU time from one call's work
  to the next's (median, p99), with the host's time per call;
- the host time while the GPU is busy: each call made with about 1 ms of work queued ahead of it,
  so that a call that waits for the GPU shows the wait (median, p99, max).

One record per (B, S) under docs/bench/serving/; `flashcore report` writes their table.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from .bench import DTYPES, Timing, call_times, gate, open_device, raised, set_timing
from .records import Result, build_record, default_records_dir, gpu_slug, nvidia_smi, provenance, unavailable

PAGE = 256
CHECKED = 16  # sequences of a batch checked against the reference (all of a smaller batch)
BUSY_MS = 1.0  # the GPU work queued ahead of each call when the host time is measured
PEERS = (("sdpa_flash", "FLASH_ATTENTION", "torch SDPA, flash backend"),
         ("sdpa_cudnn", "CUDNN_ATTENTION", "torch SDPA, cuDNN backend"),
         ("sdpa_efficient", "EFFICIENT_ATTENTION", "torch SDPA, memory-efficient backend"))
DENSE_COPY_LIMIT = 24 << 30  # bytes: attention()'s (B, H_kv, S, D) copy of the cache is made up to this


def record_path(gpu_name: str, B: int, S: int, H: int, H_kv: int, D: int, dtype: str):
    short = {v: k for k, v in DTYPES.items()}.get(dtype, dtype)
    return default_records_dir() / "serving" / f"{gpu_slug(gpu_name)}_serving_b{B}_s{S}_h{H}kv{H_kv}d{D}_{short}.json"


def busy_host_times(device, call, n: int) -> dict:
    """The host's time per call (us) with about BUSY_MS of GPU work queued ahead of each call: a call
    that waits for the GPU (a copy back to the host, a synchronization) waits for that work."""
    host = []
    for i in range(n):
        device.sleep(BUSY_MS)
        t0 = time.perf_counter()
        call()
        host.append((time.perf_counter() - t0) * 1e6)
        if i % 8 == 7:  # keep the queue short: 8 ms at most
            device.synchronize()
    device.synchronize()
    return {"busy_host_median_us": float(np.median(host)), "busy_host_p99_us": float(np.percentile(host, 99)),
            "busy_host_max_us": float(max(host)), "busy_ms": BUSY_MS, "busy_calls": n}


def _oracle(torch, q, sequence_kv, checked):
    """float64 reference and the same-dtype yardstick (SDPA's math backend) of the sequences `checked`:
    q (B, H, 1, D); sequence_kv(b) gives sequence b's keys and values as (1, H_kv, S, D) each.
    Returns (ref, lowp), each (len(checked), H, 1, D)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ref, lowp = [], []
    f = torch.nn.functional.scaled_dot_product_attention
    with sdpa_kernel(SDPBackend.MATH):
        for b in checked:
            qb, (kb, vb) = q[b:b + 1], sequence_kv(b)
            ref.append(f(qb.double(), kb.double(), vb.double(), enable_gqa=True).cpu().numpy())
            lowp.append(f(qb, kb, vb, enable_gqa=True).double().cpu().numpy())
    return np.concatenate(ref), np.concatenate(lowp)


def run_serving_point(B: int, S: int, *, H: int = 32, H_kv: int = 8, D: int = 128, dtype: str = "float16",
                      timing=Timing(), calls: int = 200, seed: int | None = None, device=None, command=None,
                      progress=None) -> dict:
    """The protocol at one (B, S) (see the module docstring), returned as a record."""
    from ..api import attention
    from ..inference import kvcache_launcher
    from .bench import Problem

    device = device or open_device()
    if device.kind != "torch":
        raise RuntimeError(f"the serving benchmark needs torch with CUDA: {device.no_peers_reason}")
    torch = device.torch
    step = progress or (lambda label: None)
    seed = int(np.random.SeedSequence().entropy % 2**32) if seed is None else seed
    gen = torch.Generator(device=device.device).manual_seed(seed)
    t = getattr(torch, dtype)
    clock_start = nvidia_smi().get("sm_clock_mhz")
    step(f"B={B} S={S}: inputs and reference")
    q_rows = torch.randn(B, 1, H, D, device=device.device, generator=gen).to(t)  # (B, S_q, H, D)
    cache = [torch.randn(B, S, H_kv, D, device=device.device, generator=gen, dtype=torch.float32).to(t)
             for _ in range(2)]
    lengths = torch.full((B,), S, dtype=torch.int32, device=device.device)
    q_heads = q_rows.transpose(1, 2).contiguous()  # (B, H, 1, D)
    keys, values = (x.transpose(1, 2) for x in cache)  # (B, H_kv, S, D) views of the cache
    checked = sorted(set(np.linspace(0, B - 1, min(B, CHECKED)).round().astype(int).tolist()))
    oracles = {None: _oracle(torch, q_heads, lambda b: (keys[b:b + 1], values[b:b + 1]), checked)}
    kv_bytes = 2 * B * S * H_kv * D * 2
    flops = 4 * B * H * S * D
    bandwidth = device.bandwidth(kv_bytes, timing) if kv_bytes <= DENSE_COPY_LIMIT else None
    variants = [("10-kvcache", "attention_kvcache on the contiguous cache", cache[0], cache[1], None)]
    if S % PAGE == 0:  # the same memory as pages of PAGE keys, handed to the sequences in a shuffled order
        pages = S // PAGE
        pool = [x.view(B * pages, PAGE, H_kv, D) for x in cache]
        table = torch.randperm(B * pages, generator=torch.Generator().manual_seed(seed)).int().reshape(B, pages)
        table = table.to(device.device)

        def paged_kv(b):
            return tuple(p[table[b].long()].reshape(1, S, H_kv, D).transpose(1, 2) for p in pool)

        oracles["paged"] = _oracle(torch, q_heads, paged_kv, checked)
        variants.append((f"10-kvcache-p{PAGE}", f"attention_kvcache on pages of {PAGE} keys in a shuffled order",
                         pool[0], pool[1], table))
    results = []

    def finish(result, call, kernel_launch):
        if kernel_launch is not None:
            set_timing(result, device.time_ms(kernel_launch, timing), flops, None, kv_bytes=kv_bytes,
                       ceiling_gb_per_s=None if bandwidth is None else bandwidth["gb_per_s"])
        result.call = dict(call_times(device, call, calls), **busy_host_times(device, call, max(20, calls // 4)))

    def check(result, out_heads, paged=False):  # out as (B, H, 1, D)
        torch.cuda.synchronize()
        ref, lowp = oracles["paged" if paged else None]
        gate(result, device.host(out_heads[checked]), ref, lowp, poisoned=True)

    # -- attention_kvcache, contiguous and paged
    for name, title, kc, vc, table in variants:
        step(f"B={B} S={S}: {name}")
        result = Result(name, "phase", title)
        try:
            out = torch.full_like(q_rows, float("nan"))
            launch, _, _ = kvcache_launcher(q_rows, kc, vc, lengths, table, causal=False, out=out)
            launch()
            check(result, out.transpose(1, 2), paged=table is not None)
            if result.correct:
                def call(kc=kc, vc=vc, table=table):
                    return _kvcache_call(q_rows, kc, vc, lengths, table)

                finish(result, call, launch)
        except Exception as e:  # noqa: BLE001 - recorded in the result, the run goes on
            result.correct, result.message = False, f"raised {raised(e)}"
        results.append(result)
    del variants
    device.release()

    # -- attention() on (B, H_kv, S, D) tensors
    title = "attention() on (B, H_kv, S, D) tensors, phase='best'"
    if 2 * B * S * H_kv * D * 2 > DENSE_COPY_LIMIT:
        results.append(unavailable("attention", "phase", title, "the (B, H_kv, S, D) copy of the cache does not "
                                   "fit beside it on this GPU's benchmark"))
    else:
        step(f"B={B} S={S}: attention()")
        result = Result("attention", "phase", title)
        try:
            dense = [x.contiguous() for x in (keys, values)]
            out = attention(q_heads, *dense)
            check(result, out)
            if result.correct:
                def call():
                    return attention(q_heads, *dense)

                finish(result, call, call)
            del dense
        except Exception as e:  # noqa: BLE001
            result.correct, result.message = False, f"raised {raised(e)}"
        results.append(result)
        device.release()

    # -- SDPA on the cache's keys, viewed: as torch picks its backend, and each backend alone (its
    # choice made once, outside the timing: a user's call has no context manager around it)
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q_heads, keys, values, enable_gqa=True)

    for name, backend, title in (("sdpa", None, "torch SDPA, the backend torch picks"), *PEERS):
        step(f"B={B} S={S}: {name}")
        result = Result(name, "peer", title)
        try:
            with sdpa_kernel(getattr(SDPBackend, backend)) if backend else contextlib.nullcontext():
                check(result, sdpa())
                if result.correct:
                    finish(result, sdpa, sdpa)
        except Exception as e:  # noqa: BLE001 - a backend that cannot run this says why
            results.append(unavailable(name, "peer", title, raised(e)))
            continue
        results.append(result)
        device.release()

    problem = Problem(B, H, 1, S, D, dtype, False, H_kv)
    oracle = {"reference": "SDPA's math backend in float64 on the GPU, sequence by sequence",
              "yardstick": f"SDPA's math backend in {dtype}",
              "rule": "max|out - ref| <= 2 * max|yardstick - ref| + atol",
              "checked_sequences": checked}
    record = build_record(problem=problem, results=results, provenance=provenance(device, sm_clock_start=clock_start),
                          timing=timing, ceiling=None, oracle=oracle,
                          command=command if command is not None else ["flashcore", *sys.argv[1:]], seed=seed,
                          bandwidth=bandwidth)
    record["config"].update(page_size=PAGE, kv_bytes=kv_bytes, serving=True)
    record["flops"] = int(flops)
    return record


def _kvcache_call(q, k_cache, v_cache, lengths, table):
    from ..inference import attention_kvcache

    return attention_kvcache(q, k_cache, v_cache, lengths, table, causal=False)


# ---------------------------------------------------------------------------------------------
# The table `flashcore report` writes
# ---------------------------------------------------------------------------------------------
def serving_records(records) -> list[dict]:
    """The serving records among `records` (measure.records.load_records of docs/bench/serving/),
    newest GPU first, then by batch and keys."""
    found = [r for r in records if r.get("config", {}).get("serving")]
    return sorted(found, key=lambda r: (r["provenance"]["gpu_name"], r["config"]["B"], r["config"]["S_k"]))


def _cell(result) -> str:
    if result is None:
        return "not measured"
    if not result.get("available", True):  # ours: not measured (the record says why); a peer: it refused
        return "not measured" if result["kind"] == "phase" else "does not run"
    if not result.get("correct"):
        return "INCORRECT"
    c = result["call"]
    return f"{c['median_ms'] * 1e3:.0f} ({c['p99_ms'] * 1e3:.0f}); {c['busy_host_median_us']:.0f}"


def serving_table(records) -> list[str]:
    """Markdown lines: per (GPU, B, keys), each row's call time back to back in us (median, p99 in
    parentheses) and its host time per call with the GPU busy (after the semicolon), and
    attention_kvcache's call against the fastest SDPA backend's."""
    lines = []
    for gpu in sorted({r["provenance"]["gpu_name"] for r in records}):
        mine = [r for r in records if r["provenance"]["gpu_name"] == gpu]
        c0 = mine[0]["config"]
        lines += [f"Decode steps on **{gpu}**, H={c0['H']} H_kv={c0.get('H_kv', c0['H'])} D={c0['D']} {c0['dtype']}, "
                  f"one query row per sequence against every key it holds: call time back to back in µs, median "
                  f"(p99), then the host's µs per call with {BUSY_MS:g} ms of GPU work queued ahead (a call that "
                  f"waited for the GPU would show it there). Each row is one run; its record names the commit.", "",
                  "| B | keys | attention_kvcache | paged (256) | attention() | best SDPA | kvcache vs SDPA |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for record in mine:
            rows = {r["name"]: r for r in record["results"]}
            peers = [r for r in record["results"] if r["kind"] == "peer" and r.get("correct") and r.get("call")]
            best = min(peers, key=lambda r: r["call"]["median_ms"]) if peers else None
            kv = rows.get("10-kvcache")
            ratio = ""
            if best and kv and kv.get("correct"):
                ratio = f"{best['call']['median_ms'] / kv['call']['median_ms']:.2f}×"
            sdpa = f"{_cell(best)} ({best['name'].removeprefix('sdpa_')})" if best else "not measured"
            lines.append(f"| {record['config']['B']} | {record['config']['S_k']} | {_cell(kv)} | "
                         f"{_cell(rows.get(f'10-kvcache-p{PAGE}'))} | {_cell(rows.get('attention'))} | {sdpa} | "
                         f"{ratio} |")
        lines.append("")
    return lines

"""`flashcore bench --kvcache B,LO,HI`: a decode step against a KV cache (attention_kvcache).

B sequences with random cache lengths LO..HI (seeded, recorded), one query row each (S_q from
--seq-q), H query heads and H_kv K/V heads of D. In one run, each checked by the gate of bench.py
against the float64 reference (sequence by sequence) before it is timed (kernel time, L2 flushed
before each launch):

- the contiguous cache (B, capacity, H_kv, D), capacity the longest length;
- the same keys in a paged cache for each page size asked for, pages handed out in a shuffled order.

A decode step is bound by reading K and V: each row gives GB/s (the bytes of the keys the sequences
hold, K and V, read once, over the median) and its share of a device-to-device copy of as many bytes
timed in the same run (bench.py's bandwidth ceiling). TFLOPS count 4 * H * S_q * D per key. The
record has bench.py's schema, with the lengths in its config; it is written under
docs/bench/kvcache/, and `flashcore report` puts its table in docs/performance.md.
"""

from __future__ import annotations

import sys

import numpy as np

from .bench import DTYPES, Timing, raised, gate, open_device, set_timing
from .records import Result, build_record, default_records_dir, gpu_slug, nvidia_smi, provenance


def record_path(gpu_name: str, B: int, lo: int, hi: int, H: int, H_kv: int, D: int, dtype: str):
    short = {v: k for k, v in DTYPES.items()}.get(dtype, dtype)
    name = f"{gpu_slug(gpu_name)}_kvcache_b{B}_{lo}-{hi}_h{H}kv{H_kv}d{D}_{short}"
    return default_records_dir() / "kvcache" / f"{name}.json"


def run_kvcache_benchmark(B: int, lo: int, hi: int, *, H: int = 32, H_kv: int = 8, D: int = 128, S_q: int = 1,
                          dtype: str = "float16", page_sizes=(64, 256), timing=Timing(), seed: int | None = None,
                          device=None, command=None, progress=None) -> dict:
    """The whole protocol on one batch of caches (see the module docstring), returned as a record."""
    from ..inference import kvcache_launcher
    from ..reference import reference_kvcache
    from .bench import Problem

    device = device or open_device()
    if device.kind != "torch":
        raise RuntimeError(f"the KV-cache benchmark needs torch with CUDA: {device.no_peers_reason}")
    torch = device.torch
    step = progress or (lambda label: None)
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(lo, hi + 1, B)]
    capacity = max(lengths)
    kv_bytes = 2 * sum(lengths) * H_kv * D * 2  # K and V, 16-bit
    flops = sum(4 * H * S_q * D * n for n in lengths)
    clock_start = nvidia_smi().get("sm_clock_mhz")
    step("inputs, reference and the bandwidth ceiling (copy)")
    gen = torch.Generator(device=device.device).manual_seed(seed)
    t = getattr(torch, dtype)
    q = torch.randn(B, S_q, H, D, device=device.device, generator=gen).to(t)
    k, v = (torch.randn(B, capacity, H_kv, D, device=device.device, generator=gen).to(t) for _ in range(2))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device.device)
    ref, _, lowp = reference_kvcache(q, k, v, seqlens, causal=True,
                                     lowp_dtype="bfloat16" if dtype == "bfloat16" else np.float16)
    bandwidth = device.bandwidth(kv_bytes, timing)
    caches = [("10-kvcache", "phase 10 on the contiguous cache", k, v, None)]
    for page in page_sizes:
        pages = -(-capacity // page)
        order = torch.randperm(B * pages, generator=torch.Generator().manual_seed(seed)).to(device.device)
        table = order.reshape(B, pages).int()
        padded = pages * page
        paged = []
        for x in (k, v):
            full = torch.zeros(B, padded, H_kv, D, device=device.device, dtype=t)
            full[:, :capacity] = x
            pool = torch.empty(B * pages, page, H_kv, D, device=device.device, dtype=t)
            pool[order] = full.reshape(B * pages, page, H_kv, D)
            paged.append(pool)
        caches.append((f"10-kvcache-p{page}", f"phase 10 on a paged cache, pages of {page} keys in a shuffled order",
                       paged[0], paged[1], table))
    results = []
    for name, title, kc, vc, table in caches:
        step(name)
        result = Result(name, "phase", title)
        out = torch.full_like(q, float("nan"))
        try:
            launch, _, _ = kvcache_launcher(q, kc, vc, seqlens, table, causal=True, out=out)
            launch()
            torch.cuda.synchronize()
            gate(result, device.host(out), ref, lowp, poisoned=True)
            if result.correct:
                set_timing(result, device.time_ms(launch, timing), flops, None, kv_bytes=kv_bytes,
                           ceiling_gb_per_s=bandwidth["gb_per_s"])
        except Exception as e:  # noqa: BLE001 - recorded in the result, the run goes on
            result.correct, result.message = False, f"raised {raised(e)}"
        results.append(result)
        device.release()
    problem = Problem(B, H, S_q, capacity, D, dtype, True, H_kv)
    oracle = {"reference": "reference_kvcache: float64, sequence by sequence",
              "yardstick": f"lowp_attention in {dtype}, sequence by sequence",
              "rule": "max|out - ref| <= 2 * max|yardstick - ref| + atol"}
    record = build_record(problem=problem, results=results, provenance=provenance(device, sm_clock_start=clock_start),
                          timing=timing, ceiling=None, oracle=oracle,
                          command=command if command is not None else ["flashcore", *sys.argv[1:]], seed=seed,
                          bandwidth=bandwidth)
    record["config"].update(lengths=lengths, page_sizes=list(page_sizes), kv_bytes=kv_bytes)
    record["flops"] = int(flops)
    return record

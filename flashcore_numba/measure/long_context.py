"""Long context: TFLOPS and extra device memory of the best kernel as S grows to 131072.

    python -m flashcore_numba.measure.long_context            # writes docs/bench/long_context/<gpu>_d64.json
    python -m flashcore_numba.measure.long_context --max-s 32768 --causal --out /tmp/lc.json

FlashAttention's promise is memory linear in S: no S × S buffer anywhere. For each S this
measures, around one `attention(q, k, v)` call on torch tensors (B=1, H=16, D=64 by default):

- extra_bytes: torch's peak allocation during the call minus what was allocated before it
  (the output is the only allocation the library makes, so extra_bytes - output_bytes is 0
  when nothing else is allocated), and the driver's free memory before and after the call,
  which would show an allocation made outside torch's allocator;
- the median time of `repeats` calls (torch events) and TFLOPS = 4·B·H·S²·D (/2 causal) / time;
- correctness on sampled query rows (the first, the last, and random ones) against the float64
  reference computed for those rows only: a full reference would itself need S × S memory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ..reference import ATOL, default_scale

S_VALUES = tuple(2**p for p in range(10, 18))  # 1024 .. 131072


def sampled_reference(q, k, v, rows, *, causal: bool, scale: float):
    """(float64 reference, fp16-arithmetic yardstick) of attention for query rows `rows` only.

    q, k, v: NumPy (B, H, S, D) arrays. Same masking rule as the kernels (bottom-right causal).
    """
    B, H, S_q, D = q.shape
    S_k = k.shape[2]
    ref = np.zeros((B, H, len(rows), D))
    lowp = np.zeros((B, H, len(rows), D))
    for i, row in enumerate(rows):
        end = min(S_k, max(0, row + 1 + S_k - S_q)) if causal else S_k
        if end == 0:
            continue  # a row that sees no key: 0
        kk, vv = k[:, :, :end].astype(np.float64), v[:, :, :end].astype(np.float64)
        s = np.einsum("bhd,bhkd->bhk", q[:, :, row].astype(np.float64), kk) * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        ref[:, :, i] = np.einsum("bhk,bhkd->bhd", p, vv) / p.sum(-1, keepdims=True)
        # the yardstick: fp16 scores and probabilities, as plain fp16 framework code would have them
        s16 = (np.einsum("bhd,bhkd->bhk", q[:, :, row].astype(np.float32), k[:, :, :end].astype(np.float32))
               * scale).astype(np.float16).astype(np.float32)
        p16 = np.exp(s16 - s16.max(-1, keepdims=True))
        p16 = (p16 / p16.sum(-1, keepdims=True)).astype(np.float16).astype(np.float32)
        lowp[:, :, i] = np.einsum("bhk,bhkd->bhd", p16, v[:, :, :end].astype(np.float32)).astype(np.float16)
    return ref, lowp


def measure_one(S: int, *, phase, B: int, H: int, D: int, causal: bool, repeats: int, n_rows: int, seed: int):
    import torch

    from ..api import attention
    from ..reference import check_close

    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16, generator=gen) for _ in range(3))
    attention(q, k, v, causal=causal, phase=phase)  # compile and warm up outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    free_before, _ = torch.cuda.mem_get_info()
    out = attention(q, k, v, causal=causal, phase=phase)
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    extra = torch.cuda.max_memory_allocated() - before
    output_bytes = out.numel() * out.element_size()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        attention(q, k, v, causal=causal, phase=phase)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    ms = float(np.median(times))
    flops = 4 * B * H * S * S * D // (2 if causal else 1)
    rng = np.random.default_rng(seed)
    rows = sorted({0, S - 1, *rng.integers(0, S, size=max(0, n_rows - 2)).tolist()})
    host = [x.cpu().numpy() for x in (q, k, v)]
    ref, lowp = sampled_reference(*host, rows, causal=causal, scale=default_scale(D))
    verdict = check_close(out[:, :, rows].cpu().numpy(), ref, lowp)
    return {"S": S, "median_ms": ms, "tflops": flops / ms / 1e9, "flops": flops, "repeats": repeats,
            "extra_bytes": int(extra), "output_bytes": int(output_bytes),
            "extra_minus_output_bytes": int(extra - output_bytes),
            "driver_free_drop_bytes": int(free_before - free_after), "input_bytes": int(3 * output_bytes),
            "rows_checked": len(rows), "correct": bool(verdict.ok), "max_err": verdict.max_err,
            "message": verdict.message}


def run(*, s_values=S_VALUES, phase="best", B=1, H=16, D=64, causal=False, repeats=5, n_rows=16, progress=print):
    from ..phases import get_phase
    from .bench import open_device
    from .records import provenance

    device = open_device()
    if device.kind != "torch":
        raise RuntimeError(f"the long-context record needs torch with CUDA: {device.no_peers_reason}")
    kernel = get_phase(phase)
    seed = int(np.random.SeedSequence().entropy % 2**31)
    points = []
    for S in s_values:
        point = measure_one(S, phase=kernel.ID, B=B, H=H, D=D, causal=causal, repeats=repeats, n_rows=n_rows,
                            seed=seed + S)
        progress(f"S={S}: {point['tflops']:.1f} TFLOPS, extra {point['extra_bytes'] / 2**20:.1f} MiB "
                 f"(output {point['output_bytes'] / 2**20:.1f} MiB), {'ok' if point['correct'] else 'WRONG'}")
        points.append(point)
    from datetime import datetime, timezone

    return {"schema": "long_context/1", "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": ["python", "-m", "flashcore_numba.measure.long_context", *sys.argv[1:]],
            "provenance": provenance(device), "kernel": kernel.ID, "title": kernel.TITLE,
            "config": {"B": B, "H": H, "D": D, "dtype": "float16", "causal": causal},
            "oracle": {"reference": "float64 NumPy on sampled query rows", "atol": ATOL}, "seed": seed,
            "points": points,
            "memory_linear_in_S": all(p["extra_minus_output_bytes"] <= 0 and p["driver_free_drop_bytes"]
                                      <= p["output_bytes"] + (2 << 20) for p in points)}


def main(argv=None) -> int:
    from .records import default_records_dir, gpu_slug

    parser = argparse.ArgumentParser(prog="python -m flashcore_numba.measure.long_context",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--max-s", type=int, default=S_VALUES[-1], help="largest S (powers of two from 1024)")
    parser.add_argument("--phase", default="best")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path,
                        help="record path (default docs/bench/long_context/<gpu>_d64[_causal].json)")
    args = parser.parse_args(argv)
    if args.max_s < 1024:
        parser.error("--max-s: at least 1024")
    s_values = tuple(s for s in S_VALUES if s <= args.max_s) or (1024,)
    record = run(s_values=s_values, phase=args.phase, causal=args.causal, repeats=args.repeats)
    # a folder of its own: docs/bench/*.json are the ladder records `flashcore report` reads
    path = args.out or default_records_dir() / "long_context" / (
        f"{gpu_slug(record['provenance']['gpu_name'])}_d64{'_causal' if args.causal else ''}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"memory linear in S: {record['memory_linear_in_S']}; record written to {path}")
    return 0 if all(p["correct"] for p in record["points"]) and record["memory_linear_in_S"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

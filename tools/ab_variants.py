"""A/B of phase-07 kernel variants against each other and torch SDPA's flash backend, on a GPU.

A tuning aid, not the benchmark (the logs of its runs are in docs/tuning/07_history.md). First every
variant is checked against the float64 reference on odd shapes (tails, S_q != S_k both ways, grouped
queries, causal and not); then it runs ROUNDS interleaved rounds of REPS launches per kernel, timed as
the benchmark times them (each launch alone, after an L2 flush), and prints the median TFLOPS of each
kernel, SDPA flash last.

    python3 tools/ab_variants.py --head-dim 128 head head:64,64,4 /tmp/p07_try.py:64,32,4,3

A variant is SOURCE[:BLOCK_M,BLOCK_N,WARPS[,BLOCKS_PER_SM]]. SOURCE is `head` (phase 07 as it is
in this checkout) or a .py file that defines phase 07's `layout(HEAD_DIM, block_m, block_n, warps)`,
`build_kernel(L, dtype[, min_blocks])` and `TILES`: a copy of flashcore_numba/phases/p07_mma_sync.py
with one change (it is loaded as a module of flashcore_numba.phases, so its relative imports work).
Without tiles a variant runs its TILES; BLOCKS_PER_SM compiles it with launch bounds for that many
blocks per SM (its build_kernel must take min_blocks).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHECK_SHAPES = ((2, 3, 3, 2048, 2048), (1, 2, 2, 300, 777), (1, 2, 2, 777, 300), (1, 1, 1, 130, 1100),
                (1, 4, 1, 200, 333))  # (B, H_q, H_kv, S_q, S_k)


def parse_variant(text: str) -> tuple[str, tuple[int, ...]]:
    """'head' or 'file.py', optionally ':BLOCK_M,BLOCK_N,WARPS[,BLOCKS_PER_SM]' -> (source, numbers)."""
    source, _, tiles = text.partition(":")
    if source != "head" and not (source.endswith(".py") and Path(source).is_file()):
        raise ValueError(f"variant {text!r}: the source must be `head` or an existing .py file")
    numbers = ()
    if tiles:
        try:
            numbers = tuple(int(x) for x in tiles.split(","))
        except ValueError:
            numbers = ()
        if len(numbers) not in (3, 4) or min(numbers) <= 0:
            raise ValueError(f"variant {text!r}: expected BLOCK_M,BLOCK_N,WARPS[,BLOCKS_PER_SM], "
                             f"positive integers")
    return source, numbers


def load(source: str):
    from flashcore_numba.phases import p07_mma_sync

    if source == "head":
        return p07_mma_sync
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"flashcore_numba.phases._ab_{Path(source).stem}", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(source, numbers, head_dim, dtype):
    module = load(source)
    if not numbers:
        return module.build_kernel(module.layout(head_dim, **module.TILES[head_dim]), dtype)
    L = module.layout(head_dim, *numbers[:3])
    return module.build_kernel(L, dtype, numbers[3]) if len(numbers) == 4 else module.build_kernel(L, dtype)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", help="SOURCE[:BLOCK_M,BLOCK_N,WARPS[,BLOCKS_PER_SM]]")
    parser.add_argument("--head-dim", type=int, choices=(64, 128), default=128)
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    parser.add_argument("--seq", type=int, default=2048,
                        help="S of the timed shape (B = 16 * 2048 / S, H = 16)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=10, help="launches per kernel and round")
    parser.add_argument("--causal-only", action="store_true")
    args = parser.parse_args(argv)
    try:
        variants = {text: parse_variant(text) for text in args.variants}
    except ValueError as exc:
        parser.error(str(exc))

    import torch

    import numpy as np

    from flashcore_numba import reference_attention
    from flashcore_numba.api import torch_to_kernel
    from flashcore_numba.measure.bench import Timing, TorchDevice
    from flashcore_numba.phases.common import LOG2E

    D = args.head_dim
    dtype = {"fp16": "float16", "bf16": "bfloat16"}[args.dtype]
    tdtype = getattr(torch, dtype)
    kernels = {text: build(source, numbers, D, dtype) for text, (source, numbers) in variants.items()}
    qk_scale = LOG2E / math.sqrt(D)

    def launch(cfg, q, k, v, o, causal):
        cfg.launch(*(torch_to_kernel(t) for t in (q, k, v, o)), causal, qk_scale)

    failed = []
    for B, h_q, h_kv, s_q, s_k in CHECK_SHAPES:
        q = torch.randn(B, h_q, s_q, D, device="cuda", dtype=tdtype)
        k, v = (torch.randn(B, h_kv, s_k, D, device="cuda", dtype=tdtype) for _ in range(2))
        for causal in (False, True):
            ref = reference_attention(q, k, v, causal=causal)  # float64, on the GPU
            for name, cfg in kernels.items():
                o = torch.full_like(q, float("nan"))
                launch(cfg, q, k, v, o, causal)
                err = float(np.abs(o.float().cpu().numpy() - ref).max())
                if not err < 2e-2:  # NaN fails too
                    failed.append(f"{name} {(B, h_q, h_kv, s_q, s_k)} causal={causal}: max error {err}")
    print("checks:", "all passed" if not failed else "; ".join(failed), flush=True)

    S = args.seq
    B, H = max(1, 16 * 2048 // S), 16
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=tdtype) for _ in range(3))
    o = torch.empty_like(q)
    device = TorchDevice()  # the benchmark's timing: an L2 flush before each launch, events around it
    timing = Timing(warmup=0, repeats=args.reps)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def flash(causal):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    for causal in ([True] if args.causal_only else [False, True]):
        runs = {name: (lambda c=cfg, m=causal: launch(c, q, k, v, o, m)) for name, cfg in kernels.items()}
        runs["flash"] = lambda m=causal: flash(m)
        for fn in runs.values():  # warm-up (and compilation)
            fn()
            fn()
        times = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, fn in runs.items():
                times[name] += device.time_ms(fn, timing)
        flops = 4 * B * H * S * S * D * (0.5 if causal else 1)
        row = "  ".join(f"{name} {flops / statistics.median(t) / 1e9:5.0f}" for name, t in times.items())
        print(f"D={D} S={S} {args.dtype} {'causal' if causal else 'nc    '} {row}", flush=True)

    def one(value):  # Numba answers per signature: a dict of one entry here
        return next(iter(value.values())) if isinstance(value, dict) else value

    for name, cfg in kernels.items():
        regs, local = cfg.kernel.get_regs_per_thread(), cfg.kernel.get_local_mem_per_thread()
        print(f"  {name}: {one(regs)} registers, {one(local)} B local memory")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

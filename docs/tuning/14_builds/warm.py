"""Phase 14's kernels compiled into the kernel cache, one process each, before a GPU run: a kernel
with mods compiles in a minute or two on one core, and `flashcore compile` knows no user's mods.

    python3 docs/tuning/14_builds/warm.py JOBS [D,dtype,score,mask[,phase[,grad[,det]]]] ...]

score: softcap, alibi or -; mask: window, documents, prefix, causal or -; phase: 07 or 09 (default:
what flex_attention picks); grad: its backward too (phase 11's kv_kernel with the mods), det: and
its deterministic build. Without
items: the cases of `flashcore bench --flex` at D 64 and 128 (fp16), forward and backward, and those
of tests/test_flex_kernel.py's GPU tests. Each runs flex_attention once on a small problem (its block
mask's kernel compiles too) and prints its time. Needs torch on a CUDA GPU.
"""

import multiprocessing as mp
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

BENCH = [(D, "float16", s, m, None, True) for D in (64, 128) for s, m in
         (("softcap", None), (None, "window"), ("alibi", None), (None, "documents"), (None, "causal"))]
GPU_TEST = [(D, dtype, s, m, phase) for D, dtype, phase in ((64, "float16", None), (128, "bfloat16", None),
                                                             (64, "float16", "07"))
            for s, m in (("softcap", "window"), ("alibi", "documents"), (None, "prefix"), (None, None))] + [
    (D, dtype, "softcap", "window", None, True, True) for D, dtype in ((64, "float16"), (128, "bfloat16"))] + [
    (64, "float16", "alibi", "window", phase) for phase in (None, "07")]  # the CUDA graph's and the thread's test


def one(D, dtype, score, mask, phase=None, grad=False, det=False):
    import torch

    from flashcore_numba import flex
    from flashcore_numba.api import flex_attention

    consumers_at_64()
    start = time.time()
    H, S = 4, 256
    q, k, v = (torch.randn(1, H, S, D, device="cuda").to(getattr(torch, dtype)) for _ in range(3))
    mods = {"softcap": flex.softcap(20.0), "alibi": flex.alibi(torch.tensor(flex.alibi_slopes(H), device="cuda")),
            "window": flex.sliding_window(64), "prefix": flex.prefix_lm(10), "causal": flex.causal_mask(),
            "documents": flex.document_mask(torch.zeros(1, S, dtype=torch.int32, device="cuda")), None: None}
    if grad:
        q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = flex_attention(q, k, v, score_mod=mods[score], mask_mod=mods[mask], phase=phase)
    finite = bool(torch.isfinite(out).all())
    if grad:
        out.backward(torch.randn_like(out))
        finite = finite and all(bool(torch.isfinite(x.grad).all()) for x in (q, k, v))
    if det:
        out = flex_attention(q, k, v, score_mod=mods[score], mask_mod=mods[mask], phase=phase, deterministic=True)
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        finite = finite and all(bool(torch.isfinite(g).all()) for g in grads)
    torch.cuda.synchronize()
    return (f"D={D} {dtype} {score} {mask} phase={phase} grad={grad} det={det}: {time.time() - start:.0f} s, "
            f"finite {finite}")


def consumers_at_64():
    """FLEX_CONSUMERS=N: phase 14's D = 64 build on phase 09 with N consumer warpgroups, not
    HOPPER_CONSUMERS's count (an A/B: docs/tuning/14_builds/consumers.py; give such kernels a
    FLASHCORE_CACHE_DIR of their own, since the cache's key does not hold the count)."""
    import os

    from flashcore_numba.phases import p14_flex as p14

    if os.environ.get("FLEX_CONSUMERS"):
        if not os.environ.get("FLASHCORE_CACHE_DIR"):
            raise SystemExit("FLEX_CONSUMERS: give the patched kernels a FLASHCORE_CACHE_DIR of their own")
        p14.HOPPER_CONSUMERS[64] = int(os.environ["FLEX_CONSUMERS"])


def parse(item: str) -> tuple:
    fields = [None if x == "-" else x for x in item.split(",")]
    return (int(fields[0]), *fields[1:5], *(["grad" in fields[5:], "det" in fields[5:]] if len(fields) > 5 else []))


def main():
    jobs = int(sys.argv[1])
    items = [parse(a) for a in sys.argv[2:]] or list(dict.fromkeys([*BENCH, *GPU_TEST]))
    start = time.time()
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        for future in as_completed([pool.submit(one, *item) for item in items]):
            try:
                print(future.result(), flush=True)
            except Exception as e:  # noqa: BLE001 - each item on its own
                print("FAILED", type(e).__name__, str(e)[:300], flush=True)
    print(f"{len(items)} kernels in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()

"""A/B of phase 10's tile configurations (block_n, stages, warps) at decode batches: each built whole,
dense (runtime's Plan) and paged (KVCachePlan on a contiguous cache), timed back to back in one
process beside SDPA's backends on the cache's (B, H_kv, S_k, D) view; docs/tuning/10_history.md,
"Two warps a block". From the repository root, on a GPU:

    FLASHCORE_CACHE_DIR=/tmp/fcx python3 docs/tuning/10_batch/decode_ab.py compile   # one process a build
    FLASHCORE_CACHE_DIR=/tmp/fcx python3 docs/tuning/10_batch/decode_ab.py time      # $OUT/decode_ab.json
"""
import dataclasses, json, math, os, sys, time
import multiprocessing as mp

VARIANTS = {"A": (32, 3, 4), "B": (16, 3, 4), "C": (32, 3, 2), "D": (32, 2, 2), "E": (32, 3, 1),
            "F": (16, 3, 2), "I": (16, 2, 4)}
H, H_KV, D = 32, 8, 128
SHAPES = [(16, 1024), (32, 1024), (64, 1024), (128, 1024), (256, 1024), (64, 4096), (64, 512), (8, 4096)]


def config(name, paged, dtype="float16"):
    from flashcore_numba.phases import p10_split_keys as p10
    bn, st, w = VARIANTS[name]
    L = p10.split_layout(D, block_n=bn, stages=st)
    cfg = p10.build_kernel(L, dtype, paged, warps=w)
    return dataclasses.replace(cfg, cache_key=(f"10-x{name}{'-kv' if paged else ''}", D, dtype))


def compile_one(args):
    name, paged = args
    t0 = time.time()
    try:
        from numba.cuda.core import sigutils
        from flashcore_numba.arch.cache import cached_cubin
        cfg = config(name, paged)
        argtypes, _ = sigutils.normalize_signature(cfg.signature("float16"))
        cached_cubin(cfg.kernel, argtypes, cfg.cache_key, (9, 0))
        return name, paged, round(time.time() - t0, 1), cfg.smem_bytes, "ok"
    except Exception as e:
        return name, paged, round(time.time() - t0, 1), None, repr(e)[:300]


def compile_all():
    jobs = [(n, p) for n in VARIANTS for p in (False, True)]
    with mp.get_context("spawn").Pool(min(14, len(jobs))) as pool:
        for r in pool.imap_unordered(compile_one, jobs):
            print("compiled", r, flush=True)


def time_all():
    import numpy as np
    import torch
    from flashcore_numba.runtime import kvcache as kvmod
    from flashcore_numba.runtime import plan as planmod
    scale = 1 / math.sqrt(D) * 1.4426950408889634
    dev = torch.device("cuda")
    stream = torch.cuda.current_stream().cuda_stream
    rows = []

    def per_call(fn, n):
        fn(); torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            fn()
        e.record(); e.synchronize()
        return s.elapsed_time(e) * 1000 / n

    for B, S in SHAPES:
        g = torch.Generator(device=dev).manual_seed(B * 7 + S)
        q_rows = torch.randn(B, 1, H, D, device=dev, generator=g).half()
        cache = [torch.randn(B, S, H_KV, D, device=dev, generator=g).half() for _ in range(2)]
        lengths = torch.full((B,), S, dtype=torch.int32, device=dev)
        q = q_rows.transpose(1, 2).contiguous()
        keys, values = (x.transpose(1, 2) for x in cache)
        dense = [x.contiguous() for x in (keys, values)]
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), keys.float(), values.float(), enable_gqa=True)
        calls = {}
        for name in VARIANTS:
            try:
                cd, ck = config(name, False), config(name, True)
                planmod.build = lambda *a, _c=cd, **k: _c
                kvmod.build_kvcache = lambda *a, _c=ck, **k: _c
                p = planmod.Plan("10", D, "float16", q.shape, dense[0].shape, False, scale, 0)
                kp = kvmod.KVCachePlan(D, "float16", q_rows.shape, cache[0].shape, None, False, scale, 0)
                out = torch.full_like(q, float("nan")); outk = torch.full_like(q_rows, float("nan"))
                p(q, dense[0], dense[1], out, stream); kp(q_rows, cache[0], cache[1], lengths, None, outk, stream)
                torch.cuda.synchronize()
                ed = (out.float() - ref).abs().max().item(); ek = (outk.transpose(1, 2).float() - ref).abs().max().item()
                print(f"B={B} S={S} {name} grid={p.grid} err dense {ed:.2e} kv {ek:.2e}", flush=True)
                if not (ed < 5e-3 and ek < 5e-3):
                    print("  WRONG", flush=True); continue
                calls[name] = lambda p=p, out=out: p(q, dense[0], dense[1], out, stream)
                calls[name + "-kv"] = lambda kp=kp, outk=outk: kp(q_rows, cache[0], cache[1], lengths, None, outk, stream)
            except Exception as e:
                print(f"B={B} S={S} {name} raised {e!r}"[:400], flush=True)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for bname in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
            try:
                with sdpa_kernel(getattr(SDPBackend, bname)):
                    torch.nn.functional.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
                def f(bname=bname):
                    with sdpa_kernel(getattr(SDPBackend, bname)):
                        return torch.nn.functional.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
                calls["sdpa-" + bname[:5].lower()] = f
            except Exception as e:
                print("sdpa", bname, "raised", repr(e)[:100])
        calls["sdpa"] = lambda: torch.nn.functional.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
        names = list(calls)
        n = max(20, int(20000 / max(1, B * S / 1024)))
        got = {k: [] for k in names}
        for r in range(6):
            for k in (names if r % 2 == 0 else names[::-1]):
                got[k].append(per_call(calls[k], n))
        med = {k: float(np.median(v)) for k, v in got.items()}
        best_sdpa = min(v for k, v in med.items() if k.startswith("sdpa"))
        for k in names:
            rows.append(dict(B=B, S=S, name=k, us=round(med[k], 2), spread=round(max(got[k]) - min(got[k]), 2),
                             vs_sdpa=round(best_sdpa / med[k], 3)))
        print(f"== B={B} S={S} best sdpa {best_sdpa:.1f} us", flush=True)
        for k in names:
            print(f"   {k:12s} {med[k]:8.1f} us  {best_sdpa/med[k]:.3f}x  spread {max(got[k])-min(got[k]):.1f}", flush=True)
        del calls, dense, cache
        torch.cuda.empty_cache()
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "decode_ab.json"), "w"), indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    compile_all() if sys.argv[1] == "compile" else time_all()

"""Phase 10 A/B in one process: padded (old) against swizzled (new) K/V rows, at one head dim.
Both built, checked against SDPA (NaN-poisoned output, twice: the counters reset), then timed in
alternating rounds (L2 flush before each launch, device time), under a lock shared with other D's."""
import fcntl, json, os, sys, time, traceback
import numpy as np
import torch
from numba import cuda
from flashcore_numba.measure.bench import open_device, Timing
from flashcore_numba.phases.common import LOG2E
from flashcore_numba.phases import p10_split_keys as p10

D = int(sys.argv[1])
out_dir = os.environ["OUT"]
TIMING = Timing(5, 200)
ROUNDS = 3
SHAPES = ([(1, 32, 8, 32768), (1, 32, 8, 8192), (1, 16, 16, 4096), (8, 32, 32, 2048), (8, 32, 8, 8192)]
          if D == 128 else [(1, 32, 8, 32768), (8, 32, 32, 2048)])
res = {"D": D, "rows": [], "peers": []}
dev = torch.device("cuda")
torch.manual_seed(0)
t0 = time.time()
configs = {}
for name, sw in (("padded", False), ("swizzled", True)):
    L = p10.split_layout(D, swizzle=sw, **p10.TILES[D])
    configs[name] = p10.build_kernel(L, "float16")
res["build_s"] = time.time() - t0
try:
    prepared = []
    for (B, H, H_kv, S_k) in SHAPES:
        q = torch.randn(B, H, 1, D, device=dev, dtype=torch.float16)
        k = torch.randn(B, H_kv, S_k, D, device=dev, dtype=torch.float16)
        v = torch.randn(B, H_kv, S_k, D, device=dev, dtype=torch.float16)
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
        fns = {}
        for name, cfg in configs.items():
            o = torch.full_like(q, float("nan"))
            qa, ka, va, oa = (cuda.as_cuda_array(x) for x in (q, k, v, o))
            fn = (lambda cfg=cfg, qa=qa, ka=ka, va=va, oa=oa: cfg.launch(qa, ka, va, oa, False, LOG2E * D ** -0.5))
            errs = []
            for _ in range(2):
                o.fill_(float("nan")); fn(); torch.cuda.synchronize()
                errs.append(float((o.float() - ref).abs().max()))
            fns[name] = (fn, max(errs), o)
        prepared.append(((B, H, H_kv, S_k), fns, (q, k, v)))
    res["compile_s"] = time.time() - t0
    with open(os.path.join(out_dir, "gpu.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        device = open_device()
        times = {}
        for rnd in range(ROUNDS):
            for shape, fns, _ in prepared:
                for name, (fn, err, _) in (fns.items() if rnd % 2 == 0 else reversed(list(fns.items()))):
                    t = device.time_ms(fn, TIMING)
                    times.setdefault((shape, name), []).append(t)
        for shape, fns, _ in prepared:
            for name, (fn, err, _) in fns.items():
                rounds = times[(shape, name)]
                allt = np.concatenate([np.array(x) for x in rounds])
                res["rows"].append(dict(shape=shape, variant=name, err=err,
                                        round_medians_us=[1e3 * float(np.median(x)) for x in rounds],
                                        median_us=1e3 * float(np.median(allt)), mean_us=1e3 * float(allt.mean()),
                                        p99_us=1e3 * float(np.percentile(allt, 99))))
        from torch.nn.attention import sdpa_kernel, SDPBackend
        for shape, fns, (q, k, v) in prepared:
            src = torch.cat([k.flatten(), v.flatten()]); dst = torch.empty_like(src)
            t = np.array(device.time_ms(lambda: dst.copy_(src), TIMING))
            row = dict(shape=shape, copy_us=1e3 * float(np.median(t)))
            try:
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                    f()
                    row["cudnn_us"] = 1e3 * float(np.median(device.time_ms(f, TIMING)))
            except Exception as e:
                row["cudnn_us"] = None
            res["peers"].append(row)
except Exception:
    res["error"] = traceback.format_exc()
json.dump(res, open(os.path.join(out_dir, f"ab10_d{D}.json"), "w"), indent=1)
print(f"D={D} done build {res.get('build_s', 0):.0f}s compile+check {res.get('compile_s', 0):.0f}s", res.get("error", "")[-3000:])

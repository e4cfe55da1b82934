"""One phase-10 variant: build, check against SDPA, time at the decode shapes (flock for timing)."""
import fcntl, json, os, sys, time, traceback, dataclasses
from functools import partial
import numpy as np
import torch
from numba import cuda
sys.path.insert(0, os.path.dirname(__file__))
name, mod, block_n, warps, stages = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
overrides = [int(x) for x in sys.argv[6].split(",")] if len(sys.argv) > 6 and sys.argv[6] else []
out_dir = os.environ["OUT"]
from flashcore_numba.arch import ptx as _ptx
_PREFETCH = os.environ.get("PREFETCH", "")
if _PREFETCH:
    _orig = _ptx.function
    def _patched(file, name, route):
        if name == "flashcore_cp_async_16":
            name = f"flashcore_cp_async_16_l2_{_PREFETCH}"
        return _orig(file, name, route)
    _ptx.function = _patched
from flashcore_numba.measure.bench import open_device, Timing
TIMING = Timing(5, 200)
from flashcore_numba.phases.common import LOG2E
if mod == "old":
    import p10_old as p10
else:
    from flashcore_numba.phases import p10_split_keys as p10
    p10.MERGE_UNROLLED = os.environ.get("UNROLL", "1") == "1"
from flashcore_numba.phases.p07_mma_sync import layout
t0 = time.time()
D = int(os.environ.get("D", "128"))
L = p10.split_layout(D, block_n, stages)
config = p10.build_kernel(L, "float16") if mod == "old" else p10.build_kernel(L, "float16", warps=warps)
SHAPES = [(1, 32, 8, 32768), (1, 32, 8, 8192), (1, 16, 16, 4096), (8, 32, 32, 2048)]
res = {"name": name, "rows": []}
dev = torch.device("cuda")
torch.manual_seed(0)
def run_shape(B, H, H_kv, S_k, splits, first):
    q = torch.randn(B, H, 1, D, device=dev, dtype=torch.float16)
    k = torch.randn(B, H_kv, S_k, D, device=dev, dtype=torch.float16)
    v = torch.randn(B, H_kv, S_k, D, device=dev, dtype=torch.float16)
    o = torch.full_like(q, float("nan"))
    cfg = config if splits is None else dataclasses.replace(config, split_keys=partial(config.split_keys, splits=splits))
    n_splits = cfg.split_keys(tuple(q.shape), tuple(k.shape), False).grid[0]
    qa, ka, va, oa = (cuda.as_cuda_array(x) for x in (q, k, v, o))
    scale = D ** -0.5
    fn = lambda: cfg.launch(qa, ka, va, oa, False, LOG2E * scale)
    fn(); torch.cuda.synchronize()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    err = float((o.float() - ref.float()).abs().max())
    # second launch must also be right (counters reset)
    o.fill_(float("nan")); fn(); torch.cuda.synchronize()
    err2 = float((o.float() - ref.float()).abs().max())
    return fn, n_splits, max(err, err2), (q, k, v)
try:
    shapes_runs = []
    for i, (B, H, H_kv, S_k) in enumerate(SHAPES):
        shapes_runs.append((B, H, H_kv, S_k, None))
        if i == 0:
            shapes_runs += [(B, H, H_kv, S_k, s) for s in overrides]
    prepared = []
    for (B, H, H_kv, S_k, s) in shapes_runs:
        fn, n, err, qkv = run_shape(B, H, H_kv, S_k, s, True)
        prepared.append(((B, H, H_kv, S_k), s, fn, n, err, qkv))
    res["compile_s"] = time.time() - t0
    with open(os.path.join(out_dir, "gpu.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        device = open_device()
        for shape, s, fn, n, err, qkv in prepared:
            t = np.array(device.time_ms(fn, TIMING))
            res["rows"].append(dict(shape=shape, forced=s, splits=n, err=err, median_us=1e3 * float(np.median(t)),
                                    mean_us=1e3 * float(t.mean()), p99_us=1e3 * float(np.percentile(t, 99))))
        if name == "old":  # peers once: the copy ceiling and SDPA's backends
            from torch.nn.attention import sdpa_kernel, SDPBackend
            for shape, s, fn, n, err, (q, k, v) in prepared:
                if s is not None:
                    continue
                src = torch.cat([k.flatten(), v.flatten()]); dst = torch.empty_like(src)
                t = np.array(device.time_ms(lambda: dst.copy_(src), TIMING))
                row = dict(shape=shape, copy_us=1e3 * float(np.median(t)))
                for be in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
                    try:
                        with sdpa_kernel([be]):
                            f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                            f()
                            t = np.array(device.time_ms(f, TIMING))
                        row[be.name] = 1e3 * float(np.median(t))
                    except Exception as e:
                        row[be.name] = None
                res.setdefault("peers", []).append(row)
except Exception:
    res["error"] = traceback.format_exc()
json.dump(res, open(os.path.join(out_dir, f"{name}.json"), "w"), indent=1)
print(name, "done", res.get("error", "")[-2000:])

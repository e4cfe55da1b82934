"""Phase 10 with parts left out (env NOMATH, NOMERGE, NOROOT), to see where its time beyond reading goes."""
import fcntl, json, os, sys, time
import numpy as np
import torch
from numba import cuda
sys.path.insert(0, os.path.dirname(__file__))
import p10v
from flashcore_numba.measure.bench import open_device, Timing
from flashcore_numba.phases.common import LOG2E
name = sys.argv[1]
OUT = os.environ["OUT"]
t0 = time.time()
cfg = p10v.build_kernel(p10v.split_layout(128, 32, 3), "float16")
dev = torch.device("cuda")
torch.manual_seed(0)
stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
prepared = []
for S_k in (32768, 8192):
    q = torch.randn(1, 32, 1, 128, device=dev, dtype=torch.float16)
    k, v = (torch.randn(1, 8, S_k, 128, device=dev, dtype=torch.float16) for _ in range(2))
    o = torch.full_like(q, float("nan"))
    qa, ka, va, oa = (cuda.as_cuda_array(x) for x in (q, k, v, o))
    fn = lambda qa=qa, ka=ka, va=va, oa=oa: cfg.launch(qa, ka, va, oa, False, LOG2E * 128 ** -0.5, stream)
    fn(); torch.cuda.synchronize()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    err = float((o.float() - ref.float()).abs().max())
    prepared.append((S_k, fn, err, (q, k, v)))
compile_s = time.time() - t0
rows = []
with open(os.path.join(OUT, "gpu.lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    device = open_device()
    for S_k, fn, err, (q, k, v) in prepared:
        t = np.array(device.time_ms(fn, Timing(5, 300))) * 1e3
        rows.append(dict(name=name, S_k=S_k, median_us=float(np.median(t)), mean_us=float(t.mean()),
                         p99_us=float(np.percentile(t, 99)), err=err))
        if name == "full":
            from torch.nn.attention import sdpa_kernel, SDPBackend
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                t = np.array(device.time_ms(f, Timing(5, 300))) * 1e3
            rows.append(dict(name="sdpa_cudnn", S_k=S_k, median_us=float(np.median(t)), mean_us=float(t.mean()),
                             p99_us=float(np.percentile(t, 99)), err=0.0))
for r in rows:
    r["compile_s"] = compile_s
json.dump(rows, open(os.path.join(OUT, f"var_{name}.json"), "w"))
print(name, "done", f"compile {compile_s:.0f} s", flush=True)

import os, sys, json
import numpy as np, torch
from numba import cuda
sys.path.insert(0, os.path.dirname(__file__))
import p10_trace as p10
from flashcore_numba.phases.common import LOG2E, launch
import dataclasses
from functools import partial
out = os.environ["OUT"]
dev = torch.device("cuda")
flushbuf = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
def run(B, H, H_kv, S_k, stages=3, block_n=32, splits=None, flush=True, reps=5, warps=4):
    L = p10.split_layout(128, block_n, stages)
    config = p10.build_kernel(L, "float16", warps=warps)
    q = torch.randn(B, H, 1, 128, device=dev, dtype=torch.float16)
    k = torch.randn(B, H_kv, S_k, 128, device=dev, dtype=torch.float16)
    v = torch.randn(B, H_kv, S_k, 128, device=dev, dtype=torch.float16)
    o = torch.empty_like(q)
    sp = config.split_keys(tuple(q.shape), tuple(k.shape), False, splits)
    nb = sp.grid[0] * sp.grid[1] * sp.grid[2] * warps
    trace = cuda.device_array((nb, 8), np.int32)
    qa, ka, va, oa = (cuda.as_cuda_array(x) for x in (q, k, v, o))
    cfg = dataclasses.replace(config, split_keys=partial(config.split_keys, splits=splits)) if splits else config
    args = cfg.arguments(qa, ka, va, oa, False, LOG2E * 128 ** -0.5)
    lines = []
    for r in range(reps):
        if flush:
            flushbuf.zero_()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        launch(cfg.kernel, sp.grid, cfg.n_threads, cfg.smem_bytes, args + (trace,))
        e1.record(); torch.cuda.synchronize()
        t = trace.copy_to_host().astype(np.int64)
        base = t[:, 0].min()
        rel = (t[:, :5] - base) % (1 << 32)
        rel = np.where(rel > (1 << 31), rel - (1 << 32), rel)
        lv = t[:, 5]
        mergers = [(l, rel[lv == l, 4]) for l in sorted(set(lv.tolist()))]
        pct = lambda x: "%5.1f/%5.1f/%5.1f" % tuple(np.percentile(x, [0, 50, 100]) / 1e3)
        lines.append(f"w{warps} B{B} H{H}/{H_kv} S_k{S_k} st{stages} bn{block_n} splits{sp.grid[0]} flush{int(flush)} event {e0.elapsed_time(e1)*1e3:6.1f} us span {rel[:,4].max()/1e3:6.1f}")
        lines.append(f"   start {pct(rel[:,0])}  prologue-end {pct(rel[:,1])}  loop-end {pct(rel[:,2])}  partial-written {pct(rel[:,3])}  (min/med/max us)")
        lines.append("   loop dur " + pct(rel[:,2]-rel[:,1]) + "  prologue dur " + pct(rel[:,1]-rel[:,0]))
        lines.append("   ends by level: " + "; ".join(f"L{l}: n={len(x)} {pct(x)}" for l, x in mergers))
        if r == reps - 1:
            np.save(f"{out}/trace_w{warps}_B{B}_S{S_k}_st{stages}_bn{block_n}_f{int(flush)}.npy", rel)
    return lines
import fcntl
res = []
lock = open(os.path.join(out, "gpu.lock"), "w")
for args in [dict(B=1, H=32, H_kv=8, S_k=32768), dict(B=1, H=32, H_kv=8, S_k=8192)]:
    fcntl.flock(lock, fcntl.LOCK_EX)
    res += run(**args)[-8:]
    fcntl.flock(lock, fcntl.LOCK_UN)
open(f"{out}/trace.txt", "w").write("\n".join(res))
print("\n".join(res))

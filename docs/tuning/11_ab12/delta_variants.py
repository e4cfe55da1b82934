# Ran on an H200 (2026-11-29) against phase 11 at commit 4f12bc7 (DELTA_ROWS: a row a warp); it
# does not run at later commits. Output: delta2_<D>.log (the rows' variants here have the store
# behind lane == 0, the slow form: see 11_ab.txt, run 12).
"""Δ kernel variants (rows per warp, fused dQ zeroing) against p11's and a driver memset. argv: D"""
import json, sys, math
import numpy as np
import torch
from numba import cuda, float32, uint32
from flashcore_numba.arch import ptx
from flashcore_numba.arch import launch as driver
from flashcore_numba.phases.common import FULL_MASK, cdiv
from flashcore_numba.phases import p11_backward as p11

D = int(sys.argv[1])
unpack = ptx.function("mma_sync.ptx", "flashcore_unpack_f16x2", "inline")


def build(R, W, FUSED):
    WORDS, COLS = D // 64, D // 32

    @cuda.jit
    def k(O, dO, DELTA, ACC):
        b, h = uint32(cuda.blockIdx.z), uint32(cuda.blockIdx.y)
        lane = uint32(cuda.laneid)
        first = (uint32(cuda.blockIdx.x) * W + uint32(cuda.threadIdx.x) // 32) * R
        totals = cuda.local.array(R, float32)
        for r in range(R):
            i = first + uint32(r)
            t = float32(0.0)
            if i < O.shape[2]:
                for j in range(WORDS):
                    w = lane + uint32(32 * j)
                    o0, o1 = unpack(O[b, h, i, w])
                    d0, d1 = unpack(dO[b, h, i, w])
                    t += o0 * d0 + o1 * d1
            totals[r] = t
        for r in range(R):
            i = first + uint32(r)
            t = totals[r]
            for width in (16, 8, 4, 2, 1):
                t += cuda.shfl_xor_sync(FULL_MASK, t, width)
            if i < O.shape[2]:
                if lane == 0:
                    DELTA[b, h, i] = t
                if FUSED:
                    for p in range(ACC.shape[0]):
                        for c in range(COLS):
                            ACC[p, b, h, i, lane + uint32(32 * c)] = float32(0.0)
    return k


B, H, S = 16, 16, 2048
o, do = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(2))
ref = (o.float() * do.float()).sum(-1)
acc = torch.full((1, B, H, S, D), 7.0, device="cuda")
delta = torch.empty(B, H, S, device="cuda")
O, dO = (cuda.as_cuda_array(x.view(torch.int32)).view(np.uint32) for x in (o, do))
DELTA, ACC = cuda.as_cuda_array(delta), cuda.as_cuda_array(acc)
stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)


def timed(fn, n=10):
    """device time per launch (torch.profiler), the mean over n launches"""
    import re
    from torch.profiler import ProfilerActivity, profile
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    ts = [e.time_range.elapsed_us() for e in prof.events() if e.device_type.name == "CUDA"]
    return round(sum(ts) / n, 1), len(ts)


rows = {}
bw = p11.build(D, "float16")
rows["p11 delta (R=1 W=4)"] = timed(lambda: bw.delta_kernel[(cdiv(S, p11.DELTA_ROWS), H, B), 32 * p11.DELTA_ROWS, stream](O, dO, DELTA, False, DELTA))
ok = float((delta - ref).abs().max())
rows["memset32 dQ acc"] = timed(lambda: driver.memset32(acc.data_ptr(), 0, acc.numel(), torch.cuda.current_stream().cuda_stream))
for R, W, F in ((1, 4, 0), (2, 4, 0), (4, 4, 0), (4, 8, 0), (8, 4, 0), (2, 8, 0), (2, 4, 1), (4, 4, 1)):
    k = build(R, W, bool(F))
    acc.fill_(7.0); delta.fill_(float("nan"))
    f = lambda: k[(cdiv(S, W * R), H, B), 32 * W, stream](O, dO, DELTA, ACC)
    f(); torch.cuda.synchronize()
    err = float((delta - ref).abs().max())
    zero = bool((acc == 0).all()) if F else None
    rows[f"R={R} W={W} fused={F}"] = (timed(f), round(err, 4), zero)
print(json.dumps(dict(D=D, p11_err=round(ok, 4), us=rows)))

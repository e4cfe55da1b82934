"""p11's Δ kernel with DELTA_ROWS warps per block (argv: D ROWS), and a clone of it defined here."""
import json, re, sys
import numpy as np
import torch
from numba import cuda, float32, uint32
from torch.profiler import ProfilerActivity, profile
from flashcore_numba.arch import ptx
from flashcore_numba.phases import p11_backward as p11
from flashcore_numba.phases.common import FULL_MASK, cdiv

D, ROWS = int(sys.argv[1]), int(sys.argv[2])
p11.DELTA_ROWS = ROWS
unpack = ptx.function("mma_sync.ptx", "flashcore_unpack_f16x2", "inline")
WORDS = D // 64


@cuda.jit
def clone(O, dO, DLSE, use_dlse, DELTA):
    b, h = uint32(cuda.blockIdx.z), uint32(cuda.blockIdx.y)
    lane = uint32(cuda.laneid)
    i = uint32(cuda.blockIdx.x) * ROWS + uint32(cuda.threadIdx.x) // 32
    if i < O.shape[2]:
        total = float32(0.0)
        for j in range(WORDS):
            w = lane + uint32(32 * j)
            o0, o1 = unpack(O[b, h, i, w])
            d0, d1 = unpack(dO[b, h, i, w])
            total += o0 * d0 + o1 * d1
        for width in (16, 8, 4, 2, 1):
            total += cuda.shfl_xor_sync(FULL_MASK, total, width)
        if lane == 0:
            DELTA[b, h, i] = total - DLSE[b, h, i] if use_dlse else total


def build_rows(R, W, acc_param):
    """R rows a warp (loads unconditional: a row past the end reads the last row again), W warps."""

    def body(O, dO, DLSE, use_dlse, DELTA):
        b, h = uint32(cuda.blockIdx.z), uint32(cuda.blockIdx.y)
        lane = uint32(cuda.laneid)
        first = (uint32(cuda.blockIdx.x) * W + uint32(cuda.threadIdx.x) // 32) * R
        last = uint32(O.shape[2] - 1)
        if first > last:
            return
        totals = cuda.local.array(R, float32)
        for r in range(R):
            i = min(first + uint32(r), last)
            t = float32(0.0)
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
            if i <= last and lane == 0:
                DELTA[b, h, i] = t - DLSE[b, h, i] if use_dlse else t

    if acc_param:
        @cuda.jit
        def k(O, dO, DLSE, use_dlse, DELTA, ACC):
            body(O, dO, DLSE, use_dlse, DELTA)
    else:
        @cuda.jit
        def k(O, dO, DLSE, use_dlse, DELTA):
            body(O, dO, DLSE, use_dlse, DELTA)
    body = cuda.jit(device=True, inline=True)(body)
    return k


B, H, S = 16, 16, 2048
o, do = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(2))
ref = (o.float() * do.float()).sum(-1)
delta = torch.empty(B, H, S, device="cuda")
O, dO = (cuda.as_cuda_array(x.view(torch.int32)).view(np.uint32) for x in (o, do))
DELTA = cuda.as_cuda_array(delta)
stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)


def timed(fn, n=10):
    delta.fill_(float("nan"))
    fn(); torch.cuda.synchronize()
    err = float((delta - ref).abs().max())
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    ts = [e.time_range.elapsed_us() for e in prof.events() if e.device_type.name == "CUDA"]
    return round(sum(ts) / n, 1), len(ts), round(err, 4)


bw = p11.build(D, "float16")
grid = (cdiv(S, ROWS), H, B)
rows = {"p11": timed(lambda: bw.delta_kernel[grid, 32 * ROWS, stream](O, dO, DELTA, False, DELTA)),
        "clone": timed(lambda: clone[grid, 32 * ROWS, stream](O, dO, DELTA, False, DELTA)),
        "p11 again": timed(lambda: bw.delta_kernel[grid, 32 * ROWS, stream](O, dO, DELTA, False, DELTA))}
acc = torch.zeros((1, B, H, S, D), device="cuda")
ACC = cuda.as_cuda_array(acc)
for R in (1, 2, 4, 8):
    k = build_rows(R, 4, False)
    g = (cdiv(S, 4 * R), H, B)
    rows[f"R={R} W=4"] = timed(lambda: k[g, 128, stream](O, dO, DELTA, False, DELTA))
    if R in (1, 4):
        k2 = build_rows(R, 4, True)
        rows[f"R={R} W=4 +ACC param"] = timed(lambda: k2[g, 128, stream](O, dO, DELTA, False, DELTA, ACC))
print(json.dumps(dict(D=D, ROWS=ROWS, us=rows)))

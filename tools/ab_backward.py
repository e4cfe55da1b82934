"""A/B of phase 11's backward against another version of it, on a GPU (docs/tuning/11_history.md).

A tuning aid, not the benchmark. Run it once per (version, head dim) in processes of their own,
each with its own kernel cache; `warm` first compiles one dQ mode's kernels into that cache (run
both modes side by side, a process each), then `time` checks and times:

    FLASHCORE_CACHE_DIR=/tmp/fc_new python3 tools/ab_backward.py warm-def new 64 &   # and warm-det
    FLASHCORE_CACHE_DIR=/tmp/fc_new python3 tools/ab_backward.py time new 64

A version is `new` (phases/p11_backward.py as it is in this checkout), `12` (phases/p12_backward_wgmma.py,
phase 11's backward with its kv_kernel on wgmma), or a path to a copy of that
file from another commit (loaded as a module of flashcore_numba.phases, so its relative imports
work; its Backward.run must take the same arguments as this checkout's, less dq_acc, dq_sums and
parts: versions before dq_acc (dQ float32, converted here, inside the timing) and after are timed alike).
The kernel cache keeps only kernels written in phases/ (arch.cache.is_ours): put the copy there
(e.g. phases/_ab_old.py, with a cache folder of its own) for `warm` to serve `time`; a copy kept
elsewhere compiles again in every process.
`kernels` prints each kernel's device time (torch.profiler) in one backward at B=16 H=16 S=2048.
`time` checks dQ, dK and dV in both modes against torch's float32 autograd on small odd shapes
(GQA, S_q != S_k, causal), then takes a lock on /tmp/gpu.lock, so that concurrent processes time
one at a time, and times Backward.run (Δ, dQ zeroed, kv_kernel, and the parts' sum where there
are parts) at B=16 H=16 S=2048 and B=1 H=16 S=4096: 8 launches back to back between two events,
median of 5, ms per backward; with deterministic=True it also compares two runs' gradients bit for
bit. It prints one JSON line.
"""

import fcntl
import importlib.util
import json
import math
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from numba import cuda  # noqa: E402

from flashcore_numba.api import torch_to_kernel  # noqa: E402

mode, version, D = sys.argv[1], sys.argv[2], int(sys.argv[3])
if version == "new":
    from flashcore_numba.phases import p11_backward as p
elif version == "12":  # phase 12: phase 11's backward with its kv_kernel on wgmma (Hopper)
    from flashcore_numba.phases import p12_backward_wgmma as p
else:
    spec = importlib.util.spec_from_file_location("flashcore_numba.phases._p11_other", version)
    p = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = p
    spec.loader.exec_module(p)
NEW = hasattr(p.Backward, "dq_parts")  # dQ in parts when deterministic
ACC = hasattr(p.Backward, "acc_rows")  # dQ in the inputs' type, from a float32 accumulator of padded rows
t0 = time.time()


def backward(q, k, v, o, lse, do, causal, det, parts=None):
    dq = torch.empty_like(q) if ACC else torch.empty(q.shape, dtype=torch.float32, device="cuda")
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty(q.shape[:3], dtype=torch.float32, device="cuda")
    bw = p.build(q.shape[-1], "float16")
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    arrays = [torch_to_kernel(x) for x in (q, k, v, o, do)]
    arrays += [cuda.as_cuda_array(lse), torch_to_kernel(dq) if ACC else cuda.as_cuda_array(dq)]
    arrays += [torch_to_kernel(x) for x in (dk, dv)]
    kw = {}
    if NEW:
        n = parts or bw.dq_parts(q.shape[0], k.shape[1], k.shape[2], det)
        if ACC:
            B, H, S_q, D = q.shape
            acc = torch.empty((n, B, H, bw.acc_rows(S_q), D), dtype=torch.float32, device="cuda")
            kw["dq_acc"] = cuda.as_cuda_array(acc)
        elif n > 1:
            kw["dq_sums"] = cuda.as_cuda_array(torch.empty((n, *q.shape), dtype=torch.float32, device="cuda"))
        kw["parts"] = n
    bw.run(*arrays, causal, 1 / math.sqrt(q.shape[-1]), det, stream=stream, delta=cuda.as_cuda_array(delta), **kw)
    # the same work either way: a version whose dQ is float32 has it converted, as attention() does
    return (dq if ACC else dq.to(torch.float16)), dk, dv


def check(B, H, H_kv, S_q, S_k, causal, det, parts=None):
    """Largest error of dq, dk, dv over the largest value of each, against float32 autograd."""
    g = torch.Generator("cuda").manual_seed(1)
    q = torch.randn(B, H, S_q, D, device="cuda", dtype=torch.float16, generator=g)
    k, v = (torch.randn(B, H_kv, S_k, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    do = torch.randn(B, H, S_q, D, device="cuda", dtype=torch.float16, generator=g)
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    q32, k32, v32 = leaves
    s = q32 @ k32.repeat_interleave(H // H_kv, 1).transpose(-1, -2) / math.sqrt(D)
    if causal:
        i = torch.arange(S_q, device="cuda")[:, None]
        j = torch.arange(S_k, device="cuda")[None, :]
        s = s.masked_fill(j > i + S_k - S_q, float("-inf"))
    # a row that sees no key: output 0 and no gradient (softmax of only -inf is NaN)
    o32 = torch.softmax(s, -1).nan_to_num(0.0) @ v32.repeat_interleave(H // H_kv, 1)
    ref = torch.autograd.grad(o32, leaves, do.float())
    lse = torch.logsumexp(s, -1).detach()
    got = backward(q, k, v, o32.detach().half(), lse, do, causal, det, parts)
    return [round(float((a.float() - r).abs().max() / r.abs().max()), 5) for a, r in zip(got, ref)]


if mode.startswith("warm"):
    errs = check(1, 2, 1, 100, 150, True, mode == "warm-det")
    print(json.dumps(dict(mode=mode, version=version, D=D, errs=errs, s=round(time.time() - t0))), flush=True)
    sys.exit(0)

if mode == "kernels":  # each kernel's device time (torch.profiler), one backward at B=16 H=16 S=2048
    from torch.profiler import ProfilerActivity, profile

    out = {}
    q, k, v, do = (torch.randn(16, 16, 2048, D, device="cuda", dtype=torch.float16) for _ in range(4))
    o, lse = torch.randn_like(q), torch.randn(16, 16, 2048, device="cuda") + 8
    for causal in (False, True):
        for det in (False, True):
            for _ in range(2):
                backward(q, k, v, o, lse, do, causal, det)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    backward(q, k, v, o, lse, do, causal, det)
                torch.cuda.synchronize()
            us = {}
            for e in prof.events():
                if e.device_type.name == "CUDA":
                    name = (re.findall(r"(\w+_kernel)", e.name) or [e.name[:40]])[-1]
                    us[name] = us.get(name, 0.0) + e.time_range.elapsed_us() / 5
            key = ("det_" if det else "") + ("causal" if causal else "full")
            out[key] = {n: round(t, 1) for n, t in us.items()}
    print(json.dumps(dict(version=version, D=D, us=out)), flush=True)
    sys.exit(0)

errs = {}
for case in ((1, 2, 2, 300, 300, False), (1, 2, 2, 300, 300, True), (1, 4, 2, 200, 333, True), (2, 2, 1, 130, 70, True)):
    for det in (False, True):
        errs[f"{case} det={det}"] = check(*case, det)
if NEW:
    errs["(1, 2, 1, 300, 333, True) det=True, 3 parts"] = check(1, 2, 1, 300, 333, True, True, parts=3)
ok = all(e < 2e-2 and not math.isnan(e) for es in errs.values() for e in es)
lock = open("/tmp/gpu.lock", "w")
fcntl.flock(lock, fcntl.LOCK_EX)  # one process times at a time
rows, same = {}, {}
for B, H, S, tag in ((16, 16, 2048, ""), (1, 16, 4096, "b1_")):
    for causal in (False, True):
        q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(4))
        o, lse = torch.randn_like(q), torch.randn(B, H, S, device="cuda") + 8  # the values do not matter here
        for det in (False, True):
            first = backward(q, k, v, o, lse, do, causal, det)
            for _ in range(2):
                again = backward(q, k, v, o, lse, do, causal, det)
            if det:
                same[tag + ("causal" if causal else "full")] = all(torch.equal(a, b) for a, b in zip(first, again))
            ts = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(8):
                    backward(q, k, v, o, lse, do, causal, det)
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b) / 8)
            rows[tag + ("det_" if det else "") + ("causal" if causal else "full")] = round(sorted(ts)[2], 3)
        del q, k, v, do, o, lse
print(json.dumps(dict(version=version, D=D, ok=ok, bit_identical=same, ms=rows, errs=errs)), flush=True)

"""Per-kernel device time of the backward plan attention()'s autograd runs (torch.profiler). argv: D"""
import json, math, re, sys
import torch
from torch.profiler import ProfilerActivity, profile
from flashcore_numba.runtime.backward import BackwardPlan

D = int(sys.argv[1])
B, H, S = 16, 16, 2048
q, k, v, do, o = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(5))
lse = torch.randn(B, H, S, device="cuda") + 8
out = {}
for causal in (False, True):
    for det in (False, True):
        plan = BackwardPlan(D, "float16", q.shape, k.shape, causal, 1 / math.sqrt(D), det, False, 0)
        def run():
            dq = torch.empty(q.shape, dtype=torch.float32, device="cuda")
            dk, dv = torch.empty_like(k), torch.empty_like(v)
            delta = torch.empty(B, H, S, device="cuda")
            sums = None if plan.parts == 1 else torch.empty((plan.parts, *q.shape), device="cuda")
            plan(q, k, v, o, do, lse, dq, dk, dv, delta, torch.cuda.current_stream().cuda_stream, dq_sums=sums)
            return dq.to(torch.float16)
        run(); run(); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                run()
            torch.cuda.synchronize()
        us = {}
        for e in prof.events():
            if e.device_type.name == "CUDA":
                name = (re.findall(r"(\w+_kernel)", e.name) or [e.name[:30]])[-1]
                us[name] = round(us.get(name, 0.0) + e.time_range.elapsed_us() / 5, 1)
        out[("det_" if det else "") + ("causal" if causal else "full")] = us
print(json.dumps(dict(D=D, us=out)))

"""A/B of the plan's launch: ctypes CUkernel (now) vs ctypes CUfunction vs cuda.bindings CUfunction.
Rounds alternate the variants; each figure is tools/call_profile.py's `us` (GPU asleep)."""
import ctypes, statistics, sys, time
import torch
from cuda.bindings import driver as drv
from flashcore_numba import api, attention
from flashcore_numba.arch import launch as L

def us(fn, n=200, reps=9):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda._sleep(150_000_000)
        asleep = torch.cuda.Event(); asleep.record()
        t = time.perf_counter()
        for _ in range(n): fn()
        dt = (time.perf_counter() - t) / n * 1e6
        if not asleep.query(): times.append(dt)
        torch.cuda.synchronize()
    return statistics.median(times) if times else float("nan")

q = torch.randn(1, 16, 128, 64, device="cuda", dtype=torch.float16); k = torch.randn_like(q); v = torch.randn_like(q)
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
attention(q, k, v); attention(q, k, v, phase="07")
plan09 = next(p for key, p in api._PLANS.items() if key[0] == "best")
plan07 = next(p for key, p in api._PLANS.items() if key[0] == "07")
s = torch._C._cuda_getCurrentRawStream(0)
lib = L._libcuda()

class CtypesFn:
    def __init__(self, launcher):
        kern = launcher.kernel
        err, fn = drv.cuKernelGetFunction(kern.handle); assert int(err) == 0
        self.fn = fn
        self._head = (ctypes.c_void_p(int(fn)),) + launcher._head[1:]
        self._params = launcher._params
    def __call__(self, stream):
        err = lib.cuLaunchKernel(*self._head, ctypes.c_void_p(stream), self._params, None)
        if err: raise RuntimeError(err)

class BindingsFn:
    def __init__(self, launcher):
        err, fn = drv.cuKernelGetFunction(launcher.kernel.handle); assert int(err) == 0
        h = launcher._head
        self.fn = fn
        self.dims = tuple(x.value for x in h[1:8])
        self.params = launcher._params.value
        self.launch = drv.cuLaunchKernel
    def __call__(self, stream):
        gx, gy, gz, bx, by, bz, smem = self.dims
        err, = self.launch(self.fn, gx, gy, gz, bx, by, bz, smem, stream, self.params, 0)
        if err: raise RuntimeError(err)

orig = {id(plan07): plan07.launch, id(plan09): plan09.launch}
ways = {"ctypes CUkernel (now)": lambda l: l, "ctypes CUfunction": CtypesFn, "bindings CUfunction": BindingsFn}
made = {name: {id(p): w(orig[id(p)]) for p in (plan07, plan09)} for name, w in ways.items()}

# correctness of each way
for name in ways:
    for p in (plan07, plan09):
        p.launch = made[name][id(p)]
    for ph in ("best", "07"):
        out = attention(q, k, v, phase=ph); torch.cuda.synchronize()
        err = (out.float() - ref.float()).abs().max().item()
        assert err < 1e-2, (name, ph, err)
print("all ways correct", flush=True)

rows = {}
for rnd in range(7):
    for name in ways:
        for p in (plan07, plan09):
            p.launch = made[name][id(p)]
        l7 = made[name][id(plan07)]
        for what, fn in (("launch 07", lambda: l7(s)), ("attention() 09", lambda: attention(q, k, v)),
                         ("attention() 07", lambda: attention(q, k, v, phase="07"))):
            rows.setdefault((what, name), []).append(us(fn))
    print("round", rnd, flush=True)
print(f"{'':40s} " + " ".join(f"r{i:<5d}" for i in range(7)) + "  median")
for (what, name), t in rows.items():
    print(f"{what + ' / ' + name:40s} " + " ".join(f"{x:6.2f}" for x in t) + f"  {statistics.median(t):6.2f}")

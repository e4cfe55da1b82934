"""Where the host time of a training call goes: cProfile of attention() with grad and of its backward."""
import cProfile, io, pstats, time, statistics
import torch
from flashcore_numba import api, attention

q = torch.randn(1, 16, 128, 64, device="cuda", dtype=torch.float16); k = torch.randn_like(q); v = torch.randn_like(q)
leaves = [x.clone().requires_grad_() for x in (q, k, v)]
g = torch.randn_like(q)
def us(fn, n=100):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    r = []
    for _ in range(5):
        torch.cuda._sleep(200_000_000); t = time.perf_counter()
        for _ in range(n): fn()
        r.append((time.perf_counter() - t) / n * 1e6); torch.cuda.synchronize()
    return statistics.median(r)
fwd = lambda: attention(*leaves)
step = lambda: torch.autograd.grad(attention(*leaves), leaves, g)
out = attention(*leaves)
node_bw = lambda: torch.autograd.grad(out, leaves, g, retain_graph=True)
for name, fn in (("fwd", fwd), ("fwd+bwd", step), ("bwd only (retained graph)", node_bw),
                 ("_require_backward", lambda: api._require_backward("best")),
                 ("_best_for_this_gpu", api._best_for_this_gpu)):
    print(f"{name:30s} {us(fn):8.1f} us", flush=True)
for name, fn in (("fwd+bwd", step), ("bwd only", node_bw)):
    pr = cProfile.Profile(); pr.enable()
    for _ in range(200): fn()
    pr.disable(); torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats(key).print_stats(35)
        print(f"==== {name} by {key}\n" + s.getvalue())

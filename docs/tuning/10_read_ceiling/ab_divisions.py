"""Phase 10 before (p10_old.py: the module at 1ad01e7) and after (the package's) the prologue's divisions
in 32 bits, and with paged_copy.diff too (p10_paged.py; VARIANTS=old,new,paged). One process per version:
they compile side by side, then take turns on the GPU (a turn file), three rounds each; each launch after
an L2 flush (device time)."""
import dataclasses, json, os, sys, time
import numpy as np
import torch
from numba import cuda
sys.path.insert(0, os.path.dirname(__file__))
from flashcore_numba import inference
from flashcore_numba.measure.bench import open_device, Timing
from flashcore_numba.phases.common import LOG2E

name = sys.argv[1]
OUT = os.environ.get("OUT", "/tmp")
if name == "old":
    import p10_old as mod
elif name == "paged":  # make_paged_variant.py: the package's phase 10 with paged_copy.diff
    import p10_paged as mod
else:
    from flashcore_numba.phases import p10_split_keys as mod
t0 = time.time()
dense = mod.build_kernel(mod.split_layout(128, **mod.TILES[128]), "float16")
paged = mod.build_kernel(mod.split_layout(128, **mod.TILES[128]), "float16", paged=True)
stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
torch.manual_seed(0)
fns = {}
for (B, H, H_kv, S_k) in [(1, 32, 8, 32768), (1, 32, 8, 8192), (1, 16, 16, 4096), (8, 32, 32, 2048), (4, 32, 8, 4096)]:
    q = torch.randn(B, H, 1, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(B, H_kv, S_k, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    o = torch.full_like(q, float("nan"))
    arrs = [cuda.as_cuda_array(x) for x in (q, k, v, o)]
    f = lambda arrs=arrs: dense.launch(*arrs, False, LOG2E * 128 ** -0.5, stream)
    err = 0.0
    for _ in range(2):
        o.fill_(float("nan")); f(); torch.cuda.synchronize()
        err = max(err, float((o.float() - ref.float()).abs().max()))
    fns[f"B{B} H{H}/{H_kv} S_k {S_k}"] = (f, err, (q, k, v))
orig = inference.build_kvcache
cfg = dataclasses.replace(orig(128, "float16"), kernel=paged.kernel, cache_key=())
inference.build_kvcache = lambda D, dt: cfg
for label, B, lo, hi in (("kvcache B1 32768", 1, 32768, 32768), ("kvcache B64 1..8192", 64, 1, 8192)):
    lengths = np.random.default_rng(7).integers(lo, hi + 1, B)
    cap = int(lengths.max())
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(B, 1, 32, 128, device="cuda", generator=g).half()
    k, v = (torch.randn(B, cap, 8, 128, device="cuda", generator=g).half() for _ in range(2))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    launch, out, _ = inference.kvcache_launcher(q, k, v, seqlens, None, causal=True)
    launch(); torch.cuda.synchronize()
    torch.save(out.cpu(), os.path.join(OUT, f"{name}_{label.replace(' ', '_')}.pt"))
    fns[label] = (launch, float("nan"), None)
print(name, f"built and checked in {time.time() - t0:.0f} s", flush=True)
device = open_device()
turn = os.path.join(OUT, "turn")
NAMES = os.environ.get("VARIANTS", "old,new").split(",")  # each process one of them, taking turns
order = [(NAMES[i % len(NAMES)], i) for i in range(3 * len(NAMES))]
res = {key: [] for key in fns}
for who, i in order:
    if who != name:
        continue
    deadline = time.time() + 150  # a sibling that died must not hang this one until the call's limit
    while (open(turn).read().strip() if os.path.exists(turn) else "0") != str(i):
        if time.time() > deadline:
            sys.exit(f"{name}: turn {i} never came (a sibling failed?)")
        time.sleep(0.05)
    for key, (f, _, _) in fns.items():
        res[key] += list(np.array(device.time_ms(f, Timing(5, 100))) * 1e3)
    open(turn, "w").write(str(i + 1))
rows = {key: dict(median_us=float(np.median(v)), err=fns[key][1]) for key, v in res.items()}
json.dump(rows, open(os.path.join(OUT, f"ab_{name}.json"), "w"), indent=1)

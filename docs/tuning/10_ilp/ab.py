"""One process per variant (argv[1]; env LAZY / SPLITQK as make_variant.py's p10v.py reads them;
argv[2:5] warps, block_n, stages; env FAN: the merge's FAN_IN if set; env MODULE: the module to build, p10v by default, `package` for
the package's phase 10, or another module beside this file such as make_variant3.py's p10v3): phase 10 at five decode shapes, D = 128 fp16, each output checked
against SDPA twice on poisoned memory, then timed with the others taking turns on the GPU (a turn
file; VARIANTS lists them in order), three rounds of 200 launches each after an L2 flush. The `base`
process also times SDPA's cuDNN backend."""
import json, os, sys, time
from pathlib import Path
import numpy as np
import torch
from numba import cuda
sys.path.insert(0, str(Path(__file__).parent))
_module = os.environ.get("MODULE", "p10v")
if _module == "package":
    from flashcore_numba.phases import p10_split_keys as p10v
else:
    import importlib
    p10v = importlib.import_module(_module)
if os.environ.get("FAN"):  # the merge's team size (FAN_IN), read when the kernel is built
    p10v.FAN_IN = int(os.environ["FAN"])
from flashcore_numba.measure.bench import open_device, Timing
from flashcore_numba.phases.common import LOG2E
from torch.nn.attention import sdpa_kernel, SDPBackend

name = sys.argv[1]
W, BN, ST = (int(x) for x in sys.argv[2:5])
OUT = os.environ.get("OUT", "/tmp")
t0 = time.time()
cfg = p10v.build_kernel(p10v.split_layout(128, BN, ST), "float16", warps=W)
stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
torch.manual_seed(0)
fns = {}
for (B, H, H_kv, S_k) in [(1, 32, 8, 32768), (1, 32, 8, 8192), (1, 16, 16, 4096), (8, 32, 32, 2048), (4, 32, 8, 4096)]:
    q = torch.randn(B, H, 1, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(B, H_kv, S_k, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    o = torch.empty_like(q)
    arrs = [cuda.as_cuda_array(x) for x in (q, k, v, o)]
    f = lambda arrs=arrs: cfg.launch(*arrs, False, LOG2E * 128 ** -0.5, stream)
    err = 0.0
    for _ in range(2):
        o.fill_(float("nan")); f(); torch.cuda.synchronize()
        err = max(err, float((o.float() - ref.float()).abs().max()))
    label = f"B{B} H{H}/{H_kv} S_k {S_k}"
    fns[label] = (f, err)
    if name == "base":
        def cudnn(q=q, k=k, v=v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        fns["cuDNN " + label] = (cudnn, 0.0)
grid = cfg.split_keys((1, 32, 1, 128), (1, 8, 32768, 128), False).grid
print(name, f"built and checked in {time.time() - t0:.0f} s, grid {grid}, fan-in {p10v.FAN_IN}", {k: f"{e:.1e}" for k, (_, e) in fns.items()},
      flush=True)
device = open_device()
turn = os.path.join(OUT, "turn")
NAMES = os.environ["VARIANTS"].split(",")
order = [(NAMES[i % len(NAMES)], i) for i in range(3 * len(NAMES))]
res = {key: [] for key in fns}
for who, i in order:
    if who != name:
        continue
    deadline = time.time() + 300
    while (open(turn).read().strip() if os.path.exists(turn) else "0") != str(i):
        if time.time() > deadline:
            sys.exit(f"{name}: turn {i} never came (a sibling failed?)")
        time.sleep(0.05)
    for key, (f, _) in fns.items():
        res[key] += list(np.array(device.time_ms(f, Timing(5, 200))) * 1e3)
    open(turn, "w").write(str(i + 1))
rows = {key: dict(median_us=float(np.median(t)), mean_us=float(np.mean(t)), p99_us=float(np.percentile(t, 99)),
                  err=fns[key][1]) for key, t in res.items()}
json.dump(dict(variant=name, warps=W, block_n=BN, stages=ST, module=_module, fan_in=p10v.FAN_IN,
               lazy=getattr(p10v, "LAZY", None), splitqk=getattr(p10v, "SPLITQK", None), grid=list(grid),
               rows=rows), open(os.path.join(OUT, f"ab_{name}.json"), "w"), indent=1)
print(name, "done", flush=True)

"""One process per variant of make_variants.py (its copy of the package first on PYTHONPATH; the
variant's name is argv[1]): phase 10 at five decode shapes, attention_kvcache on one cache of 32768
keys, the bare cp.async reader of ../10_read_ceiling/bw.py (phase 10's copy structure, nothing else)
and phase 07 at the reference shape, each checked against SDPA once, then timed: the processes take
turns on the GPU (a turn file), three rounds of 200 launches each, each launch after an L2 flush
(device time). The `base` process also times SDPA's cuDNN backend and the records' copy ceiling."""
import json, os, sys, time
from pathlib import Path
import numpy as np
import torch
from numba import cuda

name = sys.argv[1]
OUT = os.environ.get("OUT", "/tmp")
HERE = Path(__file__).resolve().parent
import flashcore_numba
from flashcore_numba import inference, phases
from flashcore_numba.arch import ptx as ptxmod
from flashcore_numba.measure.bench import open_device, Timing
from flashcore_numba.phases.common import LOG2E, launch as raw_launch

assert str(ptxmod.ptx_dir()).endswith(f"/{name}/ptx"), ptxmod.ptx_dir()
ns = {}
exec((HERE / "../10_read_ceiling/bw.py").read_text().replace("\nmain()\n", "\n"), ns)  # its make_reader only
t0 = time.time()
stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
p10 = phases.build(phases.PHASES["10"], 128)
p07 = phases.build(phases.PHASES["07"], 64)
torch.manual_seed(0)
fns, peers = {}, {}


def check(label, f, out, ref):
    err = 0.0
    for _ in range(2):
        out.fill_(float("nan")); f(); torch.cuda.synchronize()
        err = max(err, float((out.float() - ref.float()).abs().max()))
    fns[label] = (f, err)


from torch.nn.attention import sdpa_kernel, SDPBackend
for (B, H, H_kv, S_k) in [(1, 32, 8, 32768), (1, 32, 8, 8192), (1, 16, 16, 4096), (8, 32, 32, 2048), (4, 32, 8, 4096)]:
    q = torch.randn(B, H, 1, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(B, H_kv, S_k, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    o = torch.empty_like(q)
    arrs = [cuda.as_cuda_array(x) for x in (q, k, v, o)]
    label = f"p10 B{B} H{H}/{H_kv} S_k {S_k}"
    check(label, lambda arrs=arrs: p10.launch(*arrs, False, LOG2E * 128 ** -0.5, stream), o, ref)
    if name == "base":
        def cudnn(q=q, k=k, v=v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        peers[f"cudnn B{B} H{H}/{H_kv} S_k {S_k}"] = cudnn
    if S_k == 32768:  # the reader and the copy on the same bytes
        kb, vb = k.view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)
        kern, smem, tile = ns["make_reader"](4, 3, 32)
        per = -(-(kb.numel() // tile) // (128 * 4))
        rd = cuda.device_array(128 * 4 * 32, dtype=np.uint32)
        KU, VU = cuda.as_cuda_array(kb), cuda.as_cuda_array(vb)
        f = lambda: raw_launch(kern, (128,), 128, smem, (KU, VU, rd, per), stream)
        f(); torch.cuda.synchronize()
        fns["reader w4 s3 r32 x128"] = (f, 0.0)
        if name == "base":
            src = torch.cat([kb, vb]); dst = torch.empty_like(src)
            peers["copy (the records' ceiling)"] = lambda: dst.copy_(src)

g = torch.Generator(device="cuda").manual_seed(3)
q = torch.randn(1, 1, 32, 128, device="cuda", generator=g).half()
kc, vc = (torch.randn(1, 32768, 8, 128, device="cuda", generator=g).half() for _ in range(2))
seqlens = torch.tensor([32768], dtype=torch.int32, device="cuda")
launch, out, _ = inference.kvcache_launcher(q, kc, vc, seqlens, None, causal=True)
ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),
                                                       enable_gqa=True).transpose(1, 2)
check("kvcache B1 32768", launch, out, ref)

q, k, v = (torch.randn(16, 16, 2048, 64, device="cuda", dtype=torch.float16) for _ in range(3))
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
o = torch.empty_like(q)
arrs = [cuda.as_cuda_array(x) for x in (q, k, v, o)]
check("p07 B16 H16 S2048 D64", lambda: p07.launch(*arrs, False, LOG2E * 64 ** -0.5, stream), o, ref)
print(name, f"built and checked in {time.time() - t0:.0f} s", {k: f"{e:.1e}" for k, (_, e) in fns.items()}, flush=True)

device = open_device()
turn = os.path.join(OUT, "turn")
NAMES = os.environ["VARIANTS"].split(",")
order = [(NAMES[i % len(NAMES)], i) for i in range(3 * len(NAMES))]
res = {key: [] for key in [*fns, *peers]}
for who, i in order:
    if who != name:
        continue
    deadline = time.time() + 240
    while (open(turn).read().strip() if os.path.exists(turn) else "0") != str(i):
        if time.time() > deadline:
            sys.exit(f"{name}: turn {i} never came (a sibling failed?)")
        time.sleep(0.05)
    for key, f in [*((k, f) for k, (f, _) in fns.items()), *peers.items()]:
        res[key] += list(np.array(device.time_ms(f, Timing(5, 200))) * 1e3)
    open(turn, "w").write(str(i + 1))
rows = {key: dict(median_us=float(np.median(t)), mean_us=float(np.mean(t)), p99_us=float(np.percentile(t, 99)),
                  err=fns[key][1] if key in fns else 0.0) for key, t in res.items()}
json.dump(rows, open(os.path.join(OUT, f"ab_{name}.json"), "w"), indent=1)
print(name, "done", flush=True)

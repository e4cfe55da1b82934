"""#40: attention_kvcache on ragged batches with more splits than split_count gives (it gives 1 when
the (sequence, K/V head) blocks already fill the GPU: the longest sequences then set the tail)."""
import dataclasses, json, os
from functools import partial
import numpy as np
import torch
from flashcore_numba import inference, phases
from flashcore_numba.measure.bench import open_device, Timing

OUT = os.environ.get("OUT", "/tmp")
orig = phases.build_kvcache
device = open_device()
timing = Timing(5, 100)
rows = []
CASES = [("B64 1..8192", 64, 1, 8192, 32, 8), ("B64 1..8192 seed2", 64, 1, 8192, 32, 8),
         ("B32 1..16384", 32, 1, 16384, 32, 8), ("B8 2048 H_kv=32", 8, 2048, 2048, 32, 32),
         ("B16 1..4096 H_kv=32", 16, 1, 4096, 32, 32)]
for ci, (name, B, lo, hi, H, H_kv) in enumerate(CASES):
    rng = np.random.default_rng(1234 + ci)
    lengths = rng.integers(lo, hi + 1, B)
    cap = int(lengths.max())
    g = torch.Generator(device="cuda").manual_seed(ci)
    q = torch.randn(B, 1, H, 128, device="cuda", generator=g).half()
    k, v = (torch.randn(B, cap, H_kv, 128, device="cuda", generator=g).half() for _ in range(2))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    nbytes = 2 * int(lengths.sum()) * H_kv * 128 * 2
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda"); dst = torch.empty_like(src)
    tc = np.median(device.time_ms(lambda: dst.copy_(src), timing))
    del src, dst
    ref = None
    for s in (None, 1, 2, 3, 4, 6, 8):
        def patched(D, dtype="float16", s=s):
            c = orig(D, dtype)
            return c if s is None else dataclasses.replace(c, split_keys=partial(c.split_keys, splits=s))
        inference.build_kvcache = patched
        launch, out, _ = inference.kvcache_launcher(q, k, v, seqlens, None, causal=True)
        launch(); torch.cuda.synchronize()
        o = out.float().clone()
        if ref is None:
            ref = o
        err = float((o - ref).abs().max())
        t = np.array(device.time_ms(launch, timing)) * 1e3
        med = float(np.median(t))
        pct = 100 * nbytes / (med * 1e-6) / (2 * nbytes / (tc * 1e-3))
        row = dict(case=name, splits=s, median_us=med, p99_us=float(np.percentile(t, 99)), pct_copy=pct, err=err,
                   copy_ms=float(tc), bytes=nbytes)
        rows.append(row)
        print(f"{name:22s} splits {str(s):4s} {med:8.1f} us  p99 {row['p99_us']:8.1f}  {pct:5.1f} % of copy  diff {err:.1e}", flush=True)
inference.build_kvcache = orig
json.dump(rows, open(os.path.join(OUT, "splits.json"), "w"), indent=1)

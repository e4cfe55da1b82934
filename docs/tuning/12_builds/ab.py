"""A/B of phase 12's backward builds: the shipped one ("red": dQ by per-pair reductions, Sᵀ and dPᵀ
each awaited), "bulk" (dQ by one bulk reduction a 64 x 64 piece: p12_backward_wgmma.DqOfTiles),
"overlap" (Sᵀ and dPᵀ issued back to back, awaited once), both, "ws" (phase 13 in progress:
phase 12's kernel fed by a TMA producer warpgroup), and "tied" and "ws+tied" (the wgmma
accumulators named in place, not copied around each product), at the backward reference problems, every build's Backward.run back to back in one process, six rounds in alternating order;
their dQ, dK and dV compared with the shipped build's first. From the repository root, on an H100:

    FLASHCORE_CACHE_DIR=/tmp/fcx python3 docs/tuning/12_builds/ab.py compile   # a process a kernel
    FLASHCORE_CACHE_DIR=/tmp/fcx python3 docs/tuning/12_builds/ab.py time      # $OUT/builds_ab.json
    python3 docs/tuning/12_builds/ab.py table   # builds_ab.json beside this file, as 12_history.md shows it

`compile red,ws,ws+bulk` and `time red,ws,ws+bulk` take the builds named (red first); AB_RECORD
names the JSON file.

and under ncu, one backward of phase 12 (shipped build), of phase 13 or of SDPA's cuDNN backend between
cudaProfilerStart and Stop, after a warm-up (`ncu --profile-from-start off ...`):

    python3 docs/tuning/12_builds/ab.py profile 128 12       # or 13, cudnn, or a build's name (tied)
"""
import json, math, os, sys, time
import multiprocessing as mp

PROBLEMS = [(16, 16, 2048, 64, False), (16, 16, 2048, 64, True), (16, 16, 2048, 128, False),
            (16, 16, 2048, 128, True)]
BUILDS = {"red": (False, False), "bulk": (True, False), "overlap": (False, True), "bulk+overlap": (True, True),
          "tied": (False, False, True), "ws": "13", "ws+bulk": "13-bulk", "ws+tied": "13-tied"}
# ws: phase 13 (p13_backward_ws, in progress), phase 12's kernel fed by a TMA producer; ws+bulk: with
# dQ staged and added by the producer warpgroup's bulk reductions; tied, ws+tied: the wgmma
# accumulators named in place (ptx.function's in_place), not copied around each product


def backward_of(name, D):
    """The Backward of build `name` at head dim D, fp16."""
    from flashcore_numba.phases import p12_backward_wgmma as p12, p13_backward_ws as p13
    if BUILDS[name] in ("13", "13-bulk", "13-tied"):
        return p13.build(D, "float16", bulk_dq=BUILDS[name] == "13-bulk", tied=BUILDS[name] == "13-tied")
    bulk, overlap, *tied = BUILDS[name]
    return p12.build(D, "float16", bulk_dq=bulk, overlap=overlap, tied=bool(tied))


def compile_one(args):
    D, name = args
    t0 = time.time()
    try:
        from numba.cuda.core import sigutils
        from flashcore_numba.arch.cache import cached_cubin
        from flashcore_numba.phases import p12_backward_wgmma as p12
        from flashcore_numba.phases.p11_backward import views_of
        bw = backward_of(name, D)
        for kernel_id, view in views_of(bw).items():
            argtypes, _ = sigutils.normalize_signature(view.types)
            cached_cubin(view.kernel, argtypes, bw.cache_id(kernel_id), (9, 0))
        return D, name, round(time.time() - t0, 1), "ok"
    except Exception as e:
        return D, name, round(time.time() - t0, 1), repr(e)[:300]


def compile_all(names=",".join(BUILDS)):
    jobs = [(D, n) for D in (64, 128) for n in names.split(",")]
    with mp.get_context("spawn").Pool(len(jobs)) as pool:
        for r in pool.imap_unordered(compile_one, jobs):
            print("compiled", r, flush=True)


def time_all(names=",".join(BUILDS)):
    import numpy as np
    import torch
    from numba import cuda
    from flashcore_numba import attention
    from flashcore_numba.phases import p12_backward_wgmma as p12
    rows = []

    def per_call(fn, n):
        fn(); torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            fn()
        e.record(); e.synchronize()
        return s.elapsed_time(e) / n  # ms

    for B, H, S, D, causal in PROBLEMS:
        g = torch.Generator(device="cuda").manual_seed(S + D)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", generator=g).half() for _ in range(3))
        do = torch.randn_like(q)
        out, lse = attention(q, k, v, causal=causal, return_lse=True)
        lse = lse.float().contiguous()
        scale = 1 / math.sqrt(D)
        grads, calls = {}, {}
        for name in names.split(","):
            bw = backward_of(name, D)
            dq = torch.empty(B, H, S, D, device="cuda", dtype=torch.float32)
            dk, dv = torch.empty_like(k), torch.empty_like(v)
            delta = torch.empty(B, H, S, device="cuda", dtype=torch.float32)

            arrays = [cuda.as_cuda_array(x) for x in (q, k, v, out, do, lse, dq, dk, dv, delta)]

            def call(bw=bw, a=arrays):  # Numba's views of torch's memory (the default stream, as torch's)
                bw.run(*a[:9], causal, scale, delta=a[9])
            call(); torch.cuda.synchronize()
            grads[name] = (dq.clone(), dk.clone(), dv.clone())
            calls[name] = call
        ok = True
        for name in list(calls)[1:]:
            errs = [(a.float() - b.float()).abs().max().item() for a, b in zip(grads["red"], grads[name])]
            print(f"B={B} H={H} S={S} D={D} causal={causal}: {name} vs red, max |diff| dq {errs[0]:.2e} "
                  f"dk {errs[1]:.2e} dv {errs[2]:.2e}", flush=True)
            ok = ok and all(e < 2e-2 for e in errs)
        got = {n: [] for n in calls}
        for r in range(6):
            for n in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
                got[n].append(per_call(calls[n], 20))
        flops = 2.5 * 4 * B * H * S * S * D / (2 if causal else 1)
        med = {n: float(np.median(t)) for n, t in got.items()}
        for n in calls:
            rows.append(dict(B=B, H=H, S=S, D=D, causal=causal, build=n, ms=round(med[n], 4),
                             spread_ms=round(max(got[n]) - min(got[n]), 4), tflops=round(flops / med[n] / 1e9, 1),
                             vs_red=round(med["red"] / med[n], 3), agrees=ok, runs_ms=[round(x, 4) for x in got[n]]))
            print(f"   {n:12s} {med[n]:.3f} ms  {flops / med[n] / 1e9:6.1f} TFLOPS  {med['red'] / med[n]:.3f}x red", flush=True)
    gpu = torch.cuda.get_device_name()
    json.dump(dict(gpu=gpu, commit=os.environ.get("FLASHCORE_GIT_COMMIT"), rows=rows),
              open(os.path.join(os.environ.get("OUT", "."), os.environ.get("AB_RECORD", "builds_ab.json")), "w"),
              indent=1)


def profile(D, who, B=16, H=16, S=2048, causal=False):
    """One backward at B, H, S, D of phase 12 (its Backward.run) or of SDPA's cuDNN backend, inside
    cudaProfilerStart/Stop, after two unprofiled ones."""
    import torch
    from numba import cuda
    from flashcore_numba import attention
    from flashcore_numba.phases import p12_backward_wgmma as p12
    D = int(D)
    q, k, v = (torch.randn(B, H, S, D, device="cuda").half() for _ in range(3))
    do = torch.randn_like(q)
    if who != "cudnn":
        out, lse = attention(q, k, v, causal=causal, return_lse=True)
        bw = backward_of({"12": "red", "13": "ws"}.get(who, who), D)
        dq = torch.empty(B, H, S, D, device="cuda", dtype=torch.float32)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        delta = torch.empty(B, H, S, device="cuda", dtype=torch.float32)
        a = [cuda.as_cuda_array(x) for x in (q, k, v, out, do, lse.float().contiguous(), dq, dk, dv, delta)]

        def call():
            bw.run(*a[:9], causal, 1 / math.sqrt(D), delta=a[9])
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def call():
            torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def table(name="builds_ab.json"):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    """The record as a Markdown table: a row a problem, each build's median ms and its speed over red."""
    record = json.load(open(path))
    builds = [b for b in BUILDS if any(r["build"] == b for r in record["rows"])]
    lines = [f"{record['gpu']}, commit {record['commit']}: median ms of six rounds (speed over red)", "",
             "| problem | " + " | ".join(builds) + " |", "|---" * (len(builds) + 1) + "|"]
    problems = sorted({(r["B"], r["H"], r["S"], r["D"], r["causal"]) for r in record["rows"]}, key=lambda p: (p[3], p[4]))
    for B, H, S, D, causal in problems:
        cells = {r["build"]: r for r in record["rows"] if (r["B"], r["H"], r["S"], r["D"], r["causal"]) == (B, H, S, D, causal)}
        row = [f"{cells[b]['ms']:.3f} ({cells[b]['vs_red']:.2f}x)" + ("" if cells[b]["agrees"] else " differs")
               for b in builds]
        lines.append(f"| B{B} H{H} S{S} D{D}{' causal' if causal else ''} | " + " | ".join(row) + " |")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    {"compile": compile_all, "time": time_all, "table": table, "profile": profile}[sys.argv[1]](*sys.argv[2:])

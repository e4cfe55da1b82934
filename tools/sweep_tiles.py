"""Sweep tile configurations of phases 02-05 and 07 on a GPU; check each against torch and time it.

A tuning aid, not the benchmark: it times without an L2 flush, 10 launches queued between two
events, median of 3. The sweeps that chose the shapes in phases 02-05 are told in
docs/tuning/02-05_history.md. Run on a GPU machine:

    python3 tools/sweep_tiles.py [phases|sweep|all]      # D=64;  D=128 python3 tools/sweep_tiles.py sweep
    python3 tools/sweep_tiles.py 07                      # phase 07's (BLOCK_M, BLOCK_N, warps); D=128 too
    D=96 python3 tools/sweep_tiles.py 07                 # any head dim phase 07 builds (p07.gpu_tiles), and
                                                         # torch SDPA's default dispatch beside it
"""
import sys, time, math, json, os, dataclasses
import numpy as np, torch
from numba import cuda
from flashcore_numba.phases import PHASES, p02_smem_tiling as p2, p03_warp_shuffle as p3, p05_double_buffer as p5
from flashcore_numba.phases import p07_mma_sync as p7
from flashcore_numba.phases.common import LOG2E

B, H, S, D = 16, 16, 2048, int(os.environ.get("D", "64"))
torch.manual_seed(0)
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3))
refs = {c: torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=c) for c in (False, True)}
qk_scale = LOG2E / math.sqrt(D)
dq, dk, dv = (cuda.as_cuda_array(t) for t in (q, k, v))
o = torch.empty_like(q); do = cuda.as_cuda_array(o)

def check_and_time(cfg, causal, reps=10):
    o.fill_(float("nan"))
    cfg.launch(dq, dk, dv, do, causal, qk_scale); torch.cuda.synchronize()
    err = (o.float() - refs[causal]).abs().max().item()
    if not math.isfinite(err) or err > 5e-3:
        return err, float("nan")
    # launches queued back to back between two events, so that the host's launch time (about
    # 0.3 ms for a Numba launch) hides behind the kernels: a kernel timed alone would include it
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(3):
        st.record()
        for _ in range(reps):
            cfg.launch(dq, dk, dv, do, causal, qk_scale)
        en.record(); torch.cuda.synchronize()
        ts.append(st.elapsed_time(en) / reps)
    ms = float(np.median(ts))
    flops = 4 * B * H * S * S * D * (0.5 if causal else 1)
    return err, flops / ms / 1e9

rows = []
def capped(cfg, cap):
    """cfg's kernel compiled again with at most `cap` registers per thread (the rest unchanged)."""
    return dataclasses.replace(cfg, kernel=cuda.jit(max_registers=cap)(cfg.kernel.py_func))
def one(x):
    return list(x.values())[0] if isinstance(x, dict) else x
def run(name, cfg):
    t0 = time.time()
    try:
        r = [check_and_time(cfg, c) for c in (False, True)]
        regs = one(cfg.kernel.get_regs_per_thread()); lm = one(cfg.kernel.get_local_mem_per_thread())
    except Exception as e:
        print(name, "FAILED", repr(e)[:300], flush=True); rows.append(f"{name} FAILED {str(e)[:80]}"); return
    line = f"{name:<44} nc {r[0][1]:7.2f} TF (err {r[0][0]:.1e})  causal {r[1][1]:7.2f} TF  regs {regs} lmem {lm}  smem {cfg.smem_bytes//1024}K  [{time.time()-t0:.0f}s]"
    print(line, flush=True); rows.append(line)

which = sys.argv[1] if len(sys.argv) > 1 else "all"
if which in ("all", "phases"):
    for pid, m in PHASES.items():
        run(f"phase {pid}", m.build(D))
if which in ("all", "sweep"):
    if D == 64:
        for bm, bn in [(128, 64), (64, 64), (256, 32)]:
            run(f"02 bm{bm} bn{bn}", p2.build_kernel(D, bm, bn))
    for bm, bn, nw, lpr in [(64,64,4,16),(128,64,8,16),(128,32,8,8),(128,64,8,8),(64,64,4,8),(64,32,4,8)]:
        for name, stages, mod, pad_ in (("03", 1, p3, 0), ("04", 1, p3, 4), ("05", 2, p5, 4)):
            L = p3.layout(D, pad_, bm, bn, nw, lpr, stages)
            cfg = mod.build_kernel(L)
            tag = f"{name} D{D} bm{bm} bn{bn} w{nw} lpr{lpr} pad{pad_}"
            run(tag, cfg)
            if stages == 2 and nw == 8:
                run(tag + " maxreg128", capped(cfg, 128))
if which == "07":
    # (BLOCK_M, BLOCK_N, warps, register cap or 0): a warp owns BLOCK_M / (16 warps) m-tiles; a cap
    # of 128 lets two blocks of 8 warps share an SM. These assemble for sm_90a without spills
    # (BLOCK_N = 128 does not: its loops stay loops, S goes to local memory); on the H100 (128, 64, 4)
    # took 16 B of local memory. p07_mma_sync.TILES holds the fastest of each list (its docstring
    # quotes the runs that chose them; the latest, of 2378a60 and 5d649d6, in docs/tuning/07_history.md).
    P07 = {64: [(64, 32, 4, 0), (128, 64, 8, 0), (128, 64, 8, 128), (64, 64, 4, 0), (128, 64, 4, 0),
                (128, 32, 4, 0)],
           128: [(64, 32, 4, 0), (64, 64, 4, 0), (128, 64, 8, 0), (128, 64, 8, 128)]}
    # other head dims: gpu_tiles' choice first (from registers alone), then its neighbours
    wide = p7.tile_head_dim(D) > 128
    others = [(128, 48, 8, 0), (128, 32, 8, 0), (128, 64, 8, 0), (64, 32, 4, 0)] if wide else \
             [(128, 64, 4, 0), (128, 48, 4, 0), (128, 32, 4, 0), (64, 32, 4, 0)]
    chosen = tuple(p7.gpu_tiles(D)[key] for key in ("block_m", "block_n", "warps")) + (0,)
    for bm, bn, nw, cap in P07.get(D) or [chosen] + [c for c in others if c != chosen]:
        L = p7.layout(D, bm, bn, nw)
        cfg = p7.build_kernel(L)
        run(f"07 D{D} bm{bm} bn{bn} w{nw} m_tiles{L['M_TILES']}" + (f" cap{cap}" if cap else ""),
            capped(cfg, cap) if cap else cfg)
if which == "07":  # torch SDPA as it dispatches by itself (FlashAttention-2 or cuDNN at most head dims)
    for causal in (False, True):
        f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        f(); torch.cuda.synchronize()
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        for _ in range(10):
            f()
        en.record(); torch.cuda.synchronize()
        ms = st.elapsed_time(en) / 10
        line = f"sdpa D{D} {'causal' if causal else 'nc'} {4 * B * H * S * S * D * (0.5 if causal else 1) / ms / 1e9:7.2f} TF"
        print(line, flush=True); rows.append(line)
print("\n==== summary ====")
for r in rows: print(r)

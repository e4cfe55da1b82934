"""#40: how fast can K and V of the long decode step (B=1 H_kv=8 S_k=32768 D=128 fp16, 128 MiB) be
read at all? Read-only kernels with phase 10's copy structure (cp.async, per-warp stages, tiles of
rows of 256 bytes, one block an SM), a few grids and depths, beside torch's read-only reduction, the
copy the records use as the ceiling, and phase 10 itself; each after an L2 flush (device time)."""
import os, sys, time, json
import numpy as np
import torch
from numba import cuda, uint32, uint64, int32
from flashcore_numba.arch import ptx, operands
from flashcore_numba.phases.common import launch, LOG2E
from flashcore_numba.measure.bench import open_device, Timing

OUT = os.environ.get("OUT", "/tmp")
copy16 = ptx.function("cp_async.ptx", "flashcore_cp_async_16", "inline")
commit = ptx.function("cp_async.ptx", "flashcore_cp_async_commit", "inline")
WAITS = {n: ptx.function("cp_async.ptx", f"flashcore_cp_async_wait_{n}", "inline") for n in (0, 1, 2)}
ROW = 256  # bytes of a row of K or V at D = 128


def make_reader(WARPS, STAGES, TILE_ROWS):
    wait = WAITS[STAGES - 2]
    TILE = TILE_ROWS * ROW  # bytes of one tile of K (and of V)
    PASSES = TILE // 512  # a warp copies 512 bytes a pass (32 lanes x 16)
    STAGE = 2 * TILE
    WARP_BYTES = STAGES * STAGE

    @cuda.jit
    def read(K, V, OUT, tiles_per_range):
        smem_h = cuda.shared.array(0, uint32, alignment=128)
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        smem = operands.shared_address(smem_h) + uint32(warp * WARP_BYTES)
        r = cuda.blockIdx.x * WARPS + warp
        n_tiles = K.shape[0] // TILE
        t0 = r * tiles_per_range
        t1 = min(t0 + tiles_per_range, n_tiles)
        kb, vb = operands.global_address(K), operands.global_address(V)
        for st in range(STAGES - 1):
            t = t0 + st
            if t < t1:
                for i in range(PASSES):
                    off = uint64(t * TILE + i * 512 + lane * 16)
                    copy16(smem + uint32(st * STAGE + i * 512 + lane * 16), kb + off, uint32(16))
                    copy16(smem + uint32(st * STAGE + TILE + i * 512 + lane * 16), vb + off, uint32(16))
            commit()
        acc = uint32(0)
        stage = 0
        for t in range(t0, t1):
            wait()
            cuda.syncwarp()
            nt = t + STAGES - 1
            if nt < t1:
                ns = (stage + STAGES - 1) % STAGES
                for i in range(PASSES):
                    off = uint64(nt * TILE + i * 512 + lane * 16)
                    copy16(smem + uint32(ns * STAGE + i * 512 + lane * 16), kb + off, uint32(16))
                    copy16(smem + uint32(ns * STAGE + TILE + i * 512 + lane * 16), vb + off, uint32(16))
            commit()
            acc ^= smem_h[(warp * WARP_BYTES + stage * STAGE) // 4 + lane]  # touch the tile
            acc ^= smem_h[(warp * WARP_BYTES + stage * STAGE + TILE) // 4 + lane]
            stage = stage + 1 if stage + 1 < STAGES else 0
        OUT[cuda.blockIdx.x * WARPS * 32 + tid] = acc

    return read, WARPS * WARP_BYTES, TILE


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    S_k, H_kv, D = 32768, 8, 128
    k = torch.randn(1, H_kv, S_k, D, device=dev, dtype=torch.float16)
    v = torch.randn(1, H_kv, S_k, D, device=dev, dtype=torch.float16)
    q = torch.randn(1, 32, 1, D, device=dev, dtype=torch.float16)
    kb, vb = k.view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)
    nbytes = 2 * kb.numel()
    device = open_device()
    timing = Timing(5, 200)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []

    def timed(name, fn, note=""):
        t = np.array(device.time_ms(fn, timing)) * 1e3
        row = dict(name=name, median_us=float(np.median(t)), mean_us=float(t.mean()),
                   p99_us=float(np.percentile(t, 99)), read_gb_s=nbytes / (np.median(t) * 1e-6) / 1e9, note=note)
        rows.append(row)
        print(f"{name:34s} {row['median_us']:7.1f} us  {row['read_gb_s']:6.0f} GB/s read  {note}", flush=True)

    src = torch.cat([kb, vb]); dst = torch.empty_like(src)
    timed("copy (records' ceiling)", lambda: dst.copy_(src), "GB/s here: bytes read; the records count 2x")
    del dst
    s_out = torch.empty((), device=dev, dtype=torch.float32)
    flat = src.view(torch.float16)
    timed("torch.sum (read only)", lambda: torch.sum(flat, dtype=torch.float32))
    timed("torch.amax (read only)", lambda: torch.amax(flat))
    del src, flat

    from flashcore_numba import phases
    cfg = phases.build(phases.PHASES["10"], 128)
    qa, ka, va = (cuda.as_cuda_array(x) for x in (q, k, v))
    o = torch.empty_like(q); oa = cuda.as_cuda_array(o)
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    fn10 = lambda: cfg.launch(qa, ka, va, oa, False, LOG2E * D ** -0.5, stream)
    fn10(); torch.cuda.synchronize()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    err = float((o.float() - ref.float()).abs().max())
    n10 = cfg.split_keys((1, 32, 1, D), (1, H_kv, S_k, D), False).grid
    timed("phase 10 (attention, D=128)", fn10, f"grid {n10}, max err vs SDPA {err:.2e}")

    variants = [  # (warps, stages, tile rows, blocks)
        (4, 3, 32, 128), (4, 3, 32, sms), (4, 2, 32, 128), (4, 3, 32, 2 * sms), (4, 3, 32, 4 * sms),
        (8, 3, 16, 128), (8, 3, 16, sms), (2, 3, 32, 2 * sms), (4, 4, 16, sms), (4, 3, 64, sms) ,
    ]
    KU = cuda.as_cuda_array(kb); VU = cuda.as_cuda_array(vb)
    for warps, stages, tile_rows, blocks in variants:
        name = f"read w{warps} s{stages} r{tile_rows} x{blocks}"
        try:
            t_c = time.time()
            kern, smem, tile = make_reader(warps, stages, tile_rows)
            if smem > 227 * 1024:
                print(name, "smem", smem, "too much"); continue
            n_tiles = kb.numel() // tile
            ranges = blocks * warps
            per = -(-n_tiles // ranges)
            out = cuda.device_array(blocks * warps * 32, dtype=np.uint32)
            f = lambda: launch(kern, (blocks,), warps * 32, smem, (KU, VU, out, per), stream)
            f(); torch.cuda.synchronize()
            timed(name, f, f"{smem // 1024} KB smem a block, {per} tiles a warp, compile {time.time() - t_c:.1f} s")
        except Exception as e:
            print(name, "FAILED", repr(e)[:300])
    json.dump(rows, open(os.path.join(OUT, "bw.json"), "w"), indent=1)


main()

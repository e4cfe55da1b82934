"""#40: does the KV cache's layout (B, S, H_kv, D: a head's key rows 256 bytes, H_kv x 256 apart) read
slower than attention's (B, H_kv, S, D: a head's keys contiguous)? The cp.async reader of
docs/tuning/10_read_ceiling/bw.py (w4 s3 r32, one warp a range of one head's key tiles) on both."""
import os, json
import numpy as np
import torch
from numba import cuda, uint32, uint64
from flashcore_numba.arch import ptx, operands
from flashcore_numba.phases.common import launch
from flashcore_numba.measure.bench import open_device, Timing

copy16 = ptx.function("cp_async.ptx", "flashcore_cp_async_16", "inline")
commit = ptx.function("cp_async.ptx", "flashcore_cp_async_commit", "inline")
wait1 = ptx.function("cp_async.ptx", "flashcore_cp_async_wait_1", "inline")
WARPS, STAGES, TILE_ROWS, ROW = 4, 3, 32, 256
TILE = TILE_ROWS * ROW
STAGE = 2 * TILE
WARP_BYTES = STAGES * STAGE
PASSES = TILE // 512


def make(HEADS, HEAD_MINOR):
    """HEADS > 1: rows of a head HEADS x 256 bytes apart (the cache's layout); 1: contiguous.
    HEAD_MINOR: consecutive warps take the same key range of different heads (else one head's ranges)."""

    @cuda.jit(device=True, inline=True)
    def issue(smem, st, kb, vb, head, tile, lane):
        for i in range(PASSES):
            row = tile * TILE_ROWS + i * 2 + lane // 16
            off = uint64((row * HEADS + head) * ROW + (lane % 16) * 16) if HEADS > 1 else \
                uint64((head * 0 + row) * ROW + (lane % 16) * 16)
            copy16(smem + uint32(st * STAGE + i * 512 + lane * 16), kb + off, uint32(16))
            copy16(smem + uint32(st * STAGE + TILE + i * 512 + lane * 16), vb + off, uint32(16))

    @cuda.jit
    def read(K, V, OUT, per, tiles_per_head, n_heads):
        smem_h = cuda.shared.array(0, uint32, alignment=128)
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        smem = operands.shared_address(smem_h) + uint32(warp * WARP_BYTES)
        r = cuda.blockIdx.x * WARPS + warp
        n_ranges = cuda.gridDim.x * WARPS
        ranges_per_head = n_ranges // n_heads
        if HEAD_MINOR:
            head, part = r % n_heads, r // n_heads
        else:
            head, part = r // ranges_per_head, r % ranges_per_head
        t0 = part * per
        t1 = min(t0 + per, tiles_per_head)
        kb, vb = operands.global_address(K), operands.global_address(V)
        if HEADS == 1:  # contiguous heads: head h's rows start at h * tiles_per_head tiles
            t0 += head * tiles_per_head
            t1 += head * tiles_per_head
        for st in range(STAGES - 1):
            if t0 + st < t1:
                issue(smem, st, kb, vb, head, t0 + st, lane)
            commit()
        acc = uint32(0)
        stage = 0
        for t in range(t0, t1):
            wait1()
            cuda.syncwarp()
            if t + STAGES - 1 < t1:
                issue(smem, (stage + STAGES - 1) % STAGES, kb, vb, head, t + STAGES - 1, lane)
            commit()
            acc ^= smem_h[(warp * WARP_BYTES + stage * STAGE) // 4 + lane]
            stage = stage + 1 if stage + 1 < STAGES else 0
        OUT[cuda.blockIdx.x * WARPS * 32 + tid] = acc

    return read


device = open_device()
timing = Timing(5, 200)
H_kv, D = 8, 128
stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
rows = []
for S in (32768, 8192):
    nbytes = 2 * S * H_kv * D * 2
    k = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_()
    v = torch.empty_like(k).random_()
    src = torch.cat([k, v]); dst = torch.empty_like(src)
    tc = float(np.median(device.time_ms(lambda: dst.copy_(src), timing)))
    del src, dst
    KU, VU = cuda.as_cuda_array(k), cuda.as_cuda_array(v)
    tiles_per_head = S // TILE_ROWS
    for heads, minor, name in ((1, False, "contiguous heads (attention)"), (H_kv, False, "cache layout, head-major"),
                               (H_kv, True, "cache layout, head-minor")):
        kern = make(heads, minor)
        blocks = 128
        per = -(-tiles_per_head // (blocks * WARPS // H_kv))
        out = cuda.device_array(blocks * WARPS * 32, dtype=np.uint32)
        f = lambda: launch(kern, (blocks,), WARPS * 32, WARPS * WARP_BYTES, (KU, VU, out, per, tiles_per_head, H_kv), stream)
        f(); torch.cuda.synchronize()
        t = np.array(device.time_ms(f, timing)) * 1e3
        med = float(np.median(t))
        pct = 100 * (nbytes / (med * 1e-6)) / (2 * nbytes / (tc * 1e-3))
        rows.append(dict(S_k=S, name=name, median_us=med, pct_copy=pct, copy_ms=tc))
        print(f"S_k={S:6d} {name:32s} {med:7.1f} us  {pct:5.1f} % of copy", flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "strided.json"), "w"), indent=1)

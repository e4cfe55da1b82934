"""#40: the read ceiling by TMA (cp.async.bulk.tensor) beside cp.async's (bw.py): the same 128 MiB of K
and V, each warp streaming its range of key tiles through its own ring of stages, one lane issuing
the bulk copies (two 64-column boxes of 128-byte swizzled rows per tile of K, two of V), completion
counted on an mbarrier per stage. No math: how fast the bytes can arrive."""
import os, json, time
import numpy as np
import torch
from numba import cuda, uint32, int32
from flashcore_numba.arch import ptx, operands
from flashcore_numba.arch.tma import tensor_map
from flashcore_numba.phases.common import launch
from flashcore_numba.measure.bench import open_device, Timing

OUT = os.environ.get("OUT", "/tmp")
tma_load = ptx.function("tma.ptx", "flashcore_tma_load_3d", "inline")
mbar_init = ptx.function("tma.ptx", "flashcore_mbarrier_init", "inline")
fence_init = ptx.function("tma.ptx", "flashcore_fence_mbarrier_init", "inline")
expect_tx = ptx.function("tma.ptx", "flashcore_mbarrier_arrive_expect_tx", "inline")
wait = ptx.function("tma.ptx", "flashcore_mbarrier_wait", "inline")


def make_tma_reader(WARPS, STAGES, TILE_ROWS):
    ATOM = TILE_ROWS * 128  # 64 columns of TILE_ROWS rows
    TILE = 2 * ATOM  # a tile of K (or V): 128 columns
    STAGE = 2 * TILE
    WARP_BYTES = STAGES * STAGE
    BAR_OFF = WARPS * WARP_BYTES

    @cuda.jit(device=True, inline=True)
    def issue(smem, bars, s, t, map_k, map_v, tiles_per_head):
        bar = bars + uint32(8 * s)
        expect_tx(bar, uint32(STAGE))
        head = int32(t // tiles_per_head)
        row = int32((t % tiles_per_head) * TILE_ROWS)
        for a in range(2):
            tma_load(smem + uint32(s * STAGE + a * ATOM), map_k, int32(64 * a), row, head, bar)
            tma_load(smem + uint32(s * STAGE + TILE + a * ATOM), map_v, int32(64 * a), row, head, bar)

    @cuda.jit
    def read(MAPS, OUT, per, tiles_per_head, n_tiles):
        smem_h = cuda.shared.array(0, uint32, alignment=1024)
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        base = operands.shared_address(smem_h)
        smem = base + uint32(warp * WARP_BYTES)
        bars = base + uint32(BAR_OFF + warp * STAGES * 8)
        if lane == 0:
            for s in range(STAGES):
                mbar_init(bars + uint32(8 * s), uint32(1))
            fence_init()
        cuda.syncwarp()
        map_k = operands.map_address(MAPS[0])
        map_v = operands.map_address(MAPS[1])
        r = cuda.blockIdx.x * WARPS + warp
        t0 = r * per
        t1 = min(t0 + per, n_tiles)
        if lane == 0:
            for st in range(STAGES - 1):
                if t0 + st < t1:
                    issue(smem, bars, st, t0 + st, map_k, map_v, tiles_per_head)
        acc = uint32(0)
        stage = 0
        parity = uint32(0)
        for t in range(t0, t1):
            wait(bars + uint32(8 * stage), parity)
            cuda.syncwarp()
            nt = t + STAGES - 1
            if lane == 0 and nt < t1:
                issue(smem, bars, (stage + STAGES - 1) % STAGES, nt, map_k, map_v, tiles_per_head)
            acc ^= smem_h[(warp * WARP_BYTES + stage * STAGE) // 4 + lane]
            acc ^= smem_h[(warp * WARP_BYTES + stage * STAGE + TILE) // 4 + lane]
            stage += 1
            if stage == STAGES:
                stage = 0
                parity ^= uint32(1)
        OUT[cuda.blockIdx.x * WARPS * 32 + tid] = acc

    return read, BAR_OFF + WARPS * STAGES * 8, TILE


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    S_k, H_kv, D = 32768, 8, 128
    k = torch.randn(H_kv, S_k, D, device=dev, dtype=torch.float16)
    v = torch.randn(H_kv, S_k, D, device=dev, dtype=torch.float16)
    nbytes = 2 * k.numel() * 2
    device = open_device()
    timing = Timing(5, 200)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    rows = []

    def timed(name, fn, note=""):
        t = np.array(device.time_ms(fn, timing)) * 1e3
        row = dict(name=name, median_us=float(np.median(t)), mean_us=float(t.mean()),
                   p99_us=float(np.percentile(t, 99)), read_gb_s=nbytes / (np.median(t) * 1e-6) / 1e9, note=note)
        rows.append(row)
        print(f"{name:34s} {row['median_us']:7.1f} us  {row['read_gb_s']:6.0f} GB/s read  {note}", flush=True)

    src = torch.cat([k.flatten(), v.flatten()]); dst = torch.empty_like(src)
    timed("copy (records' ceiling)", lambda: dst.copy_(src), "GB/s here: bytes read; the records count 2x")
    del src, dst
    variants = [(4, 3, 32, 128), (4, 3, 32, sms), (1, 12, 32, sms), (1, 6, 64, sms), (2, 6, 32, sms),
                (4, 3, 32, 2 * sms), (1, 12, 32, 2 * sms), (4, 2, 64, sms)]
    for warps, stages, tile_rows, blocks in variants:
        name = f"tma w{warps} s{stages} r{tile_rows} x{blocks}"
        try:
            t_c = time.time()
            kern, smem, tile = make_tma_reader(warps, stages, tile_rows)
            if smem > 227 * 1024:
                print(name, "smem", smem, "too much"); continue
            maps = cuda.to_device(np.stack([tensor_map(x, (1, tile_rows, 64)).copy_to_host() for x in (k, v)]))
            tiles_per_head = S_k // tile_rows
            n_tiles = H_kv * tiles_per_head
            per = -(-n_tiles // (blocks * warps))
            out = cuda.device_array(blocks * warps * 32, dtype=np.uint32)
            f = lambda: launch(kern, (blocks,), warps * 32, smem, (maps, out, per, tiles_per_head, n_tiles), stream)
            f(); torch.cuda.synchronize()
            timed(name, f, f"{smem // 1024} KB smem a block, {per} tiles a warp, compile {time.time() - t_c:.1f} s")
        except Exception as e:
            print(name, "FAILED", repr(e)[:400])
    json.dump(rows, open(os.path.join(OUT, "bw_tma.json"), "w"), indent=1)


main()

"""cp.async of 64-row x 128-byte tiles into three shared layouts: how ncu counts L2 sectors and shared
wavefronts per LDGSTS, and how long a sweep of copies takes. Layouts: plain (rows 128 B apart), padded
(144 B apart, as phases 07 and 11), swizzled (128 B apart, chunk c of row r at chunk c ^ (r % 8))."""
import sys, numpy as np
from numba import cuda, uint32, uint64
from flashcore_numba.arch import operands, ptx
copy16 = ptx.function("cp_async.ptx", "flashcore_cp_async_16", "inline")
commit = ptx.function("cp_async.ptx", "flashcore_cp_async_commit", "inline")
wait_all = ptx.function("cp_async.ptx", "flashcore_cp_async_wait_0", "inline")
TILES = 64

def build(layout):
    ROW = 144 if layout == "padded" else 128
    SWZ = layout == "swizzled"
    @cuda.jit
    def k(G):
        smem_h = cuda.shared.array(0, uint32, alignment=128)
        smem = operands.shared_address(smem_h)
        tid = cuda.threadIdx.x
        r, chunk = tid // 8, tid % 8
        base = operands.global_address(G) + uint64(cuda.blockIdx.x) * uint64(TILES * 64 * 128)
        for t in range(TILES):
            stage = t % 2
            for i in range(4):
                row = r + i * 16
                c = (chunk ^ (row % 8)) if SWZ else chunk
                copy16(smem + stage * 64 * ROW + row * ROW + c * 16,
                       base + uint64((t * 64 + row) * 128 + chunk * 16), uint32(16))
            commit()
            wait_all()
            cuda.syncthreads()
    return k, 2 * 64 * ROW

blocks = 132 * 4
G = cuda.to_device(np.zeros(blocks * TILES * 64 * 64, np.float16))
which = sys.argv[1:] or ["plain", "padded", "swizzled"]
for layout in which:
    k, smem = build(layout)
    k[blocks, 128, 0, smem](G); cuda.synchronize()
    e0, e1 = cuda.event(), cuda.event()
    ts = []
    for _ in range(5):
        e0.record(); 
        for _ in range(10): k[blocks, 128, 0, smem](G)
        e1.record(); e1.synchronize(); ts.append(cuda.event_elapsed_time(e0, e1) / 10)
    gb = G.nbytes / min(ts) / 1e6
    print(f"{layout:9s} {min(ts)*1000:8.1f} us  {gb:7.1f} GB/s", flush=True)

"""The same long decode step's K and V (128 MiB) under ncu, read by the bare readers of
../10_read_ceiling/bw.py: phase 10's copy structure (a warp its own range and stages) in grids of 128
and 528 blocks, and blocks of two warps, two blocks an SM (cuDNN's kernel above has 256 blocks of 128
threads, two an SM); then cuDNN's and phase 10's kernels again, for the same run. Run under ncu
--profile-from-start off (run.sh readers): only what lies between cudaProfilerStart and Stop."""
from pathlib import Path
import numpy as np
import torch
import torch.nn.functional as F
from numba import cuda
from torch.nn.attention import sdpa_kernel, SDPBackend
from flashcore_numba import attention
from flashcore_numba.phases.common import launch

ns = {}
exec((Path(__file__).resolve().parent / "../10_read_ceiling/bw.py").read_text().replace("\nmain()\n", "\n"), ns)
torch.manual_seed(0)
q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.float16)
k, v = (torch.randn(1, 8, 32768, 128, device="cuda", dtype=torch.float16) for _ in range(2))
KU, VU = (cuda.as_cuda_array(x.view(-1).view(torch.uint8)) for x in (k, v))
stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
readers = []
for warps, stages, rows, blocks in [(4, 3, 32, 128), (4, 3, 32, 528), (2, 3, 32, 264), (4, 2, 32, 132)]:
    kern, smem, tile = ns["make_reader"](warps, stages, rows)
    per = -(-(KU.shape[0] // tile) // (blocks * warps))
    out = cuda.device_array(blocks * warps * 32, dtype=np.uint32)
    f = lambda kern=kern, smem=smem, blocks=blocks, warps=warps, per=per, out=out: \
        launch(kern, (blocks,), warps * 32, smem, (KU, VU, out, per), stream)
    f()
    readers.append(f)
    print(f"reader w{warps} s{stages} r{rows} x{blocks}: {smem // 1024} KB a block, {per} tiles a warp")


def cudnn():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


for _ in range(3):
    cudnn(); attention(q, k, v, phase="10")
torch.cuda.synchronize()
torch.cuda.profiler.start()
for f in readers:
    f()
cudnn()
attention(q, k, v, phase="10")
torch.cuda.synchronize()
torch.cuda.profiler.stop()

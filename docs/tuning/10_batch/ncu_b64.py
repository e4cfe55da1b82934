"""#73's last miss under Nsight Compute: the decode step B=64 H=32 H_kv=8 S_k=1024 D=128 fp16 (one query
row per sequence), where attention() (phase 10's variant "batch") is just behind SDPA's cuDNN backend
in the serving records (docs/performance.md, "Serving"). SDPA cuDNN, attention() and SDPA flash, three warm-up calls each, then one of each
between cudaProfilerStart and Stop, each behind an L2 flush. From the repository root, on a GPU:

    ncu --clock-control none --profile-from-start off --cache-control all --section SpeedOfLight \\
        --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis --section WarpStateStats \\
        --section SchedulerStats --section SourceCounters python3 docs/tuning/10_batch/ncu_b64.py > $OUT/ncu_b64.txt
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from flashcore_numba import attention

torch.manual_seed(0)
q = torch.randn(64, 32, 1, 128, device="cuda", dtype=torch.float16)
k, v = (torch.randn(64, 8, 1024, 128, device="cuda", dtype=torch.float16) for _ in range(2))


def sdpa(backend):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


for _ in range(3):
    a = sdpa(SDPBackend.CUDNN_ATTENTION)
    f = sdpa(SDPBackend.FLASH_ATTENTION)
    b = attention(q, k, v)
torch.cuda.synchronize()
print("max |ours - cuDNN|", float((a.float() - b.float()).abs().max()))
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
torch.cuda.profiler.start()
for fn in (lambda: sdpa(SDPBackend.CUDNN_ATTENTION), lambda: attention(q, k, v), lambda: sdpa(SDPBackend.FLASH_ATTENTION)):
    flush.zero_()
    torch.cuda.synchronize()
    fn()
    torch.cuda.synchronize()
torch.cuda.profiler.stop()

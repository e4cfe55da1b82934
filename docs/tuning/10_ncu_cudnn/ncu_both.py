"""Issue 40's long decode step (B=1 H_q=32 H_kv=8 S_k=32768 D=128 fp16) through SDPA's cuDNN backend
and through attention(phase="10"), three warm-up calls each, then one of each between
cudaProfilerStart and Stop: run under `ncu --profile-from-start off` (run.sh), so that the profile
holds these two kernels (and whatever small ones their calls launch) and nothing else."""
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from flashcore_numba import attention

torch.manual_seed(0)
q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.float16)
k, v = (torch.randn(1, 8, 32768, 128, device="cuda", dtype=torch.float16) for _ in range(2))


def cudnn():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


for _ in range(3):
    a = cudnn()
    b = attention(q, k, v, phase="10")
torch.cuda.synchronize()
print("max |phase 10 - cuDNN|", float((a.float() - b.float()).abs().max()))
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
flush.zero_()
torch.cuda.synchronize()
torch.cuda.profiler.start()
cudnn()
torch.cuda.synchronize()
flush.zero_()  # profiled too: it puts the second kernel behind an L2 that holds none of K and V
torch.cuda.synchronize()
attention(q, k, v, phase="10")
torch.cuda.synchronize()
torch.cuda.profiler.stop()

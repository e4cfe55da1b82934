"""Phase 10's decode at B=1 H_q=32 H_kv=8 S_k=32768 D=128 fp16 (issue 40's shape) through attention() on
Numba arrays, for ncu: its K/V cp.async copies into padded rows (as phase 07's)."""
import numpy as np
from numba import cuda
from flashcore_numba import attention
rng = np.random.default_rng(0)
q = cuda.to_device(rng.standard_normal((1, 32, 1, 128)).astype(np.float16))
k, v = (cuda.to_device(rng.standard_normal((1, 8, 32768, 128)).astype(np.float16)) for _ in range(2))
for _ in range(3):
    attention(q, k, v, phase="10")
cuda.synchronize()

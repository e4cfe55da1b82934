"""The flex_attention calls that docs/sanitizer/flex/ ran under compute-sanitizer (memcheck,
racecheck, synccheck), one tool a run, with their kernels already in the kernel cache:

    compute-sanitizer --tool memcheck --report-api-errors no python3 tools/sanitize_flex.py

Phase 14 on phase 09's kernel (the build flex_attention runs on an H100): a sliding window of 1024 and
four causal documents at D = 64 (two consumer warpgroups, block masks made on the GPU, partial, full
and empty tiles), ALiBi at D = 128 (no mask); B = 2, H = 4, S = 1500 (the last query block and key
tile end inside a tile); then the backward with a soft-cap of 20 and the window at D = 64 (phase 11's
kv_kernel with the mods, its rows from the block mask). Each output and gradient is checked to be finite here; its values, by the GPU tests
(tests/test_flex_kernel.py) and `flashcore bench --flex`'s oracle. Needs torch on a CUDA GPU.
"""

import torch

from flashcore_numba import flex
from flashcore_numba.api import flex_attention


def main():
    torch.manual_seed(0)
    B, H, S = 2, 4, 1500
    documents = flex.document_mask((torch.arange(S, device="cuda") * 4 // S).to(torch.int32).repeat(B, 1))
    alibi = flex.alibi(torch.tensor(flex.alibi_slopes(H), device="cuda"))
    for D, score_mod, mask_mod in ((64, None, flex.sliding_window(1024)), (64, None, documents), (128, alibi, None)):
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3))
        out = flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
        torch.cuda.synchronize()
        print(D, bool(torch.isfinite(out).all()), flush=True)
    q, k, v = (torch.randn(B, H, S, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    out = flex_attention(q, k, v, score_mod=flex.softcap(20.0), mask_mod=flex.sliding_window(1024))
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print("backward", all(bool(torch.isfinite(x.grad).all()) for x in (q, k, v)), flush=True)


if __name__ == "__main__":
    main()

"""The launches of attention_varlen and attention_kvcache that docs/sanitizer/inference/ runs under
compute-sanitizer, each tool in turn, after compiling their kernels into the kernel cache:

    python3 tools/sanitize.py --inference --out docs/sanitizer/inference

attention_varlen, phases 07 and 09, causal and not, at small packings chosen for their edges: an empty
sequence, rows without keys, a sequence of one row, one of two query blocks, the last sequence ending
where the packed tensors end (TMA boxes reach past it), GQA. attention_kvcache: contiguous and paged
caches (pages of 16 keys, read key by key, and of 64, read a tile at a time), ragged lengths with 0
and 1, pages in a shuffled order in a pool with unused pages, drafted rows. The outputs are checked
by the GPU tests (tests/test_gpu.py, tests/test_varlen.py, tests/test_inference.py); this script
only launches. Needs torch on a CUDA GPU.
"""

import torch

from flashcore_numba import attention_kvcache, attention_varlen

CASES = [  # (lengths of q, lengths of k, H, H_kv, D)
    ([130, 0, 17, 1], [100, 5, 40, 1], 4, 2, 64),
    ([65, 200], [0, 257], 2, 1, 128),
    ([1, 3, 129], [1, 3, 129], 2, 2, 64),
]


def offsets(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")


def main():
    torch.manual_seed(0)
    for phase in ("07", "09"):
        for lq, lk, H, H_kv, D in CASES:
            cq, ck = offsets(lq), offsets(lk)
            q = torch.randn(int(cq[-1]), H, D, device="cuda", dtype=torch.float16)
            k, v = (torch.randn(int(ck[-1]), H_kv, D, device="cuda", dtype=torch.float16) for _ in range(2))
            for causal in (False, True):
                attention_varlen(q, k, v, cq, ck, max(lq), max(lk), causal=causal, phase=phase, return_lse=True)
    for page in (None, 16, 64):
        lengths = torch.tensor([0, 1, 200, 77], dtype=torch.int32)
        q = torch.randn(4, 2, 8, 64, device="cuda", dtype=torch.float16)
        if page is None:
            k, v = (torch.randn(4, 200, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
            table = None
        else:
            per_seq = -(-200 // page)
            k, v = (torch.randn(4 * per_seq + 3, page, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
            table = torch.randperm(4 * per_seq + 3)[:4 * per_seq].reshape(4, per_seq).int().cuda()
        for causal in (False, True):
            attention_kvcache(q, k, v, lengths.cuda(), table, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    print("varlen and kvcache sanitizer cases ran")


if __name__ == "__main__":
    main()

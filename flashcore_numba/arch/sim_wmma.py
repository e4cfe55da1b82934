"""The simulator's WMMA: Python versions of the functions in ptx/wmma.ptx.

Numba's simulator runs no PTX, so phase 06's tile products are emulated here, instruction by
instruction, in the same loops as the PTX: `load_a`, `load_b`, `mma` and `store_d` stand for
`wmma.load.a`, `wmma.load.b`, `wmma.mma` and `wmma.store.d` (m16n16k16, fp16 inputs, fp32
accumulators), and `wmma_abt` / `wmma_ab` compose them as the two `.func`s do.

Fragments: PTX does not say which lane of the warp holds which element of a WMMA fragment
(it may differ between GPU generations), so there is no hardware layout to copy. The
emulation makes the simplest choice: a fragment is the whole 16 x 16 tile, held once for the
warp. Phase 06 never looks inside a fragment (it only loads, multiplies and stores them), so
the choice cannot change its results. `mma.sync`, whose layout PTX does document, is emulated
lane by lane with that layout.

A WMMA instruction is warp-collective: the 32 lanes arrive together, the work is done once,
and no lane leaves before the result is in shared memory. `warp_exchange` is that meeting.

Numerics: fp16 products are exact in fp32; each 16-deep step is summed in fp32 and added to
the fp32 accumulator, as the tensor cores do (their summation order inside a step differs,
which is rounding, well inside the reference oracle's tolerance).
"""

from __future__ import annotations

import numpy as np

from .emulation import emulation
from .sim import warp_exchange

M = N = K = 16  # the m16n16k16 shape


def load_a(ptr, ld):
    """wmma.load.a.sync.aligned.row.m16n16k16.shared.f16: a 16 x 16 fp16 tile, row-major."""
    return ptr.view(np.float16, M, K, ld).astype(np.float32)


def load_b(ptr, ld, layout: str):
    """wmma.load.b ... .f16: a 16 (k) x 16 (n) tile; `col` reads it transposed (n rows of k)."""
    if layout == "col":
        return ptr.view(np.float16, N, K, ld).astype(np.float32).T
    return ptr.view(np.float16, K, N, ld).astype(np.float32)


def mma(a, b, c):
    """wmma.mma.sync.aligned.m16n16k16.f32.f32: d = a . b + c in fp32."""
    return (a @ b).astype(np.float32) + c


def store_d(ptr, d, ld):
    """wmma.store.d.sync.aligned.row.m16n16k16.shared.f32: a 16 x 16 fp32 tile, row-major."""
    ptr.view(np.float32, M, N, ld)[...] = d


def _strip(c, a, b, c_ld, a_ld, b_ld, k_tiles, b_tile, layout):
    """C[16 x 64] = sum over k of A_k . B_(k, n), n = 0..3: the loop of both PTX functions."""
    acc = [np.zeros((M, N), np.float32) for _ in range(4)]
    for k in range(int(k_tiles)):
        frag_a = load_a(a + 32 * k, a_ld)  # 16 fp16 = 32 bytes along a row
        for n in range(4):
            acc[n] = mma(frag_a, load_b(b + b_tile(k, n), b_ld, layout), acc[n])
    for n in range(4):
        store_d(c + 64 * n, acc[n], c_ld)  # 16 fp32 = 64 bytes along a row


def _warp_collective(work):
    """Run `work` once per warp, with every lane of the warp arriving before and leaving after."""
    _, lane = warp_exchange(None)
    if lane == 0:
        work()
    warp_exchange(None)


@emulation("flashcore_wmma_abt")
def wmma_abt(c, a, b, c_ld, a_ld, b_ld, k_tiles):
    """C = A . B^T, B stored one row per column of C (K in shared memory)."""
    _warp_collective(lambda: _strip(c, a, b, c_ld, a_ld, b_ld, k_tiles,
                                    lambda k, n: 32 * int(b_ld) * n + 32 * k, "col"))


@emulation("flashcore_wmma_ab")
def wmma_ab(c, a, b, c_ld, a_ld, b_ld, k_tiles):
    """C = A . B, B stored one row per k (V in shared memory)."""
    _warp_collective(lambda: _strip(c, a, b, c_ld, a_ld, b_ld, k_tiles,
                                    lambda k, n: 32 * int(b_ld) * k + 32 * n, "row"))

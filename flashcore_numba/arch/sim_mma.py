"""The simulator's mma.sync, ldmatrix and cp.async: Python versions of the functions in
ptx/mma_sync.ptx, ptx/ldmatrix.ptx and ptx/cp_async.ptx.

Unlike WMMA (see sim_wmma), these instructions have fragment layouts the PTX ISA documents,
and the emulation keeps them lane by lane: each lane passes in the registers it holds on the
GPU and gets back the registers the GPU would give it. A kernel that reads a fragment's
registers directly (phase 07's softmax does) therefore computes the same thing here as on the
H100; tests/test_ptx.py runs the same kernels on both and checks the layouts against NumPy.

mma.sync (m16n8k16, g = lane // 4, t = lane % 4; a .b32 holds two 16-bit values, the lower
column or k in its lower half):

    A 16 x 16:  a0 = A[g][2t:2t+2]    a1 = A[g+8][2t:2t+2]    a2 = A[g][2t+8:2t+10]    a3 = A[g+8][2t+8:2t+10]
    B 16 x 8:   b0 = B[2t:2t+2][g]    b1 = B[2t+8:2t+10][g]
    C, D 16 x 8 (fp32):  c0, c1 = C[g][2t], C[g][2t+1]    c2, c3 = C[g+8][2t], C[g+8][2t+1]

Numerics: products of fp16 (or bf16) values are exact in fp32; the emulation sums in fp32 and
adds C, as the tensor cores do up to the order of the additions (rounding, far inside the
reference oracle's tolerance; the GPU tests compare the hardware with a float64 product).

cp.async is a plain copy here: it has landed when the call returns, which is what
`cp.async.wait_group` would guarantee, so commit and wait have nothing left to do.
"""

from __future__ import annotations

import numpy as np

from .emulation import emulation
from .sim import warp_exchange

# -- 16-bit halves of a .b32 register ------------------------------------------------------------


def _bits_to_float(bits, kind: str) -> float:
    if kind == "f16":
        return float(np.uint16(bits).view(np.float16))
    return float(np.uint32(int(bits) << 16).view(np.float32))  # bf16: the upper half of an fp32


def _halves(reg, kind: str) -> tuple[float, float]:
    """(lower, upper) 16-bit values of a .b32 register, as floats."""
    reg = int(reg)
    return _bits_to_float(reg & 0xFFFF, kind), _bits_to_float(reg >> 16, kind)


def _pack(lo_bits: int, hi_bits: int) -> np.uint32:
    return np.uint32((int(hi_bits) << 16) | int(lo_bits))


def f16_bits(x) -> int:
    """fp32 -> fp16 bits, round to nearest even (cvt.rn.f16.f32; beyond fp16's range: inf). A value
    inside fp16's range (or NaN) cannot overflow, so it needs no np.errstate, which costs more than
    the conversion (every P and dS value of the tensor-core phases comes through here)."""
    if not abs(x) > 65504.0:
        return int(np.float16(np.float32(x)).view(np.uint16))
    with np.errstate(over="ignore"):  # (a float64 beyond float32's range overflows already at float32)
        return int(np.float16(np.float32(x)).view(np.uint16))


def bf16_bits(x) -> int:
    """fp32 -> bf16 bits, round to nearest even (cvt.rn.bf16.f32); NaN stays a (quiet) NaN."""
    bits = int(np.float32(x).view(np.uint32))
    if (bits & 0x7F800000) == 0x7F800000 and bits & 0x7FFFFF:
        return (bits >> 16) | 0x40
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


# -- mma.sync ----------------------------------------------------------------------------------


_G = (np.arange(32) // 4)[:, None]  # each lane's g, as a column: rows g (and g + 8) of A and C
_COLS = 2 * (np.arange(32) % 4)[:, None] + np.arange(2)  # each lane's two columns, 2t and 2t + 1


def _register_halves(registers, kind: str) -> np.ndarray:
    """(lower, upper) 16-bit values of an array of .b32 registers, as float32: shape (..., 2)."""
    bits = np.asarray(registers, dtype=np.int64) & 0xFFFFFFFF
    halves = np.stack([bits & 0xFFFF, bits >> 16], axis=-1)
    if kind == "f16":
        return halves.astype(np.uint16).view(np.float16).astype(np.float32)
    return (halves.astype(np.uint32) << 16).view(np.float32)  # bf16: the upper half of an fp32


def _mma(kind, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """Gather the warp's fragments, multiply once (lane 0), hand each lane its four results. The
    fragments are placed for all 32 lanes at once: a loop over the lanes' registers was most of the
    simulator's time in the mma.sync phases."""
    values, lane = warp_exchange((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))
    D = None
    if lane == 0:
        x = _register_halves([v[:6] for v in values], kind)  # (lane, register, half)
        c = np.array([v[6:] for v in values], dtype=np.float32)  # (lane, 4)
        A = np.zeros((16, 16), np.float32)
        B = np.zeros((16, 8), np.float32)
        C = np.zeros((16, 8), np.float32)
        A[_G, _COLS], A[_G + 8, _COLS] = x[:, 0], x[:, 1]
        A[_G, _COLS + 8], A[_G + 8, _COLS + 8] = x[:, 2], x[:, 3]
        B[_COLS, _G], B[_COLS + 8, _G] = x[:, 4], x[:, 5]
        C[_G, _COLS], C[_G + 8, _COLS] = c[:, 0:2], c[:, 2:4]
        D = (A @ B).astype(np.float32) + C
    D = warp_exchange(D)[0][0]  # lane 0's product, to every lane
    g, t = lane // 4, lane % 4
    return (D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1])


@emulation("flashcore_mma_f16")
def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32: this lane's (d0, d1, d2, d3)."""
    return _mma("f16", a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


@emulation("flashcore_mma_bf16")
def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: this lane's (d0, d1, d2, d3)."""
    return _mma("bf16", a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


@emulation("flashcore_pack_f16x2")
def pack_f16x2(lo, hi):
    """cvt.rn.f16x2.f32: `lo` in bits 0-15, `hi` in bits 16-31."""
    return _pack(f16_bits(lo), f16_bits(hi))


@emulation("flashcore_pack_bf16x2")
def pack_bf16x2(lo, hi):
    """cvt.rn.bf16x2.f32: `lo` in bits 0-15, `hi` in bits 16-31."""
    return _pack(bf16_bits(lo), bf16_bits(hi))


@emulation("flashcore_unpack_f16x2")
def unpack_f16x2(packed):
    """One .b32 of two fp16 -> (lo, hi) as float32, exactly."""
    lo, hi = _halves(packed, "f16")
    return np.float32(lo), np.float32(hi)


@emulation("flashcore_unpack_bf16x2")
def unpack_bf16x2(packed):
    """One .b32 of two bf16 -> (lo, hi) as float32, exactly."""
    lo, hi = _halves(packed, "bf16")
    return np.float32(lo), np.float32(hi)


# -- ldmatrix ----------------------------------------------------------------------------------


def _ldmatrix(row_addr, trans: bool):
    """Lanes 8i..8i+7 give the row addresses of matrix i; each lane gets one register per matrix:
    elements (g, 2t) and (g, 2t + 1) of it, or transposed (2t, g) and (2t + 1, g). Each lane reads
    just the rows those lie in (one, or two transposed), not all eight."""
    values, lane = warp_exchange(row_addr)
    g, t = lane // 4, lane % 4
    regs = []
    for i in range(4):
        if trans:
            lo = values[8 * i + 2 * t].view(np.uint16, 1, 8, 8)[0, g]
            hi = values[8 * i + 2 * t + 1].view(np.uint16, 1, 8, 8)[0, g]
        else:
            lo, hi = values[8 * i + g].view(np.uint16, 1, 8, 8)[0, 2 * t:2 * t + 2]
        regs.append(_pack(lo, hi))
    return tuple(regs)


@emulation("flashcore_ldmatrix_x4")
def ldmatrix_x4(row_addr):
    """ldmatrix.sync.aligned.m8n8.x4.shared.b16: (r0, r1, r2, r3) of this lane."""
    return _ldmatrix(row_addr, trans=False)


@emulation("flashcore_ldmatrix_x4_trans")
def ldmatrix_x4_trans(row_addr):
    """ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: each matrix transposed."""
    return _ldmatrix(row_addr, trans=True)


# -- cp.async ----------------------------------------------------------------------------------


@emulation("flashcore_cp_async_16")
def cp_async_16(dst, src, src_bytes):
    """cp.async.cg.shared.global [dst], [src], 16, src_bytes: bytes past src_bytes become zeros."""
    n = int(src_bytes)
    out = dst.view(np.uint8, 1, 16, 16)[0]
    out[:n] = src.view(np.uint8, 1, n, n)[0] if n else out[:0]
    out[n:] = 0


@emulation("flashcore_cp_async_commit")
def cp_async_commit():
    """cp.async.commit_group: nothing to do, every copy has landed already."""


@emulation("flashcore_cp_async_wait_0")
def cp_async_wait_0():
    """cp.async.wait_group 0."""


@emulation("flashcore_cp_async_wait_1")
def cp_async_wait_1():
    """cp.async.wait_group 1."""


@emulation("flashcore_cp_async_wait_2")
def cp_async_wait_2():
    """cp.async.wait_group 2."""

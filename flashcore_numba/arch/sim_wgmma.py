"""The simulator's wgmma: Python versions of the functions in ptx/wgmma.ptx.

The emulation works at the level the phase uses them: one call multiplies a whole tile, read
from shared memory through its descriptor exactly as ptx/wgmma.ptx steps through it (the
start address moved on by each k-step, core matrices found LBO and SBO apart), and each
thread gets back the accumulator registers the hardware would give it:

    register 4j + e of warp w (of the warpgroup), lane (g = lane // 4, t = lane % 4):
        row 16w + g (+ 8 for e = 2, 3), column 8j + 2t (+ 1 for odd e)

A descriptor here is a `flashcore_numba.arch.operands.Descriptor` (a Pointer into the shared
array, LBO and SBO in bytes, the swizzle mode); on the GPU it is the 64-bit value of the PTX
ISA's format. With the 128-byte swizzle every address is computed as for the plain layout and
then XORed (bits 4-6 with bits 7-9), as the hardware does.
What the simulator cannot show is the asynchrony: each call is complete when it returns, as
the PTX functions are too (they end with wgmma.wait_group 0). The GPU tests compare the
hardware with this emulation (tests/test_ptx.py).

Numerics: products of fp16 or bf16 values are exact in fp32; the sums are fp32, as on the
tensor cores up to the order of the additions.
"""

from __future__ import annotations

import threading

import numpy as np

from .emulation import emulation
from .sim import warp_exchange

WARPGROUP = 128
CORE_ROW_BYTES = 16  # a core matrix: 8 rows of 16 bytes, 128 contiguous bytes (without swizzle)
ATOM_BYTES = 64 * 128  # a 128-byte-swizzle atom of ptx/wgmma.ptx: 64 rows of 128 bytes


def _bits_as_float(bits: np.ndarray, kind: str) -> np.ndarray:
    if kind == "f16":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _swizzle_128b(offset):
    """The 128-byte swizzle: address bits 4-6 XOR bits 7-9 (offsets from a 1024-byte aligned base)."""
    return offset ^ (((offset >> 7) & 7) << 4)


def _read(desc, start_bytes: int, rows: int, cols: int, k_major: bool, kind: str) -> np.ndarray:
    """A (rows, cols) operand of one wgmma from shared memory, rows along M/N and cols along K
    for a K-major operand, rows along K and cols along N for an MN-major one."""
    base = getattr(desc.pointer.array, "_ary", desc.pointer.array)
    data = np.ascontiguousarray(base).view(np.uint8).reshape(-1)
    i = np.arange(rows)[:, None]
    j = np.arange(cols)[None, :]
    start = desc.pointer.offset + start_bytes
    if desc.swizzle:  # 128-byte rows, eight of them SBO apart; MN-major atoms of 64 columns LBO apart
        if k_major:
            offset = start + (i // 8) * desc.sbo + (i % 8) * 128 + j * 2
        else:
            offset = start + (i // 8) * desc.sbo + (i % 8) * 128 + (j // 64) * desc.lbo + (j % 64) * 2
        offset = _swizzle_128b(offset)
    elif k_major:  # core matrices of 8 rows x 16 bytes, 128 contiguous bytes each
        offset = start + (i // 8) * desc.sbo + (j // 8) * desc.lbo + (i % 8) * CORE_ROW_BYTES + (j % 8) * 2
    else:
        offset = start + (j // 8) * desc.sbo + (i // 8) * desc.lbo + (i % 8) * CORE_ROW_BYTES + (j % 8) * 2
    bits = data[offset].astype(np.uint16) | (data[offset + 1].astype(np.uint16) << 8)
    return _bits_as_float(bits, kind)


def _place() -> tuple[int, int, int]:
    """(warp in the warpgroup, g, t) of the calling thread."""
    tid = threading.current_thread().thread_id
    lane = tid % 32
    return (tid % WARPGROUP) // 32, lane // 4, lane % 4


_ONCE_LOCK = threading.Lock()


def _operands(descriptors) -> tuple:
    """What names a wgmma's shared-memory operands: each descriptor's address, LBO, SBO and swizzle
    (the address in the host's memory: each simulated thread holds a view of its own of the block's
    shared memory, the same bytes)."""
    return tuple((d.pointer._address(), d.lbo, d.sbo, d.swizzle) for d in descriptors)


def _once_per_warpgroup(compute, *descriptors):
    """`compute()` for the calling thread's warpgroup: run by the first of its threads to get here,
    the result handed to the others. Every thread of a warpgroup calls the emulation of each
    wgmma (the instructions are warpgroup-collective: a thread's n-th call is its warpgroup's
    n-th), its operands in shared memory (`descriptors`) are the same for all of them, and each
    takes its own registers from one product: a product per thread (128 for each wgmma) was most
    of the simulator's time in phases 08, 09 and 12. A thread whose descriptors differ from the
    first one's (undefined on the GPU) raises, rather than taking a product of other operands."""
    thread = threading.current_thread()
    n = getattr(thread, "_flashcore_wgmma_calls", 0)
    thread._flashcore_wgmma_calls = n + 1
    manager = thread._manager  # the simulator's BlockManager: one per running block
    key = (thread.thread_id // WARPGROUP, n)
    with _ONCE_LOCK:
        products = getattr(manager, "_flashcore_wgmma", None)
        if products is None:
            products = manager._flashcore_wgmma = {}
        entry = products.get(key)
        if entry is None:
            bx, by, bz = manager._block_dim
            size = min(WARPGROUP, bx * by * bz - key[0] * WARPGROUP)  # threads of this warpgroup
            entry = products[key] = {"lock": threading.Lock(), "result": None, "readers": size,
                                     "operands": _operands(descriptors)}
    if _operands(descriptors) != entry["operands"]:
        raise RuntimeError(f"wgmma (call {key[1]} of warpgroup {key[0]}): this thread's descriptors differ from "
                           f"those of the warpgroup's first thread; every thread of a warpgroup must name the same "
                           f"operands")
    with entry["lock"]:
        if entry["result"] is None:
            entry["result"] = compute()
        result = entry["result"]
    with _ONCE_LOCK:
        entry["readers"] -= 1
        if entry["readers"] == 0:
            del products[key]
    return result


def _lane_values(D: np.ndarray, w: int, g: int, t: int) -> tuple:
    """This thread's accumulator registers of a (64, N) result."""
    # register 4j + e: row 16w + g (+ 8 for e = 2, 3), column 8j + 2t (+ 1 for odd e)
    rows = D[[16 * w + g, 16 * w + g + 8]].astype(np.float32, copy=False)
    values = rows.reshape(2, -1, 8)[:, :, 2 * t:2 * t + 2].transpose(1, 0, 2)  # (j, row, column)
    return tuple(values.reshape(-1))


def _qk(head_dim: int, kind: str, n_keys: int = 64):
    def product(desc_q, desc_k):
        S = np.zeros((64, n_keys), np.float32)
        for k in range(head_dim // 16):  # the k-steps of the PTX: 32 bytes on, the next atom after 4
            a = _read(desc_q, (k // 4) * ATOM_BYTES + (k % 4) * 32, 64, 16, True, kind)
            b = _read(desc_k, (k // 4) * n_keys * 128 + (k % 4) * 32, n_keys, 16, True, kind)  # K's atoms: n_keys rows
            S += a @ b.T
        return S

    def qk(desc_q, desc_k):
        return _lane_values(_once_per_warpgroup(lambda: product(desc_q, desc_k), desc_q, desc_k), *_place())

    return qk


def _p_tile(lanes, steps: int, kind: str) -> np.ndarray:
    """The warp's (16, 16 * steps) tile of P from its lanes' A fragments, as mma.sync lays them out
    (sim_mma): in k-step k, lane (g, t) holds in a0 P[g][16k+2t : +2], a1 the same columns of
    row g + 8, a2 and a3 those 8 columns on; the lower column in a register's lower half.
    All lanes at once in NumPy: every lane of every warp builds this tile at each P·V, and a
    loop over the 32 lanes' registers was most of the simulator's time in phases 08 and 09."""
    regs = np.array(lanes, dtype=np.int64) & 0xFFFFFFFF  # (lane, 4 * steps) .b32 registers
    # lane = 4g + t; register 4k + r with r = 2 * (column half) + (row half)
    regs = regs.reshape(8, 4, steps, 2, 2)
    halves = np.stack([regs & 0xFFFF, regs >> 16], axis=-1).astype(np.uint16)  # lower, upper 16 bits
    values = _bits_as_float(halves, kind)  # (g, t, k, column half, row half, half)
    # row = 8 * (row half) + g, column = 16k + 8 * (column half) + 2t + half
    return values.transpose(4, 0, 2, 3, 1, 5).reshape(16, 16 * steps)


def _pv(head_dim: int, kind: str, n_keys: int = 64):
    steps = n_keys // 16  # k-steps of 16 keys, four P fragments each

    def pv(*args):
        frags, desc_v = args[:4 * steps], args[4 * steps]
        lanes, _ = warp_exchange(tuple(frags))  # P's rows of this warp are in its 32 lanes
        P = _p_tile(lanes, steps, kind)
        # the k-steps of the PTX: 16 keys each, 2048 bytes on; V read once for the warpgroup
        V = _once_per_warpgroup(lambda: np.concatenate([_read(desc_v, 2048 * k, 16, head_dim, False, kind)
                                                        for k in range(steps)]), desc_v)
        w, g, t = _place()
        rows = np.zeros((64, head_dim), np.float32)
        rows[16 * w:16 * w + 16] = P @ V  # this warp's 16 rows of the 64
        return _lane_values(rows, w, g, t)

    return pv


def _pv_acc(head_dim: int, kind: str, n_keys: int):
    """O += P·V for the tuples route: (P's fragments, desc_v, O's registers) -> O's registers."""
    pv = _pv(head_dim, kind, n_keys)

    def pv_acc(frags, desc_v, acc):
        return tuple(np.float32(o + a) for o, a in zip(pv(*frags, desc_v), acc, strict=True))

    return pv_acc


def _dq(kind: str, accumulate: bool):
    """dQ = dS·K (phase 12) over 64 keys, both operands MN-major in shared memory: dSᵀ and K
    stored a row per key, each k-step 16 keys (2048 bytes) on. The _acc twin adds dQ's registers."""

    def product(desc_ds, desc_k):
        D = np.zeros((64, 64), np.float32)
        for k in range(4):
            a = _read(desc_ds, 2048 * k, 16, 64, False, kind)  # (16 keys, 64 query rows): dSᵀ, so A = its transpose
            b = _read(desc_k, 2048 * k, 16, 64, False, kind)  # (16 keys, 64 columns of d)
            D += a.T @ b
        return D

    def dq(desc_ds, desc_k):
        return _lane_values(_once_per_warpgroup(lambda: product(desc_ds, desc_k), desc_ds, desc_k), *_place())

    if accumulate:
        def dq_acc(desc_ds, desc_k, acc):
            return tuple(np.float32(o + a) for o, a in zip(dq(desc_ds, desc_k), acc, strict=True))

        return dq_acc
    return dq


for _kind in ("f16", "bf16"):
    for _D in (64, 128):
        emulation(f"flashcore_wgmma_qk_d{_D}_{_kind}")(_qk(_D, _kind))
        emulation(f"flashcore_wgmma_qk_issue_d{_D}_{_kind}")(_qk(_D, _kind))  # phase 12's build "overlap"
        emulation(f"flashcore_wgmma_pv_d{_D}_{_kind}")(_pv(_D, _kind))
        emulation(f"flashcore_wgmma_pv_acc_d{_D}_n64_{_kind}")(_pv_acc(_D, _kind, 64))  # phase 12's dV, dK
    emulation(f"flashcore_wgmma_dq_{_kind}")(_dq(_kind, False))  # phase 12's dQ
    emulation(f"flashcore_wgmma_dq_acc_{_kind}")(_dq(_kind, True))
    for _D in (64, 128):  # phase 09's 128-key tiles
        emulation(f"flashcore_wgmma_qk_d{_D}_n128_{_kind}")(_qk(_D, _kind, 128))
        emulation(f"flashcore_wgmma_pv_acc_d{_D}_n128_{_kind}")(_pv_acc(_D, _kind, 128))
        # issued, not awaited: the emulation computes at once; nothing writes the operands before the wait
        emulation(f"flashcore_wgmma_qk_issue_d{_D}_n128_{_kind}")(_qk(_D, _kind, 128))
        emulation(f"flashcore_wgmma_pv_acc_issue_d{_D}_n128_{_kind}")(_pv_acc(_D, _kind, 128))
    for _D in (192, 256):  # phase 09's 64-key tiles at the widest head dims
        for _twin in ("", "_issue"):
            emulation(f"flashcore_wgmma_qk{_twin}_d{_D}_n64_{_kind}")(_qk(_D, _kind, 64))
            emulation(f"flashcore_wgmma_pv_acc{_twin}_d{_D}_n64_{_kind}")(_pv_acc(_D, _kind, 64))
    emulation(f"flashcore_wgmma_pv_acc_issue_d128_n64_{_kind}")(_pv_acc(128, _kind, 64))  # (V of MLA's 128)


def wait_s(acc):
    """wgmma.wait_group 1: S is ready (it was computed at its issue); handed back unchanged."""
    return acc


for _n in (64, 128):
    emulation(f"flashcore_wgmma_wait_s_n{_n}")(wait_s)
    emulation(f"flashcore_wgmma_wait_last_n{_n}")(wait_s)  # wait_group 0: the same (computed at its issue)


def _wait_o(frags, acc):
    """wgmma.wait_group 0: O is ready; P's fragments were only kept alive until here."""
    return acc


for _D, _n in ((64, 128), (128, 128), (128, 64), (192, 64), (256, 64)):
    emulation(f"flashcore_wgmma_wait_o_d{_D}_n{_n}")(_wait_o)


@emulation("flashcore_fence_proxy_async")
def fence_proxy_async():
    """fence.proxy.async.shared::cta: nothing to order, the emulation reads shared memory directly."""

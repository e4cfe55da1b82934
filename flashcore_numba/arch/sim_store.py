"""The simulator's 16-byte store: a Python version of ptx/store.ptx's `flashcore_st_global_v4`.

The address is the simulator's `Pointer` (array, byte offset), as `operands.global_address` hands
it out there. The hardware faults on a store that is not 16-byte aligned; so does this one, with
the offset in the message, so that a kernel that would fault on the GPU fails in the CPU tests.
"""

from __future__ import annotations

import numpy as np

from .emulation import emulation


@emulation("flashcore_st_global_v4")
def st_global_v4(addr, w0, w1, w2, w3):
    if addr.offset % 16:
        raise ValueError(f"addr: st.global.v4.b32 needs a 16-byte aligned address, got byte offset {addr.offset}")
    addr.view(np.uint32, 1, 4, 4)[0] = [int(w0), int(w1), int(w2), int(w3)]


_RED_LOCK = __import__("threading").Lock()  # the simulator's lanes are threads: one addition at a time


@emulation("flashcore_red_add_f32")
def red_add_f32(addr, x):
    if addr.offset % 4:
        raise ValueError(f"addr: red.global.add.f32 needs a 4-byte aligned address, got byte offset {addr.offset}")
    with _RED_LOCK:
        addr.view(np.float32, 1, 1, 1)[0, 0] += np.float32(x)


@emulation("flashcore_red_add_v2_f32")
def red_add_v2_f32(addr, x0, x1):
    if addr.offset % 8:
        raise ValueError(f"addr: red.global.add.v2.f32 needs an 8-byte aligned address, got byte offset {addr.offset}")
    with _RED_LOCK:
        addr.view(np.float32, 1, 2, 2)[0] += np.array([x0, x1], np.float32)

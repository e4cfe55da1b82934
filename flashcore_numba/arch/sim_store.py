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

"""The simulator's 2^x: a Python version of ptx/exp2.ptx's `flashcore_exp2`.

`ex2.approx.ftz.f32` flushes a subnormal input to zero (2^0 = 1) and a subnormal result to
zero. NumPy's float32 exp2 is exact to rounding, closer than the hardware's 2 ulp: the
difference is far inside the reference oracle's tolerance, and the GPU tests run the real
instruction.
"""

from __future__ import annotations

import numpy as np

from .emulation import emulation

_SMALLEST_NORMAL = np.finfo(np.float32).tiny  # 2^-126


@emulation("flashcore_exp2")
def exp2(x):
    x = np.float32(x)
    if abs(x) < _SMALLEST_NORMAL:
        x = np.float32(0.0)
    with np.errstate(over="ignore", under="ignore"):
        y = np.exp2(x)
    return np.float32(0.0) if abs(y) < _SMALLEST_NORMAL else y

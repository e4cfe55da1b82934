"""The simulator's clock: a Python version of ptx/trace.ptx's `flashcore_globaltimer_lo`.

The GPU's %globaltimer counts nanoseconds, one count for every SM. The simulator counts the
host's monotonic clock in microseconds instead: a simulated launch takes seconds, and differences
of the low 32 bits are exact only within 2^31 ticks (2.1 s in nanoseconds, 36 minutes in
microseconds).
"""

from __future__ import annotations

import time

import numpy as np

from .emulation import emulation


@emulation("flashcore_globaltimer_lo")
def globaltimer_lo():
    return np.uint32((time.monotonic_ns() // 1000) & 0xFFFFFFFF)

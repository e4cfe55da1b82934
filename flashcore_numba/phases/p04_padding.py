"""Phase 04 — padding: a bank-conflict-free shared-memory layout.

What changed from phase 03
    One number: every row of the Q, K and P tiles in shared memory gets SMEM_PAD = 2 extra
    fp32 words, so a row is HEAD_DIM + 2 (or BLOCK_N + 2) words long. The kernel is phase 03's,
    built with the padded layout.

Why the hardware rewards it
    Shared memory is split into 32 banks of 4 bytes; word address w lives in bank w % 32, and
    a bank serves one word per cycle. When the 16 lanes of a group read column d of 16
    consecutive K rows, their addresses are r·HEAD_DIM + d. With HEAD_DIM = 64 every one of
    them is in bank d % 32: the hardware serializes the read into 16 passes. With rows of 66
    words the addresses are r·66 + d, banks (2r + d) % 32: 16 different banks, one pass.

    Why 2 and not 1: a pad of 1 already fixes the k reads, but the two row groups of a warp
    sit TM = 8 rows apart. When each writes its 16 consecutive p values, a pad of 1 shifts the
    second group by only 8 banks, so half of them still collide (2-way); a pad of 2 shifts it
    by 16 banks, exactly past the first group. `flashcore_numba.banks` computes these
    conflict degrees for any layout; ncu's `l1tex__data_bank_conflicts_pipe_lsu_mem_shared`
    counters measure them on the GPU.

    The cost is 2·(BLOCK_M + BLOCK_N + BLOCK_M) words of shared memory per block (1.5 KB).

Measured effect (written by `flashcore report` from the committed record; do not edit by hand)
    [measured:begin]
    not measured yet
    [measured:end]
"""

from __future__ import annotations

from functools import lru_cache

from ..common import KernelConfig
from .p03_warp_shuffle import build_kernel, layout

ID = "04"
NAME = "padding"
TITLE = "Padding: bank-conflict-free shared memory"
HEAD_DIMS = (64, 128)

SMEM_PAD = 0  # fp32 words added to each shared-memory row
# >>> exercise 04: pad each row so that lanes reading one column of a tile land in different banks
SMEM_PAD = 2  # shifts row r by 2r banks
# <<< exercise


def smem_layout(HEAD_DIM: int) -> dict:
    return layout(HEAD_DIM, smem_pad=SMEM_PAD)


@lru_cache(maxsize=None)
def build(HEAD_DIM: int) -> KernelConfig:
    return build_kernel(smem_layout(HEAD_DIM))

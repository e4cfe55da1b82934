"""Count shared-memory bank conflicts of the warp-tiled phases (03+) from their layout alone.

Shared memory has 32 banks, each 4 bytes wide: 32-bit word w lives in bank w % 32. When the
32 lanes of a warp access shared memory in one instruction, each bank serves one distinct
word per cycle (lanes reading the same word share it: a broadcast). The instruction takes as
many passes as the busiest bank has distinct words: its *conflict degree*, 1 when
conflict-free.

`warp_tile_conflicts(L)` evaluates the degree of every shared-memory access of the warp-tiled
kernel for a layout `L` (see `phases.p03_warp_shuffle.layout`), taking the worst case over the
loop indices. It needs no GPU; on one, ncu's shared-memory bank-conflict counters measure the
same thing.
"""

from __future__ import annotations

from collections import defaultdict

N_BANKS = 32


def conflict_degree(word_addresses) -> int:
    """Passes one warp-wide access needs: max over banks of the distinct words it holds."""
    words_per_bank = defaultdict(set)
    for w in word_addresses:
        words_per_bank[w % N_BANKS].add(w)
    return max(len(words) for words in words_per_bank.values())


def _lanes(L, warp=0):
    """(lane_row, lane_col) of each lane, as the warp-tiled kernel assigns them."""
    LPR = L["LANES_PER_ROW"]
    return [(warp * L["ROWS_PER_WARP"] + (lane // LPR) * L["TM"], lane % LPR) for lane in range(32)]


def warp_tile_conflicts(L) -> dict[str, int]:
    """Worst conflict degree of each shared-memory access of the warp-tiled kernel."""
    lanes = _lanes(L)
    LPR = L["LANES_PER_ROW"]
    Q_OFF, K_OFF, V_OFF, P_OFF = L["Q_OFF"], L["K_OFF"], L["V_OFF"], L["P_OFF"]
    QS, KS, VS, PS = L["Q_STRIDE"], L["K_STRIDE"], L["V_STRIDE"], L["P_STRIDE"]

    def worst(address_of_lane, loop):
        return max(conflict_degree([address_of_lane(r, c, x) for r, c in lanes]) for x in loop)

    D, TM, TN, TD, BN = L["HEAD_DIM"], L["TM"], L["TN"], L["TD"], L["BLOCK_N"]
    return {
        "q read (scores)": worst(lambda r, c, d: Q_OFF + r * QS + d, range(D)),
        "k read (scores)": max(worst(lambda r, c, d: K_OFF + (c + j * LPR) * KS + d, range(D))
                               for j in range(TN)),
        "p write (softmax)": max(worst(lambda r, c, i: P_OFF + (r + i) * PS + c + j * LPR, range(TM))
                                 for j in range(TN)),
        "p read (p·v)": worst(lambda r, c, j: P_OFF + r * PS + j, range(BN)),
        "v read (p·v)": max(worst(lambda r, c, j: V_OFF + j * VS + c + dd * LPR, range(BN))
                            for dd in range(TD)),
    }


def format_conflicts(conflicts: dict[str, int]) -> str:
    return "\n".join(f"{name:<20} {degree:>2}-way" + ("  (conflict-free)" if degree == 1 else "")
                     for name, degree in conflicts.items())

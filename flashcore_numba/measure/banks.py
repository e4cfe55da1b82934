"""Count shared-memory bank conflicts of the warp-tiled phases (03+) from their layout alone.

Shared memory has 32 banks, each 4 bytes wide: 32-bit word w lives in bank w % 32. A warp's
access is served in passes. For 4-byte accesses the 32 lanes form one group; for 16-byte
(vector) accesses the warp is served a quarter at a time, 8 lanes per group, each lane
touching 4 consecutive banks. Within a group, each bank delivers one distinct word per pass
(lanes reading the same word share it: a broadcast). The *conflict degree* of an access is
the number of passes its busiest group needs: 1 when conflict-free.

`warp_tile_conflicts(L)` evaluates the degree of every shared-memory access of the warp-tiled
kernel for a layout `L` (see `phases.p03_warp_shuffle.layout`), taking the worst case over the
loop indices. It needs no GPU; on one, ncu's shared-memory bank-conflict counters measure the
same thing.
"""

from __future__ import annotations

from collections import defaultdict

N_BANKS = 32
# The accesses inside the inner loops (executed HEAD_DIM or BLOCK_N times per tile). The p
# stores run TM*TN times per tile, a few percent of the traffic.
HOT_ACCESSES = ("q read (scores)", "k read (scores)", "p read (p·v)", "v read (p·v)")


def conflict_degree(word_addresses, width_words: int = 1) -> int:
    """Passes one warp-wide access needs; lane i accesses words a_i .. a_i + width_words - 1."""
    lanes_per_group = 32 // width_words
    worst = 1
    for g in range(0, len(word_addresses), lanes_per_group):
        words_per_bank = defaultdict(set)
        for a in word_addresses[g:g + lanes_per_group]:
            for w in range(a, a + width_words):
                words_per_bank[w % N_BANKS].add(w)
        worst = max(worst, max(len(words) for words in words_per_bank.values()))
    return worst


def _lanes(L, warp=0):
    """(lane_row, lane_col) of each lane of `warp`, by the kernel's own lane_position."""
    from ..phases.p03_warp_shuffle import lane_position

    return [lane_position(32 * warp + lane, L["ROWS_PER_WARP"], L["TM"], L["LANES_PER_ROW"])
            for lane in range(32)]


def warp_tile_conflicts(L) -> dict[str, int]:
    """Worst conflict degree of each shared-memory access of the warp-tiled kernel."""
    from ..phases.p03_warp_shuffle import acc_column

    lanes = _lanes(L)
    LPR, VEC = L["LANES_PER_ROW"], L["VEC"]
    Q_OFF, K_OFF, V_OFF, P_OFF = L["Q_OFF"], L["K_OFF"], L["V_OFF"], L["P_OFF"]
    QS, KS, VS, PS = L["Q_STRIDE"], L["K_STRIDE"], L["V_STRIDE"], L["P_STRIDE"]
    D, TM, TN, TD, BN = L["HEAD_DIM"], L["TM"], L["TN"], L["TD"], L["BLOCK_N"]

    def worst(address_of_lane, loop, width=1):
        return max(conflict_degree([address_of_lane(r, c, x) for r, c in lanes], width) for x in loop)

    return {
        "q read (scores)": max(worst(lambda r, c, d: Q_OFF + (r + i) * QS + d, range(0, D, VEC), VEC)
                               for i in range(TM)),
        "k read (scores)": max(worst(lambda r, c, d: K_OFF + (c + j * LPR) * KS + d, range(0, D, VEC), VEC)
                               for j in range(TN)),
        "p write (softmax)": max(worst(lambda r, c, i: P_OFF + (r + i) * PS + c + j * LPR, range(TM))
                                 for j in range(TN)),
        "p read (p·v)": max(worst(lambda r, c, j: P_OFF + (r + i) * PS + j, range(0, BN, VEC), VEC)
                            for i in range(TM)),
        "v read (p·v)": max(worst(lambda r, c, j: V_OFF + j * VS + acc_column(c, c4 * VEC, LPR), range(BN), VEC)
                            for c4 in range(TD // VEC)),
    }


def hot_loop_conflicts(L) -> int:
    """Worst conflict degree over the inner-loop accesses (1 = conflict-free)."""
    degrees = warp_tile_conflicts(L)
    return max(degrees[name] for name in HOT_ACCESSES)


def format_conflicts(conflicts: dict[str, int]) -> str:
    return "\n".join(f"{name:<20} {degree:>2}-way" + ("  (conflict-free)" if degree == 1 else "")
                     for name, degree in conflicts.items())

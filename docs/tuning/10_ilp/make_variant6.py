"""Writes p10v6.py beside this file: phase 10's module (as at commit 1fa10b2) with the merges
across blocks reading every partial they need before they write anything.

On the GPU's clock (trace_run.py, H200, B=1 H=32 H_kv=8 S_k=32768): the last block's merge ends
2.7 µs after the last member arrives. In the package's merge each row's log-sum-exps are one
loop iteration (4 a warp) and each thread's two columns another (8 a thread), and every
iteration ends in a store to global memory that the compiler must assume may alias the next
iteration's loads: so each iteration waits out its own round trip to L2. Here a warp first loads
the members' lse of all its rows, then merges them; and a thread first sums all of its columns'
members (every load in flight at once, no store between), then writes them."""
from pathlib import Path

here = Path(__file__).parent
src = (here / "../../../flashcore_numba/phases/p10_split_keys.py").read_text()
edits = [
    ("from ..arch import", "from flashcore_numba.arch import"),
    ("from ..arch.sim import", "from flashcore_numba.arch.sim import"),
    ("from .common import", "from flashcore_numba.phases.common import"),
    ("from .p07_mma_sync import", "from flashcore_numba.phases.p07_mma_sync import"),
    ("    PAIRS = HEAD_DIM // 2  # output columns are written two at a time (one packed 32-bit word)\n",
     "    PAIRS = HEAD_DIM // 2  # output columns are written two at a time (one packed 32-bit word)\n"
     "    ROWS_PER_WARP = (BLOCK_M + WARPS - 1) // WARPS  # a merge's rows of lse, a warp\n"
     "    ITEMS = (BLOCK_M * PAIRS + THREADS - 1) // THREADS  # a merge's pairs of columns, a thread\n"),
    ("""            for r in range(warp, n_rows, WARPS):
                row = out_row + r
                lse, w = merge_weights(LSE_PART[(first + lane) * stride, row] if lane < members
                                       else float32(-math.inf))
                if lane < FAN_IN:
                    weight[lane * BLOCK_M + r] = w
                if lane == 0:  # every lane has read the team's first lse: overwritten in place
                    put_lse(LSE, LSE_PART, lse, r, last_level, first * stride, out_row, b, h_kv * group, seq_q, row0)
            cuda.syncthreads()
""", """            lse_in = cuda.local.array(ROWS_PER_WARP, float32)  # every row's loads first
            for u in range(ROWS_PER_WARP):
                r = warp + u * WARPS
                lse_in[u] = LSE_PART[(first + lane) * stride, out_row + r] if lane < members and r < n_rows \\
                    else float32(-math.inf)
            for u in range(ROWS_PER_WARP):
                r = warp + u * WARPS
                if r < n_rows:
                    lse, w = merge_weights(lse_in[u])
                    if lane < FAN_IN:
                        weight[lane * BLOCK_M + r] = w
                    if lane == 0:
                        put_lse(LSE, LSE_PART, lse, r, last_level, first * stride, out_row, b, h_kv * group, seq_q,
                                row0)
            cuda.syncthreads()
"""),
    ("""            for idx in range(tid, n_rows * PAIRS, THREADS):
                r, col = idx // PAIRS, 2 * (idx % PAIRS)
                x, y = merge_members(O_PART, weight, first * stride, stride, members - 1, out_row + r, r, col)
                put_merged(O, O_PART, x, y, r, col, last_level, first * stride, out_row, b, h_kv * group, seq_q, row0)
""", """            xs = cuda.local.array(ITEMS, float32)  # every pair's sums first, then the stores
            ys = cuda.local.array(ITEMS, float32)
            for u in range(ITEMS):
                idx = tid + u * THREADS
                r, col = idx // PAIRS, 2 * (idx % PAIRS)
                if idx < n_rows * PAIRS:
                    xs[u], ys[u] = merge_members(O_PART, weight, first * stride, stride, members - 1, out_row + r, r,
                                                 col)
            for u in range(ITEMS):
                idx = tid + u * THREADS
                r, col = idx // PAIRS, 2 * (idx % PAIRS)
                if idx < n_rows * PAIRS:
                    put_merged(O, O_PART, xs[u], ys[u], r, col, last_level, first * stride, out_row, b, h_kv * group,
                               seq_q, row0)
"""),
]
for old, new in edits:
    assert src.count(old) == 1, old
    src = src.replace(old, new)
(here / "p10v6.py").write_text(src)

"""Per-block view of a four-warp trace (trace_run.py's .npy): rows are warps, in the order
((z * grid_y + y) * grid_x + x) * 4 + warp; columns start, first tile landed, key loop ended,
partial written, returned (ns from the first block's start)."""
import sys
import numpy as np
t = np.load(sys.argv[1]) / 1e3
end = t[:, 2].reshape(8, 16, 4)  # (K/V head, block of its 16, warp)
first = t[:, 1].reshape(8, 16, 4)
spread = end.max(2) - end.min(2)
print(f"loop end within a block (max - min over its 4 warps): median {np.median(spread):.1f} us, max {spread.max():.1f} us")
print("each block's mean loop end (us), a row per K/V head, the 16 blocks of its row tile:")
print(np.array2string(np.round(end.mean(2), 1), max_line_width=200))
print("each block's mean first tile landed (us):")
print(np.array2string(np.round(first.mean(2), 1), max_line_width=200))
blocks = end.mean(2).ravel()
early = blocks < np.median(blocks) - 5
print(f"blocks ending over 5 us before the median: {early.sum()} of {blocks.size}; "
      f"their mean {blocks[early].mean():.1f} us, the others' {blocks[~early].mean():.1f} us")

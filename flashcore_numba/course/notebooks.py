"""The lesson runtime: what a lesson notebook calls.

Every lesson is one file, `lessons/NN_<name>.py` in jupytext's "percent" format, paired with the
notebook `lessons/NN_<name>.ipynb` generated from it. All lessons follow one template (see
`course.lessons.TEMPLATE` and `flashcore lessons --new NN`): the idea and a diagram, the kernel
source, a correctness check, timing, the machine code, the exercise. The prose and the diagram
are the phase's own; everything that runs is here, written once, behind the `Lesson` class:

    lesson = Lesson("03")
    lesson.intro()          # where the kernels run: a GPU, or Numba's simulator on the CPU
    lesson.check()          # against flashcore_numba.reference on fresh random inputs
    timing = lesson.timing()  # live on a GPU; on a CPU read from the committed record
    lesson.plot_timing(timing)
    lesson.machine_code()   # registers, spills, shared memory, occupancy (measure.machine_code)
    lesson.ptx(["shfl.sync.bfly", "ex2.approx"])
    lesson.exercise()

The notebook itself chooses at run time where kernels run: `flashcore_numba.arch.sim.simulator_enabled()`.
Building, checking and running the notebooks is `flashcore lessons` (course/lessons.py).
"""

from __future__ import annotations

import difflib
import inspect
import math
import textwrap
from pathlib import Path

import numpy as np

from ..arch.sim import simulator_enabled
from ..measure.bench import REFERENCE_SHAPE  # the shape every timing in the course uses
from ..measure.records import checkout_root, repo_root
from ..phases import LESSONS, PHASES, VARIANTS, get_lesson, get_phase
from ..reference import check_close, default_scale, lowp_attention, random_qkv, reference_attention
from .exercises import exercise_module, find_regions, phase_source, region_bodies

# (B, H, S_q, S_k, D, causal) checked in the simulator, which runs one Python thread per CUDA thread:
# one block of query rows; 100 keys span two K/V tiles and end in a tail; then the causal triangle
SIM_PROBLEMS = ((1, 1, 40, 100, 64, False), (1, 1, 40, 40, 64, True))


# =============================================================================================
# Where things are
# =============================================================================================
def lessons_dir() -> Path:
    return repo_root("the lessons (lessons/)") / "lessons"


def lesson_stem(phase) -> str:
    """"03_warp_shuffle" for phase 03; "00_numba_cuda" for lesson 00 (course/puzzles.py), which has no phase."""
    phase = exercise_module(phase)
    return f"{phase.ID}_{phase.NAME}"


def lesson_path(phase, suffix: str = ".py") -> Path:
    return lessons_dir() / f"{lesson_stem(phase)}{suffix}"


def exercise_path(phase) -> Path:
    return lessons_dir() / "exercises" / f"{lesson_stem(phase)}.py"


def previous_phase(phase):
    """The phase before `phase` in the course (the ladder, then phase 11), or None for the first."""
    ids = sorted(LESSONS)
    i = ids.index(get_lesson(phase).ID)
    return LESSONS[ids[i - 1]] if i > 0 else None


# =============================================================================================
# Showing things: plain text that reads the same in a notebook, a terminal and on GitHub
# =============================================================================================
def _display(obj) -> None:
    try:
        from IPython.display import display

        display(obj)
    except ImportError:  # outside IPython
        print(obj)


def show_code(source: str, language: str = "python") -> None:
    """Source code, syntax-highlighted in a notebook (its plain-text form is the source itself)."""
    try:
        from IPython.display import Code

        _display(Code(source, language=language))
    except ImportError:
        print(source)


def table(rows, columns) -> str:
    """A fixed-width text table: `rows` are dicts, `columns` are (key, header) pairs."""
    cells = [[header for _, header in columns]]
    for row in rows:
        cells.append([_fmt(row.get(key)) for key, _ in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0 or math.isinf(value) or math.isnan(value):
            return f"{value:g}"
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def source_of(*objects) -> str:
    """Source of functions, classes or modules; a Numba dispatcher shows its Python function."""
    return "\n\n".join(inspect.getsource(getattr(o, "py_func", o)).rstrip() for o in objects)


# =============================================================================================
# Timing: through measure.bench, the one harness (live on a GPU, its committed records on a CPU)
# =============================================================================================
PEERS_SHOWN = ("sdpa_flash", "sdpa_cudnn")


def records_dir() -> Path:
    from ..measure.records import default_records_dir

    return default_records_dir()


def latest_record(directory=None) -> dict | None:
    """The record `flashcore report` shows: newest full ladder at the reference shape, non-causal first."""
    from ..measure.records import load_records
    from ..measure.report import ladder_records

    noncausal, causal = ladder_records(load_records(directory))
    return noncausal or causal


def latest_record_of(problem: dict, phase_id: str, directory=None) -> dict | None:
    """The newest record of `problem` (a phase's LESSON_PROBLEM: its config's fields) with a row
    for `phase_id`, or None."""
    from ..measure.records import load_records

    found = [r for r in load_records(directory) if "sweep" not in r
             and all(r["config"].get(key) == value for key, value in problem.items())
             and any(x["kind"] == "phase" and x["name"] == phase_id for x in r["results"])]
    return max(found, key=lambda r: r["created"]) if found else None


def measure(phase_ids, shape=REFERENCE_SHAPE, causal: bool = False, problem: dict | None = None) -> dict:
    """Benchmark phases and torch SDPA on this GPU with the full protocol; returns a record (not saved).
    `problem` (Problem's fields) replaces the shape: a phase that serves other shapes (phase 10)."""
    from ..measure.bench import Problem, run_benchmark

    problem = Problem(**problem) if problem else Problem.from_shape(shape, causal=causal)
    return run_benchmark(problem, phase_ids=list(phase_ids),
                         peer_names=PEERS_SHOWN, measure_ceiling=False,
                         command=["python", "-m", "flashcore_numba.course.notebooks",
                                  "(a lesson's timing cell)"])


def timing_rows(record: dict, phase_ids) -> list[dict]:
    """The record's rows for these phases and the SDPA peers, labelled for a table and a plot."""
    rows = []
    for r in record["results"]:
        if (r["kind"] == "phase" and r["name"] not in phase_ids) or (r["kind"] == "peer"
                                                                     and r["name"] not in PEERS_SHOWN):
            continue
        if r["kind"] == "phase":
            label = f"{r['name']} {get_phase(r['name']).NAME}"
        else:
            label = r["title"].replace("torch SDPA, ", "torch SDPA ").replace(" backend", "")
        note = "" if r.get("tflops") else (r.get("reason") or r.get("message") or "not timed")
        rows.append({"name": label, "phase": r["name"] if r["kind"] == "phase" else None,
                     "peer": r["kind"] == "peer", "median_ms": r.get("median_ms"), "tflops": r.get("tflops"),
                     "note": note})
    return rows


def _describe_shape(config: dict) -> str:
    causal = config.get("causal")
    if config["S_q"] == config["S_k"]:
        S, flops = f"S={config['S_q']}", f"4·B·H·S²·D{'/2' if causal else ''}"
    else:
        S, flops = f"S_q={config['S_q']} S_k={config['S_k']}", "4·B·H·S_q·S_k·D (less the masked pairs)"
    kv = f" H_kv={config['H_kv']}" if config.get("H_kv") else ""
    return (f"B={config['B']} H={config['H']}{kv} {S} D={config['D']} {config.get('dtype', 'float16')}, "
            f"{'causal' if causal else 'not causal'}; TFLOPS = {flops} / median time")


def display_path(path) -> str:
    if path is None:
        return "the benchmark record"
    root = checkout_root()
    try:
        return str(Path(path).resolve().relative_to(root)) if root else str(path)
    except ValueError:
        return str(path)


# =============================================================================================
# Diagrams
# =============================================================================================
def _plt():
    import matplotlib.pyplot as plt

    return plt


def draw_memory_hierarchy():
    """The H100's memory hierarchy as nested boxes: size, latency and bandwidth (rough figures)."""
    plt = _plt()
    from matplotlib.patches import FancyBboxPatch

    levels = [
        ("registers", "64K × 32-bit per SM (256 KB)", "~1 cycle", "feeds the FP32 units directly", "#4c72b0"),
        ("shared memory / L1", "up to 228 KB shared per SM", "~30 cycles", "~32 TB/s over 132 SMs",
         "#55a868"),
        ("L2 cache", "50 MB, shared by all SMs", "~250 cycles", "several TB/s", "#dd8452"),
        ("HBM3 (global memory)", "80 GB", "~500-800 cycles", "3.35 TB/s", "#c44e52"),
    ]
    _, ax = plt.subplots(figsize=(9, 3.6))
    for i, (name, size, latency, bw, color) in enumerate(levels):
        width = 0.4 + 0.2 * i
        x = (1.6 - width) / 2
        y = 3 - i
        ax.add_patch(FancyBboxPatch((x, y + 0.08), width, 0.84, boxstyle="round,pad=0.01", color=color,
                                    alpha=0.85))
        ax.text(0.8, y + 0.6, name, ha="center", va="center", color="white", fontsize=11, weight="bold")
        ax.text(0.8, y + 0.3, size, ha="center", va="center", color="white", fontsize=9)
        ax.text(1.7, y + 0.5, f"{latency}   ·   {bw}", ha="left", va="center", fontsize=10)
    ax.text(1.7, 4.15, "latency   ·   bandwidth", ha="left", fontsize=10, style="italic")
    ax.set_xlim(0, 3.2)
    ax.set_ylim(0, 4.4)
    ax.axis("off")
    ax.set_title("Closer to the cores = smaller, faster (rough H100 figures; see docs/hardware.md)")
    plt.show()


def draw_warp_tile(L):
    """Which lane of warp 0 computes which score of the warp's ROWS_PER_WARP × BLOCK_N tile."""
    plt = _plt()
    rows, cols = L["ROWS_PER_WARP"], L["BLOCK_N"]
    lpr, tm = L["LANES_PER_ROW"], L["TM"]
    owner = np.zeros((rows, cols), dtype=int)
    for lane in range(32):
        r0 = (lane // lpr) * tm
        c = lane % lpr
        for i in range(tm):
            for j in range(L["TN"]):
                owner[r0 + i, c + j * lpr] = lane
    _, ax = plt.subplots(figsize=(11, 3.4))
    ax.imshow(owner, cmap="tab20", aspect="auto", interpolation="nearest")
    for (r, c), lane in np.ndenumerate(owner):
        ax.text(c, r, str(lane), ha="center", va="center", fontsize=5.5)
    ax.set_xlabel(f"key j in the tile (BLOCK_N = {cols}); lane owns keys lane_col + j·{lpr}")
    ax.set_ylabel(f"query row (warp 0: {rows} rows)")
    ax.set_title(f"Warp 0's scores: each number is the lane that computes it (TM = {tm} rows × "
                 f"TN = {L['TN']} keys per lane)")
    plt.show()


def draw_bank_map(layouts):
    """Banks hit by the lanes that read K in one pass (column 0 of rows 0, 1, 2 ...), per layout.

    A lane reads `VEC` consecutive words per instruction (1, or 4 for 16-byte loads). A warp's
    access is served 32 / VEC lanes at a time; the picture shows the first such group.
    """
    plt = _plt()
    from ..measure.banks import N_BANKS, warp_tile_conflicts

    _, axes = plt.subplots(1, len(layouts), figsize=(5.5 * len(layouts), 3.6), squeeze=False)
    for ax, (title, L) in zip(axes[0], layouts):
        width = L.get("VEC", 1)
        lanes = min(L["LANES_PER_ROW"], 32 // width)
        grid = np.zeros((lanes, N_BANKS))
        for lane in range(lanes):  # lane c reads k[c][0 : width]
            for w in range(width):
                grid[lane, (L["K_OFF"] + lane * L["K_STRIDE"] + w) % N_BANKS] = 1
        ax.imshow(grid, cmap="Greens", aspect="auto", vmin=0, vmax=1.3)
        load = grid.sum(axis=0)
        for bank in range(N_BANKS):
            if load[bank] > 1:
                ax.text(bank, -0.9, f"{int(load[bank])}×", ha="center", color="#c44e52", fontsize=9,
                        weight="bold")
        degree = warp_tile_conflicts(L)["k read (scores)"]
        access = "one 4-byte word" if width == 1 else f"{4 * width} bytes ({width} banks)"
        ax.set_xlabel("bank (word address mod 32)")
        ax.set_ylabel("lane c, reading row c of K")
        ax.set_title(f"{title}: row stride {L['K_STRIDE']} words\n"
                     f"each lane reads {access}; "
                     f"{degree} pass{'es' if degree > 1 else ''}", fontsize=10)
        ax.set_ylim(lanes - 0.5, -1.5)
    plt.tight_layout()
    plt.show()


def with_pad(L: dict, pad: int) -> dict:
    """Layout `L` of a warp-tiled phase rebuilt with another row padding (the rest unchanged).

    `p03_warp_shuffle.layout` takes its parameters by the names of the keys it returns
    (HEAD_DIM, block_m -> BLOCK_M, ...), so they are read back from L.
    """
    from ..phases.p03_warp_shuffle import layout

    args = {}
    for name in inspect.signature(layout).parameters:
        if name == "smem_pad":
            args[name] = pad
        elif name.upper() in L:
            args[name] = L[name.upper()]
    return layout(**args)


def pad_sweep(L: dict, pads=range(9)) -> None:
    """Conflict degree of every shared-memory access of layout `L`, for each row padding it allows."""
    from ..measure.banks import warp_tile_conflicts

    rows, refused = [], {}
    for pad in pads:
        try:
            padded = with_pad(L, pad)
        except AssertionError as exc:  # the layout refuses this pad (e.g. it breaks 16-byte alignment)
            refused.setdefault(str(exc), []).append(str(pad))
            continue
        conflicts = warp_tile_conflicts(padded)
        rows.append({"pad": pad, **conflicts, "smem": padded["SMEM_FLOATS"] * 4,
                     "note": "conflict-free" if max(conflicts.values()) == 1 else ""})
    names = [k for k in rows[0] if k not in ("pad", "smem", "note")]
    print(f"Passes each warp-wide access needs (1 = conflict-free), per padding of the tile rows "
          f"(head dim {L['HEAD_DIM']}):")
    columns = [("pad", "pad (words)"), *((n, n) for n in names), ("smem", "smem bytes"), ("note", "")]
    print(table(rows, columns))
    for why, which in refused.items():
        print(f"pads {', '.join(which)}: not allowed ({why})")


def draw_pipeline(n_tiles: int = 4):
    """Schematic timeline: load-then-compute (phase 04) against prefetch-while-computing (phase 05)."""
    plt = _plt()
    load, compute = 1.0, 1.6
    _, ax = plt.subplots(figsize=(10, 2.6))
    t = 0.0
    for j in range(n_tiles):  # phase 04: wait for the tile, then compute on it
        ax.broken_barh([(t, load)], (1.6, 0.6), color="#c44e52")
        ax.text(t + load / 2, 1.9, f"load {j}", ha="center", va="center", color="white", fontsize=8)
        ax.broken_barh([(t + load, compute)], (1.6, 0.6), color="#4c72b0")
        ax.text(t + load + compute / 2, 1.9, f"compute {j}", ha="center", va="center", color="white",
                fontsize=8)
        t += load + compute
    end04 = t
    ax.broken_barh([(0, load)], (0.2, 0.6), color="#c44e52")  # phase 05: only tile 0 is waited for
    ax.text(load / 2, 0.5, "load 0", ha="center", va="center", color="white", fontsize=8)
    t = load
    for j in range(n_tiles):
        ax.broken_barh([(t, compute)], (0.2, 0.6), color="#4c72b0")
        ax.text(t + compute / 2, 0.5, f"compute {j}", ha="center", va="center", color="white", fontsize=8)
        if j + 1 < n_tiles:
            ax.broken_barh([(t + 0.1, load)], (0.85, 0.25), color="#c44e52", alpha=0.6)
            ax.text(t + 0.1 + load / 2, 0.975, f"load {j + 1}", ha="center", va="center", fontsize=6.5)
        t += compute
    ax.set_yticks([0.5, 1.9], ["phase 05: prefetch", "phase 04: load, wait"])
    ax.set_xlabel(f"time (schematic): {end04:.1f} vs {t:.1f} units for {n_tiles} tiles")
    ax.set_xlim(0, end04 + 0.2)
    ax.set_ylim(0, 2.4)
    ax.set_title("Double buffering hides the load of tile j+1 behind the arithmetic of tile j")
    plt.show()


def mma_accumulator_owner(rows: int = 16, cols: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """(lane, register index) of each element of an `mma.m16n8k16` fp32 accumulator (C/D) fragment.

    The layout the PTX ISA documents: lane = 4·group + t (group = lane // 4, t = lane % 4) holds
    c0, c1 at row group, columns 2t and 2t+1, and c2, c3 at row group + 8, the same columns.
    """
    lane = np.zeros((rows, cols), dtype=int)
    reg = np.zeros((rows, cols), dtype=int)
    for ln in range(32):
        group, t = ln // 4, ln % 4
        for i in range(4):
            r, c = group + 8 * (i // 2), 2 * t + i % 2
            lane[r, c], reg[r, c] = ln, i
    return lane, reg


def mma_operand_owner(operand: str) -> tuple[np.ndarray, np.ndarray]:
    """(lane, register) of each element of an `mma.m16n8k16` operand: "A" (16×16), "B" (16×8, k × n)
    or "C" (16×8), as the PTX ISA documents them (g = lane // 4, t = lane % 4)."""
    if operand == "C":
        return mma_accumulator_owner()
    shape = (16, 16) if operand == "A" else (16, 8)
    lane, reg = np.zeros(shape, dtype=int), np.zeros(shape, dtype=int)
    for ln in range(32):
        g, t = ln // 4, ln % 4
        for i in range(4 if operand == "A" else 2):
            for half in range(2):
                if operand == "A":  # a0: (g, 2t) a1: (g+8, 2t) a2: (g, 2t+8) a3: (g+8, 2t+8)
                    r, c = g + 8 * (i % 2), 2 * t + half + 8 * (i // 2)
                else:  # b0: (k=2t, n=g) b1: (k=2t+8, n=g)
                    r, c = 2 * t + half + 8 * i, g
                lane[r, c], reg[r, c] = ln, i
    return lane, reg


def swizzled_chunk(row: int, chunk: int) -> int:
    """Where the 128-byte swizzle stores 16-byte chunk `chunk` of row `row`: chunk ^ (row % 8)."""
    return chunk ^ (row % 8)


def draw_swizzle(rows: int = 16):
    """The 128-byte swizzle of ptx/wgmma.ptx: each 128-byte row of a tile holds eight 16-byte chunks
    (8 fp16 of d); row r stores its chunk c at position c ^ (r % 8). Left the plain layout, right the
    swizzled one; the colour and number of a cell is the chunk it holds."""
    plt = _plt()
    _, axes = plt.subplots(1, 2, figsize=(12, 6))
    plain = np.tile(np.arange(8), (rows, 1))
    swizzled = np.array([[swizzled_chunk(r, p) for p in range(8)] for r in range(rows)])  # XOR is its own inverse
    for ax, grid, title in [(axes[0], plain, ("plain: chunk c of every row at position c\n"
                                             "(eight rows' chunk 0 in the same 4 banks: an 8-way conflict)")),
                            (axes[1], swizzled, ("128-byte swizzle: chunk c of row r at position c ^ (r % 8)\n"
                                                "(eight rows' chunk 0 in eight different bank groups)"))]:
        ax.imshow(grid, cmap="tab10", aspect="auto", interpolation="nearest", alpha=0.6)
        for (r, p), c in np.ndenumerate(grid):
            ax.text(p, r, str(c), ha="center", va="center", fontsize=8)
        ax.set_xticks(range(8), [f"{16 * p}" for p in range(8)])
        ax.set_xlabel("byte position in the 128-byte row (16-byte chunks: 4 banks each)")
        ax.set_ylabel("row (query or key)")
        ax.set_title(title, fontsize=9)
    plt.suptitle("A 64-column atom of an fp16 tile in shared memory: which chunk of d sits where", fontsize=10)
    plt.tight_layout()
    plt.show()


def draw_warpgroup_rows():
    """Which warp of a warpgroup holds which rows of a 64-row wgmma accumulator, and which
    registers of a lane hold which columns (mma.sync's C layout, repeated per 8-column block)."""
    plt = _plt()
    _, ax = plt.subplots(figsize=(12, 4.5))
    owner = np.repeat(np.arange(4), 16)[:, None] * np.ones((1, 64), int)
    ax.imshow(owner, cmap="Pastel1", aspect="auto", interpolation="nearest")
    for w in range(4):
        ax.text(31.5, 16 * w + 7.5, f"warp {w}: rows {16 * w}-{16 * w + 15}; lane (g, t) holds rows "
                f"{16 * w}+g and {16 * w}+g+8, columns 8j+2t and 8j+2t+1 in registers 4j .. 4j+3",
                ha="center", va="center", fontsize=8)
    ax.set_xlabel("column of S (key) or of O (d)")
    ax.set_ylabel("row (query)")
    ax.set_title("The accumulator of one wgmma m64nNk16: four warps, each mma.sync's C layout on its 16 rows")
    plt.show()


def draw_warp_specialization(n_tiles: int = 5, gemm: float = 0.8, softmax: float = 1.3, load: float = 1.2):
    """Schematic timelines of phase 09 (two consumers), without and with the overlap inside a
    warpgroup: the producer's TMA loads into the ring, the consumers taking turns at the tensor
    cores (S = Q·Kᵀ of tile n, P·V of tile n-1), and their softmax. Bottom row of each: what the
    tensor cores run. `gemm` is one product's time, `softmax` one tile's softmax."""
    plt = _plt()
    _, axes = plt.subplots(2, 1, figsize=(12, 6.4), sharex=True)
    colors = {"load": "#c44e52", "S": "#4c72b0", "PV": "#8172b2", "softmax": "#55a868", "wait": "#cccccc"}
    y = {"producer": 3.0, "consumer 0": 2.0, "consumer 1": 1.0, "tensor cores": 0.0}
    ends = []
    for ax, overlap in zip(axes, (False, True)):
        def bar(row, start, length, kind, text, ax=ax):
            ax.broken_barh([(start, length)], (y[row] + 0.15, 0.7), color=colors[kind])
            ax.text(start + length / 2, y[row] + 0.5, text, ha="center", va="center", color="white", fontsize=7)

        for n in range(n_tiles + 2):  # the producer runs ahead, limited by the ring, not by the consumers
            bar("producer", n * load * 0.55, load * 0.5, "load", f"K,V {n}")
        cores = 0.0  # when the tensor cores are next free
        turn = 0.0  # when the next consumer may take its turn (issue its products)
        ready = {0: load, 1: load}  # when each consumer can take its next turn
        for n in range(n_tiles):
            for c in (0, 1):
                row = f"consumer {c}"
                start = max(turn, ready[c])
                first = max(start, cores)
                if overlap or n == 0:  # S first, P·V of the previous tile queued behind it
                    s_end = first + gemm
                    pv_end = s_end + (gemm if n > 0 else 0.0)
                    pv_start = s_end
                else:  # 09-turns runs P·V first (the other order spilled), then S
                    pv_start, pv_end = first, first + gemm
                    s_end = pv_end + gemm
                bar("tensor cores", s_end - gemm, gemm, "S", f"S{n} c{c}")
                if n > 0:
                    bar("tensor cores", pv_start, gemm, "PV", f"PV{n - 1} c{c}")
                cores = max(s_end, pv_end)
                pv_end = cores if not overlap else pv_end
                if overlap:  # issue both, wait for S only, softmax while P·V runs
                    turn = start + 0.05
                    bar(row, start, s_end - start, "wait", f"S{n}")
                    bar(row, s_end, softmax, "softmax", f"softmax {n}")
                    ready[c] = max(s_end + softmax, pv_end)
                else:  # wait for both products, then the softmax
                    turn = pv_end
                    bar(row, start, pv_end - start, "wait", f"S{n}" if n == 0 else f"PV{n - 1} + S{n}")
                    bar(row, pv_end, softmax, "softmax", f"softmax {n}")
                    ready[c] = pv_end + softmax
        ends.append(max(ready.values()))
        ax.set_yticks([v + 0.5 for v in y.values()], list(y))
        title = ("with the overlap (09-overlap, 09): S awaited alone, P·V of the previous tile runs under the softmax"
                 if overlap else "turns without the overlap (09-turns): both products awaited, then the softmax")
        ax.set_title(f"{title}; done at {ends[-1]:.1f}", fontsize=9)
    axes[1].set_xlim(0, max(ends) + 0.2)
    axes[1].set_xlabel("time (schematic, not measured)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[k]) for k in colors]
    axes[0].legend(handles, ["TMA load (one thread)", "S = Q·Kᵀ", "P·V", "softmax (FP32 + exp2)",
                             "consumer waiting on its products"], loc="upper right", fontsize=7, ncol=5)
    plt.suptitle("Phase 09: a TMA producer fills the ring; two consumer warpgroups take turns at the tensor cores")
    plt.tight_layout()
    plt.show()


def decode_blocks(shape, kv_heads: int, seq_k: int, sms: int = 132) -> list[dict]:
    """How many blocks each tensor-core phase launches for one decode step, against the SMs of
    an H100 (132): phases 07 and 09 one per 128 query rows per head (their H100 tiles), phase 10
    one per 16 packed rows per K/V head and per share of the keys, four warps each on a range of
    it (its split rule with an H100's SMs and shared memory). Nothing is launched."""
    from ..phases import p10_split_keys as p10
    from ..phases.common import H100_SM_LIMITS, blocks_per_sm, cdiv

    B, H, S_q, D = shape
    rows = []
    for pid in ("07", "09"):
        blocks = cdiv(S_q, 128) * H * B  # 07's grid, and 09's units of 128 rows
        rows.append({"phase": pid, "block_m": 128, "blocks": blocks, "rows used": f"{S_q} of 128",
                     "reads of each K/V head": H // kv_heads})
    L = p10.gpu_layout(D)
    row_tiles = cdiv(H // kv_heads * S_q, p10.BLOCK_M)
    splits = p10.split_count(B * kv_heads * row_tiles, cdiv(seq_k, L["BLOCK_N"]),
                             sms * blocks_per_sm(p10.smem_size(L, p10.WARPS), H100_SM_LIMITS), warps=p10.WARPS)
    rows.append({"phase": "10", "block_m": p10.BLOCK_M, "blocks": B * kv_heads * row_tiles * splits,
                 "rows used": f"{H // kv_heads * S_q} of 16", "reads of each K/V head": 1})
    for r in rows:
        r["SMs busy"] = f"{min(r['blocks'], sms)} of {sms}"
    return rows


def draw_split_keys(n_splits: int = 4, n_tiles: int = 12):
    """Phase 10 for one (batch, K/V head, row tile): the keys cut into n_splits ranges of whole
    tiles (32 keys at D = 128), each a warp that ends with a partial output and its log-sum-exp; the
    block merges its warps' partials, and the last block to finish the blocks' (the order does not
    matter: the merge is associative)."""
    plt = _plt()
    _, ax = plt.subplots(figsize=(12, 3.8))
    colors = ["#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974", "#64b5cd"]
    per = -(-n_tiles // n_splits)
    for s in range(n_splits):
        first, last = s * per, min(n_tiles, (s + 1) * per)
        color = colors[s % len(colors)]
        for tile in range(first, last):
            ax.add_patch(plt.Rectangle((tile, 3), 0.92, 0.8, color=color, alpha=0.8))
        middle = (first + last) / 2
        ax.text(middle, 4.15, f"range {s} (a warp): keys {first * 32}..{last * 32 - 1}", ha="center", fontsize=8)
        ax.annotate("", xy=(middle, 1.9), xytext=(middle, 2.9), arrowprops=dict(arrowstyle="->", color=color))
        ax.text(middle, 1.45, f"o_{s} = acc / l_i\nlse_{s} = m_i + log2 l_i", ha="center", va="center", fontsize=8,
                bbox=dict(boxstyle="round", fc="white", ec=color))
        ax.annotate("", xy=(n_tiles / 2, -0.25), xytext=(middle, 0.9), arrowprops=dict(arrowstyle="->", color="#888"))
    ax.text(n_tiles / 2, -0.8, "the block, its warps (then the last block to finish, the blocks):  "
            "lse = log2 Σ_s 2^lse_s,   o = Σ_s 2^(lse_s - lse) · o_s", ha="center", va="center", fontsize=9,
            bbox=dict(boxstyle="round", fc="#f3f3f3", ec="#888"))
    ax.text(-0.3, 3.4, "K, V\ntiles", ha="right", va="center", fontsize=8)
    ax.set_xlim(-1.5, n_tiles + 0.5)
    ax.set_ylim(-1.3, 4.6)
    ax.axis("off")
    ax.set_title("Phase 10: one query row tile, its keys split across the warps of a block, merged by their log-sum-exp")
    plt.show()


def draw_backward_loops(n_rows: int = 8, n_keys: int = 8):
    """Phase 11's two ways through the (query tile x key block) grid of S, both kv_kernel's: by
    default a block per column of key blocks walks down the query tiles (dK, dV summed in its
    registers; each tile's share of dQ added by atomics, every block to the same rows at once);
    with deterministic=True one block takes the columns in turn, so the additions to each element
    of dQ come one after another, in the same order every run."""
    plt = _plt()
    _, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, by_keys in zip(axes, (True, False)):
        for i in range(n_rows):
            for j in range(n_keys):
                mine = (j == 2) if by_keys else True
                ax.add_patch(plt.Rectangle((j, n_rows - 1 - i), 0.92, 0.92, color="#4c72b0" if mine else "#dddddd",
                                           alpha=0.85 if by_keys else (0.25 + 0.6 * (n_keys - j) / n_keys)))
        if by_keys:
            ax.annotate("", xy=(2.46, -0.4), xytext=(2.46, n_rows + 0.2), arrowprops=dict(arrowstyle="->", lw=1.6))
            ax.text(2.46, n_rows + 0.45, "one block: its keys' K, V stay in shared memory", ha="center", fontsize=8)
            for i in range(n_rows):
                ax.annotate("", xy=(-0.35, n_rows - 0.54 - i), xytext=(1.9, n_rows - 0.54 - i),
                            arrowprops=dict(arrowstyle="->", color="#c44e52", lw=0.8))
            ax.text(-0.45, n_rows / 2, "dQ += scale · dS K\n(float32 atomics:\nevery key block\nadds to every\nquery row)",
                    ha="right", va="center", fontsize=8, color="#c44e52")
            ax.text(n_keys / 2, -1.0, "dV += Pᵀ dO and dK += scale · dSᵀ Q stay in registers", ha="center", fontsize=9)
            ax.set_title("kv_kernel: a block per key block, query tiles stream past", fontsize=10)
        else:
            for j in range(n_keys):
                ax.text(j + 0.46, n_rows - 0.54, str(j + 1), ha="center", va="center", fontsize=8, color="white")
            ax.annotate("", xy=(n_keys + 0.2, n_rows + 0.45), xytext=(-0.2, n_rows + 0.45),
                        arrowprops=dict(arrowstyle="->", lw=1.6))
            ax.text(n_keys / 2, -1.0, "one block takes the key blocks in turn (1, 2, 3, ...): each element of dQ\n"
                    "is added to by one thread, in the same order every run: bit-identical", ha="center", fontsize=9)
            ax.set_title("kv_kernel, deterministic=True: a block per (batch, K/V head), key blocks in turn", fontsize=10)
        ax.text(n_keys / 2, n_rows + 1.1, "key blocks →", ha="center", fontsize=8)
        ax.text(-0.3 if not by_keys else n_keys + 0.3, n_rows / 2, "query\ntiles\n↓", ha="right" if not by_keys else "left",
                va="center", fontsize=8)
        ax.set_xlim(-3.2 if by_keys else -1.2, n_keys + 1.2)
        ax.set_ylim(-1.5, n_rows + 1.5)
        ax.set_aspect("equal")
        ax.axis("off")
    plt.tight_layout()
    plt.show()


def draw_wgmma_backward(block_m: int = 128, head_dim: int = 64):
    """Phase 12's block at D = 64: who computes what of one query tile. Left, Sᵀ (and dPᵀ, Pᵀ, dSᵀ):
    128 keys by BLOCK_M query rows, a band of 64 keys per warpgroup, 16 per warp, each band one
    wgmma call; right, the tile's dQ (BLOCK_M query rows by D), a 64 x 64 piece per warpgroup, each
    summed over all 128 keys (dSᵀ of both warpgroups, from shared memory)."""
    plt = _plt()
    _, axes = plt.subplots(1, 2, figsize=(12, 5.2), gridspec_kw={"width_ratios": [block_m, head_dim]})
    colors = ("#4c72b0", "#dd8452")
    ax = axes[0]
    for wg in range(2):
        for w in range(4):
            top = 128 - (64 * wg + 16 * w)
            ax.add_patch(plt.Rectangle((0, top - 16), block_m, 15.4, color=colors[wg], alpha=0.35 + 0.12 * w))
            ax.text(block_m / 2, top - 8, f"warpgroup {wg}, warp {w}: keys {64 * wg + 16 * w}-{64 * wg + 16 * w + 15}",
                    ha="center", va="center", fontsize=8)
    ax.set_xlim(0, block_m)
    ax.set_ylim(0, 128)
    ax.set_xlabel(f"query row of the tile (0-{block_m - 1})")
    ax.set_ylabel("key of the block (0 at the top)")
    ax.set_yticks([])
    ax.set_title("Sᵀ = K Qᵀ, dPᵀ = V dOᵀ (then Pᵀ, dSᵀ; dV, dK over the rows):\none wgmma per warpgroup, "
                 "B = the query tile, read once for 4 warps", fontsize=9)
    ax = axes[1]
    pieces = [(r, c) for r in range(block_m // 64) for c in range(head_dim // 64)]
    for p, (r, c) in enumerate(pieces):
        wg = p % 2
        ax.add_patch(plt.Rectangle((64 * c, block_m - 64 * (r + 1)), 63.4, 63.4, color=colors[wg], alpha=0.55))
        ax.text(64 * c + 32, block_m - 64 * r - 32, f"warpgroup {wg}\ndq, dq_acc:\nall 128 keys\n(dSᵀ of both)",
                ha="center", va="center", fontsize=8)
    ax.set_xlim(0, head_dim)
    ax.set_ylim(0, block_m)
    ax.set_xlabel(f"column of dQ (d, 0-{head_dim - 1})")
    ax.set_ylabel("query row of the tile (0 at the top)")
    ax.set_yticks([])
    ax.set_title("dQ = dS K: a 64 x 64 piece per warpgroup,\nadded to dQ in global memory by red", fontsize=9)
    plt.tight_layout()
    plt.show()



def draw_backward_ring(n_tiles: int = 4, load: float = 1.0, products: float = 1.6, dq: float = 0.8):
    """Schematic timelines of one block of the backward over n_tiles query tiles: phase 12, where
    every thread copies the next tile (cp.async) and the block meets before reading it, and phase
    13, where a producer's TMA loads run ahead into a ring of two stages and the consumers release a
    stage once dK's product has read it (before dQ). `products` is one tile's Sᵀ, dPᵀ, the
    elementwise step and dV, dK; `dq` its dSᵀ stores and dQ. Not measured: the shape of the
    schedule, not its lengths."""
    plt = _plt()
    _, axes = plt.subplots(2, 1, figsize=(12, 5.4), sharex=True)
    colors = {"load": "#c44e52", "tile": "#4c72b0", "dq": "#8172b2", "wait": "#cccccc"}
    ends = []

    def bar(ax, y, start, length, kind, text):
        ax.broken_barh([(start, length)], (y + 0.15, 0.7), color=colors[kind])
        ax.text(start + length / 2, y + 0.5, text, ha="center", va="center", color="white", fontsize=7)

    # phase 12: the copy of tile n + 1 is issued with tile n's work, but every thread waits for it
    # (and the block barrier) before tile n + 1's products; the copies take issue slots of the warps
    ax, t = axes[0], 0.0
    bar(ax, 1, t, load, "load", "copy Q,dO 0")
    t += load
    for n in range(n_tiles):
        issue = 0.25 * load if n + 1 < n_tiles else 0.0  # the threads' own cp.async instructions
        if issue:
            bar(ax, 1, t, issue, "load", "")
        bar(ax, 1, t + issue, products, "tile", f"Sᵀ,dPᵀ,dV,dK {n}")
        bar(ax, 1, t + issue + products, dq, "dq", f"dQ {n}")
        t += issue + products + dq
        if n + 1 < n_tiles:
            waited = max(0.0, load - products - dq)  # the copy not yet landed: wait, then the block barrier
            bar(ax, 1, t, waited + 0.15, "wait", "")
            t += waited + 0.15
    ends.append(t)
    ax.set_yticks([1.5], ["both warpgroups"])
    ax.set_title(f"phase 12: every thread copies, waits for its copies, meets the block; done at {t:.1f}", fontsize=9)

    # phase 13: stage s is refilled once the consumers released its last tile (after dK's product)
    ax = axes[1]
    loaded, released, t = [], [], 0.0
    for n in range(n_tiles):
        # the producer: stage n % 2 is free once tile n - 2 was released; one thread issues in order
        start = max(released[n - 2] if n >= 2 else 0.0, loaded[-1] if loaded else 0.0)
        bar(ax, 2, start, load, "load", f"{n} → stage {n % 2}")
        loaded.append(start + load)
        # the consumers: wait for the tile's bytes (full), compute, release the stage (empty), then dQ
        begin = max(t, loaded[n])
        if begin > t:
            bar(ax, 1, t, begin - t, "wait", "")
        bar(ax, 1, begin, products, "tile", f"Sᵀ,dPᵀ,dV,dK {n}")
        released.append(begin + products)
        bar(ax, 1, begin + products, dq, "dq", f"dQ {n}")
        t = begin + products + dq
    ends.append(t)
    ax.set_yticks([2.5, 1.5], ["producer (1 thread)", "consumers"])
    ax.set_title(f"phase 13: TMA loads into a ring of 2 stages, released after dK's product; done at {t:.1f}",
                 fontsize=9)
    axes[1].set_xlim(0, max(ends) + 0.2)
    axes[1].set_xlabel("time (schematic, not measured)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[k]) for k in colors]
    axes[0].legend(handles, ["loads of Q and dO", "products and the elementwise step", "dSᵀ and dQ", "waiting"],
                   loc="upper right", fontsize=7, ncol=4)
    plt.tight_layout()
    plt.show()


def draw_block_masks(masks: dict, seq: int = 256, block: int = 32):
    """Each mask (name -> flex.MaskMod) over seq rows and keys of batch 0, head 0: the elements a row
    sees in black, over its tiles of block x block coloured by kind (flex.create_block_mask): empty
    (the kernel skips it), partial (mask_mod per element), full (no mask_mod call). Under each, the
    share of tiles the kernel visits: the share of the work it does."""
    from .. import flex

    plt = _plt()
    colors = {flex.EMPTY: (1.0, 1.0, 1.0), flex.PARTIAL: (0.87, 0.52, 0.32), flex.FULL: (0.3, 0.45, 0.69)}
    _, axes = plt.subplots(1, len(masks), figsize=(3.6 * len(masks), 3.9), squeeze=False)
    for ax, (name, mask) in zip(axes[0], masks.items()):
        kinds = flex.create_block_mask(mask, None, None, seq, seq, block, block).kinds[0, 0]
        tiles = np.array([[colors[int(kind)] for kind in row] for row in kinds])
        ax.imshow(tiles, extent=(0, seq, seq, 0), interpolation="nearest")
        seen = flex.mask_matrix(mask, 0, 0, seq, seq)
        ax.imshow(np.where(seen[..., None], 0.0, 1.0) * np.ones(3), extent=(0, seq, seq, 0), alpha=0.35,
                  interpolation="nearest")
        for edge in range(0, seq + 1, block):
            ax.axhline(edge, color="#888888", lw=0.4)
            ax.axvline(edge, color="#888888", lw=0.4)
        visited = float(np.mean(kinds != flex.EMPTY))
        partial = float(np.mean(kinds == flex.PARTIAL))
        ax.set_title(f"{name}\n{visited:.0%} of the tiles visited, {partial:.0%} partial", fontsize=9)
        ax.set_xlabel("key (kv_idx)")
        ax.set_ylabel("query row (q_idx)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[k], ec="#888888") for k in (flex.EMPTY, flex.PARTIAL, flex.FULL)]
    axes[0][0].legend(handles, ["empty: skipped", "partial: mask_mod", "full: no mask_mod"], loc="lower left",
                      fontsize=7)
    plt.tight_layout()
    plt.show()


def draw_mma_fragments():
    """The three operands of `mma.sync.m16n8k16`: which lane holds each element, in which register."""
    plt = _plt()
    _, axes = plt.subplots(1, 3, figsize=(15, 5.2), gridspec_kw={"width_ratios": [2, 1, 1]})
    for ax, (operand, title) in zip(axes, [("A", "A = Q or P (16 × 16, fp16 pairs)"),
                                           ("B", "B = Kᵀ or V (16 k × 8 n, fp16 pairs)"),
                                           ("C", "C, D = S or O (16 × 8, fp32)")]):
        lane, reg = mma_operand_owner(operand)
        ax.imshow(lane, cmap="tab20", aspect="auto", interpolation="nearest")
        prefix = operand.lower() if operand != "C" else "c"
        for (r, c), ln in np.ndenumerate(lane):
            ax.text(c, r, f"{ln}\n{prefix}{reg[r, c]}", ha="center", va="center", fontsize=5.5)
        ax.set_title(title, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    plt.suptitle("mma.m16n8k16: number = lane, then register. The four lanes of a quad (same lane // 4) "
                 "share rows of A and C: a row reduction is two shuffles", fontsize=10)
    plt.tight_layout()
    plt.show()


def draw_fragment_layout():
    """A 16×16 WMMA accumulator tile as the two `mma.m16n8k16` accumulators the hardware computes.

    The colour and number of each element is the lane that holds it; c0..c3 its register.
    """
    plt = _plt()
    lane, reg = mma_accumulator_owner()
    tile_lane = np.hstack([lane, lane])
    tile_reg = np.hstack([reg, reg + 4])
    _, ax = plt.subplots(figsize=(11, 6))
    ax.imshow(tile_lane, cmap="tab20", aspect="auto", interpolation="nearest")
    for (r, c), ln in np.ndenumerate(tile_lane):
        ax.text(c, r, f"{ln}\nc{tile_reg[r, c]}", ha="center", va="center", fontsize=6)
    ax.axvline(7.5, color="black", lw=2)
    ax.axhline(7.5, color="white", lw=1, ls="--")
    ax.set_xticks(range(16))
    ax.set_yticks(range(16))
    ax.set_xlabel("column of the 16×16 tile (left: first mma.m16n8k16, c0-c3; right: second, c4-c7)")
    ax.set_ylabel("row")
    ax.set_title("mma.m16n8k16 accumulators, as PTX documents them: lane = 4·(row mod 8) + (column mod 8) // 2."
                 "\nA wmma.mma m16n16k16 runs as two of them on sm_80/sm_90 (2 HMMA.16816 in the SASS), but "
                 "PTX does not promise WMMA's lane layout", fontsize=9)
    plt.show()


def _committed_record(directory, kind: str, wanted) -> tuple[dict | None, str]:
    """(the newest committed record of `flashcore bench --<kind>` whose config `wanted` takes, the timing
    cell's line saying where it comes from), or (None, "") after saying there is none yet. `directory`:
    the records' folder (default docs/bench/<kind>/)."""
    from ..measure.records import load_records

    folder = Path(directory) if directory else records_dir() / kind
    found = [r for r in load_records(folder) if wanted(r["config"])] if folder.is_dir() else []
    if not found:
        print(f"No {kind} record in {display_path(folder)} yet: on a GPU machine `flashcore bench --{kind}` "
              "writes one, and this cell then shows its numbers.")
        return None, ""
    record = max(found, key=lambda r: r["created"])
    return record, (f"Not measured here (no GPU): measured on {record['provenance']['gpu_name']} on "
                    f"{record['created'][:10]}, read from {display_path(record.get('_path'))}")


def _timing_row(result: dict, phase: str | None) -> dict:
    """A record's result as a row of the timing table (`phase`: the lesson phase it belongs to, or None)."""
    note = "" if result.get("tflops") else (result.get("reason") or result.get("message") or "not timed")
    return {"name": result["name"], "phase": phase, "peer": result["kind"] == "peer",
            "median_ms": result.get("median_ms"), "tflops": result.get("tflops"), "note": note}


# =============================================================================================
# The lesson
# =============================================================================================
class Lesson:
    """One phase's notebook: every cell after the prose is one method call."""

    def __init__(self, phase, head_dim: int = 64):
        self.phase = get_lesson(phase)
        self.previous = previous_phase(self.phase)
        # other builds of the same kernel ("06-inline"): timed and compiled beside the phase
        self.variants = [v for v in VARIANTS.values() if v.phase is self.phase]
        self.head_dim = head_dim
        self.on_gpu = not simulator_enabled()
        self._reports = None
        self._timed = None  # (record, where it comes from) of the timing cell

    @property
    def backward(self) -> bool:
        """Phases 11, 12 and 13: kernels of their own, graded and timed by their gradients."""
        return getattr(self.phase, "BACKWARD", False)

    @property
    def mods(self) -> bool:
        """Phase 14: a kernel with a user's mods and a block mask, graded and timed with them."""
        return getattr(self.phase, "MODS", False)

    @property
    def main_id(self) -> str:
        """The kernel whose PTX and SASS the lesson shows: the phase's, or a backward phase's kv_kernel."""
        return f"{self.phase.ID}-kv" if self.backward else self.phase.ID

    def _ids(self) -> list[str]:
        """The kernels this lesson compares: the previous phase, this one, and its variants (phase 11: its
        kv_kernel and Δ's kernel; phases 12 and 13: the previous phase's kv_kernel and its own)."""
        if self.backward:
            pid = self.phase.ID
            return ["11-kv", "11-delta"] if pid == "11" else [f"{int(pid) - 1:02d}-kv", self.main_id]
        if self.mods:  # phase 14: the kernel it changes (07's), then its own with the lesson's mods
            return [self.phase.BUILDS_ON, self.phase.ID]
        base = PHASES.get(getattr(self.phase, "BUILDS_ON", ""))  # phase 10: built on 07, after 09
        return [p.ID for p in (self.previous, base, self.phase, *self.variants) if p is not None]

    def _compiled_ids(self) -> list[str]:
        """The kernels the machine-code cells compile: all of `_ids` on a GPU, or where the lesson
        compares the variants' code itself (phase 06's two PTX routes, `call_cost`). In the
        simulator the variants of phase 09 are left out: each takes a minute or two of a laptop
        core to compile, and the lesson's tables make their point with 08 against 09."""
        if self.on_gpu or self.phase.ID == "06" or self.backward:
            return self._ids()
        # a phase built on an earlier one than its predecessor (phase 10 on 07's mma.sync) compares
        # its machine code with that one
        base = PHASES.get(getattr(self.phase, "BUILDS_ON", ""), self.previous)
        return [p.ID for p in (base, self.phase) if p is not None]

    # -- where we are ----------------------------------------------------------------------
    def intro(self) -> None:
        p = self.phase
        print(f"Phase {p.ID} — {p.TITLE}   (flashcore_numba.phases.{p.__name__.rsplit('.', 1)[-1]})")
        if self.on_gpu:
            from numba import cuda

            if not cuda.is_available():
                raise RuntimeError("NUMBA_ENABLE_CUDASIM is off but no CUDA GPU is available: restart the "
                                   "kernel with NUMBA_ENABLE_CUDASIM=1 to run the lesson in the simulator")
            dev = cuda.get_current_device()
            name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
            cc = dev.compute_capability
            print(f"Kernels run on: {name} (compute capability {cc[0]}.{cc[1]}); timings are measured live.")
        else:
            print("Kernels run in Numba's CUDA simulator on the CPU (NUMBA_ENABLE_CUDASIM=1): one Python "
                  "thread per CUDA thread,\nso correctness is checked on a tiny shape and timings are read "
                  "from the committed GPU record.")
        import numba

        from .. import __version__

        print(f"flashcore_numba {__version__}, numba {numba.__version__}, numpy {np.__version__}")

    def changelog(self) -> None:
        """The phase module's docstring: its changelog and the measured effect from the record."""
        print(inspect.getdoc(self.phase))

    # -- source ----------------------------------------------------------------------------
    def show_source(self, *objects) -> None:
        """Source of the given functions (default: the phase's `build`), straight from the package,
        with this lesson's exercise regions empty, as the student's stub has them (`as_the_stub_has_it`)."""
        source, emptied = self.as_the_stub_has_it(source_of(*(objects or (self.phase.build,))))
        show_code(source)
        self._say_emptied(emptied)

    def show_diff(self, old, new) -> None:
        """Unified diff between two functions' sources: only what the new phase changed (this lesson's
        exercise regions empty, as in show_source)."""
        old, new = (getattr(o, "py_func", o) for o in (old, new))
        a, emptied_a = self.as_the_stub_has_it(inspect.getsource(old))
        b, emptied_b = self.as_the_stub_has_it(inspect.getsource(new))
        name_a = f"{old.__module__.rsplit('.', 1)[-1]}.{old.__qualname__}"
        name_b = f"{new.__module__.rsplit('.', 1)[-1]}.{new.__qualname__}"
        diff = difflib.unified_diff(a.splitlines(), b.splitlines(), name_a, name_b, lineterm="", n=2)
        show_code("\n".join(diff), language="diff")
        self._say_emptied(emptied_a + [x for x in emptied_b if x not in emptied_a])

    def regions(self) -> list:
        """This lesson's exercise regions (exercises.Region), in the order of the phase's file."""
        return find_regions(phase_source(self.phase), default_label=self.phase.ID)

    def as_the_stub_has_it(self, source: str) -> tuple[str, list[str]]:
        """(source with the lines of this lesson's exercise regions removed, the labels of those it
        emptied). The markers stay, so a listing shows where the student writes and what, exactly as
        the stub does; the lines themselves appear only after the exercise (show_solution). Regions
        of other phases (an earlier lesson's, in a diff against it) are left as they are."""
        ours = {r.label for r in self.regions()}
        bodies = {label: span for label, span in region_bodies(source).items() if label in ours}
        removed = {i for first, end in bodies.values() for i in range(first, end)}
        lines = [line for i, line in enumerate(source.splitlines()) if i not in removed]
        return "\n".join(lines), [label for label, (first, end) in bodies.items() if end > first]

    @staticmethod
    def _say_emptied(labels: list[str]) -> None:
        if labels:
            print(f"(exercise region{'s' * (len(labels) != 1)} {', '.join(labels)} shown empty, as your stub has "
                  f"{'them' if len(labels) != 1 else 'it'}: the solution is at the end of the lesson)")

    def show_solution(self) -> None:
        """The solution of this lesson's exercise: each region's lines as the phase has them, under its
        marker. The lesson shows it only here, after the exercise."""
        print(f"The solution of exercise {self.phase.ID}, as {display_path(Path(self.phase.__file__))} has it "
              f"(try it yourself first):")
        parts = []
        for region in self.regions():
            body = textwrap.dedent("\n".join(region.solution))
            parts.append(f"# >>> exercise {region.label}: {region.instruction}\n{body}\n# <<< exercise")
        show_code("\n\n".join(parts))

    def show_ptx(self, filename: str, name: str | None = None) -> None:
        """A file of ptx/ (or one function of it, with the comment above it), exactly as it runs."""
        from ..arch.ptx import ptx_dir

        text = (ptx_dir() / filename).read_text()
        if name is not None:
            lines = text.splitlines()
            start = next(i for i, line in enumerate(lines) if f" {name}(" in line)
            while start > 0 and lines[start - 1].startswith("//"):
                start -= 1
            end = next(i for i in range(start, len(lines)) if lines[i] == "}")
            text = "\n".join(lines[start:end + 1])
        print(f"ptx/{filename}" + (f": {name}" if name else ""))
        show_code(text, language="text")

    # -- correctness -----------------------------------------------------------------------
    def check_shapes(self) -> list[tuple]:
        """(B, H, S_q, S_k, D, causal) problems for `check`: tails, several K/V tiles, masks."""
        if not self.on_gpu:
            return list(SIM_PROBLEMS)
        problems = [(2, 3, 200, 200, d, c) for d in self.phase.HEAD_DIMS for c in (False, True)]
        return problems + [(1, 2, 1000, 1000, self.head_dim, True), (1, 2, 130, 300, self.head_dim, True)]

    def check(self, problems=None) -> None:
        """Run the kernel on fresh random inputs (output poisoned with NaN first) against the reference."""
        if self.backward:
            return self.check_gradients(problems)
        if self.mods:
            return self.check_flex(problems)
        from numba import cuda

        from ..phases.common import LOG2E
        from ..reference import ATOL

        rows = []
        for B, H, Sq, Sk, D, causal in problems or self.check_shapes():
            q, k, v = random_qkv((B, H, Sq, D), Sk)
            dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
            dout = cuda.to_device(np.full(q.shape, np.nan, dtype=np.float16))  # every element must be written
            self.phase.build(D).launch(dq, dk, dv, dout, causal, default_scale(D) * LOG2E)
            verdict = check_close(dout.copy_to_host(), reference_attention(q, k, v, causal=causal),
                                  lowp_attention(q, k, v, causal=causal))
            rows.append({"shape": f"{B}×{H}×{Sq}×{Sk}×{D}", "causal": causal, "max_err": verdict.max_err,
                         "allowed": verdict.allowed, "nan/inf": verdict.nonfinite,
                         "result": "pass" if verdict.ok else "FAIL", "why": verdict.message})
        print(table(rows, [("shape", "B×H×S_q×S_k×D"), ("causal", "causal"), ("max_err", "max |out-ref|"),
                           ("allowed", "allowed"), ("nan/inf", "NaN/Inf left"), ("result", "result")]))
        failed = [r for r in rows if r["result"] != "pass"]
        if failed:
            raise AssertionError("; ".join(f"{r['shape']} causal={r['causal']}: {r['why']}" for r in failed))
        print(f"allowed = 2 × (error of plain fp16 attention) + {ATOL:g}: FlashAttention's test oracle")

    def check_gradients(self, problems=None) -> None:
        """Phases 11, 12 and 13: dQ, dK and dV of fresh random problems (poisoned with NaN first) against the
        float64 reference's gradients, by the grader's rule (course/grade_backward.py)."""
        from .grade_backward import GradientCase, gradient_runs, launch, make_inputs, verdicts

        if problems is None:
            problems = ([(20, 38, 64, False, 2, 1), (20, 38, 64, True, 2, 1)] if not self.on_gpu else
                        [(300, 300, d, c, 4, 2) for d in self.phase.HEAD_DIMS for c in (False, True)]
                        + [(1000, 700, 128, True, 8, 1)])
        rows, failed = [], []
        for seq_q, seq_k, D, causal, heads, heads_kv in problems:
            case = GradientCase(seq_q, seq_k, D, causal=causal, heads=heads, heads_kv=heads_kv)
            x = make_inputs(case, None)
            runs = gradient_runs(case, x, launch(self.phase, case, x))
            for (name, r), verdict in zip(runs.items(), verdicts(runs)):
                err = float(np.max(np.abs(r.out - r.expected))) if np.isfinite(r.out).all() else float("inf")
                rows.append({"problem": f"S_q={seq_q} S_k={seq_k} D={D} H={heads}/{heads_kv}",
                             "causal": causal, "grad": name, "max_err": err, "allowed": r.allowed,
                             "result": "pass" if r.ok else "FAIL"})
                if not r.ok:
                    failed.append(f"{case} {verdict}")
        print(table(rows, [("problem", "problem (H = query/K/V heads)"), ("causal", "causal"), ("grad", "gradient"),
                           ("max_err", "max |grad-ref|"), ("allowed", "allowed"), ("result", "result")]))
        if failed:
            raise AssertionError("; ".join(failed))
        print("allowed = 2 × (error of the same formulas in fp16/float32, as the kernels compute them) + 1e-3 of "
              "the gradient's largest value")

    def check_flex(self, problems=None) -> None:
        """Phase 14: fresh random problems with mods and masks (the grader's, course/grade_flex.py), the
        output poisoned with NaN first, against the float64 oracle with the same mods (reference_flex)."""
        from .grade_flex import FlexCase, run_case, verdict

        if problems is None:
            problems = ([(40, 70, 64, "window", 1, 2, 1), (19, 38, 64, "alibi+documents", 2, 2, 2),
                         (19, 38, 64, "softcap+prefix", 1, 1, 1)] if not self.on_gpu else
                        [(1000, 1000, d, mods, 2, 4, 2) for d in self.phase.HEAD_DIMS
                         for mods in ("window", "alibi+documents", "softcap+prefix", "rows_blind")])
        rows, failed = [], []
        for seq_q, seq_k, D, mods, B, H, H_kv in problems:
            case = FlexCase(seq_q, seq_k, D, mods, batch=B, heads=H, heads_kv=H_kv,
                            logits=30.0 if "softcap" in mods else None)
            run = run_case(self.phase, case, None, Path(self.phase.__file__))
            err = float(np.max(np.abs(run.out - run.expected))) if run.out is not None and np.isfinite(run.out).all() \
                else float("inf")
            rows.append({"problem": f"B={B} H={H}/{H_kv} S_q={seq_q} S_k={seq_k} D={D}", "mods": mods, "max_err": err,
                         "allowed": run.allowed, "result": "pass" if run.ok else "FAIL"})
            if not run.ok:
                failed.append(f"{case}: {verdict(run)}")
        print(table(rows, [("problem", "problem (H = query/K/V heads)"), ("mods", "mods"), ("max_err", "max |out-ref|"),
                           ("allowed", "allowed"), ("result", "result")]))
        if failed:
            raise AssertionError("; ".join(failed))
        print("allowed = 2 × (error of the oracle's output rounded to fp16) + 0.001; the oracle applies the same "
              "mods in float64")

    # -- timing ----------------------------------------------------------------------------
    def timing(self, directory=None) -> dict | None:
        """This phase, the previous one and torch SDPA: measured live on a GPU, else the committed record."""
        if self.backward:
            return self.timing_backward(directory)
        if self.mods:
            return self.timing_flex(directory)
        ids = self._ids()
        problem = getattr(self.phase, "LESSON_PROBLEM", None)  # a phase of other shapes: phase 10, decoding
        if self.on_gpu:
            record = measure(ids, problem=problem)
            label = (f"Measured live on {record['provenance']['gpu_name']} on {record['created'][:10]} "
                     f"(flashcore_numba.measure.bench: median of {record['timing']['repeats']} runs, "
                     "L2 flushed)")
        else:
            record = latest_record(directory) if problem is None else latest_record_of(problem, self.phase.ID, directory)
            if record is None:
                where = display_path(directory or records_dir())
                print(f"No GPU benchmark record in {where} yet, so there is nothing to show here on a CPU.\n"
                      "On a GPU machine `flashcore bench` writes one; this cell then shows its numbers.")
                return None
            label = (f"Not measured here (no GPU): measured on {record['provenance']['gpu_name']} on "
                     f"{record['created'][:10]}, read from {display_path(record.get('_path'))}")
            if not any(r["kind"] == "phase" and r["name"] == self.phase.ID for r in record["results"]):
                label += f"\n(that record has no row for phase {self.phase.ID} yet)"
        self._timed = (record, "measured by the timing cell" if self.on_gpu
                       else f"read from {display_path(record.get('_path'))}")
        rows = timing_rows(record, ids)
        print(label)
        print(_describe_shape(record["config"]))
        print(table(rows, [("name", "kernel"), ("median_ms", "median ms"), ("tflops", "TFLOPS"),
                           ("note", "")]))
        mine = {r["phase"]: r for r in rows if r["phase"] and r["tflops"]}
        if self.previous is not None and self.previous.ID in mine and self.phase.ID in mine:
            ratio = mine[self.phase.ID]["tflops"] / mine[self.previous.ID]["tflops"]
            print(f"\nphase {self.phase.ID} runs at {ratio:.2f}× the throughput of phase {self.previous.ID}")
        return {"rows": rows, "label": label}

    def timing_backward(self, directory=None) -> dict | None:
        """The backward phases (11, and 12 and 13 on Hopper) beside SDPA's backward at the reference shape:
        measured live on a GPU (flashcore bench --backward's protocol), else the committed record
        (docs/bench/backward/)."""
        from ..measure import backward
        from ..measure.bench import Problem

        problem = Problem.from_shape(REFERENCE_SHAPE, causal=False)
        if self.on_gpu:
            record = backward.run_backward_benchmark(problem, command=["(a lesson's timing cell)"])
            label = f"Measured live on {record['provenance']['gpu_name']} on {record['created'][:10]}"
        else:
            record, label = _committed_record(directory, "backward", lambda c: c.get("D") == problem.D
                                              and not c.get("causal"))
            if record is None:
                return None
        rows = [_timing_row(r, r["name"].split("-")[0] if r["kind"] == "phase" else None) for r in record["results"]]
        print(label)
        print(_describe_shape(record["config"]) + "; " + record.get("flops_rule", backward.FLOPS_RULE))
        print(table(rows, [("name", "kernel"), ("median_ms", "median ms"), ("tflops", "TFLOPS"), ("note", "")]))
        timed = {r["name"]: r for r in rows if r["tflops"]}
        mine = self.phase.ID
        if mine in timed and "sdpa_flash" in timed:
            print(f"\nphase {mine}'s backward runs at {timed[mine]['tflops'] / timed['sdpa_flash']['tflops']:.2f}× "
                  "the throughput of SDPA's flash backend")
        before = f"{int(mine) - 1:02d}"  # the backward phase this one changes (12: 11; 13: 12)
        if mine != "11" and mine in timed and before in timed:
            print(f"phase {mine} runs at {timed[mine]['tflops'] / timed[before]['tflops']:.2f}× phase {before}'s "
                  "throughput")
        elif mine != "11":
            print(f"(that record has no row for phase {mine}: `flashcore bench --backward` times it on Hopper)")
        return {"rows": rows, "label": label}

    def timing_flex(self, directory=None) -> dict | None:
        """Phase 14 beside torch's FlexAttention with the same mods (`flashcore bench --flex`'s cases):
        measured live on a GPU with torch (two cases, at a smaller shape than the records'), else the
        committed record at D = 64 (docs/bench/flex/)."""
        from ..measure import flex as flex_bench
        from ..measure.bench import Problem, Timing

        if self.on_gpu:
            try:
                record = flex_bench.run_flex_benchmark(Problem.from_shape((4, 16, 4096, 64)),
                                                       cases=("sliding_window", "causal_mask"),
                                                       timing=Timing(warmup=2, repeats=10),
                                                       command=["(a lesson's timing cell)"])
            except RuntimeError as e:  # no torch with CUDA: the benchmark's peers need it
                print(f"Not measured: {e}")
                return None
            label = f"Measured live on {record['provenance']['gpu_name']} on {record['created'][:10]}"
        else:
            record, label = _committed_record(directory, "flex", lambda c: c.get("D") == 64)
            if record is None:
                return None
        rows = [_timing_row(r, self.phase.ID if r["name"].startswith("14 ") else None) for r in record["results"]]
        print(label)
        print(_describe_shape(record["config"]) + "; " + record.get("flops_rule", ""))
        print(table(rows, [("name", "kernel, case"), ("median_ms", "median ms"), ("tflops", "TFLOPS"), ("note", "")]))
        timed = {r["name"]: r for r in rows if r["tflops"]}
        for name in timed:
            case = name.removeprefix("14 ")
            if name.startswith("14 ") and f"flex_attention {case}" in timed:
                print(f"{case}: phase 14 at {timed[name]['tflops'] / timed[f'flex_attention {case}']['tflops']:.2f}× "
                      "the throughput of torch's FlexAttention")
        if "14 causal_mask" in timed and "attention causal=True" in timed:
            print(f"causal as a mask_mod: {timed['14 causal_mask']['median_ms'] / timed['attention causal=True']['median_ms']:.2f}× "
                  "the time of attention(causal=True), the fast path")
        return {"rows": rows, "label": label}

    def plot_timing(self, timing: dict | None) -> None:
        """Bars of the timing rows on a log scale: the peers are orders of magnitude ahead at first."""
        rows = [r for r in (timing or {}).get("rows", []) if r.get("tflops")]
        if not rows:
            print("nothing to plot")
            return
        plt = _plt()
        colors = ["#4c72b0" if r["phase"] == self.phase.ID and not r["name"].endswith("-step") else "#dd8452" if r["peer"] else "#8c8c8c"
                  for r in rows]
        _, ax = plt.subplots(figsize=(8, max(2.4, 0.8 + 0.45 * len(rows))))
        values = [r["tflops"] for r in rows]
        ax.barh([r["name"] for r in rows], values, color=colors)
        for i, value in enumerate(values):
            ax.text(value * 1.08, i, f"{value:.3g} TFLOPS", va="center", fontsize=9)
        ax.set_xscale("log")
        ax.set_xlim(min(values) / 2, max(values) * 10)
        ax.invert_yaxis()
        ax.set_xlabel("TFLOPS (log scale)")
        ax.set_title(timing["label"], fontsize=9)
        plt.tight_layout()
        plt.show()

    # -- machine code ----------------------------------------------------------------------
    def reports(self) -> dict:
        """kernel_report of the previous and this phase (compiled once; in a subprocess in the simulator)."""
        if self._reports is None:
            from ..measure.machine_code import find_disassembler, kernel_reports

            self._reports = kernel_reports(self._compiled_ids(), self.head_dim, sass=find_disassembler() is not None)
        return self._reports

    def machine_code(self) -> None:
        """Registers, spills, local and shared memory, and the occupancy they allow, side by side."""
        from ..measure.machine_code import occupancy

        rows = []
        for pid, r in self.reports().items():
            occ = occupancy(r)
            rows.append({"phase": f"{pid} {r['name']}", "registers": r["registers"],
                         "spill st/ld B": f"{r['spill_store_bytes']}/{r['spill_load_bytes']}",
                         "stack B": r["stack_frame_bytes"], "static smem": r["static_smem_bytes"],
                         "dynamic smem": r["dynamic_smem_bytes"], "threads": r["n_threads"],
                         "blocks/SM": f"{occ['blocks_per_sm']} ({occ['limited_by']})",
                         "occupancy": f"{occ['occupancy']:.0%}"})
        print(f"Compiled for sm_90a (H100) at D={self.head_dim}; per thread: registers, spill bytes, stack "
              "frame (local memory); per block: shared memory in bytes.")
        print(table(rows, [(k, k) for k in rows[0]]))
        print("blocks/SM and occupancy: how many blocks fit on one H100 SM (65536 registers, 228 KB shared "
              "memory, 2048 threads) and what runs out first.")
        left_out = [kid for kid in self._ids() if kid not in self._compiled_ids()]
        if left_out:
            print(f"Not compiled in the simulator: {', '.join(left_out)} (a minute or two each on a laptop core); "
                  "the lesson's saved outputs, run on a GPU, list them too.")
        for pid, r in self.reports().items():
            if r["spill_store_bytes"] or r["spill_load_bytes"]:
                print(f"\nphase {pid} spills: {r['spill_store_bytes']} bytes stored to and "
                      f"{r['spill_load_bytes']} loaded from local memory per thread "
                      f"({r['registers']} registers in use).")
            elif r["stack_frame_bytes"]:
                print(f"\nphase {pid} keeps a {r['stack_frame_bytes']}-byte stack frame in local memory per "
                      "thread: an array the compiler could not place in registers.")
        if self._timed:  # what the driver reported for the kernels the timing record ran
            record, source = self._timed
            loaded = [r for r in record["results"] if r["name"] in self.reports() and r.get("registers")]
            if loaded:
                print(f"\nThe driver on {record['provenance']['gpu_name']} ({source}): " + "; ".join(
                    f"phase {r['name']} {r['registers']} registers, {r['local_bytes_per_thread']} bytes "
                    "of local memory per thread" for r in loaded))

    def ptx(self, patterns, max_lines: int = 16, context: int = 1) -> None:
        """How often each key PTX instruction appears in each phase; where it first appears in this one."""
        from ..measure.machine_code import ptx_excerpt

        self._counts("ptx", patterns, "PTX")
        ptx = self.reports()[self.main_id]["ptx"]
        header = [line.strip() for line in ptx.splitlines() if line.startswith((".version", ".target"))]
        print(f"\nPTX of {self.main_id} ({', '.join(header)}), first occurrence of each:")
        print(ptx_excerpt(ptx, patterns, max_lines, context))

    def sass(self, patterns, max_lines: int = 16, context: int = 1) -> None:
        """The same for SASS, the GPU's own instructions, when a disassembler (nvdisasm) is installed."""
        from ..measure.machine_code import ptx_excerpt

        text = self.reports()[self.main_id].get("sass")
        if not text:
            print("No SASS here: it needs nvdisasm or cuobjdump. The course extra installs nvdisasm "
                  "(pip install -e \".[course]\", on Linux and Windows); else a CUDA toolkit's, on the PATH."
                  "\nThe PTX above is what the assembler starts from; "
                  "it unrolls loops further and allocates registers.")
            return
        self._counts("sass", patterns, "SASS")
        print(f"\nSASS of {self.main_id}, first occurrence of each:")
        print(ptx_excerpt(text, patterns, max_lines, context))

    def call_cost(self) -> None:
        """The phase beside its variants: what calling linked PTX costs (registers, stack, CALLs, time)."""
        from ..measure.machine_code import instruction_counts, sass_calls

        timed = {}
        if self._timed:
            timed = {r["name"]: r for r in self._timed[0]["results"] if r["kind"] == "phase"}
        rows = []
        for kid in [self.phase.ID, *(v.ID for v in self.variants)]:
            r = self.reports()[kid]
            calls = sass_calls(r["sass"]) if r.get("sass") else None
            linked = {name for name in r["callee_frames"]}
            row = {"kernel": f"{kid} {r['name']}", "registers": r["registers"],
                   "stack B": r["stack_frame_bytes"],
                   "callee stack B": sum(r["callee_frames"].values()) if linked else "-",
                   "CALL to ptx/": "-" if calls is None else sum(n for c, n in calls.items() if c in linked),
                   "HMMA": "-" if not r.get("sass") else instruction_counts(r["sass"], ["HMMA"])["HMMA"],
                   "TFLOPS": timed.get(kid, {}).get("tflops")}
            rows.append(row)
        print(f"Compiled for sm_90a at D={self.head_dim} (static counts: a loop body counts once); TFLOPS "
              "from the timing cell above.")
        print(table(rows, [(k, k) for k in rows[0]]))
        print("CALL to ptx/: SASS call sites into the linked functions. HMMA: tensor-core instructions in "
              "the cubin; on the link route they sit once in the called functions' loops, on the inline "
              "route the compiler unrolls them into the kernel.")

    def _counts(self, key, patterns, what) -> None:
        from ..measure.machine_code import instruction_counts

        rows = []
        for pid, r in self.reports().items():
            counts = instruction_counts(r.get(key) or "", patterns)
            rows.append({"phase": f"{pid} {r['name']}", **counts})
        print(f"{what} instructions in the code (static counts: a loop body counts once):")
        print(table(rows, [("phase", "phase")] + [(p, p) for p in patterns]))

    def bank_conflicts(self) -> None:
        """Worst shared-memory bank-conflict degree of each access (phases with a warp-tile layout)."""
        from ..measure.banks import warp_tile_conflicts

        rows = []
        for p in (self.previous, self.phase):
            if p is not None and hasattr(p, "smem_layout"):
                L = p.smem_layout(self.head_dim)
                rows.append({"phase": f"{p.ID} {p.NAME} (pad {L['SMEM_PAD']})", **warp_tile_conflicts(L)})
        if not rows:
            print("This phase has no warp-tiled shared-memory layout to analyse.")
            return
        print("Passes each warp-wide shared-memory access needs (1 = conflict-free), from the layout alone:")
        print(table(rows, [(k, k) for k in rows[0]]))

    # -- exercise --------------------------------------------------------------------------
    def exercise(self) -> None:
        """Where this phase's exercise regions are, where the stub lives, and how to grade it."""
        stub = exercise_path(self.phase)
        module = self.phase.__name__.rsplit(".", 1)[-1]
        print(f"The stub is flashcore_numba/phases/{module}.py with these regions cut out; "
              "you write them back:")
        for region in self.regions():  # lines of the phase file
            start, n_lines = region.begin + 2, region.end - region.begin - 1  # 1-based, markers excluded
            print(f"  - exercise {region.label}: {region.instruction}   (lines {start}-{start + n_lines - 1} "
                  f"of the phase source, {n_lines} lines)")
        where = display_path(stub) if stub.exists() else f"{display_path(stub)} (not written yet)"
        print(f"\nYour stub: {where}")
        print(f"Grade it:  flashcore grade {self.phase.ID}")
        print(f"     or:   pytest lessons/exercises --grade {self.phase.ID}")

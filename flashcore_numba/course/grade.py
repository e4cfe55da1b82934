"""`flashcore grade NN [path/to/solution.py]`: grade an exercise, with points and a reason per check.

    flashcore grade 03                      # lessons/exercises/03_warp_shuffle.py
    flashcore grade 03 my_copy.py --seed 7  # another file; --seed repeats a run exactly
    python -m flashcore_numba.course.grade 03   # the same without the `flashcore` script
    pytest lessons/exercises --grade 03     # the same checks, one pytest test each

The student's file is loaded as a module of its own and its kernel is launched the way every
phase is: `module.build(D).launch(q, k, v, out, causal, qk_scale)` on Numba device arrays.

The checks (`checks_for(phase)` lists them; `--list` prints them):
- each exercise region on its own, first (see `region_checks`): the solved file with only that
  region's lines taken from the student's file, run on S = 1 and on a few rows against two key
  tiles (every case runs, so that the pattern shows). A solved region passes while another is
  still empty. A failure says what the outputs look like where the pattern is known
  (flashcore_numba.course.diagnose: all zeros, only S = 1 right, NaN everywhere, a constant
  factor, ...), in the region's own words where hints.py has them, with the worst element
  against the expected one and a picture of the wrong rows and columns. `--hint [K]` prints
  the regions' hints (flashcore_numba.course.hints), tiers 1..K.
- correctness on adversarial shapes (see `correctness_checks`): S a multiple of the tile and
  not, S smaller than a tile, S = 1, causal rows that see a single key and rows that see none
  (they must give zeros), scores of about ±30, every head dim of the phase. Inputs are fresh
  random numbers from a seed drawn at run time, so no answer can be hard-coded; the seed is
  printed when a check fails, and --seed repeats the run. The output is filled with NaN
  before each launch, so a value the kernel never writes cannot pass, and neither can NaN or
  Inf; in the simulator so are the kernel's local arrays (`poisoned_local_arrays`). A check stops at its first failing case. The oracle is
  flashcore_numba.reference.check_close: at most twice fp16 arithmetic's error, plus 1e-3.
- the phase's own point: phase 04 must remove the shared-memory bank conflicts (counted from
  the layout by flashcore_numba.measure.banks, no GPU needed); on a GPU, phase 04 must beat phase 03
  and phase 05 must beat phase 04, measured in the same run; phases without a point of their
  own must run at least 0.8x as fast as their reference solution. Timing checks need a GPU and
  are skipped, with that reason, in the simulator.

An exception raised in the kernel is reported at the line of the student's file it came from
(the simulator runs the kernel's Python code; diagnose.describe_exception walks the traceback).

Exit status 0 only on full marks (of the checks this machine can run).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType

import numpy as np

from ..arch.sim import kernel_target, rerun_in_simulator, simulator_enabled
from ..measure.records import CheckoutNeeded, repo_root
from ..phases import LESSONS, PHASES, build
from ..phases.common import LOG2E
from ..reference import (
    ATOL,
    check_close,
    default_scale,
    lowp_attention,
    random_qkv,
    reference_attention,
    scaled_to_logits,
    visible_mask,
)
from ..usage import Parser, usage_error
from . import exercises
from .checks import Case, Check, Outcome, Result
from .diagnose import CaseRun, describe_exception, explain
from .exercises import PUZZLES_ID, exercise_module
from .hints import hints_for
from .student import (
    RegionNotLoaded,
    gpu_timing_lock,
    kernel_diagnoses,
    load_module,
    load_region,
    poisoned_local_arrays,
    still_empty,
)

UNTILED_KEYS = 16  # a phase that walks the keys one at a time (01) is graded as if its key tile were 16
LARGE_LOGITS = 30.0  # the largest |score| of the large-logits check
TIMING_SHAPE = (4, 8, 2048, 64)  # B, H, S, D of the GPU timing checks: the reference S, fewer heads
# so that the NumPy oracle that gates them stays quick
TIMED_RUNS = 10  # per kernel; the median counts
NOT_SLOWER = 0.8  # a phase without a point of its own must reach 0.8x its reference solution's speed
NEEDS_A_GPU = "needs a GPU: timings in the CUDA simulator mean nothing"


# ---------------------------------------------------------------------------------------------
# Checks and their outcomes
# ---------------------------------------------------------------------------------------------
@dataclass
class Grading:
    """What a check needs: the student's module, the phase it solves, where kernels run."""

    phase: ModuleType  # the package's phase module: the reference solution
    student: ModuleType | None  # None when the file did not load
    path: Path
    on_gpu: bool
    seed: int
    load_error: str | None = None
    results: list[Result] = field(default_factory=list)

    def run(self, check: Check) -> Result:
        started = time.perf_counter()
        if check.gpu_only and not self.on_gpu:
            outcome = Outcome("skip", NEEDS_A_GPU)
        elif self.student is None and check.kind != "region":  # a region is graded in the solution's file
            outcome = Outcome("fail", f"the file does not load: {self.load_error}")
        else:
            try:
                outcome = check.run(self, check)
            except Exception as e:  # noqa: BLE001 - a bug in the student's code, outside a launch
                outcome = Outcome("fail", describe_exception(e, self.path))
        result = Result(check.name, check.title, check.points, outcome.status, outcome.detail,
                        check.gpu_only, check.kind, round(time.perf_counter() - started, 2))
        self.results.append(result)
        return result

    def case_seed(self, check: Check, index: int):
        """The inputs of case `index` of `check`: a function of the run's seed, so --seed repeats it."""
        return np.random.SeedSequence([self.seed, _stable_hash(check.name), index])


def _stable_hash(text: str) -> int:
    return zlib.crc32(text.encode())  # unlike hash(), the same in every process


# ---------------------------------------------------------------------------------------------
# Running one case: fresh inputs, poisoned output, the oracle
# ---------------------------------------------------------------------------------------------
def make_inputs(case: Case, seed):
    """Random fp16 (q, k, v); with `logits`, q and k are scaled so that max |score| ≈ logits."""
    q, k, v = random_qkv((1, 1, case.seq_q, case.head_dim), case.seq_k, seed=seed, dtype=np.float64)
    if case.logits:
        q, k = scaled_to_logits(q, k, case.logits)
    return tuple(x.astype(np.float16) for x in (q, k, v))


def launch(module: ModuleType, q, k, v, causal: bool) -> np.ndarray:
    """Run the module's kernel on (q, k, v) and return its output.

    The output array is filled with NaN first (the poison): an element the kernel forgets
    to write stays NaN, and NaN never passes. In the simulator, so are the kernel's local
    arrays (see poisoned_local_arrays): a register never written reads as NaN, every time.
    """
    from numba import cuda

    D = q.shape[-1]
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    dout = cuda.to_device(np.full(q.shape, np.nan, dtype=np.float16))
    with poisoned_local_arrays():
        keyed_build(module, D).launch(dq, dk, dv, dout, causal, default_scale(D) * LOG2E)
        cuda.synchronize()
    return dout.copy_to_host()


PHASES_DIR = Path(__file__).resolve().parents[1] / "phases"  # the package's phase modules


def keyed_build(module: ModuleType, D: int):
    """`module.build(D)`; for the package's own phase, imported or loaded from its file in phases/ (a
    speed check's baseline, or a solution graded from the package's file), as phases.build makes it,
    with its cache key, so that its kernel loads from the disk cache instead of compiling in every
    grader. A student's module compiles as before, even where its kernel is a package function built
    with the student's own parameters (exercise 04 builds phase 03's kernel with its own padding)."""
    where = getattr(module, "__file__", None)
    if where is not None and Path(where).resolve().parent == PHASES_DIR:
        return build(module, D)
    return module.build(D)


def judge(out: np.ndarray, q, k, v, causal: bool) -> Outcome:
    """The oracle, with a precise reason for outputs left unwritten."""
    nan = np.isnan(out)
    if nan.any():
        first = np.argwhere(nan)[0].tolist()
        hint = ""
        if not visible_mask(q.shape[2], k.shape[2], causal)[first[2]].any():
            hint = f"; row {first[2]} sees no key: it must give zeros"
        return Outcome("fail", f"{int(nan.sum())} of {out.size} outputs are NaN, first at [b, h, row, d] = "
                               f"{first}: never written (the output was filled with NaN before the "
                               f"launch) or computed as NaN{hint}")
    verdict = check_close(out, reference_attention(q, k, v, causal=causal), lowp_attention(q, k, v, causal=causal))
    return Outcome("pass" if verdict.ok else "fail", verdict.message)


def run_cases(g: Grading, check: Check) -> Outcome:
    """Every case of a correctness check, in order; stops at the first failure."""
    errors = []
    for index, case in enumerate(check.cases):
        q, k, v = make_inputs(case, g.case_seed(check, index))
        try:
            out = launch(g.student, q, k, v, case.causal)
        except Exception as e:  # noqa: BLE001 - whatever the student's kernel raises is a failed case
            return Outcome("fail", f"{case}: the kernel {describe_exception(e, g.path)}")
        outcome = judge(out, q, k, v, case.causal)
        if outcome.status != "pass":
            return Outcome("fail", f"{case}: {outcome.detail}\n"
                                   f"{explain([case_run(case, out, q, k, v)], kernel_diagnoses(g))}")
        errors.append(outcome.detail.split(" <=")[0].removeprefix("max error "))
    n = len(check.cases)
    return Outcome("pass", f"{n} case{'s' * (n != 1)} correct (max error {', '.join(errors)})")


def case_run(case: Case, out, q, k, v, error: str = "") -> CaseRun:
    """A launch's output (None if it raised) with what the oracle expects and allows, for diagnose."""
    expected = reference_attention(q, k, v, causal=case.causal)
    lowp = lowp_attention(q, k, v, causal=case.causal)
    allowed = 2.0 * float(np.max(np.abs(lowp - expected))) + ATOL
    return CaseRun(str(case), case.seq_k, out, expected, allowed, error)


# ---------------------------------------------------------------------------------------------
# One region on its own: the solution's kernel with only that region's lines from the student's file
# ---------------------------------------------------------------------------------------------
# Regions whose code differs with the head dim (a loop over 64-column strips, TMA atoms of 64
# columns) are graded at the phase's largest head dim, where every strip or atom runs; regions
# about where a block's rows start, on two row blocks.
LARGEST_HEAD_DIM = {"06-b", "09-b"}
TWO_ROW_BLOCKS = {"09-a"}
# and about what blocks do together: 10-b counts the blocks of a merge team, and in the simulator a
# block's two warps take two key tiles, so its case has five (three ranges: two blocks)
KEY_TILES = {"10-b": 5}


def region_cases(phase: ModuleType, label: str) -> tuple[Case, ...]:
    """A few rows against two key tiles (non-causal: every key of both tiles counts; KEY_TILES
    names regions that need more), then S = 1.

    S = 1 runs only once the other case has failed, for the diagnosis (the whole-kernel check
    s_one grades it): a state not carried from key to key passes it and fails the other. A case
    costs about one simulated block per key tile, so a region check stays a few seconds.
    """
    D = max(phase.HEAD_DIMS) if label in LARGEST_HEAD_DIM else phase.HEAD_DIMS[0]
    BM, BN = tile_sizes(phase, D)
    rows = min(BM, BN) // 3 + 1  # fewer rows than a tile
    seq_k = (KEY_TILES.get(label, 2) - 1) * BN + 6  # the last tile part full
    return Case(BM + rows if label in TWO_ROW_BLOCKS else rows, seq_k, D), Case(1, 1, phase.HEAD_DIMS[0])


def run_region(g: Grading, check: Check) -> Outcome:
    """The cases of a region check, in order, on past a failure (so that the diagnosis sees the
    pattern); the last, S = 1, only once another has failed."""
    try:
        module, path, spliced = load_region(g, check.region)
    except RegionNotLoaded as e:
        return Outcome("fail", str(e))
    mapped = {"lines": spliced.lines, "shown_as": g.path, "outside": spliced.outside}
    runs, reasons = [], []
    for index, case in enumerate(check.cases):
        if case.seq_k == 1 and all(r.ok for r in runs):
            continue  # right so far: S = 1 would only serve a diagnosis
        q, k, v = make_inputs(case, g.case_seed(check, index))
        try:
            out = launch(module, q, k, v, case.causal)
        except Exception as e:  # noqa: BLE001 - whatever the region raises is a failed case
            message = f"the kernel {describe_exception(e, path, **mapped)}"
            runs.append(case_run(case, None, q, k, v, error=message))
            reasons.append(message)
            continue
        runs.append(case_run(case, out, q, k, v))
        reasons.append(judge(out, q, k, v, case.causal).detail)
    if all(r.ok for r in runs):
        return Outcome("pass", f"{len(runs)} case{'s' * (len(runs) != 1)} correct "
                               f"({'; '.join(r.label for r in runs)}), with only region {check.region} from your file")
    first = next(i for i, r in enumerate(runs) if not r.ok)
    lines = [f"{runs[first].label}: {reasons[first]}"]
    lines += still_empty(g, check.region, spliced)
    passed = [r.label for r in runs if r.ok]
    if passed:
        lines.append(f"passed: {'; '.join(passed)}")
    explanation = explain(runs, hints_for(check.region).diagnoses)
    return Outcome("fail", "\n".join(lines + ([explanation] if explanation else [])))


def region_checks(phase: ModuleType) -> list[Check]:
    """One check per exercise region: the region graded in a kernel that is otherwise the solution.

    Phase 04's region is a layout constant: it is graded by the bank conflicts of that layout.
    """
    checks = []
    for region in exercises.phase_regions(phase):
        title = "the region on its own"
        if phase.ID == "04":
            checks.append(Check(region.label, title, 1, run=region_bank_conflicts, kind="region",
                                region=region.label))
        else:
            checks.append(Check(region.label, title, 1, run=run_region, kind="region",
                                cases=region_cases(phase, region.label), region=region.label))
    return checks


def region_bank_conflicts(g: Grading, check: Check) -> Outcome:
    """Phase 04's region (SMEM_PAD) in the solution's file: its layout's bank conflicts."""
    try:
        module, path, _ = load_region(g, check.region)
    except RegionNotLoaded as e:
        return Outcome("fail", str(e))
    return bank_conflicts_check().run(Grading(g.phase, module, path, g.on_gpu, g.seed), check)


# ---------------------------------------------------------------------------------------------
# The correctness checks, derived from the phase's tile sizes
# ---------------------------------------------------------------------------------------------
def tile_sizes(phase: ModuleType, head_dim: int) -> tuple[int, int]:
    """(query rows per block, keys per tile) of the kernel `phase.build(head_dim)` builds here.

    In the simulator the phases build the same kernels with small tiles, so the graded shapes
    shrink with them. The row tile is on the KernelConfig; the key tile is found by the
    phases' conventions: `tiles(D)` (phases 03+), SIM_BLOCK_N / BLOCK_N, `smem_layout(D)`.
    A phase without one walks the keys one at a time (01) and is graded as if its tile were 16.
    """
    block_m = phase.build(head_dim).block_m
    block_n = None
    if hasattr(phase, "tiles"):
        block_n = phase.tiles(head_dim).get("block_n")
    elif simulator_enabled() and hasattr(phase, "SIM_BLOCK_N"):
        block_n = phase.SIM_BLOCK_N
    elif hasattr(phase, "BLOCK_N"):
        block_n = phase.BLOCK_N
    elif hasattr(phase, "smem_layout"):
        block_n = phase.smem_layout(head_dim).get("BLOCK_N")
    return block_m, block_n or UNTILED_KEYS


def correctness_checks(phase: ModuleType) -> list[Check]:
    """The adversarial shapes, one case per check, as few simulated blocks as show the point.

    In the simulator every CUDA thread is a Python thread: a case costs roughly one unit per
    (row block, key tile) it runs, whatever the number of rows actually used. So B = H = 1,
    most cases fit one row block, and the properties share cases where they can:

        tile_multiple  S = S_q = S_k a multiple of both tiles, causal: full tiles, the diagonal
                       tile masked, and row 0 sees a single key
        tail           S_q = BM + S_k, S_k = BN + 6, causal: row and key tails; the whole first
                       row block sees no key (its key loop never runs) and must write zeros;
                       row BM sees key 0 only
        short          S_q = S_k smaller than any tile
        s_one          S_q = S_k = 1
        large_logits   q and k scaled so that the largest |score| is 30; S_k = BN + 6 keys,
                       non-causal, so the running max must be rescaled across tiles
        head_dims      the other head dims of the phase, with their own tile sizes

    Every case but `short` and `s_one` spans two key tiles, so a kernel whose multi-tile path
    is broken (phase 05's prefetching, for one) fails them.
    """
    D = phase.HEAD_DIMS[0]
    BM, BN = tile_sizes(phase, D)
    S = math.lcm(BM, 2 * BN)  # whole row blocks holding at least two key tiles
    short = min(BM, BN) // 3 + 1  # fewer rows and keys than any tile

    def check(name, title, *cases):
        return Check(name, title, 1, run=run_cases, cases=cases)

    checks = [
        check("tile_multiple", "S a multiple of the tile; row 0 sees one key", Case(S, S, D, causal=True)),
        check("tail", "S not a multiple of the tile; empty rows give 0",
              Case(BM + BN + 6, BN + 6, D, causal=True)),
        check("short", "S smaller than a tile", Case(short, short, D)),
        check("s_one", "S = 1", Case(1, 1, D)),
        check("large_logits", f"large logits (scores up to ±{LARGE_LOGITS:g})",
              Case(short, BN + 6, D, logits=LARGE_LOGITS)),
    ]
    others = phase.HEAD_DIMS[1:]
    if others:
        cases = []
        for d in others:
            bm, bn = tile_sizes(phase, d)
            cases.append(Case(min(bm, bn) // 3 + 1, bn + 6, d))
        checks.append(check("head_dims", f"head dim {', '.join(map(str, others))}", *cases))
    return checks


# ---------------------------------------------------------------------------------------------
# The phase's own point
# ---------------------------------------------------------------------------------------------
def bank_conflicts_check(points: int = 2) -> Check:
    """The layout's shared-memory accesses conflict no more than the reference solution's.

    Counted from `smem_layout(D)` by flashcore_numba.measure.banks, at every head dim; no GPU needed.
    Relative to the solution, not an absolute zero: an access that the solution leaves
    conflicted on purpose (a cheap one outside the inner loops) does not cost points.
    """

    def run(g: Grading, check: Check) -> Outcome:
        from ..measure.banks import warp_tile_conflicts

        if not hasattr(g.student, "smem_layout"):
            return Outcome("fail", "the module has no smem_layout(HEAD_DIM) function to inspect")
        problems, pads = [], []
        for D in g.phase.HEAD_DIMS:
            layout = g.student.smem_layout(D)
            pads.append(str(layout.get("SMEM_PAD")))
            target = warp_tile_conflicts(g.phase.smem_layout(D))
            worse = [f"{what} {degree}-way (the solution: {target[what]}-way)"
                     for what, degree in warp_tile_conflicts(layout).items() if degree > target.get(what, 1)]
            if worse:
                problems.append(f"D={D}: {', '.join(worse)}")
        pad = f"SMEM_PAD = {', '.join(dict.fromkeys(pads))}"
        if problems:
            return Outcome("fail", f"bank conflicts remain with {pad}: {'; '.join(problems)}")
        return Outcome("pass", f"{pad}: no access conflicts more than in the solution, at D = "
                               f"{', '.join(map(str, g.phase.HEAD_DIMS))}")

    return Check("bank_conflicts", "bank conflicts: none worse than in the solution", points, run,
                 kind="point")


def speed_check(baseline_id: str | None, at_least: float, points: int) -> Check:
    """Time the student's kernel against a package kernel in the same run (GPU only).

    baseline_id None: the phase's own reference solution. The student's kernel must first be
    correct on the timing shape: a wrong kernel's time means nothing.
    """

    def run(g: Grading, check: Check) -> Outcome:
        baseline = g.phase if baseline_id is None else PHASES[baseline_id]
        who = "the reference solution" if baseline_id is None else f"phase {baseline_id}"
        B, H, S, D = TIMING_SHAPE
        shape = f"B={B} H={H} S={S} D={D}"
        q, k, v = random_qkv(TIMING_SHAPE, seed=g.case_seed(check, 0))
        try:
            out = launch(g.student, q, k, v, False)
        except Exception as e:  # noqa: BLE001 - whatever the student's kernel raises is a failed check
            return Outcome("fail", f"{shape}: the kernel {describe_exception(e, g.path)}")
        correct = judge(out, q, k, v, False)
        if correct.status != "pass":
            return Outcome("fail", f"not timed: wrong at {shape} ({correct.detail})")
        mine, theirs = time_against(g.student, baseline, q, k, v)
        ratio = theirs / mine
        detail = (f"{ratio:.2f}x {who}'s speed (yours {mine:.3f} ms, {who} {theirs:.3f} ms; medians of "
                  f"{TIMED_RUNS} at {shape}); needs at least {at_least:.2f}x")
        return Outcome("pass" if ratio >= at_least else "fail", detail)

    if baseline_id is None:
        title = f"speed: at least {at_least:g}x the reference solution"
    else:
        title = f"speed: beats phase {baseline_id} (at least {at_least:g}x)"
    return Check(f"speed_vs_{baseline_id or 'solution'}", title, points, run, gpu_only=True, kind="point")


def time_against(student: ModuleType, baseline: ModuleType, q, k, v) -> tuple[float, float]:
    """Median milliseconds of the two kernels, timed alternately with CUDA events (bench's protocol:
    warm-up launches, the L2 cache flushed before each timed one)."""
    from numba import cuda

    from ..measure.bench import NumbaDevice, Timing

    device = NumbaDevice()
    D = q.shape[-1]
    qk_scale = default_scale(D) * LOG2E
    arrays = [cuda.to_device(x) for x in (q, k, v)] + [cuda.device_array(q.shape, dtype=np.float16)]

    def launcher(module):
        config = keyed_build(module, D)
        return lambda: config.launch(*arrays, False, qk_scale, stream=device.stream)

    mine_fn, theirs_fn = launcher(student), launcher(baseline)
    timing = Timing(warmup=2, repeats=TIMED_RUNS // 2)
    mine, theirs = [], []
    with gpu_timing_lock():
        for _ in range(2):  # alternate, so that clock drift or a busy neighbour hits both kernels alike
            mine += device.time_ms(mine_fn, timing)
            theirs += device.time_ms(theirs_fn, timing)
    return statistics.median(mine), statistics.median(theirs)


# The point of each phase beyond correctness; a phase not listed (and every new one) must be
# at least NOT_SLOWER times as fast as its reference solution.
# "Beats" means by a margin timing noise cannot supply (an unchanged kernel measures 1.00x
# +- a few percent); the committed H100 records show 1.57x (04 over 03) and 1.27x (05 over 04).
BEATS = 1.05
PHASE_POINTS: dict[str, Callable[[], list[Check]]] = {
    "04": lambda: [bank_conflicts_check(points=2), speed_check("03", at_least=BEATS, points=2)],
    "05": lambda: [speed_check("04", at_least=BEATS, points=2)],
    # the tensor cores: a gain far beyond timing noise, so the bar sits well above BEATS
    "06": lambda: [speed_check("05", at_least=1.5, points=2)],
    "07": lambda: [speed_check("06", at_least=1.5, points=2)],  # fragments in registers, no trip through smem
}


def point_checks(phase: ModuleType) -> list[Check]:
    make = PHASE_POINTS.get(phase.ID)
    return make() if make else [speed_check(None, at_least=NOT_SLOWER, points=1)]


_CHECKS: dict[str, list[Check]] = {}


def checks_for(phase) -> list[Check]:
    """Every graded check of a phase (by id, name or module), in the order they run."""
    phase = exercise_module(phase)
    if phase.ID not in _CHECKS:
        if phase.ID == PUZZLES_ID:  # lesson 00's puzzles, no phase: their checks are their own
            from .puzzle_checks import checks

            _CHECKS[phase.ID] = checks()
        elif getattr(phase, "BACKWARD", False):  # phase 11: graded by its gradients
            from .grade_backward import checks

            _CHECKS[phase.ID] = checks(phase)
        elif getattr(phase, "MODS", False):  # phase 14: graded with mods and a block mask
            from .grade_flex import checks

            _CHECKS[phase.ID] = checks(phase)
        else:
            _CHECKS[phase.ID] = region_checks(phase) + correctness_checks(phase) + point_checks(phase)
    return _CHECKS[phase.ID]


# ---------------------------------------------------------------------------------------------
# Loading the student's file
# ---------------------------------------------------------------------------------------------
def default_path(phase: ModuleType) -> Path:
    """lessons/exercises/NN_<name>.py: under the current directory, else in this source checkout
    (CheckoutNeeded where there is none: an installed package holds no exercise stubs)."""
    relative = Path("lessons", "exercises", f"{phase.ID}_{phase.NAME}.py")
    return relative if relative.exists() else repo_root("the exercise stubs (lessons/exercises/)") / relative


def describe_load_error(e: BaseException, path: Path) -> str:
    """The error and the line of the student's file it came from."""
    if isinstance(e, SyntaxError):
        return f"{Path(e.filename or path).name} line {e.lineno}: SyntaxError: {e.msg}"
    hint = ""
    if isinstance(e, ImportError) and "relative import" in str(e):
        hint = " (exercise files import absolutely: `from flashcore_numba.phases.common import ...`)"
    return describe_exception(e, path) + hint


def start(phase, path: Path | None = None, *, seed: int | None = None, on_gpu: bool | None = None) -> Grading:
    """Load the student's file for `phase` and return the grading context (nothing run yet)."""
    phase = exercise_module(phase)
    path = Path(path) if path else default_path(phase)
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    on_gpu = (not simulator_enabled()) if on_gpu is None else on_gpu
    try:
        student, error = load_module(path), None
    except Exception as e:  # noqa: BLE001 - a file that does not import fails every check, with the reason
        student, error = None, describe_load_error(e, path)
    return Grading(phase=phase, student=student, path=path, on_gpu=on_gpu, seed=seed, load_error=error)


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def score(results: list[Result]) -> tuple[int, int]:
    """(points earned, points available on this machine): skipped checks count in neither."""
    graded = [r for r in results if r.status != "skip"]
    return sum(r.earned for r in graded), sum(r.points for r in graded)


def full_marks(results: list[Result]) -> bool:
    return bool(results) and all(r.status != "fail" for r in results) and any(r.status == "pass" for r in results)


def command_line(g: Grading, *, seed: bool) -> str:
    relative = os.path.relpath(g.path)
    path = str(g.path) if relative.startswith("..") else relative  # outside the current directory: in full
    return f"flashcore grade {g.phase.ID} {path}" + (f" --seed {g.seed}" if seed else "")


def render(g: Grading, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(soft_wrap=True)
    mark = {"pass": "[green]pass[/green]", "fail": "[red]FAIL[/red]", "skip": "[yellow]skipped[/yellow]"}
    table = Table(title=f"Exercise {g.phase.ID}: {g.phase.TITLE}")
    table.add_column("#", justify="right")
    table.add_column("check")  # its name: what --only and --hint take
    table.add_column("what it checks")
    table.add_column("result")
    table.add_column("points", justify="right")
    table.add_column("time", justify="right")
    for i, r in enumerate(g.results, 1):
        points = "—" if r.status == "skip" else f"{r.earned}/{r.points}"
        table.add_row(str(i), r.name, r.title, mark[r.status], points,
                      "" if r.status == "skip" else f"{r.seconds:.0f} s")
    console.print(table)
    for i, r in enumerate(g.results, 1):
        if r.status != "pass":
            label = "FAIL" if r.status == "fail" else "skipped"
            console.print(f"{i}. {r.name} — {r.title}: {label}: {r.detail}", markup=False, highlight=False)
    earned, available = score(g.results)
    skipped = [r for r in g.results if r.status == "skip"]
    line = f"Score: {earned}/{available}"
    if skipped:
        worth = sum(r.points for r in skipped)
        line += f" ({len(skipped)} check{'s' * (len(skipped) != 1)} worth {worth} point{'s' * (worth != 1)} skipped)"
    console.print(line, markup=False, highlight=False)
    random_inputs = {c.name for c in checks_for(g.phase) if c.random_inputs}  # the checks a seed repeats
    if full_marks(g.results):
        console.print("Full marks.", highlight=False)
    elif any(r.status == "fail" and r.name in random_inputs for r in g.results):
        console.print(f"Inputs came from the hidden seed {g.seed}; `{command_line(g, seed=True)}` repeats "
                      f"this run exactly.", markup=False, highlight=False)
    failed = [r for r in g.results if r.status == "fail"]
    regions = [r for r in failed if r.kind == "region"]
    labels = [r.label for r in exercises.phase_regions(g.phase)]
    example = next((r.name for r in failed if r.name in labels), labels[0] if labels else "")
    stuck = (f"Stuck? `flashcore grade {g.phase.ID} --hint` gives a hint per region (--hint 2, 3 say more; "
             f"`--hint --only {example}`, one region's).")
    if regions:
        console.print(f"Start with the region check{'s' * (len(regions) != 1)} {', '.join(r.name for r in regions)}: "
                      f"each grades one region, with the rest of the file taken from the solution, so each "
                      f"shows progress on its own. {stuck}", markup=False, highlight=False)
    elif failed:
        console.print(stuck, markup=False, highlight=False)


def to_json(g: Grading) -> dict:
    earned, available = score(g.results)
    return {"phase": g.phase.ID, "file": str(g.path), "device": "gpu" if g.on_gpu else "simulator",
            "seed": g.seed, "load_error": g.load_error, "score": earned, "available": available,
            "full_marks": full_marks(g.results), "results": [asdict(r) for r in g.results]}


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def _parser() -> Parser:
    ids = ", ".join([PUZZLES_ID, *LESSONS])
    parser = Parser(prog="flashcore grade", description="Grade an exercise: points and a reason per check.")
    parser.add_argument("phase", metavar="NN", help=f"the phase of the exercise ({ids})")
    parser.add_argument("path", nargs="?", type=Path,
                        help="the solution to grade (default lessons/exercises/NN_<name>.py)")
    parser.add_argument("--seed", type=int, help="repeat a run: the seed printed by a failing one")
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this check, or with --hint "
                        "give only this region's hints (repeatable; the names of the results table's check "
                        "column and of --list: a region's label such as 03-a, or tail, s_one, ...)")
    parser.add_argument("--list", action="store_true", help="list the checks of the phase and exit")
    parser.add_argument("--hint", nargs="?", const=1, type=int, choices=(1, 2, 3), metavar="K",
                        help="print hints 1..K (1 the idea, 2 the helpers, 3 pseudo-code; default 1) of every "
                             "region, or of the regions named by --only, and exit")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON")
    return parser


def find_check(checks: list[Check], name: str) -> Check | None:
    """The check `name` names: its name (the label in the results table's check column) or an older
    name it kept (lesson 00's kernel names: add_ten for 00-a)."""
    name = name.strip()
    return next((c for c in checks if name == c.name or name in c.aliases), None)


def print_hints(phase: ModuleType, upto: int, only: list[str] | None) -> int:
    """`--hint K`: tiers 1..K of the hints of the phase's regions (those named by --only, if any: a
    region's label, or the name of a check that grades one region)."""
    from .hints import render_hints

    regions = exercises.phase_regions(phase)
    labels = [r.label for r in regions]
    wanted = []
    for name in only or ():
        check = find_check(checks_for(phase), name)
        label = name.strip() if name.strip() in labels else (check.region if check else "")
        if not label:
            what = (f"{name!r} is a check of the whole kernel, and hints are per region" if check
                    else f"{name!r} is not a region of exercise {phase.ID}")
            return _usage_error(f"--only: {what}; its regions are {', '.join(labels)}")
        wanted.append(label)
    chosen = [r for r in regions if not only or r.label in wanted]
    print(f"Hints for exercise {phase.ID} ({phase.TITLE}); `--hint {min(upto + 1, 3)}` "
          f"{'says more' if upto < 3 else 'is the last tier'}.\n")
    print(render_hints(chosen, upto), end="")
    return 0


def _usage_error(message: str) -> int:
    return usage_error("flashcore grade", message)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        phase = exercise_module(args.phase)
    except (ValueError, TypeError) as e:
        return _usage_error(f"NN: {e}")
    checks = checks_for(phase)
    names = [c.name for c in checks]
    if args.hint:
        return print_hints(phase, args.hint, args.only)
    if args.list:
        instructions = {r.label: r.instruction for r in exercises.phase_regions(phase)}
        for c in checks:
            cases = "; ".join(map(str, c.cases))
            points = f"{c.points} pt{'s' * (c.points != 1)}"
            print(f"{c.name:<18} {points:<7} {c.title}"
                  + (f": {instructions[c.region]}" if c.region else "")
                  + (" [GPU]" if c.gpu_only else "") + (f"\n{'':<25}{cases}" if cases else ""))
        return 0
    unknown = [n for n in args.only or () if find_check(checks, n) is None]
    if unknown:
        return _usage_error(f"--only: unknown check {unknown[0]!r}; the checks of exercise {phase.ID} are "
                            f"{', '.join(names)}")
    only = {find_check(checks, n).name for n in args.only or ()}
    try:
        path = args.path or default_path(phase)
    except CheckoutNeeded as e:
        return _usage_error(f"path: {e}; or name your exercise file: flashcore grade {phase.ID} "
                            f"path/to/{phase.ID}_{phase.NAME}.py")
    if not path.is_file():
        return _usage_error(f"path: no file {str(path)!r}; the exercise stubs are in lessons/exercises/ "
                            f"(regenerate them with python -m flashcore_numba.course.exercises --write)")

    target = kernel_target()  # the same rule as `flashcore run`
    if target == "none":
        print("No CUDA GPU found: grading in Numba's CUDA simulator on the CPU instead.", flush=True)
        return rerun_in_simulator("flashcore_numba.course.grade", argv)

    from rich.console import Console

    console = Console(soft_wrap=True)
    if not console.is_terminal:  # a pipe or a file: no terminal width to fit, keep table rows on one line
        console = Console(soft_wrap=True, width=120)
    g = start(phase, path, seed=args.seed, on_gpu=(target == "gpu"))
    where = "a GPU" if g.on_gpu else "the CUDA simulator (no GPU: slow, and the timing checks are skipped)"
    console.print(f"Grading {path} as exercise {phase.ID} ({phase.TITLE}) on {where}.",
                  markup=False, highlight=False)
    selected = [c for c in checks if not only or c.name in only]
    try:
        with console.status("") as status:
            for i, check in enumerate(selected, 1):
                status.update(f"check {i}/{len(selected)}: {check.title}")
                g.run(check)
    except KeyboardInterrupt:
        console.print("interrupted", highlight=False)
        return 130
    render(g, console)
    if args.json:
        args.json.write_text(json.dumps(to_json(g), indent=2) + "\n", encoding="utf-8")
    return 0 if full_marks(g.results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

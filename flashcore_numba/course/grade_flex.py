"""The graded checks of exercise 14, your own attention: mods and a block mask where the others grade plain attention.

`flashcore grade 14` runs them (grade.checks_for picks them for phase 14). The student's file,
lessons/exercises/14_flex.py, is loaded as every exercise is, and its kernel run by `run_kernel` on
NumPy arrays (its build_for, tiles and block_lists), with the mods of each case taken from the
student's file where it defines them (its `sliding_window_mod` and `softcap_mod`, the exercise's
regions 14-a and 14-b) and the block mask made on the host at the file's tiles:

- each case draws fresh fp16 q, k, v from the run's seed (k and v may have fewer heads); the output
  and the log-sum-exp start as NaN, and so do the kernel's local arrays in the simulator;
- the oracle is reference.reference_flex with the package's own mods (the solution's), float64:
  within twice the error of the oracle's output rounded to fp16, plus FlashAttention's atol. NaN
  never passes. A row the mask leaves no key gives zeros;
- a failure says what the pattern of the wrong elements suggests (diagnose.py, in the words of the
  region it most likely comes from), the worst element and a picture of the wrong rows and columns.

The checks: each region on its own (the solution with only that region from the student's file),
then one problem per check (a sliding window with tails and grouped heads, a soft-cap at large
scores with a prefix-LM mask, ALiBi with documents per batch, rows that see no key, NaN in the keys
of tiles the mask leaves empty, S = 1, D = 128), then on a GPU the speed of the student's kernel
against the solution's with a sliding window.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from .. import flex
from ..reference import ATOL, check_close, random_qkv, reference_flex, scaled_to_logits
from .checks import Check, Outcome
from .diagnose import CaseRun, describe_exception, explain
from .hints import hints_for
from .student import (
    RegionNotLoaded,
    gpu_timing_lock,
    kernel_diagnoses,
    load_region,
    poisoned_local_arrays,
    still_empty,
)

TIMING_SHAPE = (4, 8, 2048, 64)  # B, H, S, D of the GPU timing check
TIMING_WINDOW = 256  # its sliding window (left; causal): a band of tiles
TIMED_RUNS = 10


def some_rows_blind(b, h, q_idx, kv_idx):
    """Causal, and every fourth row sees no key at all (its output must be zeros)."""
    return (q_idx % 4 != 0) & (kv_idx <= q_idx)


def mods_of(name: str, B: int, H: int, S_k: int, seed) -> tuple:
    """(score_mod, mask_mod) of a case, the package's own (the solution's): the oracle's mods."""
    rng = np.random.default_rng(seed)
    if name == "window":
        return None, flex.sliding_window(10, 3)
    if name == "causal_window":
        return None, flex.sliding_window(TIMING_WINDOW)
    if name == "softcap+prefix":
        return flex.softcap(5.0), flex.prefix_lm(7)
    if name == "softcap":
        return flex.softcap(5.0), None
    if name == "alibi+documents":
        ids = np.sort(rng.integers(0, 3, (B, S_k)), axis=1).astype(np.int32)
        return flex.alibi(flex.alibi_slopes(H)), flex.document_mask(ids)
    if name == "rows_blind":
        return None, flex.mask_mod(some_rows_blind)
    if name == "causal":
        return None, flex.causal_mask()
    raise ValueError(f"no mods named {name!r}")


@dataclass(frozen=True)
class FlexCase:
    """One launch of a check: batch `batch`, `heads` query heads on `heads_kv` K/V heads, S_q = seq_q,
    S_k = seq_k, the mods named `mods` (mods_of)."""

    seq_q: int
    seq_k: int
    head_dim: int
    mods: str
    batch: int = 1
    heads: int = 1
    heads_kv: int = 1
    logits: float | None = None  # scale q and k so that the largest |score| is this
    nan_in_empty_tiles: bool = False  # the keys of tiles no query block sees are NaN

    def __str__(self) -> str:
        text = f"S_q={self.seq_q} S_k={self.seq_k} D={self.head_dim}, {self.mods}"
        if self.batch > 1:
            text += f", B={self.batch}"
        if self.heads != self.heads_kv:
            text += f", {self.heads} query heads on {self.heads_kv} K/V head{'s' * (self.heads_kv != 1)}"
        if self.logits:
            text += f", scores up to ±{self.logits:g}"
        return text + (", NaN in the keys of the empty tiles" if self.nan_in_empty_tiles else "")


def theirs(module: ModuleType, mod):
    """The case's mod with the student's function in place of the solution's where the student's file
    defines one of that name (the built-ins of phase 14's module), checked as flex checks any mod."""
    if mod is None:
        return None
    fn = mod.fn
    if getattr(fn, "__module__", "").endswith("phases.p14_flex") and hasattr(module, fn.__name__):
        fn = getattr(module, fn.__name__)
    make = flex.score_mod if mod.kind == "score_mod" else flex.mask_mod
    return make(fn, *mod.arrays)


def make_inputs(case: FlexCase, module: ModuleType, seed) -> dict:
    """fp16 q, k, v, the solution's mods and the oracle's output and allowed error."""
    shape = (case.batch, case.heads, case.seq_q, case.head_dim)
    q, k, v = random_qkv(shape, case.seq_k, heads_kv=case.heads_kv, seed=seed, dtype=np.float64)
    if case.logits:
        q, k = scaled_to_logits(q, k, case.logits)
    q, k, v = (x.astype(np.float16) for x in (q, k, v))
    score_mod, mask_mod = mods_of(case.mods, case.batch, case.heads, case.seq_k, seed)
    expected, _ = reference_flex(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    lowp = expected.astype(np.float16).astype(np.float64)
    allowed = 2.0 * float(np.max(np.abs(lowp - expected))) + ATOL
    if case.nan_in_empty_tiles and mask_mod is not None:
        tile = module.tiles(case.head_dim)
        kinds = flex.create_block_mask(mask_mod, case.batch, case.heads, case.seq_q, case.seq_k, tile["block_m"],
                                       tile["block_n"]).kinds
        for n in np.flatnonzero((kinds == flex.EMPTY).all(axis=(0, 1, 2))):  # no query block sees key tile n
            rows = slice(n * tile["block_n"], (n + 1) * tile["block_n"])
            k[:, :, rows] = np.nan
            v[:, :, rows] = np.nan
    return dict(q=q, k=k, v=v, score_mod=score_mod, mask_mod=mask_mod, expected=expected, allowed=allowed)


def run_kernel(module: ModuleType, q, k, v, score_mod=None, mask_mod=None):
    """(out, lse) of `module`'s kernel (phase 14's, or a student's file of it) on NumPy q, k, v ((B, H,
    S, D) fp16, k and v with as many heads or fewer): score_mod and mask_mod are flex.ScoreMod and
    flex.MaskMod, the block mask made on the host at the module's tiles, out and the LSE poisoned with
    NaN first. api.flex_attention is the library's call of the package's kernel."""
    from numba import cuda

    from ..phases.common import LOG2E, launch

    B, H, S_q, D = q.shape
    S_k = k.shape[2]
    tile = module.tiles(D)
    if mask_mod is None:
        kinds = np.full((1, 1, -(-S_q // tile["block_m"]), -(-S_k // tile["block_n"])), flex.FULL, np.int8)
    else:
        kinds = flex.create_block_mask(mask_mod, B, H, S_q, S_k, tile["block_m"], tile["block_n"]).kinds
    config = module.build_for(D, q.dtype.name, score_mod, mask_mod)
    lists = [cuda.to_device(x) for x in (*module.block_lists(kinds), kinds)]
    out = cuda.to_device(np.full(q.shape, np.nan, q.dtype))
    lse = cuda.to_device(np.full((B, H, S_q), np.nan, np.float32))
    qk_scale = np.float32(D ** -0.5 * LOG2E)
    args = [flex.device_arrays(mod if mod is not None else flex.Mod(None)) for mod in (score_mod, mask_mod)]
    launch(config.kernel, (-(-S_q // config.block_m), H, B), config.n_threads, config.smem_bytes,
           (*(cuda.to_device(x) for x in (q, k, v)), out.view(np.uint32), lse, qk_scale, *lists, *args))
    cuda.synchronize()
    return out.copy_to_host(), lse.copy_to_host()


def run_case(module: ModuleType, case: FlexCase, seed, path, mapped=None) -> CaseRun:
    """The module's kernel on the case (None out where it raised), as diagnose.py sees a launch."""
    x = make_inputs(case, module, seed)
    try:
        mods = [theirs(module, x[name]) for name in ("score_mod", "mask_mod")]
        with poisoned_local_arrays():
            out, _ = run_kernel(module, x["q"], x["k"], x["v"], *mods)
    except Exception as e:  # noqa: BLE001 - whatever the student's code raises is a failed case
        return CaseRun(str(case), case.seq_k, None, x["expected"], x["allowed"],
                       f"the kernel {describe_exception(e, path, **(mapped or {}))}")
    return CaseRun(str(case), case.seq_k, np.asarray(out, dtype=np.float64), x["expected"], x["allowed"])


def verdict(run: CaseRun) -> str:
    if run.error:
        return run.error
    nan = np.isnan(run.out)
    if nan.any():
        first = np.argwhere(nan)[0].tolist()
        hint = "; that row sees no key: it must give zeros" if not np.any(run.expected[tuple(first[:3])]) else ""
        return (f"{int(nan.sum())} of {run.out.size} outputs are NaN, first at [b, h, row, d] = {first}: never "
                f"written (the output was filled with NaN before the launch) or computed as NaN{hint}")
    return check_close(run.out, run.expected, run.expected, atol=run.allowed).message


def run_cases(g, check: Check) -> Outcome:
    """The case(s) of a correctness check, in order; stops at the first failure."""
    errors = []
    for index, case in enumerate(check.cases):
        run = run_case(g.student, case, g.case_seed(check, index), g.path)
        if not run.ok:
            explanation = "" if run.error else "\n" + explain([run], kernel_diagnoses(g))
            return Outcome("fail", f"{case}: {verdict(run)}{explanation}")
        errors.append(f"{float(np.max(np.abs(run.out - run.expected))):.1e}")
    n = len(check.cases)
    return Outcome("pass", f"{n} case{'s' * (n != 1)} correct (max error {', '.join(errors)})")


def run_region(g, check: Check) -> Outcome:
    """The region's cases in the solution's file with only that region from the student's, on past a
    failure so that the diagnosis sees every case."""
    try:
        module, path, spliced = load_region(g, check.region)
    except RegionNotLoaded as e:
        return Outcome("fail", str(e))
    mapped = {"lines": spliced.lines, "shown_as": g.path, "outside": spliced.outside}
    runs = [run_case(module, case, g.case_seed(check, i), path, mapped) for i, case in enumerate(check.cases)]
    if all(r.ok for r in runs):
        return Outcome("pass", f"{len(runs)} case{'s' * (len(runs) != 1)} correct "
                               f"({'; '.join(str(c) for c in check.cases)}), with only region {check.region} "
                               f"from your file")
    first = next(i for i, r in enumerate(runs) if not r.ok)
    lines = [f"{check.cases[first]}: {verdict(runs[first])}"]
    lines += still_empty(g, check.region, spliced)
    explanation = explain([r for r in runs if not r.error], hints_for(check.region).diagnoses)
    return Outcome("fail", "\n".join(lines + ([explanation] if explanation else [])))


def tiles(phase: ModuleType, head_dim: int) -> tuple[int, int]:
    tile = phase.tiles(head_dim)
    return tile["block_m"], tile["block_n"]


def region_cases(phase: ModuleType, label: str) -> tuple[FlexCase, ...]:
    """A case that runs the region's code, in seconds of the simulator: two query blocks, three key
    tiles of which the last part full, a mask with empty, partial and full tiles (the window's), or
    the soft-cap at large scores for the score mod."""
    D = phase.HEAD_DIMS[0]
    BM, BN = tiles(phase, D)
    if label.endswith("-b"):  # softcap_mod
        return (FlexCase(BM // 2 + 3, BN + 6, D, "softcap", logits=30.0),)
    return (FlexCase(BM + 6, 2 * BN + 6, D, "window", heads=2, heads_kv=1),)


def correctness_checks(phase: ModuleType) -> list[Check]:
    """One problem per check, as few simulated blocks as show the point:

        window          a window of 10 keys before and 3 after: empty, partial and full tiles, tails,
                        2 query heads on 1 K/V head
        softcap_prefix  soft-capping at 5 of scores up to ±30, with a prefix-LM mask
        alibi_documents ALiBi (a slope per head) and a document mask per batch: bound arrays read by
                        b, h, q_idx and kv_idx; B = 2
        rows_blind      every fourth row sees no key: zeros, never NaN
        empty_tiles     causal with S_k > S_q: the keys past S_q are NaN, in tiles no row sees
        s_one           S_q = S_k = 1
        head_dims       D = 128
    """
    D = phase.HEAD_DIMS[0]
    BM, BN = tiles(phase, D)
    short = BM // 2 + 3

    def check(name, title, case):
        return Check(name, title, 1, run=run_cases, cases=(case,))

    checks = [
        check("window", "a sliding window: empty, partial and full tiles, grouped heads",
              FlexCase(BM + 6, 2 * BN + 6, D, "window", heads=2, heads_kv=1)),
        check("softcap_prefix", "a soft-cap at large scores, a prefix-LM mask",
              FlexCase(short, BN + 6, D, "softcap+prefix", logits=30.0)),
        check("alibi_documents", "ALiBi and documents per batch: the mods' arrays",
              FlexCase(short, BN + 6, D, "alibi+documents", batch=2, heads=2, heads_kv=2)),
        check("rows_blind", "rows that see no key give zeros", FlexCase(short, short, D, "rows_blind")),
        check("empty_tiles", "the keys of empty tiles are never read (NaN there)",
              FlexCase(short, 3 * BN + 6, D, "causal", nan_in_empty_tiles=True)),
        check("s_one", "S = 1", FlexCase(1, 1, D, "window")),
    ]
    for d in phase.HEAD_DIMS[1:]:
        bm, bn = tiles(phase, d)
        checks.append(check("head_dims", f"head dim {d}", FlexCase(bm // 2 + 3, bn + 6, d, "window")))
    return checks


def speed_check(at_least: float = 0.8) -> Check:
    """On a GPU: the student's kernel at least `at_least` x the solution's speed at TIMING_SHAPE with a
    causal sliding window of TIMING_WINDOW keys, after a correct run there (batch 0, head 0 checked)."""

    def run(g, check: Check) -> Outcome:
        B, H, S, D = TIMING_SHAPE
        shape = f"B={B} H={H} S={S} D={D}, a window of {TIMING_WINDOW}"
        case = FlexCase(S, S, D, "causal_window", batch=1, heads=1)
        x = make_inputs(case, g.student, g.case_seed(check, 0))
        try:
            mods = [theirs(g.student, x[name]) for name in ("score_mod", "mask_mod")]
            q, k, v = (np.ascontiguousarray(np.broadcast_to(x[n], (B, H, S, D))) for n in ("q", "k", "v"))
            out, _ = run_kernel(g.student, q, k, v, *mods)
        except Exception as e:  # noqa: BLE001
            return Outcome("fail", f"{shape}: the kernel {describe_exception(e, g.path)}")
        got = CaseRun(str(case), S, out[:1, :1].astype(np.float64), x["expected"], x["allowed"])
        if not got.ok:
            return Outcome("fail", f"not timed: wrong at {shape} ({verdict(got)})")
        mine, solution = time_against(g.student, g.phase, q, k, v, mods, [x["score_mod"], x["mask_mod"]])
        ratio = solution / mine
        return Outcome("pass" if ratio >= at_least else "fail",
                       f"{ratio:.2f}x the reference solution's speed (yours {mine:.3f} ms, the solution "
                       f"{solution:.3f} ms; medians of {TIMED_RUNS} at {shape}); needs at least {at_least:.2f}x")

    return Check("speed_vs_solution", f"speed: at least {at_least:g}x the reference solution", 1, run,
                 gpu_only=True, kind="point")


def time_against(student: ModuleType, baseline: ModuleType, q, k, v, their_mods, our_mods) -> tuple[float, float]:
    """Median milliseconds of the two kernels on the same device arrays and block lists, timed
    alternately as grade.time_against times the forward kernels."""
    from numba import cuda

    from ..measure.bench import NumbaDevice, Timing
    from ..phases.common import LOG2E, launch

    device = NumbaDevice()
    B, H, S, D = q.shape
    inputs = [cuda.to_device(x) for x in (q, k, v)]
    out = cuda.device_array(q.shape, np.float16).view(np.uint32)
    lse = cuda.device_array((B, H, S), np.float32)
    qk_scale = np.float32(D ** -0.5 * LOG2E)

    def launcher(module, mods):
        score_mod, mask_mod = mods
        tile = module.tiles(D)
        kinds = flex.create_block_mask(mask_mod, None, None, S, S, tile["block_m"], tile["block_n"]).kinds
        lists = [cuda.to_device(a) for a in (*module.block_lists(kinds), kinds)]
        args = [flex.device_arrays(m if m is not None else flex.Mod(None)) for m in mods]
        config = module.build_for(D, "float16", score_mod, mask_mod)
        grid = (-(-S // config.block_m), H, B)
        return lambda: launch(config.kernel, grid, config.n_threads, config.smem_bytes,
                              (*inputs, out, lse, qk_scale, *lists, *args), device.stream)

    mine_fn, theirs_fn = launcher(student, their_mods), launcher(baseline, our_mods)
    timing = Timing(warmup=2, repeats=TIMED_RUNS // 2)
    mine, solution = [], []
    with gpu_timing_lock():
        for _ in range(2):
            mine += device.time_ms(mine_fn, timing)
            solution += device.time_ms(theirs_fn, timing)
    return statistics.median(mine), statistics.median(solution)


def checks(phase: ModuleType) -> list[Check]:
    """Every graded check of exercise 14, in the order they run."""
    from . import exercises

    regions = [Check(r.label, f"region {r.label} on its own", 1, run=run_region, kind="region",
                     cases=region_cases(phase, r.label), region=r.label) for r in exercises.phase_regions(phase)]
    return regions + correctness_checks(phase) + [speed_check()]

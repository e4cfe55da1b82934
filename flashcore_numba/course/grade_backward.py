"""The graded checks of exercise 11, the backward pass: gradients where the other exercises grade an output.

`flashcore grade 11` runs them (grade.checks_for picks them for a phase with BACKWARD set). The
student's file, lessons/exercises/11_backward.py, is loaded as every exercise is, and run through
its own `backward()` helper on NumPy arrays, the way tests/test_backward.py runs the phase:

- each case draws fresh fp16 q, k, v and dO from the run's seed; O and the log-sum-exp are what
  the forward saved (the float64 reference's, O rounded to fp16). dQ, dK and dV start as NaN
  (the helper poisons them), and so do the kernels' local arrays in the simulator.
- the oracle, per gradient: within twice the yardstick's error plus gradient_atol (1e-3 of the
  gradient's largest value), where the yardstick is the same formulas computed as the kernels
  compute them (float32 sums of fp16 P and dS: reference_gradients(lowp="float16")) and the
  reference is float64. NaN never passes.
- a failure says which of dQ, dK and dV are wrong, and what that means: dV = Pᵀ dO needs only P,
  dK and dQ need dS as well, and only dQ needs the sum over key blocks (`WHICH`). Then, on the
  wrong gradients, the patterns of diagnose.py (all zeros, a constant factor, ...), the worst
  element and a picture of the wrong rows and columns.

The checks: each region on its own (the solution with only that region from the student's file,
grade.load_region), then one problem per check (the tiles' multiple, a tail with rows that see no
key, grouped-query heads, S = 1, large scores, D = 128, the deterministic dQ), then on a GPU the
speed of the student's backward against the solution's.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from ..reference import (
    check_close,
    default_scale,
    gradient_atol,
    gradient_oracle,
    random_qkv,
    reference_attention,
    reference_lse,
    scaled_to_logits,
)
from .checks import Check, Outcome
from .diagnose import CaseRun, diagnose, excerpt, picture
from .hints import hints_for
from .student import (
    RegionNotLoaded,
    gpu_timing_lock,
    kernel_diagnoses,
    load_region,
    poisoned_local_arrays,
    still_empty,
)

NAMES = ("dq", "dk", "dv")
# What the set of wrong gradients says (dV = Pᵀ dO needs P; dK = scale · dSᵀ Q and dQ = scale · dS K
# need dS = P ∘ (dP − Δ) too; dQ alone is summed over the key blocks). A region may word its own
# (hints.py, diagnoses keyed "wrong:dq+dk").
WHICH = {
    "dq": "dK and dV are right, dQ is not: dS is right (dK comes from it too), so dQ = scale · dS K is "
          "not summed over the key blocks as it should be",
    "dq+dk": "dV = Pᵀ dO is right, so P is; dQ and dK, which both come from dS = P ∘ (dP − Δ), are not: "
             "dS, or the Δ it subtracts, is wrong",
    "dk": "dQ and dV are right, dK is not: dK = scale · dSᵀ Q, summed over the group's query heads, is "
          "not accumulated or not stored right",
    "dv": "dQ and dK are right, dV is not: dV = Pᵀ dO, summed over the group's query heads, is not "
          "accumulated or not stored right",
    "dq+dk+dv": "every gradient is wrong: P itself (recomputed from the scores and the saved log-sum-exp) "
                "or the problem's inputs are read wrong",
}
TIMING_SHAPE = (4, 8, 1024, 64)  # B, H, S, D of the GPU timing check
TIMED_RUNS = 10


@dataclass(frozen=True)
class GradientCase:
    """One backward of a check: B = 1, `heads` query heads sharing `heads_kv` K/V heads."""

    seq_q: int
    seq_k: int
    head_dim: int
    causal: bool = False
    heads: int = 1
    heads_kv: int = 1
    deterministic: bool = False
    logits: float | None = None  # scale q and k so that the largest |score| is this

    def __str__(self) -> str:
        text = f"S_q={self.seq_q} S_k={self.seq_k} D={self.head_dim} {'causal' if self.causal else 'non-causal'}"
        if self.heads != self.heads_kv:
            text += f", {self.heads} query heads on {self.heads_kv} K/V head{'s' * (self.heads_kv != 1)}"
        if self.logits:
            text += f", scores up to ±{self.logits:g}"
        return text + (", deterministic dQ" if self.deterministic else "")


def make_inputs(case: GradientCase, seed) -> dict:
    """fp16 q, k, v and dO, and what the forward saved: O (fp16) and the log-sum-exp (float32)."""
    shape = (1, case.heads, case.seq_q, case.head_dim)
    q, k, v = random_qkv(shape, case.seq_k, heads_kv=case.heads_kv, seed=seed, dtype=np.float64)
    if case.logits:
        q, k = scaled_to_logits(q, k, case.logits)
    q, k, v = (x.astype(np.float16) for x in (q, k, v))
    do = np.random.default_rng(seed).standard_normal(shape).astype(np.float16)
    o = reference_attention(q, k, v, causal=case.causal).astype(np.float16)
    lse = reference_lse(q, k, causal=case.causal).astype(np.float32)
    return dict(q=q, k=k, v=v, o=o, do=do, lse=lse)


def launch(module: ModuleType, case: GradientCase, x: dict) -> tuple[np.ndarray, ...]:
    """(dq, dk, dv) as float64 from the module's backward() (local arrays poisoned in the simulator)."""
    with poisoned_local_arrays():
        grads = module.backward(x["q"], x["k"], x["v"], x["o"], x["do"], x["lse"], causal=case.causal,
                                deterministic=case.deterministic)
    return tuple(np.asarray(g, dtype=np.float64) for g in grads)


def gradient_runs(case: GradientCase, x: dict, got, error: str = "") -> dict[str, CaseRun]:
    """Each gradient's CaseRun (diagnose.py's view of one output against the oracle)."""
    ref, yardstick = gradient_oracle(x["q"], x["k"], x["v"], x["do"], causal=case.causal)
    runs = {}
    for i, name in enumerate(NAMES):
        allowed = 2.0 * float(np.max(np.abs(yardstick[i] - ref[i]))) + gradient_atol(ref[i])
        runs[name] = CaseRun(f"{case}: {name}", case.seq_k, None if got is None else got[i], ref[i], allowed, error)
    return runs


def verdicts(runs: dict[str, CaseRun]) -> list[str]:
    """'dq: max error ... <= allowed ...' per gradient, check_close's words."""
    out = []
    for name, r in runs.items():
        out.append(f"{name}: " + check_close(r.out, r.expected, r.expected, atol=r.allowed).message)
    return out


def explain(case_runs: list[dict[str, CaseRun]], messages: dict[str, str] | None = None) -> str:
    """Which gradients are wrong and what that says, the pattern of the wrong ones (diagnose.py),
    then the worst wrong gradient's excerpt and picture."""
    messages = messages or {}
    ran = [runs for runs in case_runs if all(r.out is not None for r in runs.values())]
    failing = [runs for runs in ran if not all(r.ok for r in runs.values())]
    if not failing:
        return ""
    worst = max(failing, key=lambda runs: runs["dq"].out.size)
    wrong = [name for name in NAMES if not worst[name].ok]
    key = "+".join(wrong)
    lines = [f"wrong: {', '.join(wrong)}; right: {', '.join(n for n in NAMES if n not in wrong) or 'none'}"]
    if f"wrong:{key}" in messages or key in WHICH:
        lines.append(f"diagnosis: {messages.get(f'wrong:{key}', WHICH.get(key))}")
    patterns: dict[str, list[str]] = {}  # a pattern's words -> the gradients that show it, said once
    for name in wrong:
        pattern = diagnose([runs[name] for runs in ran], messages)
        if pattern:
            patterns.setdefault(pattern, []).append(name)
    lines += [f"{', '.join(names)}: {pattern}" for pattern, names in patterns.items()]
    r = worst[wrong[0]]
    lines.append(f"in case {r.label}:")
    if not np.isnan(np.asarray(r.out, dtype=np.float64)).all():
        lines.append(excerpt(r.out, r.expected, r.allowed))
    lines.append(picture(r.out, r.expected, r.allowed))
    return "\n".join(lines)


def run_case(module: ModuleType, case: GradientCase, seed, path, mapped=None) -> dict[str, CaseRun]:
    from .diagnose import describe_exception

    x = make_inputs(case, seed)
    try:
        got = launch(module, case, x)
    except Exception as e:  # noqa: BLE001 - whatever the student's backward raises is a failed case
        return gradient_runs(case, x, None, error=f"the kernel {describe_exception(e, path, **(mapped or {}))}")
    return gradient_runs(case, x, got)


def run_cases(g, check: Check) -> Outcome:
    """The case(s) of a correctness check, in order; stops at the first failure."""
    errors = []
    for index, case in enumerate(check.cases):
        runs = run_case(g.student, case, g.case_seed(check, index), g.path)
        error = next((r.error for r in runs.values() if r.error), "")
        if error:
            return Outcome("fail", f"{case}: {error}")
        if not all(r.ok for r in runs.values()):
            explanation = explain([runs], kernel_diagnoses(g))
            return Outcome("fail", f"{case}: " + "; ".join(verdicts(runs)) + "\n" + explanation)
        errors.append(", ".join(f"{name} {check_close(r.out, r.expected, r.expected, atol=r.allowed).max_err:.1e}"
                                for name, r in runs.items()))
    return Outcome("pass", f"correct (max errors {'; '.join(errors)})")


def run_region(g, check: Check) -> Outcome:
    """The region's cases in the solution's file with only that region from the student's, on past a
    failure so that the diagnosis sees every case."""
    try:
        module, path, spliced = load_region(g, check.region)
    except RegionNotLoaded as e:
        return Outcome("fail", str(e))
    mapped = {"lines": spliced.lines, "shown_as": g.path, "outside": spliced.outside}
    case_runs = [run_case(module, case, g.case_seed(check, index), path, mapped)
                 for index, case in enumerate(check.cases)]
    if all(r.ok for runs in case_runs for r in runs.values()):
        return Outcome("pass", f"{len(case_runs)} case{'s' * (len(case_runs) != 1)} correct "
                               f"({'; '.join(str(c) for c in check.cases)}), with only region {check.region} "
                               f"from your file")
    first = next(i for i, runs in enumerate(case_runs) if not all(r.ok for r in runs.values()))
    runs = case_runs[first]
    error = next((r.error for r in runs.values() if r.error), "")
    lines = [f"{check.cases[first]}: {error or '; '.join(verdicts(runs))}"]
    lines += still_empty(g, check.region, spliced)
    explanation = explain(case_runs, hints_for(check.region).diagnoses)
    return Outcome("fail", "\n".join(lines + ([explanation] if explanation else [])))


def tiles(phase: ModuleType, head_dim: int) -> tuple[int, int]:
    """(query rows per tile, keys per block) of kv_kernel as `phase` builds it here (smaller in the
    simulator), so that the graded shapes cross their edges."""
    kv = phase.build(head_dim).kv
    return kv["STREAM_ROWS"], kv["OWN_ROWS"]


def region_cases(phase: ModuleType) -> tuple[GradientCase, ...]:
    """Two query tiles against two key blocks, the last ones part full: every loop and every sum of
    the kernels runs (the sum over a group's heads is the gqa check's), in seconds of the simulator."""
    D = phase.HEAD_DIMS[0]
    BM, BN = tiles(phase, D)
    return (GradientCase(BM + 4, BN + 6, D),)


def correctness_checks(phase: ModuleType) -> list[Check]:
    """One problem per check, as few simulated blocks as show the point:

        tile_multiple  S_q = S_k a multiple of both tiles, causal: the diagonal tiles masked
        tail           S_q = BM + BN + 6 > S_k = BN + 6, causal: the first BM rows see no key
                       and give no gradient; partial tiles of rows and keys
        gqa            2 query heads on 1 K/V head: dK and dV summed over the group
        s_one          S_q = S_k = 1
        large_logits   scores up to ±30: the softmax nearly one-hot, P from the log-sum-exp exact
        head_dims      D = 128
        deterministic  dQ summed by a block per part, its key blocks in turn (the serial build), causal
    """
    D = phase.HEAD_DIMS[0]
    BM, BN = tiles(phase, D)
    S = math.lcm(BM, BN)
    short = min(BM, BN) // 3 + 1

    def check(name, title, case):
        return Check(name, title, 1, run=run_cases, cases=(case,))

    checks = [
        check("tile_multiple", "S a multiple of the tiles, causal", GradientCase(S, S, D, causal=True)),
        check("tail", "S not a multiple of the tiles; rows that see no key give nothing",
              GradientCase(BM + BN + 6, BN + 6, D, causal=True)),
        check("gqa", "grouped-query heads: dK and dV summed over each group",
              GradientCase(short, BN + 6, D, heads=2, heads_kv=1)),
        check("s_one", "S = 1", GradientCase(1, 1, D)),
        check("large_logits", "large logits (scores up to ±30)", GradientCase(short, BN + 6, D, logits=30.0)),
    ]
    for d in phase.HEAD_DIMS[1:]:
        bm, bn = tiles(phase, d)
        checks.append(check("head_dims", f"head dim {d}", GradientCase(min(bm, bn) // 3 + 1, bn + 6, d)))
    checks.append(check("deterministic", "deterministic dQ (each block's key blocks in turn), causal",
                        GradientCase(BM + 4, BN + 6, D, causal=True, deterministic=True)))
    return checks


def speed_check(at_least: float = 0.8) -> Check:
    """On a GPU: the student's backward (atomic dQ) at least `at_least` x the solution's speed at
    TIMING_SHAPE, after a correct run there."""

    def run(g, check: Check) -> Outcome:
        B, H, S, D = TIMING_SHAPE
        shape = f"B={B} H={H} S={S} D={D}"
        case = GradientCase(S, S, D, heads=H, heads_kv=H)
        x = make_inputs(case, g.case_seed(check, 0))
        x = {k: np.repeat(v, B, axis=0) for k, v in x.items()}
        runs = gradient_runs(case, {k: v[:1] for k, v in x.items()}, None)
        try:
            got = launch(g.student, case, x)
        except Exception as e:  # noqa: BLE001
            from .diagnose import describe_exception

            return Outcome("fail", f"{shape}: the kernel {describe_exception(e, g.path)}")
        runs = {name: CaseRun(r.label, r.seq_k, got[i][:1], r.expected, r.allowed)
                for i, (name, r) in enumerate(runs.items())}
        if not all(r.ok for r in runs.values()):
            return Outcome("fail", f"not timed: wrong at {shape} ({'; '.join(verdicts(runs))})")
        mine, theirs = time_against(g.student, g.phase, x)
        ratio = theirs / mine
        return Outcome("pass" if ratio >= at_least else "fail",
                       f"{ratio:.2f}x the reference solution's speed (yours {mine:.3f} ms, the solution "
                       f"{theirs:.3f} ms; medians of {TIMED_RUNS} at {shape}); needs at least {at_least:.2f}x")

    return Check("speed_vs_solution", f"speed: at least {at_least:g}x the reference solution", 1, run,
                 gpu_only=True, kind="point")


def time_against(student: ModuleType, baseline: ModuleType, x: dict) -> tuple[float, float]:
    """Median milliseconds of the two backwards (Backward.run on the same device arrays, atomic dQ),
    timed alternately as grade.time_against times the forward kernels."""
    from numba import cuda

    from ..measure.bench import NumbaDevice, Timing

    device = NumbaDevice()
    q = x["q"]
    D = q.shape[-1]
    inputs = [cuda.to_device(x[name]) for name in ("q", "k", "v", "o", "do", "lse")]
    outputs = [cuda.device_array(q.shape, np.float32), cuda.device_array(x["k"].shape, np.float16),
               cuda.device_array(x["v"].shape, np.float16)]
    delta = cuda.device_array(q.shape[:3], np.float32)  # allocated once: a free inside the timing would wait

    def launcher(module):
        backward = module.build(D)
        return lambda: backward.run(*inputs, *outputs, False, default_scale(D), stream=device.stream, delta=delta)

    mine_fn, theirs_fn = launcher(student), launcher(baseline)
    timing = Timing(warmup=2, repeats=TIMED_RUNS // 2)
    mine, theirs = [], []
    with gpu_timing_lock():
        for _ in range(2):
            mine += device.time_ms(mine_fn, timing)
            theirs += device.time_ms(theirs_fn, timing)
    return statistics.median(mine), statistics.median(theirs)


def checks(phase: ModuleType) -> list[Check]:
    """Every graded check of exercise 11, in the order they run."""
    from . import exercises

    cases = region_cases(phase)
    regions = [Check(r.label, f"region {r.label} on its own", 1, run=run_region, kind="region", cases=cases,
                     region=r.label) for r in exercises.phase_regions(phase)]
    return regions + correctness_checks(phase) + [speed_check()]

"""The graded exercises: stubs in sync with the phases, and graded checks that can fail and can pass.

Two kinds of test:

- the stubs (cheap, text only): each committed stub is exactly what flashcore_numba.course.exercises
  generates from its phase; every phase has at least one marked region; solving only adds
  lines; every region matters (removing it changes the program, not just comments).
- the grader (simulator runs): for every phase, each graded check FAILS on the untouched stub
  and PASSES on the reference solution (the phase module itself); a check that cannot fail
  is a defect. `python -m flashcore_numba.course.grade 03` prints a failing score with a reason per
  check on the stub and full marks on the solution. Checks that need a GPU are skipped in
  the simulator with their reason; their fail-on-stub / pass-on-solution tests are marked
  `gpu` and run with FLASHCORE_GPU=1 on a GPU machine.

The grader runs as a subprocess per (phase, stub or solution), exactly as a student runs it;
they start as soon as the session's tests are known, in the shared pool of background jobs (the
root conftest.py), one per core; on a GPU too, where their timed launches take turns with the
session's other GPU tests. Each subprocess writes its results as
JSON, which the per-check tests read.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from flashcore_numba.arch.sim import simulator_enabled
from flashcore_numba.course import exercises, grade
from flashcore_numba.phases import LESSONS

REPO = Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = 900

# Checks that a phase's untouched stub passes by design, and the phase whose stub proves them
# able to fail instead. Phases 03-05 share their tiles, so their correctness checks are the
# same checks (same cases, same code); test_check_fails_on_stub verifies that equality.
# - 04: the exercise is pure performance: the stub (SMEM_PAD = 0) is phase 03's layout and
#   computes the right numbers, only slower.
# - 05: with a single key tile there is no next tile to prefetch, so the emptied prefetch
#   regions never run: the single-tile cases are right on the stub.
STUB_RIGHT_BY_DESIGN = {
    "04": ("03", {c.name for c in grade.checks_for("04") if c.kind == "correctness"}),
    "05": ("03", {"short", "s_one"}),
}

# Checks that a stub passes by design with no donor phase sharing them, and the deliberately wrong
# answer, filled into the phase's own regions, that proves them able to fail instead.
# - 09: the regions are TMA box coordinates; a problem within the first query tile and the first 64
#   keys has them all 0, the stub's values. One key off, the V boxes bring the wrong rows.
# - 13: 13-a is TMA box coordinates again (the producer's), all 0 within one box; one row off
#   brings the wrong rows. 13-b's walk never moves in a problem of one query tile.
WRONG_ANSWER = {
    "09": ({"short", "s_one"}, {"09-b": "col = int32(64 * a)\nrow = int32(n * BLOCK_N + 64 * box + 1)"}),
    "13": ({"s_one"}, {"13-a": "col = int32(64 * a)\nrow = int32(row0 + 64 * r + 1)"}),
}


def _stub_proof(phase_id: str, check_name: str) -> tuple[str, str]:
    """The run that must fail this check: (phase, "stub"), a donor's (donor, "stub"), or (phase, "wrong")."""
    if check_name in WRONG_ANSWER.get(phase_id, (set(), {}))[0]:
        return phase_id, "wrong"
    donor, names = STUB_RIGHT_BY_DESIGN.get(phase_id, (None, set()))
    return (donor if check_name in names else phase_id), "stub"


def _all_checks() -> list:
    """Every graded check of every phase, as pytest params (a list: pytest 9 deprecates generators)."""
    return [pytest.param(phase.ID, check.name, marks=[pytest.mark.gpu] if check.gpu_only else [],
                         id=f"{phase.ID}-{check.name}")
            for phase in LESSONS.values() for check in grade.checks_for(phase)]


# ---------------------------------------------------------------------------------------------
# The stubs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("phase_id", list(LESSONS))
def test_every_phase_has_regions_and_a_stub(phase_id):
    phase = LESSONS[phase_id]
    assert exercises.phase_regions(phase), f"phase {phase_id} has no `# >>> exercise` region"
    path = exercises.stub_path(phase)
    assert path.is_file(), f"{path} is missing: run python -m flashcore_numba.course.exercises --write"


@pytest.mark.parametrize("phase_id", [exercises.PUZZLES_ID, *LESSONS])
def test_region_labels_follow_the_order_of_the_file(phase_id):
    """A reader meets 10-a before 10-b: in the stub's list, in the file and in the grader's table
    (10-b once came first in the file, and 11-c and 12-c led theirs). A single region is the phase's id."""
    regions = exercises.phase_regions(exercises.exercise_module(phase_id))
    labels = [r.label for r in regions]
    assert labels == ([phase_id] if len(regions) == 1 else [f"{phase_id}-{chr(ord('a') + i)}" for i in range(len(regions))])
    assert [r.begin for r in regions] == sorted(r.begin for r in regions)


def test_the_11c_instruction_ends_its_sentence():
    """An instruction says what to write in words a student can act on (11-c's once ended "...rows that
    exist only")."""
    instruction = next(r.instruction for r in exercises.phase_regions(LESSONS["11"]) if r.label == "11-c")
    assert instruction.endswith("only in the rows that exist (row < seq_q)"), instruction


@pytest.mark.parametrize("phase_id", list(LESSONS))
def test_stub_is_in_sync_with_its_phase(phase_id):
    phase = LESSONS[phase_id]
    path = exercises.stub_path(phase)
    committed = path.read_text(encoding="utf-8") if path.exists() else ""
    assert committed == exercises.stub_source(phase), (
        f"{path.relative_to(REPO)} differs from the stub generated from {Path(phase.__file__).name}: "
        f"after changing the phase run `python -m flashcore_numba.course.exercises --write` (if you are "
        f"solving the exercise in place, this failure is expected)")


@pytest.mark.parametrize("phase_id", list(LESSONS))
def test_solving_only_adds_lines(phase_id):
    """The stub's lines are a subsequence of the solved file's: a student never deletes a line."""
    phase = LESSONS[phase_id]
    solved = iter(exercises.solution_source(phase).splitlines())
    for number, line in enumerate(exercises.stub_source(phase).splitlines(), 1):
        assert any(line == other for other in solved), f"stub line {number} is not in the solution: {line!r}"


@pytest.mark.parametrize("phase_id", list(LESSONS))
def test_every_region_changes_the_program(phase_id):
    """Emptying any one region changes the code (its AST), not merely comments or blank lines."""
    phase = LESSONS[phase_id]
    source = exercises.exercise_source(phase)
    full = ast.dump(ast.parse(source))
    for region in exercises.phase_regions(phase):
        emptied = exercises.strip_regions(source, [region])
        assert ast.dump(ast.parse(emptied)) != full, f"region {region.label} holds no code"


@pytest.mark.parametrize("phase_id", list(LESSONS))
def test_stub_imports_absolutely_and_loads(phase_id, tmp_path):
    phase = LESSONS[phase_id]
    stub = exercises.stub_source(phase)
    assert not [line for line in stub.splitlines() if line.lstrip().startswith("from .")]
    path = tmp_path / exercises.stub_name(phase)
    path.write_text(stub, encoding="utf-8")
    module = grade.load_module(path)  # standalone: no package-relative import left
    assert module.ID == phase.ID and callable(module.build)


def test_exercises_command_reports_in_sync():
    assert exercises.main([]) == 0


def test_stub_generation_from_marked_source():
    source = (
        "from ..common import key_end\n"
        "from .p03_warp_shuffle import layout\n"
        "def f(x):\n"
        "    y = 0\n"
        "    # >>> exercise 09-a: double x\n"
        "    y = 2 * x\n"
        "    # <<< exercise\n"
        "    return y\n"
    )
    regions = exercises.find_regions(source, "p09.py")
    assert [(r.label, r.instruction, r.solution) for r in regions] == [("09-a", "double x", ("    y = 2 * x",))]
    stub = exercises.absolute_imports(exercises.strip_regions(source, regions), "flashcore_numba.phases")
    assert stub.splitlines() == [
        "from flashcore_numba.common import key_end",
        "from flashcore_numba.phases.p03_warp_shuffle import layout",
        "def f(x):",
        "    y = 0",
        "    # >>> exercise 09-a: double x",
        "    # <<< exercise",
        "    return y",
    ]
    filled = exercises.fill_regions(stub, {"09-a": "y = 3 * x"})
    assert "    y = 3 * x\n    # <<< exercise" in filled


@pytest.mark.parametrize("source, error", [
    ("# >>> exercise a: x\ny = 1\n", "never closed"),
    ("y = 1\n# <<< exercise\n", "without an opening"),
    ("# >>> exercise a: x\n# >>> exercise b: y\n# <<< exercise\n", "inside the region"),
    ("# >>> exercise a: x\n\n# <<< exercise\n", "empty"),
    ("# >>> exercise\ny = 1\n# <<< exercise\n", "malformed"),
    ("# >>> exercise a: x\ny = 1\n# <<< exercise\n# >>> exercise a: z\ny = 2\n# <<< exercise\n", "unique"),
])
def test_malformed_markers_are_reported_with_their_line(source, error):
    with pytest.raises(exercises.ExerciseFormatError, match=error):
        exercises.find_regions(source, "p09.py")


# ---------------------------------------------------------------------------------------------
# The grader, run as students run it
# ---------------------------------------------------------------------------------------------
@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    report: dict | None

    def result(self, check_name: str) -> dict:
        assert self.report is not None, f"the grader wrote no report:\n{self.stdout}\n{self.stderr}"
        for r in self.report["results"]:
            if r["name"] == check_name:
                return r
        raise AssertionError(f"check {check_name} did not run:\n{self.stdout}")


class GraderRuns:
    """Grader subprocesses, started together once the session's tests are known (conftest.py; when
    the first test needs one, in a pool of their own, where the session started none), waited for
    per test. On a GPU they compile side by side and take turns timing (grade.gpu_timing_lock),
    with each other and with the session's other GPU tests."""

    def __init__(self, workdir: Path, phase_ids, pool: ThreadPoolExecutor | None = None, checks=None):
        self.workdir = workdir
        self.checks = checks or {}  # phase -> the check names its runs must grade (absent or None: all)
        self.futures: dict[tuple[str, str], Future] = {}
        self.procs: list[subprocess.Popen] = []
        self.closed = False
        # A grader per core, on a GPU too: most of a GPU run is compiling the student's kernel, and
        # the timed launches of concurrent graders take turns (grade.gpu_timing_lock).
        workers = max(1, os.cpu_count() or 1)
        self.own_pool = pool is None
        self.pool = ThreadPoolExecutor(max_workers=workers) if pool is None else pool
        jobs = []
        for pid in phase_ids:
            jobs += [(pid, "solution"), (pid, "stub")] + ([(pid, "wrong")] if pid in WRONG_ANSWER else [])
        if self.checks:  # on a GPU: leave out a run no selected test reads
            jobs = [job for job in jobs if self._checks_of(*job) != []]
        # The longest first (later phases are slower in the simulator; a solution runs every case)
        for job in sorted(jobs, key=lambda j: (-int(j[0]), j[1] != "solution")):
            self.futures[job] = self.pool.submit(self._run, *job)

    def _command(self, pid: str, variant: str):
        phase = LESSONS[pid]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        out = self.workdir / f"{pid}_{variant}.json"
        argv = [sys.executable, "-m", "flashcore_numba.course.grade", pid]
        if variant == "solution":  # the phase module itself, by its path in the repository
            cwd = REPO
            argv.append(str(Path(phase.__file__).relative_to(REPO)))
        else:  # the default path, lessons/exercises/NN_<name>.py, holding the generated stub
            # a folder per run: the stub and the wrong answer of one phase are graded side by side,
            # and a grader reads its file again for each region check (in one folder, the wrong
            # answer's file replaced the stub's halfway through the stub's run)
            cwd = self.workdir / f"{pid}_{variant}"
            stub = exercises.stub_path(phase, cwd / "lessons" / "exercises")
            stub.parent.mkdir(parents=True, exist_ok=True)
            source = exercises.stub_source(phase)
            if variant == "wrong":
                source = exercises.fill_regions(source, WRONG_ANSWER[pid][1])
            stub.write_text(source, encoding="utf-8")
        for name in self._checks_of(pid, variant) or ():
            argv += ["--only", name]
        return argv + ["--json", str(out)], cwd, env, out

    def _checks_of(self, pid: str, variant: str) -> list[str] | None:
        """The checks the run (pid, variant) grades: None for all of them. A stub that is right by
        design, or a deliberately wrong answer, grades only the checks it must fail; on a GPU, a
        run grades only the checks the selected tests read (see _wanted_checks)."""
        names = None
        if variant != "solution" and (pid in STUB_RIGHT_BY_DESIGN or pid in WRONG_ANSWER):
            names = [c.name for c in grade.checks_for(LESSONS[pid]) if _stub_proof(pid, c.name) == (pid, variant)]
        wanted = self.checks.get(pid)
        if wanted is not None:
            every = names if names is not None else [c.name for c in grade.checks_for(LESSONS[pid])]
            names = [name for name in every if name in wanted]
        return names

    def _run(self, pid: str, variant: str) -> Run:
        if self.closed:
            raise RuntimeError("the session is over")
        argv, cwd, env, out = self._command(pid, variant)
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        try:
            stdout, stderr = proc.communicate(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            stderr += f"\n(killed after {JOB_TIMEOUT_S} s)"
        report = json.loads(out.read_text()) if out.exists() else None
        return Run(proc.returncode, stdout, stderr, report)

    def get(self, pid: str, variant: str) -> Run:
        return self.futures[pid, variant].result()

    def close(self):
        self.closed = True
        for future in self.futures.values():
            future.cancel()
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        if self.own_pool:
            self.pool.shutdown(wait=True)
        else:  # a background job's folder (tempfile), not pytest's
            shutil.rmtree(self.workdir, ignore_errors=True)


def _wanted(items) -> list[str]:
    """The phases the selected tests ask about (e.g. only 03 under `-k 03`)."""
    wanted = set()
    for item in items:
        if "runs" not in getattr(item, "fixturenames", ()):
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "phase_id" in params:
            wanted.add(params["phase_id"])
            if "check_name" in params:
                wanted.add(_stub_proof(params["phase_id"], params["check_name"])[0])
        if item.name.startswith("test_grade_03"):
            wanted.add("03")
    return sorted(wanted)


def _wanted_checks(items) -> dict:
    """Phase -> the names of the checks the selected tests read from its grader runs; None where a
    selected test reads a whole run (every check). Used on a GPU, where every check of a run
    compiles kernels of its own: under `-m gpu` the runs grade the timing checks alone, and the
    simulator grades the rest (in CI)."""
    checks: dict = {}
    for item in items:
        if "runs" not in getattr(item, "fixturenames", ()):
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        pids = [params["phase_id"]] if "phase_id" in params else list(LESSONS)
        name = params.get("check_name")
        if name is None:
            checks.update(dict.fromkeys(pids))
            continue
        for pid in {pids[0], _stub_proof(pids[0], name)[0]}:
            if checks.get(pid, set()) is not None:
                checks.setdefault(pid, set()).add(name)
    return checks


# On a GPU too, the graders start with the session (conftest.py): most of their time is compiling
# the students' kernels, which overlaps the other tests; their timed launches take turns with them.
BACKGROUND_ON_GPU = True


def start_background(items, pool):
    """The grader runs, started in the session's pool of background jobs (see conftest.py); on a
    GPU, each grading only the checks the selected tests read (_wanted_checks)."""
    wanted = _wanted(items)
    checks = None if simulator_enabled() else _wanted_checks(items)
    if not wanted:
        return None
    return GraderRuns(Path(tempfile.mkdtemp(prefix="graded")), wanted, pool, checks=checks)


@pytest.fixture(scope="module")
def runs(request, background, tmp_path_factory):
    if background is not None:  # started when the session's tests were known
        yield background
        return
    items = request.session.items
    graders = GraderRuns(tmp_path_factory.mktemp("graded"), _wanted(items),
                         checks=None if simulator_enabled() else _wanted_checks(items))
    yield graders
    graders.close()


def _explain(run: Run) -> str:
    return f"\n--- grader output ---\n{run.stdout}\n{run.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("phase_id, check_name", _all_checks())
def test_check_fails_on_stub(phase_id, check_name, runs):
    check = next(c for c in grade.checks_for(phase_id) if c.name == check_name)
    donor, variant = _stub_proof(phase_id, check_name)
    if donor != phase_id:
        same = next(c for c in grade.checks_for(donor) if c.name == check_name)
        assert (same.cases, same.run) == (check.cases, check.run), (
            f"phase {phase_id}'s stub passes {check_name} by design; phase {donor}'s stub proves the check "
            f"able to fail only while the two checks are the same")
    run = runs.get(donor, variant)
    result = run.result(check_name)
    assert result["status"] == "fail", f"{check_name} did not fail on the {variant}: {result['detail']}" + _explain(run)
    assert result["detail"], "a failure must say why"


@pytest.mark.slow
@pytest.mark.parametrize("phase_id, check_name", _all_checks())
def test_check_passes_on_solution(phase_id, check_name, runs):
    run = runs.get(phase_id, "solution")
    result = run.result(check_name)
    assert result["status"] == "pass", f"{check_name} failed on the solution: {result['detail']}" + _explain(run)


# What each untouched stub's region check says beyond failing: the diagnosis of its pattern, or
# (None) no known pattern, and then the excerpt and the picture of the wrong outputs. Phase 04's
# region is graded by its layout's bank conflicts.
STUB_REGION_SAYS = {
    "01": "diagnosis: all zeros: the running state is never updated",
    "02": "diagnosis: all zeros: the K and V tiles are never loaded",
    "03-a": "diagnosis: only S = 1 passes",
    "03-b": "diagnosis: the signs are right but the outputs are too large",
    "04": "bank conflicts remain with SMEM_PAD = 0",
    "05-a": "diagnosis: only the single-tile cases pass",
    "05-b": "diagnosis: only the single-tile cases pass",
    "06-a": "diagnosis: only S = 1 passes",
    "06-b": None,
    "07-a": "diagnosis: only S = 1 passes",
    "07-b": "diagnosis: NaN everywhere: the region writes nothing yet",
    "08-a": "diagnosis: only S = 1 passes",
    "08-b": "diagnosis: NaN everywhere: the region writes nothing yet",
    "09-a": "diagnosis: only S = 1 passes: its single row is the block's first",
    "09-b": "diagnosis: only S = 1 passes",
    "10-a": "diagnosis: all zeros: every member's weight is still 0",
    "10-b": "diagnosis: only S = 1 passes: with one key there is one block",
    "11-a": "diagnosis: every gradient is wrong, so P is",
    "11-b": "diagnosis: dV is right, so P is; dK and dQ are not",
    "11-c": "dq: all zeros: nothing is added to dQ",
    "12-a": "NaN everywhere: dq is never written",
    "12-b": "NaN everywhere: s and dp are never written",
    "12-c": "dq: all zeros: dQ = dS K adds nothing",
    "13-a": "diagnosis: every gradient is wrong: the boxes past the first",
    "13-b": "diagnosis: every gradient is wrong, yet a single query tile would be right: the walk never moves",
}
# Regions whose emptied stub cannot run at all, and what the failure says instead of a picture of
# wrong outputs: a mod without its return (14-a, 14-b) is refused by flex's check of a mod, by
# name, before any launch; 14-d leaves the kernel without the tile it computes.
STUB_REGION_RAISES = {
    "14-a": "mask_mod sliding_window_mod: expected a bool (True where the row sees the key), got NoneType",
    "14-b": "score_mod softcap_mod: expected a number (the new score), got NoneType",
    "14-d": "NameError: name 'n' is not defined",
}
REGIONS = [pytest.param(phase.ID, r.label, id=r.label) for phase in LESSONS.values()
           for r in exercises.phase_regions(phase)]


def test_each_grader_run_grades_a_file_of_its_own(tmp_path):
    """A phase's stub and its wrong answer are graded side by side, and a grader reads the file again
    for each region check: written to one path, the wrong answer replaced the stub halfway through
    the stub's run (CI once saw 09-b's stub graded as the wrong answer, its diagnosis gone)."""
    runs = GraderRuns.__new__(GraderRuns)  # the commands alone: no grader started
    runs.workdir, runs.checks = tmp_path, {}
    (_, stub_cwd, _, _), (_, wrong_cwd, _, _) = runs._command("09", "stub"), runs._command("09", "wrong")
    stub, wrong = (exercises.stub_path(LESSONS["09"], cwd / "lessons" / "exercises") for cwd in (stub_cwd, wrong_cwd))
    assert stub != wrong and stub.read_text() == exercises.stub_source(LESSONS["09"]) != wrong.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("phase_id, label", REGIONS)
def test_region_check_fails_on_the_stub_with_its_diagnosis(phase_id, label, runs):
    """The region checks' fail-on-stub and pass-on-solution are test_check_fails_on_stub and
    test_check_passes_on_solution; here, what the failure teaches (from the same grader runs)."""
    detail = runs.get(phase_id, "stub").result(label)["detail"]
    says = STUB_REGION_SAYS.get(label)
    if says:
        assert says in detail, detail
    if phase_id != "04":
        assert f"region {label} is still empty" in detail and "--hint" in detail, detail
        if label in STUB_REGION_RAISES:
            assert STUB_REGION_RAISES[label] in detail, detail
            return
        assert "wrong outputs" in detail, detail
        if says is None:
            assert "worst at row" in detail, detail


@pytest.mark.slow
@pytest.mark.parametrize("phase_id", list(LESSONS))
def test_timing_checks_are_skipped_in_the_simulator_with_the_reason(phase_id, runs):
    if not simulator_enabled():
        pytest.skip("runs in the simulator only (here the timing checks run)")
    run = runs.get(phase_id, "solution")
    gpu_checks = [c.name for c in grade.checks_for(phase_id) if c.gpu_only]
    assert gpu_checks, f"phase {phase_id} has no GPU check: its own point is missing"
    for name in gpu_checks:
        result = run.result(name)
        assert result["status"] == "skip" and result["detail"].startswith("needs a GPU"), result
    assert run.returncode == 0 and run.report["full_marks"], _explain(run)
    assert "skipped: needs a GPU" in run.stdout


@pytest.mark.slow
def test_grade_03_on_the_stub_prints_a_failing_score_with_reasons(runs):
    run = runs.get("03", "stub")
    assert run.returncode == 1, _explain(run)
    report = run.report
    assert report["score"] < report["available"]
    assert f"Score: {report['score']}/{report['available']}" in run.stdout
    assert "lessons/exercises/03_warp_shuffle.py" in run.stdout  # the default path
    for r in report["results"]:
        if r["status"] != "pass":
            label = "FAIL" if r["status"] == "fail" else "skipped"
            assert f"{r['title']}: {label}: {r['detail']}" in run.stdout, r
    assert f"--seed {report['seed']}" in run.stdout  # how to reproduce the hidden inputs


@pytest.mark.slow
def test_grade_03_on_the_solution_prints_full_marks(runs):
    run = runs.get("03", "solution")
    assert run.returncode == 0, _explain(run)
    report = run.report
    assert report["score"] == report["available"] > 0
    assert f"Score: {report['available']}/{report['available']}" in run.stdout
    assert "Full marks." in run.stdout


# ---------------------------------------------------------------------------------------------
# Grader details that need no kernel run
# ---------------------------------------------------------------------------------------------
def test_a_file_that_does_not_load_fails_every_check_with_the_reason(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("from flashcore_numba.phases.common import KernelConfig\nx = (\n", encoding="utf-8")
    g = grade.start("01", path, seed=1)
    result = g.run(next(c for c in grade.checks_for("01") if c.kind == "correctness"))
    assert result.status == "fail" and "SyntaxError" in result.detail and "line 2" in result.detail
    # a region check is graded in the solution's file, but this one has lost the region's markers
    region = g.run(next(c for c in grade.checks_for("01") if c.kind == "region"))
    assert region.status == "fail" and "markers of region 01 are missing" in region.detail


def test_relative_imports_outside_the_package_get_a_hint(tmp_path):
    path = tmp_path / "copied_phase.py"
    path.write_text("from ..common import KernelConfig\n", encoding="utf-8")
    g = grade.start("01", path, seed=1)
    assert "import absolutely" in g.load_error


def test_nan_output_fails_with_the_poison_explained():
    q, k, v = grade.make_inputs(grade.Case(3, 3, 64, causal=True), seed=5)
    out = grade.reference_attention(q, k, v, causal=True).astype("float16")
    assert grade.judge(out, q, k, v, True).status == "pass"
    out[0, 0, 2, 7] = float("nan")
    outcome = grade.judge(out, q, k, v, True)
    assert outcome.status == "fail" and "never written" in outcome.detail and "[0, 0, 2, 7]" in outcome.detail
    out[0, 0, 2, 7] = float("inf")
    assert grade.judge(out, q, k, v, True).status == "fail"


def test_large_logits_reach_the_target_score():
    case = grade.Case(64, 64, 64, logits=grade.LARGE_LOGITS)
    q, k, _ = grade.make_inputs(case, seed=3)
    scores = q[0, 0].astype(float) @ k[0, 0].astype(float).T / 8.0
    assert 0.97 * grade.LARGE_LOGITS <= abs(scores).max() <= 1.03 * grade.LARGE_LOGITS


def test_seeds_are_drawn_at_run_time_unless_given():
    path = exercises.stub_path(LESSONS["01"])
    assert len({grade.start("01", path).seed for _ in range(3)}) > 1
    assert grade.start("01", path, seed=42).seed == 42


def test_unknown_phase_and_missing_file_are_one_line_errors(capsys):
    assert grade.main(["42"]) == 2
    assert "NN:" in capsys.readouterr().err
    assert grade.main(["03", "no/such/file.py"]) == 2
    assert "no file" in capsys.readouterr().err


def _pytest(*args):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=REPO, check=False,
                          capture_output=True, text=True, timeout=300)


def test_pytest_entry_without_grade_skips_with_the_command_to_use():
    run = _pytest("lessons/exercises", "-q")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 skipped" in run.stdout and "--grade NN" in run.stdout


def test_pytest_entry_grades_one_check_per_test():
    # the bank-conflict check needs no kernel launch: fast on the stub and on the solution
    stub = _pytest("lessons/exercises", "--grade", "04", "-k", "bank_conflicts", "-q")
    assert stub.returncode == 1 and "test_graded_check[bank_conflicts]" in stub.stdout, stub.stdout
    assert "bank conflicts remain" in stub.stdout and "Score: 0/2" in stub.stdout
    solved = _pytest("lessons/exercises", "--grade", "04", "--solution", "flashcore_numba/phases/p04_padding.py",
                     "-k", "bank_conflicts", "-q")
    assert solved.returncode == 0 and "1 passed" in solved.stdout and "Full marks." in solved.stdout, solved.stdout


@pytest.mark.parametrize("mine_ms, verdict", [(1.0, "pass"), (2.0, "fail")])
def test_speed_check_gates_on_correctness_then_compares_medians(monkeypatch, tmp_path, mine_ms, verdict):
    """The GPU timing check's logic, with the clock replaced (the timing itself runs in the gpu tests)."""
    monkeypatch.setattr(grade, "TIMING_SHAPE", (1, 1, 5, 64))  # tiny: the kernel runs in the simulator
    monkeypatch.setattr(grade, "time_against", lambda student, baseline, q, k, v: (mine_ms, 1.0))
    check = grade.speed_check(None, at_least=0.8, points=1)
    solved = grade.start("01", LESSONS["01"].__file__, seed=3, on_gpu=True)
    result = solved.run(check)
    assert result.status == verdict and "needs at least 0.80x" in result.detail, result.detail
    stub = tmp_path / "01_naive.py"
    stub.write_text(exercises.stub_source(LESSONS["01"]), encoding="utf-8")
    wrong = grade.start("01", stub, seed=3, on_gpu=True).run(check)
    assert wrong.status == "fail" and wrong.detail.startswith("not timed: wrong"), wrong.detail


@pytest.mark.parametrize("phase_id", sorted(pid for pid in LESSONS if pid >= exercises.FULL_ACCOUNT_FROM))
def test_tensor_core_stubs_point_to_their_long_docstring(phase_id):
    """A phase whose docstring is its full account (07 on) gives its stub a short one: the title,
    then where the account and the lesson are. The phase keeps the long one."""
    phase = LESSONS[phase_id]
    doc = ast.get_docstring(ast.parse(exercises.stub_source(phase).split("\n", 1)[1]))
    full = ast.get_docstring(ast.parse(exercises.phase_source(phase)))
    assert len(doc.splitlines()) <= 6 < len(full.splitlines())
    assert doc.splitlines()[0] == full.splitlines()[0]
    assert phase.__file__.endswith(doc.split("docstring of ")[1].split(";")[0].split("/")[-1])
    assert exercises.lesson_name(phase) in doc and exercises.lesson_name(phase) in exercises.stub_source(phase)[:2000]


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="ast.parse is safe in threads from CPython 3.13")
def test_background_jobs_parse_one_at_a_time():
    """The grader runs build their stubs (ast.parse) in background threads while tests here parse
    too; on CPython 3.11-3.12 two parses at once can raise SystemError (conftest.py serialises them).
    A parse that has started holds every other thread's parse back until it ends."""
    inside, overlaps = [], []
    started = threading.Event()

    def parse(_source, *args, **kwargs):
        if inside:
            overlaps.append(1)
        inside.append(1)
        started.set()
        time.sleep(0.05)  # a long parse, so that a second thread has every chance to enter
        inside.pop()

    original = ast.parse.__wrapped__
    try:
        ast.parse.__globals__["_parse"] = parse  # the function the session's wrapper calls
        threads = [threading.Thread(target=ast.parse, args=("x",)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        ast.parse.__globals__["_parse"] = original
    assert started.is_set() and not overlaps


def test_a_gpu_session_grades_only_the_checks_its_tests_read(tmp_path):
    """On a GPU every check of a grader run compiles kernels of its own, so a run grades only the
    checks its selected tests read: under `-m gpu`, the timing checks. A test that reads a whole
    run (no check name) keeps every check of its phase."""
    from types import SimpleNamespace

    def item(name, **params):
        return SimpleNamespace(name=name, fixturenames=["runs"], callspec=SimpleNamespace(params=params))

    speed = [c.name for c in grade.checks_for(LESSONS["07"]) if c.gpu_only]
    items = [item("test_check_fails_on_stub", phase_id="07", check_name=speed[0]),
             item("test_check_passes_on_solution", phase_id="07", check_name=speed[0]),
             item("test_timing_checks_are_skipped", phase_id="05"),
             SimpleNamespace(name="test_other", fixturenames=[])]
    checks = _wanted_checks(items)
    assert checks == {"07": {speed[0]}, "05": None}
    runs = GraderRuns.__new__(GraderRuns)
    runs.checks = checks
    assert runs._checks_of("07", "solution") == [speed[0]] == runs._checks_of("07", "stub")
    assert runs._checks_of("05", "solution") is None  # every check
    assert runs._checks_of("03", "stub") is None  # a phase no test restricts
    runs.checks = {}  # the simulator: as before, a stub right by design grades only what it must fail
    for pid in STUB_RIGHT_BY_DESIGN:
        assert runs._checks_of(pid, "stub") == [c.name for c in grade.checks_for(LESSONS[pid])
                                                if _stub_proof(pid, c.name) == (pid, "stub")]

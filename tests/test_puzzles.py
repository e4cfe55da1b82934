"""Lesson 00's puzzles: the stub is generated from course/puzzles.py, each graded check fails on the
untouched stub with a reason and passes on the solution, and `flashcore grade 00` grades them.

Everything runs in this process in the simulator, on arrays of 8 to 130 elements: a few seconds.
"""

from __future__ import annotations

import ast
import json
import time
from pathlib import Path

import pytest

from flashcore_numba.course import exercises, grade, puzzle_checks, puzzles

REPO = Path(__file__).resolve().parents[1]
SOLUTION = Path(puzzles.__file__)
pytest_plugins = ["pytester"]
CHECKS = [c.name for c in grade.checks_for("00")]


@pytest.fixture(scope="module")
def stub_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("puzzles") / exercises.stub_name(puzzles)
    path.write_text(exercises.stub_source(puzzles), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def graded_stub(stub_path):
    g = grade.start("00", stub_path, seed=1)
    return {c.name: g.run(c) for c in grade.checks_for("00")}


@pytest.fixture(scope="module")
def graded_solution():
    g = grade.start("00", SOLUTION, seed=2)
    return {c.name: g.run(c) for c in grade.checks_for("00")}


def test_stub_is_committed_and_in_sync():
    path = exercises.stub_path(puzzles)
    assert path.name == "00_numba_cuda.py"
    assert path.is_file() and path.read_text(encoding="utf-8") == exercises.stub_source(puzzles), (
        f"{path.relative_to(REPO)} differs from the stub generated from course/puzzles.py: run "
        f"`python -m flashcore_numba.course.exercises --write`")
    assert path in [exercises.stub_path(m) for m in exercises.exercise_modules()]


def test_one_region_per_puzzle_and_solving_only_adds_lines():
    regions = exercises.phase_regions(puzzles)
    assert [r.label for r in regions] == [p.label for p in puzzle_checks.PUZZLES]
    source = exercises.phase_source(puzzles)
    for region in regions:  # each region holds code, not only comments
        assert ast.dump(ast.parse(exercises.strip_regions(source, [region]))) != ast.dump(ast.parse(source))
    solved = iter(exercises.solution_source(puzzles).splitlines())
    for number, line in enumerate(exercises.stub_source(puzzles).splitlines(), 1):
        assert any(line == other for other in solved), f"stub line {number} is not in the solution: {line!r}"


@pytest.mark.parametrize("name", CHECKS)
def test_check_fails_on_the_stub_with_a_reason(graded_stub, name):
    result = graded_stub[name]
    assert result.status == "fail", result
    assert "never written" in result.detail or "outputs wrong" in result.detail, result.detail
    assert "expected [" in result.detail and "got [" in result.detail, "expected and got side by side"


@pytest.mark.parametrize("name", CHECKS)
def test_check_passes_on_the_solution(graded_solution, name):
    assert graded_solution[name].status == "pass", graded_solution[name].detail


def test_a_missing_guard_is_diagnosed(tmp_path):
    path = tmp_path / "unguarded.py"
    path.write_text(exercises.fill_regions(exercises.stub_source(puzzles), {"00-b": "out[i] = alpha * a[i]"}))
    g = grade.start("00", path, seed=3)
    result = g.run(next(c for c in grade.checks_for("00") if c.name == "00-b"))
    assert result.status == "fail"
    assert "IndexError" in result.detail and "if i < a.size" in result.detail, result.detail
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.strip() == "out[i] = alpha * a[i]")
    assert f"unguarded.py line {line} (`out[i] = alpha * a[i]`) raised IndexError" in result.detail, result.detail


# A barrier inside a branch: on a GPU undefined; the simulator used to release it once every thread
# still running had reached it, and gave full marks
BRANCHED_BARRIERS = {
    "inside_if_t_below_stride": ("        cuda.syncthreads()  # this step's sums", "            cuda.syncthreads()  # this step's sums"),
    "inside_if_t_is_0": ("        cuda.syncthreads()  # this step's sums",
                         "        if t == 0:\n            cuda.syncthreads()  # this step's sums"),
}


@pytest.mark.parametrize("slip", BRANCHED_BARRIERS)
def test_a_barrier_inside_a_branch_fails_in_seconds_naming_it(tmp_path, capsys, slip):
    """`flashcore grade 00` on 00-c with its loop's cuda.syncthreads() inside `if t < stride:` or inside
    `if t == 0:`: the check fails within seconds, naming the barrier's line, the threads that wait
    there and those that left the kernel, with the hint to put it where every thread passes."""
    old, new = BRANCHED_BARRIERS[slip]
    solution = exercises.solution_source(puzzles)
    assert solution.count(old) == 1
    path = tmp_path / f"{slip}.py"
    path.write_text(solution.replace(old, new), encoding="utf-8")
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if "# this step's sums" in text)
    started = time.monotonic()
    assert grade.main(["00", str(path)]) == 1
    assert time.monotonic() - started < 60  # it used to pass; a hang would take minutes
    out = capsys.readouterr().out
    barrier = f"at cuda.syncthreads(): {path}:{line} (`cuda.syncthreads()  # this step's sums"
    waiting, gone = (("threads 0-3 wait", "threads 4-7") if slip == "inside_if_t_below_stride"
                     else ("thread 0 waits", "threads 1-7"))
    assert "3. 00-c — reduce: a block sums its elements in shared memory: FAIL" in out
    assert "raised BarrierError" in out and f"{waiting} {barrier}" in out, out
    assert f"{gone} left the kernel" in out
    assert "put the barrier where every thread passes" in out and "Score: 4/6" in out


def test_a_missing_kernel_is_named(tmp_path):
    path = tmp_path / "empty.py"
    path.write_text("x = 1\n")
    result = grade.start("00", path, seed=4).run(grade.checks_for("00")[0])
    assert result.status == "fail" and "no kernel named add_ten" in result.detail


def test_grade_command(tmp_path, capsys, stub_path):
    assert grade.main(["00", "--list"]) == 0
    out = tmp_path / "solution.json"
    assert grade.main(["00", str(SOLUTION), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["full_marks"] and report["score"] == report["available"] == 6
    assert grade.main(["00", str(stub_path), "--seed", "11"]) == 1
    out = capsys.readouterr().out
    assert "Score: 0/6" in out
    # like every exercise's: the seed that repeats the run, and where the hints are
    assert f"Inputs came from the hidden seed 11; `flashcore grade 00 {stub_path} --seed 11`" in out, out
    assert "Stuck? `flashcore grade 00 --hint` gives a hint per region" in out and "`--hint --only 00-a`" in out


def test_only_and_hint_take_the_names_of_the_results_table(tmp_path, capsys, stub_path):
    """The table's check column names each puzzle by its region's label (00-c); --only takes it to grade
    and to give hints, as it takes 03-a for exercise 03; the kernels' names (block_sum) still work."""
    out = tmp_path / "only.json"
    assert grade.main(["00", str(stub_path), "--only", "00-c", "--only", "matvec", "--json", str(out)]) == 1
    assert [r["name"] for r in json.loads(out.read_text())["results"]] == ["00-c", "00-d"]
    table = capsys.readouterr().out
    assert "│ 00-c  │ reduce: a block sums" in table and "3. 00-c — reduce" not in table and "1. 00-c — reduce" in table
    for name in ("00-c", "block_sum"):
        assert grade.main(["00", "--hint", "--only", name]) == 0
        hints = capsys.readouterr().out
        assert "00-c: load a[i]" in hints and "00-a:" not in hints
    assert grade.main(["00", "--only", "sum"]) == 2
    assert "unknown check 'sum'; the checks of exercise 00 are 00-a, 00-b, 00-c, 00-d" in capsys.readouterr().err


def test_pytest_grades_the_puzzles(pytester):
    """`pytest lessons/exercises --grade 00`, as a student runs it, on the solution (in this process)."""
    pytester.chdir()
    result = pytester.runpytest_inprocess(str(REPO / "lessons" / "exercises"), "--grade", "00", "--solution",
                                          str(SOLUTION), "-p", "no:cacheprovider", "--rootdir", str(REPO))
    result.assert_outcomes(passed=len(CHECKS))
    assert "Full marks" in result.stdout.str()


def test_pictures_show_every_thread():
    assert "10  11" in puzzle_checks.picture_map() and "have no element" in puzzle_checks.picture_map()
    assert puzzle_checks.picture_reduction().count("syncthreads()") == 3  # log2(TPB) steps
    assert "have no row" in puzzle_checks.picture_tiles()

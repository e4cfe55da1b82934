"""The grader that teaches: region checks, diagnoses, pictures, the student's line, hints.

Fast: the diagnosis rules, pictures and excerpts run on synthetic arrays; the traceback mapping on
tiny files; two region checks of phase 01 run in the simulator on two tiny cases each. That every
region check fails on the untouched stub (with its diagnosis) and passes on the solution is tested
with the other graded checks, from the grader runs of tests/test_exercises.py.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest

from flashcore_numba.course import diagnose, exercises, grade, grade_backward, hints
from flashcore_numba.course.diagnose import CaseRun
from flashcore_numba.phases import LESSONS


def _run(out, expected, seq_k=8, allowed=1e-3, label="case"):
    out = None if out is None else np.asarray(out, dtype=np.float64).reshape(1, 1, *np.shape(out))
    expected = np.asarray(expected, dtype=np.float64).reshape(1, 1, *np.shape(expected))
    return CaseRun(label, seq_k, out, expected, allowed)


@pytest.fixture
def expected():
    return np.random.default_rng(0).standard_normal((12, 8))


# ---------------------------------------------------------------------------------------------
# Diagnosis rules, on synthetic outputs
# ---------------------------------------------------------------------------------------------
def test_right_outputs_get_no_diagnosis(expected):
    assert diagnose.diagnose([_run(expected, expected)]) == ""


def test_nan_everywhere_means_the_region_writes_nothing(expected):
    nan = np.full_like(expected, np.nan)
    assert "writes nothing" in diagnose.diagnose([_run(nan, expected[:1, :], seq_k=1), _run(nan, expected)])
    partly = expected.copy()
    partly[3] = np.nan
    assert "writes nothing" not in diagnose.diagnose([_run(partly, expected)])


def test_all_zeros_means_nothing_reaches_the_output(expected):
    zeros = np.zeros_like(expected)
    assert "all zeros: nothing that should reach the output does" in diagnose.diagnose(
        [_run(zeros[:1], expected[:1], seq_k=1), _run(zeros, expected)])
    # zeros where a one-key case passes are not "all zeros" but "not carried"
    verdict = diagnose.diagnose([_run(expected[:1], expected[:1], seq_k=1), _run(zeros, expected)])
    assert "all zeros" not in verdict and "only S = 1 passes" in verdict


def test_only_s_one_passing_means_the_state_is_not_carried(expected):
    wrong = expected[::-1] * 0.3 + 1.0
    verdict = diagnose.diagnose([_run(expected[:1], expected[:1], seq_k=1), _run(wrong, expected)])
    assert "only S = 1 passes" in verdict and "not carried" in verdict
    # a region may word it itself
    assert diagnose.diagnose([_run(expected[:1], expected[:1], seq_k=1), _run(wrong, expected)],
                             {"s_one": "mine"}) == "mine"
    # S = 1 failing too: not this pattern
    assert "only S = 1" not in diagnose.diagnose([_run(wrong[:1], expected[:1], seq_k=1), _run(wrong, expected)])


def test_a_constant_factor_means_a_scale(expected):
    verdict = diagnose.diagnose([_run(1.4427 * expected, expected)])
    assert "constant factor 1.443" in verdict and "scale" in verdict


def test_a_factor_per_row_means_the_row_sums(expected):
    factors = np.linspace(0.5, 3.0, expected.shape[0])[:, None]
    verdict = diagnose.diagnose([_run(factors * expected, expected)])
    assert "each row is off by a factor of its own (from 0.5 to 3)" in verdict


def test_right_signs_wrong_sizes_means_a_sum_or_scale(expected):
    sizes = np.random.default_rng(1).uniform(3.0, 5.0, expected.shape)
    assert "signs are right" in diagnose.diagnose([_run(sizes * expected, expected)])


def test_one_wrong_strip_of_columns_means_a_strip_never_computed():
    """D = 128 in two 64-column strips, the second never multiplied: only its columns are wrong."""
    expected = np.random.default_rng(3).standard_normal((6, 128))
    out = expected.copy()
    out[:, 64:] = 0.25
    verdict = diagnose.diagnose([_run(expected[:, :64], expected[:, :64]), _run(out, expected)])
    assert "only columns 64..127" in verdict
    # with the region's own wording (exercise 06-b)
    from flashcore_numba.course.hints import HINTS

    worded = diagnose.diagnose([_run(out, expected)], HINTS["06-b"].diagnoses)
    assert worded.startswith("only columns 64..127 are wrong: at D = 128")
    # wrong columns that are not one range, or every column: not this pattern
    out[:, 10] = 9.0
    assert "only columns" not in diagnose.diagnose([_run(out, expected)])


def test_noise_gets_no_diagnosis(expected):
    noise = np.random.default_rng(2).standard_normal(expected.shape)
    assert diagnose.diagnose([_run(noise, expected)]) == ""
    # slightly off everywhere, by no factor: not "a factor of 1.00"
    assert diagnose.diagnose([_run(expected + 0.01 * noise, expected)]) == ""


def test_picture_marks_the_wrong_rows_and_columns():
    expected = np.ones((8, 8))
    out = expected.copy()
    out[2, 5] = 7.0
    out[6:, :] = np.nan
    lines = diagnose.picture(out, expected, 1e-3).splitlines()
    assert "17 of 64 wrong" in lines[0]
    grid = [line.split()[-1] for line in lines[1:]]
    assert grid == ["........", "........", ".....X..", "........", "........", "........",
                    "XXXXXXXX", "XXXXXXXX"]
    big = np.ones((64, 128))
    wrong_big = big.copy()
    wrong_big[:, 64:] = 0.0  # the right half of the columns wrong: so is the right half of the picture
    lines = diagnose.picture(wrong_big, big, 1e-3).splitlines()
    assert len(lines) == 1 + diagnose.MAX_PICTURE_ROWS and "4 rows per line" in lines[0]
    assert all(line.split()[-1] == "." * 16 + "X" * 16 for line in lines[1:])
    assert "wrong outputs in every row and column" in diagnose.picture(np.zeros((4, 4)), big[:4, :4], 1e-3)


def test_excerpt_shows_the_worst_element_got_and_expected():
    expected = np.zeros((4, 8))
    out = expected.copy()
    out[2, 6] = -3.94531
    text = diagnose.excerpt(out, expected, 1e-3)
    assert "worst at row 2, column 6: got -3.94531, expected 0.00000" in text
    assert "columns 4..7" in text and "-3.9453" in text.splitlines()[1]


# ---------------------------------------------------------------------------------------------
# The student's file and line, from a traceback
# ---------------------------------------------------------------------------------------------
def test_an_exception_is_reported_at_the_students_line(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text("def f(a):\n    x = 1\n    return a[x, 3]\n", encoding="utf-8")
    module = grade.load_module(path)
    with pytest.raises(TypeError) as info:
        module.f(5)
    text = diagnose.describe_exception(info.value, path)
    assert text.startswith("mine.py line 3 (`return a[x, 3]`) raised TypeError")


def test_the_simulators_thread_prefix_moves_to_the_end():
    e = IndexError("tid=[0, 0, 0] ctaid=[0, 0, 0]: too many indices")
    assert diagnose.describe_exception(e, "nowhere.py") == (
        "raised IndexError: too many indices (in thread tid=[0, 0, 0] ctaid=[0, 0, 0])")


def test_a_spliced_region_maps_its_lines_back_to_the_students_file(tmp_path):
    solution = ("def f(a):\n    y = 0\n    # >>> exercise 09-a: index\n    y = a[0]\n    # <<< exercise\n"
                "    return y\n")
    student = ("# a header line\n" + solution.replace("    y = a[0]\n", "    z = 2\n    y = a[z, 1]\n"))
    spliced = exercises.splice_region(solution, student, "09-a")
    assert spliced.lines == {4: 5, 5: 6}
    (tmp_path / "mine.py").write_text(student, encoding="utf-8")
    path = tmp_path / "spliced.py"
    path.write_text(spliced.source, encoding="utf-8")
    with pytest.raises(TypeError) as info:
        grade.load_module(path).f([1])
    text = diagnose.describe_exception(info.value, path, spliced.lines, shown_as=tmp_path / "mine.py")
    assert text.startswith("mine.py line 6 (`y = a[z, 1]`) raised TypeError"), text
    # a compiler's message (numba on a GPU) that quotes the spliced file is rewritten the same way
    typing = TypeError(f'Failed in cuda mode pipeline\nFile "{path}", line 4:\n    y = a[z, 1]')
    assert 'File "mine.py", line 5:' in diagnose.describe_exception(typing, path, spliced.lines,
                                                                     shown_as=tmp_path / "mine.py")
    with pytest.raises(exercises.ExerciseFormatError, match="markers of region 09-a are missing"):
        exercises.splice_region(solution, "def f(a):\n    return 1\n", "09-a")


# ---------------------------------------------------------------------------------------------
# Region checks in the simulator (phase 01: two tiny cases each)
# ---------------------------------------------------------------------------------------------
def _region_check(phase_id, label):
    return next(c for c in grade.checks_for(phase_id) if c.region == label)


def _graded_attempt(tmp_path, fills):
    phase = LESSONS["01"]
    path = tmp_path / exercises.stub_name(phase)
    path.write_text(exercises.fill_regions(exercises.stub_source(phase), fills), encoding="utf-8")
    return grade.start("01", path, seed=4).run(_region_check("01", "01"))


def test_a_state_not_carried_between_keys_is_diagnosed(tmp_path):
    # each key replaces l_i and acc instead of updating them: right for one key only
    result = _graded_attempt(tmp_path, {"01": "m_new, m_ref, alpha = softmax_rescale(m_i, s)\n"
                                              "p = math.exp2(s - m_ref)\n"
                                              "l_i = p\n"
                                              "for d in range(HEAD_DIM):\n"
                                              "    acc[d] = p * float32(V[b, h, j, d])\n"
                                              "m_i = m_new"})
    assert result.status == "fail"
    assert "passed: S_q=1 S_k=1" in result.detail
    assert "diagnosis: only S = 1 passes" in result.detail and "not carried" in result.detail
    assert "worst at row" in result.detail and "wrong outputs" in result.detail


def test_a_bug_that_raises_in_the_simulator_names_the_students_line(tmp_path):
    result = _graded_attempt(tmp_path, {"01": "m_i = max(m_i, s)\nl_i = acc[j, 1]"})
    assert result.status == "fail"
    line = next(i for i, text in enumerate((tmp_path / "01_naive.py").read_text().splitlines(), 1)
                if "l_i = acc[j, 1]" in text)
    assert f"01_naive.py line {line} (`l_i = acc[j, 1]`) raised IndexError" in result.detail, result.detail


def test_a_missing_barrier_before_the_block_counter_is_read_fails_in_seconds(tmp_path):
    """Exercise 10's block counter without the cuda.syncthreads() before `done = done_s[0]`: threads
    read the count before thread 0 wrote it, disagree on whether their block merges, and the merging
    ones wait at the merge's warp shuffles for lanes that left. It took 605 s (a time-out) and ended
    in "BrokenBarrierError: tid=[54, 0, 0] ctaid=[1, 0, 0]"; now the region check fails within
    seconds, naming the lines of the student's file where threads wait and who left.

    A race shows only in the runs where a thread reads before thread 0 writes, and the simulator's
    threads run in the order the operating system gives them: a run where every thread read late
    computes the right answer (once in a full suite, under load). So up to three runs, each of its
    own seed; every run that fails must fail as described, and one must."""
    import re
    import time

    phase, label = LESSONS["10"], "10-b"
    barrier = "        cuda.syncthreads()\n        done = done_s[0]\n"
    solution = exercises.solution_source(phase)
    assert solution.count(barrier) == 1
    path = tmp_path / exercises.stub_name(phase)
    path.write_text(solution.replace(barrier, "        done = done_s[0]\n"), encoding="utf-8")
    for seed in (5, 6, 7):
        started = time.monotonic()
        result = grade.start("10", path, seed=seed).run(_region_check("10", label))
        assert time.monotonic() - started < 120
        if result.status != "pass":
            break
    assert result.status == "fail" and "raised BarrierError" in result.detail, result.detail
    assert "left the kernel (they never arrive)" in result.detail
    # the wait is named where it is (a shared helper may hold the shuffle) and traced to the student's lines
    assert re.search(rf"waits? at (a warp collective|cuda.syncthreads)[^\n]*{re.escape(path.name)}:\d+ \(`",
                     result.detail), result.detail
    assert "flashcore_regions" not in result.detail  # the student's lines, not the spliced copy's


def test_a_whole_kernel_check_words_its_diagnosis_as_the_regions_at_fault(tmp_path):
    """Exercise 10's untouched stub gives all zeros: its whole-kernel checks said "m_i, l_i and acc keep
    their initial values", which no region of exercise 10 holds. Now they say it as the regions still
    empty word it (10-a: the merge weights); once 10-a is written, only 10-b is suspected."""
    from flashcore_numba.course.checks import Result
    from flashcore_numba.course.student import suspect_regions

    phase = LESSONS["10"]
    path = tmp_path / exercises.stub_name(phase)
    path.write_text(exercises.stub_source(phase), encoding="utf-8")
    g = grade.start("10", path, seed=6)
    assert suspect_regions(g) == ["10-a", "10-b"]
    result = g.run(next(c for c in grade.checks_for("10") if c.name == "short"))
    assert result.status == "fail" and "diagnosis: all zeros: every member's weight is still 0" in result.detail
    assert "(region 10-a)" in result.detail and "m_i, l_i and acc" not in result.detail, result.detail
    solved_a = next(r for r in exercises.phase_regions(phase) if r.label == "10-a").solution
    path.write_text(exercises.fill_regions(exercises.stub_source(phase), {"10-a": textwrap.dedent("\n".join(solved_a))}))
    assert suspect_regions(grade.start("10", path, seed=6)) == ["10-b"]
    # where no region is empty, the regions whose own check failed; where none did, all of them
    g = grade.start("10", Path(phase.__file__), seed=6)
    assert suspect_regions(g) == ["10-a", "10-b"]
    g.results.append(Result("10-b", "region 10-b on its own", 1, "fail", "", False, "region"))
    assert suspect_regions(g) == ["10-b"]
    assert hints.worded_by(["10-a", "10-b"])["s_one"].count("(region 10-") == 2


# ---------------------------------------------------------------------------------------------
# Hints and the list of checks
# ---------------------------------------------------------------------------------------------
ALL_REGIONS = [r.label for module in (exercises.exercise_module(exercises.PUZZLES_ID), *LESSONS.values())
               for r in exercises.phase_regions(module)]


def test_every_region_has_three_tiers_of_hints_and_no_hint_is_orphaned():
    assert sorted(hints.HINTS) == sorted(ALL_REGIONS)
    for label in ALL_REGIONS:
        h = hints.hints_for(label)
        assert all(h.tier(k).strip() for k in (1, 2, 3)), label
        # the patterns of an output (diagnose.py), and for the backward which gradients are wrong
        known = set(diagnose.MESSAGES) | {f"wrong:{which}" for which in grade_backward.WHICH}
        assert set(h.diagnoses) <= known, label


@pytest.mark.parametrize("phase_id", list(LESSONS))
def test_list_shows_a_check_per_region(phase_id, capsys):
    assert grade.main([phase_id, "--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line and not line[0].isspace()]
    regions = [r.label for r in exercises.phase_regions(LESSONS[phase_id])]
    assert listed[:len(regions)] == regions


def test_hint_prints_the_tiers_asked_for_of_one_region_or_all(capsys):
    assert grade.main(["03", "--hint"]) == 0
    out = capsys.readouterr().out
    assert "03-a:" in out and "03-b:" in out and "hint 1 (the idea)" in out and "hint 2 (" not in out
    assert grade.main(["03", "--hint", "3", "--only", "03-b"]) == 0
    out = capsys.readouterr().out
    assert "03-a:" not in out and all(f"hint {k}" in out for k in (1, 2, 3))
    assert grade.main(["03", "--hint", "--only", "03-c"]) == 2
    assert "not a region of exercise 03" in capsys.readouterr().err
    assert grade.main(["03", "--hint", "--only", "tail"]) == 2  # a check's name, but of the whole kernel
    assert "'tail' is a check of the whole kernel, and hints are per region; its regions are 03-a, 03-b" in (
        capsys.readouterr().err)


def test_the_07b_instruction_names_pack_and_the_register_order():
    region = next(r for r in exercises.phase_regions(LESSONS["07"]) if r.label == "07-b")
    assert "pack(" in region.instruction and "a0..a3" in region.instruction
    assert "a0 = row g" in hints.hints_for("07-b").helpers


def test_a_broken_region_fails_its_own_check_only(tmp_path):
    """A syntax error in 07-b: the file does not load, yet 07-a is still graded (in the solution's file)."""
    phase = LESSONS["07"]
    path = tmp_path / exercises.stub_name(phase)
    solved_a = "\n".join(next(r for r in exercises.phase_regions(phase) if r.label == "07-a").solution)
    fills = {"07-a": "\n".join(line.strip() for line in solved_a.splitlines()), "07-b": "p_frag[0, 0, 0] = pack("}
    path.write_text(exercises.fill_regions(exercises.stub_source(phase), fills), encoding="utf-8")
    g = grade.start("07", path, seed=1)
    assert g.student is None and "SyntaxError" in g.load_error
    module, _, spliced = grade.load_region(g, "07-a")  # loads: 07-b there is the solution's
    assert callable(module.build) and len(spliced.lines) == 4
    result = g.run(_region_check("07", "07-b"))
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if "p_frag[0, 0, 0] = pack(" in text)
    assert result.status == "fail" and f"07_mma_sync.py line {line}: SyntaxError" in result.detail, result.detail


def test_graders_take_turns_timing_on_the_gpu():
    """Graders compile side by side but time one at a time: while one holds the timing lock,
    another cannot take it (a second handle of the same file, as another process would open it)."""
    fcntl = pytest.importorskip("fcntl")
    import tempfile

    path = Path(tempfile.gettempdir()) / "flashcore-numba-timing.lock"
    with grade.gpu_timing_lock():
        with open(path, "a") as other:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(path, "a") as other:  # released: free again
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(other, fcntl.LOCK_UN)


def test_the_timing_lock_is_re_entrant_within_a_process():
    """A GPU test session holds the lock around each test while graders run beside it
    (conftest.py); a test that grades in-process takes it again and must not wait for itself. The
    lock is held until the outer block ends."""
    fcntl = pytest.importorskip("fcntl")
    import tempfile

    path = Path(tempfile.gettempdir()) / "flashcore-numba-timing.lock"
    with grade.gpu_timing_lock():
        with grade.gpu_timing_lock():
            pass
        with open(path, "a") as other:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(path, "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(other, fcntl.LOCK_UN)
    # re-entrant per thread, not per process: another thread of the same process waits its turn
    import threading

    taken = threading.Event()

    def other_thread():
        with grade.gpu_timing_lock():
            taken.set()

    with grade.gpu_timing_lock():
        thread = threading.Thread(target=other_thread)
        thread.start()
        assert not taken.wait(0.3)
    thread.join(10)
    assert taken.is_set()


def test_a_gpu_test_holds_the_timing_lock_while_graders_run_beside_the_session(monkeypatch):
    """conftest.pytest_runtest_protocol: in a GPU session with graders started, a GPU test runs (setup,
    call, teardown) holding the graders' timing lock; a test that waits for the graders, or any test
    while none run, does not take it."""
    fcntl = pytest.importorskip("fcntl")
    import tempfile
    from types import SimpleNamespace

    import conftest

    path = Path(tempfile.gettempdir()) / "flashcore-numba-timing.lock"

    def held() -> bool:
        with open(path, "a") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(other, fcntl.LOCK_UN)
            return False

    def runs_holding(graders, fixturenames=(), gpu=True) -> bool:
        item = SimpleNamespace(config=SimpleNamespace(stash={conftest.BACKGROUND: (None, graders)}),
                               fixturenames=list(fixturenames), module=SimpleNamespace(),
                               get_closest_marker=lambda name: object() if gpu and name == "gpu" else None)
        protocol = conftest.pytest_runtest_protocol(item, None)
        next(protocol)
        during = held()
        with pytest.raises(StopIteration):
            protocol.send(None)
        assert not held()
        return during

    monkeypatch.setattr(conftest, "simulator_enabled", lambda: False)
    assert runs_holding({"tests.test_exercises": object()})
    assert not runs_holding({"tests.test_exercises": object()}, fixturenames=["runs"])
    assert not runs_holding({"tests.test_exercises": object()}, gpu=False)
    assert not runs_holding({"tests.test_exercises": None})

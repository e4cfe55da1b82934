"""`pytest lessons/exercises --grade NN [--solution PATH] [--grade-seed N]`: grade an exercise with pytest.

Each graded check of `flashcore grade NN` is one test (flashcore_numba.course.grade defines them);
the score table is printed at the end. Without --grade nothing is graded: the tests are
reported as skipped with the command to use, so a plain `pytest lessons/exercises` never fails.
The root conftest.py chooses the CUDA simulator unless FLASHCORE_GPU=1.
"""

from __future__ import annotations

import io

import pytest

GRADING = pytest.StashKey()


def pytest_addoption(parser):
    group = parser.getgroup("flashcore", "grading an exercise (pytest lessons/exercises --grade NN)")
    group.addoption("--grade", metavar="NN", help="grade the exercise of phase NN, e.g. 03")
    group.addoption("--solution", metavar="PATH", help="the file to grade (default lessons/exercises/NN_<name>.py)")
    group.addoption("--grade-seed", metavar="N", type=int, help="repeat a run: the seed a failing run printed")


def pytest_generate_tests(metafunc):
    if "graded_check" not in metafunc.fixturenames:
        return
    phase = metafunc.config.getoption("grade")
    if phase is None:
        skip = pytest.mark.skip(reason="nothing to grade: run `pytest lessons/exercises --grade NN` (e.g. 03)")
        metafunc.parametrize("graded_check", [pytest.param(None, marks=skip)], ids=["no-grade-option"])
        return
    from flashcore_numba.course import grade

    try:
        checks = grade.checks_for(phase)
    except (ValueError, TypeError) as e:
        raise pytest.UsageError(f"--grade: {e}") from None
    metafunc.parametrize("graded_check", checks, ids=[c.name for c in checks])


@pytest.fixture(scope="session")
def grading(pytestconfig):
    """The student's module, loaded once, and the run's seed: shared by every check."""
    from flashcore_numba.course import grade

    g = grade.start(pytestconfig.getoption("grade"), pytestconfig.getoption("solution"),
                    seed=pytestconfig.getoption("grade_seed"))
    pytestconfig.stash[GRADING] = g
    return g


def pytest_terminal_summary(terminalreporter, config):
    g = config.stash.get(GRADING, None)
    if g is None or not g.results:
        return
    from rich.console import Console

    from flashcore_numba.course import grade

    buffer = io.StringIO()
    grade.render(g, Console(file=buffer, width=100, soft_wrap=True))
    terminalreporter.section(f"flashcore grade {g.phase.ID}: {g.path}")
    terminalreporter.write(buffer.getvalue())

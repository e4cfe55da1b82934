"""The graded checks of one exercise, one test each: `pytest lessons/exercises --grade NN`.

See conftest.py for the options. A check the machine cannot run (timing without a GPU) is
skipped with its reason; a failing check reports why, and the run's hidden seed.
"""

import pytest


def test_graded_check(graded_check, grading):
    result = grading.run(graded_check)
    if result.status == "skip":
        pytest.skip(result.detail)
    if result.status == "fail":
        seed = ""
        if graded_check.random_inputs:  # say how to get the same ones again
            seed = f" (inputs from hidden seed {grading.seed}: --grade-seed {grading.seed} repeats them)"
        pytest.fail(f"{result.title}: {result.detail}{seed}", pytrace=False)

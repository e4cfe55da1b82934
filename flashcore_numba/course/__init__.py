"""The course: what the lessons and the exercises run. Uses the library and the measurement.

    notebooks.py  the lesson runtime: the `Lesson` class and the diagrams a notebook calls
    lessons.py    `flashcore lessons`: the notebooks built from, checked against and run from
                  their .py sources
    exercises.py  exercise stubs generated from the marked regions of the phase sources
    grade.py      `flashcore grade NN`: graded checks with points and reasons
    puzzles.py    lesson 00's puzzles, four small kernels (not a phase): the source of the stub
                  lessons/exercises/00_numba_cuda.py
    puzzle_checks.py  how each puzzle is launched, checked (`flashcore grade 00`) and drawn
"""

"""The course: what the lessons and the exercises run. Uses the library and the measurement.

    notebooks.py  the lesson runtime (the `Lesson` class, the diagrams) and `flashcore lessons`
    exercises.py  exercise stubs generated from the marked regions of the phase sources
    grade.py      `flashcore grade NN`: graded checks with points and reasons
"""

"""Exercise stubs, generated from the phase sources: `lessons/exercises/NN_<name>.py`.

A phase module marks the lines a student writes:

    # >>> exercise 03-a: reduce m_ij to the max over the LANES_PER_ROW lanes of this row
    offset = LANES_PER_ROW // 2
    ...
    # <<< exercise

The stub is the phase source with the lines between each pair of markers removed (the
markers stay, so the student sees where to write and what), a header saying what to do and
how to grade, and the package-relative imports made absolute (`from .common import` ->
`from flashcore_numba.phases.common import`) so that the file runs from anywhere. Solving an
exercise therefore only adds lines, as in mojo-gpu-puzzles: the stub's lines are a
subsequence of the solution's, which tests/test_exercises.py checks.

Each region is graded on its own as well as in the whole kernel: `splice_region` puts the
student's lines of one region into the solved file, and flashcore_numba.course.grade runs that
kernel. A region's hints (three tiers) and the wording of its diagnoses live in
flashcore_numba/course/hints.py, keyed by its label: a new region needs an entry there.

Stubs are never edited by hand. After changing a phase:

    python -m flashcore_numba.course.exercises           # which stubs are out of date? (exit 1 if any)
    python -m flashcore_numba.course.exercises --write   # regenerate them all

Everything is driven by `flashcore_numba.phases.LESSONS` (and lesson 00's puzzles,
course/puzzles.py): a new phase with marked regions gets its stub with no new code here.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from ..measure.records import CheckoutNeeded, checkout_root, repo_root

# `# >>> exercise 03-a: what to write` ... `# <<< exercise`. The label is optional for a phase
# with a single region (`# >>> exercise 01: ...`).
BEGIN = re.compile(r"^(?P<indent>[ \t]*)# >>> exercise(?: (?P<label>[^:]+?))?: (?P<instruction>\S.*?)\s*$")
END = re.compile(r"^[ \t]*# <<< exercise\s*$")
# PEP 263: a comment on line 1 or 2 with "coding:" in it ("...decoding: ...") names the file's encoding
ENCODING_DECLARATION = re.compile(r"^[ \t\f]*#.*?coding[:=]")
# `from .x import` / `from ..x import`: resolved against the phase's package.
RELATIVE_IMPORT = re.compile(r"^(?P<head>[ \t]*from[ \t]+)(?P<name>\.+[\w.]*)(?P<tail>[ \t]+import\b.*)$")


class ExerciseFormatError(ValueError):
    """A phase source whose exercise markers are malformed; names the file and line."""


@dataclass(frozen=True)
class Region:
    label: str  # "03-a", or the phase id when the region has none
    instruction: str
    begin: int  # index of the `# >>>` line in the source's lines
    end: int  # index of the `# <<<` line
    solution: tuple[str, ...]  # the lines in between, as written in the phase


def find_regions(source: str, filename: str = "<source>", default_label: str = "") -> list[Region]:
    """The marked regions of a source, in order. Raises ExerciseFormatError on bad markers."""
    lines = source.splitlines()
    regions: list[Region] = []
    open_at = None
    for i, line in enumerate(lines):
        begin, end = BEGIN.match(line), END.match(line)
        if begin:
            if open_at is not None:
                raise ExerciseFormatError(f"{filename}:{i + 1}: exercise region opened inside the region "
                                          f"opened at line {open_at + 1}; close it first with `# <<< exercise`")
            open_at = i
        elif end:
            if open_at is None:
                raise ExerciseFormatError(f"{filename}:{i + 1}: `# <<< exercise` without an opening "
                                          f"`# >>> exercise LABEL: instruction` line")
            m = BEGIN.match(lines[open_at])
            body = tuple(lines[open_at + 1:i])
            if not any(s.strip() for s in body):
                raise ExerciseFormatError(f"{filename}:{open_at + 1}: exercise region is empty: "
                                          f"there is nothing for the student to write")
            regions.append(Region(label=(m["label"] or default_label).strip(), instruction=m["instruction"],
                                  begin=open_at, end=i, solution=body))
            open_at = None
        elif ">>> exercise" in line or "<<< exercise" in line:
            raise ExerciseFormatError(f"{filename}:{i + 1}: malformed exercise marker {line.strip()!r}; "
                                      f"expected `# >>> exercise LABEL: instruction` or `# <<< exercise`")
    if open_at is not None:
        raise ExerciseFormatError(f"{filename}:{open_at + 1}: exercise region is never closed "
                                  f"with `# <<< exercise`")
    labels = [r.label for r in regions]
    duplicates = sorted({x for x in labels if labels.count(x) > 1})
    if duplicates:
        raise ExerciseFormatError(f"{filename}: exercise labels must be unique; repeated: {', '.join(duplicates)} "
                                  f"(label several regions 03-a, 03-b, ...)")
    return regions


def absolute_imports(source: str, package: str) -> str:
    """Rewrite `from .common import x` as `from flashcore_numba.phases.common import x` (for `package`)."""

    def rewrite(line: str) -> str:
        m = RELATIVE_IMPORT.match(line)
        if not m:
            return line
        return f"{m['head']}{importlib.util.resolve_name(m['name'], package)}{m['tail']}"

    return "\n".join(rewrite(line) for line in source.splitlines()) + "\n"


def strip_regions(source: str, regions: list[Region]) -> str:
    """The source with every region's lines removed; the marker lines stay."""
    lines = source.splitlines()
    removed = {i for r in regions for i in range(r.begin + 1, r.end)}
    return "\n".join(line for i, line in enumerate(lines) if i not in removed) + "\n"


# ---------------------------------------------------------------------------------------------
# Per phase
# ---------------------------------------------------------------------------------------------
def phase_source(phase: ModuleType) -> str:
    return Path(phase.__file__).read_text(encoding="utf-8")


# From phase 07 on (the tensor-core phases, decoding, the backward) a phase's docstring is its full
# account, not a lesson: the stub gets a short one. Phases 01-06 keep theirs, the lesson in brief.
FULL_ACCOUNT_FROM = "07"


def lesson_name(phase: ModuleType) -> str:
    return f"lessons/{phase.ID}_{phase.NAME}.ipynb"


def exercise_source(phase: ModuleType) -> str:
    """The phase source as its exercise files hold it. The docstring of a phase from
    FULL_ACCOUNT_FROM on (what changed, why, every measured effect) is cut to its first paragraph
    and a pointer to the solution and the lesson, so that the stub opens on the kernel; the same
    cut in the stub and in the solution keeps the stub's lines a subsequence of the solution's."""
    source = phase_source(phase)
    body = ast.parse(source).body
    first = body[0] if body else None
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)) or phase.ID < FULL_ACCOUNT_FROM:
        return source
    title = first.value.value.strip().split("\n\n")[0]
    short = (f'"""{title}\n\nThe whole account of this phase (what it changes, why the hardware rewards it, '
             f'what each\nchange bought) is the docstring of {_relative(phase.__file__)}; the lesson is\n'
             f'{lesson_name(phase)}.\n"""\n')
    lines = source.splitlines(keepends=True)
    return "".join(lines[:first.lineno - 1]) + short + "".join(lines[first.end_lineno:])


def phase_regions(phase: ModuleType) -> list[Region]:
    return find_regions(exercise_source(phase), _relative(phase.__file__), default_label=phase.ID)


def stub_name(phase: ModuleType) -> str:
    return f"{phase.ID}_{phase.NAME}.py"


def exercises_dir() -> Path:
    """lessons/exercises/ of the checkout (an installed package has none: CheckoutNeeded)."""
    return repo_root("the exercise stubs (lessons/exercises/)") / "lessons" / "exercises"


def stub_path(phase: ModuleType, directory: Path | None = None) -> Path:
    return Path(directory or exercises_dir()) / stub_name(phase)


def _relative(path) -> str:
    path, root = Path(path).resolve(), checkout_root()
    try:
        return path.relative_to(root).as_posix() if root else str(path)
    except ValueError:
        return str(path)


def header(phase: ModuleType, regions: list[Region]) -> str:
    """What the student reads first: what to do, how to grade, where the solution is."""
    n = len(regions)
    todo = "\n".join(f"#   {r.label}: {r.instruction}" for r in regions)
    if phase.ID == PUZZLES_ID:  # lesson 00's puzzles (course/puzzles.py): small kernels, no phase
        what, inputs, source = "lesson 00's puzzles", "hidden random inputs", "the puzzles"
        no_gpu = "Without a GPU the kernels run in Numba's CUDA simulator."
    else:
        what, inputs, source = (f"the finished phase {phase.ID} kernel",
                                "hidden random inputs and adversarial shapes", "the phase")
        no_gpu = "Without a GPU the kernel runs in Numba's CUDA simulator (slow) and the timing checks are skipped."
    lesson = ("The docstring below is the lesson." if exercise_source(phase) == phase_source(phase)
              else f"The lesson is {lesson_name(phase)}.")
    return f"""\
# Exercise {phase.ID}: {phase.TITLE}
#
# This is {what} with {n} marked region{"s" * (n != 1)} emptied:
{todo}
# Write the missing lines between each `# >>> exercise` line and its `# <<< exercise` line.
# Change nothing else: solving only adds lines. {lesson}
#
# Grade it ({inputs}; points and reasons per check):
#     flashcore grade {phase.ID}                         this file
#     flashcore grade {phase.ID} path/to/copy.py         a copy of it
#     pytest lessons/exercises --grade {phase.ID}        the same checks, as pytest tests
# {no_gpu}
# Stuck? `flashcore grade {phase.ID} --hint` gives a hint per region (--hint 2, 3: more);
# the solution is {_relative(phase.__file__)}.
#
# Generated from that file by `python -m flashcore_numba.course.exercises --write`:
# improve {source}, not this copy.
"""


def solution_source(phase: ModuleType) -> str:
    """The solved exercise file: the stub with every region filled in as the phase has it."""
    return header(phase, phase_regions(phase)) + absolute_imports(exercise_source(phase), phase.__package__)


def stub_source(phase: ModuleType) -> str:
    """The exercise stub of a phase, exactly as committed under lessons/exercises/."""
    source = exercise_source(phase)
    regions = phase_regions(phase)
    if not regions:
        raise ExerciseFormatError(f"{_relative(phase.__file__)}: no `# >>> exercise` region; every phase "
                                  f"ships with an exercise (see flashcore_numba/course/exercises.py)")
    stub = header(phase, regions) + absolute_imports(strip_regions(source, regions), phase.__package__)
    if any(ENCODING_DECLARATION.match(line) for line in stub.splitlines()[:2]):
        raise ExerciseFormatError(f"{_relative(phase.__file__)}: the stub's first lines read as a Python encoding "
                                  f"declaration (PEP 263: a comment with 'coding:' in it); reword the phase's "
                                  f"TITLE, which the header's first line holds")
    try:  # an emptied region must leave valid Python (e.g. not the whole body of an `if`)
        compile(stub, stub_name(phase), "exec")
    except SyntaxError as e:
        raise ExerciseFormatError(f"{_relative(phase.__file__)}: the stub is not valid Python once the "
                                  f"regions are emptied ({e.msg}, stub line {e.lineno}); keep a statement "
                                  f"such as `pass` or an initial value outside the region") from None
    return stub


def fill_regions(stub: str, fills: dict[str, str]) -> str:
    """Insert text into a stub's regions by label (used to build deliberately wrong answers)."""
    lines = stub.splitlines()
    out = []
    label = None
    for line in lines:
        begin = BEGIN.match(line)
        if begin:
            label = (begin["label"] or "").strip()
        if END.match(line) and label in fills:
            indent = re.match(r"[ \t]*", line).group()
            out += [indent + x for x in fills[label].splitlines()]
        out.append(line)
    return "\n".join(out) + "\n"


def region_bodies(source: str) -> dict[str, tuple[int, int]]:
    """Where each region's lines are in a student's file: label -> (first line, one past the last),
    0-based, the marker lines excluded. Unlike find_regions, an empty region is fine (an untouched
    stub) and the labels are read as written (a phase with one region has its id as its label)."""
    lines = source.splitlines()
    bodies, label, start = {}, None, 0
    for i, line in enumerate(lines):
        begin = BEGIN.match(line)
        if begin:
            label, start = (begin["label"] or "").strip(), i + 1
        elif END.match(line) and label is not None:
            bodies[label] = (start, i)
            label = None
    return bodies


@dataclass(frozen=True)
class Spliced:
    """The solution with one region's lines taken from a student's file (see splice_region)."""

    source: str
    lines: dict[int, int]  # 1-based line of `source` -> 1-based line of the student's file
    # the same for the lines outside every region that the student's file has too (the code
    # around the regions, at other places where the student's regions are longer or shorter)
    outside: dict[int, int] = field(default_factory=dict)


def splice_region(solution: str, student: str, label: str) -> Spliced:
    """The solved exercise `solution` (solution_source) with region `label`'s lines replaced by the
    student's: a kernel in which only that region is the student's, so it is graded on its own.
    Raises ExerciseFormatError when the student's file has lost the region's markers."""
    theirs = region_bodies(student)
    if label not in theirs:
        raise ExerciseFormatError(f"the markers of region {label} are missing: keep the `# >>> exercise "
                                  f"{label}: ...` and `# <<< exercise` lines the stub came with")
    begin, end = region_bodies(solution)[label]
    first, last = theirs[label]
    student_lines, solution_lines = student.splitlines(), solution.splitlines()
    spliced = solution_lines[:begin] + student_lines[first:last] + solution_lines[end:]
    mapping = {begin + 1 + i: first + 1 + i for i in range(last - first)}
    shift = (last - first) - (end - begin)  # how far the solution's lines after the region moved
    outside = {}
    for at_solution, at_student in _outside_lines(solution_lines, student_lines).items():
        if at_solution < begin or at_solution >= end:
            outside[at_solution + 1 + (shift if at_solution >= end else 0)] = at_student + 1
    return Spliced("\n".join(spliced) + "\n", mapping, outside)


def _outside_lines(solution: list[str], student: list[str]) -> dict[int, int]:
    """0-based line of the solution -> the same line in the student's file, for the lines outside
    every region that both have (matched as text, in order: a student may have changed some)."""
    def outside(lines):
        inside = {i for a, b in region_bodies("\n".join(lines)).values() for i in range(a, b)}
        return [i for i in range(len(lines)) if i not in inside]

    ours, theirs = outside(solution), outside(student)
    matcher = difflib.SequenceMatcher(None, [solution[i] for i in ours], [student[i] for i in theirs], autojunk=False)
    return {ours[a + k]: theirs[b + k] for a, b, n in matcher.get_matching_blocks() for k in range(n)}


# ---------------------------------------------------------------------------------------------
# python -m flashcore_numba.course.exercises [--write]
# ---------------------------------------------------------------------------------------------
# Lesson 00's puzzles have an exercise like a phase's, though they are no phase: their module
# (course/puzzles.py) has a phase's ID, NAME and TITLE; course/puzzle_checks.py grades them.
PUZZLES_ID = "00"


def exercise_module(phase) -> ModuleType:
    """The module an exercise id names: a phase (by id, name or module), or lesson 00's puzzles
    ("00", "0", "numba_cuda" or the module)."""
    from ..phases import get_lesson
    from . import puzzles

    if phase is puzzles or (isinstance(phase, str) and phase.strip() in (PUZZLES_ID, "0", puzzles.NAME)):
        return puzzles
    try:
        return get_lesson(phase)
    except ValueError as e:
        raise ValueError(f"{e}; or {PUZZLES_ID} (lesson 00's puzzles)") from None


def exercise_modules() -> list[ModuleType]:
    """Every module with an exercise: lesson 00's puzzles (course/puzzles.py), then the phases of
    the course (phases.LESSONS: the ladder, then phase 11)."""
    from ..phases import LESSONS
    from . import puzzles

    return [puzzles, *LESSONS.values()]


def out_of_date(directory: Path | None = None) -> list[Path]:
    directory = directory or exercises_dir()
    return [stub_path(p, directory) for p in exercise_modules()
            if not stub_path(p, directory).exists()
            or stub_path(p, directory).read_text(encoding="utf-8") != stub_source(p)]


def write_all(directory: Path | None = None) -> list[Path]:
    directory = Path(directory or exercises_dir())
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for phase in exercise_modules():
        path = stub_path(phase, directory)
        text = stub_source(phase)
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            written.append(path)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashcore_numba.course.exercises",
                                     description="Check or regenerate the exercise stubs in "
                                                 "lessons/exercises/.")
    parser.add_argument("--write", action="store_true", help="rewrite the stubs from the phase sources")
    args = parser.parse_args(argv)
    try:
        if args.write:
            written = write_all()
            for path in written:
                print(f"wrote {_relative(path)}")
            print(f"{len(written)} stub(s) rewritten" if written else "all stubs were up to date")
            return 0
        stale = out_of_date()
    except (ExerciseFormatError, CheckoutNeeded) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in stale:
        print(f"out of date: {_relative(path)}")
    if stale:
        print("regenerate with: python -m flashcore_numba.course.exercises --write")
        return 1
    print("all stubs are up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

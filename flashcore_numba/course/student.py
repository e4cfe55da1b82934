"""Running a student's file: loading it as a module of its own, splicing one region of it into the
solution, and what a launch of it needs (the poisoned local arrays, the timing lock). Shared by
the grader's checks of the forward phases (grade.py) and of the backward (grade_backward.py)."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import re
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

import numpy as np

from ..arch.sim import simulator_enabled
from . import exercises
from .diagnose import describe_exception
from .hints import worded_by

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # flashcore_numba/

_loaded = itertools.count()


def load_module(path: Path) -> ModuleType:
    """Import a file as a fresh module of its own (a unique name, so nothing is shared or cached).

    A file inside this package (a phase module, the reference solution) is loaded as a
    sibling of its package so that its relative imports resolve.
    """
    path = Path(path).resolve()
    stem = re.sub(r"\W", "_", path.stem)
    name = f"_flashcore_graded_{stem}_{next(_loaded)}"
    try:
        package = ".".join(("flashcore_numba",) + path.parent.relative_to(PACKAGE_DIR).parts)
        name = f"{package}.{name}"
    except ValueError:
        pass
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and numba look modules up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


_REGION_DIR: list[Path] = []


def _region_dir() -> Path:
    """Where the spliced kernels are written (one folder per process, removed at exit)."""
    if not _REGION_DIR:
        import atexit
        import shutil

        folder = Path(tempfile.mkdtemp(prefix="flashcore_regions_"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _REGION_DIR.append(folder)
    return _REGION_DIR[0]


class RegionNotLoaded(Exception):
    """The spliced file of a region check does not load; the message says why, at the student's line."""


def load_region(g, label: str) -> tuple[ModuleType, Path, exercises.Spliced]:
    """(module, its file, the splice) of the solution with region `label`'s lines from the student's file
    (g: the grading, grade.Grading: its phase and the student's path)."""
    student = g.path.read_text(encoding="utf-8")
    try:
        spliced = exercises.splice_region(exercises.solution_source(g.phase), student, label)
    except exercises.ExerciseFormatError as e:
        raise RegionNotLoaded(str(e)) from None
    name = re.sub(r"\W", "_", label)
    path = _region_dir() / f"{g.phase.ID}_{g.phase.NAME}_region_{name}_{next(_loaded)}.py"
    path.write_text(spliced.source, encoding="utf-8")
    try:
        return load_module(path), path, spliced
    except SyntaxError as e:
        line = spliced.lines.get(e.lineno)
        where = f"{g.path.name} line {line}" if line else f"region {label}"
        raise RegionNotLoaded(f"{where}: SyntaxError: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 - the region's code fails as the module loads
        raise RegionNotLoaded(f"region {label}: {describe_exception(e, path, spliced.lines, g.path)}") from None


def region_lines(spliced: exercises.Spliced) -> list[str]:
    """The student's lines of a spliced source."""
    lines = spliced.source.splitlines()
    return [lines[i - 1] for i in sorted(spliced.lines)]


def holds_code(lines) -> bool:
    """Whether a region's lines hold code (not only blank lines and comments): a region without is still empty."""
    return any(line.strip() and not line.lstrip().startswith("#") for line in lines)


def still_empty(g, label: str, spliced) -> list[str]:
    """The line a failed region check adds while the student's region `label` holds no code yet (every
    grader's: grade.py, grade_backward.py, grade_flex.py), else none."""
    if holds_code(region_lines(spliced)):
        return []
    return [f"region {label} is still empty: write its lines between the markers "
            f"(`flashcore grade {g.phase.ID} --hint` gives a hint)"]


def suspect_regions(g) -> list[str]:
    """The regions a failure of the whole kernel most likely comes from (g: the grading, grade.Grading):
    those still empty in the student's file; else those whose own check failed in this run; else all
    of the exercise's regions."""
    labels = [r.label for r in exercises.phase_regions(g.phase)]
    lines = g.path.read_text(encoding="utf-8").splitlines()
    bodies = exercises.region_bodies("\n".join(lines))
    empty = [label for label in labels if label in bodies and not holds_code(lines[slice(*bodies[label])])]
    failed = [r.name for r in g.results if r.kind == "region" and r.status == "fail"]
    return empty or [label for label in labels if label in failed] or labels


def kernel_diagnoses(g) -> dict[str, str]:
    """The diagnoses of a whole-kernel check, in the words of the regions it most likely comes from
    (suspect_regions): a student of exercise 10 reads of its merge weights, not of m_i, l_i and acc."""
    return worded_by(suspect_regions(g))


# A local array's poison, per kind of element: NaN for floats, and for unsigned words the bits of
# fp16 NaNs (0x7E00 per 16-bit half), since they carry packed fp16 pairs (mma fragments)
NAN_HALVES = 0x7E007E007E007E00


@contextlib.contextmanager
def poisoned_local_arrays():
    """In the simulator, cuda.local.array comes filled with NaN (floats), fp16 NaN bits (unsigned
    words) or zeros (signed), rather than NumPy's leftovers: an unset register gives the same
    wrong answer on every run, so the diagnosis is the same on every run. Nothing on a GPU."""
    if not simulator_enabled():
        yield
        return
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    def array(self, shape, dtype, alignment=None):
        if not isinstance(dtype, np.dtype) and not isinstance(dtype, type):
            dtype = numpy_support.as_dtype(dtype)
        dtype = np.dtype(dtype)
        if dtype.kind == "f":
            return np.full(shape, np.nan, dtype)
        if dtype.kind == "u":
            return np.full(shape, NAN_HALVES & ((1 << (8 * dtype.itemsize)) - 1), dtype)
        return np.zeros(shape, dtype)

    original = kernelapi.FakeCUDALocal.array
    kernelapi.FakeCUDALocal.array = array
    try:
        yield
    finally:
        kernelapi.FakeCUDALocal.array = original


_timing_lock = threading.local()  # this thread's nesting of gpu_timing_lock: an inner one holds nothing more


@contextlib.contextmanager
def gpu_timing_lock():
    """One grader at a time times kernels on this machine: two timing at once would each measure
    the other's load. Graders still compile side by side (the test suite runs one per core); only
    the timed launches wait. A lock file in the temporary folder (arch/cache.py's `locked`: where
    the platform has no flock, no lock: run one grader at a time there). Re-entrant within a
    thread: a GPU test session holds it around each test while graders run beside it
    (conftest.py), and a test that grades in-process takes it again. Another thread waits."""
    from ..arch.cache import locked

    depth = getattr(_timing_lock, "depth", 0)
    if depth:
        _timing_lock.depth = depth + 1
        try:
            yield
        finally:
            _timing_lock.depth -= 1
        return
    with locked(Path(tempfile.gettempdir()) / "flashcore-numba-timing.lock"):
        _timing_lock.depth = 1
        try:
            yield
        finally:
            _timing_lock.depth = 0

"""Test set-up shared by every test file.

CPU by default: unless FLASHCORE_GPU=1 is set, the whole session runs in Numba's CUDA
simulator (NUMBA_ENABLE_CUDASIM=1), which must be chosen before numba.cuda is imported.
Tests marked `gpu` need a real GPU and skip, with the reason, in the simulator. On a GPU
machine: `FLASHCORE_GPU=1 python -m pytest -m gpu`.

Background jobs. The longest work of the suite runs in child processes:
the exercise grader, the lesson notebooks, `flashcore run`, the kernels compiled for sm_90a. The
simulator is bound to one core by the GIL, so while this process runs the other tests a second
core sits idle. A test module may define `start_background(items, pool)`: it is called once the
session's tests are known, submits its child processes to one shared pool (a worker per core)
and returns what its fixture hands to its tests. The tests that read such jobs (they use a
fixture named in BACKGROUND_FIXTURES) run last, so that the jobs have had the whole session to
finish. The jobs run at a lower priority (nice 10) than the tests of this process.

Tests marked `beside`: long simulator runs (whole modules say so with pytestmark) that a child
pytest runs in the same pool, beside this process's tests, instead of this process: each such
test of this session then reads its outcome (passed, failed with the child's report, skipped with
its reason) from the child, last. A CPU session only, and never inside that child (FLASHCORE_BESIDE_REPORT
names the child's file of outcomes); on a GPU, or run alone (`pytest tests/test_varlen.py::test_x`
where every selected test is `beside`), they run here as any test.

In a GPU session only the modules that say BACKGROUND_ON_GPU start theirs (test_exercises: the
graders, whose GPU work is timing kernels). They take turns with this process's tests: each GPU
test holds the graders' timing lock (course.student.gpu_timing_lock) while it runs, so that no
grader times a kernel while a test's kernels share the GPU, and the graders' compiling, most of
their time, overlaps the rest of the suite.
"""

import ast
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if sys.version_info < (3, 13):
    # On CPython 3.11 and 3.12 the counter that ast.parse uses to check its own recursion is one per
    # interpreter, not one per thread: two threads parsing at once (a test here, and jupytext or
    # the grader's stub generation in a background job) can make either raise "SystemError: AST
    # constructor recursion depth mismatch" (CPython issue 106905). One parse at a time: ast.parse
    # is called by its module-level name, by pytest's assertion rewriting and by ast.literal_eval,
    # so replacing it here covers them all.
    _parse, _parse_lock = ast.parse, threading.Lock()

    @functools.wraps(_parse)
    def _one_parse_at_a_time(*args, **kwargs):
        with _parse_lock:
            return _parse(*args, **kwargs)

    ast.parse = _one_parse_at_a_time

if os.environ.get("FLASHCORE_GPU", "0") in ("", "0"):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest  # noqa: E402

from flashcore_numba.arch.sim import simulator_enabled  # noqa: E402

# the fixtures that read background jobs: the grader runs (test_exercises), the executed lessons
# (test_lessons), `flashcore run` (test_harness), the sm_90a compile reports (test_machine_code, test_ptx,
# test_backward, test_backward_wgmma), the kernel cache and launch ABI against the real compiler (test_runtime)
BACKGROUND_FIXTURES = {"runs", "executed", "flashcore_run", "compiler_run", "reports", "phase06_reports",
                       "phase07_report", "phase08_report", "phase09_report", "backward_reports",
                       "wgmma_backward_reports"}
BACKGROUND = pytest.StashKey[tuple]()


BESIDE = pytest.StashKey[object]()
BESIDE_REPORT = "FLASHCORE_BESIDE_REPORT"  # set in the child that runs the `beside` tests: its outcomes' file


def _waits(item) -> bool:
    """Does this test wait for a background job (a fixture of BACKGROUND_FIXTURES, or the child run)?"""
    return bool(BACKGROUND_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("beside"))


def pytest_collection_modifyitems(config, items):
    # the tests waiting for background jobs last (a stable sort keeps the order)
    items.sort(key=_waits)
    if not simulator_enabled():
        from numba import cuda

        if cuda.is_available():
            return
        reason = "no CUDA GPU is available"
    else:
        reason = "runs in the CUDA simulator (set FLASHCORE_GPU=1 on a GPU machine to run GPU tests)"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Start every module's background jobs (see the module docstring); in a GPU session, those of
    the modules that say BACKGROUND_ON_GPU."""
    if not session.items or session.config.option.collectonly:
        return
    pool = TimedPool(max_workers=os.cpu_count() or 1, initializer=_lower_priority)
    started = {}
    modules = dict.fromkeys(getattr(item, "module", None) for item in session.items)
    if not simulator_enabled():  # a GPU session: without a GPU its GPU tests skip, and no grader starts
        from numba import cuda

        on_gpu = cuda.is_available()
        modules = [m for m in modules if on_gpu and getattr(m, "BACKGROUND_ON_GPU", False)]
    # the pool runs jobs in the order they come: a module whose jobs are the longest (the lessons)
    # says so with BACKGROUND_FIRST, so that its jobs start at once and the short ones fill in around them
    beside = [item for item in session.items if item.get_closest_marker("beside")]
    if simulator_enabled() and BESIDE_REPORT not in os.environ and 0 < len(beside) < len(session.items):
        session.config.stash[BESIDE] = BesideRun(beside, pool, session.config.rootpath)  # the longest job: first
    for module in sorted(modules, key=lambda m: not getattr(m, "BACKGROUND_FIRST", False)):
        start = getattr(module, "start_background", None)
        if start is not None:
            started[module.__name__] = start(session.items, pool)
    session.config.stash[BACKGROUND] = (pool, started)


class BesideRun:
    """The child pytest that runs this session's `beside` tests (see the module docstring), started
    in the pool; each of those tests here reads its outcome instead of running."""

    def __init__(self, items, pool, root):
        self.outcomes_file = Path(tempfile.mkdtemp(prefix="beside")) / "outcomes.json"
        self.root = root
        nodeids = [item.nodeid for item in items]
        self.done = pool.submit(self.run, nodeids)
        for item in items:  # here, no fixture and no test body: the child runs both
            item.setup = lambda: None
            item.runtest = functools.partial(self.read, item.nodeid)

    def run(self, nodeids):
        env = dict(os.environ, **{BESIDE_REPORT: str(self.outcomes_file)})
        # -m "": the tests named, whatever their markers (the session chose them: `-m slow` chooses slow ones)
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "", *nodeids],
                              cwd=self.root, env=env, capture_output=True, text=True)
        outcomes = json.loads(self.outcomes_file.read_text()) if self.outcomes_file.exists() else {}
        return done, outcomes  # read once, when the child ends

    def read(self, nodeid):
        done, outcomes = self.done.result()
        if nodeid not in outcomes:
            pytest.fail(f"the child run of the `beside` tests did not report {nodeid} (exit status "
                        f"{done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}", pytrace=False)
        outcome, text = outcomes[nodeid]
        if outcome == "skipped":
            pytest.skip(text)
        if outcome == "failed":
            pytest.fail(f"(run in the child pytest beside this one)\n{text}", pytrace=False)


_OUTCOMES: dict = {}  # in the child: nodeid -> (outcome, the report's text)


def pytest_runtest_logreport(report):
    """In the child that runs the `beside` tests: each test's outcome, the worst of its phases."""
    if BESIDE_REPORT not in os.environ:
        return
    previous = _OUTCOMES.get(report.nodeid, ("passed", ""))
    if report.failed:
        _OUTCOMES[report.nodeid] = ("failed", f"{previous[1]}{report.when}: {report.longreprtext}\n")
    elif report.skipped and previous[0] == "passed":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _OUTCOMES[report.nodeid] = ("skipped", reason.removeprefix("Skipped: "))
    else:
        _OUTCOMES.setdefault(report.nodeid, previous)


class TimedPool(ThreadPoolExecutor):
    """The shared pool, noting when each job started and ended: the session's summary lists the
    longest (the suite's critical path is usually one of them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.created = time.monotonic()
        self.times: list[tuple[str, float, float]] = []

    def submit(self, fn, /, *args, **kwargs):
        name = " ".join([getattr(fn, "__qualname__", repr(fn)), *map(str, args)])

        def timed():
            started = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times.append((name, started - self.created, time.monotonic() - self.created))

        return super().submit(timed)


NUMBA_COMPILES: list[tuple[str, float]] = []  # GPU sessions: (kernel, seconds) of each Numba compiled here


def pytest_configure(config):
    if not simulator_enabled():
        from numba.cuda.dispatcher import CUDADispatcher

        watch_compiles(CUDADispatcher)


def watch_compiles(dispatcher_class, compiles=NUMBA_COMPILES):
    """Note in `compiles` each kernel that Numba's dispatcher compiles in this process: one launched
    without its cache key (or a student's), which no `flashcore compile` can spare the suite."""
    from numba.cuda.core import sigutils

    original = dispatcher_class.compile

    @functools.wraps(original)
    def compile(self, sig):
        try:  # only watching: whatever goes wrong here must not change what compile does
            fresh = not self.specialized and sigutils.normalize_signature(sig)[0] not in self.overloads
        except Exception:  # noqa: BLE001
            fresh = False
        started = time.perf_counter()
        try:
            return original(self, sig)
        finally:
            if fresh:
                try:
                    where = os.path.relpath(self.py_func.__code__.co_filename)
                    compiles.append((f"{self.py_func.__qualname__} ({where})", time.perf_counter() - started))
                except Exception:  # noqa: BLE001 - only watching
                    pass

    dispatcher_class.compile = compile


def pytest_terminal_summary(terminalreporter):
    if not simulator_enabled() and not terminalreporter.config.option.collectonly:  # what it compiled
        from flashcore_numba.arch.cache import cache_dir, stats

        terminalreporter.section("kernels compiled by this process")
        terminalreporter.write_line(
            f"kernel cache: {stats['loaded']} loaded from {cache_dir()}, {stats['built']} compiled, "
            f"{stats['rejected']} entries rejected (`flashcore compile` fills it ahead)")
        terminalreporter.write_line(f"Numba, without the cache: {len(NUMBA_COMPILES)} kernels in "
                                    f"{sum(s for _, s in NUMBA_COMPILES):.0f} s")
        for name, seconds in sorted(NUMBA_COMPILES, key=lambda c: -c[1])[:10]:
            terminalreporter.write_line(f"{seconds:7.1f} s  {name}")
    pool, _ = terminalreporter.config.stash.get(BACKGROUND, (None, {}))
    if not getattr(pool, "times", None):
        return
    terminalreporter.section("background jobs (seconds from the session's start; longest first)")
    for name, start, end in sorted(pool.times, key=lambda t: t[1] - t[2])[:15]:
        terminalreporter.write_line(f"{end - start:7.1f} s  {start:6.1f} -> {end:6.1f}  {name}")
    terminalreporter.write_line(f"{len(pool.times)} jobs, {sum(end - start for _, start, end in pool.times):.0f} s "
                                "together")


def _lower_priority():
    """A background worker yields the processor to this process's tests: on Linux the nice value
    belongs to the calling thread, and the child processes it starts inherit it. The simulated
    CUDA threads of a test hand the interpreter lock to one another thousands of times per launch,
    and each hand-over waits for the next thread to be scheduled: the fewer cores background jobs
    of equal priority leave it, the longer each wait."""
    try:
        os.nice(10)
    except (AttributeError, OSError):  # no nice() on this platform
        pass


@pytest.fixture(scope="module")
def background(request):
    """What the requesting module's start_background returned, or None (not started: none of its
    tests selected, or a GPU session and the module does not say BACKGROUND_ON_GPU)."""
    _, started = request.config.stash.get(BACKGROUND, (None, {}))
    return started.get(request.module.__name__)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A GPU test, while graders run beside the session, holds their timing lock (see the module
    docstring) through its setup, call and teardown (a module's fixture may launch kernels too). Not
    the tests that wait for the graders' results: they would wait for a grader that waits for them."""
    _, started = item.config.stash.get(BACKGROUND, (None, {}))
    graders_beside = not simulator_enabled() and any(started.values())
    waits_for_them = (BACKGROUND_FIXTURES & set(getattr(item, "fixturenames", ()))
                      or getattr(getattr(item, "module", None), "BACKGROUND_ON_GPU", False))
    if not graders_beside or item.get_closest_marker("gpu") is None or waits_for_them:
        yield
        return
    from flashcore_numba.course.student import gpu_timing_lock

    with gpu_timing_lock():
        yield


def pytest_sessionfinish(session):
    if BESIDE_REPORT in os.environ:  # the child of a BesideRun: its outcomes for the parent
        Path(os.environ[BESIDE_REPORT]).write_text(json.dumps(_OUTCOMES), encoding="utf-8")
    pool, started = session.config.stash.get(BACKGROUND, (None, {}))
    for jobs in started.values():
        close = getattr(jobs, "close", None)
        if close is not None:
            close()
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)

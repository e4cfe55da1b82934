"""The lesson notebooks: one per phase, in sync with their jupytext source, and runnable headless.

Each lesson is executed top to bottom with nbclient in a fresh kernel, which inherits this
session's environment: in CI that is the simulator (the root conftest sets NUMBA_ENABLE_CUDASIM=1).
The executed notebooks are written to a temporary folder, never over the committed ones.
"""

from __future__ import annotations

import difflib
import re
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pytest

# the notebook tools are the `notebooks` extra: without them these tests skip, saying which is missing
# (IPython.display too: the listings print through it. Imported here, before the session's background
# lessons start their threads: an import of IPython racing one in another thread raised KeyError)
for _module in ("nbformat", "nbclient", "jupytext", "IPython.display"):
    pytest.importorskip(_module, reason=f"{_module} is not installed (pip install -e '.[notebooks]')",
                        exc_type=ImportError)
import nbformat  # noqa: E402

from flashcore_numba.course import lessons, notebooks  # noqa: E402
from flashcore_numba.phases import LESSONS as PHASES  # noqa: E402 (every phase with a lesson: the ladder, then 11)

LESSONS = Path(__file__).resolve().parent.parent / "lessons"
FIXTURE_RECORDS = Path(__file__).parent / "data" / "bench_records"
TEMPLATE_CALLS = ("lesson.intro()", "lesson.show_source(", "lesson.check()", "lesson.timing()",
                  "lesson.plot_timing(", "lesson.machine_code()", "lesson.ptx(", "lesson.sass(",
                  "lesson.exercise()", "lesson.show_solution()")


@pytest.mark.parametrize("pid", sorted(PHASES))
def test_every_phase_has_a_lesson(pid):
    stem = notebooks.lesson_stem(pid)
    for suffix in (".py", ".ipynb"):
        assert (LESSONS / f"{stem}{suffix}").exists(), (
            f"phase {pid} has no lessons/{stem}{suffix}: write it with `flashcore lessons --new {pid}`, "
            f"then `flashcore lessons --sync`")


def test_course_map_links_every_lesson():
    readme = (LESSONS / "README.md").read_text()
    for pid in ["00", *PHASES]:
        stem = notebooks.lesson_stem(pid)
        assert f"]({stem}.ipynb)" in readme, f"lessons/README.md has no row linking {stem}.ipynb"
        assert f"](exercises/{stem}.py)" in readme, f"lessons/README.md does not link exercises/{stem}.py"


def test_notebooks_are_in_sync_with_their_sources():
    assert lessons.check() == []


@pytest.mark.parametrize("pid", sorted(PHASES))
def test_lesson_follows_the_template(pid):
    text = notebooks.lesson_path(pid).read_text()
    assert f'notebooks.Lesson("{pid}")' in text
    missing = [call for call in TEMPLATE_CALLS if call not in text]
    assert not missing, f"lesson {pid} lacks the template's cells: {missing}"
    assert "NUMBA_ENABLE_CUDASIM" in text.split("notebooks.Lesson(")[0], (
        "the device cell must come before the package is imported")


def test_sync_and_check_catch_a_stale_notebook(tmp_path):
    py = tmp_path / "01_naive.py"
    shutil.copy(LESSONS / "01_naive.py", py)
    assert lessons.sync([py], quiet=True) == [py.with_suffix(".ipynb")]
    assert lessons.sync([py], quiet=True) == [], "regenerating an unchanged lesson must change nothing"

    def problems():
        return [p for p in lessons.check(tmp_path) if "01_naive" in p and "has no lesson" not in p]

    assert problems() == []
    py.write_text(py.read_text().replace("lesson.check()", "lesson.check()  # edited"))
    assert any("differs from 01_naive.py" in p for p in problems())
    lessons.sync([py], quiet=True)
    assert problems() == []


def test_sync_keeps_outputs_of_unchanged_cells(tmp_path):
    py = tmp_path / "01_naive.py"
    shutil.copy(LESSONS / "01_naive.py", py)
    lessons.sync([py], quiet=True)
    ipynb = py.with_suffix(".ipynb")
    nb = nbformat.read(ipynb, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    edited = next(i for i, c in enumerate(code) if c.source == "lesson.exercise()")
    for cell in code[edited - 1:edited + 1]:
        cell.outputs = [nbformat.v4.new_output("stream", text=f"output of {cell.source}\n")]
    nbformat.write(nb, ipynb)
    py.write_text(py.read_text().replace("lesson.exercise()", "lesson.exercise()  # edited"))
    lessons.sync([py], quiet=True)
    code = [c for c in nbformat.read(ipynb, as_version=4).cells if c.cell_type == "code"]
    assert code[edited - 1].outputs, "an unchanged cell keeps its output"
    assert not code[edited].outputs, "an edited cell loses its stale output"


def test_new_lesson_from_the_template(tmp_path):
    path = lessons.new_lesson("03", tmp_path)
    text = path.read_text()
    assert path.name == "03_warp_shuffle.py"
    assert 'notebooks.Lesson("03")' in text and "p03_warp_shuffle as phase" in text
    assert all(call in text for call in TEMPLATE_CALLS)
    assert lessons.notebook_from_py(path).cells, "the template is valid jupytext"
    with pytest.raises(FileExistsError, match="phase"):
        lessons.new_lesson("03", tmp_path)


def test_timing_reads_the_committed_record_on_a_cpu(capsys):
    if not notebooks.Lesson("03").on_gpu:
        result = notebooks.Lesson("03").timing(FIXTURE_RECORDS)
        out = capsys.readouterr().out
        assert re.search(r"measured on .+ on \d{4}-\d{2}-\d{2}, read from .+\.json", out)
        names = [r["name"] for r in result["rows"]]
        assert "02 smem_tiling" in names and "03 warp_shuffle" in names
        assert any(r["peer"] and r["tflops"] for r in result["rows"])


def test_timing_without_a_record_says_so(tmp_path, capsys):
    if not notebooks.Lesson("03").on_gpu:
        assert notebooks.Lesson("03").timing(tmp_path) is None
        assert "No GPU benchmark record" in capsys.readouterr().out


@pytest.mark.parametrize("pid", [p for p in sorted(PHASES) if hasattr(PHASES[p], "smem_layout")])
def test_with_pad_rebuilds_a_phase_layout(pid):
    """The pad sweep of lesson 04 re-derives a phase's layout with another pad; same pad, same layout."""
    L = PHASES[pid].smem_layout(64)
    assert notebooks.with_pad(L, L["SMEM_PAD"]) == L


@pytest.mark.parametrize("pid", sorted(PHASES))
def test_committed_exercise_listing_matches_the_stub(pid, capsys):
    """The committed notebook's `lesson.exercise()` output is what it prints now: the regions the
    stub cuts out, with the instructions the phase's markers give them (a student reads it before
    opening the stub). Line numbers may drift with edits elsewhere in the phase; nothing else may.
    It prints nothing that needs a GPU: `flashcore lessons --listings` re-renders it."""
    nb = nbformat.read(notebooks.lesson_path(pid).with_suffix(".ipynb"), as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code" and "lesson.exercise()" in c.source]
    assert len(cells) == 1, f"lesson {pid}: expected one cell calling lesson.exercise(), found {len(cells)}"
    notebooks.Lesson(pid).exercise()
    numbered = re.compile(r"\(lines \d+-\d+ of the phase source, \d+ lines?\)")
    committed = "\n".join(lessons.plain_text(cells[0].get("outputs", [])))
    assert numbered.sub("(lines ...)", committed) == numbered.sub("(lines ...)", capsys.readouterr().out.rstrip("\n")), (
        f"lessons/{notebooks.lesson_stem(pid)}.ipynb lists other exercise regions than the phase has now: "
        f"run `flashcore lessons --listings --only {pid}`")


def _leaked_regions(text: str, labels) -> list[str]:
    """The labels among `labels` whose `# >>> exercise LABEL:` marker in `text` (a listing, or a diff of
    one) is followed by a line other than its `# <<< exercise`: a region shown with its solution."""
    lines = [line.lstrip("+- ") for line in text.splitlines()]
    leaked = []
    for i, line in enumerate(lines):
        for label in labels:
            if line.startswith(f"# >>> exercise {label}:") and not (i + 1 < len(lines) and lines[i + 1].startswith(
                    "# <<< exercise")):
                leaked.append(label)
    return leaked


@pytest.mark.parametrize("pid", sorted(PHASES))
def test_a_lesson_shows_its_regions_empty_until_the_solution(pid, capsys):
    """Before its solution cell, a committed lesson shows its exercise's regions as the stub has them
    (every listing used to print them filled in: copying "The kernel" passed the grader); the
    solution comes after the exercise, in `lesson.show_solution()`, whose output is what it prints now."""
    nb = nbformat.read(notebooks.lesson_path(pid).with_suffix(".ipynb"), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    at = [i for i, c in enumerate(code) if "lesson.show_solution()" in c.source]
    exercise = [i for i, c in enumerate(code) if "lesson.exercise()" in c.source]
    assert len(at) == 1 and exercise and at[0] > exercise[-1], (
        f"lesson {pid}: one `lesson.show_solution()` cell, after the `lesson.exercise()` cell")
    labels = [r.label for r in notebooks.Lesson(pid).regions()]
    # a solution's own lines: those the student's stub does not have (the region's markers aside, a
    # listing that printed them would give the answer away)
    stub = notebooks.exercise_path(pid).read_text(encoding="utf-8")
    own = {line.strip() for region in notebooks.Lesson(pid).regions() for line in region.solution
           if len(line.strip()) >= 12 and not line.strip().startswith("#") and line.strip() not in stub}
    for cell in code[:at[0]]:
        text = "\n".join(lessons.plain_text(cell.get("outputs", [])))
        assert not _leaked_regions(text, labels), (
            f"lessons/{notebooks.lesson_stem(pid)}.ipynb shows the solution of {_leaked_regions(text, labels)} in "
            f"its cell {cell.source!r} (run `flashcore lessons --listings --only {pid}`)")
        shown_early = sorted(line for line in own if line in text)
        assert not shown_early, (f"lessons/{notebooks.lesson_stem(pid)}.ipynb prints solution lines {shown_early} "
                                 f"in its cell {cell.source!r}, before the exercise's solution")
    notebooks.Lesson(pid).show_solution()
    shown = "\n".join(lessons.plain_text(code[at[0]].get("outputs", [])))
    assert shown == capsys.readouterr().out.rstrip("\n"), (
        f"lessons/{notebooks.lesson_stem(pid)}.ipynb shows another solution than the phase has now: "
        f"run `flashcore lessons --listings --only {pid}`")
    for region in notebooks.Lesson(pid).regions():  # every line of every region, there and only there
        assert all(line.strip() in shown for line in region.solution), region.label


def test_listings_show_only_this_lessons_regions_empty(capsys):
    """show_source and show_diff cut the lines of the lesson's own regions, not another phase's (a diff
    against the previous phase keeps that phase's code), and say which they cut."""
    from flashcore_numba.phases import p10_split_keys, p11_backward, p12_backward_wgmma

    notebooks.Lesson("10").show_source(p10_split_keys.make_merge)  # where the regions are since the roles split
    out = capsys.readouterr().out
    assert _leaked_regions(out, ["10-a", "10-b"]) == [] and "# >>> exercise 10-b:" in out
    assert "done = done_s[0]" not in out and "regions 10-a, 10-b shown empty" in out
    notebooks.Lesson("12").show_diff(p11_backward.make_dq, p12_backward_wgmma.build_kv_kernel)  # 11-c is in make_dq
    out = capsys.readouterr().out
    assert _leaked_regions(out, ["12-a", "12-b", "12-c"]) == [] and "region" in out.splitlines()[-1]
    assert "# >>> exercise 11-c:" in out and "red_pair(at, c[n, 0] * scale" in out  # phase 11's own, kept


def test_listing_cells_are_the_pure_ones():
    cell = nbformat.v4.new_code_cell
    assert lessons.is_listing(cell("lesson.show_source(phase.build)"))
    assert lessons.is_listing(cell("from flashcore_numba.phases import common\n\nlesson.show_diff(a, b)\n"
                                   "lesson.show_ptx('store.ptx')"))
    assert not lessons.is_listing(cell("lesson.show_source(phase.Build)\nprint(phase.BUILDS)"))
    assert lessons.is_listing(cell("lesson.exercise()")) and lessons.is_listing(cell("lesson.show_solution()"))
    assert not lessons.is_listing(cell("lesson.check()"))
    assert not lessons.is_listing(cell("import numpy as np"))
    assert not lessons.is_listing(nbformat.v4.new_markdown_cell("lesson.show_source(phase.build)"))


def test_refresh_listings_redoes_a_stale_listing_and_nothing_else(tmp_path):
    """A listing whose text no longer matches the code is re-rendered; every other output (the GPU
    run's) is kept byte for byte, and an up-to-date notebook is not rewritten."""
    for suffix in (".py", ".ipynb"):
        shutil.copy(notebooks.lesson_path("04").with_suffix(suffix), tmp_path)
    ipynb = tmp_path / notebooks.lesson_path("04").with_suffix(".ipynb").name
    nb = nbformat.read(ipynb, as_version=4)
    listing = next(i for i, c in enumerate(nb.cells) if lessons.is_listing(c) and c.get("outputs"))
    want = lessons.plain_text(nb.cells[listing].outputs)
    others = [c.get("outputs") for i, c in enumerate(nb.cells) if i != listing]
    nb.cells[listing].outputs = [nbformat.v4.new_output("stream", name="stdout", text="def old(): ...\n")]
    nbformat.write(nb, ipynb)
    assert lessons.refresh_listings([ipynb.with_suffix(".py")], timeout=120) == []
    redone = nbformat.read(ipynb, as_version=4)
    assert lessons.plain_text(redone.cells[listing].outputs) == want
    assert [c.get("outputs") for i, c in enumerate(redone.cells) if i != listing] == others
    before = ipynb.read_text()
    assert lessons.refresh_listings([ipynb.with_suffix(".py")], timeout=120) == []
    assert ipynb.read_text() == before


def test_main_check_passes(capsys):
    assert lessons.main(["--check"]) == 0


def _execute(pid, folder: Path, kernel_manager=None, source=notebooks.lesson_path):
    """Lesson pid (its source: source(pid)) executed from a copy in folder: (its copy, the failures)."""
    py = folder / source(pid).name
    shutil.copy(source(pid), py)
    return py, lessons.execute([py], timeout=300, kernel_manager=kernel_manager)


def _lessons_wanted(items):
    return sorted({item.callspec.params["pid"] for item in items
                   if "executed" in getattr(item, "fixturenames", ()) and hasattr(item, "callspec")})


class BackgroundLessons:
    """The lessons the selected tests execute, submitted to the session's pool of background jobs
    (conftest.py), each from a copy in a folder of its own. source: a lesson's source, by id."""

    def __init__(self, wanted, pool, source=notebooks.lesson_path):
        from jupyter_client.manager import AsyncKernelManager  # with nbclient

        self.folder = Path(tempfile.mkdtemp(prefix="lessons"))
        self.source = source
        self.kernels = []  # the manager of every lesson's kernel, so that close() can stop them
        kernels = self.kernels

        class Recorded(AsyncKernelManager):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                kernels.append(self)

        self.manager = Recorded
        self.futures = {}
        for pid in sorted(wanted, reverse=True):  # the later lessons simulate and compile more: first
            (self.folder / pid).mkdir()
            self.futures[pid] = pool.submit(self.run, pid)

    def run(self, pid):
        return _execute(pid, self.folder / pid, self.manager, self.source)

    def results(self):
        return {pid: future.result() for pid, future in self.futures.items()}

    def close(self):
        """The end of the session. Cut short (-x, Ctrl+C), lessons may still run: their kernels are
        killed and their jobs waited for before their folders go. (A kernel whose working folder is
        removed under it fails with tracebacks after pytest's summary, and the session would wait
        minutes for lessons no test reads.)"""
        for future in self.futures.values():
            future.cancel()  # those not started
        while not all(future.done() for future in self.futures.values()):
            for manager in self.kernels:  # nbclient's next look at a killed kernel ends its lesson
                _kill_kernel(manager)
            wait(self.futures.values(), timeout=1)
        shutil.rmtree(self.folder, ignore_errors=True)


def _kernel_process(manager):
    """The process of the kernel `manager` started (jupyter_client's local provisioner), or None."""
    return getattr(getattr(manager, "provisioner", None), "process", None)


def _kill_kernel(manager) -> None:
    """Kill the kernel `manager` started, if it still runs: a signal, safe from any thread while
    another thread's event loop drives the manager."""
    process = _kernel_process(manager)
    if process is not None and process.poll() is None:
        try:
            process.kill()
        except OSError:  # it ended meanwhile
            pass


BACKGROUND_FIRST = True  # lesson 09 is the suite's longest job: its jobs go to the pool before the others'


def start_background(items, pool):
    wanted = _lessons_wanted(items)
    return BackgroundLessons(wanted, pool) if wanted else None


@pytest.fixture(scope="module")
def executed(request, background, tmp_path_factory):
    """Every lesson executed from a temporary copy, in the background when the session started
    (else here, two at a time: a kernel is one busy process)."""
    if background is not None:
        return background.results()
    with ThreadPoolExecutor(max_workers=2) as pool:
        wanted = _lessons_wanted(request.session.items)
        folders = [tmp_path_factory.mktemp(f"lesson{pid}") for pid in wanted]
        return dict(zip(wanted, pool.map(_execute, wanted, folders)))


@pytest.mark.slow
@pytest.mark.parametrize("pid", sorted(PHASES))
def test_lesson_executes(pid, executed):
    """Every cell runs without error (in the simulator in CI), and the check prints its verdict."""
    py, failures = executed[pid]
    assert not failures, failures[0]
    nb = nbformat.read(py.with_suffix(".ipynb"), as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("pass" in o.get("text", "") for o in outputs), "the correctness check printed no verdict"
    # the committed notebook's source listings are the code as it is now (they need no GPU to redo)
    committed = nbformat.read(notebooks.lesson_path(pid).with_suffix(".ipynb"), as_version=4)
    for fresh, kept in zip(nb.cells, committed.cells):
        assert kept.cell_type != "code" or kept.get("outputs") or not fresh.outputs, (
            f"lessons/{notebooks.lesson_stem(pid)}.ipynb has never run its cell {kept.source!r}: execute the "
            f"lesson on a GPU (flashcore lessons --execute --only {pid})")
        if lessons.is_listing(kept):
            shown, now = lessons.plain_text(kept.get("outputs", [])), lessons.plain_text(fresh.outputs)
            assert shown == now, (
                f"lessons/{notebooks.lesson_stem(pid)}.ipynb shows a stale listing in its cell "
                f"{kept.source!r}: run `flashcore lessons --listings --only {pid}`\n" + "\n".join(
                    difflib.unified_diff("\n".join(shown).splitlines(), "\n".join(now).splitlines(), "committed",
                                         "this run", lineterm="", n=1)))


@pytest.mark.parametrize("pid", ["00"])
def test_lesson00_executes(pid, executed):
    """Lesson 00 (no phase: its puzzles are course/puzzles.py) runs top to bottom in a few seconds; in the
    simulator its unguarded kernel raises an error that the lesson reads, and the untouched stub is graded."""
    py, failures = executed[pid]
    assert not failures, failures[0]
    nb = nbformat.read(py.with_suffix(".ipynb"), as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    if notebooks.simulator_enabled():
        assert "IndexError: tid=[" in text and "in kernel double_unguarded" in text, text[-3000:]
    assert "Exercise 00" in text and "Score: " in text, "the grading cell printed no score"


def test_execute_notebook_shuts_its_kernel_down(tmp_path):
    """A notebook executed by `execute_notebook` leaves no kernel process behind (nbclient keeps the
    kernels of managers it was handed alive unless told otherwise). The recording manager is handed
    in, not patched into jupyter_client: lessons executing in the background use the module meanwhile."""
    from jupyter_client import manager

    made = []

    class Recorded(manager.AsyncKernelManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    py = tmp_path / "tiny.py"
    py.write_text("# %%\nprint(6 * 7)\n")
    nb = lessons.execute_notebook(py, timeout=120, kernel_manager=Recorded)
    assert "42" in nb.cells[0].outputs[0]["text"]
    assert len(made) == 1
    assert not made[0].has_kernel, "the notebook's kernel is still running"


def test_a_kernel_that_dies_ends_its_lesson(tmp_path):
    """A lesson whose kernel dies mid-cell (killed, crashed) fails at once with DeadKernelError.
    (With a blocking kernel client, nbclient's wait for the cell's output held its event loop, and
    the run waited for ever.)"""
    from nbclient.exceptions import DeadKernelError

    py = tmp_path / "dies.py"
    py.write_text("# %%\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    outcome = []

    def run():
        try:
            lessons.execute_notebook(py, timeout=600)
        except BaseException as exc:  # noqa: BLE001 - what ended it is the test's subject
            outcome.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(timeout=120)
    assert not runner.is_alive(), "the lesson still waits for a kernel that died"
    assert len(outcome) == 1 and isinstance(outcome[0], DeadKernelError), outcome


DIES_STARTING = """
import sys
from pathlib import Path

from jupyter_client.manager import AsyncKernelManager

from flashcore_numba.course import lessons


class DiesStarting(AsyncKernelManager):
    async def start_kernel(self, **kwargs):
        await super().start_kernel(**kwargs)
        self.provisioner.process.kill()


try:
    lessons.execute_notebook(Path(sys.argv[1]), timeout=120, kernel_manager=DiesStarting)
except RuntimeError as exc:
    print("raised:", exc)
"""


def test_a_kernel_that_dies_starting_leaves_no_exit_hook(tmp_path):
    """nbclient registers its kernel's cleanup to run at the interpreter's exit and unregisters it when
    the run ends, but not where the kernel died while starting; the hook then failed after pytest's
    summary ("assert self.km is not None"). execute_notebook unregisters it in every case: a process
    whose lesson's kernel died starting exits without a traceback."""
    import os
    import subprocess
    import sys

    py = tmp_path / "tiny.py"
    py.write_text("# %%\nprint(6 * 7)\n")
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", DIES_STARTING, str(py)], env=env, capture_output=True, text=True,
                          timeout=180, check=False)
    assert "raised: Kernel died before replying to kernel_info" in done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "atexit" not in done.stderr, done.stderr


def test_a_session_cut_short_stops_its_lessons(tmp_path):
    """At the end of a session cut short (-x, Ctrl+C), the lessons still running are stopped within
    seconds: their kernels killed, their jobs ended, their folder removed after them (it was once
    removed under the running kernels, which printed tracebacks after pytest's summary while the
    session waited for them to finish)."""
    slow = tmp_path / "slow.py"
    slow.write_text("# %%\nimport time\ntime.sleep(600)\n")
    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs = BackgroundLessons(["a", "b", "c"], pool, source=lambda pid: slow)
        deadline = time.monotonic() + 120
        while sum(_kernel_process(k) is not None for k in jobs.kernels) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3)  # the cells have started
        processes = [_kernel_process(k) for k in jobs.kernels]
        assert len(processes) == 2 and all(p is not None and p.poll() is None for p in processes), processes
        started = time.monotonic()
        jobs.close()
        assert time.monotonic() - started < 30
    assert not jobs.folder.exists()
    assert all(p.poll() is not None for p in processes), "a lesson's kernel still runs"
    assert jobs.futures["a"].cancelled() and all(jobs.futures[pid].exception() for pid in "bc")


def test_the_simulator_compiles_phase_09s_variants_only_on_a_gpu():
    """Lesson 09's machine-code cells compile 08 and 09 in the simulator (each of 09's variants
    would add a minute or two of a laptop core) and every variant on a GPU; lesson 06 compares
    its two PTX routes, so it compiles both everywhere."""
    lesson = notebooks.Lesson("09")
    assert set(lesson._ids()) == {"08", "09", "09-overlap", "09-turns", "09-ws"}
    expected = lesson._ids() if lesson.on_gpu else ["08", "09"]
    assert lesson._compiled_ids() == expected
    assert "06-inline" in notebooks.Lesson("06")._compiled_ids()
    # lesson 10 is phase 07's loop split across blocks: its machine code beside 07's, timed beside 09 too
    lesson = notebooks.Lesson("10")
    assert lesson._ids() == ["09", "07", "10", "10-batch"]
    assert lesson._compiled_ids() == (lesson._ids() if lesson.on_gpu else ["07", "10"])


def where_it_ran(pid) -> str:
    """"a GPU" or "Numba's CUDA simulator": where the committed notebook of lesson pid ran, as its own
    outputs say (a phase lesson's first cell prints "Kernels run on: <GPU>" or "Kernels run in Numba's
    CUDA simulator"; lesson 00's "kernels run in the CUDA GPU" or "... in Numba's CUDA simulator")."""
    nb = nbformat.read(LESSONS / f"{notebooks.lesson_stem(pid)}.ipynb", as_version=4)
    text = "\n".join(lessons.plain_text([o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]))
    found = re.search(r"(?i)kernels run (on: |in the CUDA GPU|in Numba's CUDA simulator)", text)
    assert found, f"lessons/{notebooks.lesson_stem(pid)}.ipynb does not say where its kernels ran"
    return "Numba's CUDA simulator" if "simulator" in found.group(1) else "a GPU"


def spans(ids) -> str:
    """"00 and 06-10", "01-05, 11 and 12": lesson ids, consecutive runs of three or more as ranges."""
    runs = []
    for pid in sorted(ids):
        if runs and int(pid) == int(runs[-1][-1]) + 1:
            runs[-1].append(pid)
        else:
            runs.append([pid])
    parts = [f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(r) for r in runs]
    text = ", ".join(parts)
    head, _, last = text.rpartition(", ")
    return f"{head} and {last}" if head else last


def test_course_map_says_where_each_committed_notebook_ran():
    """lessons/README.md names the lessons whose committed outputs are a GPU run and those run in the
    simulator, as the notebooks themselves say (a lesson executed anew where it ran elsewhere changes it)."""
    where = {pid: where_it_ran(pid) for pid in ["00", *PHASES]}
    gpu = [pid for pid, w in where.items() if w == "a GPU"]
    simulated = [pid for pid, w in where.items() if w != "a GPU"]
    assert spans(["00", "06", "07", "08", "09", "10"]) == "00 and 06-10" and spans(["01", "02"]) == "01 and 02"
    expected = (f"lessons {spans(gpu)} ran on a GPU,\nlessons {spans(simulated)} in Numba's CUDA simulator"
                if gpu and simulated else None)
    readme = (LESSONS / "README.md").read_text(encoding="utf-8")
    assert expected is not None and re.sub(r"\s+", " ", expected) in re.sub(r"\s+", " ", readme), (
        f"lessons/README.md should say where the committed notebooks ran: {expected!r}")


def test_a_stream_split_into_messages_reads_as_one_text():
    """A busy kernel may send one print's stdout in several messages; the listing checks compare the
    text a reader sees, so consecutive messages of one stream are one text (stderr stays apart)."""
    out = [{"output_type": "stream", "name": "stdout", "text": "The solution:"},
           {"output_type": "stream", "name": "stdout", "text": "\nline\n"},
           {"output_type": "stream", "name": "stderr", "text": "a warning\n"},
           {"output_type": "execute_result", "data": {"text/plain": "42"}}]
    assert lessons.plain_text(out) == ["The solution:\nline", "a warning", "42"]

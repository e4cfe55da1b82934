"""`flashcore lessons`: build, check and run the lesson notebooks.

`lessons/NN_<name>.py` (jupytext's "percent" format) is the source of each lesson; the `.ipynb`
beside it is generated from it and committed with the outputs of one run, on a GPU or in the
simulator (lessons/README.md says which, and a test keeps it true). What the cells
call is the lesson runtime, course/notebooks.py.

    flashcore lessons --sync      regenerate every .ipynb from its .py (outputs of unchanged cells kept)
    flashcore lessons --check     fail if a notebook's cells differ from its .py, or a phase has no lesson
    flashcore lessons --execute   run every lesson top to bottom and save the outputs into its .ipynb
    flashcore lessons --listings  re-render only the source listings (and the exercise's regions and
                                  solution) of the committed notebooks
    flashcore lessons --new 06    write lessons/06_<name>.py from the template

jupytext reads and writes the notebooks and nbclient executes them; two things are written here
on purpose:
- `sync` hands outputs over only to cells whose source is unchanged. jupytext's own merge
  (`jupytext.combine.combine_inputs_with_outputs`, behind `jupytext --update`) also gives an
  edited cell the output of the cell it replaced (matched by position, or up to black's
  reformatting), and a lesson must never show an output its code did not produce.
- cell ids come from each cell's content (`_cell_id`): nbformat draws random ones, and a
  notebook regenerated from an unchanged .py must not change.
"""

from __future__ import annotations

import ast
import atexit
import copy
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

from ..arch.sim import simulator_enabled
from ..phases import LESSONS, get_lesson
from ..usage import Parser, usage_error
from .notebooks import display_path, lesson_path, lesson_stem, lessons_dir, previous_phase

LESSON_GLOB = "[0-9][0-9]_*.py"
JUPYTEXT_FORMAT = "py:percent"


def lesson_sources(directory: Path | None = None) -> list[Path]:
    """Every lesson .py (NN_<name>.py) in the lessons folder, in course order."""
    directory = lessons_dir() if directory is None else Path(directory)
    return sorted(directory.glob(LESSON_GLOB))


# =============================================================================================
# The template every lesson follows (`flashcore lessons --new NN` writes it)
# =============================================================================================
HEADER = """\
# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---
"""

DEVICE_CELL = """\
# %%
# Where the kernels run is decided before numba.cuda is first imported: on the CUDA GPU when the
# driver shows one, else in Numba's CUDA simulator on the CPU. Set NUMBA_ENABLE_CUDASIM to choose.
import os

if "NUMBA_ENABLE_CUDASIM" not in os.environ:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if os.path.exists("/dev/nvidiactl") else "1"
"""

# After the exercise, and only there: the listings above show its regions empty, as the stub has them
SOLUTION_CELLS = """
# %% [markdown]
# ## The solution
#
# Try the exercise first. These are the lines the phase itself has in each region; the listings
# above show the regions empty, as your stub has them.

# %%
lesson.show_solution()
"""

TEMPLATE = HEADER + """
# %% [markdown]
# # Phase {ID} — {TITLE}
#
# *Previous: {PREV}. Hardware background: [docs/hardware.md](../docs/hardware.md).*
#
# ## The idea
#
# *(to write: what changes from the previous phase, in two or three sentences)*
#
# ## Why the hardware rewards it
#
# *(to write: the hardware reason, with a diagram where a picture beats words)*

""" + DEVICE_CELL + """
# %%
from flashcore_numba.course import notebooks
from flashcore_numba.phases import {MODULE} as phase

lesson = notebooks.Lesson("{ID}")
lesson.intro()

# %% [markdown]
# ## The kernel
#
# Straight from the package: what runs is what you read.

# %%
lesson.show_source(phase.build)

# %% [markdown]
# ## Is it correct?
#
# Fresh random inputs, the output poisoned with NaN first, compared with the float64 reference.

# %%
lesson.check()

# %% [markdown]
# ## How fast is it?

# %%
timings = lesson.timing()

# %%
lesson.plot_timing(timings)

# %% [markdown]
# ## What changed in the machine code

# %%
lesson.machine_code()

# %%
lesson.ptx(["ld.shared", "fma.rn.f32", "ex2.approx"])

# %%
lesson.sass(["LDS", "FFMA", "MUFU.EX2"])

# %% [markdown]
# ## Exercise

# %%
lesson.exercise()
""" + SOLUTION_CELLS


def new_lesson(phase, directory: Path | None = None) -> Path:
    """Write NN_<name>.py for a phase from the template (into lessons/ by default); never overwrites."""
    phase = get_lesson(phase)
    path = (lessons_dir() if directory is None else Path(directory)) / f"{lesson_stem(phase)}.py"
    if path.exists():
        raise FileExistsError(f"phase: {display_path(path)} exists already")
    prev = previous_phase(phase)
    text = TEMPLATE.format(ID=phase.ID, TITLE=phase.TITLE, MODULE=phase.__name__.rsplit(".", 1)[-1],
                           PREV=f"[{prev.ID} {prev.NAME}]({lesson_stem(prev)}.ipynb)" if prev else "none")
    path.write_text(text)
    return path


# =============================================================================================
# Building, checking and running the notebooks
# =============================================================================================
def _jupytext():
    try:
        import jupytext
    except ImportError as exc:
        raise SystemExit("the lessons need jupytext: pip install -e '.[course]'") from exc
    return jupytext


def _cell_id(cell, taken: set) -> str:
    digest = hashlib.sha1(f"{cell.cell_type}\n{cell.source}".encode()).hexdigest()
    n = 8
    while digest[:n] in taken and n < len(digest):
        n += 1
    taken.add(digest[:n])
    return digest[:n]


def notebook_from_py(py: Path):
    """The notebook a lesson .py describes, with stable cell ids (so regenerating it changes nothing)."""
    jupytext = _jupytext()
    nb = jupytext.read(str(py), fmt=JUPYTEXT_FORMAT)
    taken: set = set()
    for cell in nb.cells:
        cell["id"] = _cell_id(cell, taken)
    return nb


def _cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source) for c in nb.cells]


def sync(sources=None, *, quiet: bool = False) -> list[Path]:
    """Regenerate each lesson's .ipynb from its .py; outputs of unchanged cells are kept."""
    import nbformat

    jupytext = _jupytext()
    written = []
    for py in sources or lesson_sources():
        py = Path(py)
        ipynb = py.with_suffix(".ipynb")
        nb = notebook_from_py(py)
        if ipynb.exists():
            old = nbformat.read(str(ipynb), as_version=4)
            outputs = {(c.cell_type, c.source): c for c in old.cells if c.cell_type == "code"}
            for cell in nb.cells:
                kept = outputs.get((cell.cell_type, cell.source))
                if kept is not None:
                    cell["outputs"] = kept.get("outputs", [])
                    cell["execution_count"] = kept.get("execution_count")
            for key in ("language_info",):
                if key in old.metadata:
                    nb.metadata[key] = old.metadata[key]
        text = jupytext.writes(nb, fmt="ipynb")
        if not ipynb.exists() or ipynb.read_text() != text:
            ipynb.write_text(text)
            written.append(ipynb)
            if not quiet:
                print(f"wrote {display_path(ipynb)}")
    return written


def check(directory: Path | None = None) -> list[str]:
    """Problems with the lessons: a phase without one, a notebook out of sync with its .py."""
    import nbformat

    directory = lessons_dir() if directory is None else Path(directory)
    problems = []
    for phase in LESSONS.values():
        for suffix in (".py", ".ipynb"):
            path = directory / f"{lesson_stem(phase)}{suffix}"
            if not path.exists():
                problems.append(f"phase {phase.ID} has no lesson {display_path(path)}"
                                + (" (write it: flashcore lessons --new " + phase.ID + ")" if suffix == ".py"
                                   else " (generate it: flashcore lessons --sync)"))
    for py in lesson_sources(directory):
        ipynb = py.with_suffix(".ipynb")
        if not ipynb.exists():
            continue
        want = _cells(notebook_from_py(py))
        have = _cells(nbformat.read(str(ipynb), as_version=4))
        if want != have:
            first = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
            problems.append(f"{display_path(ipynb)} differs from {py.name} (first at cell {first}); "
                            "run: flashcore lessons --sync")
    for ipynb in sorted(directory.glob("[0-9][0-9]_*.ipynb")):
        if not ipynb.with_suffix(".py").exists():
            problems.append(f"{display_path(ipynb)} has no {ipynb.with_suffix('.py').name}: "
                            "the .py is the source")
    return problems


def kernel_env(extra: dict | None = None) -> dict:
    """Environment of a notebook kernel: this one, with this checkout importable."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the checkout holding flashcore_numba/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    env.update(extra or {})
    return env


def execute_notebook(py: Path, cwd: Path | None = None, timeout: int = 600, env: dict | None = None,
                     kernel_manager=None):
    """Run a lesson top to bottom in a fresh kernel; returns the executed notebook (a cell error raises).

    kernel_manager: the jupyter_client AsyncKernelManager class to start the kernel with (a test hands
    in a subclass that records its instances, without patching the module other threads use)."""
    py = Path(py)
    return _run(notebook_from_py(py), cwd or py.parent, timeout, env=env, kernel_manager=kernel_manager)


def _run(nb, cwd: Path, timeout: int, env: dict | None = None, kernel_manager=None):
    """Execute notebook nb in place, in a fresh kernel started in cwd; returns it.

    The kernel's manager is an AsyncKernelManager, as nbclient's own default: its client's waits
    give way to nbclient's check that the kernel lives, so a kernel that dies mid-cell (crashed, or
    killed) ends the run with DeadKernelError. A blocking client's wait for the cell's output would
    hold nbclient's event loop, and the run would wait for that output for ever."""
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient

    with tempfile.TemporaryDirectory() as sockets:
        # IPC sockets where available: a local kernel needs no TCP port (ipykernel warns about
        # unencrypted TCP, and the warning would land in the outputs)
        transport = {"transport": "ipc", "ip": str(Path(sockets) / "kernel")} if os.name == "posix" else {}
        km = (kernel_manager or AsyncKernelManager)(kernel_name="python3", **transport)
        client = NotebookClient(nb, km=km, timeout=timeout, kernel_name="python3", record_timing=False,
                                resources={"metadata": {"path": str(cwd)}})
        try:
            # cleanup_kc: nbclient shuts down only the kernels of managers it made itself, and each
            # kernel left running holds a process and a couple of hundred MB until the caller exits
            client.execute(env=env or kernel_env(), cleanup_kc=True)
        finally:
            # nbclient registers the kernel's cleanup to run at exit and unregisters it when the run
            # ends, except where the kernel died starting: then the hook, its kernel already cleaned
            # up, fails at the interpreter's exit (AssertionError: self.km is not None)
            atexit.unregister(client._cleanup_kernel)
    return nb


# The cells that only show source (after any imports): what they print is the package's files,
# the same on a GPU as in the simulator, so they can be re-rendered without running anything else.
# `exercise` lists the exercise's regions and `show_solution` their lines, from the phase's markers.
LISTING_CALLS = ("show_source", "show_diff", "show_ptx", "exercise", "show_solution")


def is_listing(cell) -> bool:
    """True for a code cell made only of imports and `lesson.<one of LISTING_CALLS>(...)` calls."""
    if cell.cell_type != "code":
        return False
    try:
        body = ast.parse(cell.source).body
    except SyntaxError:
        return False
    calls = [node for node in body if not isinstance(node, (ast.Import, ast.ImportFrom))]
    return bool(calls) and all(
        isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Attribute) and node.value.func.attr in LISTING_CALLS
        and isinstance(node.value.func.value, ast.Name) and node.value.func.value.id == "lesson"
        for node in calls)


def plain_text(outputs) -> list[str]:
    """The text a reader sees of a cell's outputs: each one's plain-text form (or printed text). A
    stream the kernel sent in several messages (a busy machine splits a cell's stdout where it
    pleases, even mid-line) is one text, as the reader sees it."""
    texts, stream = [], None
    for output in outputs:
        text = output.get("text", output.get("data", {}).get("text/plain", ""))
        text = "".join(text) if isinstance(text, list) else text
        name = output.get("name") if output.get("output_type") == "stream" else None
        if name is not None and name == stream:
            texts[-1] += text
        else:
            texts.append(text)
        stream = name
    return [text.rstrip("\n") for text in texts]


def refresh_listings(sources=None, timeout: int = 600) -> list[str]:
    """Re-render the source listings (`is_listing` cells) of each committed .ipynb, nothing else.

    A notebook's outputs come from one run of the lesson; when a phase's code changes, its listings go
    stale while its timings stay true. Here the cell that makes `lesson` and the listing cells run
    alone, in the simulator, and only the listing cells' outputs are written back (numbered as a
    full run numbers them) where their text differs from the committed one. Returns the failures
    (their notebooks are left as they were)."""
    import nbformat
    from nbclient.exceptions import CellExecutionError

    jupytext = _jupytext()
    failures = []
    for py in sources or lesson_sources():
        py = Path(py)
        ipynb = py.with_suffix(".ipynb")
        nb = jupytext.read(str(ipynb), fmt="ipynb")
        code = [c for c in nb.cells if c.cell_type == "code"]
        setup = next((c for c in code if "notebooks.Lesson(" in c.source), None)
        listings = [c for c in code if is_listing(c)]
        if setup is None or not listings:
            continue
        part = nbformat.v4.new_notebook(cells=copy.deepcopy([setup, *listings]), metadata=copy.deepcopy(nb.metadata))
        try:
            ran = _run(part, py.parent, timeout, env=kernel_env({"NUMBA_ENABLE_CUDASIM": "1"}))
        except CellExecutionError as exc:
            failures.append(f"{display_path(ipynb)}: {exc}")
            print(f"  FAILED; {ipynb.name} left as it was:\n{exc}", flush=True)
            continue
        stale = 0
        for cell, fresh in zip(listings, ran.cells[1:]):
            if plain_text(cell.get("outputs", [])) != plain_text(fresh.outputs):  # else the same listing: kept
                cell["outputs"] = fresh.outputs  # (its HTML as this machine's pygments writes it)
                cell["execution_count"] = code.index(cell) + 1
                stale += 1
        if stale:
            ipynb.write_text(jupytext.writes(nb, fmt="ipynb"))
            print(f"wrote {display_path(ipynb)}: {stale} of its {len(listings)} listings re-rendered", flush=True)
    return failures


def execute(sources=None, timeout: int = 600, kernel_manager=None) -> list[str]:
    """Execute every lesson and save its outputs into its .ipynb (the committed outputs come from here).

    A lesson whose cell fails keeps its previous .ipynb; the others still run. Returns the failures.
    kernel_manager: as execute_notebook's (the test suite's records its kernels, to stop them).
    """
    from nbclient.exceptions import CellExecutionError

    jupytext = _jupytext()
    failures = []
    for py in sources or lesson_sources():
        py = Path(py)
        t0 = time.perf_counter()
        print(f"executing {display_path(py)} ...", flush=True)
        try:
            nb = execute_notebook(py, timeout=timeout, kernel_manager=kernel_manager)
        except CellExecutionError as exc:
            failures.append(f"{display_path(py)}: {exc}")
            print(f"  FAILED after {time.perf_counter() - t0:.0f} s; "
                  f"{py.with_suffix('.ipynb').name} left as it was:\n{exc}", flush=True)
            continue
        ipynb = py.with_suffix(".ipynb")
        ipynb.write_text(jupytext.writes(nb, fmt="ipynb"))
        print(f"  wrote {display_path(ipynb)} in {time.perf_counter() - t0:.0f} s", flush=True)
    return failures


def main(argv=None) -> int:
    """`flashcore lessons [--sync] [--execute] [--listings] [--check] [--new NN] [--only NN ...]`."""
    parser = Parser(prog="flashcore lessons",
                    description="Build, check and run the lesson notebooks "
                                "(lessons/NN_<name>.py is the source; the .ipynb is generated from it).")
    parser.add_argument("--sync", action="store_true", help="regenerate every .ipynb from its .py")
    parser.add_argument("--execute", action="store_true",
                        help="run every lesson and save its outputs into the .ipynb "
                             "(on a GPU when there is one)")
    parser.add_argument("--listings", action="store_true",
                        help="re-render only the source listings (show_source, show_diff, show_ptx, "
                             "exercise and show_solution cells) of the committed notebooks, in the simulator; every other output "
                             "is kept")
    parser.add_argument("--check", action="store_true",
                        help="fail if a phase has no lesson or a .ipynb differs from its .py (the default)")
    parser.add_argument("--new", metavar="NN",
                        help="write lessons/NN_<name>.py for phase NN from the template")
    parser.add_argument("--only", nargs="+", metavar="NN", help="only these phases' lessons")
    parser.add_argument("--timeout", type=int, default=600, help="seconds a cell may run (default 600)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a bad argument already reported in one line
        return e.code if isinstance(e.code, int) else 2

    def fail(message: str) -> int:
        return usage_error(parser.prog, message)

    lessons_dir()  # CheckoutNeeded (one line from the CLI) where there is no checkout
    try:
        import nbformat  # noqa: F401 - every action reads or writes notebooks
    except ModuleNotFoundError:
        return fail("the notebooks need the course extra: pip install -e \".[course]\"")
    if args.new:
        try:
            path = new_lesson(args.new)
        except (FileExistsError, ValueError, TypeError) as exc:
            return fail(f"--new: {exc}")
        print(f"wrote {display_path(path)}: fill in its prose, then flashcore lessons --sync")
    sources = None
    if args.only:
        try:
            sources = [lesson_path(p) for p in args.only]
        except (ValueError, TypeError) as exc:
            return fail(f"--only: {exc}")
        missing = [display_path(p) for p in sources if not p.exists()]
        if missing:
            return fail(f"--only: no lesson {', '.join(missing)} (write it: flashcore lessons --new NN)")
    if args.sync:
        written = sync(sources)
        print(f"{len(written)} notebook(s) regenerated" if written else "every notebook is in sync")
    if args.execute:
        where = "the simulator" if simulator_enabled() or not os.path.exists("/dev/nvidiactl") else "the GPU"
        print(f"kernels will run on {where}")
        failures = execute(sources, timeout=args.timeout)
        if failures:
            return fail(f"{len(failures)} lesson(s) failed: " + ", ".join(f.split(":")[0] for f in failures))
    if args.listings:
        failures = refresh_listings(sources, timeout=args.timeout)
        if failures:
            return fail(f"{len(failures)} lesson(s) failed: " + ", ".join(f.split(":")[0] for f in failures))
    if args.check or not (args.sync or args.execute or args.new or args.listings):
        problems = check()
        if problems:
            print("\n".join(problems), file=sys.stderr)
            return 1
        print(f"{len(lesson_sources())} lessons, every phase has one, every notebook in sync with its .py")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The suite runs with the core dependencies and pytest alone: a test that needs an optional
package (the `dev`, `notebooks` or `torch` extra) skips, saying which package and extra, and
collection never fails for a missing one.

Two checks. Statically, every test module's imports are read with `ast`: an optional package
imported when the module is imported must come after `pytest.importorskip` of it, or sit under a
`try` that catches ImportError; one imported inside a function is the function's business, and
every `pytest.importorskip` of an optional package names the extra to install. Dynamically,
pytest runs in a child process where importing the optional packages fails as it does where they
are not installed.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# pyproject.toml: the core is numba-cuda, numpy and rich; these come with the extras (IPython and
# jupyter_client with ipykernel and nbclient)
OPTIONAL = ("hypothesis", "nbformat", "nbclient", "jupytext", "matplotlib", "torch", "IPython", "ipykernel",
            "jupyter_client")
CATCHES_IMPORT_ERROR = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def _optional(name: str | None) -> str | None:
    top = (name or "").partition(".")[0]
    return top if top in OPTIONAL else None


def _is_importorskip(node) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "importorskip" and bool(node.args))


def _names(arg, loops: dict[str, list[str]]) -> list[str]:
    """The modules an importorskip's argument stands for: a string, or the variable of an enclosing
    `for` over strings."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    return loops.get(arg.id, []) if isinstance(arg, ast.Name) else []


def _names_the_extra(call, constants: dict[str, str]) -> bool:
    """Does the call's reason say what to install? (A string, an f-string or a module's constant.)"""
    reason = next((kw.value for kw in call.keywords if kw.arg == "reason"), None)
    if isinstance(reason, ast.Name):
        return "pip install" in constants.get(reason.id, "")
    return reason is not None and any(isinstance(n, ast.Constant) and "pip install" in str(n.value)
                                      for n in ast.walk(reason))


def _catches_import_error(node) -> bool:
    return isinstance(node, ast.Try) and any(
        handler.type is None or any(isinstance(n, ast.Name) and n.id in CATCHES_IMPORT_ERROR
                                    for n in ast.walk(handler.type)) for handler in node.handlers)


def unguarded_imports(source: str, where: str = "<test>") -> list[str]:
    """What in `source` breaks collection, or skips without naming the extra, where an optional
    package is missing: one message each."""
    tree = ast.parse(source)
    constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for target in node.targets if isinstance(target, ast.Name)}
    problems = []
    for call in ast.walk(tree):  # every importorskip of an optional package, at any depth
        if _is_importorskip(call) and not _names_the_extra(call, constants):
            named = _names(call.args[0], {})
            if not named or any(map(_optional, named)):
                problems.append(f"{where}:{call.lineno}: `{ast.unparse(call)}` without a reason naming the "
                                f"extra to install (reason=\"... (pip install -e '.[extra]')\")")

    guarded: set[str] = set()

    def visit(statements, loops):  # what runs when the module is imported, in order
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue  # runs when called: a test importing there fails or skips on its own
            if _catches_import_error(node):
                visit(node.handlers + node.orelse + node.finalbody, loops)  # its body may fail
                continue
            if isinstance(node, ast.For) and isinstance(node.target, ast.Name) \
                    and isinstance(node.iter, (ast.Tuple, ast.List)):
                names = [e.value for e in node.iter.elts if isinstance(e, ast.Constant)]
                visit(node.body + node.orelse, {**loops, node.target.id: names})
                continue
            blocks = [getattr(node, f) for f in ("body", "handlers", "orelse", "finalbody")
                      if isinstance(getattr(node, f, None), list)]
            if blocks:  # if, with, class, try, while at the top: their statements run too
                for block in blocks:
                    visit(block, loops)
                continue
            guarded.update(name for call in ast.walk(node) if _is_importorskip(call)
                           for name in _names(call.args[0], loops))
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                modules = [node.module] if isinstance(node, ast.ImportFrom) and not node.level else []
            for top in filter(None, map(_optional, modules)):
                if top not in guarded:
                    problems.append(f"{where}:{node.lineno}: `{ast.unparse(node)}` runs when the module is "
                                    f"imported, and {top} is optional: put pytest.importorskip({top!r}, "
                                    f"reason=...) before it, or import it in the tests that need it")

    visit(tree.body, {})
    return problems


def suite_modules() -> list[Path]:
    return sorted((ROOT / "tests").glob("*.py")) + [ROOT / "conftest.py"]


@pytest.mark.parametrize("path", suite_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_optional_imports_are_guarded(path):
    problems = unguarded_imports(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source, expected", [
    ("import pytest\nfrom hypothesis import given\n", "`from hypothesis import given` runs when"),
    ("import matplotlib.pyplot as plt\n", "matplotlib is optional"),
    ("import pytest\npytest.importorskip('nbformat', reason='x (pip install nb)')\nimport jupytext\n",
     "jupytext is optional"),
    ("import pytest\nif True:\n    import torch\n", "torch is optional"),
    ("import pytest\nclass T:\n    import IPython\n", "IPython is optional"),
    ("import pytest\ntry:\n    import torch\nexcept KeyError:\n    pass\n", "torch is optional"),
    ("import pytest\ndef test():\n    torch = pytest.importorskip('torch')\n", "without a reason naming"),
    ("import pytest\nWHY = 'no torch'\ndef test():\n    pytest.importorskip('torch', reason=WHY)\n",
     "without a reason naming"),
])
def test_an_unguarded_import_is_caught(source, expected):
    """The checker itself: each of these would break collection, or skip without naming the extra."""
    problems = unguarded_imports(source)
    assert len(problems) == 1 and expected in problems[0], problems


def test_guarded_imports_pass():
    source = ("import pytest\n"
              "for _m in ('nbformat', 'jupytext'):\n"
              "    pytest.importorskip(_m, reason=f'{_m} is not installed (pip install -e .[notebooks])')\n"
              "import nbformat\nimport jupytext\n"
              "try:\n    import matplotlib\nexcept ImportError:\n    matplotlib = None\n"
              "NO_TORCH = 'torch is not installed (pip install -e .[torch])'\n"
              "def test():\n"
              "    torch = pytest.importorskip('torch', reason=NO_TORCH)\n"
              "    from hypothesis import given\n"
              "import numpy, rich\n")
    assert unguarded_imports(source) == []


# pytest runs in a child process whose imports of the blocked packages fail with the error a
# missing package gives. A finder first on sys.meta_path makes them fail; plugin autoloading is off
# because pytest marks the packages of plugins (hypothesis has one) for its assertion rewriter,
# whose import hook would then find them before the finder does: where hypothesis is not
# installed its plugin is not there either, and the suite uses no other plugin.
CHILD = """
import sys

BLOCKED = set(sys.argv[1].split(","))


class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
import pytest

status = pytest.main(sys.argv[2:])
leaked = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
print("imported although blocked:", leaked)
sys.exit(int(status) or bool(leaked))
"""


def _pytest_without(blocked, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    command = [sys.executable, "-c", CHILD, ",".join(blocked), "-q", "-p", "no:cacheprovider", "-rs", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          check=False)


def test_property_tests_skip_without_hypothesis():
    """test_properties.py collects without hypothesis; its property-based tests skip, saying why."""
    done = _pytest_without(["hypothesis"], "tests/test_properties.py", "-m", "slow",  # the property tests are slow
                           "-k", "random_problems_in_the_simulator and 01")
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "1 skipped" in out and "hypothesis is not installed (pip install -e '.[dev]')" in out, out[-2000:]
    assert "imported although blocked: []" in out


@pytest.mark.parametrize("blocked", [["nbformat"], ["jupytext"], OPTIONAL],
                         ids=["nbformat", "jupytext", "all"])
def test_collection_without_optional_packages(blocked):
    """One notebook tool missing: the lesson tests skip, naming it. Every optional package missing:
    the whole suite still collects."""
    whole = blocked is OPTIONAL
    done = _pytest_without(blocked, "--collect-only", "tests" if whole else "tests/test_lessons.py")
    out = done.stdout
    expected = 0 if whole else pytest.ExitCode.NO_TESTS_COLLECTED  # test_lessons.py skipped as a whole
    assert done.returncode == expected, out[-3000:] + done.stderr[-3000:]
    summary = out.splitlines()[-2]  # the last line is the child's own
    assert "error" not in summary.lower() and "collected" in summary, out[-2000:]
    first = "nbformat" if whole else blocked[0]  # the lesson tests' first check
    assert f"{first} is not installed (pip install -e '.[notebooks]')" in out, out[-2000:]
    assert "imported although blocked: []" in out


def test_the_course_extra_brings_the_disassembler():
    """The lessons' SASS cells need nvdisasm: the course extra installs NVIDIA's wheel of it
    (cuda-toolkit's nvdisasm extra), and where the course extra is installed on a platform NVIDIA
    builds it for, the lessons find it."""
    import importlib.util
    import re

    from flashcore_numba.measure.machine_code import find_disassembler

    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    course = re.search(r"^course = \[(.*?)\]\n", text, re.MULTILINE | re.DOTALL).group(1)
    assert '"cuda-toolkit[nvdisasm]==13.*"' in course, course
    if importlib.util.find_spec("jupyterlab") is not None and sys.platform in ("linux", "win32"):
        assert find_disassembler() is not None, "the course extra is installed, but no nvdisasm is found"


def test_a_sass_cell_without_a_disassembler_says_what_to_install(capsys):
    """Where no nvdisasm or cuobjdump is found, the lessons' SASS cell prints how to get one (the course
    extra) instead of failing, and points back to the PTX."""
    from types import SimpleNamespace

    from flashcore_numba.course.notebooks import Lesson

    no_sass = SimpleNamespace(reports=lambda: {"09": {"ptx": ".version 8.0"}}, main_id="09")
    Lesson.sass(no_sass, ["WGMMA"])
    out = capsys.readouterr().out
    assert "No SASS here: it needs nvdisasm" in out and 'pip install -e ".[course]"' in out and "PTX" in out

"""The package's layers, enforced: the folder is the architecture (docs/architecture.md).

    flashcore_numba/   __init__, __main__, api, reference, cli: the library's face and the CLI
      runtime/         the call path: a plan per problem, the launch, compiled kernels on disk
      phases/          the kernels, and the tile helpers only they use
      arch/            below Numba's surface: what the simulator lacks, shared memory, (PTX)
      measure/         bench, report, machine_code, banks, doctor
      course/          the lesson runtime, `flashcore lessons`, exercises, grade

Arrows point one way: course -> measure -> library -> runtime -> phases -> arch, and the library
(the face, the runtime, the phases and arch) never imports measurement, course or CLI code. Nothing but __main__ imports
the CLI, which only wires commands to the rest. Every import statement of every module is
read with `ast`, those inside functions included (that is where most of the heavy imports
live), and resolved to the module it names.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

PACKAGE = "flashcore_numba"
PACKAGE_DIR = Path(__file__).resolve().parent.parent / PACKAGE
MAX_TOP_LEVEL_MODULES = 6
SUBPACKAGES = ("runtime", "phases", "arch", "measure", "course")

# layer -> the layers it must never import
FORBIDDEN = {
    "arch": {"runtime", "phases", "library", "measure", "course", "cli", "__main__"},  # the bottom
    "phases": {"runtime", "library", "measure", "course", "cli", "__main__"},  # kernels: arch and each other
    "runtime": {"library", "measure", "course", "cli", "__main__"},  # the call path: phases and arch
    "library": {"measure", "course", "cli", "__main__"},  # __init__, api, reference
    "measure": {"course", "cli", "__main__"},  # uses the library; the course uses it
    "course": {"cli", "__main__"},
    "cli": {"__main__"},  # wiring: may use everything below it
    "__main__": set(),  # `python -m flashcore_numba` is the CLI
}


def why(importer: str, imported: str) -> str:
    if imported == "cli":
        return "nothing but __main__ imports the CLI; move what both need to the layer it belongs to"
    if imported == "__main__":
        return "__main__ is the program's entry point, never a module to import"
    return {
        "arch": "arch is the bottom layer: the kernels are built on it, never the reverse",
        "phases": "the kernels use arch and each other only",
        "runtime": "the call path runs the kernels; the face above it validates and calls it",
        "library": "the library never uses what measures or teaches it",
        "measure": "measurement uses the library; the course uses measurement, never the reverse",
    }.get(importer, "")


def layer(module: str) -> str | None:
    """The layer of a module of the package (None for one outside it)."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    if len(parts) == 1 or parts[1] in ("api", "reference"):
        return "library"
    return parts[1] if parts[1] in SUBPACKAGES + ("cli", "__main__") else "unknown"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, at any depth.

    `from . import x` names the submodule x when there is one, else its package.
    """
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {(node.lineno, alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add((node.lineno, submodule if _is_module(submodule) else base))
    return sorted(found)


def _is_module(name: str) -> bool:
    """Is `name` a module or package of this package (on disk)?"""
    if layer(name) is None:
        return False
    path = PACKAGE_DIR.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def violations(source: str, module: str, is_package: bool = False, where: str = "") -> list[str]:
    """Every import of `source` (module `module`) that points the wrong way, one message each."""
    mine = layer(module)
    problems = []
    for line, target in imported_modules(source, module, is_package):
        theirs = layer(target)
        if theirs in FORBIDDEN.get(mine, ()):
            problems.append(f"{where or module}:{line} imports {target}: {mine} must not import {theirs} "
                            f"({why(mine, theirs)})")
    return problems


def package_modules() -> list[Path]:
    return sorted(PACKAGE_DIR.rglob("*.py"))


def test_every_module_belongs_to_a_layer():
    unknown = [str(p.relative_to(PACKAGE_DIR.parent)) for p in package_modules()
               if layer(module_name(p)) in (None, "unknown")]
    assert not unknown, (f"{unknown}: a new subpackage needs its layer in tests/test_layout.py and its "
                         f"place in docs/architecture.md")


def test_top_level_holds_the_face_and_the_cli_only():
    top = sorted(p.name for p in PACKAGE_DIR.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, (
        f"flashcore_numba/ has {len(top)} modules at the top ({', '.join(top)}); at most "
        f"{MAX_TOP_LEVEL_MODULES}: kernels go in phases/, hardware helpers in arch/, measurement in "
        f"measure/, teaching in course/")


@pytest.mark.parametrize("path", package_modules(), ids=lambda p: str(p.relative_to(PACKAGE_DIR)))
def test_imports_point_one_way(path):
    where = str(path.relative_to(PACKAGE_DIR.parent))
    source = path.read_text(encoding="utf-8")
    problems = violations(source, module_name(path), path.name == "__init__.py", where)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("module, source, expected", [
    ("flashcore_numba.api", "def f():\n    from .measure import bench\n", "library must not import measure"),
    ("flashcore_numba.phases.p09_x", "from ..course import grade\n", "phases must not import course"),
    ("flashcore_numba.arch.ptx", "from flashcore_numba.phases import common\n",
     "arch must not import phases"),
    ("flashcore_numba.course.grade", "def g():\n    from .. import cli\n", "course must not import cli"),
    ("flashcore_numba.measure.bench", "import flashcore_numba.cli\n", "measure must not import cli"),
    ("flashcore_numba.measure.report", "from ..course.exercises import write_all\n",
     "measure must not import course"),
])
def test_a_wrong_way_import_is_caught(module, source, expected):
    """The checker itself: imports at any depth, relative or absolute, each named with its line."""
    problems = violations(source, module)
    assert len(problems) == 1 and expected in problems[0], problems


def test_right_way_imports_pass():
    source = ("from ..measure.bench import Timing\nfrom ..phases.common import LOG2E\n"
              "from ..arch.sim import simulator_enabled\nfrom .. import __version__\nimport numpy\n")
    assert violations(source, "flashcore_numba.course.grade") == []

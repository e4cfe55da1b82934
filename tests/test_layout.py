"""The package's layers, enforced: the folder is the architecture (docs/architecture.md).

    flashcore_numba/   __init__, __main__, api, inference, reference, flex, cli: the library's face
                       (api: attention; inference: attention_kvcache and attention_varlen; flex:
                       score_mod and mask_mod) and the CLI;
                       usage: the one form of a usage error, for the CLI and the course's commands
      runtime/         the call path: a plan per problem, the launch, compiled kernels on disk
      phases/          the kernels, and the tile helpers only they use
      arch/            below Numba's surface: what the simulator lacks, shared memory, (PTX)
      measure/         bench, records, report, machine_code, banks, doctor
      course/          the lesson runtime, `flashcore lessons`, exercises, grade

Arrows point one way: course -> measure -> library -> runtime -> phases -> arch, and the library
(the face, the runtime, the phases and arch) never imports measurement, course or CLI code. Nothing but __main__ imports
the CLI, which only wires commands to the rest. Every import statement of every module is
read with `ast`, those inside functions included (that is where most of the heavy imports
live), and resolved to the module it names.

Within a layer the imports form no circle either: a module that imports one that imports it
back (at any depth, through any number of modules) can only be read, and imported, together.

And a definition the package shares has one home: each name of SHARED is assigned at module
level in exactly one module, and every other user imports it from there.

And a kernel reads as its roles: no function of phases/ is longer than MAX_PHASE_FUNCTION_LINES,
nested functions counted in the one that holds them (a kernel's closure that grew to hold all of
its roles fails, as phase 09's and 10's did at 543 and 574 lines).
"""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path

import pytest

PACKAGE = "flashcore_numba"
PACKAGE_DIR = Path(__file__).resolve().parent.parent / PACKAGE
MAX_TOP_LEVEL_MODULES = 8  # the face (api, inference, reference, flex), usage, cli, __init__, __main__
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
    if len(parts) == 1 or parts[1] in ("api", "inference", "reference", "flex", "usage"):
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


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the modules of the package it imports, from {module: (source, is_package)}."""
    return {module: {target for _, target in imported_modules(source, module, is_package) if layer(target)}
            for module, (source, is_package) in sources.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle of `graph`, one per group of modules that import each other, as a path
    `a, b, ..., a` (a shortest one back to its first module, the first in sorted order)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(module):  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:  # module is the first of its group: the group is above it
            group = set(stack[stack.index(module):])
            del stack[stack.index(module):]
            on_stack.difference_update(group)
            if len(group) > 1 or module in graph.get(module, ()):
                groups.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return [_path_back(min(group), graph, group) for group in sorted(groups, key=min)]


def _path_back(start: str, graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest import path from `start` back to itself, within `group` (breadth first)."""
    came_from, frontier = {}, [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph.get(module, set()) & group):
                if target == start:
                    path = [module]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return path[::-1] + [start]
                if target not in came_from:
                    came_from[target] = module
                    following.append(target)
        frontier = following
    raise AssertionError(f"{start} is in no circle")


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


def test_no_import_circle():
    sources = {module_name(p): (p.read_text(encoding="utf-8"), p.name == "__init__.py") for p in package_modules()}
    found = circles(import_graph(sources))
    assert not found, ("import circles (move what both sides need into a module that imports neither):\n"
                       + "\n".join(" -> ".join(circle) for circle in found))


ARCH, PHASES_ = f"{PACKAGE}.arch", f"{PACKAGE}.phases"


@pytest.mark.parametrize("sources, expected", [
    ({f"{ARCH}.ptx": "def function():\n    from . import sim_mma\n",  # the import back inside a function
      f"{ARCH}.sim_mma": "from .ptx import emulation\n"},
     [[f"{ARCH}.ptx", f"{ARCH}.sim_mma", f"{ARCH}.ptx"]]),
    ({f"{PHASES_}.common": "from . import tracing\n",  # three modules, relative and absolute
      f"{PHASES_}.tracing": f"import {PHASES_}.p09_warp_specialized\n",
      f"{PHASES_}.p09_warp_specialized": "def build():\n    from .common import launch\n"},
     [[f"{PHASES_}.common", f"{PHASES_}.tracing", f"{PHASES_}.p09_warp_specialized", f"{PHASES_}.common"]]),
    ({f"{ARCH}.sim": f"from {ARCH} import sim\n"}, [[f"{ARCH}.sim", f"{ARCH}.sim"]]),  # a module importing itself
    ({f"{ARCH}.ptx": "from . import sim_mma, sim_wmma\n",  # two circles through one module: one group, one path
      f"{ARCH}.sim_mma": "from .ptx import emulation\n", f"{ARCH}.sim_wmma": "from .ptx import emulation\n"},
     [[f"{ARCH}.ptx", f"{ARCH}.sim_mma", f"{ARCH}.ptx"]]),
])
def test_an_import_circle_is_caught(sources, expected):
    """The checker itself: a circle of any length, through imports at any depth, named in order."""
    graph = import_graph({module: (source, False) for module, source in sources.items()})
    assert circles(graph) == expected


def test_imports_without_a_circle_pass():
    """The registry below both: ptx -> sim_mma -> emulation and ptx -> emulation is no circle."""
    sources = {f"{ARCH}.ptx": "from .emulation import registered\ndef function():\n    from . import sim_mma\n",
               f"{ARCH}.sim_mma": "from .emulation import emulation\nfrom .sim import warp_exchange\n",
               f"{ARCH}.emulation": "from __future__ import annotations\n", f"{ARCH}.sim": "import numpy\n"}
    assert circles(import_graph({module: (source, False) for module, source in sources.items()})) == []


# ---------------------------------------------------------------------------------------------
# One home per shared definition
# ---------------------------------------------------------------------------------------------
# name -> the module that defines it; every other module imports it from there
SHARED = {
    "FULL_MASK": f"{PACKAGE}.phases.common",  # the warp's 32 lanes, for shuffles and votes
    "MMA_N": f"{PACKAGE}.phases.common",  # the columns of an n-tile of the accumulator layout
    "PTX_TYPE": f"{PACKAGE}.phases.common",  # a dtype's name in PTX, beside ELEMENT
    "REFERENCE_SHAPE": f"{PACKAGE}.measure.bench",  # the shape of the ladder
    "repo_root": f"{PACKAGE}.measure.records",  # where docs/bench/ and lessons/ are
    "SCHEMA": f"{PACKAGE}.measure.records",  # the record format's version
    "Parser": f"{PACKAGE}.usage",  # every command's argument parser, one error form
    "usage_error": f"{PACKAGE}.usage",
}


def module_level_definitions(source) -> set[str]:
    """Names a module binds at its top level by assignment, def or class (imports aside),
    including those bound under a top-level if/try/with."""
    names = set()

    def visit(statements):
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            for block in ("body", "orelse", "finalbody", "handlers"):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(getattr(node, block, []))

    visit((ast.parse(source) if isinstance(source, str) else source).body)
    return names


def definitions_by_name(sources: dict, names) -> dict[str, list[str]]:
    """name -> the modules (of `sources`, {module: source or its ast}) that define it at module level."""
    found = {name: [] for name in names}
    for module, source in sorted(sources.items()):
        for name in module_level_definitions(source) & set(names):
            found[name].append(module)
    return found


@cache
def package_trees() -> dict[str, ast.Module]:
    """module -> its parsed source, for every module of the package (parsed once per session)."""
    return {module_name(p): ast.parse(p.read_text(encoding="utf-8")) for p in package_modules()}


def test_each_shared_definition_has_one_home():
    homes = definitions_by_name(package_trees(), SHARED)
    wrong = [f"{name} is defined in {', '.join(modules) or 'no module'}; its one home is {SHARED[name]} "
             f"(import it from there)" for name, modules in homes.items() if modules != [SHARED[name]]]
    assert not wrong, "\n".join(wrong)


def test_a_second_home_is_caught():
    """The checker itself: a copy at module level, under an if, or as a class is found; a local
    variable of the same name inside a function, or an import, is not a definition."""
    sources = {
        "a": "FULL_MASK = 0xFFFFFFFF\nclass Parser: pass\n",
        "b": "from a import FULL_MASK\ndef f():\n    FULL_MASK = 1\n",
        "c": "import os\nif os.name:\n    FULL_MASK: int = 0xFFFFFFFF\n",
        "d": "try:\n    pass\nexcept ImportError:\n    class Parser: pass\n",
    }
    assert definitions_by_name(sources, ["FULL_MASK", "Parser"]) == {"FULL_MASK": ["a", "c"], "Parser": ["a", "d"]}


def test_one_argument_parser_class():
    """Every command's parser is usage.Parser: a second ArgumentParser subclass would bring back a
    second form of usage error."""
    subclasses = [f"{module}.{node.name}" for module, tree in package_trees().items() for node in ast.walk(tree)
                  if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("ArgumentParser")
                                                            for b in node.bases)]
    assert subclasses == [f"{SHARED['Parser']}.Parser"], subclasses


def test_no_private_name_is_imported_across_modules():
    """A module's private names (a leading underscore) are its own: no other module of the package
    imports one (`from .x import _name`); what another module needs is public, named for what it does."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "flashcore_numba"
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                found += [f"{path.relative_to(root)}: from {'.' * node.level}{node.module or ''} import {a.name}"
                          for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found, "\n".join(found)


# ---------------------------------------------------------------------------------------------
# Kernels that read like the algorithm
# ---------------------------------------------------------------------------------------------
MAX_PHASE_FUNCTION_LINES = 300
SPLIT_IT = ("give its roles functions of their own (factories at module level that return device functions, "
            "as the phases' make_* do) and let it only wire them together")


def long_functions(source: str, where: str, limit: int = MAX_PHASE_FUNCTION_LINES) -> list[str]:
    """Every function (or method, or function nested in another) of `source` longer than `limit`
    lines, from its `def` to its last line: nested functions count in the one that holds them too."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append(f"{where}:{node.lineno} {node.name} is {lines} lines, more than {limit}: "
                             f"{SPLIT_IT}")
    return found


def test_no_phase_function_is_longer_than_the_limit():
    """No function of phases/ over MAX_PHASE_FUNCTION_LINES lines: a kernel's roles (the producer, the
    softmax of a tile, the epilogue, ...) are functions a reader can find and read alone, and the
    closure that holds the compile-time constants only wires them together."""
    found = []
    for path in sorted((PACKAGE_DIR / "phases").glob("*.py")):
        found += long_functions(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE_DIR.parent)))
    assert not found, "\n".join(found)


def test_a_long_function_is_caught():
    """The checker itself: a function over the limit is found, also when most of its length is a
    function nested in it (which is found too when it is itself over the limit); one at the limit is not."""
    source = "def outer():\n    def inner():\n" + "".join(f"        x{i} = {i}\n" for i in range(4)) + \
        "    return inner\n"  # outer: 7 lines, inner: 5
    assert long_functions(source, "a.py", limit=7) == []
    assert long_functions(source, "a.py", limit=5) == [f"a.py:1 outer is 7 lines, more than 5: {SPLIT_IT}"]
    names = [problem.split(" is ")[0] for problem in long_functions(source, "a.py", limit=4)]
    assert names == ["a.py:1 outer", "a.py:2 inner"]

"""Compiled kernels on disk: the first call in a new process loads a cubin instead of compiling.

Numba compiles a phase's kernel on its first launch in every process (17-32 s for phases 07-09),
and its own `cache=True` cannot keep these kernels: they are closures over device functions
whose pickles differ from process to process, and a kernel that links PTX files refuses to be
pickled at all. So the cubin Numba would load is kept here, one file per kernel:

    <cache dir>/<key>.cubin     magic, a JSON header (the key's fields, the entry name, the cubin's
                                SHA-256), the cubin

The key is a SHA-256 of everything that changes the machine code: the kernel (phase or variant,
head dim, dtype, argument types), the compute capability, the source of the kernel (`kernel_source`:
its phase's module, the module that defines it, every module of the package those import, and so
on; phases/__init__.py and arch/__init__.py, which build the variants; every file of ptx/), and the
toolchain (numba-cuda, numba, NVVM and nvJitLink versions). So an edit to phase 11 compiles
phase 11's kernels again, not the forward's; an edit to a module every phase imports, all of them.
An entry whose header does not name its key, whose cubin does not match its checksum, or that
cannot be read at all (stale, truncated, written by another version) is rebuilt and replaced,
never loaded. Only the package's own kernels are cached: the key names the
package's source, not a copy's, so a kernel defined in any other file (an exercise being solved,
lessons/exercises/) compiles in every process, never loads the package's cubin under the same
identity (`is_ours`). Files are written whole (a temporary file, then a rename), so a
process killed mid-write leaves no half entry under the final name.

Where: $FLASHCORE_CACHE_DIR, else the platform's cache folder (~/.cache/flashcore-numba on
Linux, $XDG_CACHE_HOME when set; ~/Library/Caches on macOS; %LOCALAPPDATA% on Windows).
FLASHCORE_CACHE=0 switches it off: every process compiles again. Its `reports/` folder keeps the
machine-code reports of measure/machine_code.py (registers, spills, PTX, SASS) the same way. `flashcore compile` fills it
ahead of time (runtime/precompile.py).

Both launches use it: the plan of a call on torch tensors loads the cubin itself (runtime/plan.py),
and a launch through Numba (phases.common.launch) first gives Numba's dispatcher the cached kernel
(`install`), so that Numba loads it instead of compiling.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

MAGIC = b"flashcore-numba cubin 1\n"
PACKAGE = Path(__file__).resolve().parents[1]
stats = {"built": 0, "loaded": 0, "rejected": 0}  # this process's cache events (tests and `flashcore compile`)


def cache_dir() -> Path | None:
    """The cache folder, or None when FLASHCORE_CACHE=0 switches the cache off."""
    if os.environ.get("FLASHCORE_CACHE", "1").strip().lower() in ("0", "off", "no", "false"):
        return None
    explicit = os.environ.get("FLASHCORE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    elif os.name == "nt":
        base = Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local"))
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "flashcore-numba"


@lru_cache(maxsize=None)
def source_fingerprint() -> str:
    """SHA-256 of every kernel's source: every .py file of phases/ and arch/, every file of ptx/ (the
    machine-code reports' key; a kernel's own cache key hashes its own files, kernel_fingerprint)."""
    digest = hashlib.sha256()
    for path in _every_source_file():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _every_source_file() -> tuple[Path, ...]:
    """Every .py file of phases/ and arch/, then every file of ptx/."""
    from .ptx import ptx_dir

    return (tuple(sorted([*PACKAGE.glob("phases/*.py"), *PACKAGE.glob("arch/*.py")])) +
            tuple(sorted(ptx_dir().glob("*.ptx"))))


@lru_cache(maxsize=None)
def _package_files() -> tuple[frozenset, frozenset]:
    """(every .py file, every folder) of the package: one walk, not a stat per import."""
    files = frozenset(PACKAGE.rglob("*.py"))
    return files, frozenset(path.parent for path in files)


def _import_statements(text: str):
    """(dots, module, names) of each `from <dots><module> import <names>` and (None, None, modules)
    of each `import <modules>` that starts a line, names in parentheses gathered across lines. A
    scan of the lines, not ast.parse: parsing the ~20 files behind one kernel took 0.1 s of a
    first call that otherwise takes 0.035 s. A match inside a string only adds a file to a key,
    which costs a compile, never a stale load."""
    lines = iter(text.splitlines())
    for line in lines:
        words = line.split(None, 1)
        if not words or words[0] not in ("from", "import"):
            continue
        statement = line.split("#", 1)[0]
        while "(" in statement and ")" not in statement:
            statement += " " + next(lines, ")").split("#", 1)[0]
        statement = statement.replace("(", " ").replace(")", " ")
        if words[0] == "import":
            yield None, None, statement.split(None, 1)[-1]
            continue
        head, _, names = statement.partition(" import ")
        where = head.split()[1] if len(head.split()) > 1 else ""
        module = where.lstrip(".")
        yield len(where) - len(module), module, names


@lru_cache(maxsize=None)
def imported_modules(path: Path) -> frozenset[Path]:
    """The package's own module files that the module `path` imports, relative or absolute, at its
    top or inside a function: `from .common import x` is common.py, `from ..arch import ptx` is
    arch/ptx.py (a name that is a module), `from ..phases import build` is phases/__init__.py."""
    files, folders = _package_files()
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)  # [package, ..., module]
    found = set()
    for dots, module, names in _import_statements(path.read_text(encoding="utf-8")):
        names = [n.split()[0] for n in names.split(",") if n.split()]
        if dots is None:  # import flashcore_numba.x.y
            ours = [n for n in names if n.split(".")[0] == PACKAGE.name]
            targets = [PACKAGE.parent.joinpath(*n.split(".")) for n in ours]
            names = []
        elif dots:
            targets = [PACKAGE.parent.joinpath(*parts[:-dots], *(module.split(".") if module else []))]
        elif module.split(".")[0] == PACKAGE.name:
            targets = [PACKAGE.parent.joinpath(*module.split("."))]
        else:
            continue
        for target in targets:
            if target.with_suffix(".py") in files:
                found.add(target.with_suffix(".py"))
            elif target in folders:
                subs = [target / f"{name}.py" for name in names]
                found.update(sub for sub in subs if sub in files)
                if not subs or not all(sub in files for sub in subs):
                    found.add(target / "__init__.py")
    return frozenset(found)


@lru_cache(maxsize=None)
def kernel_source(kernel_id: str, defining_file: str) -> tuple[Path, ...]:
    """The files whose text makes the kernel `kernel_id` (a cache identity's first field, "07",
    "06-inline", "11-kv"...) defined in `defining_file`: its phase's module (the id's number) and
    that file, every package module they import and those import in turn (a package's
    __init__.py counts as its own text: the phases' registry imports every phase, and following it
    would make every kernel depend on every phase), phases/__init__.py and arch/__init__.py, and
    every file of ptx/. An id without a phase number gets every file (source_fingerprint's)."""
    from .ptx import ptx_dir

    phase = sorted(PACKAGE.glob(f"phases/p{kernel_id[:2]}_*.py")) if kernel_id[:2].isdigit() else []
    if len(phase) != 1:
        return _every_source_file()
    todo, seen = [phase[0], Path(defining_file).resolve()], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        if path.name != "__init__.py":
            todo.extend(imported_modules(path))
    seen.update((PACKAGE / "phases" / "__init__.py", PACKAGE / "arch" / "__init__.py"))
    return tuple(sorted(seen)) + tuple(sorted(ptx_dir().glob("*.ptx")))


@lru_cache(maxsize=None)
def kernel_fingerprint(kernel_id: str, defining_file: str) -> str:
    """SHA-256 of the files of kernel_source(kernel_id, defining_file)."""
    digest = hashlib.sha256()
    for path in kernel_source(kernel_id, defining_file):
        name = path.relative_to(PACKAGE).as_posix() if path.is_relative_to(PACKAGE) else f"ptx/{path.name}"
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def global_names(code) -> set[str]:
    """The globals a code object (and the code nested in it) loads: not co_names, which also holds
    the attributes it reads (`np.float32` names float32, which a module may hold as a Numba type)."""
    import dis
    import inspect

    names = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= global_names(const)
    return names


def function_fingerprint(fn) -> str | None:
    """SHA-256 of what the machine code of a function a user hands a kernel follows from (phase 14's
    mods, flashcore_numba/flex.py), for a cache identity: its bytecode, constants, names and
    defaults, the Python version, and the value of every global or closure variable it reads that
    is a number, a string, a module (by name) or a function (fingerprinted in turn). None where it
    reads one of another kind (an array, an object: its value could change without its code
    changing): then its kernel is compiled in each process, never cached."""
    import inspect

    import numpy as np

    digest = hashlib.sha256(repr(sys.version_info[:2]).encode())
    seen = set()

    def code(c):
        digest.update(c.co_code + repr((c.co_names, c.co_varnames, c.co_argcount, c.co_freevars)).encode())
        for const in c.co_consts:
            if inspect.iscode(const):
                code(const)
            else:
                digest.update(repr((type(const).__name__, const)).encode())

    def visit(f) -> bool:
        f = getattr(f, "py_func", f)  # a Numba device function: its Python function
        if not inspect.isfunction(f):
            return False
        if f in seen:
            return True
        seen.add(f)
        code(f.__code__)
        digest.update(repr(f.__defaults__).encode())
        cells = [c.cell_contents for c in (f.__closure__ or ())]
        named = [(name, f.__globals__[name]) for name in sorted(global_names(f.__code__)) if name in f.__globals__]
        for name, value in [*enumerate(cells), *named]:
            if isinstance(value, (bool, int, float, complex, str, bytes, type(None), np.number)):
                digest.update(repr((name, type(value).__name__, value)).encode())
            elif inspect.ismodule(value):
                digest.update(repr((name, value.__name__)).encode())
            elif not visit(value):
                return False
        return True

    return digest.hexdigest()[:32] if visit(fn) else None


@lru_cache(maxsize=None)
def toolchain() -> dict:
    """The versions that shape the machine code."""
    import importlib.metadata

    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    from cuda.bindings import nvjitlink
    from numba.cuda.cudadrv.nvvm import NVVM

    return {"numba-cuda": version("numba-cuda"), "numba": version("numba"),
            "nvvm": ".".join(map(str, NVVM().get_version())), "nvjitlink": ".".join(map(str, nvjitlink.version()))}


@dataclass(frozen=True)
class CachedKernel:
    cubin: bytes
    entry: str
    key: str
    built: bool  # compiled by this call, not read from the cache


def key_fields(identity: tuple, argtypes, cc, source: str | None = None) -> dict:
    """What the key hashes: the kernel's identity (its id, head dim and dtype: phases.build), its
    argument types, the compute capability, the kernel's source (kernel_fingerprint; None: every
    kernel's, source_fingerprint) and the toolchain."""
    return {"kernel": [str(x) for x in identity], "argtypes": str(tuple(argtypes)), "cc": list(map(int, cc[:2])),
            "source": source or source_fingerprint(), "toolchain": toolchain()}


def key_of(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:40]


def read_entry(path: Path, key: str) -> tuple[bytes, str] | None:
    """(cubin, entry) of a valid entry for `key`, or None (missing, or not to be trusted)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        if not data.startswith(MAGIC):
            raise ValueError("not a flashcore-numba cubin")
        header_end = data.index(b"\n", len(MAGIC))
        header = json.loads(data[len(MAGIC):header_end])
        cubin = data[header_end + 1:]
        if header.get("key") != key:
            raise ValueError("written for another key")
        if hashlib.sha256(cubin).hexdigest() != header.get("sha256") or len(cubin) != header.get("size"):
            raise ValueError("truncated or altered")
        return cubin, header["entry"]
    except (ValueError, KeyError, TypeError):
        stats["rejected"] += 1
        return None


def write_entry(path: Path, key: str, fields: dict, cubin: bytes, entry: str) -> None:
    header = dict(fields, key=key, entry=entry, size=len(cubin), sha256=hashlib.sha256(cubin).hexdigest())
    write_whole(path, MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + cubin)


def write_whole(path: Path, data: bytes) -> None:
    """`data` into `path` whole or not at all: a temporary file beside it, then a rename, so that
    a reader (or a process killed mid-write) never leaves or sees half a file under that name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def locked(path: Path):
    """Hold an exclusive lock on the file `path` (made if missing) for a `with` block, so that
    processes take turns: flock where the platform has it; elsewhere no lock."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def is_ours(dispatcher) -> bool:
    """Whether `dispatcher`'s kernel is written in phases/ or arch/ of this package (whose files
    kernel_fingerprint hashes). A student's copy of a phase declares the same cache identity as the
    phase, so without this test it would load the solution's cubin."""
    try:
        where = Path(dispatcher.py_func.__code__.co_filename).resolve()
    except (AttributeError, OSError):
        return False
    return where.parent in (PACKAGE / "phases", PACKAGE / "arch")


def cached_cubin(dispatcher, argtypes, identity: tuple, cc) -> CachedKernel:
    """The cubin of `dispatcher` (a kernel whose identity, its id, head dim and dtype, is `identity`)
    compiled for `argtypes` (Numba types) on a GPU of compute capability `cc`: from the cache when it
    holds a valid entry, else compiled (Numba's own compile, arch.launch.build_cubin) and stored. A
    kernel that is not the package's own (`is_ours`) is compiled every time, never cached."""
    from .launch import build_cubin

    ours = is_ours(dispatcher)
    source = kernel_fingerprint(str(identity[0]), dispatcher.py_func.__code__.co_filename) if ours else None
    fields = key_fields(identity, argtypes, cc, source)
    key = key_of(fields)
    folder = cache_dir() if ours else None
    path = folder / f"{key}.cubin" if folder is not None else None
    found = read_entry(path, key) if path is not None else None
    if found is not None:
        stats["loaded"] += 1
        return CachedKernel(found[0], found[1], key, built=False)
    cubin, entry = build_cubin(dispatcher, argtypes, cc)
    stats["built"] += 1
    if path is not None:
        try:
            write_entry(path, key, fields, cubin, entry)
        except OSError as e:  # a read-only or full disk costs the next process a compile, nothing more
            import warnings

            warnings.warn(f"flashcore-numba: could not write the kernel cache {path} ({e}); set "
                          f"FLASHCORE_CACHE_DIR to a writable folder or FLASHCORE_CACHE=0", stacklevel=2)
    return CachedKernel(cubin, entry, key, built=True)


def install(dispatcher, argtypes, identity: tuple) -> None:
    """Give `dispatcher` its kernel for `argtypes` from the cache (compiled there once if need be),
    so that Numba's own launch loads that cubin instead of compiling: its compiled kernel rebuilt
    the way numba-cuda rebuilds one from its own cache (`_Kernel._rebuild`,
    `CUDACodeLibrary._rebuild`), holding the cubin for this GPU."""
    from cuda.core import ObjectCode
    from numba import cuda
    from numba.cuda import types
    from numba.cuda.codegen import CUDACodeLibrary
    from numba.cuda.dispatcher import _Kernel

    cc = tuple(cuda.get_current_device().compute_capability)
    found = cached_cubin(dispatcher, argtypes, identity, cc)
    full_cc = (cc[0], cc[1], "a" if cc >= (9, 0) else "")
    library = CUDACodeLibrary._rebuild(
        codegen=dispatcher.targetctx.codegen(), name=found.entry, entry_name=found.entry, llvm_strs=[],
        ptx_cache={}, cubin_cache={full_cc: ObjectCode.from_cubin(found.cubin)}, linkerinfo_cache={},
        max_registers=None, nvvm_options={}, needs_cudadevrt=False, nrt=False, use_cooperative=False, lto=True)
    kernel = _Kernel._rebuild(cooperative=False, name=found.entry, signature=types.void(*argtypes),
                              codelibrary=library, debug=False, lineinfo=False, call_helper=None, extensions=[])
    dispatcher.add_overload(kernel, tuple(argtypes))

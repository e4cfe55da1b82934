"""PTX from `ptx/` as device functions, by two routes, and the simulator's stand-ins.

Every hand-written PTX function lives in one file of the top-level `ptx/` folder, as a
`.visible .func` in numba-cuda's C ABI (wgmma.ptx, whose functions come in many near-copies,
is generated from ptx/templates/wgmma.ptx.in by `ptx_templates` and committed: what is read
here is always the file in ptx/). A kernel gets it from here in one of two ways:

- the **link route**: `cuda.declare_device(name, signature, abi="c", link=[file])`. The
  `.ptx` file is linked as written, and every use is a real call: arguments through `.param`
  space, a SASS `CALL`, registers the callee must save. nvJitLink never inlines PTX.
- the **inline route**: the same function body pasted into the kernel as inline assembly
  (`numba.cuda.extending.intrinsic` + `llvmlite.ir.InlineAsm`). No call: the compiler
  allocates the registers of the body together with the kernel's own.

Why inline assembly and not a `.cu` wrapper compiled with LTO: the wrapper would have to
hold the PTX text again inside `asm volatile("...")` strings, a second copy to keep in step.
Here the inline text is *derived* from the `.ptx` file by two mechanical edits, so the file a
reader opens in `ptx/` is exactly what runs on both routes:

    ld.param.b32  %x, [name];   ->   mov.b32  %x, $i;     (operand i = parameter `name`)
    st.param.f32  [func_retval0+8], %y;  ->  mov.f32  $j, %y;   (output j, by offset)
    ret;                        ->   (dropped)

and the body is wrapped in `{ }`, which gives its registers and labels their own scope, so a
function may be pasted many times into one kernel. One rule follows for the files: a body must
not declare registers named like the compiler's own (%r1, %rd2, %f3, %p4, %rs5, %fd6): LLVM
writes the asm operands as such names, and inside the braces a local %r1 would capture them.
`parse` refuses such a file.

In Numba's simulator there is no PTX at all: `function()` imports the `sim_*.py` modules and
hands back the Python emulation registered for that name in `arch/emulation.py` (see
`flashcore_numba.arch.sim_wmma` and `sim_mma`), which takes the same arguments. The sim
modules register there, not here, so none of them imports this module.
The operands those functions take (shared and global addresses, tensor-map addresses, wgmma
matrix descriptors, register arrays as tuples) are made in `arch/operands.py`; in the simulator
an address there is a `Pointer`, an (array, byte offset) pair that emulations read and write through.

A function that touches no memory (an `mma`, a conversion) is pasted without a memory
clobber, so the compiler may still move loads and stores around it; the others keep every
memory access on its side.

In order, this module holds: the reader of a `.ptx` file (`parse`, `load`, `PtxFunction`) and
the two routes (`function`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .emulation import registered
from .sim import simulator_enabled

ROUTES = ("link", "inline")

# PTX parameter type -> (Numba type name, inline-asm constraint letter, LLVM IR type)
_TYPES = {
    "b16": ("uint16", "h", "i16"),
    "u16": ("uint16", "h", "i16"),
    "b32": ("uint32", "r", "i32"),
    "u32": ("uint32", "r", "i32"),
    "s32": ("int32", "r", "i32"),
    "f32": ("float32", "f", "float"),
    "b64": ("uint64", "l", "i64"),
    "u64": ("uint64", "l", "i64"),
    "s64": ("int64", "l", "i64"),
}


def ptx_dir() -> Path:
    """The `ptx/` folder: beside the package in a checkout, inside it in an installed wheel."""
    package = Path(__file__).resolve().parents[1]  # flashcore_numba/
    for candidate in (package.parent / "ptx", package / "ptx"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"no ptx/ folder beside or inside {package}")


# ---------------------------------------------------------------------------------------------
# Reading a .ptx file
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PtxFunction:
    """One `.visible .func` of a ptx/ file."""

    name: str
    path: Path
    params: tuple[tuple[str, str], ...]  # (name, PTX type) in order
    results: tuple[tuple[int, str], ...]  # (byte offset in func_retval0, PTX type), by offset
    body: str  # the text between the braces

    @property
    def signature(self):
        """The Numba signature both routes declare: PTX .b32 -> uint32, .f32 -> float32, ..."""
        from numba import types

        args = [getattr(types, _TYPES[t][0]) for _, t in self.params]
        outs = [getattr(types, _TYPES[t][0]) for _, t in self.results]
        if not outs:
            return types.void(*args)
        if len(outs) == 1:
            return outs[0](*args)
        if len(set(outs)) == 1:
            return types.UniTuple(outs[0], len(outs))(*args)
        return types.Tuple(outs)(*args)

    def param_groups(self) -> list[tuple[str, str, int]]:
        """The parameters as (name, PTX type, count): a run `acc0, acc1, ..., accN-1` of one type is
        one group of N (one tuple argument with `function(..., tuples=True)`), any other a group of 1."""
        groups = []
        for name, kind in self.params:
            m = _NUMBERED.fullmatch(name)
            if m and groups and groups[-1][0] == m["stem"] and groups[-1][1] == kind and int(m["i"]) == groups[-1][2]:
                groups[-1] = (m["stem"], kind, groups[-1][2] + 1)
            elif m and int(m["i"]) == 0:
                groups.append((m["stem"], kind, 1))
            else:
                groups.append((name, kind, 1))
        return groups

    def tuple_signature(self):
        """The Numba signature with each numbered run of parameters taken as one UniTuple."""
        from numba import types

        sig = self.signature
        args = [types.UniTuple(getattr(types, _TYPES[t][0]), n) if n > 1 else getattr(types, _TYPES[t][0])
                for _, t, n in self.param_groups()]
        return sig.return_type(*args)

    @property
    def touches_memory(self) -> bool:
        """Whether the body reads, writes or orders memory (beyond its own parameters).

        A register-only function (an `mma`, a conversion) is pasted without a memory clobber,
        so the compiler may still schedule loads and stores around it.
        """
        code = [line.split("//")[0] for line in self.body.splitlines()]
        return any(_MEMORY_OP.search(line) and not _PARAM_OP.search(line) for line in code)

    @property
    def leaves_in_flight(self) -> bool:
        """Whether it returns with its wgmma still running (commit_group and no wait_group): an
        `_issue` function, whose results may be read only after a later wait (see inline_asm)."""
        code = "\n".join(line.split("//")[0] for line in self.body.splitlines())
        return "wgmma.commit_group" in code and "wgmma.wait_group" not in code

    @property
    def awaits_in_flight(self) -> bool:
        """Whether its parameters are registers of a wgmma in flight: a wait function (wait_group
        first, then the parameters, which it hands back unchanged)."""
        code = "\n".join(line.split("//")[0] for line in self.body.splitlines())
        return "wgmma.wait_group" in code and "wgmma.mma_async" not in code

    def inline_asm(self, in_place: bool = False) -> tuple[str, str]:
        """(assembly text, LLVM constraint string) of the body as inline assembly.

        Outputs come first in LLVM's operand numbering ($0 ..), then the inputs. in_place: the
        body's registers renamed to the operands, as for a function that leaves its wgmma in
        flight (`_inline_in_place`), where the usual text copies each parameter in and each
        result out by a `mov`.
        """
        if self.leaves_in_flight or in_place:
            return self._inline_in_place()
        n_out = len(self.results)
        params = [name for name, _ in self.params]
        out_index = {offset: i for i, (offset, _) in enumerate(self.results)}
        lines = []
        for line in self.body.splitlines():
            code = line.split("//")[0].strip()
            load = _LD_PARAM.fullmatch(code)
            store = _ST_RETVAL.fullmatch(code)
            if load:
                kind, reg, name = load.groups()
                lines.append(f"    mov.{kind} {reg}, ${n_out + params.index(name)};")
            elif store:
                kind, offset, reg = store.groups()
                lines.append(f"    mov.{kind} ${out_index[int(offset or 0)]}, {reg};")
            elif code == "ret;":
                continue
            else:
                lines.append(line)
        constraints = [f"={_TYPES[t][1]}" for _, t in self.results]
        constraints += [_TYPES[t][1] for _, t in self.params]
        if self.touches_memory:
            constraints.append("~{memory}")  # it reads or writes memory: no memory access moves across it
        return "{\n" + "\n".join(lines) + "\n}", ",".join(constraints)

    def _inline_in_place(self) -> tuple[str, str]:
        """The inline text of a function that leaves its wgmma in flight.

        The usual `mov` out of a result register would read an accumulator before its wait (not
        allowed; ptxas would serialize every wgmma of the kernel instead). So the body's registers
        are renamed to the asm operands themselves, the one mechanical edit here besides dropping
        the parameter moves and `ret;`:
            a result register               -> its output operand $j (the st.param dropped);
            a parameter loaded into it too  -> the input is tied to $j (LLVM's "+", operand "j");
            a parameter register the body never writes (P's fragments) -> its input operand.
        A parameter register the body does write (a descriptor it steps on) keeps its `mov`.
        The kernel then holds the in-flight registers as its own values until a wait function
        (flashcore_wgmma_wait_*) takes them: no copy of them is made before that wait.
        """
        n_out = len(self.results)
        params = [name for name, _ in self.params]
        out_index = {offset: i for i, (offset, _) in enumerate(self.results)}
        code = [line.split("//")[0].strip() for line in self.body.splitlines()]
        loads = {m[3]: m[2] for m in map(_LD_PARAM.fullmatch, code) if m}  # param -> register
        stores = {m[3]: out_index[int(m[2] or 0)] for m in map(_ST_RETVAL.fullmatch, code) if m}  # register -> j
        written = _written_registers(line for line in code if not _LD_PARAM.fullmatch(line))
        operand, tied = {}, {}
        for reg, j in stores.items():
            operand[reg] = f"${j}"
        for name, reg in loads.items():
            if reg in stores:
                tied[name] = stores[reg]
            elif reg not in written:
                operand[reg] = f"${n_out + params.index(name)}"
        rename = re.compile(r"%\w+")
        lines = []
        for line, stripped in zip(self.body.splitlines(), code, strict=True):
            load = _LD_PARAM.fullmatch(stripped)
            if _ST_RETVAL.fullmatch(stripped) or stripped == "ret;" or (load and load[2] in operand):
                continue
            if load:
                kind, reg, name = load.groups()
                line = f"    mov.{kind} {reg}, ${n_out + params.index(name)};"
            elif not stripped.startswith(".reg"):
                line = rename.sub(lambda m: operand.get(m.group(0), m.group(0)), line)
            lines.append(line)
        constraints = [f"={_TYPES[t][1]}" for _, t in self.results]
        constraints += [str(tied[name]) if name in tied else _TYPES[t][1] for name, t in self.params]
        if self.touches_memory:
            constraints.append("~{memory}")
        return "{\n" + "\n".join(lines) + "\n}", ",".join(constraints)


def _written_registers(code_lines) -> set[str]:
    """Registers an instruction writes: its first operand, or a wgmma's accumulator list."""
    written = set()
    for statement in " ".join(code_lines).split(";"):
        statement = re.sub(r"^\s*@!?%\w+\s+", "", statement)  # a guard predicate is read, not written
        parts = statement.split(None, 1)
        if len(parts) < 2 or parts[0].startswith((".", "st.")):
            continue
        op, operands = parts
        if op.startswith("wgmma.mma_async"):
            written |= set(re.findall(r"%\w+", operands[operands.index("{"):operands.index("}")]))
        else:
            first = re.match(r"\s*(%\w+)", operands)
            if first:
                written.add(first.group(1))
    return written


_FUNC = re.compile(
    r"^\.visible\s+\.func\s+(?:\((?P<ret>[^)]*)\)\s*)?(?P<name>\w+)\s*\((?P<params>[^)]*)\)\s*\n\{\n"
    r"(?P<body>.*?)^\}", re.MULTILINE | re.DOTALL)
_PARAM = re.compile(r"\.param\s+\.(\w+)\s+(\w+)")
_COMPILER_REGISTER = re.compile(r"\.reg\s+\.\w+\s+[^;]*?%(?:r|rd|rs|f|fd|p|h|hh)(?:\d+\b|<\d+>)")
_MEMORY_OP = re.compile(r"\b(ld|st|cp|ldmatrix|stmatrix|wmma\.load|wmma\.store|atom|red|bar|fence|mbarrier)\.")
_PARAM_OP = re.compile(r"\b(ld|st)\.param\.")
_NUMBERED = re.compile(r"(?P<stem>[A-Za-z_]+?)(?P<i>\d+)")
_LD_PARAM = re.compile(r"ld\.param\.(\w+)\s+(%\w+),\s*\[(\w+)\];")
_ST_RETVAL = re.compile(r"st\.param\.(\w+)\s+\[func_retval0(?:\+(\d+))?\],\s*(%\w+);")


def parse(path: Path) -> dict[str, PtxFunction]:
    """Every `.visible .func` of a ptx/ file, by name."""
    text = Path(path).read_text()
    functions = {}
    for m in _FUNC.finditer(text):
        params = tuple((name, kind) for kind, name in _PARAM.findall(m.group("params")))
        for name, kind in params:
            if kind not in _TYPES:
                raise ValueError(f"{path}: {m.group('name')}: parameter {name} has type .{kind}; "
                                 f"supported: {', '.join('.' + t for t in _TYPES)}")
        clash = _COMPILER_REGISTER.search(m.group("body"))
        if clash:
            raise ValueError(f"{path}: {m.group('name')} declares register {clash.group(0)}, named like the "
                             f"compiler's own registers (%r1, %rd1, %f1, %p1 ...): on the inline route it "
                             f"would capture an asm operand; give it another name")
        stores = {}
        for line in m.group("body").splitlines():
            store = _ST_RETVAL.fullmatch(line.split("//")[0].strip())
            if store:
                stores[int(store.group(2) or 0)] = store.group(1)
        functions[m.group("name")] = PtxFunction(m.group("name"), Path(path), params,
                                                 tuple(sorted(stores.items())), m.group("body"))
    if not functions:
        raise ValueError(f"{path}: no `.visible .func` found")
    return functions


@lru_cache(maxsize=None)
def load(filename: str) -> dict[str, PtxFunction]:
    return parse(ptx_dir() / filename)


# ---------------------------------------------------------------------------------------------
# The two routes
# ---------------------------------------------------------------------------------------------
def _linked(fn: PtxFunction):
    from numba import cuda

    return cuda.declare_device(fn.name, fn.signature, link=[str(fn.path)], abi="c")


def _inlined(fn: PtxFunction, tuples: bool = False, in_place: bool = False):
    """An intrinsic of fixed arity (Numba intrinsics take no *args) emitting the body inline.

    tuples: each numbered run of parameters (frag0 .. frag31) is one tuple argument, unpacked
    into one asm operand per element.
    """
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    sig = fn.tuple_signature() if tuples else fn.signature
    counts = [n for _, _, n in fn.param_groups()] if tuples else [1] * len(fn.params)
    asm, constraints = fn.inline_asm(in_place)
    llvm = {"i16": ir.IntType(16), "i32": ir.IntType(32), "i64": ir.IntType(64), "float": ir.FloatType()}
    in_types = [llvm[_TYPES[t][2]] for _, t in fn.params]
    out_types = [llvm[_TYPES[t][2]] for _, t in fn.results]
    if not out_types:
        ret = ir.VoidType()
    elif len(out_types) == 1:
        ret = out_types[0]
    else:
        ret = ir.LiteralStructType(out_types)

    def typer(typingctx, *args):
        def codegen(context, builder, signature, llargs):
            flat = []  # a tuple argument is its elements, one asm operand each
            for value, n in zip(llargs, counts, strict=True):
                flat += [builder.extract_value(value, i) for i in range(n)] if n > 1 else [value]
            call = builder.asm(ir.FunctionType(ret, in_types), asm, constraints, flat, side_effect=True)
            if not out_types:
                return context.get_dummy_value()
            if len(out_types) == 1:
                return call
            values = [builder.extract_value(call, i) for i in range(len(out_types))]
            return context.make_tuple(builder, sig.return_type, values)

        return sig, codegen

    arg_names = ", ".join(f"arg{i}" for i in range(len(counts)))
    namespace = {"typer": typer}
    exec(f"def {fn.name}(typingctx, {arg_names}):\n    return typer(typingctx, {arg_names})\n", namespace)
    return intrinsic(namespace[fn.name])


@lru_cache(maxsize=None)
def function(filename: str, name: str, route: str = "link", tuples: bool = False, in_place: bool = False):
    """PTX function `name` of ptx/`filename`, callable from a kernel, by `route`.

    tuples (inline route only): a numbered run of parameters (frag0 .. frag31, acc0 .. acc63) is
    passed as one tuple instead of one argument each; such a function's emulation takes the tuples.
    in_place (inline route only): its registers are the asm operands themselves, an accumulator
    tied to its input (`PtxFunction._inline_in_place`), not copied in and out by a `mov` each.
    ptxas does not always fold those copies: a wgmma accumulator of 64 registers then moves
    between register ranges every tile (docs/tuning/12_history.md, "Tied accumulators").
    In the simulator both routes give the same Python emulation: there is no PTX to run.
    """
    if route not in ROUTES:
        raise ValueError(f"route: expected one of {', '.join(ROUTES)}, got {route!r}")
    if tuples and route != "inline":
        raise ValueError("tuples: only the inline route passes tuples")
    if in_place and route != "inline":
        raise ValueError("in_place: only the inline route names registers in place")
    fn = load(filename).get(name)
    if fn is None:
        raise ValueError(f"name: ptx/{filename} has no function {name!r}; it has {', '.join(load(filename))}")
    if route == "link" and (fn.leaves_in_flight or fn.awaits_in_flight):
        raise ValueError(f"route: {name} (ptx/{filename}) passes registers of a wgmma still in flight, which only "
                         f"the inline route can name in place; a call would copy them through .param space "
                         f"before the wait")
    if simulator_enabled():
        # importing them registers the emulations (they import arch/emulation.py, never this module)
        from . import sim_bulk, sim_exp2, sim_mma, sim_store, sim_tma, sim_trace, sim_wgmma, sim_warpgroup, sim_wmma  # noqa: F401

        pyfunc = registered(name)
        if pyfunc is None:
            raise NotImplementedError(f"{name} (ptx/{filename}) has no emulation for the simulator")
        return pyfunc
    return _linked(fn) if route == "link" else _inlined(fn, tuples, in_place)

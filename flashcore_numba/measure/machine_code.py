"""What the compiler made of a phase: registers, spills, shared and local memory, PTX and SASS.

No GPU is needed. Numba compiles a phase's kernel for sm_90a (the H100; numba-cuda targets
sm_90a there too) into PTX, to read, and into NVVM's LTO-IR, which nvJitLink, the linker
numba-cuda itself uses, turns into machine code as numba-cuda does when it loads the kernel: the
report describes the kernel that runs. With `-verbose` the assembler (ptxas) reports what the
kernel costs per thread:

    ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
    ptxas info    : Used 168 registers, used 1 barriers

A *spill* is a value the compiler could not keep in a register and parked in local memory
(per-thread memory that lives in DRAM, cached in L1): a phase that promises to keep its tiles
in registers must show zero spill bytes and a zero stack frame.

In Numba's simulator (NUMBA_ENABLE_CUDASIM=1) `numba.cuda` has no compiler, so `kernel_report`
then runs this module in a fresh Python process without that variable:

    python -m flashcore_numba.measure.machine_code 03 64         # the report of phase 03 at D=64, JSON
    python -m flashcore_numba.measure.machine_code 02 03 64      # several phases: {"02": ..., "03": ...}
    python -m flashcore_numba.measure.machine_code 03 64 --sass  # with SASS (needs nvdisasm or cuobjdump)

SASS, the GPU's native instructions, is disassembled from the same cubin when `nvdisasm` (or
`cuobjdump`) is found: on PATH, in a CUDA toolkit, or from the `nvidia-cuda-nvdisasm` wheel.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

def signature(config, dtype: str = "float16") -> str:
    """The kernel's signature as a launch types it (phases.common.KernelConfig.signature)."""
    return config.signature(dtype)


CC = (9, 0, "a")  # the H100, as numba-cuda compiles for it
ARCH = "sm_90a"
RESERVED_SMEM_BYTES = 1024  # shared memory the CUDA runtime reserves per block on sm_80 and newer

REPORT_KEYS = ("registers", "spill_store_bytes", "spill_load_bytes", "stack_frame_bytes", "static_smem_bytes",
               "dynamic_smem_bytes", "ptx")


# ---------------------------------------------------------------------------------------------
# Compile and assemble
# ---------------------------------------------------------------------------------------------
# the backward's kernels (no forward kernel: phases.LESSONS): phase 11's, and phase 12's kv_kernel on wgmma
BACKWARD_KERNELS = ("11-kv", "11-kv-serial", "11-delta", "11-sum", "12-kv", "12-kv-serial", "13-kv")
# phase 14's kernel, with the lesson's mods compiled in (p14_flex.kernel_views): a user's mods make kernels of their own
FLEX_KERNELS = ("14",)


def kernel_config(kernel_id: str, head_dim: int, dtype: str = "float16"):
    """What compiles a kernel id: a forward kernel's KernelConfig ("07", "06-inline"), or one of the
    backward's kernels ("11-kv", "11-kv-serial", "11-delta", "11-sum": p11_backward.kernel_views;
    "12-kv", "12-kv-serial": p12_backward_wgmma.kernel_views; "13-kv": p13_backward_ws's, in progress)."""
    from ..phases import build, get_phase

    if kernel_id in BACKWARD_KERNELS:
        from ..phases import p11_backward, p12_backward_wgmma, p13_backward_ws

        phase = {"12": p12_backward_wgmma, "13": p13_backward_ws}.get(kernel_id[:2], p11_backward)
        return phase.kernel_views(head_dim, dtype)[kernel_id]
    if kernel_id in FLEX_KERNELS:
        from ..phases import p14_flex

        return p14_flex.kernel_views(head_dim, dtype)[kernel_id]
    return build(get_phase(kernel_id), head_dim, dtype)


def _kernel_id(kernel_id) -> str:
    from ..phases import get_phase

    return kernel_id if kernel_id in BACKWARD_KERNELS + FLEX_KERNELS else get_phase(kernel_id).ID


def compile_phase_ptx(phase_id: str, head_dim: int, dtype: str = "float16") -> str:
    """PTX of a phase's kernel specialized to `head_dim` and `dtype`, for sm_90a."""
    from numba import cuda

    from ..arch.compile_speed import shared_inline_memo

    config = kernel_config(phase_id, head_dim, dtype)
    with shared_inline_memo():
        ptx, _ = cuda.compile_ptx(config.kernel.py_func, signature(config, dtype), cc=CC,
                                  launch_bounds=config.launch_bounds)
    return ptx


def compile_phase_ltoir(phase_id: str, head_dim: int, dtype: str = "float16") -> bytes:
    """The kernel as NVVM's LTO-IR: what numba-cuda hands nvJitLink when it loads a kernel."""
    from numba import cuda

    from ..arch.compile_speed import shared_inline_memo

    config = kernel_config(phase_id, head_dim, dtype)
    with shared_inline_memo():
        ltoir, _ = cuda.compile(config.kernel.py_func, signature(config, dtype), cc=CC, device=False, abi="numba",
                                output="ltoir", launch_bounds=config.launch_bounds)
    return ltoir


def compile_phase_ptx_and_ltoir(phase_id: str, head_dim: int, dtype: str = "float16") -> tuple[str, bytes]:
    """The kernel's PTX and its LTO-IR from one compile. numba-cuda's `compile` returns one or the
    other, but its code library makes either from the same LLVM IR (NVVM, in a second or two), so
    Numba's front end, most of the time (minutes for phase 09 at D = 128: typing, and inlining
    the device functions into the kernel), runs once, not once for each. The LTO-IR is the same
    code as `compile_phase_ltoir`'s (assembled, the same SASS). Where numba-cuda's library is not
    reachable this way (another version), the two compiles."""
    try:
        from numba.cuda.compiler import _compile_pyfunc_with_fixup
    except ImportError:
        return compile_phase_ptx(phase_id, head_dim, dtype), compile_phase_ltoir(phase_id, head_dim, dtype)
    from ..arch.compile_speed import shared_inline_memo

    config = kernel_config(phase_id, head_dim, dtype)
    with shared_inline_memo():
        library, _ = _compile_pyfunc_with_fixup(config.kernel.py_func, signature(config, dtype), device=False,
                                                cc=CC, abi="numba", launch_bounds=config.launch_bounds)
    (ptx,) = library.get_asm_strs(cc=CC)
    return ptx, library.get_ltoir(cc=CC)


def assemble(ptx: str | bytes, arch: str = ARCH, linked=()) -> tuple[str, bytes]:
    """Assemble PTX (or link LTO-IR, given bytes) with nvJitLink, linking the `.ptx` files in
    `linked` as a kernel on the link route does; returns (the verbose info log, the cubin).

    From PTX, nvJitLink compiles the kernel as one unit of a program that may have others, and
    ptxas then ignores `setmaxnreg` (info C7504, "to maintain compatibility across compilation
    units"): a kernel that relies on it (phase 09) is assembled from its LTO-IR, as Numba does.
    """
    from cuda.bindings import nvjitlink

    lto = isinstance(ptx, bytes)
    options = [f"-arch={arch}", "-verbose"] + (["-lto"] if lto else [])
    handle = nvjitlink.create(len(options), options)
    try:
        if lto:
            nvjitlink.add_data(handle, nvjitlink.InputType.LTOIR, ptx, len(ptx), "kernel.ltoir")
        inputs = ([] if lto else [("kernel.ptx", ptx)]) + [(Path(f).name, Path(f).read_text()) for f in linked]
        for name, text in inputs:
            data = text.encode()
            nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), name)
        try:
            nvjitlink.complete(handle)
        except Exception as exc:
            raise RuntimeError(f"nvJitLink could not assemble the PTX for {arch}:\n"
                               f"{_log(nvjitlink, handle, 'error')}") from exc
        log = _log(nvjitlink, handle, "info")
        cubin = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, cubin)
        return log, bytes(cubin)
    finally:
        nvjitlink.destroy(handle)


def find_ptxas() -> str | None:
    """A CUDA toolkit's ptxas: $FLASHCORE_PTXAS, else the one on PATH; None when there is none."""
    path = os.environ.get("FLASHCORE_PTXAS") or shutil.which("ptxas")
    return path if path and Path(path).is_file() else None


_PTX_VERSION = re.compile(r"^\.version\s+\S+", re.MULTILINE)
_PTXAS_CURRENT_VERSION = re.compile(r"Unsupported \.version \S+; current version is '([\d.]+)'")


def assemble_with_ptxas(ptx: str, ptxas: str, arch: str = ARCH) -> str:
    """Assemble PTX with a toolkit's `ptxas -v`; returns its info log (parse_resource_usage reads it).

    A second opinion on registers and spills. nvJitLink is ptxas inside a library, and each CUDA
    release allocates registers a little differently: a GPU machine whose nvJitLink is older than
    this one's may spill where this one does not (docs/tuning/07_history.md). When that older
    toolkit's ptxas is installed here, it assembles the same PTX as that machine would. The PTX
    that Numba writes may declare a newer ISA `.version` than an older ptxas accepts; it is then
    lowered to the version that ptxas names, which is enough for the kernels here, whose
    instructions all exist in that ISA (ptxas fails otherwise, and so does this function).
    """
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        for _ in range(2):
            src.write_text(ptx)
            run = subprocess.run([ptxas, f"-arch={arch}", "-v", str(src), "-o", str(out)],
                                 check=False, capture_output=True, text=True)
            if run.returncode == 0:
                return run.stdout + run.stderr
            current = _PTXAS_CURRENT_VERSION.search(run.stderr)
            if not current:
                break
            ptx = _PTX_VERSION.sub(f".version {current.group(1)}", ptx, count=1)
        raise RuntimeError(f"{ptxas} could not assemble the PTX for {arch}:\n{run.stderr}")


def _log(nvjitlink, handle, kind: str) -> str:
    size = getattr(nvjitlink, f"get_{kind}_log_size")(handle)
    buf = bytearray(size)
    if size:
        getattr(nvjitlink, f"get_{kind}_log")(handle, buf)
    return bytes(buf).rstrip(b"\0").decode(errors="replace")


_USED_REGISTERS = re.compile(r"Used (\d+) registers")
_STACK_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_BARRIERS = re.compile(r"used (\d+) barriers")
_LINKER_SMEM = re.compile(r"(\d+) bytes smem")
_STATIC_SHARED = re.compile(r"^\s*\.shared\s.*?\[(\d+)\]", re.MULTILINE)


def parse_resource_usage(log: str) -> dict:
    """registers, stack frame, spills and barriers of the (single) kernel in an nvJitLink -verbose log."""
    regs = _USED_REGISTERS.search(log)
    frame = _STACK_SPILLS.search(log)
    if regs is None or frame is None:
        raise ValueError(f"log: no 'Used N registers' / 'bytes stack frame' line in the assembler "
                         f"log:\n{log}")
    barriers = _BARRIERS.search(log)
    linker_smem = _LINKER_SMEM.search(log)
    return {
        "registers": int(regs.group(1)),
        "stack_frame_bytes": int(frame.group(1)),
        "spill_store_bytes": int(frame.group(2)),
        "spill_load_bytes": int(frame.group(3)),
        "barriers": int(barriers.group(1)) if barriers else 0,
        # the linker's figure includes the 1 KB the runtime reserves per block that uses shared memory
        "linker_smem_bytes": int(linker_smem.group(1)) if linker_smem else None,
    }


_CALLEE = re.compile(r"Function properties for (\w+)\n.*?(\d+) bytes stack frame")


def callee_frames(log: str) -> dict[str, int]:
    """Stack frame bytes of each linked `.func` in an nvJitLink -verbose log (the kernel excluded)."""
    return {name: int(frame) for name, frame in _CALLEE.findall(log) if not name.startswith("_Z")}


def static_smem_from_ptx(ptx: str) -> int:
    """Bytes of statically sized `.shared` arrays declared in the PTX (dynamic ones are `.extern`)."""
    return sum(int(n) for n in _STATIC_SHARED.findall(ptx))


# ---------------------------------------------------------------------------------------------
# Reading PTX and SASS
# ---------------------------------------------------------------------------------------------
_PTX_OPCODE = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)")
_SASS_OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s*(?:@!?U?P\w+\s+)?([A-Z][\w.]*)")


def opcode(line: str) -> str | None:
    """The instruction name of one PTX or nvdisasm/cuobjdump SASS line (None for other lines)."""
    m = _SASS_OPCODE.match(line) or _PTX_OPCODE.match(line)
    if m is None or m.group(1).startswith((".", "//")):
        return None
    return m.group(1)


def instruction_counts(text: str, patterns) -> dict[str, int]:
    """How many instructions in `text` (PTX or SASS) start with each pattern, e.g. "shfl.sync.bfly".

    These are static counts, the number of times an instruction appears in the code; a loop
    body appears once however often it runs.
    """
    counts = dict.fromkeys(patterns, 0)
    for line in text.splitlines():
        op = opcode(line)
        if op is None:
            continue
        for p in patterns:
            if op.startswith(p):
                counts[p] += 1
    return counts


_SASS_CALL = re.compile(r"\bCALL\.\S+\s+`\((\w+)\)")


def sass_calls(sass: str) -> dict[str, int]:
    """Callee -> number of SASS `CALL` sites: the linked PTX functions, and the compiler's own
    subroutines (such as the slow path of an IEEE fp32 division, present since phase 01)."""
    counts: dict[str, int] = {}
    for callee in _SASS_CALL.findall(sass):
        counts[callee] = counts.get(callee, 0) + 1
    return counts


def ptx_excerpt(ptx: str, patterns, max_lines: int = 16, context: int = 1) -> str:
    """A short excerpt: the first occurrence of each pattern with `context` lines of code around it.

    Works on SASS text too. Blank and comment lines are skipped; windows that touch are merged,
    gaps are marked with '...'; at most `max_lines` lines are returned, each with its line number.
    """
    code = [(n, line.rstrip()) for n, line in enumerate(ptx.splitlines(), start=1)
            if line.strip() and not line.strip().startswith("//")]
    hits = []
    for p in patterns:
        for i, (_, line) in enumerate(code):
            op = opcode(line)
            if op is not None and op.startswith(p):
                hits.append(i)
                break
    keep: set[int] = set()
    for i in sorted(hits):
        window = [j for j in range(max(0, i - context), min(len(code), i + context + 1)) if j not in keep]
        if len(keep) + len(window) > max_lines:
            break
        keep.update(window)
    out, previous = [], None
    for j in sorted(keep):
        if previous is not None and j != previous + 1:
            out.append("    ...")
        number, line = code[j]
        out.append(f"{number:6d}  {line}")
        previous = j
    return "\n".join(out) if out else f"(none of {', '.join(patterns)} in this code)"


def find_disassembler() -> str | None:
    """Path of nvdisasm, else cuobjdump: on PATH, in CUDA_HOME, or from the NVIDIA wheels."""
    for tool in ("nvdisasm", "cuobjdump"):
        path = shutil.which(tool)
        if path is None:
            try:
                from cuda.pathfinder import find_nvidia_binary_utility

                path = find_nvidia_binary_utility(tool)
            except (ImportError, RuntimeError, OSError):  # no cuda-pathfinder, or one without it
                path = None
        if path:
            return path
    return None


def disassemble(cubin: bytes) -> str | None:
    """SASS of a cubin, or None when no disassembler is installed."""
    tool = find_disassembler()
    if tool is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        nvdisasm = Path(tool).name.startswith("nvdisasm")
        args = [tool, "-c", str(path)] if nvdisasm else [tool, "-sass", str(path)]
        done = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------
def _report_here(phase_id: str, head_dim: int, sass: bool, dtype: str = "float16") -> dict:
    kernel_id = _kernel_id(phase_id)
    config = kernel_config(kernel_id, head_dim, dtype)
    # assembled from its LTO-IR, as numba-cuda loads every kernel (LTO is its default wherever
    # nvJitLink is): the machine code that runs. From the PTX, ptxas allocates differently (06-inline
    # at D = 64: 149 registers from the PTX, 168 from the LTO-IR, as the driver reports for the kernel
    # launched) and ignores setmaxnreg (see assemble)
    ptx, ltoir = compile_phase_ptx_and_ltoir(kernel_id, head_dim, dtype)
    log, cubin = assemble(ltoir, linked=config.ptx_files)
    if kernel_id in BACKWARD_KERNELS + FLEX_KERNELS:
        name = config.kernel.py_func.__name__
    else:
        from ..phases import get_phase

        name = get_phase(kernel_id).NAME
    report = {"phase": kernel_id, "name": name,
              "head_dim": head_dim, "dtype": dtype, "arch": ARCH}
    report.update(parse_resource_usage(log))
    # the link route: which ptx/ files were linked, and the stack frame of each function called
    report["linked_ptx"] = [Path(f).name for f in config.ptx_files]
    report["callee_frames"] = callee_frames(log)
    report["static_smem_bytes"] = static_smem_from_ptx(ptx)
    report["dynamic_smem_bytes"] = config.smem_bytes
    report["n_threads"] = config.n_threads
    report["ptx"] = ptx
    report["assembler_log"] = log
    report["sass"] = disassemble(cubin) if sass else None
    return report


def _report_kept(phase_id: str, head_dim: int, sass: bool, dtype: str = "float16") -> dict:
    """`_report_here`, kept on disk beside the kernel cache (arch/cache.py, `reports/`): compiling
    phase 09 for sm_90a takes a minute or two on a laptop core, and a lesson, `flashcore run` and
    the tests ask for the same reports again. The key hashes everything the report depends on:
    the kernels' source, this file, the toolchain, the phase, head dim and dtype. A report is
    stored with its SASS whenever a disassembler is found, and handed out without it when not
    asked for. One process compiles a key at a time (a lock file, where the platform has flock);
    another asking for it meanwhile waits and reads it. An entry that does not parse or names
    another key is compiled again. FLASHCORE_CACHE=0 keeps nothing."""
    import hashlib

    from ..arch.cache import cache_dir, locked, source_fingerprint, toolchain, write_whole

    folder = cache_dir()
    if folder is None:
        return _report_here(phase_id, head_dim, sass, dtype)
    with_sass = sass or find_disassembler() is not None
    fields = {"phase": phase_id, "head_dim": int(head_dim), "dtype": dtype, "arch": ARCH, "sass": with_sass,
              "source": source_fingerprint(), "reporter": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
              "toolchain": toolchain()}
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:40]
    path = folder / "reports" / f"{key}.json"
    with locked(path.with_suffix(".lock")):
        try:
            kept = json.loads(path.read_text(encoding="utf-8"))
            report = kept["report"] if kept.get("key") == key else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            report = None
        if report is None:
            report = _report_here(phase_id, head_dim, with_sass, dtype)
            write_whole(path, json.dumps({"key": key, "fields": fields, "report": report}).encode())
    return report if sass else dict(report, sass=None)


def compiler_env(**extra) -> dict:
    """The environment of a fresh interpreter that compiles for real: this one's without the
    simulator, with this checkout importable (and `extra` set)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    package_parent = str(Path(__file__).resolve().parents[2])  # the checkout holding flashcore_numba/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    return {**env, **extra}


def _in_subprocess(phase_ids, head_dim: int, sass: bool, dtype: str) -> dict[str, dict]:
    """Run this module in a fresh interpreter that compiles for real (no simulator)."""
    env = compiler_env()
    args = [sys.executable, "-m", "flashcore_numba.measure.machine_code", *phase_ids, str(head_dim), "--many",
            "--dtype", dtype]
    if sass:
        args.append("--sass")
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"compiling phases {', '.join(phase_ids)} in a subprocess failed:\n{done.stderr}")
    return json.loads(done.stdout)


@cache
def _reports(phase_ids: tuple, head_dim: int, sass: bool, dtype: str) -> dict:
    from ..arch.sim import simulator_enabled

    if simulator_enabled():
        return _in_subprocess(phase_ids, head_dim, sass, dtype)
    return {p: _report_kept(p, head_dim, sass, dtype) for p in phase_ids}


def kernel_reports(phase_ids, head_dim: int, *, sass: bool = False, dtype: str = "float16") -> dict[str, dict]:
    """`kernel_report` of several phases at once (one subprocess in the simulator)."""
    ids = tuple(_kernel_id(p) for p in phase_ids)
    reports = _reports(ids, int(head_dim), bool(sass), dtype)
    return {p: dict(reports[p]) for p in ids}


def kernel_report(phase_id, head_dim: int, *, sass: bool = False, dtype: str = "float16") -> dict:
    """What one phase's kernel costs per thread and per block, compiled for sm_90a.

    Keys: registers, spill_store_bytes, spill_load_bytes, stack_frame_bytes (per thread);
    static_smem_bytes (from the PTX's `.shared` declarations), dynamic_smem_bytes (what the
    phase launches with, `build(D).smem_bytes`), n_threads, barriers, linker_smem_bytes
    (static + the runtime's 1 KB reservation); linked_ptx and callee_frames (the ptx/ files a
    link-route kernel calls into, and each called function's stack frame); ptx, assembler_log, and sass (text, or None
    when not asked for or no disassembler is installed).
    """
    (report,) = kernel_reports([phase_id], head_dim, sass=sass, dtype=dtype).values()
    return report


# ---------------------------------------------------------------------------------------------
# Occupancy: how many blocks of a kernel fit on one SM of an H100
# ---------------------------------------------------------------------------------------------
H100_SM = {"registers": 65536, "smem_bytes": 228 * 1024, "threads": 2048, "blocks": 32,
           "register_granularity": 256}


def occupancy(report: dict, sm: dict = H100_SM) -> dict:
    """Resident blocks per SM and what limits them, from a kernel report (registers, smem, threads)."""
    n_threads = report["n_threads"]
    warps = -(-n_threads // 32)
    gran = sm["register_granularity"]
    regs_per_warp = -(-report["registers"] * 32 // gran) * gran
    smem = report["dynamic_smem_bytes"] + report["static_smem_bytes"]
    smem_per_block = smem + RESERVED_SMEM_BYTES if smem else 0
    limits = {
        "registers": sm["registers"] // (regs_per_warp * warps) if regs_per_warp else sm["blocks"],
        "shared memory": sm["smem_bytes"] // smem_per_block if smem_per_block else sm["blocks"],
        "threads": sm["threads"] // n_threads,
        "blocks": sm["blocks"],
    }
    blocks = min(limits.values())
    return {"blocks_per_sm": blocks, "limited_by": min(limits, key=limits.get), "limits": limits,
            "warps_per_sm": blocks * warps, "occupancy": blocks * warps / (sm["threads"] // 32)}


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m flashcore_numba.measure.machine_code",
                                     description="Registers, spills, shared memory and PTX of a phase's "
                                                 "kernel, compiled for sm_90a without a GPU (JSON).")
    parser.add_argument("phases", nargs="+", help="phase ids, then the head dim: 03 64  or  02 03 64")
    parser.add_argument("--sass", action="store_true", help="include SASS (needs nvdisasm or cuobjdump)")
    parser.add_argument("--many", action="store_true", help="always print {phase: report}")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="float16")
    args = parser.parse_args(argv)
    if len(args.phases) < 2 or not args.phases[-1].isdigit():
        parser.error("expected one or more phase ids followed by the head dim, e.g. 03 64")
    *ids, head_dim = args.phases
    reports = kernel_reports(ids, int(head_dim), sass=args.sass, dtype=args.dtype)
    json.dump(reports if args.many or len(reports) > 1 else next(iter(reports.values())), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

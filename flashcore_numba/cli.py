"""`flashcore`: the command line of the course.

    flashcore run        walk the phase ladder: check and time every phase on a GPU, or check
                         every phase in Numba's CUDA simulator when there is no GPU
    flashcore bench      the benchmark protocol; writes a JSON record to docs/bench/
    flashcore report     regenerate the README's headline, docs/performance.md, the plots and the
                         phase docstrings' "Measured effect" from the committed records
    flashcore compile    compile kernels ahead of time into the kernel cache (arch/cache.py)
    flashcore doctor     is this machine ready? one line per check, with the fix
    flashcore grade      grade an exercise (flashcore_numba.course.grade)
    flashcore lessons    the notebooks (flashcore_numba.course.lessons)

Mistakes in the arguments get one line naming the option and exit status 2, never a traceback
(usage.py: the form every command shares). `python -m flashcore_numba ...` is the same command.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from pathlib import Path

from .arch.sim import kernel_target, rerun_in_simulator
from .measure.records import CheckoutNeeded
from .phases import KERNELS, LESSONS, PHASES, get_phase
from .usage import Parser, usage_error

MIN_REPEATS = 20  # the protocol: median of at least 20 timed runs
SIM_SHAPE = (1, 1, 48, 64)  # one 64-row tile, 48 keys: a tail on every phase; a few seconds each
DELEGATED = {"grade": "flashcore_numba.course.grade", "lessons": "flashcore_numba.course.lessons"}
# the last line of `flashcore run`: where a student goes from here
NEXT_STEP = ("Next: open lessons/00_numba_cuda.ipynb (from the repository's root: "
             "`jupyter lab --notebook-dir=. lessons/00_numba_cuda.ipynb`) or run `flashcore grade 00` "
             "to grade its puzzles; lessons/README.md is the course map.")
# the same step where the package was installed from a wheel, with no lessons/ beside it
NEXT_STEP_INSTALLED = ("Next: the lessons and their graded exercises come with a source checkout of "
                       "flashcore-numba, which an installed package does not hold: clone the repository and "
                       "run `pip install -e \".[course]\"` in it.")
SIM_DISCLAIMER = ("Simulator timings mean nothing: every CUDA thread ran as a Python thread on the CPU. "
                  "Run `flashcore run` on a GPU to time the phases.")


class CLIError(Exception):
    """A mistake the user can fix: printed as one line by `usage_error`, exit status 2."""


def next_step() -> str:
    from .measure.records import checkout_root

    return NEXT_STEP if checkout_root() is not None else NEXT_STEP_INSTALLED


# ---------------------------------------------------------------------------------------------
# Argument types: each error says what was expected and what was given (argparse adds the
# option's name in front: "argument --shape: expected ...")
# ---------------------------------------------------------------------------------------------
def _positive_ints(text: str, count: int | None = None) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",")]
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if not values or any(v <= 0 for v in values) or (count is not None and len(values) != count):
        what = "a positive integer" if count == 1 else "positive integers separated by commas"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    return _positive_ints(text, 1)[0]


def parse_shape(text: str) -> tuple[int, int, int, int]:
    try:
        return _positive_ints(text, 4)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected B,H,S,D (four positive integers, e.g. 16,16,2048,64), "
                                         f"got {text!r}") from None


def parse_phases(text: str) -> list[str]:
    if text.strip() == "all":
        return list(KERNELS)
    ids = []
    for part in text.split(","):
        try:
            ids.append(get_phase(part.strip()).ID)
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("phase: ")) from None
    return ids


def parse_compile_ids(text: str) -> list[str]:
    """`flashcore compile --phases`: the ladder's kernel ids (parse_phases) and the extra kernels'
    ("10-kvcache", "07-varlen", "09-varlen", "11": runtime/precompile.py)."""
    from .runtime.precompile import EXTRA_KERNELS, kernel_ids

    if text.strip() == "all":
        return kernel_ids()
    ids = []
    for part in (p.strip() for p in text.split(",")):
        try:
            ids += [part] if part in EXTRA_KERNELS else parse_phases(part)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} (or one of {', '.join(EXTRA_KERNELS)})") from None
    return ids


def parse_dtypes(text: str) -> tuple[str, ...]:
    names = {"fp16": "float16", "bf16": "bfloat16", "float16": "float16", "bfloat16": "bfloat16"}
    parts = [p.strip() for p in text.split(",")]
    if not all(p in names for p in parts):
        raise argparse.ArgumentTypeError(f"expected fp16, bf16 or both separated by a comma, got {text!r}")
    return tuple(dict.fromkeys(names[p] for p in parts))


def parse_cc(text: str) -> tuple[int, int]:
    major, _, minor = text.strip().partition(".")
    if not (major.isdigit() and minor.isdigit()):
        raise argparse.ArgumentTypeError(f"expected a compute capability such as 9.0, got {text!r}")
    return int(major), int(minor)


def parse_peers(text: str) -> list[str]:
    from .measure.bench import PEER_NAMES, PEERS

    if text.strip() == "none":
        return []
    names = []
    for part in text.split(","):
        name = PEER_NAMES.get(part.strip(), part.strip())
        name = name if name in PEERS or name.startswith("sdpa_") else f"sdpa_{name}"
        if name not in PEERS:
            known = ", ".join([*(n.removeprefix("sdpa_") for n in PEERS if n.startswith("sdpa_")), *PEER_NAMES])
            raise argparse.ArgumentTypeError(f"unknown peer {part!r}; expected none or some of {known}")
        names.append(name)
    return names


def _build_parser() -> Parser:
    parser = Parser(prog="flashcore", description="FlashAttention in Numba CUDA, one phase at a time.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = sub.add_parser("run", help="walk the phase ladder: check (and on a GPU, time) every phase")
    run.add_argument("--shape", type=parse_shape, help="B,H,S,D (GPU default 16,16,2048,64; "
                     "simulator default 1,1,48,64)")
    run.add_argument("--causal", action="store_true",
                     help="causal mask (the simulator checks both by default)")
    run.add_argument("--repeats", type=_positive_int, default=20,
                     help="timed launches per kernel (GPU)")
    run.set_defaults(handler=cmd_run)

    bench = sub.add_parser("bench", help="benchmark phases and torch SDPA; write a JSON record")
    bench.add_argument("--phases", type=parse_phases,
                       help="comma-separated phase ids, e.g. 01,03 (default: all)")
    bench.add_argument("--shape", type=parse_shape, default=None, help="B,H,S,D (default 16,16,2048,64)")
    bench.add_argument("--causal", action="store_true", help="causal mask")
    bench.add_argument("--seq-k", type=_positive_int, default=None, metavar="S_K",
                       help="keys per sequence when they differ from the queries' S (e.g. decode: S=1)")
    bench.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    bench.add_argument("--kv-heads", type=_positive_int, default=None,
                       help="K/V heads, fewer than H for grouped-query attention (default: H)")
    bench.add_argument("--value-dim", type=_positive_int, default=None, metavar="D_V",
                       help="v's (and the output's) head dim where it is not D's, as MLA's 128 beside D = 192 "
                            "(phase 07 and the SDPA backends that take it)")
    bench.add_argument("--sweep", action="store_true",
                       help="run S = 512 .. 16384 (powers of two), keeping B*S of --shape")
    bench.add_argument("--sweep-s", type=_positive_ints, default=None,
                       help="the sequence lengths of --sweep, e.g. 512,1024,2048 (implies --sweep)")
    bench.add_argument("--repeats", type=_positive_int, default=100,
                       help=f"kernel-time launches per kernel, each after an L2 flush (at least {MIN_REPEATS})")
    bench.add_argument("--tail", type=_positive_int, default=None, metavar="N",
                       help="also N device-only launches back to back per kernel, counting those above "
                            "1.5x their median (at most about 5 s of GPU time per kernel)")
    bench.add_argument("--calls", type=_positive_int, default=None, metavar="N",
                       help="also N calls of attention() back to back per kernel (the call time; torch only)")
    bench.add_argument("--cap-seconds", type=float, default=5.0, metavar="S",
                       help="--tail and --calls: at most about S seconds of GPU time per kernel (default 5)")
    bench.add_argument("--warmup", type=_positive_int, default=3)
    bench.add_argument("--peers", type=parse_peers, default=None,
                       help="peers to compare: torch SDPA's backends flash,cudnn,efficient,math (the "
                            "default; --backward: flash,cudnn), and flex (FlexAttention, torch.compile'd: a "
                            "compile per shape first, so never a default), or none")
    bench.add_argument("--varlen", type=lambda t: _positive_ints(t, 3), default=None, metavar="N,LO,HI",
                       help="packed sequences (attention_varlen): N of random lengths LO..HI, H and D from "
                            "--shape, beside a dense batch of as many tokens and SDPA on the padded batch; "
                            "the record goes to docs/bench/varlen/")
    bench.add_argument("--backward", action="store_true",
                       help="the backward pass (phase 11, attention()'s autograd) on --shape beside SDPA's flash "
                            "and cuDNN backward (--peers flash,cudnn,flex adds FlexAttention's), and one "
                            "training step each; the record goes to docs/bench/backward/ (with --flex: each "
                            "case's backward too, beside FlexAttention's, in the flex record)")
    bench.add_argument("--flex", action="store_true",
                       help="phase 14 (flex_attention) beside torch's FlexAttention (torch.compile'd) with the "
                            "same mods: a sliding window, softcap, ALiBi, a document mask and causal as a "
                            "mask_mod (beside attention(causal=True)) on --shape; the record goes to "
                            "docs/bench/flex/ (--peers none: phase 14's rows alone)")
    bench.add_argument("--cases", type=_flex_cases, default=None, metavar="CASE,...",
                       help="--flex: only these of its cases (sliding_window, softcap, alibi, documents, "
                            "causal_mask), e.g. sliding_window,causal_mask at a long S")
    bench.add_argument("--kvcache", type=lambda t: _positive_ints(t, 3), default=None, metavar="B,LO,HI",
                       help="a decode step against a KV cache (attention_kvcache): B sequences of random lengths "
                            "LO..HI, one query row each, H and D from --shape, H_kv from --kv-heads; contiguous "
                            "and paged (--page-sizes); the record goes to docs/bench/kvcache/")
    bench.add_argument("--serving", action="store_true",
                       help="a decode step as a serving loop calls it: attention_kvcache (contiguous and paged), "
                            "attention() and SDPA's backends at every --batches x --caches, H and D from --shape, "
                            "H_kv from --kv-heads; kernel time, call time and host time with the GPU busy; one "
                            "record per point in docs/bench/serving/")
    bench.add_argument("--batches", type=_positive_ints, default=(1, 8, 64, 256),
                       help="--serving: the batch sizes (default 1,8,64,256)")
    bench.add_argument("--caches", type=_positive_ints, default=(1024, 4096, 32768),
                       help="--serving: the keys each sequence holds (default 1024,4096,32768)")
    bench.add_argument("--page-sizes", type=_positive_ints, default=(64, 256),
                       help="--kvcache: the paged caches' page sizes, multiples of 16 (default 64,256)")
    bench.add_argument("--first-call", action="store_true",
                       help="the first attention() call of new processes with the kernel cache warm (and with "
                            "--cold, empty): import, first and second call, for each of --phases (default: "
                            "attention()'s own choice); the record goes to docs/bench/first_call/")
    bench.add_argument("--processes", type=_positive_int, default=3,
                       help="--first-call: new processes per phase and cache (default 3)")
    bench.add_argument("--cold", action="store_true",
                       help="--first-call: also with an empty kernel cache in each process (each compiles)")
    bench.add_argument("--out", type=Path, help="record file (default docs/bench/<gpu>_<shape>.json)")
    bench.set_defaults(handler=cmd_bench)

    comp = sub.add_parser("compile", help="compile kernels ahead of time into the kernel cache")
    comp.add_argument("--phases", type=parse_compile_ids, default=None,
                      help="comma-separated kernel ids, e.g. 09,09-ws, or 10-kvcache, 07-varlen, 09-varlen, "
                           "09-trace, 11 (the backward) and 12 (its kv_kernel on wgmma: what attention()'s autograd "
                           "runs on Hopper; nothing to compile elsewhere) (default: all of them)")
    comp.add_argument("--head-dims", type=_positive_ints, default=(64, 128), help="e.g. 64,128 (default both)")
    comp.add_argument("--value-dims", type=_positive_ints, default=(),
                      help="v's head dims of their own, e.g. --head-dims 192 --value-dims 128 (MLA): also the "
                           "forward kernels of the phases that take the pair (07, 09, 07-varlen, 09-varlen)")
    comp.add_argument("--dtypes", type=parse_dtypes, default=("float16", "bfloat16"),
                      help="fp16, bf16 or both, comma-separated (default both)")
    comp.add_argument("--jobs", type=_positive_int, default=None,
                      help="kernels compiled at once, one process each (default: the CPU count)")
    comp.add_argument("--cc", type=parse_cc, default=None,
                      help="compute capability to compile for, e.g. 9.0 (default: this GPU's; needed without one)")
    comp.set_defaults(handler=cmd_compile)

    report = sub.add_parser("report", help="regenerate the README's headline, docs/performance.md, the plots "
                                           "and the phase docstrings")
    report.add_argument("--records", type=Path, default=None,
                        help="directory of records (default docs/bench)")
    report.add_argument("--readme", type=Path, default=None, help="README to update (default README.md)")
    report.add_argument("--performance", type=Path, default=None,
                        help="page of the full tables to update (default docs/performance.md beside the README)")
    report.set_defaults(handler=cmd_report)

    doctor = sub.add_parser("doctor", help="check this machine: GPU, driver, packages, simulator")
    doctor.set_defaults(handler=cmd_doctor)

    # grade and lessons belong to other modules; they take their own arguments (see main)
    sub.add_parser("grade", help="grade an exercise (flashcore grade --help)", add_help=False)
    sub.add_parser("lessons", help="the notebook lessons (flashcore lessons --help)", add_help=False)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        return _delegate(argv[0], argv[1:])
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a bad argument already reported in one line
        return e.code if isinstance(e.code, int) else 2
    args.argv = argv
    try:
        return int(args.handler(args) or 0)
    except (CLIError, CheckoutNeeded) as e:
        return usage_error(f"flashcore {args.command}", str(e))
    except KeyboardInterrupt:
        print(f"flashcore {args.command}: interrupted", file=sys.stderr)
        return 130


def _delegate(name: str, argv) -> int:
    module_name = DELEGATED[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        return usage_error(f"flashcore {name}", f"{module_name} is not part of this installation")
    try:
        return int(module.main(argv) or 0)
    except CheckoutNeeded as e:
        return usage_error(f"flashcore {name}", str(e))


def _console(width=None):
    from rich.console import Console

    return Console(width=width)


def _text(value) -> str:
    """Escape text from results (reasons, messages) for rich: "pip install '.[torch]'" must
    print as is, not lose "[torch]" as a markup tag."""
    from rich.markup import escape

    return escape(str(value))


def _progress(console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=True)


# ---------------------------------------------------------------------------------------------
# flashcore run
# ---------------------------------------------------------------------------------------------
def cmd_run(args) -> int:
    target = kernel_target()
    if target == "none":
        print("No CUDA GPU found: checking every phase in Numba's CUDA simulator on the CPU instead.",
              flush=True)
        return rerun_in_simulator("flashcore_numba", args.argv)
    if target == "simulator":
        return _run_simulator(args)
    return _run_gpu(args)


def _run_simulator(args) -> int:
    from .measure import backward, bench
    from .measure import flex as flex_bench

    console = _console()
    shape = args.shape or SIM_SHAPE
    modes = (True,) if args.causal else (False, True)
    device = bench.NumbaDevice()
    verdicts = {}  # (phase id, causal) -> Result
    # the ladder, then the phases of the course that are no rung of it: 11, 12 and 13 (checked by their
    # gradients) and 14 (with mods and a mask)
    course = {**PHASES, **{pid: m for pid, m in LESSONS.items()
                            if getattr(m, "BACKWARD", False) or getattr(m, "MODS", False)}}
    with _progress(console) as progress:
        task = progress.add_task("simulator", total=len(course) * len(modes))
        for causal in modes:
            problem = bench.Problem.from_shape(shape, causal=causal)
            host_qkv, qkv = device.inputs(problem, seed=None)
            ref, lowp, _ = device.oracle(host_qkv, qkv, problem)
            for phase in PHASES.values():
                progress.update(task, description=f"phase {phase.ID} {'causal' if causal else 'non-causal'}")
                verdicts[phase.ID, causal], _ = bench.check_phase(phase, device, qkv, problem, ref, lowp)
                progress.advance(task)
            # phases 11, 12 and 13, the backward: their gradients of the same problem (fresh inputs of that shape)
            for pid, module in course.items():
                if pid not in PHASES:
                    progress.update(task, description=f"phase {pid} {'causal' if causal else 'non-causal'}")
                    verdicts[pid, causal] = (flex_bench.check_flex(problem) if getattr(module, "MODS", False)
                                             else backward.check_backward(problem, phase=pid))
                    progress.advance(task)

    console.print(_simulator_table(verdicts, shape, modes, course))
    console.print(_err_legend(verdicts), soft_wrap=True, highlight=False)
    failed = [key for key, r in verdicts.items() if r.available and not r.correct]
    skipped = [key for key, r in verdicts.items() if not r.available]
    for pid, causal in skipped + failed:  # what does not fit a cell, under the table
        mode = "causal" if causal else "non-causal"
        r = verdicts[pid, causal]
        why = _text(r.message) if r.available else f"skipped, {_text(r.reason)}"
        console.print(f"phase {pid} ({mode}): {why}", soft_wrap=True)
    if failed:
        console.print(f"{len(failed)} of {len(verdicts)} checks INCORRECT in the simulator.")
    elif skipped:
        console.print(f"Every phase that ran is correct in the simulator; {len(skipped)} checks skipped.")
    else:
        console.print(f"All {len(course)} phases correct in the simulator "
                      f"({', '.join('causal' if c else 'non-causal' for c in modes)}).")
    console.print(SIM_DISCLAIMER, soft_wrap=True)
    console.print(next_step(), soft_wrap=True, markup=False, highlight=False)
    return 1 if failed else 0


def _simulator_table(verdicts, shape, modes, course):
    """The simulator's verdicts, a row per phase and a column per mode (`verdicts[phase id, causal]`
    are Results), in the look of the GPU table; a cell too narrow wraps between words, never cutting
    a number."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    B, H, S, D = shape
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("phase", no_wrap=True)
    for causal in modes:
        table.add_column("causal" if causal else "non-causal", overflow="fold")
    for phase in course.values():
        table.add_row(f"{phase.ID} {phase.NAME}", *(_verdict_cell(verdicts[phase.ID, c]) for c in modes))
    # the title above the table, not in it: a table one mode wide would wrap it
    title = f"Phase ladder in the CUDA simulator: B={B} H={H} S={S} D={D} fp16"
    return Group(Text(title, style="table.title"), table)


def _err_legend(verdicts) -> str:
    """What the table's "err" is measured against, and the errors the oracle allowed in this run."""
    allowed = sorted(r.allowed_err for r in verdicts.values() if r.available and r.allowed_err is not None)
    here = ""
    if allowed:
        span = f"{allowed[0]:.1e}" if allowed[0] == allowed[-1] else f"{allowed[0]:.1e} to {allowed[-1]:.1e}"
        here = f" (here {span})"
    return ("err: the largest absolute difference from the float64 reference over every output element "
            "(phases 11, 12 and 13: over dq, dk and dv, from the float64 gradients; phase 14: with a soft-cap and "
            "a mask, from the float64 reference with the same mods). A phase is correct when err "
            "is at most its allowed error, FlashAttention's test oracle: twice the error of the same problem "
            "computed in plain fp16, plus 0.001 (for a gradient, plus 0.001 of its largest value)" + here + ".")


def _verdict_cell(result) -> str:
    if not result.available:
        return "[yellow]skipped[/yellow]"  # the reason is printed under the table
    if result.correct:
        return f"[green]correct[/green] (err {result.max_err:.1e})"
    return "[red]INCORRECT[/red]"


def _run_gpu(args) -> int:
    from .measure import bench

    console = _console()
    problem = bench.Problem.from_shape(args.shape or bench.REFERENCE_SHAPE, causal=args.causal)
    device = bench.open_device()
    peers = ["sdpa_flash", "sdpa_cudnn"] if device.kind == "torch" else []
    timing = bench.Timing(warmup=2, repeats=args.repeats)
    with _progress(console) as progress:
        task = progress.add_task("run", total=1 + len(KERNELS) + len(peers))

        def step(label):
            progress.update(task, description=label, advance=1)

        results, _, _ = bench.bench_problem(problem, list(KERNELS.values()), peers, device, timing,
                                            progress=step)
    results = [r.to_dict() for r in results]
    console.print(_results_table(results, f"Phase ladder on {device.name}: {problem.describe()}",
                                 vs_peers=peers))
    if device.kind != "torch":
        console.print(f"No SDPA comparison: {_text(device.no_peers_reason)}.", soft_wrap=True)
    console.print("A quick look; `flashcore bench` measures with the full protocol and writes a record.",
                  soft_wrap=True)
    console.print(next_step(), soft_wrap=True, markup=False, highlight=False)
    wrong = [r for r in results if r["kind"] == "phase" and r["available"] and not r["correct"]]
    return 1 if wrong else 0


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------
def _short_name(r) -> str:
    """"06-inline wmma-inline", "SDPA flash": a table cell that fits an 80-column log (titles are in
    the phase docstrings, the README and the lessons)."""
    if r["kind"] == "phase":
        try:
            return f"{r['name']} {get_phase(r['name']).NAME}"
        except (ValueError, TypeError):  # a record from another version of the ladder
            return r["name"]
    return "SDPA " + r["name"].removeprefix("sdpa_") if r["name"].startswith("sdpa_") else r["name"]


def _sig3(value) -> str:
    """3 significant digits, without exponents: 0.535, 6.31, 47.5, 452, 1234."""
    if value is None:
        return "—"
    if abs(value) >= 999.5:
        return f"{value:.0f}"
    return f"{value:#.3g}".rstrip(".")  # "#" keeps the zeros of 1.00; "100." loses its point


class _FitToWidth:
    """A renderable laid out when it is printed, for the width it is given (a terminal's, or 80
    columns in a log): `layout(console, options)` yields what to print."""

    def __init__(self, layout):
        self.layout = layout

    def __rich_console__(self, console, options):
        yield from self.layout(console, options)


def _results_table(results, title, *, vs_peers=(), resources=False, bandwidth=False, ladder=True):
    """One problem's results (dicts as in a record) for rich: the title, a table with one line
    per kernel, and under it what does not fit a cell. With `bandwidth` (a decode step, bound by
    reading K and V, not by FLOPs), GB/s and the share of the copy's bandwidth come after TFLOPS. Every number is printed whole at the
    width it gets: a kernel whose "id name" is too long is named by its id alone, and where
    that is not enough the least needed columns are left out, last first (local B, smem B,
    regs, %peak, the SDPA columns from the last, × prev), and named under the table. ladder=False:
    rows that are not rungs of one ladder (--flex: a row per mask), no "× prev" column."""
    from .measure.bench import format_tflops, ladder_speedups

    speedups = ladder_speedups(results) if ladder else {}
    peer_tflops = {r["name"]: r.get("tflops") for r in results if r["kind"] == "peer"}

    def speedup(r):
        prev = speedups.get(r["name"])
        return "" if prev is None else f"[red]{prev[1]:.2f}×[/red]" if prev[1] < 1 else f"{prev[1]:.2f}×"

    def vs_peer(peer):
        def cell(r):
            base = peer_tflops.get(peer)
            ratio = r["tflops"] / base if r.get("tflops") and base and r["kind"] == "phase" else None
            return "" if ratio is None else f"{_sig3(100 * ratio)}%"
        return cell

    def smem(r):
        static, dynamic = r.get("static_smem_bytes") or 0, r.get("dynamic_smem_bytes") or 0
        return str(static + dynamic) if r["kind"] == "phase" else ""

    def optional(key):
        return lambda r: "" if r.get(key) is None else str(r[key])

    # (header, the cell of an available result, when to leave it out: the higher, the sooner; 0 never)
    columns = [("ms", lambda r: _sig3(r.get("median_ms")), 0),
               ("TFLOPS", lambda r: format_tflops(r.get("tflops")), 0)] + ([("× prev", speedup, 1)] if ladder else [])
    if bandwidth and any(r.get("gb_per_s") is not None for r in results):
        columns.append(("GB/s", lambda r: "" if r.get("gb_per_s") is None else f"{r['gb_per_s']:.0f}", 3))
        if any(r.get("pct_of_bandwidth") is not None for r in results):
            columns.append(("%bw", lambda r: "" if r.get("pct_of_bandwidth") is None
                            else f"{r['pct_of_bandwidth']:.1f}%", 3))
    if resources and any(r.get("pct_of_ceiling") is not None for r in results):
        columns.append(("%peak", lambda r: "" if r.get("pct_of_ceiling") is None
                        else f"{r['pct_of_ceiling']:.1f}%", 4))
    columns += [(f"% {peer.removeprefix('sdpa_')}", vs_peer(peer), 2 + i) for i, peer in enumerate(vs_peers)]
    if resources:
        columns += [("regs", optional("registers"), 10), ("smem B", smem, 11),
                    ("local B", optional("local_bytes_per_thread"), 12)]

    rows, notes = [], []  # rows: (label, label by id alone, cells, check)
    for r in results:
        label = _text(_short_name(r))
        short = _text(r["name"]) if r["kind"] == "phase" else label
        if not r["available"]:
            rows.append((label, short, ["—"] * len(columns), "[yellow]n/a[/yellow]"))
            notes.append(f"{_short_name(r)}: n/a, {_text(r['reason'])}")
            continue
        prev = speedups.get(r["name"])
        if prev and prev[1] < 1:
            notes.append(f"{_short_name(r)}: SLOWER than {prev[0]}")
        if not r["correct"]:
            notes.append(f"{_short_name(r)}: FAILED, {_text(r['message'])}")
        rows.append((label, short, [cell(r) for _, cell, _ in columns],
                     "[green]ok[/green]" if r["correct"] else "[red]FAILED[/red]"))

    def table(kept, labels):
        from rich import box
        from rich.table import Table

        t = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
        t.add_column("kernel", no_wrap=True)
        for i in kept:
            t.add_column(columns[i][0], justify="right", no_wrap=True)
        t.add_column("check", no_wrap=True)
        for name, (_, _, cells, check) in zip(labels, rows):
            t.add_row(name, *(cells[i] for i in kept), check)
        return t

    def layout(console, options):
        from rich.measure import Measurement
        from rich.text import Text

        def excess(t):  # columns over the width, the table unwrapped
            return Measurement.get(console, options.update_width(10_000), t).maximum - options.max_width

        def cells(markup):
            return Text.from_markup(markup).cell_len

        by_need = sorted((i for i, c in enumerate(columns) if c[2]), key=lambda i: -columns[i][2])
        for n_left_out in range(len(by_need) + 1):
            kept = [i for i in range(len(columns)) if i not in by_need[:n_left_out]]
            labels = [label for label, *_ in rows]
            over = excess(t := table(kept, labels))
            if over > 0:  # the labels too long for what is left are given by id alone
                fits = max(map(cells, labels), default=0) - over
                labels = [label if cells(label) <= fits else short for label, short, *_ in rows]
                over = excess(t := table(kept, labels))
            if over <= 0:
                break
        headers = [columns[i][0] for i in kept]
        legend = ["× prev: speed over the kernel above"] if "× prev" in headers else []
        if peers := [h for h in headers if h.startswith("% ")]:
            legend.append(f"{', '.join(peers)}: of torch SDPA's backends")
        if "%peak" in headers:
            legend.append("%peak: of the tensor-core ceiling")
        if "GB/s" in headers:
            legend.append("GB/s: K and V read once" + (", %bw: of the copy's bandwidth" * ("%bw" in headers)))
        if left_out := [c[0] for i, c in enumerate(columns) if i not in kept]:
            legend.append(f"left out to fit {options.max_width} columns: {', '.join(left_out)}")
        yield Text(title, style="table.title")  # above the table, not in it: wrapped at its width
        yield t
        for line in ["; ".join(legend)] * bool(legend) + notes:  # one line per kernel
            yield Text.from_markup(line, style="table.caption")

    return _FitToWidth(layout)


def _sweep_table(record, title):
    from rich.table import Table

    from .measure.bench import format_tflops

    table = Table(title=title)
    table.add_column("Kernel (TFLOPS)")
    for point in record["sweep"]:
        table.add_column(f"S={point['S']}\nB={point['B']}", justify="right")
    names = [(r["name"], r["title"], r["kind"]) for r in record["sweep"][0]["results"]]
    for name, title_, kind in names:
        cells = []
        for point in record["sweep"]:
            r = next((x for x in point["results"] if x["name"] == name), None)
            if r is None or not r["available"]:
                cells.append("n/a")
            elif not r["correct"]:
                cells.append("[red]FAILED[/red]")
            else:
                cells.append(format_tflops(r["tflops"]))
        table.add_row(_text(f"{name} {title_}" if kind == "phase" else title_), *cells)
    return table


# ---------------------------------------------------------------------------------------------
# flashcore bench
# ---------------------------------------------------------------------------------------------
def cmd_bench(args) -> int:
    if args.repeats < MIN_REPEATS:
        raise CLIError(f"--repeats: the benchmark protocol times at least {MIN_REPEATS} runs, got "
                       f"{args.repeats} (`flashcore run --repeats N` is the quick look)")
    if not args.cap_seconds > 0:
        raise CLIError(f"--cap-seconds: expected a positive number of seconds, got {args.cap_seconds}")
    if args.seq_k is not None and (args.sweep or args.sweep_s):
        raise CLIError("--seq-k: a sweep keeps S_q = S_k; drop one of the two")
    if args.cold and not args.first_call:
        raise CLIError("--cold: an empty kernel cache for the first call of new processes; only with --first-call")
    if args.cases and not args.flex:
        raise CLIError("--cases: the cases of --flex; only with --flex")
    target = kernel_target()
    if target != "gpu":
        why = ("the CUDA simulator is on (NUMBA_ENABLE_CUDASIM)" if target == "simulator"
               else "no CUDA GPU found")
        raise CLIError(f"{why}; benchmarks need a GPU, and simulator timings mean nothing. "
                       f"`flashcore run` checks every phase on the CPU.")
    from .measure import bench, records

    dtype = bench.DTYPES[args.dtype]
    shape = args.shape or bench.REFERENCE_SHAPE
    if args.kv_heads is not None and shape[1] % args.kv_heads:
        raise CLIError(f"--kv-heads {args.kv_heads}: must divide the {shape[1]} query heads of --shape")
    problem = bench.Problem.from_shape(shape, dtype=dtype, causal=args.causal, kv_heads=args.kv_heads,
                                       value_dim=args.value_dim)
    if problem.D_v is not None and (args.first_call or args.backward or args.varlen or args.kvcache
                                    or args.serving):
        raise CLIError("--value-dim: the forward's benchmark only (one head dim for q, k and v elsewhere)")
    if args.seq_k is not None:
        problem = dataclasses.replace(problem, S_k=args.seq_k)
    if args.first_call:
        return _bench_first_call(args, bench, dtype, shape)
    if args.flex:  # before --backward: --flex --backward adds each case's backward to the flex record
        return _bench_flex(args, bench, records, problem)
    if args.backward:
        return _bench_backward(args, bench, records, problem)
    if args.varlen:
        return _bench_varlen(args, bench, records, dtype, shape)
    if args.kvcache:
        return _bench_kvcache(args, bench, records, dtype, shape)
    if args.serving:
        return _bench_serving(args, bench, records, dtype, shape)
    phase_ids = args.phases or list(KERNELS)
    peers = list(bench.DEFAULT_PEERS) if args.peers is None else args.peers
    sweep = args.sweep_s or (bench.SWEEP_S if args.sweep else None)
    device = bench.open_device()
    if dtype != "float16" and device.kind != "torch":
        raise CLIError(f"--dtype {args.dtype}: needs torch with CUDA (NumPy has no bfloat16): "
                       f"{device.no_peers_reason}")
    timing = bench.Timing(warmup=args.warmup, repeats=args.repeats, tail=args.tail or 0, calls=args.calls or 0,
                          cap_seconds=args.cap_seconds)
    n_points = len(sweep) if sweep else 1
    console = _console()
    with _progress(console) as progress:
        task = progress.add_task("bench", total=1 + n_points * (1 + len(phase_ids) + len(peers)))

        def step(label):
            progress.update(task, description=label, advance=1)

        record = bench.run_benchmark(problem, phase_ids=phase_ids, peer_names=peers, timing=timing,
                                     sweep_lengths=sweep, command=["flashcore", *args.argv],
                                     progress=step, device=device)
    gpu = record["provenance"]["gpu_name"]
    from .api import DECODE_ROWS  # a decode step: few query rows per K/V head, bound by reading K and V

    decode = not sweep and problem.S_q * problem.H // problem.heads_kv <= DECODE_ROWS
    if sweep:
        console.print(_sweep_table(record, f"{gpu}: sweep over S, B·S = {problem.B * problem.S_q}, "
                                           f"H={problem.H} D={problem.D} {args.dtype}"
                                           + (" causal" if problem.causal else "")))
    else:
        # the full table (registers, shared and local memory) needs more than 80 columns: in a log
        # (no terminal to measure) it is printed 132 wide; a narrower terminal gets kernels named
        # by id and, if need be, columns left out (said under the table), never a number cut
        wide = console if console.is_terminal else _console(width=132)
        wide.print(_results_table(record["results"], f"{gpu}: {problem.describe()}", resources=True,
                                  bandwidth=decode))
    if record.get("bandwidth_gb_per_s") and decode:
        console.print(f"Bandwidth ceiling, same run: {_text(record['bandwidth']['what'])} = "
                      f"{record['bandwidth_gb_per_s']:.0f} GB/s", soft_wrap=True)
    if record.get("ceiling_tflops"):
        console.print(f"Tensor-core ceiling, same run: {_text(record['ceiling']['what'])} = "
                      f"{record['ceiling_tflops']:.0f} TFLOPS", soft_wrap=True)
    path = args.out or records.default_record_path(gpu, problem, sweep=bool(sweep), phase_ids=phase_ids)
    records.write_record(record, path)
    console.print(f"Record written to {path}; `flashcore report` regenerates the README and plots.",
                  soft_wrap=True)
    results = [r for p in record.get("sweep", [record]) for r in p["results"]]
    wrong = [r for r in results if r["kind"] == "phase" and r["available"] and not r["correct"]]
    return 1 if wrong else 0


def _flex_cases(text: str) -> tuple[str, ...]:
    """--cases: names of `flashcore bench --flex`'s cases, comma-separated."""
    from .measure.flex import CASES

    cases = tuple(c.strip() for c in text.split(",") if c.strip())
    unknown = [c for c in cases if c not in CASES]
    if not cases or unknown:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(CASES)}, got {text!r}")
    return cases


def _bench_flex(args, bench, records, problem) -> int:
    """`flashcore bench --flex` (measure/flex.py)."""
    from .measure import flex

    if args.sweep or args.sweep_s or args.phases or args.varlen or args.kvcache or args.causal:
        raise CLIError("--flex: one problem, its cases' own masks; drop --sweep, --phases, --varlen, --kvcache "
                       "and --causal (the case causal_mask is causal)")
    if problem.S_q != problem.S_k:
        raise CLIError("--flex: the cases' masks are of S_q = S_k; drop --seq-k")
    device = bench.open_device()
    if device.kind != "torch":
        raise CLIError(f"--flex: needs torch with CUDA: {device.no_peers_reason}")
    timing = bench.Timing(warmup=args.warmup, repeats=args.repeats, calls=args.calls or 0,
                          cap_seconds=args.cap_seconds)
    peers = args.peers is None or bool(args.peers)
    console = _console()
    with _progress(console) as progress:
        cases = args.cases or flex.CASES
        task = progress.add_task("bench", total=len(cases))

        def step(label):
            progress.update(task, description=label, advance=1)

        record = flex.run_flex_benchmark(problem, cases=cases, peers=peers, timing=timing, device=device,
                                         command=["flashcore", *args.argv], progress=step, backward=args.backward)
    return _write_pass_record(args, console, records, record, f"flex, {problem.describe()}",
                              flex.record_path(record["provenance"]["gpu_name"], problem), "", ladder=False)


def _bench_backward(args, bench, records, problem) -> int:
    """`flashcore bench --backward` (measure/backward.py)."""
    from .measure import backward

    if args.sweep or args.sweep_s or args.phases or args.varlen or args.kvcache:
        raise CLIError("--backward: one problem, the backward's own rows; drop --sweep, --phases, --varlen and "
                       "--kvcache")
    device = bench.open_device()
    if device.kind != "torch":
        raise CLIError(f"--backward: needs torch with CUDA: {device.no_peers_reason}")
    peers = list(backward.BACKWARD_PEERS) if args.peers is None else args.peers
    timing = bench.Timing(warmup=args.warmup, repeats=args.repeats, calls=args.calls or 0,
                          cap_seconds=args.cap_seconds)
    console = _console()
    with _progress(console) as progress:
        task = progress.add_task("bench", total=4 + 2 * len(peers))

        def step(label):
            progress.update(task, description=label, advance=1)

        record = backward.run_backward_benchmark(problem, peer_names=peers, timing=timing, device=device,
                                                 command=["flashcore", *args.argv], progress=step)
    return _write_pass_record(args, console, records, record, f"backward, {problem.describe()}",
                              backward.record_path(record["provenance"]["gpu_name"], problem),
                              "; `flashcore report` regenerates the README")


def _write_pass_record(args, console, records, record, what: str, default_path, then: str, ladder=True) -> int:
    """The table of a record of one pass (--backward, --flex), its FLOPs rule, the record written (to
    --out or `default_path`); 1 where a phase's row failed its oracle. ladder: _results_table's."""
    gpu = record["provenance"]["gpu_name"]
    wide = console if console.is_terminal else _console(width=132)
    wide.print(_results_table(record["results"], f"{gpu}: {what}", resources=False, ladder=ladder))
    console.print(_text(record["flops_rule"]), soft_wrap=True)
    path = args.out or default_path
    records.write_record(record, path)
    console.print(f"Record written to {path}{then}.", soft_wrap=True)
    wrong = [r for r in record["results"] if r["kind"] == "phase" and r["available"] and not r["correct"]]
    return 1 if wrong else 0


def _bench_varlen(args, bench, records, dtype, shape) -> int:
    """`flashcore bench --varlen N,LO,HI` (measure/varlen.py)."""
    from .measure import varlen

    n, lo, hi = args.varlen
    if lo > hi:
        raise CLIError(f"--varlen: the shortest length {lo} is above the longest {hi}")
    if args.seq_k is not None or args.sweep or args.sweep_s or args.kv_heads is not None:
        raise CLIError("--varlen: packed sequences have S_q = S_k per sequence and as many K/V heads as query "
                       "heads here; drop --seq-k, --sweep and --kv-heads")
    device = bench.open_device()
    if device.kind != "torch":
        raise CLIError(f"--varlen: needs torch with CUDA: {device.no_peers_reason}")
    phase_ids = args.phases or list(varlen.VARLEN_PHASES)
    if any(p not in varlen.VARLEN_PHASES for p in phase_ids):
        raise CLIError(f"--phases: packed sequences run on phases {', '.join(varlen.VARLEN_PHASES)}")
    peers = list(varlen.VARLEN_PEERS) if args.peers is None else args.peers
    timing = bench.Timing(warmup=args.warmup, repeats=args.repeats)
    console = _console()
    with _progress(console) as progress:
        task = progress.add_task("bench", total=2 + 2 * len(phase_ids) + len(peers))

        def step(label):
            progress.update(task, description=label, advance=1)

        record = varlen.run_varlen_benchmark(n, lo, hi, H=shape[1], D=shape[3], dtype=dtype, causal=args.causal,
                                             phase_ids=phase_ids, peer_names=peers, timing=timing, device=device,
                                             command=["flashcore", *args.argv], progress=step)
    gpu = record["provenance"]["gpu_name"]
    c = record["config"]
    wide = console if console.is_terminal else _console(width=132)
    wide.print(_results_table(record["results"], f"{gpu}: {n} packed sequences of {lo}..{hi} "
                              f"({c['packed_tokens']} tokens), H={c['H']} D={c['D']} {args.dtype}"
                              + (" causal" if c["causal"] else ""), resources=True))
    path = args.out or varlen.record_path(gpu, n, lo, hi, c["H"], c["D"], dtype, c["causal"])
    records.write_record(record, path)
    console.print(f"Record written to {path}; `flashcore report` regenerates the README.", soft_wrap=True)
    wrong = [r for r in record["results"] if r["kind"] == "phase" and r["available"] and not r["correct"]]
    return 1 if wrong else 0


def _bench_kvcache(args, bench, records, dtype, shape) -> int:
    """`flashcore bench --kvcache B,LO,HI` (measure/kvcache.py)."""
    from .measure import kvcache

    B, lo, hi = args.kvcache
    if lo > hi:
        raise CLIError(f"--kvcache: the shortest length {lo} is above the longest {hi}")
    if bad := [p for p in args.page_sizes if p % 16]:
        raise CLIError(f"--page-sizes: {bad[0]} is not a multiple of 16")
    if args.seq_k is not None or args.sweep or args.sweep_s or args.causal or args.phases:
        raise CLIError("--kvcache: one query row per sequence against its cache, causal, phase 10; drop --seq-k, "
                       "--sweep, --causal and --phases")
    H, D = shape[1], shape[3]
    H_kv = args.kv_heads or H
    if H % H_kv:
        raise CLIError(f"--kv-heads {H_kv}: must divide the {H} query heads of --shape")
    device = bench.open_device()
    if device.kind != "torch":
        raise CLIError(f"--kvcache: needs torch with CUDA: {device.no_peers_reason}")
    timing = bench.Timing(warmup=args.warmup, repeats=args.repeats)
    console = _console()
    with _progress(console) as progress:
        task = progress.add_task("bench", total=2 + len(args.page_sizes))

        def step(label):
            progress.update(task, description=label, advance=1)

        record = kvcache.run_kvcache_benchmark(B, lo, hi, H=H, H_kv=H_kv, D=D, dtype=dtype,
                                               page_sizes=args.page_sizes, timing=timing, device=device,
                                               command=["flashcore", *args.argv], progress=step)
    gpu = record["provenance"]["gpu_name"]
    wide = console if console.is_terminal else _console(width=132)
    wide.print(_results_table(record["results"], f"{gpu}: decode step, {B} caches of {lo}..{hi} keys, H={H} "
                              f"H_kv={H_kv} D={D} {args.dtype}", resources=True, bandwidth=True))
    console.print(f"Bandwidth ceiling, same run: {_text(record['bandwidth']['what'])} = "
                  f"{record['bandwidth_gb_per_s']:.0f} GB/s", soft_wrap=True)
    path = args.out or kvcache.record_path(gpu, B, lo, hi, H, H_kv, D, dtype)
    records.write_record(record, path)
    console.print(f"Record written to {path}; `flashcore report` regenerates the README.", soft_wrap=True)
    return 1 if any(r["available"] and not r["correct"] for r in record["results"]) else 0


def _bench_serving(args, bench, records, dtype, shape) -> int:
    """`flashcore bench --serving` (measure/serving.py): one record per (batch, cache)."""
    from .measure import serving

    if args.seq_k is not None or args.sweep or args.sweep_s or args.causal or args.phases or args.varlen:
        raise CLIError("--serving: one query row per sequence against its whole cache; drop --seq-k, --sweep, "
                       "--causal, --phases and --varlen")
    H, D = (shape[1], shape[3]) if args.shape else (32, 128)
    H_kv = args.kv_heads or (8 if not args.shape else H)
    if H % H_kv:
        raise CLIError(f"--kv-heads {H_kv}: must divide the {H} query heads of --shape")
    device = bench.open_device()
    if device.kind != "torch":
        raise CLIError(f"--serving: needs torch with CUDA: {device.no_peers_reason}")
    timing = bench.Timing(warmup=args.warmup, repeats=args.repeats)
    console = _console()
    wide = console if console.is_terminal else _console(width=150)
    failed = False
    for B in args.batches:
        for S in args.caches:
            with _progress(console) as progress:
                task = progress.add_task("bench", total=None)
                record = serving.run_serving_point(B, S, H=H, H_kv=H_kv, D=D, dtype=dtype, timing=timing,
                                                   calls=args.calls or 200, device=device,
                                                   command=["flashcore", *args.argv],
                                                   progress=lambda label: progress.update(task, description=label))
            gpu = record["provenance"]["gpu_name"]
            wide.print(serving_table(record, f"{gpu}: decode step, B={B}, {S} keys each, H={H} H_kv={H_kv} D={D} "
                                             f"{args.dtype}"))
            path = serving.record_path(gpu, B, S, H, H_kv, D, dtype) if args.out is None else \
                args.out.with_name(f"{args.out.stem}_b{B}_s{S}{args.out.suffix}")
            records.write_record(record, path)
            console.print(f"Record written to {path}.", soft_wrap=True)
            failed |= any(r["available"] and not r["correct"] for r in record["results"])
    return 1 if failed else 0


def serving_table(record, title: str):
    """A serving record's rows: kernel time, call time (median, p99, host) and host time while the GPU
    is busy, in us."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in ("row", "kernel", "call", "call p99", "host", "host, GPU busy", "busy p99", "verdict"):
        table.add_column(column, justify="left" if column in ("row", "verdict") else "right")
    for r in record["results"]:
        if not r["available"] or not r["correct"]:
            table.add_row(r["name"], *[""] * 6, _text(r.get("reason") or r.get("message") or ""))
            continue
        c = r["call"]
        table.add_row(r["name"], f"{r['median_ms'] * 1e3:.1f}", f"{c['median_ms'] * 1e3:.1f}",
                      f"{c['p99_ms'] * 1e3:.1f}", f"{c['host_median_us']:.1f}", f"{c['busy_host_median_us']:.1f}",
                      f"{c['busy_host_p99_us']:.1f}", "correct")
    return table


def _bench_first_call(args, bench, dtype, shape) -> int:
    """`flashcore bench --first-call` (measure/first_call.py)."""
    from .measure import first_call

    if args.seq_k is not None or args.sweep or args.sweep_s or args.varlen or args.kvcache or args.backward:
        raise CLIError("--first-call: attention() on one problem of --shape; drop --seq-k, --sweep, --varlen, "
                       "--kvcache and --backward")
    device = bench.open_device()
    if device.kind != "torch":
        raise CLIError(f"--first-call: needs torch with CUDA: {device.no_peers_reason}")
    phases = args.phases or [None]
    console = _console()
    with _progress(console) as progress:
        task = progress.add_task("bench", total=len(phases) * (1 + args.processes * (2 if args.cold else 1)))

        def step(label):
            progress.update(task, description=label, advance=1)

        try:
            record = first_call.run_first_call_benchmark(shape, phases=phases, causal=args.causal, dtype=dtype,
                                                         kv_heads=args.kv_heads, processes=args.processes,
                                                         cold=args.cold, device=device,
                                                         command=["flashcore", *args.argv], progress=step)
        except RuntimeError as e:
            raise CLIError(f"--first-call: {e}") from None
    for r in record["results"]:
        console.print(f"{r['phase'] or 'attention()'}, {r['cache']} cache: first call {r['first_call_s']:.3f} s "
                      f"(import {r['import_s']:.2f} s, second call {1e3 * r['second_call_s']:.2f} ms), median of "
                      f"{len(r['runs'])} new processes{'' if r['ok'] else '; WRONG OUTPUT'}", soft_wrap=True)
    path = args.out or first_call.record_path(record["provenance"]["gpu_name"], record["config"], phases)
    first_call.write(record, path)
    console.print(f"Record written to {path}; `flashcore report` regenerates the README.", soft_wrap=True)
    return 0 if all(r["ok"] for r in record["results"]) else 1


# ---------------------------------------------------------------------------------------------
# flashcore compile
# ---------------------------------------------------------------------------------------------
def cmd_compile(args) -> int:
    import os

    if kernel_target() == "simulator":
        raise CLIError("the CUDA simulator is on (NUMBA_ENABLE_CUDASIM): it has no compiler to fill the cache with")
    from .arch.cache import cache_dir
    from .runtime import precompile

    folder = cache_dir()
    if folder is None:
        raise CLIError("FLASHCORE_CACHE=0 switches the kernel cache off: there is nowhere to compile to")
    cc = args.cc
    if cc is None:
        if kernel_target() != "gpu":
            raise CLIError("--cc: no CUDA GPU here to read the compute capability from; name it, e.g. --cc 9.0")
        from numba import cuda

        cc = tuple(cuda.get_current_device().compute_capability)[:2]
    items = precompile.kernels_to_compile(args.phases or precompile.kernel_ids(), args.head_dims, args.dtypes,
                                          args.value_dims)
    if not items:
        raise CLIError("no kernel matches --phases, --head-dims, --value-dims and --dtypes")
    jobs = min(args.jobs or os.cpu_count() or 1, len(items))
    console = _console()
    console.print(f"Compiling {len(items)} kernels for compute capability {cc[0]}.{cc[1]} into {folder}, "
                  f"{jobs} at a time.", soft_wrap=True)
    with _progress(console) as progress:
        task = progress.add_task("compile", total=len(items))

        def done(item, result):
            progress.update(task, advance=1, description=_compile_item(item))

        results = precompile.compile_all(items, cc, jobs, done)
    built = sum(r is True for _, r in results)
    failed = [(item, r) for item, r in results if isinstance(r, str)]
    console.print(f"{built} compiled, {len(results) - built - len(failed)} already in the cache, "
                  f"{len(failed)} failed.", soft_wrap=True)
    for item, message in failed:
        console.print(f"  {_compile_item(item)}: {_text(message)}", soft_wrap=True)
    return 1 if failed else 0


def _compile_item(item) -> str:
    """'09 D=192 float16', or with v's head dim of its own '09 D=192 D_v=128 float16'."""
    kernel_id, head_dim, dtype, *value_dim = item
    return f"{kernel_id} D={head_dim}" + (f" D_v={value_dim[0]}" if value_dim else "") + f" {dtype}"


# ---------------------------------------------------------------------------------------------
# flashcore report, flashcore doctor
# ---------------------------------------------------------------------------------------------
def cmd_report(args) -> int:
    from .course import exercises
    from .measure import report

    if args.records is not None and not args.records.is_dir():
        raise CLIError(f"--records: {args.records} is not a directory")
    try:
        summary = report.generate(records_dir=args.records, readme=args.readme, performance=args.performance)
    except report.ReportError as e:
        raise CLIError(str(e)) from None
    # the exercise stubs copy the phase sources, whose docstrings the report may just have changed
    summary += [f"{path}: exercise stub regenerated" for path in exercises.write_all()]
    for line in summary:
        print(line)
    return 0


def cmd_doctor(args) -> int:
    from .measure import doctor

    return doctor.main()

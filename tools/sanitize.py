"""Run every GPU kernel under compute-sanitizer (memcheck, racecheck, synccheck) at small shapes with
tails; write one log per tool under docs/sanitizer/ and fail on any error.

    python tools/sanitize.py                         # every kernel, every tool
    python tools/sanitize.py --kernels 06,07 --tools racecheck
    python tools/sanitize.py --backward --out docs/sanitizer/11   # the backward's kernels (11; 12 on Hopper)
    python tools/sanitize.py --inference --out docs/sanitizer/inference   # varlen, kvcache

`--report-api-errors no`: cuda-bindings probes the driver with calls that fail by design
(cuGetProcAddress of entry points this driver lacks); those are not errors of the kernels.
Each tool runs one child process (`--child`) that launches every kernel on every shape and checks
its output against the float64 reference, so a log also says that the kernels ran and were right
(--inference: tools/sanitize_inference.py, whose outputs the GPU tests check).

Before the tools run, `flashcore compile` puts the kernels the children launch in the kernel
cache (all cores at once), and the children load them from there: a kernel compiled inside a
child runs its compiler under the sanitizer, minutes where loading takes a second. With the cache
off (FLASHCORE_CACHE=0) the children compile, and --backward's last case, kv_kernel built for
sm_80 (its dQ by scalar `red`), compiles in each child.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("memcheck", "racecheck", "synccheck")
# the children's persistent grids (common.sm_count_override); --inference's script keeps the GPU's own
# count, so its decode steps split their keys as on the whole GPU (warps with no keys too)
CHILD_SMS = 2
# (B, H, S_q, S_k, D, causal): tails everywhere, S_q != S_k both ways, rows without keys, D 64 and 128.
# The 400-key shapes reach every loop of phase 09's consumers: at D = 128 tiles 1 and 2 in the loop
# without masks and tile 3 in the masked one; at D = 64, causal, the 192-row blocks also stream tiles
# that their first consumers' rows never see, and those consumers pass them (PASS_UNSEEN)
# The last two are decode steps: phase 10 splits their keys (its blocks' partials, the count, the merge)
SHAPES = ((1, 2, 77, 50, 64, True), (1, 1, 130, 130, 128, False), (2, 1, 33, 65, 64, True),
          (1, 1, 70, 70, 128, True), (1, 1, 200, 400, 128, False), (1, 1, 400, 400, 64, True),
          (2, 4, 1, 1000, 64, False), (1, 2, 3, 700, 128, True))


def child(kernel_ids) -> int:
    import numpy as np
    from numba import cuda

    from flashcore_numba import check_close, lowp_attention, reference_attention
    from flashcore_numba.phases import KERNELS, build
    from flashcore_numba.phases.common import LOG2E
    from flashcore_numba.reference import default_scale, random_qkv

    failed = 0
    for kid in kernel_ids:
        kernel = KERNELS[kid]
        for B, H, Sq, Sk, D, causal in SHAPES:
            if D not in kernel.HEAD_DIMS:
                continue
            q, k, v = random_qkv((B, H, Sq, D), Sk, seed=0)
            out = cuda.to_device(np.full(q.shape, np.nan, np.float16))
            build(kernel, D).launch(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), out, causal,
                                    default_scale(D) * LOG2E)
            cuda.synchronize()
            verdict = check_close(out.copy_to_host(), reference_attention(q, k, v, causal=causal),
                                  lowp_attention(q, k, v, causal=causal))
            failed += not verdict.ok
            print(f"kernel {kid} B={B} H={H} S_q={Sq} S_k={Sk} D={D} causal={causal}: "
                  f"{'ok' if verdict.ok else 'WRONG'} ({verdict.message})", flush=True)
    return 1 if failed else 0


# The backward (--backward): (B, H, H_kv, S_q, S_k, D, causal), fp16, each with dQ by reductions and
# deterministic (the serial build; with more than one part where there are fewer heads than SMs): tails, S_q != S_k both ways (rows that see no key), GQA, one query
# tile of kv_kernel crossing the group's next head. The last two run sm_80's dQ reductions (one float
# per instruction) on this GPU too, the last as a GeForce RTX card gets it at D = 64: one dSᵀ buffer,
# dQ behind a barrier of its own (p11_backward.ds_buffers_for).
BACKWARD_SHAPES = ((1, 2, 2, 77, 50, 64, True), (1, 2, 1, 130, 130, 128, False), (2, 4, 2, 33, 65, 64, True),
                   (1, 1, 1, 200, 70, 128, True), (1, 2, 1, 150, 150, 64, False))


def child_backward() -> int:
    from numba import cuda

    from flashcore_numba.measure.backward import check_backward
    from flashcore_numba.measure.bench import Problem
    from flashcore_numba.phases import backward_phase, cc_reason

    failed = 0
    cases = [(shape, det, None, "11") for shape in BACKWARD_SHAPES for det in (False, True)]
    cases += [(BACKWARD_SHAPES[0], False, (8, 0), "11"), (BACKWARD_SHAPES[0], False, (8, 6), "11")]
    if cc_reason(backward_phase("12"), cuda.get_current_device().compute_capability) is None:  # Hopper: phase 12 too
        cases += [(shape, det, None, "12") for shape in BACKWARD_SHAPES for det in (False, True)]
    for (B, H, H_kv, Sq, Sk, D, causal), det, cc, phase in cases:
        problem = Problem(B, H, Sq, Sk, D, causal=causal, H_kv=H_kv)
        result = check_backward(problem, seed=0, deterministic=det, cc=cc, phase=phase)
        failed += not result.correct
        how = "deterministic" if det else "reductions" + (f", built for sm_{cc[0]}{cc[1]}" if cc else "")
        print(f"backward {phase} B={B} H={H} H_kv={H_kv} S_q={Sq} S_k={Sk} D={D} causal={causal} ({how}): "
              f"{'ok' if result.correct else 'WRONG'} ({result.message})", flush=True)
    return 1 if failed else 0


def is_clean(text: str) -> bool:
    """A sanitizer's summary with nothing in it: memcheck's and synccheck's "ERROR SUMMARY: 0 errors",
    racecheck's "0 hazards displayed (0 errors, 0 warnings)" (its warnings are hazards too)."""
    return "ERROR SUMMARY: 0 errors" in text or "RACECHECK SUMMARY: 0 hazards displayed" in text


INFERENCE_KERNELS = ("10-kvcache", "07-varlen", "09-varlen")  # what tools/sanitize_inference.py launches


def kernels_to_prepare(args, ids) -> list[str]:
    """The `flashcore compile` ids of what the children launch (runtime/precompile.py)."""
    if args.backward:
        return ["11", "12"]
    if args.inference:
        return list(INFERENCE_KERNELS)
    return list(ids)


def prepare(kernel_ids, env) -> None:
    """Compile the children's kernels into the kernel cache first (see the docstring), by `flashcore
    compile` in the children's environment; where it cannot (no GPU, the cache off) it says why and
    the children compile theirs."""
    cmd = [sys.executable, "-m", "flashcore_numba", "compile", "--phases", ",".join(kernel_ids),
           "--head-dims", "64,128", "--dtypes", "fp16"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    said = (done.stdout + done.stderr).strip().splitlines()
    print(f"kernel cache: {said[-1] if said else ''}" + ("" if done.returncode == 0 else
          " (not compiled ahead: the children compile under the sanitizer)"), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", help="comma-separated kernel ids (default: every kernel, variants too)")
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated sanitizer tools")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "sanitizer", help="folder for the logs")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--backward", action="store_true",
                       help="phase 11's backward kernels instead (BACKWARD_SHAPES; --out docs/sanitizer/11)")
    which.add_argument("--inference", action="store_true",
                       help="attention_varlen's and attention_kvcache's kernels instead "
                            "(tools/sanitize_inference.py; --out docs/sanitizer/inference)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from flashcore_numba.measure.records import git_state
    from flashcore_numba.phases import KERNELS

    if args.child and args.inference:
        parser.error("--child: runs the forward kernels or, with --backward, phase 11's; "
                     "--inference runs tools/sanitize_inference.py")
    if args.kernels and (args.backward or args.inference):
        parser.error("--kernels: names forward kernels; --backward and --inference run kernels of their own")
    ids = args.kernels.split(",") if args.kernels else list(KERNELS)
    unknown = [k for k in ids if k not in KERNELS]
    if unknown:
        parser.error(f"--kernels: unknown {', '.join(unknown)}; known: {', '.join(KERNELS)}")
    if args.child:
        # phase 09's persistent grid on two blocks, each taking several query blocks (the library's
        # own grid has a block per SM, which these small shapes would leave mostly idle)
        from flashcore_numba.phases import common

        common.sm_count_override = CHILD_SMS
        return child_backward() if args.backward else child(ids)
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        parser.error("compute-sanitizer is not on PATH (it comes with the CUDA toolkit)")
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    prepare(kernels_to_prepare(args, ids), env)
    worst = 0
    for tool in args.tools.split(","):
        head = [sanitizer, "--tool", tool, "--report-api-errors", "no", "--error-exitcode", "99",
                sys.executable]
        if args.inference:
            script, rest = ROOT / "tools" / "sanitize_inference.py", []
        else:
            mode = ["--backward"] if args.backward else ["--kernels", ",".join(ids)]
            script, rest = Path(__file__), ["--child", *mode]
        cmd = [*head, str(script), *rest]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        log = args.out / f"{tool}.log"
        shown = ["compute-sanitizer", *head[1:7], "python", f"tools/{script.name}", *rest]
        log.write_text(f"$ {' '.join(shown)}\n"
                       f"code at commit {git_state()['git_commit']}\n"
                       f"{done.stdout}{done.stderr}exit status {done.returncode}\n")
        clean = done.returncode == 0 and is_clean(done.stdout + done.stderr)
        print(f"{tool}: {'clean' if clean else 'ERRORS (or wrong output)'}, {log}", flush=True)
        worst = max(worst, 0 if clean else 1)
    return worst


if __name__ == "__main__":
    raise SystemExit(main())

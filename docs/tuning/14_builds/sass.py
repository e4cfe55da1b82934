"""What a mod costs in machine code, without a GPU: phase 14's build on phase 09 (what flex_attention
runs on an H100) for one mod at a time, compiled for sm_90a as Numba loads it (arch/launch.build_cubin:
NVVM's LTO-IR through nvJitLink), disassembled (nvdisasm: on PATH or from the nvidia-cuda-nvdisasm
wheel), its instructions counted by opcode beside the build without mods. Every score of every
tile runs the mod's instructions, so at D = 64, where a tile's products are short, they are what
the consumer warpgroups spend their issue slots on.

    python3 docs/tuning/14_builds/sass.py 64 none alibi softcap window documents causal --out X.json

Each case compiles in one to three minutes on one core. The JSON holds, per case, the count of
instructions, registers and spills, and its opcodes; the table printed last, the counts beside
the build without mods ("none", which must be among the cases for the differences).
"""

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def build_case(D: int, case: str, H: int = 16, S: int = 4096):
    """(config, argtypes) of phase 14 on 09 with the case's built-in mods, typed as a call would type
    them (the block mask's lists and the mods' arrays, here NumPy arrays of the same types)."""
    from numba.cuda.core import sigutils

    from flashcore_numba import flex
    from flashcore_numba.arch.smem import argument_types
    from flashcore_numba.phases import p14_flex as p14

    mods = {"none": (None, None), "alibi": (flex.alibi(np.asarray(flex.alibi_slopes(H), np.float32)), None),
            "softcap": (flex.softcap(50.0), None), "window": (None, flex.sliding_window(1024)),
            "causal": (None, flex.causal_mask()),
            "documents": (None, flex.document_mask(np.zeros((1, S), np.int32)))}
    smod, mmod = mods[case]
    config = p14.build_for(D, "float16", smod, mmod, "09")
    tile = p14.tiles(D, "09")
    kinds = flex.kernel_kinds(None, mmod, 1, H, S, S, tile["block_m"], tile["block_n"], False)
    stand_in = (np.zeros(1, np.float32),)
    tail = (*p14.hopper_lists(kinds, S, tile["block_n"]), kinds,
            tuple(smod.host_arrays()) if smod is not None and smod.arrays else stand_in,
            tuple(mmod.host_arrays()) if mmod is not None and mmod.arrays else stand_in)
    head = tuple(sigutils.normalize_signature(config.signature("float16"))[0])
    return config, head + argument_types(config.kernel, tail)


def opcodes(sass: str) -> collections.Counter:
    counts = collections.Counter()
    for line in sass.splitlines():
        code = line.split("*/", 1)[1] if "*/" in line else line
        m = re.match(r"\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)[ ;]", code)
        if m:
            counts[m.group(1)] += 1
    return counts


def report(D: int, case: str) -> dict:
    from flashcore_numba.arch.launch import build_cubin
    from flashcore_numba.measure import machine_code

    config, argtypes = build_case(D, case)
    start = time.time()
    cubin, _ = build_cubin(config.kernel, argtypes, (9, 0))
    seconds = time.time() - start
    tool = machine_code.find_disassembler()
    if tool is None:
        raise SystemExit("no nvdisasm: pip install nvidia-cuda-nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout
    ops = opcodes(sass)
    return dict(case=case, D=D, instructions=sum(ops.values()), compile_seconds=round(seconds),
                opcodes=dict(ops.most_common()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("D", type=int)
    parser.add_argument("cases", nargs="+")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from flashcore_numba.measure.records import git_state, package_version

    rows = [report(args.D, case) for case in args.cases]
    if args.out:
        code = dict(git_state(), numba_cuda=package_version("numba-cuda"))
        args.out.write_text(json.dumps(dict(code=code, rows=rows), indent=1) + "\n")
    base = next((r for r in rows if r["case"] == "none"), None)
    print(f"{'case':<10} {'instructions':>12} {'beside none':>12}  most added")
    for r in rows:
        added = "" if base is None else ", ".join(
            f"{op} {r['opcodes'].get(op, 0) - base['opcodes'].get(op, 0):+d}" for op in sorted(
                set(r["opcodes"]) | set(base["opcodes"]),
                key=lambda op: -abs(r["opcodes"].get(op, 0) - base["opcodes"].get(op, 0)))[:5])
        extra = "" if base is None else f"{r['instructions'] - base['instructions']:+d}"
        print(f"{r['case']:<10} {r['instructions']:>12} {extra:>12}  {added}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Numba's inliner with one deepcopy memo per inlined call, A/B against numba-cuda 0.30.4 as it is.

numba-cuda's InlineWorker.inline_ir copies the callee's IR block by block, each block with a
deepcopy of its own: every block's copy drags a copy of the callee's whole Scope (every variable)
with it, and the blocks end up with equal but separate scopes. Here the copies of one inline_ir
call share one memo, so the callee's blocks share one copied Scope, as the callee's own blocks do.
The first run patched Numba in this script's processes (`patch_numba`); the package has since
taken the idea (flashcore_numba/arch/compile_speed.py), and `patched` now runs the package's own
compile, `numba` the same with FLASHCORE_SHARED_INLINE_MEMO=0.

    python3 docs/tuning/compile_time/shared_memo.py one 07 64 float16 patched   # one kernel's PTX: seconds, hash
    python3 docs/tuning/compile_time/shared_memo.py all [jobs]                  # every kernel below, both ways

`all` compiles each kernel's PTX for sm_90a both ways (no GPU used), side by side on `jobs`
cores, and prints a table: seconds each way and whether the PTX is the same (Numba's mangled names
and .loc/.file lines normalized).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

KERNELS = ([(p, 64, "float16") for p in ("01", "02", "03", "04", "05", "06", "07", "08", "09", "10")]
           + [(p, 128, "float16") for p in ("07", "08", "09", "10")] + [("09", 128, "bfloat16")]
           + [(k, d, "float16") for d in (64, 128) for k in ("11-kv", "11-kv-serial", "11-delta", "12-kv", "12-kv-serial")])


def patch_numba():
    import numba.cuda.core.inline_closurecall as icc

    original = icc.InlineWorker.inline_ir

    class SharedMemo:
        """The `copy` module as inline_ir sees it, with one memo while an inline_ir call runs."""
        memo = None

        def deepcopy(self, x, memo=None):
            return copy.deepcopy(x, memo if memo is not None else self.memo)

        def __getattr__(self, name):
            return getattr(copy, name)

    shared = SharedMemo()

    def inline_ir(self, *args, **kwargs):
        shared.memo = {}
        try:
            return original(self, *args, **kwargs)
        finally:
            shared.memo = None

    icc.copy = shared
    icc.InlineWorker.inline_ir = inline_ir


def normalized(ptx: str) -> str:
    ptx = re.sub(r"_ZN\w+", "NAME", ptx)
    return "\n".join(line for line in ptx.splitlines() if not line.lstrip().startswith((".loc", ".file", "//")))


def one(kernel_id: str, head_dim: int, dtype: str, mode: str) -> dict:
    """`numba`: numba-cuda as it is; `patched`: the package's compile, which runs Numba with
    arch/compile_speed.py's shared memo since it went in (`experiment`: this script's own first
    version of the patch, patch_numba, as the first A/B ran it)."""
    import os

    if mode == "numba":
        os.environ["FLASHCORE_SHARED_INLINE_MEMO"] = "0"
    elif mode == "experiment":
        os.environ["FLASHCORE_SHARED_INLINE_MEMO"] = "0"
        patch_numba()
    from flashcore_numba.measure import machine_code

    start = time.perf_counter()
    ptx = machine_code.compile_phase_ptx(machine_code._kernel_id(kernel_id), head_dim, dtype)
    seconds = time.perf_counter() - start
    return {"kernel": kernel_id, "head_dim": head_dim, "dtype": dtype, "mode": mode, "seconds": round(seconds, 1),
            "ptx_sha": hashlib.sha256(normalized(ptx).encode()).hexdigest()[:16], "ptx_lines": ptx.count("\n")}


def run_one(args) -> dict:
    done = subprocess.run([sys.executable, __file__, "one", *map(str, args)], capture_output=True, text=True, check=False)
    if done.returncode:
        return {"kernel": args[0], "head_dim": args[1], "dtype": args[2], "mode": args[3], "error": done.stderr[-800:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv) -> int:
    if argv[0] == "one":
        print(json.dumps(one(argv[1], int(argv[2]), argv[3], argv[4])))
        return 0
    jobs = int(argv[1]) if len(argv) > 1 else 16
    work = [(*k, mode) for k in KERNELS for mode in ("numba", "patched")]
    work.sort(key=lambda w: -(w[1] == 128) - (w[0] in ("09", "12-kv", "12-kv-serial")))  # the long ones first
    with ThreadPoolExecutor(jobs) as pool:
        results = list(pool.map(run_one, work))
    for r in results:
        print(json.dumps(r), file=sys.stderr)
    by = {(r["kernel"], r["head_dim"], r["dtype"], r["mode"]): r for r in results}
    print(f"{'kernel':14} {'D':>4} {'dtype':9} {'numba s':>8} {'patched s':>9}  same PTX")
    total = [0.0, 0.0]
    for k in KERNELS:
        a, b = by[(*k, "numba")], by[(*k, "patched")]
        if "error" in a or "error" in b:
            print(f"{k[0]:14} {k[1]:>4} {k[2]:9} error: {(a.get('error') or b.get('error'))[-200:]!r}")
            continue
        total[0] += a["seconds"]
        total[1] += b["seconds"]
        print(f"{k[0]:14} {k[1]:>4} {k[2]:9} {a['seconds']:8.1f} {b['seconds']:9.1f}  {a['ptx_sha'] == b['ptx_sha']}")
    print(f"{'total':29} {total[0]:8.1f} {total[1]:9.1f}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    raise SystemExit(main(sys.argv[1:]))

"""`flashcore bench --first-call`: what the first attention() call of a new process costs.

A model server, a training job or a notebook starts a new Python process and calls attention().
Before its kernel runs, that first call loads the kernel from the kernel cache (arch/cache.py),
where `flashcore compile` or an earlier process put it, or compiles it (tens of seconds). Kernel
time and call time (bench.py) are measured in a process that has made its first call long
before; this measures the first call itself, in new processes:

- **warm**: the kernel cache as it is (FLASHCORE_CACHE_DIR or the platform's folder), after one
  process has called once, so that it holds the kernel (loaded, or compiled and stored);
- **cold** (with --cold): each process with an empty cache of its own, so that it compiles.

Each process imports flashcore_numba and torch (timed from the process's first line: `import_s`),
makes its inputs on the GPU (not timed: any CUDA work pays for its context first), calls
attention() once and waits for the GPU (`first_call_s`), calls it again (`second_call_s`), checks
the output against the float64 reference and says what the kernel cache did (loaded, compiled,
rejected). A warm cache that made a process compile (the cache switched off, or not writable)
stops the benchmark: its figures would not be what they say. The record (docs/bench/first_call/)
keeps every process's figures; `flashcore report` puts their medians in docs/performance.md.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from .records import SCHEMA, default_records_dir, gpu_slug, load_records, provenance, write_record

KIND = "first_call"
CACHE_MODES = ("warm", "cold")
_RUN_KEYS = {"import_s": float, "first_call_s": float, "second_call_s": float, "ok": bool, "loaded": int,
             "built": int, "rejected": int}


def record_path(gpu_name: str, config: dict, phases=(None,)) -> Path:
    from .bench import DTYPES

    short = {v: k for k, v in DTYPES.items()}.get(config["dtype"], config["dtype"])
    kv = f"kv{config['H_kv']}" if config["H_kv"] != config["H"] else ""
    shape = f"b{config['B']}h{config['H']}{kv}s{config['S']}d{config['D']}"
    name = (f"{gpu_slug(gpu_name)}_first_call_{shape}_{short}"
            + ("_causal" if config["causal"] else "")
            + ("_p" + "-".join(p or "best" for p in phases) if any(phases) else ""))
    return default_records_dir() / KIND / f"{name}.json"


# ---------------------------------------------------------------------------------------------
# One new process
# ---------------------------------------------------------------------------------------------
# The new process's program: the clock starts before anything of flashcore_numba is imported
CHILD = ("import time; t0 = time.perf_counter(); import json, sys; "
         "from flashcore_numba.measure.first_call import child; "
         "print(json.dumps(child(json.loads(sys.argv[1]), t0)))")


def child(config: dict, t0: float) -> dict:
    """The figures of one new process's first calls (this runs in that process, whose clock
    started at t0, before its imports)."""
    import numpy as np

    import flashcore_numba
    from flashcore_numba.arch import cache
    from flashcore_numba.reference import check_close, lowp_attention, reference_attention

    try:
        import torch

        on_torch = torch.cuda.is_available()
    except ImportError:
        on_torch = False
    t1 = time.perf_counter()
    B, H, S, D, H_kv = config["B"], config["H"], config["S"], config["D"], config["H_kv"]
    if on_torch:
        dtype = getattr(torch, config["dtype"])
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, H, S, D, device="cuda", generator=gen).to(dtype)
        k, v = (torch.randn(B, H_kv, S, D, device="cuda", generator=gen).to(dtype) for _ in range(2))
        wait = torch.cuda.synchronize
        wait()
    else:  # the simulator (the CPU tests): NumPy arrays, fp16
        rng = np.random.default_rng(0)
        q = rng.standard_normal((B, H, S, D)).astype(np.float16)
        k, v = (rng.standard_normal((B, H_kv, S, D)).astype(np.float16) for _ in range(2))

        def wait():
            return None
    phase = config["phase"] or "best"  # None in the record: attention()'s own choice
    t2 = time.perf_counter()
    out = flashcore_numba.attention(q, k, v, causal=config["causal"], phase=phase)
    wait()
    t3 = time.perf_counter()
    out = flashcore_numba.attention(q, k, v, causal=config["causal"], phase=phase)
    wait()
    t4 = time.perf_counter()
    host = (lambda x: x.float().cpu().numpy()) if on_torch else (lambda x: x)
    ref = reference_attention(q, k, v, causal=config["causal"])
    lowp = lowp_attention(q, k, v, causal=config["causal"],
                          dtype="bfloat16" if config["dtype"] == "bfloat16" else np.float16)
    ok = bool(check_close(host(out), ref, lowp).ok)
    return dict(import_s=t1 - t0, first_call_s=t3 - t2, second_call_s=t4 - t3, ok=ok,
                loaded=cache.stats["loaded"], built=cache.stats["built"], rejected=cache.stats["rejected"])


def new_process(config: dict, env: dict | None = None, timeout: float = 900.0) -> dict:
    """Run `child(config)` in a new Python process (the environment changed by `env`), on this
    process's copy of flashcore_numba (its folder first on the new process's path)."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(config)], capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"a new process ran past {timeout:.0f} s") from None
    if done.returncode != 0:
        raise RuntimeError(f"a new process failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------
def run_first_call_benchmark(shape, *, phases=(None,), causal=False, dtype="float16", kv_heads=None,
                             processes: int = 3, cold: bool = False, device=None, command=None,
                             progress=None) -> dict:
    """The whole protocol (the module docstring) for each phase of `phases` (None: attention()'s own
    choice), as a record. shape: (B, H, S, D)."""
    from .bench import open_device

    B, H, S, D = shape
    device = device or open_device()
    step = progress or (lambda label: None)
    config = dict(B=B, H=H, H_kv=kv_heads or H, S=S, D=D, dtype=dtype, causal=bool(causal),
                  processes=processes)
    results = []
    for phase in phases:
        name = phase or "attention()'s choice"
        child_config = dict(config, phase=phase)
        modes = []
        step(f"{name}: one process to fill the kernel cache")
        new_process(child_config)  # the cache as it is then holds the kernel: loaded, or compiled and stored
        runs = []
        for i in range(processes):
            step(f"{name}: warm cache, new process {i + 1} of {processes}")
            runs.append(new_process(child_config))
        if any(r["built"] for r in runs):
            raise RuntimeError(f"{name}: a process compiled with the kernel cache warm (is it switched off "
                               "by FLASHCORE_CACHE=0, or its folder not writable?): that is not a warm first "
                               "call")
        modes.append(("warm", runs))
        if cold:
            runs = []
            for i in range(processes):
                step(f"{name}: empty cache, new process {i + 1} of {processes}")
                with tempfile.TemporaryDirectory(prefix="flashcore-cold-") as empty:
                    runs.append(new_process(child_config, {"FLASHCORE_CACHE_DIR": empty}))
            modes.append(("cold", runs))
        for mode, runs in modes:
            results.append(dict(phase=phase, cache=mode, runs=runs, ok=all(r["ok"] for r in runs),
                                first_call_s=median([r["first_call_s"] for r in runs]),
                                import_s=median([r["import_s"] for r in runs]),
                                second_call_s=median([r["second_call_s"] for r in runs])))
    return dict(kind=KIND, schema=SCHEMA, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                command=list(command or []), provenance=provenance(device), config=config, results=results)


def validate(record) -> list[str]:
    """Problems with a first-call record's schema, as messages; an empty list means valid."""
    if not isinstance(record, dict):
        return ["record: expected a JSON object"]
    errors = []
    for key, typ in (("kind", str), ("schema", int), ("created", str), ("command", list),
                     ("provenance", dict), ("config", dict), ("results", list)):
        if not isinstance(record.get(key), typ):
            errors.append(f"record.{key}: expected {typ.__name__}, got {record.get(key)!r}")
    if record.get("kind") != KIND or record.get("schema") != SCHEMA:
        errors.append(f"record: expected kind {KIND!r}, schema {SCHEMA}")
    for key in ("gpu_name", "git_commit"):
        if key not in record.get("provenance", {}):
            errors.append(f"provenance: missing key {key!r}")
    config = record.get("config", {})
    for key, typ in (("B", int), ("H", int), ("H_kv", int), ("S", int), ("D", int), ("dtype", str),
                     ("causal", bool), ("processes", int)):
        if not isinstance(config.get(key), typ):
            errors.append(f"config.{key}: expected {typ.__name__}, got {config.get(key)!r}")
    for i, r in enumerate(record.get("results", []) if isinstance(record.get("results"), list) else []):
        where = f"results[{i}]"
        if not isinstance(r, dict):
            errors.append(f"{where}: expected an object")
            continue
        if not isinstance(r.get("ok"), bool):
            errors.append(f"{where}.ok: expected true or false, got {r.get('ok')!r}")
        if r.get("cache") not in CACHE_MODES:
            errors.append(f"{where}.cache: expected one of {CACHE_MODES}, got {r.get('cache')!r}")
        if not (r.get("phase") is None or isinstance(r.get("phase"), str)):
            errors.append(f"{where}.phase: expected a phase id or null")
        for key in ("first_call_s", "import_s", "second_call_s"):
            if not isinstance(r.get(key), (int, float)) or not math.isfinite(r[key]) or r[key] < 0:
                errors.append(f"{where}.{key}: expected a time in seconds, got {r.get(key)!r}")
        runs = r.get("runs")
        if not isinstance(runs, list) or not runs:
            errors.append(f"{where}.runs: expected the processes' figures")
            continue
        for j, run in enumerate(runs):
            for key, typ in _RUN_KEYS.items():
                value = run.get(key) if isinstance(run, dict) else None
                if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
                    errors.append(f"{where}.runs[{j}].{key}: expected {typ.__name__}, got {value!r}")
    return errors


def write(record: dict, path) -> Path:
    """The record to `path`, validated first (records.write_record with this kind's validator)."""
    return write_record(record, path, validate)


def load(directory) -> list[dict]:
    """Every first-call record in `directory` (none if it does not exist), oldest first, each with
    its `_path`; a file that is not a valid record raises RecordError naming it (records.load_records
    with this kind's validator)."""
    return load_records(directory, validate, "first-call record")

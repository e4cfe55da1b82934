"""The benchmark record: its schema, its files under docs/bench/, and the provenance it carries.

Every speed figure this project quotes is read from a record, one JSON file per `flashcore bench`
run: bench.py measures and builds it, the CLI writes it (`write_record`), report.py and the lessons
read it (`load_records`), and `flashcore doctor` asks the same provenance questions of a machine.
What a record holds (`validate_record` checks it):

    schema, created, command   the format's version, when (UTC) and how the run was started
    provenance                 the GPU, its clocks, the driver and package versions, the git commit
    config                     the problem: B, H, S_q, S_k, D, dtype, causal (H_kv when grouped)
    timing                     the protocol's settings (bench.Timing)
    ceiling, ceiling_tflops    the tensor-core ceiling measured in the same run, or null
    bandwidth, bandwidth_gb_per_s
                               the memory-bandwidth ceiling (a copy of K and V's bytes) measured
                               in the same run; absent where not measured (older records)
    oracle                     what a result was checked against
    flops, seed, results       the FLOP count, the inputs' seed, one row per phase or peer
                               (`Result`); a sweep has instead `sweep`, a list of
                               {S, B, config, flops, seed, results}

The files are written as `json.dumps(record, indent=1)` plus a newline, and named by
`default_record_path`. `repo_root` says where the checkout is, for docs/bench/ and, in the
course, lessons/.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import phases as phase_registry

SCHEMA = 1


# ---------------------------------------------------------------------------------------------
# Where the checkout is
# ---------------------------------------------------------------------------------------------
class CheckoutNeeded(FileNotFoundError):
    """What a command needs from a source checkout (lessons/, docs/, the README) is not here: an
    installed package holds only the library. The message says so and what to do."""

    def __init__(self, what: str):
        super().__init__(f"{what}: not here; they come with a source checkout of flashcore-numba, not "
                         "with an installed package: clone the repository, run `pip install -e \".[course]\"` "
                         "in it and run this from inside it")


def checkout_root() -> Path | None:
    """The checkout holding docs/ and lessons/: the folder above the package when it is one (a
    source checkout, or an editable install), else the working directory or its nearest parent
    that is one; None where there is none (a package installed from a wheel, run elsewhere)."""
    here = Path(__file__).resolve().parents[2]  # flashcore_numba/measure/records.py -> the checkout
    for root in (here, Path.cwd(), *Path.cwd().parents):
        if (root / "lessons").is_dir() or (root / "docs" / "bench").is_dir():
            return root
    return None


def repo_root(what: str = "this command") -> Path:
    """`checkout_root()`, or CheckoutNeeded naming `what` needed it."""
    root = checkout_root()
    if root is None:
        raise CheckoutNeeded(what)
    return root


def default_records_dir() -> Path:
    """docs/bench/ of the checkout; where the package was installed from a wheel, flashcore-bench/
    in the working directory (so `flashcore bench` works from any install)."""
    root = checkout_root()
    return root / "docs" / "bench" if root is not None else Path.cwd() / "flashcore-bench"


# ---------------------------------------------------------------------------------------------
# The schema: one row per phase or peer, the record around them, and its check
# ---------------------------------------------------------------------------------------------
@dataclass
class Result:
    """One row of a record: a phase or a peer on one problem."""

    name: str  # phase id ("03") or peer name ("sdpa_flash")
    kind: str  # "phase" | "peer"
    title: str
    available: bool = True
    reason: str | None = None  # why not available
    correct: bool | None = None
    message: str | None = None  # the oracle's verdict, or what went wrong
    max_err: float | None = None
    allowed_err: float | None = None
    median_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    mean_ms: float | None = None
    p99_ms: float | None = None
    tflops: float | None = None
    pct_of_ceiling: float | None = None
    # K and V's bytes over the median, and their share of the bandwidth ceiling (absent in older records)
    gb_per_s: float | None = None
    pct_of_bandwidth: float | None = None
    # kernel resources (phases on a real GPU only)
    registers: int | None = None
    static_smem_bytes: int | None = None
    dynamic_smem_bytes: int | None = None
    local_bytes_per_thread: int | None = None
    # the tail (Timing.tail) and the call time (Timing.calls): `distribution` dicts, when measured;
    # call_op: the same call through the custom op torch.compile sees, torch.ops.flashcore.attention;
    # launch_loop (a phase's, with the call time): its kernel's own launch timed as the call is, back
    # to back, in runs alternating with the calls': call / launch_loop is what attention() adds under
    # the same load on the board (the kernel time also differs by its L2 flush and its short batches).
    # "launch": "plan" where that launch is the plan's driver launch that attention() makes; older
    # records (without it) timed the lessons' launch through Numba's dispatcher
    tail: dict | None = None
    call: dict | None = None
    call_op: dict | None = None
    launch_loop: dict | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("max_err", "allowed_err"):  # JSON has no inf
            if d[key] is not None and not math.isfinite(d[key]):
                d[key] = None
        if self.kind == "peer":
            for key in ("registers", "static_smem_bytes", "dynamic_smem_bytes", "local_bytes_per_thread"):
                del d[key]
        # absent, not null, where not measured (older records lack them)
        for key in ("gb_per_s", "pct_of_bandwidth", "tail", "call", "call_op", "launch_loop"):
            if d[key] is None:
                del d[key]
        return d


def unavailable(name: str, kind: str, title: str, reason: str) -> Result:
    return Result(name, kind, title, available=False, reason=reason)


def build_record(*, problem, results, provenance: dict, timing, ceiling: dict | None,
                 oracle: dict, command, seed: int | None = None, sweep: list | None = None,
                 bandwidth: dict | None = None) -> dict:
    """The JSON record of one `flashcore bench` run (see `validate_record` for the schema).

    `problem` is a bench.Problem (its `as_dict()` is the "config") and `timing` a bench.Timing
    (a dataclass, written field by field).

    A single run carries `flops`, `seed` and `results`; a sweep carries `sweep`, a list of
    {"S", "B", "config", "flops", "seed", "results"}, with `config` the base problem.
    """
    record = {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": list(command),
        "provenance": provenance,
        "config": problem.as_dict(),
        "timing": asdict(timing),
        "ceiling": ceiling,
        "ceiling_tflops": ceiling.get("tflops") if ceiling else None,
        "oracle": oracle,
    }
    if bandwidth:
        record.update(bandwidth=bandwidth, bandwidth_gb_per_s=bandwidth["gb_per_s"])
    if sweep is None:
        record.update(flops=problem.flops, seed=seed, results=[_as_dict(r) for r in results])
    else:
        record["sweep"] = [dict(point, results=[_as_dict(r) for r in point["results"]]) for point in sweep]
    return record


def _as_dict(result) -> dict:
    return result.to_dict() if isinstance(result, Result) else dict(result)


_NUMBER = (int, float)
_TOP_KEYS = {"schema": int, "created": str, "command": list, "provenance": dict, "config": dict,
             "timing": dict, "oracle": dict}
_CONFIG_KEYS = {"B": int, "H": int, "S_q": int, "S_k": int, "D": int, "dtype": str, "causal": bool}
_RESULT_KEYS = {"name": str, "kind": str, "title": str, "available": bool}
_MEASURED_KEYS = ("median_ms", "min_ms", "max_ms", "tflops")
_DISTRIBUTION_KEYS = ("n", "median_ms", "mean_ms", "p99_ms", "max_ms", "slow")
_PHASE_RESOURCE_KEYS = ("registers", "static_smem_bytes", "dynamic_smem_bytes", "local_bytes_per_thread")


def validate_record(record: dict) -> list[str]:
    """Problems with a record's schema, as messages; an empty list means valid."""
    errors = []

    def check(obj, keys, where):
        for key, typ in keys.items():
            if key not in obj:
                errors.append(f"{where}: missing key {key!r}")
            elif not isinstance(obj[key], typ) or (typ is int and isinstance(obj[key], bool)):
                errors.append(f"{where}.{key}: expected {typ.__name__}, got {type(obj[key]).__name__}")

    if not isinstance(record, dict):
        return ["record: expected a JSON object"]
    check(record, _TOP_KEYS, "record")
    if record.get("schema") != SCHEMA:
        errors.append(f"record.schema: expected {SCHEMA}, got {record.get('schema')!r}")
    check(record.get("config", {}), _CONFIG_KEYS, "config")
    for key in ("gpu_name", "git_commit"):
        if key not in record.get("provenance", {}):
            errors.append(f"provenance: missing key {key!r}")
    for key in ("ceiling_tflops", "bandwidth_gb_per_s"):
        if record.get(key) is not None and not isinstance(record[key], _NUMBER):
            errors.append(f"record.{key}: expected a number or null")
    if "sweep" in record:
        points = [(f"sweep[{i}]", p) for i, p in enumerate(record["sweep"])]
        for where, point in points:
            check(point, {"S": int, "flops": int, "results": list, "config": dict}, where)
    else:
        points = [("record", record)]
        check(record, {"flops": int, "results": list}, "record")
    for where, point in points:
        for i, r in enumerate(point.get("results", [])):
            errors.extend(_validate_result(r, f"{where}.results[{i}]"))
    return errors


def _validate_result(r, where) -> list[str]:
    errors = []
    for key, typ in _RESULT_KEYS.items():
        if not isinstance(r.get(key), typ):
            errors.append(f"{where}.{key}: expected {typ.__name__}, got {r.get(key)!r}")
    if r.get("kind") not in ("phase", "peer"):
        errors.append(f"{where}.kind: expected 'phase' or 'peer', got {r.get('kind')!r}")
    if r.get("available") is False:
        if not isinstance(r.get("reason"), str):
            errors.append(f"{where}.reason: an unavailable result must say why")
        return errors
    if not isinstance(r.get("correct"), bool):
        errors.append(f"{where}.correct: expected true or false, got {r.get('correct')!r}")
    if not isinstance(r.get("message"), str):
        errors.append(f"{where}.message: expected a string")
    for key in ("max_err", "allowed_err"):
        if r.get(key) is not None and not isinstance(r.get(key), _NUMBER):
            errors.append(f"{where}.{key}: expected a number or null")
    keys = _MEASURED_KEYS + tuple(k for k in ("pct_of_ceiling", "mean_ms", "p99_ms", "gb_per_s",
                                            "pct_of_bandwidth") if r.get(k) is not None)
    for key in keys:
        value = r.get(key)
        if r.get("correct") and not isinstance(value, _NUMBER):
            errors.append(f"{where}.{key}: a correct result must be timed, got {value!r}")
        if not r.get("correct") and value is not None:
            errors.append(f"{where}.{key}: an incorrect result must not carry a speed figure")
    for key in ("tail", "call", "call_op", "launch_loop"):
        if key in r:
            if not r.get("correct") or not isinstance(r[key], dict):
                errors.append(f"{where}.{key}: expected an object, and only in a correct result")
            elif any(not isinstance(r[key].get(f), _NUMBER) for f in _DISTRIBUTION_KEYS):
                errors.append(f"{where}.{key}: expected numbers {', '.join(_DISTRIBUTION_KEYS)}")
            elif r[key]["median_ms"] <= 0:
                errors.append(f"{where}.{key}: expected a positive median")
    if "launch_loop" in r and (r.get("kind") != "phase" or "call" not in r):
        errors.append(f"{where}.launch_loop: only a phase's, beside its call time")
    if isinstance(r.get("launch_loop"), dict) and r["launch_loop"].get("launch", "plan") != "plan":
        errors.append(f"{where}.launch_loop.launch: expected \"plan\" (or absent in older records)")
    if r.get("kind") == "phase":
        for key in _PHASE_RESOURCE_KEYS:
            if key not in r:
                errors.append(f"{where}: missing key {key!r}")
            elif r[key] is not None and not isinstance(r[key], int):
                errors.append(f"{where}.{key}: expected an integer or null")
    return errors


# ---------------------------------------------------------------------------------------------
# Files: one JSON file per run under docs/bench/
# ---------------------------------------------------------------------------------------------
class RecordError(ValueError):
    """A record file that cannot be read or does not follow the schema."""


def load_records(directory=None, validate=None, what: str = "benchmark record") -> list[dict]:
    """Every record in `directory` (default docs/bench), oldest first.

    Each record gets a `_path` key: its file, as a string. A missing directory holds no
    records; a file that is not a valid record raises RecordError naming it: a committed
    record nobody can read is a bug worth hearing about. `validate` (default validate_record)
    checks another kind of record (measure/first_call.py's), `what` names it in the error.
    """
    validate = validate or validate_record
    directory = Path(directory) if directory is not None else default_records_dir()
    records = []
    for path in sorted(directory.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise RecordError(f"{path}: not readable as JSON ({e})") from None
        errors = validate(record)
        if errors:
            raise RecordError(f"{path}: not a valid {what}: {errors[0]}")
        record["_path"] = str(path)
        records.append(record)
    return sorted(records, key=lambda r: r["created"])


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def default_record_path(gpu_name: str, problem, *, sweep: bool = False, phase_ids=None) -> Path:
    """docs/bench/<gpu>_[sweep_]<problem>[_p<ids>].json, <problem> being a bench.Problem's `tag`.

    A run of only some phases gets their ids in the name, so it never overwrites the record
    of the whole ladder.
    """
    kind = "sweep_" if sweep else ""
    ids = sorted(phase_ids) if phase_ids is not None else sorted(phase_registry.KERNELS)
    subset = "" if ids == sorted(phase_registry.KERNELS) else "_p" + "-".join(ids)
    return default_records_dir() / f"{gpu_slug(gpu_name)}_{kind}{problem.tag}{subset}.json"


def write_record(record: dict, path, validate=None) -> Path:
    errors = (validate or validate_record)(record)
    if errors:  # a bug in this module, not a user error: refuse to write a bad record
        raise ValueError("refusing to write an invalid record: " + "; ".join(errors[:5]))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# Provenance: what a reader needs to trust or reproduce a number
# ---------------------------------------------------------------------------------------------
def _run(cmd, cwd=None) -> str | None:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def nvidia_smi() -> dict:
    """SM clock (now and max, MHz) and driver version of the first GPU; {} without nvidia-smi."""
    out = _run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,driver_version",
                "--format=csv,noheader,nounits"])
    if out:
        fields = [f.strip() for f in out.splitlines()[0].split(",")]
        if len(fields) == 3:
            return {"sm_clock_mhz": _int_or_none(fields[0]), "sm_clock_max_mhz": _int_or_none(fields[1]),
                    "driver": fields[2]}
    try:  # pynvml, where installed, answers the same questions
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        driver = pynvml.nvmlSystemGetDriverVersion()
        return {"sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                "sm_clock_max_mhz": pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM),
                "driver": driver.decode() if isinstance(driver, bytes) else driver}
    except Exception:  # noqa: BLE001 - provenance is best effort: no NVML, no clocks
        return {}


def _int_or_none(text):
    try:
        return int(float(text))
    except ValueError:
        return None


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_state() -> dict:
    """Commit of the checkout and whether it has uncommitted changes (records themselves aside).

    A copy of the tree whose .git folder is missing or stale (as on a rented GPU machine that
    receives the working tree, not the history) cannot tell: the caller then names the commit
    in FLASHCORE_GIT_COMMIT (and FLASHCORE_GIT_DIRTY=0/1), which takes precedence.
    """
    if os.environ.get("FLASHCORE_GIT_COMMIT"):
        dirty = os.environ.get("FLASHCORE_GIT_DIRTY")
        return {"git_commit": os.environ["FLASHCORE_GIT_COMMIT"],
                "git_dirty": None if dirty is None else dirty not in ("0", "")}
    root = checkout_root()
    if root is None:  # an installed package: no git tree to ask
        return {"git_commit": None, "git_dirty": None}
    commit = _run(["git", "rev-parse", "HEAD"], cwd=root)
    # tracked files only: what a run carries beside the checkout (a wheel, a kernel cache, scratch
    # scripts) is no change to the code it measures
    status = _run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs/bench"],
                  cwd=root)
    return {"git_commit": commit, "git_dirty": None if commit is None else bool(status)}


def provenance(device, *, sm_clock_start=None) -> dict:
    """Everything about the machine and the software that produced a record."""
    smi = nvidia_smi()
    try:
        from numba.cuda.cudadrv.driver import driver

        cuda_driver = ".".join(map(str, driver.get_version()))
    except Exception:  # noqa: BLE001 - provenance is best effort
        cuda_driver = None
    info = {
        "gpu_name": device.name,
        "compute_capability": ".".join(map(str, device.cc)),
        "sm_clock_mhz_start": sm_clock_start,
        "sm_clock_mhz_end": smi.get("sm_clock_mhz"),
        "sm_clock_max_mhz": smi.get("sm_clock_max_mhz"),
        "driver": smi.get("driver"),
        "cuda_driver_api": cuda_driver,
        "torch_cuda": device.torch_cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "array_backend": device.kind,
    }
    for pkg in ("numba", "numba-cuda", "numpy", "torch", "cuda-bindings"):
        info[pkg.replace("-", "_")] = package_version(pkg)
    info.update(git_state())
    return info

"""`flashcore doctor`: is this machine ready? One line per check: OK, WARN or FAIL, with the fix.

A CPU-only machine is a supported set-up (the simulator runs every phase), so a missing GPU
is a WARN, not a FAIL. FAIL means something that will break: a missing package, or
numpy >= 2.5 under numba-cuda 0.30.x (its first kernel launch fails). Exit status 1 when
any check FAILs, else 0.

The GPU is probed in a child process with the simulator switched off: numba decides
between the simulator and the real CUDA module once per process, and this process may
already have chosen the simulator.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass

from ..arch.sim import simulator_enabled
from .records import nvidia_smi, package_version

# Runs in a fresh interpreter with NUMBA_ENABLE_CUDASIM unset; prints one JSON line.
_PROBE = r"""
import json
info = {"available": False}
try:
    from numba import cuda
    if cuda.is_available():
        dev = cuda.get_current_device()
        name = dev.name
        info.update(available=True, name=name.decode() if isinstance(name, bytes) else str(name),
                    cc=list(dev.compute_capability))
    else:
        try:
            cuda.get_current_device()
        except Exception as e:
            info["why"] = " ".join(str(e).split())[:200].rstrip(" :")
    try:
        from numba.cuda.cudadrv.driver import driver
        info["cuda_driver_api"] = ".".join(map(str, driver.get_version()))
    except Exception:
        pass
    def _kernel(a):
        a[0] = 1.0
    try:
        ptx, _ = cuda.compile_ptx(_kernel, "void(float32[:])", cc=(9, 0, "a"))
        info["nvvm_sm90a"] = ".target sm_90a" in ptx
    except Exception as e:
        info["nvvm_error"] = " ".join(str(e).split())[:200]
except Exception as e:
    info["why"] = " ".join(str(e).split())[:200]
print(json.dumps(info))
"""


@dataclass(frozen=True)
class Check:
    status: str  # "OK" | "WARN" | "FAIL"
    name: str
    detail: str
    fix: str = ""


def _version_tuple(text: str | None) -> tuple[int, ...]:
    parts = []
    for piece in (text or "").split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def probe_gpu() -> dict:
    """Ask a child interpreter (simulator off) what GPU and compiler it sees."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                              timeout=180, check=False)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {"available": False, "why": "the probe process failed"}


def package_checks() -> list[Check]:
    checks = [Check("OK", "python", platform.python_version())]
    numba_v, cuda_v, numpy_v = (package_version(p) for p in ("numba", "numba-cuda", "numpy"))
    pin_numba_cuda = 'pip install "numba-cuda[cu13]>=0.30,<0.31"'
    checks.append(Check("OK", "numba", numba_v) if numba_v else
                  Check("FAIL", "numba", "not installed", pin_numba_cuda))
    if not cuda_v:
        checks.append(Check("FAIL", "numba-cuda", "not installed", pin_numba_cuda))
    elif _version_tuple(cuda_v)[:2] != (0, 30):
        checks.append(Check("WARN", "numba-cuda", f"{cuda_v}; this project is tested with 0.30.x",
                            pin_numba_cuda))
    else:
        checks.append(Check("OK", "numba-cuda", cuda_v))
    if not numpy_v:
        checks.append(Check("FAIL", "numpy", "not installed", 'pip install "numpy<2.5"'))
    elif _version_tuple(numpy_v)[:2] >= (2, 5) and _version_tuple(cuda_v)[:2] == (0, 30):
        checks.append(Check("FAIL", "numpy", f"{numpy_v}: numba-cuda {cuda_v} fails at the first kernel "
                            "launch (module 'numpy' has no attribute 'row_stack')",
                            'pip install "numpy<2.5"'))
    else:
        checks.append(Check("OK", "numpy", numpy_v))
    try:
        from cuda.bindings import nvjitlink

        checks.append(Check("OK", "nvJitLink", ".".join(map(str, nvjitlink.version()))))
    except Exception as e:  # noqa: BLE001 - any failure to load it means the same: no PTX linking
        checks.append(Check("WARN", "nvJitLink", f"not usable ({type(e).__name__}); phases that link PTX "
                            "(06+) cannot build", 'pip install "numba-cuda[cu13]"'))
    return checks


def gpu_checks(info: dict) -> list[Check]:
    checks = []
    sim = simulator_enabled()
    if info.get("available"):
        cc = tuple(info["cc"])
        checks.append(Check("OK", "GPU", f"{info['name']}, compute capability {cc[0]}.{cc[1]}"))
    else:
        checks.append(Check("WARN", "GPU", f"no CUDA GPU ({info.get('why', 'not found')}); `flashcore run` "
                            "checks the phases in the simulator, timing needs a GPU",
                            "none needed on a CPU machine; on a GPU machine install the NVIDIA driver"))
    smi = nvidia_smi()
    if smi.get("driver") or info.get("cuda_driver_api"):
        checks.append(Check("OK", "driver", f"{smi.get('driver', 'version unknown')}, "
                            f"CUDA {info.get('cuda_driver_api', '?')} (driver API)"))
    else:
        checks.append(Check("WARN", "driver", "no NVIDIA driver found (nvidia-smi missing)",
                            "install the NVIDIA driver on a GPU machine (the simulator needs none)"))
    if info.get("nvvm_sm90a"):
        checks.append(Check("OK", "compiler", "NVVM compiles kernels for sm_90a (no GPU needed)"))
    else:
        checks.append(Check("FAIL", "compiler", f"NVVM could not compile for sm_90a "
                            f"({info.get('nvvm_error', 'unknown error')})", 'pip install "numba-cuda[cu13]"'))
    if sim and info.get("available"):
        checks.append(Check("WARN", "simulator", "ON (NUMBA_ENABLE_CUDASIM=1) although a GPU is present: "
                            "kernels run on the CPU and timings mean nothing", "unset NUMBA_ENABLE_CUDASIM"))
    elif sim:
        checks.append(Check("OK", "simulator", "ON (NUMBA_ENABLE_CUDASIM=1): kernels run on the CPU, "
                            "timings mean nothing"))
    else:
        checks.append(Check("OK", "simulator", "off" + ("" if info.get("available") else
                            "; `flashcore run` switches it on by itself when there is no GPU")))
    if not info.get("available"):
        checks.append(Check("WARN", "sm_90a phases", "cannot run without a GPU (they still compile)",
                            "run them on an H100 (compute capability 9.0)"))
    elif tuple(info["cc"]) == (9, 0):
        checks.append(Check("OK", "sm_90a phases", "can run: compute capability 9.0 (wgmma, TMA)"))
    else:
        cc = info["cc"]
        checks.append(Check("WARN", "sm_90a phases", f"cannot run on compute capability {cc[0]}.{cc[1]}; "
                            "they are skipped with a reason", "use an H100 (compute capability 9.0)"))
    return checks


def torch_check() -> Check:
    try:
        import torch
    except ImportError:
        return Check("WARN", "torch", "not installed: no torch inputs, no SDPA peers or ceiling in "
                     "`flashcore bench`", "pip install -e '.[torch]'")
    except Exception as e:  # noqa: BLE001 - a broken install (missing CUDA libraries, ...) is a finding
        return Check("WARN", "torch", f"installed but its import fails: {type(e).__name__}: {e}",
                     "reinstall torch for this machine's CUDA")
    if not torch.cuda.is_available():
        return Check("WARN", "torch", f"{torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: "
                     "SDPA peers unavailable", "install a CUDA build of torch on a GPU machine")
    return Check("OK", "torch", f"{torch.__version__}, CUDA {torch.version.cuda}, sees "
                 f"{torch.cuda.get_device_name()}")


def run_checks() -> list[Check]:
    return package_checks() + gpu_checks(probe_gpu()) + [torch_check()]


def main() -> int:
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False, soft_wrap=True)  # one line per check, however long
    colors = {"OK": "green", "WARN": "yellow", "FAIL": "red"}
    checks = run_checks()
    for c in checks:
        fix = f" — fix: {c.fix}" if c.fix and c.status != "OK" else ""
        console.print(f"[{colors[c.status]}]{c.status:<4}[/] {c.name:<14} {escape(c.detail + fix)}")
    failed = sum(c.status == "FAIL" for c in checks)
    return 1 if failed else 0

"""The package as a user installs it: an sdist and a wheel built from this checkout, the wheel
installed into a new virtual environment, and the library, the command and the grader run there
from a folder that is not the checkout.

An editable install (`pip install -e .`) reads the checkout and hides what a wheel leaves out; this
test is the only place the project is installed the way `pip install flashcore-numba` would. It
needs pip to reach the package index (for the build backend and the dependencies; CI's pip cache
already holds them) and takes about two minutes, so it is marked `install`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.install


def _run(cmd, cwd, env=None, timeout=900, check=True) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if check and done.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {done.returncode}\n{done.stdout[-4000:]}\n"
                    f"{done.stderr[-4000:]}")
    return done


def _tracked_copy(dest: Path) -> Path:
    """The checkout's files that git tracks or would (a clean clone of this commit), copied, so that
    nothing built here lands in the checkout."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: cannot tell which files a clean clone holds")
    for name in filter(None, listed.stdout.split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def _packages(root: Path) -> set[str]:
    """Every Python package of the source tree, as a folder path inside the wheel."""
    return {p.parent.relative_to(root).as_posix() for p in (root / "flashcore_numba").rglob("__init__.py")}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv's python, the wheel's file names, a folder outside the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = _tracked_copy(tmp / "src")
    dist = tmp / "dist"
    # the sdist by the build backend itself, then the wheel built *from the sdist* by pip in an
    # isolated environment: a file the sdist forgets is then missing from the wheel too
    _run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(dist)!r})"],
         cwd=source)
    (sdist,) = dist.glob("*.tar.gz")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, sdist], cwd=tmp)
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    with tarfile.open(sdist) as t:
        sdist_names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=tmp)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    _run([python, "-m", "pip", "install", "-q", wheel], cwd=tmp)
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:  # the same torch as here (the CPU build's file on a CPU machine)
        _run([python, "-m", "pip", "install", "-q", f"torch=={torch.__version__.split('+')[0]}"], cwd=tmp)
    elsewhere = tmp / "user"
    elsewhere.mkdir()
    return python, names, sdist_names, elsewhere


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NUMBA_ENABLE_CUDASIM")}
    env["FLASHCORE_CACHE"] = "0"  # nothing from this machine's kernel cache
    return env


def test_the_wheel_holds_every_package_and_the_ptx(installed):
    _, names, _, _ = installed
    missing = sorted(p for p in _packages(ROOT) if f"{p}/__init__.py" not in names)
    assert not missing, f"packages missing from the wheel: {missing}"
    ptx = sorted(p.name for p in (ROOT / "ptx").glob("*.ptx"))
    assert ptx and all(f"flashcore_numba/ptx/{name}" in names for name in ptx), sorted(names)


def test_the_sdist_holds_the_ptx_and_its_templates(installed):
    _, _, sdist_names, _ = installed
    for path in [*(ROOT / "ptx").rglob("*.ptx"), *(ROOT / "ptx" / "templates").glob("*")]:
        assert path.relative_to(ROOT).as_posix() in sdist_names, path


def test_the_installed_package_is_the_wheels_not_the_checkouts(installed):
    python, _, _, elsewhere = installed
    out = _run([python, "-c", "import flashcore_numba, flashcore_numba.runtime.plan as p; print(p.__file__)"],
               cwd=elsewhere, env=_env()).stdout.strip()
    assert "site-packages" in out and not out.startswith(str(ROOT)), out


def test_doctor_and_run_in_the_simulator(installed):
    python, _, _, elsewhere = installed
    flashcore = python.parent / "flashcore"
    doctor = _run([flashcore, "doctor"], cwd=elsewhere, env=_env())
    assert "numba-cuda" in doctor.stdout, doctor.stdout
    run = _run([flashcore, "run"], cwd=elsewhere, env=_env())
    assert "simulator" in run.stdout and "correct in the simulator" in run.stdout, run.stdout[-3000:]
    # no lessons/ beside an installed package: the last line says where the course is
    assert "source checkout" in run.stdout.splitlines()[-1] or "source checkout" in run.stdout[-400:]


def test_attention_on_numpy_and_torch_validation(installed):
    python, _, _, elsewhere = installed
    script = textwrap.dedent("""
        import numpy as np
        from flashcore_numba import attention
        from flashcore_numba.reference import reference_attention
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, 1, 40, 64)).astype(np.float16) for _ in range(3))
        out = attention(q, k, v, phase="02")
        ref = reference_attention(q, k, v)
        err = float(np.abs(out.astype(np.float64) - ref).max())
        assert np.isfinite(out).all() and err < 2e-2, err
        print("numpy ok", err)
        try:
            import torch
        except ImportError:
            print("no torch")
        else:
            t = torch.randn(1, 2, 16, 64, dtype=torch.float16)
            try:
                attention(t, t, t)
            except TypeError as e:
                assert str(e).startswith("q:"), e
                print("torch refused:", e)
            else:
                raise AssertionError("a CPU torch tensor was accepted")
    """)
    env = {**_env(), "NUMBA_ENABLE_CUDASIM": "1"}
    out = _run([python, "-c", script], cwd=elsewhere, env=env).stdout
    assert "numpy ok" in out, out


def test_grade_on_a_stub_copied_out_and_the_checkouts_files_named(installed):
    python, _, _, elsewhere = installed
    flashcore = python.parent / "flashcore"
    stub = elsewhere / "01_naive.py"
    shutil.copy(ROOT / "lessons" / "exercises" / "01_naive.py", stub)
    untouched = _run([flashcore, "grade", "01", stub], cwd=elsewhere, env=_env(), check=False)
    assert untouched.returncode == 1 and "Score: 0/" in untouched.stdout, untouched.stdout[-3000:]
    _run([python, "-c", "from flashcore_numba.course import exercises; from flashcore_numba.phases import "
          "get_phase; open('solved.py', 'w').write(exercises.solution_source(get_phase('01')))"],
         cwd=elsewhere, env=_env())
    solved = _run([flashcore, "grade", "01", "solved.py"], cwd=elsewhere, env=_env(), check=False)
    assert solved.returncode == 0 and "Full marks" in solved.stdout, solved.stdout[-3000:]
    # what only a checkout holds fails in one line that says so, never a traceback
    for command in (["grade", "01"], ["lessons"], ["report"]):
        done = _run([flashcore, *command], cwd=elsewhere, env=_env(), check=False)
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert "source checkout" in done.stderr and "Traceback" not in done.stderr, done.stderr

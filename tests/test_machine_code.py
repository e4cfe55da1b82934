"""The machine-code report: kernels compiled for sm_90a and assembled by nvJitLink, no GPU needed.

In the simulator (the default test session) `kernel_report` compiles in a subprocess without
NUMBA_ENABLE_CUDASIM; one subprocess serves every phase these tests look at. It starts as a
background job (the root conftest.py) as soon as the session's tests are known.
"""

from __future__ import annotations

import sys

import pytest

from flashcore_numba.measure.machine_code import (
    REPORT_KEYS,
    compiler_env,
    instruction_counts,
    kernel_reports,
    occupancy,
    opcode,
    parse_resource_usage,
    ptx_excerpt,
)

REGISTER_PHASES = ("03", "04")  # phases whose lesson promises every tile value lives in registers


def _compile():
    return kernel_reports(["01", *REGISTER_PHASES], 64)


def start_background(items, pool):
    """The compile in the session's pool of background jobs (conftest.py), if a selected test of this
    module reads it. A thread of the pool only waits for the subprocess, so this process goes on
    with the other tests meanwhile."""
    this_module = sys.modules[__name__]  # `reports` is a common name: only this module's tests count
    if any(getattr(item, "module", None) is this_module and "reports" in item.fixturenames for item in items):
        return pool.submit(_compile)
    return None


@pytest.fixture(scope="module")
def reports(background):
    # compiled here in a GPU session (no background jobs), or if the job is still waiting for a
    # worker of the pool (cancel() then takes it off the queue: it never runs twice)
    if background is None or background.cancel():
        return _compile()
    return background.result()


def test_report_parses(reports):
    for pid, r in reports.items():
        for key in REPORT_KEYS:
            assert key in r, f"phase {pid}: no {key!r} in the report"
        assert 0 < r["registers"] <= 255, f"phase {pid}: {r['registers']} registers"
        assert ".target sm_90a" in r["ptx"]
        assert r["static_smem_bytes"] == 0, f"phase {pid}: the phases use dynamic shared memory only"
    assert reports["01"]["dynamic_smem_bytes"] == 0
    assert reports["03"]["dynamic_smem_bytes"] > 48 * 1024  # why launch() raises the per-kernel limit


@pytest.mark.parametrize("pid", REGISTER_PHASES)
def test_register_phases_do_not_spill(reports, pid):
    r = reports[pid]
    assert (r["spill_store_bytes"], r["spill_load_bytes"], r["stack_frame_bytes"]) == (0, 0, 0), (
        f"phase {pid} keeps its tiles in registers, but ptxas reports {r['stack_frame_bytes']} bytes of stack "
        f"frame, {r['spill_store_bytes']} bytes of spill stores, {r['spill_load_bytes']} of spill loads "
        f"({r['registers']} registers)")


def test_phase03_ptx_has_its_key_instructions(reports):
    counts = instruction_counts(reports["03"]["ptx"], ["shfl.sync.bfly", "ex2.approx", "ld.local", "st.local"])
    assert counts["shfl.sync.bfly"] > 0, "the row max and sum are butterfly shuffles"
    assert counts["ex2.approx"] > 0, "exp2 is a single ex2.approx instruction"
    assert counts["ld.local"] == counts["st.local"] == 0


def test_parse_resource_usage():
    log = ("ptxas info    : 0 bytes gmem\n"
           "ptxas         .     192 bytes stack frame, 192 bytes spill stores, 288 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers\n"
           "info    : used 255 registers, used 1 barriers, 192 stack, 1024 bytes smem, 952 bytes cmem[0]\n")
    assert parse_resource_usage(log) == {"registers": 255, "stack_frame_bytes": 192, "spill_store_bytes": 192,
                                         "spill_load_bytes": 288, "barriers": 1, "linker_smem_bytes": 1024}
    with pytest.raises(ValueError, match="log"):
        parse_resource_usage("nothing useful")


def test_opcode_reads_ptx_and_sass():
    assert opcode("\t@%p3 bra \t$L__BB0_4;") == "bra"
    assert opcode("\tshfl.sync.bfly.b32 \t%r80|%p125, %r76, %r78, %r77, %r79;") == "shfl.sync.bfly.b32"
    assert opcode("        /*7640*/                   SHFL.BFLY PT, R89, R88, 0x8, 0x1f ;") == "SHFL.BFLY"
    assert opcode("        /*0090*/              @!P0 LDS R4, [R2] ;") == "LDS"
    assert opcode("\t// begin inline asm") is None
    assert opcode("\t.reg .pred \t%p<5>;") is None


SMALL_PTX = ("\tmov.u32 \t%r1, 0;", "\t// begin inline asm", "\tex2.approx.f32 \t%f2, %f1;",
             "\tadd.f32 \t%f3, %f2, %f2;", "", "\tmov.u32 \t%r2, 1;", "\tmov.u32 \t%r3, 2;",
             "\tshfl.sync.bfly.b32 \t%r4|%p1, %r3, 8, 31, -1;")


def test_excerpt_and_counts():
    ptx = "\n".join(SMALL_PTX)
    assert instruction_counts(ptx, ["ex2.approx", "mov", "fma"]) == {"ex2.approx": 1, "mov": 3, "fma": 0}
    excerpt = ptx_excerpt(ptx, ["ex2.approx", "shfl.sync.bfly"], max_lines=10, context=1)
    lines = excerpt.splitlines()
    assert "ex2.approx.f32" in lines[1] and "shfl.sync.bfly" in lines[-1]
    assert "// begin inline asm" not in excerpt and "    ..." in lines
    assert "none of" in ptx_excerpt(ptx, ["wgmma"])


def test_occupancy_on_h100():
    small = {"registers": 168, "n_threads": 128, "dynamic_smem_bytes": 0, "static_smem_bytes": 0}
    assert occupancy(small)["blocks_per_sm"] == 3  # 168 regs × 128 threads: 3 blocks of 64K registers
    assert occupancy(small)["limited_by"] == "registers"
    big_smem = dict(small, registers=32, dynamic_smem_bytes=100 * 1024)
    assert occupancy(big_smem)["blocks_per_sm"] == 2
    assert occupancy(big_smem)["limited_by"] == "shared memory"


def test_reports_are_kept_on_disk_and_rebuilt_when_damaged(tmp_path, monkeypatch):
    """A report compiled once is read back by the next process that asks (lessons, `flashcore run`
    and the tests ask for the same ones); a damaged entry is compiled again, never trusted; with
    FLASHCORE_CACHE=0 nothing is kept. The compiler is replaced by a counter here."""
    from flashcore_numba.arch import cache
    from flashcore_numba.measure import machine_code

    compiled = []

    def fake_report(phase_id, head_dim, sass, dtype="float16"):
        compiled.append((phase_id, head_dim, dtype))
        return {"phase": phase_id, "registers": 42, "sass": "SASS" if sass else None}

    monkeypatch.setattr(machine_code, "_report_here", fake_report)
    monkeypatch.setattr(machine_code, "find_disassembler", lambda: "nvdisasm")
    monkeypatch.setattr(cache, "toolchain", lambda: {"numba-cuda": "test"})
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FLASHCORE_CACHE", raising=False)

    first = machine_code._report_kept("09", 64, False)
    again = machine_code._report_kept("09", 64, True)
    assert compiled == [("09", 64, "float16")]  # once, with its SASS kept for whoever asks for it
    assert first["sass"] is None and again["sass"] == "SASS" and again["registers"] == 42
    machine_code._report_kept("09", 128, False)
    assert len(compiled) == 2  # another head dim is another report

    (entry,) = [p for p in (tmp_path / "reports").glob("*.json") if '"head_dim": 64' in p.read_text()]
    entry.write_text(entry.read_text()[:20])  # truncated
    assert machine_code._report_kept("09", 64, False)["registers"] == 42 and len(compiled) == 3

    monkeypatch.setenv("FLASHCORE_CACHE", "0")
    machine_code._report_kept("09", 64, False)
    machine_code._report_kept("09", 64, False)
    assert len(compiled) == 5


def test_the_report_assembles_what_numba_cuda_loads(monkeypatch):
    """Every report, with launch bounds or without, is assembled from the kernel's LTO-IR, as
    numba-cuda loads a kernel: it describes the kernel that runs. Assembled from the PTX, 06-inline
    at D = 64 had 149 registers in lesson 06's machine-code table where the driver reported 168 for
    the kernel launched (the LTO-IR's count). The compiler is stood in for here."""
    from flashcore_numba.measure import machine_code

    assembled = []
    log = "ptxas info    : Used 168 registers, used 1 barriers\n0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"

    def assemble(code, linked=()):
        assembled.append(code)
        return log, b""

    monkeypatch.setattr(machine_code, "compile_phase_ptx_and_ltoir", lambda *args: ("PTX", b"LTO-IR"))
    monkeypatch.setattr(machine_code, "compile_phase_ptx", lambda *args: "PTX")
    monkeypatch.setattr(machine_code, "assemble", assemble)
    for kernel_id in ("06-inline", "06", "03", "09"):  # inlined, linked PTX, plain, launch bounds
        assert machine_code._report_here(kernel_id, 64, sass=False)["registers"] == 168
    assert assembled == [b"LTO-IR"] * 4


@pytest.mark.slow
def test_one_compile_gives_the_ptx_and_the_ltoir_of_two():
    """Phase 09's report (launch bounds: assembled from its LTO-IR) takes the PTX and the LTO-IR
    from one compile (`compile_phase_ptx_and_ltoir`): the same PTX as `compile_phase_ptx`'s, and
    LTO-IR that assembles to the same machine code as `compile_phase_ltoir`'s (phase 01 here: it
    compiles in seconds). Numba's mangled names differ from compile to compile."""
    import json
    import subprocess

    script = (
        "import json, re\n"
        "from flashcore_numba.measure import machine_code as m\n"
        "ptx, ltoir = m.compile_phase_ptx_and_ltoir('01', 64)\n"
        "names = lambda s: re.sub(r'_ZN\\w+', 'NAME', s)\n"
        "log = lambda code: re.sub(r'Compile time = [\\d.]+ ms|LTOIR Container created \\(\\d+ bytes\\)', '',\n"
        "                          names(m.assemble(code)[0]))\n"
        "sass = lambda code: names(m.disassemble(m.assemble(code)[1]) or '')\n"
        "print(json.dumps({'ptx': names(ptx) == names(m.compile_phase_ptx('01', 64)),\n"
        "                  'log': log(ltoir) == log(m.compile_phase_ltoir('01', 64)),\n"
        "                  'sass': sass(ltoir) == sass(m.compile_phase_ltoir('01', 64)),\n"
        "                  'lto': isinstance(ltoir, bytes) and not ltoir.startswith(b'//')}))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=compiler_env(), check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    same = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(same.values()), same

"""CPU tests of the benchmark harness and the CLI: FLOP counting, the record schema, the
correctness gate, `flashcore report` from a fixture record, and `flashcore doctor` and
`flashcore run` on a machine without a GPU. No torch, no GPU.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from numba import cuda, int32

from flashcore_numba import PHASES
from flashcore_numba.arch.sim import simulator_enabled
from flashcore_numba.cli import main
from flashcore_numba.measure import bench, records, report
from flashcore_numba.phases import LESSONS
from flashcore_numba.reference import visible_mask

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_RECORDS = Path(__file__).parent / "data" / "bench_records"
README_TEXT = """# Some project

Text before the headline.

<!-- headline:begin -->
stale headline
<!-- headline:end -->

Text after the headline.
"""
PERFORMANCE_TEXT = """# Performance

Text before the table.

<!-- bench:begin -->
stale text
<!-- bench:end -->

Text after the table.
"""


def _cli_env(*, simulator: bool) -> dict:
    """Environment for `python -m flashcore_numba` in a child: this checkout importable, wide
    output (rich wraps at 80 columns when not on a terminal), simulator on or off."""
    env = dict(os.environ, COLUMNS="200")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if simulator:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    else:
        env.pop("NUMBA_ENABLE_CUDASIM", None)
    return env


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------
def test_flops_non_causal():
    assert bench.attention_flops(2, 3, 128, 96, 64, False) == 4 * 2 * 3 * 128 * 96 * 64
    assert bench.Problem.from_shape((16, 16, 2048, 64)).flops == 4 * 16 * 16 * 2048 * 2048 * 64


def test_flops_causal_square_is_half():
    assert bench.attention_flops(2, 3, 128, 128, 64, True) == 2 * 3 * 128 * 128 * 64 * 4 // 2
    assert bench.visible_pairs(128, 128, True) == 128 * 129 // 2  # the exact count differs by 1/S


@pytest.mark.parametrize("seq_q, seq_k", [(5, 8), (8, 5), (1, 7), (7, 1), (64, 48), (48, 64), (3, 3)])
def test_flops_causal_rectangular_counts_the_visible_pairs(seq_q, seq_k):
    brute = int(visible_mask(seq_q, seq_k, True).sum())
    assert bench.visible_pairs(seq_q, seq_k, True) == brute
    if seq_q != seq_k:
        assert bench.attention_flops(2, 3, seq_q, seq_k, 64, True) == 4 * 2 * 3 * 64 * brute


def test_sweep_keeps_tokens_per_launch():
    points = bench.sweep_problems(bench.Problem.from_shape((16, 16, 2048, 64), causal=True))
    assert [p.S_q for p in points] == [512, 1024, 2048, 4096, 8192, 16384]
    assert {p.B * p.S_q for p in points} == {16 * 2048}
    assert all(p.causal and p.H == 16 for p in points)


def test_default_record_path_names_gpu_and_problem():
    path = records.default_record_path("NVIDIA H100 80GB HBM3", bench.Problem.from_shape((16, 16, 2048, 64),
                                                                                         causal=True))
    assert path.name == "nvidia-h100-80gb-hbm3_b16h16s2048d64_fp16_causal.json"
    assert path.parent.name == "bench"
    partial = records.default_record_path("H100", bench.Problem.from_shape((1, 2, 512, 128)), sweep=True,
                                          phase_ids=["05", "03"])
    assert partial.name == "h100_sweep_b1h2s512d128_fp16_p03-05.json"  # never overwrites the full ladder


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------
PROVENANCE = {"gpu_name": "Test GPU", "git_commit": None, "git_dirty": None}
ORACLE = {"reference": "test", "yardstick": "test"}


def _fake_results(flops):
    timed = records.Result("01", "phase", "Phase one", correct=True, message="ok", max_err=1e-4,
                           allowed_err=2e-3, registers=40, static_smem_bytes=0, dynamic_smem_bytes=1024,
                           local_bytes_per_thread=0)
    bench.set_timing(timed, [2.0, 1.0, 3.0, 2.0], flops, ceiling_tflops=500.0)
    wrong = records.Result("02", "phase", "Phase two", correct=False, message="max error 1 > allowed 0.002",
                           max_err=1.0, allowed_err=2e-3)
    peer = records.unavailable("sdpa_cudnn", "peer", "torch SDPA, cuDNN backend", "no cuDNN")
    return [timed, wrong, peer]


def test_record_schema_round_trip():
    problem = bench.Problem.from_shape((1, 2, 256, 64))
    record = records.build_record(problem=problem, results=_fake_results(problem.flops), provenance=PROVENANCE,
                                  timing=bench.Timing(), ceiling={"what": "test", "tflops": 500.0},
                                  oracle=ORACLE, command=["flashcore", "bench"], seed=7)
    assert records.validate_record(record) == []
    record = json.loads(json.dumps(record))  # what a reader of the file sees
    assert records.validate_record(record) == []
    assert record["config"] == {"B": 1, "H": 2, "S_q": 256, "S_k": 256, "D": 64, "dtype": "float16",
                                "causal": False}
    timed, wrong, peer = record["results"]
    assert timed["median_ms"] == 2.0 and timed["min_ms"] == 1.0 and timed["max_ms"] == 3.0
    assert timed["tflops"] == pytest.approx(problem.flops / 2e-3 / 1e12)
    assert timed["pct_of_ceiling"] == pytest.approx(100 * timed["tflops"] / 500.0)
    assert timed["registers"] == 40 and timed["dynamic_smem_bytes"] == 1024
    assert wrong["correct"] is False and wrong["tflops"] is None and wrong["median_ms"] is None
    assert peer == {**peer, "available": False, "reason": "no cuDNN"}
    assert "registers" not in peer


def test_record_carries_mean_p99_tail_and_call():
    problem = bench.Problem.from_shape((1, 2, 256, 64))
    timed, wrong, peer = _fake_results(problem.flops)
    assert timed.mean_ms == 2.0 and timed.p99_ms == pytest.approx(2.97)
    timed.tail = bench.distribution([1.0] * 98 + [1.6, 9.0])
    timed.call = dict(bench.distribution([1.1, 1.2, 1.3]), host_median_us=12.0, host_p99_us=20.0, host_max_us=21.0)
    timed.launch_loop = dict(bench.distribution([1.0, 1.1, 1.2]), host_median_us=4.0, host_p99_us=5.0,
                             host_max_us=6.0, launch="plan")
    assert timed.tail["slow"] == 2 and timed.tail["n"] == 100 and timed.tail["max_ms"] == 9.0
    record = records.build_record(problem=problem, results=[timed, wrong, peer], provenance=PROVENANCE,
                                  timing=bench.Timing(tail=100, calls=3), ceiling=None, oracle=ORACLE, command=[],
                                  seed=1)
    record = json.loads(json.dumps(record))
    assert records.validate_record(record) == []
    assert record["results"][0]["tail"]["slow"] == 2 and record["results"][0]["call"]["host_median_us"] == 12.0
    assert "tail" not in record["results"][1] and "call" not in record["results"][2]  # absent where not measured
    assert record["results"][0]["launch_loop"]["median_ms"] == 1.1
    assert "launch_loop" not in record["results"][1]
    record["results"][0]["tail"]["p99_ms"] = "fast"
    assert any("tail" in e for e in records.validate_record(record))
    record["results"][0]["tail"]["p99_ms"] = 1.0
    record["results"][0]["launch_loop"]["median_ms"] = None
    assert any("launch_loop" in e for e in records.validate_record(record))
    record["results"][0]["launch_loop"]["median_ms"] = 0.0  # the README divides by it
    assert any("positive median" in e for e in records.validate_record(record))
    record["results"][0]["launch_loop"]["median_ms"] = 1.1
    record["results"][0]["launch_loop"]["launch"] = "numba"  # older records have no key; new ones the plan's
    assert any("launch_loop.launch" in e for e in records.validate_record(record))
    del record["results"][0]["launch_loop"]["launch"]
    assert records.validate_record(record) == []
    del record["results"][0]["call"]  # a launch loop is the yardstick of a call: not without one
    assert any("launch_loop: only a phase's" in e for e in records.validate_record(record))


def test_paired_call_times_alternate_the_call_and_the_launch():
    """The call and its kernel's launch loop in alternating runs (call, launch | launch, call | ...),
    n timed each, after three untimed calls a run: each its own distribution, with the host's time."""
    order = []

    class Device:
        clock = 0.0

        def event(self):
            return SimpleNamespace(at=None)

        def record(self, event):
            event.at = self.clock

        def elapsed(self, a, b):
            return b.at - a.at

        def synchronize(self):
            pass

    device = Device()

    def timed(name, ms):
        def f():
            order.append(name)
            device.clock += ms
        return f

    call, loop = bench.paired_call_times(device, timed("call", 2.0), timed("launch", 1.5), 10, rounds=4)
    runs = [name for i, name in enumerate(order) if i == 0 or order[i - 1] != name]  # a round's second
    assert runs == ["call", "launch", "call", "launch", "call"]  # run and the next one's first merge
    assert order.count("call") == order.count("launch") == 10 + 4 * 3  # n, and 3 untimed a run
    assert call["n"] == loop["n"] == 10 and call["median_ms"] == 2.0 and loop["median_ms"] == 1.5
    assert call["host_median_us"] >= 0 and "host_p99_us" in loop


class _ScriptedClock:
    """A device for queued_times whose sleeps last what was asked, and a host clock of its own (so the
    test does not depend on how busy the machine is): a launch takes the host 1 µs, or `slow_host_s` in
    the first measured batch, longer than the GPU's sleep."""

    def __init__(self, slow_host_s=0.0):
        self.sleeps, self.slow_host_s, self.launches, self.now = [], slow_host_s, 0, 0.0

    def perf_counter(self):
        return self.now

    def event(self):
        return SimpleNamespace(ms=None)

    def record(self, event):
        event.ms = self.sleeps[-1] if self.sleeps else 0.0

    def elapsed(self, start, end):
        return 1.0 if start.ms == end.ms else end.ms  # a launch: 1 ms; the sleep: what was asked

    def synchronize(self):
        pass

    def flush(self):
        pass

    def sleep(self, ms):
        self.sleeps.append(ms)

    def launch(self):
        self.launches += 1
        slow = self.slow_host_s and len(self.sleeps) == 1
        self.now += self.slow_host_s if slow else 1e-6


def test_queued_times_drops_a_batch_the_host_could_have_entered(monkeypatch):
    clock = _ScriptedClock()
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    assert bench.queued_times(clock, clock.launch, 45, flush=True, batch=20) == [1.0] * 45
    assert len(clock.sleeps) == 3 and clock.launches == 20 + 45  # one batch to size the sleep, then 20, 20, 5
    slow = _ScriptedClock(slow_host_s=0.01)  # 20 launches of 10 ms: longer than a sleep sized on a fast batch
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=slow.perf_counter))
    assert bench.queued_times(slow, slow.launch, 20, flush=False, batch=20) == [1.0] * 20
    assert len(slow.sleeps) == 2 and slow.sleeps[1] == 2 * slow.sleeps[0]  # dropped, then again behind twice the sleep


def test_capped_launch_counts():
    assert bench.capped(1000, 0.5, 5.0) == 1000
    assert bench.capped(1000, 47.0, 5.0) == 106  # phase 01 at the reference shape: about 5 s
    assert bench.capped(1000, 5000.0, 5.0) == 20 and bench.capped(10, 5000.0, 5.0) == 10


def test_record_schema_rejects_bad_records():
    problem = bench.Problem.from_shape((1, 2, 256, 64))
    good = records.build_record(problem=problem, results=_fake_results(problem.flops), provenance=PROVENANCE,
                                timing=bench.Timing(), ceiling=None, oracle=ORACLE, command=[], seed=1)
    cases = {
        "a correct result must be timed": lambda r: r["results"][0].pop("tflops"),
        "must not carry a speed figure": lambda r: r["results"][1].update(tflops=9.9),
        "must say why": lambda r: r["results"][2].pop("reason"),
        "missing key 'flops'": lambda r: r.pop("flops"),
        "config.B": lambda r: r["config"].update(B="16"),
        "kind": lambda r: r["results"][0].update(kind="kernel"),
    }
    for expected, corrupt in cases.items():
        record = json.loads(json.dumps(good))
        corrupt(record)
        errors = records.validate_record(record)
        assert any(expected in e for e in errors), (expected, errors)


class FakeTimedDevice(bench.NumbaDevice):
    """The simulator's device, with fixed timings: run_benchmark end to end without a GPU."""

    def __init__(self):
        super().__init__()
        self.timed = 0

    def time_ms(self, fn, timing):
        self.timed += 1
        return [1.0, 2.0, 3.0]

    def ceiling(self, dtype, timing):
        return {"what": "fake", "median_ms": 1.0, "tflops": 100.0}


@pytest.mark.skipif(not simulator_enabled(), reason="uses the CUDA simulator")
def test_run_benchmark_builds_a_valid_record():
    device = FakeTimedDevice()
    problem = bench.Problem(1, 1, 16, 16, 64)
    record = bench.run_benchmark(problem, phase_ids=["01"], peer_names=["sdpa_flash"],
                                 timing=bench.Timing(1, 3), command=["flashcore", "bench"], device=device)
    assert records.validate_record(record) == []
    phase, peer = record["results"]
    assert phase["correct"] is True and phase["median_ms"] == 2.0
    assert phase["tflops"] == pytest.approx(problem.flops / 2e-3 / 1e12)
    assert phase["pct_of_ceiling"] == pytest.approx(phase["tflops"])  # ceiling 100 TFLOPS
    assert peer["available"] is False and "torch" in peer["reason"]
    assert record["ceiling_tflops"] == 100.0 and device.timed == 1

    sweep = bench.run_benchmark(bench.Problem(2, 1, 16, 16, 64, causal=True), phase_ids=["01"], peer_names=[],
                                timing=bench.Timing(1, 3), sweep_lengths=(16, 32), device=device)
    assert records.validate_record(sweep) == []
    assert [(p["S"], p["B"]) for p in sweep["sweep"]] == [(16, 2), (32, 1)]
    assert all(p["results"][0]["correct"] for p in sweep["sweep"])


class _FakeConfig:
    """A kernel config whose 'kernel' writes nothing, or zeros."""

    def __init__(self, write_zeros):
        self.write_zeros, self.smem_bytes = write_zeros, 0

    def launch(self, q, k, v, o, causal, qk_scale, stream=0):
        if self.write_zeros:
            o.copy_to_device(np.zeros(o.shape, dtype=np.float16))


@pytest.mark.skipif(not simulator_enabled(), reason="uses the CUDA simulator")
@pytest.mark.parametrize("write_zeros, expected", [(False, "still NaN"), (True, "max error")])
def test_wrong_output_fails_the_gate_and_is_not_timed(write_zeros, expected):
    fake_phase = SimpleNamespace(ID="99", TITLE="Broken", HEAD_DIMS=(64,),
                                 build=lambda D: _FakeConfig(write_zeros))
    device = FakeTimedDevice()
    problem = bench.Problem(1, 1, 8, 8, 64)
    results, _, _ = bench.bench_problem(problem, [fake_phase], [], device, bench.Timing(1, 3))
    (result,) = results
    assert result.correct is False and expected in result.message
    assert result.median_ms is None and result.tflops is None and device.timed == 0


@pytest.mark.skipif(not simulator_enabled(), reason="uses the CUDA simulator")
def test_phase_without_the_dtype_is_skipped_with_a_reason():
    problem = bench.Problem(1, 1, 8, 8, 64, dtype="bfloat16")
    result, launch = bench.check_phase(PHASES["01"], bench.NumbaDevice(), None, problem, None, None)
    assert result.available is False and "float16" in result.reason and launch is None


# ---------------------------------------------------------------------------------------------
# flashcore report, from the fixture records
# ---------------------------------------------------------------------------------------------
@pytest.fixture()
def report_tree(tmp_path):
    """A temporary README, docs/performance.md, phase files and record directory: the real ones are
    never touched."""
    records = tmp_path / "docs" / "bench"
    shutil.copytree(FIXTURE_RECORDS, records)
    (tmp_path / "README.md").write_text(README_TEXT)
    (tmp_path / "docs" / "performance.md").write_text(PERFORMANCE_TEXT)
    phases_dir = tmp_path / "phases"
    phases_dir.mkdir()
    for phase_id in ("01", "02", "03"):
        shutil.copy(PHASES[phase_id].__file__, phases_dir)
    return SimpleNamespace(root=tmp_path, records=records, readme=tmp_path / "README.md",
                           performance=tmp_path / "docs" / "performance.md", phases=phases_dir)


def _generate(tree):
    return report.generate(records_dir=tree.records, readme=tree.readme, phases_dir=tree.phases)


def test_report_table_from_fixture(report_tree):
    _generate(report_tree)
    text = report_tree.performance.read_text()
    assert text.startswith("# Performance\n\nText before the table.")
    assert text.endswith("Text after the table.\n")
    assert "stale text" not in text
    block = text[text.index(report.BEGIN):text.index(report.END)]
    assert "#### The ladder, B=16 H=16 S=2048 D=64 fp16" in block
    assert "Fixture GPU (test data, not a measurement)" in block and "2026-11-20" in block
    assert "| 01 | Naive: one thread per query row | 1.00 |  | 0.80 |" in block
    assert "| 02 | Shared-memory tiling of K and V | 3.00 | 3.00× vs 01 | 2.40 | 3.00× vs 01 |" in block
    assert "| 2.50 | 0.83× vs 02 (**slower**) | FAILED check |" in block
    assert "| SDPA | torch SDPA, flash backend | 298 |  | 262 |" in block
    assert "| SDPA | torch SDPA, cuDNN backend | n/a |" in block and "fixture: no cuDNN here" in block
    assert "42.6% / 37.4%" in block  # 298 and 262 of the 700-TFLOPS ceiling
    assert "(bench/fixture_b16h16s2048d64_fp16.json)" in block  # relative to docs/
    assert "(bench/fixture_b16h16s2048d64_fp16_causal.json)" in block
    assert "Text after" not in block
    assert "| 01 |" not in report_tree.readme.read_text()  # the ladder is no part of the README's headline


def test_report_plots_from_fixture(report_tree):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e '.[notebooks]')",
                        exc_type=ImportError)
    _generate(report_tree)
    text = report_tree.performance.read_text()
    block = text[text.index(report.BEGIN):text.index(report.END)]
    for plot in ("ladder.png", "sweep.png"):
        path = report_tree.records / plot
        assert path.stat().st_size > 10_000
        assert f"(bench/{plot})" in block
    headline = report_tree.readme.read_text()
    assert "(docs/bench/ladder.png)" in headline and "sweep.png" not in headline


def test_report_without_matplotlib(report_tree, monkeypatch):
    """Without matplotlib (the `notebooks` extra) the report writes the table, no plots, and says so."""
    def missing():
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    monkeypatch.setattr(report, "_pyplot", missing)
    summary = _generate(report_tree)
    assert "plots skipped: matplotlib is not installed (pip install matplotlib)" in summary
    text = report_tree.performance.read_text()
    assert "| 01 | Naive: one thread per query row | 1.00 |" in text and ".png" not in text
    assert ".png" not in report_tree.readme.read_text()
    assert not list(report_tree.records.glob("*.png"))


def test_report_launch_times_and_flags(report_tree):
    """Records of the device-only protocol carry mean and p99, the tail and the call: the README gets a
    launch-times table, and a kernel whose mean exceeds its median by more than 5 % is flagged there
    and in the command's summary. The fixture's older records carry none of it: no table."""
    _generate(report_tree)
    assert "#### Launch times" not in report_tree.performance.read_text()
    path = report_tree.records / "fixture_b16h16s2048d64_fp16.json"
    record = json.loads(path.read_text())
    for r in record["results"]:
        if r.get("correct"):
            r.update(mean_ms=r["median_ms"], p99_ms=r["max_ms"])
    first = record["results"][0]
    first["mean_ms"] = 1.2 * first["median_ms"]  # a tail in the kernel time
    first["tail"] = bench.distribution([1.0] * 997 + [2.0, 9.0, 9.0])
    first["call"] = dict(bench.distribution([1.5] * 10), host_median_us=30.0, host_p99_us=40.0, host_max_us=41.0)
    first["launch_loop"] = dict(bench.distribution([1.2] * 10), host_median_us=5.0, host_p99_us=6.0,
                                host_max_us=7.0)
    path.write_text(json.dumps(record))
    summary = _generate(report_tree)
    block = report_tree.performance.read_text()
    block = block[block.index(report.BEGIN):block.index(report.END)]
    assert "#### Launch times" in block
    row = next(line for line in block.splitlines() if line.startswith("| 01 |") and "**mean +20%**" in line)
    assert "**3 of 1000**" in row and "1.5 / 1.5 (30 µs)" in row
    assert "01 (B=16 H=16 S=2048 D=64 fp16): kernel time's mean 20% above its median" in block
    assert any(line.startswith("FLAGGED: 01 (B=16 H=16 S=2048 D=64 fp16): kernel time's mean 20%") for line in summary)
    # the call times of the record: one row of the table of what a call costs
    assert "#### What a call costs" in block
    row = next(line for line in block.splitlines() if line.startswith("| 16, 16, 2048, 2048, 64 fp16 |"))
    assert row.startswith(f"| 16, 16, 2048, 2048, 64 fp16 | 01 | 1500 / 1500 | {first['median_ms'] * 1e3:.0f} |")
    assert row.endswith("| 1.25 | 30 | — | — | — |")  # call / its kernel's launches: 1.5 / 1.2
    # a run of one kernel at a small shape is a row of that table, not a ladder of its own
    # whose launch loop waited on the host (Numba's launch outlasting the kernel): no ratio, "host"
    host_bound = dict(first["launch_loop"], host_median_us=0.9e3 * first["launch_loop"]["median_ms"])
    small = dict(record, created="2026-11-30T00:00:00+00:00", config=dict(record["config"], B=1, S_q=128, S_k=128),
                 results=[dict(first, launch_loop=host_bound)])
    (report_tree.records / "small_p01.json").write_text(json.dumps(small))
    _generate(report_tree)
    block = report_tree.performance.read_text()
    assert "| 1, 16, 128, 128, 64 fp16 | 01 |" in block and "#### B=1 H=16 S=128" not in block
    row = next(line for line in block.splitlines() if line.startswith("| 1, 16, 128, 128, 64 fp16 |"))
    assert row.endswith("| host | 30 | — | — | — |")
    # the plan's launch loop (the driver launch attention() makes): a ratio where the board set its pace
    small["results"][0]["launch_loop"] = dict(first["launch_loop"], launch="plan")
    (report_tree.records / "small_p01.json").write_text(json.dumps(small))
    _generate(report_tree)
    row = next(line for line in report_tree.performance.read_text().splitlines()
               if line.startswith("| 1, 16, 128, 128, 64 fp16 |"))
    assert row.endswith("| 1.25 | 30 | — | — | — |")
    # another GPU's call times: a table of its own, the GPU measured last first, each under its name
    other = dict(small, created="2999-01-01T00:00:00+00:00", provenance=dict(small["provenance"], gpu_name="Newer GPU"))
    (report_tree.records / "small_p01_newer.json").write_text(json.dumps(other))
    _generate(report_tree)
    block = report_tree.performance.read_text()
    block = block[block.index("#### What a call costs"):block.index(report.END)]
    titles = [line for line in block.splitlines() if line.startswith("On the ")]
    assert len(titles) == 2 and titles[0].startswith("On the Newer GPU (2999-01-01; ")
    assert titles[1].startswith(f"On the {small['provenance']['gpu_name']} (")
    newer = block[block.index(titles[0]):block.index(titles[1])]
    assert "| 1, 16, 128, 128, 64 fp16 | 01 |" in newer and "| 16, 16, 2048, 2048, 64 fp16 |" not in newer
    # a run of two phases: the row is the faster one's (what "best" runs there), not the newer name's
    slow = dict(first, name="10", median_ms=2 * first["median_ms"])
    (report_tree.records / "small_p01_newer.json").write_text(json.dumps(dict(other, results=[dict(first), slow])))
    _generate(report_tree)
    block = report_tree.performance.read_text()
    assert "| 1, 16, 128, 128, 64 fp16 | 01 |" in block and "| 1, 16, 128, 128, 64 fp16 | 10 |" not in block


def test_report_marks_sweep_points_whose_launches_spread(report_tree, monkeypatch):
    """A sweep point whose fastest launch is more than 5 % below its median, or which another record of
    the same problem contradicts by more than 5 %, is named in the summary (and drawn hollow in
    sweep.png, with the same note); a point whose slowest launch alone is far off is not."""
    def no_plots():  # the summary alone (test_report_plots_from_fixture draws the plots)
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    path = report_tree.records / "fixture_sweep_b16h16s2048d64_fp16.json"
    record = json.loads(path.read_text())
    at_512, at_1024 = record["sweep"]
    at_1024["results"][0]["min_ms"] = 0.8 * at_1024["results"][0]["median_ms"]  # 01 at S=1024
    at_512["results"][0]["max_ms"] = 3 * at_512["results"][0]["median_ms"]  # one slow launch: the median holds
    path.write_text(json.dumps(record))
    other = {k: v for k, v in record.items() if k != "sweep"}  # one problem: sdpa_flash at S=512, half as fast
    other.update(created="2026-11-30T00:00:00+00:00", config=at_512["config"], flops=at_512["flops"],
                 results=[dict(at_512["results"][1], tflops=0.5 * at_512["results"][1]["tflops"])])
    (report_tree.records / "other_b64h16s512d64_fp16.json").write_text(json.dumps(other))
    monkeypatch.setattr(report, "_pyplot", no_plots)
    summary = _generate(report_tree)
    flags = [line for line in summary if line.startswith("FLAGGED: sweep")]
    assert flags == [("FLAGGED: sweep D=64 non-causal, S=512, sdpa_flash: 180 TFLOPS, 90.0 TFLOPS in "
                      "other_b64h16s512d64_fp16.json"),
                     "FLAGGED: sweep D=64 non-causal, S=1024, 01: 1.10 TFLOPS, fastest launch 20% below the median"]
    monkeypatch.undo()
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e '.[notebooks]')",
                        exc_type=ImportError)
    found = records.load_records(report_tree.records)
    sweep = next(r for r in found if "sweep" in r)
    assert set(report.sweep_spreads(sweep, found)) == {(512, "sdpa_flash"), (1024, "01")}
    assert report.plot_sweep([(sweep, None)], report_tree.root / "sweep.png", found).stat().st_size > 10_000


def test_report_phase_docstrings_from_fixture(report_tree):
    _generate(report_tree)
    texts = {pid: next(report_tree.phases.glob(f"p{pid}_*.py")).read_text() for pid in ("01", "02", "03")}
    for text in texts.values():
        ast.parse(text)  # still a valid module
        assert "not measured yet" not in text
    assert re.search(r"fp16: 1\.00 TFLOPS,\s+causal 0\.80 TFLOPS; 41 registers, 0 B local memory",
                     texts["01"])
    assert re.search(r"3\.00 TFLOPS\s+\(3\.00x phase 01\), causal 2\.40 TFLOPS \(3\.00x phase 01\)",
                     texts["02"])
    assert re.search(r"2\.50 TFLOPS\s+\(0\.83x phase 02, SLOWER than phase 02\)", texts["03"])
    assert re.search(r"causal FAILED the correctness\s+gate", texts["03"])
    # the rest of each file is untouched
    original = Path(PHASES["02"].__file__).read_text()
    assert texts["02"].split("[measured:end]")[1] == original.split("[measured:end]")[1]
    assert texts["02"].split("[measured:begin]")[0] == original.split("[measured:begin]")[0]


def _headline_record(gpu, problem, rows, created, *, backward_pass=False):
    """A record of `rows` ((name, kind, ms) each) on `gpu`, as `flashcore bench` writes one."""
    results = []
    for name, kind, ms in rows:
        r = records.Result(name, kind, f"title of {name}", correct=True, message="ok", max_err=1e-4,
                           allowed_err=1e-3)
        bench.set_timing(r, [ms] * 3, problem.flops, None)
        results.append(r)
    record = records.build_record(problem=problem, results=results,
                                  provenance={"gpu_name": gpu, "git_commit": "abc1234" + "0" * 33, "git_dirty": False},
                                  timing=bench.Timing(), ceiling=None, oracle={"reference": "t", "yardstick": "t"},
                                  command=["flashcore", "bench"], seed=1)
    record["created"] = created
    if backward_pass:
        record["config"]["pass"] = "backward"
    return record


def test_report_headline_from_fixture(report_tree):
    """The README's headline: phase 09 and phase 13 at the four reference problems and phase 10 at each
    decode step, each beside SDPA flash, SDPA cuDNN and FlexAttention of its own run, on the GPU whose
    records fill most of it; a missing record or peer says "not measured" in the table and in the
    command's summary, never a silent gap."""
    summary = _generate(report_tree)
    text = report_tree.readme.read_text()
    assert text.startswith("# Some project\n\nText before the headline.") and text.endswith("Text after the headline.\n")
    headline = text[text.index(report.HEADLINE_BEGIN):text.index(report.HEADLINE_END)]
    assert "stale headline" not in headline
    assert ("| forward, 09 (TFLOPS) | B=16 H=16 S=2048 D=64 fp16 | not measured | not measured | not measured | "
            "not measured | — |") in headline
    assert "| backward, 13 (TFLOPS) | B=16 H=16 S=2048 D=64 fp16 | not measured |" in headline
    assert "|  | B=16 H=16 S=2048 D=128 fp16 causal | not measured |" in headline
    assert "[docs/performance.md](docs/performance.md)" in headline
    assert ("NOT MEASURED: Fixture GPU (test data, not a measurement): forward phase 09, B=16 H=16 S=2048 D=64 fp16: "
            "no record") in summary

    gpu = "Headline GPU"
    forward = bench.Problem.from_shape((16, 16, 2048, 64))
    records.write_record(_headline_record(gpu, forward, [("09", "phase", 1.0), ("sdpa_flash", "peer", 1.5),
                                                         ("sdpa_cudnn", "peer", 1.25)], "2026-12-01T00:00:00"),
                         report_tree.records / "h_fwd.json")
    backward = bench.Problem.from_shape((16, 16, 2048, 128), causal=True)
    records.write_record(_headline_record(gpu, backward, [("13", "phase", 2.0), ("sdpa_flash", "peer", 1.0)],
                                          "2026-12-02T00:00:00", backward_pass=True),
                         report_tree.records / "backward" / "h_bwd.json")
    decode = bench.Problem(1, 32, 1, 32768, 128, "float16", False, 8)
    records.write_record(_headline_record(gpu, decode, [("10", "phase", 0.05), ("sdpa_flash", "peer", 0.06),
                                                        ("sdpa_cudnn", "peer", 0.055), ("flex_attention", "peer", 0.1)],
                                          "2026-12-03T00:00:00"), report_tree.records / "h_dec.json")
    summary = _generate(report_tree)
    headline = report_tree.readme.read_text()
    assert "On the **Headline GPU** (2026-12-01 to 2026-12-03, code at commit `abc1234`)" in headline
    assert ("| forward, 09 (TFLOPS) | [B=16 H=16 S=2048 D=64 fp16](docs/bench/h_fwd.json) | 275 | 183 | 220 | "
            "not measured | 1.25× SDPA cuDNN |") in headline
    assert "|  | B=16 H=16 S=2048 D=64 fp16 causal | not measured |" in headline  # no record: no link, no figure
    assert ("|  | [B=16 H=16 S=2048 D=128 fp16 causal](docs/bench/backward/h_bwd.json) | 137 | 275 | not measured | "
            "not measured | 0.50× SDPA flash |") in headline  # half the speed of SDPA flash's backward
    assert ("| decode step, 10 (µs) | [B=1 H=32 H_kv=8 S_q=1 S_k=32768 D=128 fp16](docs/bench/h_dec.json) | 50 | 60 | "
            "55 | 100 | 1.10× SDPA cuDNN |") in headline
    assert "On the **Fixture GPU" not in headline  # the GPU with the fuller headline is shown (its ladder plot stays)
    assert "NOT MEASURED: Headline GPU: forward phase 09, B=16 H=16 S=2048 D=64 fp16: FlexAttention not in h_fwd.json" \
        in summary
    assert "NOT MEASURED: Headline GPU: backward phase 13, B=16 H=16 S=2048 D=128 fp16 causal: SDPA cuDNN not in " \
        "h_bwd.json" in summary


def test_report_is_idempotent_and_records_are_read_back(report_tree):
    _generate(report_tree)
    first = report_tree.readme.read_text(), report_tree.performance.read_text()
    summary = _generate(report_tree)
    assert (report_tree.readme.read_text(), report_tree.performance.read_text()) == first
    assert any(line.endswith("headline unchanged") for line in summary)
    assert any(line.endswith("performance tables unchanged") for line in summary)
    numbers = report.measured_phase("03", report.load_records(report_tree.records))
    assert numbers["noncausal"]["tflops"] == pytest.approx(2.5)
    assert numbers["causal"]["correct"] is False
    assert numbers["speedup_noncausal"][0] == "02"
    assert numbers["speedup_noncausal"][1] == pytest.approx(2.5 / 3.0)


def test_report_prefers_the_full_ladder_over_a_newer_partial_run(report_tree):
    full = json.loads((report_tree.records / "fixture_b16h16s2048d64_fp16.json").read_text())
    partial = dict(full, created="2026-12-01T00:00:00+00:00",
                   results=[dict(r, tflops=9.99) for r in full["results"] if r["name"] == "02"])
    (report_tree.records / "fixture_b16h16s2048d64_fp16_p02.json").write_text(json.dumps(partial))
    _generate(report_tree)
    text = report_tree.performance.read_text()
    assert "9.99" not in text and "| 01 | Naive: one thread per query row | 1.00 |" in text


def test_report_errors_are_clear(report_tree):
    (report_tree.records / "broken.json").write_text('{"schema": 1}')
    with pytest.raises(report.ReportError, match="broken.json"):
        _generate(report_tree)
    (report_tree.records / "broken.json").unlink()
    report_tree.performance.write_text("# no markers here\n")
    with pytest.raises(report.ReportError, match="bench:begin"):
        _generate(report_tree)
    report_tree.performance.write_text(PERFORMANCE_TEXT)
    report_tree.readme.write_text("# no markers here\n")
    with pytest.raises(report.ReportError, match="headline:begin"):
        _generate(report_tree)
    report_tree.performance.unlink()
    with pytest.raises(report.ReportError, match="--performance: .*performance.md does not exist"):
        _generate(report_tree)


def test_report_without_records(report_tree, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    report.generate(records_dir=empty, readme=report_tree.readme, phases_dir=report_tree.phases)
    assert "No benchmark record yet" in report_tree.readme.read_text()
    assert "No benchmark record yet" in report_tree.performance.read_text()
    assert "not measured yet" in next(report_tree.phases.glob("p01_*.py")).read_text()


# ---------------------------------------------------------------------------------------------
# The CLI
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, option", [
    (["bench", "--shape", "16,16"], "--shape"),
    (["bench", "--shape", "16,16,x,64"], "--shape"),
    (["run", "--shape", "1,1,0,64"], "--shape"),
    (["bench", "--phases", "01,42"], "phase"),
    (["bench", "--peers", "flashy"], "--peers"),
    (["bench", "--dtype", "fp8"], "--dtype"),
    (["bench", "--repeats", "5"], "--repeats"),
    (["bench", "--cap-seconds", "0"], "--cap-seconds"),
    (["bench", "--seq-k", "0"], "--seq-k"),
    (["bench", "--seq-k", "100", "--sweep"], "--seq-k"),
    (["bench", "--cold"], "--cold"),
    (["bench", "--first-call", "--processes", "0"], "--processes"),
    (["compile", "--cc", "nine"], "--cc"),
    (["compile", "--dtypes", "fp8"], "--dtypes"),
    (["compile", "--head-dims", "0"], "--head-dims"),
    (["compile", "--phases", "42"], "phase"),
    (["compile", "--jobs", "-1"], "--jobs"),
    (["compile", "--value-dims", "x"], "--value-dims"),
])
def test_cli_bad_arguments_give_one_line(argv, option, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and option in err and "Traceback" not in err


@pytest.mark.parametrize("argv, prog, says", [
    (["walk"], "flashcore", "invalid choice: 'walk'"),  # argparse's, at the top
    (["bench", "--dtype", "fp8"], "flashcore bench", "(see flashcore bench --help)"),  # argparse's, a command
    (["report", "--records", "no/such/dir"], "flashcore report", "--records: no/such/dir is not a directory"),
    (["grade", "03", "--seed", "x"], "flashcore grade", "(see flashcore grade --help)"),
    (["grade", "42"], "flashcore grade", "NN: "),
    (["lessons", "--timeout", "x"], "flashcore lessons", "(see flashcore lessons --help)"),
    (["lessons", "--only", "42"], "flashcore lessons", "--only: "),
])
def test_every_usage_error_has_one_form(argv, prog, says, capsys):
    """`<prog>: error: <message>` on one line and exit status 2, whichever command and whether
    argparse or the command found the mistake (usage.py)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: error: ") and err.count("\n") == 1 and says in err, err


@pytest.mark.skipif(not simulator_enabled(), reason="uses the CUDA simulator")
def test_cli_compile_refuses_the_simulator(capsys):
    assert main(["compile", "--cc", "9.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "simulator" in err and "Traceback" not in err


def test_cli_compile_names_value_head_dims(monkeypatch, capsys, tmp_path):
    """`flashcore compile --head-dims 192 --value-dims 128`: the pairs' kernels are in the list it
    compiles and named with D_v in its report (the compiling itself stood in for)."""
    from flashcore_numba import cli
    from flashcore_numba.runtime import precompile

    monkeypatch.setattr(cli, "kernel_target", lambda: "gpu")
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(tmp_path))
    seen = []

    def compile_all(items, cc, jobs, done):
        seen.extend(items)
        results = [(item, True if len(item) == 3 else "TestError: stood in") for item in items]
        for item, result in results:
            done(item, result)
        return results

    monkeypatch.setattr(precompile, "compile_all", compile_all)
    assert main(["compile", "--phases", "09,07-varlen", "--head-dims", "192", "--value-dims", "128", "--dtypes",
                 "fp16", "--cc", "9.0", "--jobs", "1"]) == 1
    assert ("09", 192, "float16", 128) in seen and ("07-varlen", 192, "float16", 128) in seen
    out = capsys.readouterr().out
    assert "09 D=192 D_v=128 float16: TestError: stood in" in out and "2 failed" in out


@pytest.mark.skipif(not simulator_enabled(), reason="uses the CUDA simulator")
def test_cli_bench_refuses_the_simulator(capsys):
    assert main(["bench"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "flashcore run" in err


@pytest.mark.skipif(not simulator_enabled(), reason="uses the CUDA simulator")
def test_cli_gpu_paths_with_a_fake_gpu(monkeypatch, tmp_path, capsys):
    """`bench` and `run` as on a GPU, with the simulator's device and fixed timings standing in:
    argument handling, tables, the record file. (The device code itself needs a real GPU.)"""
    from flashcore_numba import cli

    monkeypatch.setattr(cli, "kernel_target", lambda: "gpu")
    monkeypatch.setattr(bench, "open_device", FakeTimedDevice)
    # keep it quick: `run` checks every kernel (KERNELS), `bench` every phase; two of each here
    monkeypatch.setattr(cli, "PHASES", {pid: PHASES[pid] for pid in ("01", "02")})
    monkeypatch.setattr(cli, "KERNELS", {pid: PHASES[pid] for pid in ("01", "02")})
    monkeypatch.setenv("COLUMNS", "250")  # rich: no wrapping inside table cells
    out = tmp_path / "record.json"
    argv = ["bench", "--phases", "01", "--shape", "1,1,16,64", "--peers", "flash", "--out", str(out)]
    assert main(argv) == 0
    record = json.loads(out.read_text())
    assert records.validate_record(record) == [] and record["command"] == ["flashcore", *argv]
    assert [r["name"] for r in record["results"]] == ["01", "sdpa_flash"]
    printed = capsys.readouterr().out
    assert "Record written to" in printed and "pip install -e '.[torch]'" in printed

    sweep = tmp_path / "sweep.json"
    assert main(["bench", "--phases", "01", "--shape", "2,1,16,64", "--sweep-s", "16,32", "--peers", "none",
                 "--causal", "--out", str(sweep)]) == 0
    record = json.loads(sweep.read_text())
    assert [p["S"] for p in record["sweep"]] == [16, 32] and record["config"]["causal"] is True

    assert main(["run", "--shape", "1,1,16,64"]) == 0
    printed = capsys.readouterr().out
    assert "1.00×" in printed  # phase 02 against phase 01, with the same fake timing
    assert "flashcore bench" in printed


# `flashcore run` at 80 columns (a log, or a narrow terminal): every number whole, one line per kernel
# (name, median ms, the ms and TFLOPS the table should show; the reference shape's FLOPs)
LADDER_MS = [("01", 452.0, "452", "0.61"), ("02", 151.0, "151", "1.82"), ("03", 47.5, "47.5", "5.79"),
             ("04", 30.1, "30.1", "9.13"), ("05", 25.2, "25.2", "10.9"), ("06", 6.31, "6.31", "43.6"),
             ("06-inline", 5.9, "5.90", "46.6"), ("07", 1.62, "1.62", "170"), ("08", 0.71, "0.710", "387"),
             ("09", 0.535, "0.535", "514"), ("09-overlap", 0.55, "0.550", "500"),
             ("09-turns", 0.6, "0.600", "458"), ("09-ws", 0.65, "0.650", "423"),
             ("sdpa_flash", 0.61, "0.610", "451"), ("sdpa_cudnn", 0.52, "0.520", "529")]


def _fake_ladder() -> list[dict]:
    """A full ladder of results as `bench` records them (Result.to_dict), every kernel and both peers."""
    from flashcore_numba.phases import KERNELS

    flops = bench.Problem.from_shape(bench.REFERENCE_SHAPE).flops
    results = []
    for name, ms, _, _ in LADDER_MS:
        if name.startswith("sdpa_"):
            r = records.Result(name, "peer", f"torch SDPA, {name} backend", correct=True, message="ok",
                               max_err=1e-4, allowed_err=2e-3)
        else:
            r = records.Result(name, "phase", KERNELS[name].TITLE, correct=True, message="ok", max_err=1e-4,
                               allowed_err=2e-3, registers=168, static_smem_bytes=0, dynamic_smem_bytes=98304,
                               local_bytes_per_thread=0)
        bench.set_timing(r, [ms], flops, ceiling_tflops=989.0)
        results.append(r.to_dict())
    return results


def _rendered(renderable, width: int) -> list[str]:
    import io

    from rich.console import Console

    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    console.print(renderable)
    return console.export_text().splitlines()


def _ladder_rows(lines: list[str]) -> dict[str, str]:
    """Kernel name -> its row: the lines under the header's rule, one per kernel, in order, each
    starting with the kernel's id (or "SDPA flash"), then the notes."""
    start = next(i for i, line in enumerate(lines) if line.startswith("───")) + 1
    body = lines[start:start + len(LADDER_MS)]
    rows = {}
    for (name, *_), line in zip(LADDER_MS, body, strict=True):
        label = "SDPA " + name.removeprefix("sdpa_") if name.startswith("sdpa_") else name
        assert re.match(rf"{re.escape(label)} ", line), (name, "\n".join(lines))
        rows[name] = line
    assert not re.match(r"\w+ .* ok *$", lines[start + len(LADDER_MS)]), "\n".join(lines)  # no row more
    return rows


@pytest.mark.parametrize("width", [80, 60])
def test_run_table_keeps_every_number_whole(width):
    from flashcore_numba import cli

    title = "Phase ladder on NVIDIA H100 80GB HBM3: B=16 H=16 S=2048 D=64 fp16 causal"
    lines = _rendered(cli._results_table(_fake_ladder(), title, vs_peers=["sdpa_flash", "sdpa_cudnn"]), width)
    text = "\n".join(lines)
    assert "…" not in text and max(map(len, lines)) <= width, text
    assert " ".join(line.strip() for line in lines[:2]).startswith(title), text  # the title, above the table
    rows = _ladder_rows(lines)
    for name, _, ms, tflops in LADDER_MS:
        assert re.search(rf" {re.escape(ms)} +{re.escape(tflops)} ", rows[name]), (name, text)
    assert re.search(r"\b0\.97× ", rows["09-overlap"]), text  # speed over phase 09, whole
    assert "09-overlap warp_specialized-overlap: SLOWER than 09" in text  # the full name in the notes
    if width == 80:  # every column fits, and the names that fit are kept
        assert rows["09"].startswith("09 warp_specialized ") and rows["02"].startswith("02 smem_tiling ")
        assert re.search(r" 114% +97\.2% ", rows["09"])
        assert "% flash, % cudnn: of torch SDPA's backends" in text
        assert "left out" not in text
    else:
        assert "left out to fit 60 columns: % cudnn" in text and re.search(r" 114% +ok", rows["09"])


def test_bench_table_at_80_and_132_columns():
    """`flashcore bench` prints 132 wide in a log (everything, full names) and fits an 80-column terminal."""
    from flashcore_numba import cli

    table = cli._results_table(_fake_ladder(), "Test GPU: B=16 H=16 S=2048 D=64 fp16", resources=True)
    wide = "\n".join(_rendered(table, 132))
    assert "…" not in wide and "left out" not in wide
    assert re.search(r"^09-overlap warp_specialized-overlap +0\.550 +500 +0\.97× +50\.5% +168 +98304 +0 +ok",
                     wide, re.MULTILINE), wide
    lines = _rendered(table, 80)
    text = "\n".join(lines)
    assert "…" not in text and max(map(len, lines)) <= 80, text
    rows = _ladder_rows(lines)
    assert re.search(r" 0\.535 +514 +1\.33× +52\.0% +168 +98304 +0 +ok", rows["09"]), text
    assert re.search(r" 47\.5 +5\.79 ", rows["03"]), text


def test_bandwidth_figures_of_a_decode_step():
    """GB/s counts K and V read once; its share is of the copy measured in the same run, and a
    decode step's table shows both (a prefill's table, bound by FLOPs, does not)."""
    from flashcore_numba import cli

    problem = bench.Problem(1, 32, 1, 8192, 128, H_kv=8)
    assert problem.kv_bytes == 2 * 8 * 8192 * 128 * 2
    r = records.Result("10", "phase", "Split keys", correct=True, message="ok", max_err=1e-4, allowed_err=2e-3,
                       registers=100, static_smem_bytes=0, dynamic_smem_bytes=0, local_bytes_per_thread=0)
    bench.set_timing(r, [0.01], problem.flops, None, kv_bytes=problem.kv_bytes, ceiling_gb_per_s=3200.0)
    assert r.gb_per_s == pytest.approx(problem.kv_bytes / 1e-5 / 1e9)  # 3355 GB/s
    assert r.pct_of_bandwidth == pytest.approx(100 * r.gb_per_s / 3200.0)
    copy = {"what": "copy", "bytes": problem.kv_bytes, "median_ms": 0.02, "gb_per_s": 3200.0}
    record = records.build_record(problem=problem, results=[r], provenance=PROVENANCE, timing=bench.Timing(),
                                  ceiling=None, oracle=ORACLE, command=[], seed=1, bandwidth=copy)
    assert records.validate_record(json.loads(json.dumps(record))) == []
    assert record["bandwidth_gb_per_s"] == 3200.0 and record["results"][0]["pct_of_bandwidth"] > 100
    assert records.validate_record(dict(record, bandwidth_gb_per_s="fast")) == [
        "record.bandwidth_gb_per_s: expected a number or null"]
    wrong = dict(record["results"][0], correct=False)
    assert any("pct_of_bandwidth" in e for e in records.validate_record(dict(record, results=[wrong])))
    text = "\n".join(_rendered(cli._results_table(record["results"], "decode", resources=True, bandwidth=True), 132))
    assert re.search(r" GB/s +%bw ", text) and re.search(r" 3355 +104\.9% ", text), text
    assert "GB/s: K and V read once, %bw: of the copy's bandwidth" in text
    prefill = "\n".join(_rendered(cli._results_table(record["results"], "prefill", resources=True), 132))
    assert "GB/s" not in prefill
    unmeasured = records.Result("10", "phase", "t", correct=True, message="ok").to_dict()
    assert "gb_per_s" not in unmeasured and "pct_of_bandwidth" not in unmeasured  # as older records
    from flashcore_numba.measure import report

    assert report._bandwidth_bound(record, None)  # a decode step with the copy beside it: told in GB/s
    lines = report.bandwidth_table(record)
    assert "| 10 | Split keys | 10 | 3355 | 104.9% |  |" in lines, lines
    assert any("K and V's 32 MiB read once" in line and "3200 GB/s" in line for line in lines), lines
    prefill = dict(record, config=dict(record["config"], S_q=64))
    assert not report._bandwidth_bound(prefill, None) and not report._bandwidth_bound(dict(record, bandwidth_gb_per_s=None), None)


def test_measured_effect_keeps_to_the_phase_and_its_dtype():
    """A phase's "Measured effect" block: the reference shape with its variants, the phase alone at
    the other shapes of the reference dtype, a decode step (in µs and % of the copy) only for a phase
    the reference shape does not run, records named once per causal pair; never a commit hash."""
    def result(name, ms, problem, **kv):
        r = records.Result(name, "phase", f"title of {name}", correct=True, message="ok", max_err=1e-4,
                           allowed_err=2e-3)
        bench.set_timing(r, [ms], problem.flops, None, **kv)
        return r.to_dict()

    def record(problem, results, path, **extra):
        return dict({"provenance": {"gpu_name": "G"}, "created": "2026-12-01T00:00:00", "config": problem.as_dict(),
                     "results": results, "_path": path}, **extra)

    ref, ref_c = bench.Problem.from_shape((16, 16, 2048, 64)), bench.Problem.from_shape((16, 16, 2048, 64), causal=True)
    nc = record(ref, [result("08", 2.0, ref), result("09", 1.0, ref), result("09-ws", 1.25, ref)], "/r/x_fp16.json")
    c = record(ref_c, [result("08", 1.0, ref_c), result("09", 0.5, ref_c)], "/r/x_fp16_causal.json")
    d128 = bench.Problem.from_shape((16, 16, 2048, 128))
    bf16 = bench.Problem.from_shape((16, 16, 2048, 128), dtype="bfloat16")
    decode = bench.Problem(1, 32, 1, 8192, 128, H_kv=8)
    copy = {"bandwidth": {"what": "copy", "bytes": decode.kv_bytes, "median_ms": 0.02, "gb_per_s": 3200.0},
            "bandwidth_gb_per_s": 3200.0}
    others = [(record(d128, [result("08", 4.0, d128), result("09", 2.0, d128), result("09-ws", 2.5, d128)],
                      "/r/y_d128.json"), None),
              (record(bf16, [result("09", 2.0, bf16)], "/r/z_bf16.json"), None),
              (record(decode, [result("09", 0.04, decode, kv_bytes=decode.kv_bytes, ceiling_gb_per_s=3200.0),
                               result("10", 0.02, decode, kv_bytes=decode.kv_bytes, ceiling_gb_per_s=3200.0)],
                      "/r/w_decode.json", **copy), None)]
    text = " ".join(line.strip() for line in report.measured_lines("09", nc, c, others))
    assert "09-ws: " in text and "At B=16 H=16 S=2048 D=128 fp16: 275 TFLOPS (2.00x phase 08)" in text, text
    assert text.count("09-ws") == 1 and "bf16" not in text and "S_k=8192" not in text, text  # the phase alone, fp16
    assert "(x_fp16[_causal].json, y_d128.json). Every shape and dtype measured: docs/performance.md." in text, text
    ten = " ".join(line.strip() for line in report.measured_lines("10", nc, c, others))
    assert "not measured at this shape (the phase serves others)" in ten
    assert "At B=1 H=32 H_kv=8 S_q=1 S_k=8192 D=128 fp16: 20 µs, 52.4% of the copy (2.00x phase 09)" in ten, ten
    assert not re.search(r"\b[0-9a-f]*[a-f][0-9a-f]*[0-9][0-9a-f]*\b", text.replace("-", " "))


def _fake_verdicts(modes):
    verdicts = {}
    for i, pid in enumerate(LESSONS):
        for causal in modes:
            verdicts[pid, causal] = records.Result(pid, "phase", f"Phase {pid}", correct=True, message="ok",
                                                   max_err=(i + 1) * 1.23e-4, allowed_err=2e-3)
    verdicts["03", modes[-1]] = records.Result("03", "phase", "Phase 03", correct=False, max_err=0.5,
                                               allowed_err=2e-3, message="max error 0.5 > allowed 2e-3")
    verdicts["08", modes[0]] = records.unavailable("08", "phase", "Phase 08", "a reason long enough to be cut "
                                                   "if it were printed in the table's cell, as it once was")
    return verdicts


@pytest.mark.parametrize("modes", [(False, True), (True,)])
def test_simulator_table_at_80_columns(modes):
    from flashcore_numba import cli

    verdicts = _fake_verdicts(modes)
    lines = _rendered(cli._simulator_table(verdicts, cli.SIM_SHAPE, modes, LESSONS), 80)
    text = "\n".join(lines)
    assert "…" not in text and max(map(len, lines)) <= 80, text
    assert lines[0] == "Phase ladder in the CUDA simulator: B=1 H=1 S=48 D=64 fp16", text
    for i, (pid, phase) in enumerate(LESSONS.items()):
        row = [line for line in lines if line.startswith(f"{pid} {phase.NAME} ")]
        assert len(row) == 1, text  # one line per phase
        cells = [_rendered(cli._verdict_cell(verdicts[pid, causal]), 80)[0] for causal in modes]
        assert re.sub(r" +", " ", row[0]).strip() == " ".join([pid, phase.NAME, *cells]), text
        if pid not in ("03", "08"):
            assert row[0].count(f"correct (err {(i + 1) * 1.23e-4:.1e})") == len(modes), text
    assert "INCORRECT" in text and "skipped" in text and "cut" not in text  # the reason goes under the table


def test_simulator_run_says_what_err_is_measured_against():
    from flashcore_numba import cli

    verdicts = _fake_verdicts((False, True))
    verdicts["01", False].allowed_err = 3.5e-3
    legend = cli._err_legend(verdicts)
    assert "largest absolute difference from the float64 reference" in legend, legend
    assert "allowed error" in legend and "(here 2.0e-03 to 3.5e-03)" in legend, legend
    assert "(here 2.0e-03)" in cli._err_legend(_fake_verdicts((True,)))


@pytest.mark.slow  # two `flashcore doctor` runs; the wheel's test (marker install) runs it too
def test_doctor_without_gpu():
    has_gpu = shutil.which("nvidia-smi") is not None
    for simulator in (False, True):
        done = subprocess.run([sys.executable, "-m", "flashcore_numba", "doctor"],
                              env=_cli_env(simulator=simulator), capture_output=True, text=True,
                              timeout=300, check=False)
        lines = done.stdout.strip().splitlines()
        assert lines and all(re.match(r"(OK|WARN|FAIL) ", line) for line in lines), done.stdout + done.stderr
        failed = any(line.startswith("FAIL") for line in lines)
        assert done.returncode == (1 if failed else 0)
        names = [line.split()[1] for line in lines]
        for name in ("numba", "numba-cuda", "numpy", "nvJitLink", "GPU", "driver", "simulator", "torch"):
            assert name in names, name
        assert any(line.split()[1] == "sm_90a" for line in lines)
        simulator_line = next(line for line in lines if line.split()[1] == "simulator")
        assert ("ON" in simulator_line) == simulator
        if not has_gpu:
            assert any(line.startswith("WARN GPU") for line in lines)


def _flashcore_run() -> subprocess.CompletedProcess:
    has_gpu = shutil.which("nvidia-smi") is not None
    return subprocess.run([sys.executable, "-m", "flashcore_numba", "run"], env=_cli_env(simulator=has_gpu),
                          capture_output=True, text=True, timeout=600, check=False)


def start_background(items, pool):
    """`flashcore run` in the session's pool of background jobs (conftest.py), if its test is selected."""
    if any("flashcore_run" in getattr(item, "fixturenames", ()) for item in items):
        return pool.submit(_flashcore_run)
    return None


@pytest.fixture(scope="module")
def flashcore_run(background):
    return background.result() if background is not None else _flashcore_run()


def test_run_without_gpu(flashcore_run):
    """`flashcore run` on a CPU machine: every phase correct in the simulator, and it says that
    simulator timings mean nothing. Without a GPU the child starts with the simulator off, so
    this also covers run re-launching itself in the simulator."""
    has_gpu = shutil.which("nvidia-smi") is not None
    done = flashcore_run
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    if not has_gpu:
        assert "No CUDA GPU found" in out
    for phase_id in LESSONS:  # the ladder, and 11 (the backward) by its gradients
        row = next(line for line in out.splitlines() if re.match(rf"\W*{phase_id}\b", line))
        assert row.count("correct (err") == 2, row  # non-causal and causal
    assert "INCORRECT" not in out
    assert "err: the largest absolute difference from the float64 reference" in out and "allowed error" in out
    assert f"All {len(LESSONS)} phases correct in the simulator" in out
    assert "timings mean nothing" in out


# ---------------------------------------------------------------------------------------------
# Grouped-query attention in the benchmark
# ---------------------------------------------------------------------------------------------
def test_gqa_problem_names_and_validation():
    problem = bench.Problem.from_shape((16, 32, 2048, 64), kv_heads=8)
    assert problem.tag == "b16h32kv8s2048d64_fp16" and "H=32 H_kv=8" in problem.describe()
    assert problem.as_dict()["H_kv"] == 8 and problem.heads_kv == 8
    assert "H_kv" not in bench.Problem.from_shape((1, 4, 8, 64), kv_heads=4).as_dict()  # not grouped
    with pytest.raises(ValueError, match="H_kv: 3 key/value heads must divide the 32"):
        bench.Problem.from_shape((1, 32, 8, 64), kv_heads=3)


def test_reference_reads_each_query_heads_kv_head():
    from flashcore_numba.reference import random_qkv, reference_attention

    q, k, v = random_qkv((1, 6, 9, 64), 11, heads_kv=2)
    assert k.shape == (1, 2, 11, 64)
    expected = reference_attention(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1), causal=True)
    np.testing.assert_array_equal(reference_attention(q, k, v, causal=True), expected)


@pytest.mark.skipif(not simulator_enabled(), reason="uses the CUDA simulator")
def test_gqa_benchmark_runs_gqa_phases_and_says_why_not_the_others():
    device = FakeTimedDevice()
    problem = bench.Problem(1, 4, 16, 16, 64, H_kv=2)
    record = bench.run_benchmark(problem, phase_ids=["05", "07"], peer_names=[], timing=bench.Timing(1, 3),
                                 device=device)
    assert records.validate_record(record) == [] and record["config"]["H_kv"] == 2
    p05, p07 = record["results"]
    assert p05["available"] is False and "grouped-query" in p05["reason"]
    assert p07["correct"] is True, p07["message"]


def test_ladder_table_folds_phases_that_could_not_run():
    """A bf16 record lists fp16-only phases as n/a: one note for them, no empty rows."""
    def phase(name, **kw):
        return {"name": name, "kind": "phase", "title": f"Phase {name}", **kw}

    skipped = [phase(p, available=False, reason=f"phase {p} supports float16 only, not bfloat16") for p in ("05", "06")]
    ran = phase("07", available=True, correct=True, message="ok", tflops=200.0, pct_of_ceiling=None)
    peer = {"name": "sdpa_cudnn", "kind": "peer", "title": "torch SDPA, cuDNN backend", "available": False,
            "reason": "no cuDNN"}
    lines = report.ladder_table({"results": [*skipped, ran, peer]}, None)
    rows = [line for line in lines if line.startswith("| 0")]
    assert [row.split("|")[1].strip() for row in rows] == ["07"]
    assert "- n/a — 05, 06: supports float16 only, not bfloat16" in lines
    assert any("no cuDNN" in line for line in lines)  # a peer's reason is kept


@pytest.mark.skipif(not simulator_enabled(), reason="tests the simulator's block loop (arch/sim._run_block)")
def test_simulator_block_loop_keeps_barriers_and_reports_errors():
    """The pausing block loop still releases every syncthreads only once all threads arrived, and a
    thread that fails while the others wait at a barrier makes the launch raise instead of hang."""
    @cuda.jit
    def shift_left(out, fail_at):
        buf = cuda.shared.array(64, int32)
        i = cuda.threadIdx.x
        buf[i] = i + 1
        cuda.syncthreads()  # every write is done before any neighbour reads
        if i == fail_at:
            raise ValueError("lane failed")
        cuda.syncthreads()
        out[i] = buf[(i + 1) % 64]

    out = np.zeros(64, dtype=np.int32)
    shift_left[1, 64](out, -1)
    assert out.tolist() == [(i + 1) % 64 + 1 for i in range(64)]
    with pytest.raises(ValueError, match="lane failed"):
        shift_left[1, 64](out, 5)


def _line_of(kernel, marker: str) -> str:
    """'file:line (`code`)' of the line of a simulated kernel's source that holds `marker`."""
    import inspect

    fn = getattr(kernel, "py_func", kernel)
    lines, first = inspect.getsourcelines(fn)
    index = next(i for i, text in enumerate(lines) if marker in text)
    return f"{Path(inspect.getsourcefile(fn)).resolve().relative_to(Path.cwd())}:{first + index} (`{lines[index].strip()}`)"


def _stopped_in_seconds(launch):
    """The BarrierError a launch raises, and that it came within seconds (not a time-out's minutes)."""
    import time

    from flashcore_numba.arch.sim import BarrierError

    started = time.monotonic()
    with pytest.raises(BarrierError) as info:
        launch()
    assert time.monotonic() - started < 20, "a block that can never go on is stopped at once"
    return str(info.value)


@pytest.mark.skipif(not simulator_enabled(), reason="tests the simulator's block loop (arch/sim._run_block)")
def test_simulator_stops_threads_waiting_at_different_barriers(monkeypatch):
    """Two syncthreads lines, each reached by half the block: on a GPU undefined; the simulator used
    to let both halves through. Now the launch stops, naming both lines and the threads at each."""
    monkeypatch.chdir(ROOT)

    @cuda.jit
    def two_barriers(out):
        i = cuda.threadIdx.x
        if i < 4:
            cuda.syncthreads()  # barrier A
        else:
            cuda.syncthreads()  # barrier B
        out[i] = i

    out = np.zeros(8, dtype=np.int32)
    text = _stopped_in_seconds(lambda: two_barriers[1, 8](out))
    assert f"threads 0-3 wait at cuda.syncthreads(): {_line_of(two_barriers, 'barrier A')}" in text, text
    assert f"threads 4-7 wait at cuda.syncthreads(): {_line_of(two_barriers, 'barrier B')}" in text, text
    assert "put the barrier where every thread passes" in text


@pytest.mark.skipif(not simulator_enabled(), reason="tests the simulator's block loop (arch/sim._run_block)")
def test_simulator_stops_a_barrier_that_threads_which_returned_never_reach(monkeypatch):
    """A barrier inside `if i == 0:` (the others leave the kernel), and one in a helper whose caller
    only some threads call: the line of each barrier and the call that led there are named."""
    monkeypatch.chdir(ROOT)

    @cuda.jit(device=True)
    def wait_for_the_block():
        cuda.syncthreads()  # in the helper

    @cuda.jit
    def first_only(out, through_helper):
        i = cuda.threadIdx.x
        if i == 0:
            if through_helper:
                wait_for_the_block()  # the call
            else:
                cuda.syncthreads()  # thread 0 alone
        out[i] = i

    out = np.zeros(8, dtype=np.int32)
    text = _stopped_in_seconds(lambda: first_only[2, 8](out, False))
    assert f"thread 0 waits at cuda.syncthreads(): {_line_of(first_only, 'thread 0 alone')}" in text, text
    assert "threads 1-7 left the kernel" in text and "block [0, 0, 0]" in text
    text = _stopped_in_seconds(lambda: first_only[2, 8](out, True))
    assert (f"thread 0 waits at cuda.syncthreads(): {_line_of(wait_for_the_block, 'in the helper')}, called from "
            f"{_line_of(first_only, 'the call')}") in text, text
    # the block loop still releases barriers that every thread reaches, and the module works again
    test_simulator_block_loop_keeps_barriers_and_reports_errors()


@pytest.mark.skipif(not simulator_enabled(), reason="tests the simulator's block loop (arch/sim._run_block)")
def test_simulator_stops_a_warp_collective_or_named_barrier_that_can_never_complete(monkeypatch):
    """A shuffle after half the warp has returned, and a named barrier that expects more threads than
    come, used to wait ten minutes (a time-out) and end in BrokenBarrierError with no line."""
    from flashcore_numba.arch import ptx

    monkeypatch.chdir(ROOT)

    @cuda.jit
    def half_warp_shuffle(out):
        i = cuda.threadIdx.x
        if i >= 16:
            return
        out[i] = cuda.shfl_xor_sync(0xFFFFFFFF, i, 1)  # the shuffle

    out = np.zeros(32, dtype=np.int32)
    text = _stopped_in_seconds(lambda: half_warp_shuffle[1, 32](out))
    assert f"threads 0-15 wait at a warp collective (shuffle, vote, mma): {_line_of(half_warp_shuffle, 'the shuffle')}" \
        in text, text
    assert "threads 16-31 left the kernel" in text and "needs every lane of its warp" in text

    bar_sync = ptx.function("warpgroup.ptx", "flashcore_bar_sync", "inline")

    @cuda.jit
    def short_named_barrier(out):
        i = cuda.threadIdx.x
        bar_sync(np.uint32(1), np.uint32(128))  # the named barrier
        out[i] = i

    text = _stopped_in_seconds(lambda: short_named_barrier[1, 64](out))
    assert (f"threads 0-63 wait at named barrier 1 (expects 128 threads): "
            f"{_line_of(short_named_barrier, 'the named barrier')}") in text, text


# ---------------------------------------------------------------------------------------------
# The first call of a new process (measure/first_call.py)
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_first_call_benchmark_runs_new_processes_and_writes_a_record(tmp_path):
    """`run_first_call_benchmark` in the simulator (phase 01, a tiny problem): a process that fills
    the cache, then the measured ones, each a new Python process that checks its output; the record
    validates, round-trips through `load`, and `flashcore report`'s table gives its medians.
    Timings here mean nothing (the simulator); on a GPU `flashcore bench --first-call` writes them."""
    from flashcore_numba.measure import first_call, report

    record = first_call.run_first_call_benchmark((1, 2, 24, 64), phases=["01"], causal=True, processes=2,
                                                 cold=True, command=["test"])
    assert first_call.validate(record) == []
    r, cold = record["results"]
    assert (r["phase"], r["cache"], cold["phase"], cold["cache"]) == ("01", "warm", "01", "cold")
    assert r["ok"] and cold["ok"] and len(r["runs"]) == len(cold["runs"]) == 2
    assert all(run["ok"] and run["first_call_s"] > 0 and run["import_s"] > 0 for run in r["runs"] + cold["runs"])
    assert r["first_call_s"] == pytest.approx(0.5 * sum(run["first_call_s"] for run in r["runs"]))  # a median of 2
    path = first_call.write(record, tmp_path / "first_call" / "r.json")
    (loaded,) = first_call.load(tmp_path / "first_call")
    assert loaded["_path"] == str(path) and loaded["results"] == record["results"]
    text = "\n".join(report.first_call_table([loaded], tmp_path))
    assert "#### The first call of a new process" in text and "| 1, 2, 24, 64 fp16 causal | 01 | warm |" in text
    assert "| 1, 2, 24, 64 fp16 causal | 01 | cold |" in text
    assert f"{r['first_call_s']:.2f} s" in text and "Median of 2 processes" in text


def test_first_call_records_are_validated(tmp_path):
    """A record that lost a field, or whose process failed its check, is refused or flagged: the
    validator names the field; the README says WRONG OUTPUT."""
    from flashcore_numba.measure import first_call, report
    from flashcore_numba.measure.records import RecordError

    run = dict(import_s=1.0, first_call_s=0.4, second_call_s=0.001, ok=True, loaded=1, built=0, rejected=0)
    record = dict(kind=first_call.KIND, schema=first_call.SCHEMA, created="2026-11-29T00:00:00", command=[],
                  provenance=dict(gpu_name="GPU", git_commit="0" * 40),
                  config=dict(B=1, H=16, H_kv=16, S=128, D=64, dtype="float16", causal=False, processes=1),
                  results=[dict(phase=None, cache="warm", runs=[run], ok=True, first_call_s=0.4, import_s=1.0,
                                second_call_s=0.001)])
    assert first_call.validate(record) == []
    bad = json.loads(json.dumps(record))
    del bad["results"][0]["runs"][0]["first_call_s"]
    assert any("runs[0].first_call_s" in e for e in first_call.validate(bad))
    bad = json.loads(json.dumps(record))
    del bad["results"][0]["ok"]
    assert any("results[0].ok" in e for e in first_call.validate(bad))
    assert any("results[1]: expected an object" in e
               for e in first_call.validate(dict(record, results=record["results"] + [7])))
    bad = json.loads(json.dumps(record))
    bad["results"][0]["cache"] = "lukewarm"
    assert any("results[0].cache" in e for e in first_call.validate(bad))
    with pytest.raises(ValueError, match="invalid record"):
        first_call.write(bad, tmp_path / "bad.json")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "x.json").write_text(json.dumps(bad))
    with pytest.raises(RecordError, match="x.json"):
        first_call.load(tmp_path / "dir")
    record["_path"] = str(tmp_path / "r.json")
    record["results"][0]["ok"] = False
    record["provenance"]["git_commit"] = None  # not a git checkout: the table says so, and does not fail
    text = "\n".join(report.first_call_table([record], tmp_path))
    row = "| 1, 16, 128, 64 fp16 | attention() chooses | warm | 0.40 s (WRONG OUTPUT) | 1.00 s | 1.00 ms | 1 / 0 |"
    assert row in text


def test_first_call_refuses_a_warm_cache_that_compiled(monkeypatch):
    """A process that compiled with the cache meant to be warm (the cache switched off, or its folder
    not writable) stops the benchmark with the reason: its figure would not be a warm first call."""
    from flashcore_numba.measure import first_call

    run = dict(import_s=1.0, first_call_s=20.0, second_call_s=0.001, ok=True, loaded=0, built=1, rejected=0)
    monkeypatch.setattr(first_call, "new_process", lambda config, env=None: dict(run))
    with pytest.raises(RuntimeError, match="compiled with the kernel cache warm"):
        first_call.run_first_call_benchmark((1, 1, 16, 64), phases=["01"], processes=1)


def test_peers_name_flexattention_and_the_default_leaves_it_out():
    """--peers takes SDPA's backends by their short names and FlexAttention as flex; a bare run compares
    SDPA's backends only (FlexAttention compiles a kernel per shape first, so it is asked for)."""
    from flashcore_numba.cli import parse_peers
    from flashcore_numba.measure import bench

    assert parse_peers("flash,cudnn,flex") == ["sdpa_flash", "sdpa_cudnn", "flex_attention"]
    assert parse_peers("none") == []
    assert "flex_attention" in bench.PEERS and "flex_attention" not in bench.DEFAULT_PEERS
    assert set(bench.DEFAULT_PEERS) == set(bench.PEERS) - {"flex_attention"}
    with pytest.raises(Exception, match="unknown peer 'bogus'.*flex"):
        parse_peers("bogus")


def test_the_serving_table_of_a_record():
    """`flashcore report`'s serving table (measure/serving.py): per batch and cache, each call's time
    back to back (median, p99) and the host's time with the GPU busy, the fastest SDPA backend named,
    a backend that does not run said so, and attention_kvcache's speed against that backend's."""
    from flashcore_numba.measure.serving import serving_records, serving_table

    def row(name, kind, median_us, host_us=20.0):
        return dict(name=name, kind=kind, available=True, correct=True,
                    call=dict(median_ms=median_us / 1e3, p99_ms=2 * median_us / 1e3, busy_host_median_us=host_us))

    record = dict(provenance=dict(gpu_name="NVIDIA H100 80GB HBM3"), _path="x.json",
                  config=dict(B=64, S_q=1, S_k=1024, H=32, H_kv=8, D=128, dtype="float16", serving=True),
                  results=[row("10-kvcache", "phase", 100.0), row("10-kvcache-p256", "phase", 101.0),
                           row("attention", "phase", 99.0), row("sdpa", "peer", 95.0), row("sdpa_cudnn", "peer", 90.0),
                           dict(name="sdpa_efficient", kind="peer", available=False, reason="no kernel")])
    ignored = dict(record, config=dict(record["config"], serving=False))
    lines = serving_table(serving_records([record, ignored]))
    table = [line for line in lines if line.startswith("| 64 ")]
    assert len(table) == 1, lines
    assert table[0] == "| 64 | 1024 | 100 (200); 20 | 101 (202); 20 | 99 (198); 20 | 90 (180); 20 (cudnn) | 0.90× |"


@pytest.mark.skipif(not simulator_enabled(), reason="the `beside` tests run in a child only in a CPU session")
def test_beside_tests_run_in_a_child_and_report_here(tmp_path):
    """Tests marked `beside` (conftest.py) run in a child pytest beside the session's own tests, and
    each reports here what it did there: a pass, a failure with the child's assertion, a skip with
    its reason; the unmarked test runs here. A probe file in tests/ (the root's conftest applies),
    run by a pytest of its own."""
    probe = ROOT / "tests" / f"beside_probe_{os.getpid()}.py"
    probe.write_text(
        "import os\n"
        "import pytest\n"
        "HERE = os.environ.get('FLASHCORE_BESIDE_REPORT')\n"
        "def test_here():\n"
        "    assert HERE is None\n"
        "@pytest.mark.beside\n"
        "def test_passes_in_the_child():\n"
        "    assert HERE is not None\n"
        "@pytest.mark.beside\n"
        "def test_fails_in_the_child():\n"
        "    assert 1 + 1 == 3, 'the child saw two'\n"
        "@pytest.mark.beside\n"
        "def test_skips_in_the_child():\n"
        "    pytest.skip('nothing to do there')\n", encoding="utf-8")
    try:
        env = {k: v for k, v in os.environ.items() if k != "FLASHCORE_BESIDE_REPORT"}
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(probe)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    finally:
        probe.unlink()
    out = done.stdout
    assert "1 failed, 2 passed, 1 skipped" in out, out + done.stderr[-2000:]
    assert "run in the child pytest beside this one" in out and "the child saw two" in out, out
    assert "nothing to do there" in out, out


def test_a_docstring_names_a_record_and_its_causal_twin_once():
    """A record and its causal twin are one name in a measured-effect block, the causal flag before
    the phases' suffix where the record has one; a causal record alone keeps its name."""
    from flashcore_numba.measure.report import _file_list

    assert _file_list(["a_fp16.json", "a_fp16_causal.json", "b_fp16_p07-09.json", "b_fp16_causal_p07-09.json",
                       "c_fp16_causal_p07.json", "d_fp16_p09.json"]) == \
        "a_fp16[_causal].json, b_fp16[_causal]_p07-09.json, c_fp16_causal_p07.json, d_fp16_p09.json"

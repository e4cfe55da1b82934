"""`flashcore run` / `bench` tables stay readable at 80 columns: one line per kernel, nothing wrapped."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from flashcore_numba import cli
from flashcore_numba.measure.records import load_records

RECORDS = Path(__file__).parent / "data" / "bench_records"


def render(table, width=80) -> list[str]:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(table)
    return console.file.getvalue().splitlines()


def test_results_table_fits_80_columns():
    records = [r for r in load_records(RECORDS) if "results" in r]
    assert records, "fixture records missing"
    for record in records:
        results = record["results"]
        lines = render(cli._results_table(results, "Phase ladder", vs_peers=["sdpa_flash", "sdpa_cudnn"]))
        assert max(map(len, lines)) <= 80, "\n".join(lines)
        start = next(i for i, line in enumerate(lines) if line.startswith("─")) + 1
        end = next(i for i, line in enumerate(lines) if line.startswith("× prev"))
        body = lines[start:end]  # the rows, between the header rule and the caption
        assert len(body) == len(results), "a kernel's row wrapped onto several lines:\n" + "\n".join(lines)
        assert all("…" not in line for line in lines), "a cell was cut:\n" + "\n".join(lines)
        for r in results:
            assert any(cli._short_name(r) in line for line in body), cli._short_name(r)


def test_short_names():
    assert cli._short_name({"kind": "phase", "name": "06-inline"}) == "06-inline wmma-inline"
    assert cli._short_name({"kind": "peer", "name": "sdpa_cudnn"}) == "SDPA cudnn"


def test_run_ends_with_the_next_step(monkeypatch, capsys):
    """`flashcore run` ends by pointing a student at lesson 00 and its grader, which both exist."""
    from types import SimpleNamespace

    from flashcore_numba import PHASES
    from flashcore_numba.course import grade, notebooks

    assert "lessons/00_numba_cuda.ipynb" in cli.NEXT_STEP and "`flashcore grade 00`" in cli.NEXT_STEP
    assert notebooks.lesson_path("00", ".ipynb").is_file() and grade.main(["00", "--list"]) == 0
    capsys.readouterr()
    if cli.kernel_target() == "simulator":  # one phase on 4 rows: the last lines are the point
        monkeypatch.setattr(cli, "PHASES", {"01": PHASES["01"]})
        assert cli._run_simulator(SimpleNamespace(shape=(1, 1, 4, 64), causal=True)) == 0
        lines = capsys.readouterr().out.strip().splitlines()
        assert " ".join(lines[-2:]).endswith(cli.NEXT_STEP), lines[-4:]

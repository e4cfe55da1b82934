"""The documentation holds to the code: every FLASHCORE_* switch in one table of docs/guide.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SWITCH = re.compile(r"\bFLASHCORE_[A-Z0-9_]+\b")


def _switches_read() -> dict[str, set[str]]:
    """Each FLASHCORE_* name in the package, tools/, conftest.py and .ci/ -> the files naming it."""
    files = [*(ROOT / "flashcore_numba").rglob("*.py"), *(ROOT / "tools").iterdir(), ROOT / "conftest.py",
             *(ROOT / ".ci").iterdir()]
    found: dict[str, set[str]] = {}
    for path in files:
        if path.is_file():
            for name in SWITCH.findall(path.read_text(errors="replace")):
                found.setdefault(name, set()).add(path.relative_to(ROOT).as_posix())
    return found


def _switch_table(text: str) -> dict[str, str]:
    """{variable: its "read by" cell} of the table under docs/guide.md's "## Environment switches"."""
    assert "\n## Environment switches\n" in text, "docs/guide.md has no section '## Environment switches'"
    section = text.split("\n## Environment switches\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(FLASHCORE_[A-Z0-9_]+)` \| `([^`]+)` \|", section, flags=re.MULTILINE)
    return dict(rows)


def test_every_switch_is_in_the_guides_table():
    table = _switch_table((ROOT / "docs" / "guide.md").read_text())
    read = _switches_read()
    assert sorted(read) == sorted(table), (
        f"in the code but not in docs/guide.md's table: {sorted(set(read) - set(table))}; "
        f"in the table but read nowhere: {sorted(set(table) - set(read))}")
    for name, where in table.items():  # the "read by" cell names a file that reads it
        candidates = [ROOT / where, ROOT / "flashcore_numba" / where]
        assert any(p.is_file() and name in p.read_text() for p in candidates), f"{name}: not in {where}"


def test_the_library_reads_no_test_setting_from_the_environment():
    """The persistent grid's size for tests is phases.common.sm_count_override, set in Python."""
    library = "\n".join(p.read_text() for p in (ROOT / "flashcore_numba").rglob("*.py"))
    assert "FLASHCORE_SMS" not in library


def test_the_readmes_first_screen_has_the_commands_and_the_headline():
    """README.md: what it is, the two commands and the generated headline with the ladder plot in its
    first 80 lines; at most 300 lines (the full tables are docs/performance.md's)."""
    from flashcore_numba.measure import report

    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; the full tables belong in docs/performance.md"
    first = "\n".join(lines[:80])
    for needed in ('pip install -e ".[course]" && flashcore run', "python3 -m pytest", report.HEADLINE_BEGIN,
                   report.HEADLINE_END, "![ladder](docs/bench/ladder.png)", "](docs/performance.md)"):
        assert needed in first, f"not in README.md's first 80 lines: {needed!r}"
    performance = (ROOT / "docs" / "performance.md").read_text()
    assert report.BEGIN in performance and report.END in performance
    assert report.BEGIN not in "\n".join(lines)  # the full tables are not repeated in the README

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
    rows = re.findall(r"^\| `(FLASHCORE_[A-Z0-9_]+)` \| `([^`]+)` \|", section, flags=re.M)
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

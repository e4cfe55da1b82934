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


# ---------------------------------------------------------------------------------------------
# docs/tuning: one history per phase and the scripts that measure again what was kept
# ---------------------------------------------------------------------------------------------
TUNING = ROOT / "docs" / "tuning"
TUNING_MAX_FILES = 80
TUNING_MAX_BYTES = 1_500_000
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _tuning_files() -> list[Path]:
    return sorted(p for p in TUNING.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def test_tuning_is_small():
    files = _tuning_files()
    size = sum(p.stat().st_size for p in files)
    assert len(files) <= TUNING_MAX_FILES, f"docs/tuning holds {len(files)} files (at most {TUNING_MAX_FILES})"
    assert size <= TUNING_MAX_BYTES, f"docs/tuning holds {size} bytes (at most {TUNING_MAX_BYTES})"


def test_every_tuning_file_is_linked_from_the_index_and_every_link_resolves():
    index = TUNING / "README.md"
    linked = {(TUNING / target).resolve() for target in LINK.findall(index.read_text())
              if "://" not in target}
    unlinked = [p.relative_to(TUNING).as_posix() for p in _tuning_files() if p != index and p.resolve() not in linked]
    assert not unlinked, f"not linked from docs/tuning/README.md: {unlinked}"
    for page in TUNING.rglob("*.md"):
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.exists(), f"{page.relative_to(ROOT)} links {target}, which does not exist"


# Citations of removed logs that are waiting to be repointed to the histories: each entry must still
# be found (so the list shrinks as they are fixed), and nothing else may be missing. Empty since the
# kernels of phases 09-11 cite their histories.
PENDING_CITATIONS: set = set()  # (file, path) cited but no longer in docs/tuning


def test_every_docs_tuning_path_named_in_the_repository_exists():
    """Code, tests, tools, lessons and docs that cite docs/tuning/<path> cite a file that is there
    (the logs that were removed are cited by commit, `git show 2843081:docs/tuning/<path>`)."""
    cited = re.compile(r"(?<![0-9a-f]:)docs/tuning/([A-Za-z0-9_./-]*[A-Za-z0-9_/])")
    sources = [*(ROOT / "flashcore_numba").rglob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "tools").iterdir(),
               *(ROOT / "lessons").glob("*.py"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md",
               *TUNING.rglob("*.md")]
    missing = set()
    for path in sources:
        if path.is_file():
            for name in cited.findall(path.read_text(errors="replace")):
                if not (TUNING / name).exists():
                    missing.add((path.relative_to(ROOT).as_posix(), name))
    assert missing - PENDING_CITATIONS == set(), f"cited but not in docs/tuning: {sorted(missing - PENDING_CITATIONS)}"
    assert PENDING_CITATIONS - missing == set(), f"fixed since: drop from PENDING_CITATIONS {PENDING_CITATIONS - missing}"


# ---------------------------------------------------------------------------------------------
# Phase docstrings teach; the logs are docs/tuning's
# ---------------------------------------------------------------------------------------------
DOCSTRING_MAX_LINES = 100  # the measured-effect block included
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def _phase_docstrings() -> dict[str, str]:
    import ast

    phases = ROOT / "flashcore_numba" / "phases"
    return {p.name: ast.get_docstring(ast.parse(p.read_text()), clean=False) or ""
            for p in sorted(phases.glob("p[0-9][0-9]_*.py"))}


def test_a_commit_hash_is_caught():
    assert COMMIT.findall("the records of commit bc3c341 and of 1e08cec") == ["bc3c341", "1e08cec"]
    assert COMMIT.findall("2026-11-27, 4096 keys, B=16 H=16, decade, 0x10, 1000000") == []


def test_phase_docstrings_carry_no_log():
    """Each phase module's docstring says what changed, why the hardware rewards it and the measured
    effect; the commits, dates of A/Bs and their lists belong in docs/tuning's histories."""
    for name, doc in _phase_docstrings().items():
        assert not COMMIT.findall(doc), f"{name}: commit hashes in the docstring: {COMMIT.findall(doc)}"
        lines = len(doc.splitlines())
        assert lines <= DOCSTRING_MAX_LINES, f"{name}: a docstring of {lines} lines (at most {DOCSTRING_MAX_LINES})"

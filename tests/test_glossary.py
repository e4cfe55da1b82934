"""docs/glossary.md: every term a lesson links there is defined, each lesson links a term once, at
its first use, and the words the course leans on all have an entry. Text only: milliseconds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GLOSSARY = REPO / "docs" / "glossary.md"
LESSONS = sorted((REPO / "lessons").glob("[0-9][0-9]_*.py"))
LINK = re.compile(r"\[([^\]]+)\]\(\.\./docs/glossary\.md#([^)\s]*)\)")

# The words the lessons build on, each of which must have an entry (SASS and CTA included: the
# lessons used them long before anything defined them).
REQUIRED = ["warp", "sm", "hbm", "cta", "block", "grid", "occupancy", "ptx", "sass", "quad", "fragment",
            "swizzle", "mbarrier", "warpgroup", "tma", "wgmma", "mmasync", "ldmatrix", "bank-conflict",
            "shared-memory", "register", "l2-cache", "online-softmax", "tensor-core", "producer-and-consumer",
            "persistent-kernel", "lane", "kernel", "thread", "launch", "tile", "simulator", "barrier"]


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", heading.strip().lower()))


def anchors() -> dict[str, str]:
    """anchor -> the entry's text."""
    entries = re.split(r"^### ", GLOSSARY.read_text(encoding="utf-8"), flags=re.MULTILINE)[1:]
    return {anchor(e.splitlines()[0]): e for e in entries}


def prose(path: Path) -> str:
    """The lesson's markdown cells as one text, without code blocks, code spans, headings or links
    other than the glossary's (those keep their text)."""
    lines, markdown, fenced = [], False, False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# %%"):
            markdown, fenced = "[markdown]" in line, False
            continue
        if not markdown:
            continue
        body = line[2:]
        if body.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or body.lstrip().startswith("#"):
            continue
        lines.append(body)
    text = "\n".join(lines)
    kept = LINK.findall(text)  # the glossary links stay whole, even with code in their text
    text = LINK.sub("\0", text)
    text = re.sub(r"!?\[[^\]]*\]\([^)]*\)", " ", re.sub(r"`[^`]*`", " ", text))
    for word, target in kept:
        text = text.replace("\0", f"[{word}](../docs/glossary.md#{target})", 1)
    return text


def test_every_entry_is_short_and_plain():
    entries = anchors()
    assert set(REQUIRED) <= set(entries), f"no entry for {sorted(set(REQUIRED) - set(entries))}"
    for name, text in entries.items():
        sentences = len(re.findall(r"[.!?](?:\s|$)", " ".join(text.splitlines()[1:])))
        assert 1 <= sentences <= 4, f"glossary entry {name!r}: {sentences} sentences, keep it to 1-3"


@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_links_exist_once_at_first_use(path):
    entries = anchors()
    text = prose(path)
    links = LINK.findall(text)
    assert links, f"{path.name} links nothing to docs/glossary.md"
    seen = set()
    for word, target in links:
        assert target in entries, f"{path.name} links [{word}] to glossary.md#{target}, which has no entry"
        assert target not in seen, f"{path.name} links glossary.md#{target} twice: link a term at its first use only"
        seen.add(target)
        at = text.find(f"[{word}](../docs/glossary.md#{target})")
        word = re.sub(r"\s+", " ", word.strip("`*"))
        earlier = re.search(rf"(?<![\w\[-]){re.escape(word)}(?![\w-])", re.sub(r"\s+", " ", text[:at]), re.IGNORECASE)
        assert at >= 0 and not earlier, f"{path.name}: {word!r} is used before its glossary link"

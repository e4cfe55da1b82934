"""Every relative link of the lessons opens where the documented command serves them.

The README, docs/guide.md, lessons/README.md and `flashcore run`'s last line tell a student to open
the lessons with `jupyter lab ...`, run from the repository's root. JupyterLab serves one folder,
its root, and opens nothing outside it: a link that leaves the root answers 404 as surely as one
naming a file that is not there. `server_root` works the root out of a command the way
jupyter_server 2 (JupyterLab 4's server) does: `--notebook-dir` (ServerApp.root_dir) names it; a
folder given as the argument replaces it; a file given as the argument is opened, and without
`--notebook-dir` its folder becomes the root (so `jupyter lab lessons/00_numba_cuda.ipynb` serves
lessons/, where every `../docs/...` link fails). Text only: milliseconds.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from flashcore_numba import cli

REPO = Path(__file__).resolve().parents[1]
LESSONS = REPO / "lessons"
# the documents that say how to open the lessons (each must say it at least once)
DOCUMENTS = ("README.md", "docs/guide.md", "lessons/README.md")
# every document a student opens in JupyterLab from the lessons: the notebooks, their sources, the map
LINKED = sorted(LESSONS.glob("[0-9][0-9]_*.ipynb")) + sorted(LESSONS.glob("[0-9][0-9]_*.py")) + [LESSONS / "README.md"]

COMMAND = re.compile(r"jupyter lab\b[^\n`)]*")
ROOT_OPTIONS = ("--notebook-dir", "--ServerApp.root_dir")
FENCE = re.compile(r"^\s*```.*?^\s*```[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(\s*([^)\s]+)[^)]*\)")  # [text](target "title")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
HTML_LINK = re.compile(r"\b(?:href|src)\s*=\s*[\"']([^\"']+)[\"']")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, data:


def documented_commands() -> dict[str, list[str]]:
    """Each document's `jupyter lab ...` commands (comments after `#` dropped)."""
    texts = {name: (REPO / name).read_text(encoding="utf-8") for name in DOCUMENTS}
    texts["flashcore_numba/cli.py: NEXT_STEP"] = cli.NEXT_STEP
    return {name: [re.sub(r"\s+#.*$", "", c).strip() for c in COMMAND.findall(text)] for name, text in texts.items()}


def server_root(command: str, cwd: Path = REPO) -> tuple[Path, Path | None]:
    """(the folder JupyterLab serves, the file it opens or None) for `command` run in `cwd`.
    Options with a value are written `--name=value`, as the docs write them."""
    args = shlex.split(command)
    assert args[:2] == ["jupyter", "lab"], command
    root = opened = None
    positional = []
    for arg in args[2:]:
        if arg.startswith("--"):
            name, _, value = arg.partition("=")
            if name in ROOT_OPTIONS:
                assert value, f"{command!r}: write {name}=FOLDER"
                root = (cwd / value).resolve()
        else:
            positional.append(arg)
    if positional:  # jupyter_server takes the first: a folder is the root, a file is opened
        path = (cwd / positional[0]).resolve()
        assert path.exists(), f"{command!r}: {positional[0]} does not exist in {cwd}"
        if path.is_dir():
            root = path
        else:
            opened = path
    if root is None:
        root = opened.parent if opened is not None else cwd.resolve()
    assert opened is None or opened.is_relative_to(root), (
        f"{command!r}: jupyter_server refuses to open {opened}, which is outside its root {root}")
    return root, opened


def markdown_links(text: str) -> list[str]:
    """The link targets of markdown text, code blocks and code spans left out."""
    text = CODE_SPAN.sub(" ", FENCE.sub(" ", text))
    return MARKDOWN_LINK.findall(text) + REFERENCE_LINK.findall(text) + HTML_LINK.findall(text)


def _cell_text(value) -> str:
    return "".join(value) if isinstance(value, list) else value


def links_of(path: Path) -> list[str]:
    """Every link target a student can click in the document: a notebook's markdown cells and its
    HTML and markdown outputs; a jupytext source's markdown cells; a markdown file."""
    if path.suffix == ".ipynb":
        found = []
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] == "markdown":
                found += markdown_links(_cell_text(cell["source"]))
            for output in cell.get("outputs", []):
                data = output.get("data", {})
                found += HTML_LINK.findall(_cell_text(data.get("text/html", "")))
                found += markdown_links(_cell_text(data.get("text/markdown", "")))
        return found
    if path.suffix == ".py":  # jupytext percent format: a markdown cell's lines are comments
        cells = re.split(r"^# %%", path.read_text(encoding="utf-8"), flags=re.MULTILINE)[1:]
        markdown = [re.sub(r"^# ?", "", cell.split("\n", 1)[1], flags=re.MULTILINE)
                    for cell in cells if cell.startswith(" [markdown]")]
        return [link for cell in markdown for link in markdown_links(cell)]
    return markdown_links(path.read_text(encoding="utf-8"))


def broken_links(root: Path) -> list[str]:
    """Each relative link of LINKED that does not open under `root`: 'document: link (why)'."""
    broken = []
    for path in LINKED:
        for link in links_of(path):
            target = re.split(r"[#?]", link, maxsplit=1)[0]
            if not target or EXTERNAL.match(link):
                continue
            resolved = (path.parent / target).resolve()
            name = path.relative_to(REPO)
            if not resolved.is_relative_to(root):
                broken.append(f"{name}: {link} (outside the server's root {root.relative_to(REPO.parent)})")
            elif not resolved.exists():
                broken.append(f"{name}: {link} (no such file)")
    return broken


def test_every_document_says_how_to_open_the_lessons():
    for name, commands in documented_commands().items():
        assert commands, f"{name} gives no `jupyter lab` command to open the lessons"


@pytest.mark.parametrize("command", sorted({c for cs in documented_commands().values() for c in cs}))
def test_every_lesson_link_opens_under_the_documented_command(command):
    root, opened = server_root(command)
    assert opened is None or opened.parent == LESSONS, f"{command!r} opens {opened}, not a lesson"
    assert sum(len(links_of(path)) for path in LINKED) > 300, "the link reader found too few links"
    broken = broken_links(root)
    assert not broken, (f"{command!r} serves {root}: {len(broken)} links of the lessons do not open there, "
                        "e.g.\n" + "\n".join(broken[:10]))


def test_server_root_follows_jupyter_server():
    """The cases of jupyter_server 2's ServerApp (its `_default_root_dir` and `parse_command_line`)."""
    assert server_root("jupyter lab") == (REPO, None)
    assert server_root("jupyter lab lessons/") == (LESSONS, None)
    notebook = LESSONS / "00_numba_cuda.ipynb"
    assert server_root("jupyter lab lessons/00_numba_cuda.ipynb") == (LESSONS, notebook)
    assert server_root("jupyter lab --notebook-dir=. lessons/00_numba_cuda.ipynb") == (REPO, notebook)
    assert server_root("jupyter lab --notebook-dir=. lessons") == (LESSONS, None)  # the argument wins
    assert broken_links(LESSONS), "the links to ../docs must fail where lessons/ is the root"
    with pytest.raises(AssertionError, match="outside its root"):
        server_root("jupyter lab --notebook-dir=docs lessons/00_numba_cuda.ipynb")


def test_the_link_reader_skips_code_and_reads_every_form():
    text = ("[a](x.md) ![b](img/y.png) `k[1, 32](d_a)` [c](z.md \"title\")\n"
            "```python\nkernel[blocks, threads](out)\n```\n[ref]: r.md\n<img src=\"p.png\"> [web](https://a.b/c)")
    assert markdown_links(text) == ["x.md", "img/y.png", "z.md", "https://a.b/c", "r.md", "p.png"]

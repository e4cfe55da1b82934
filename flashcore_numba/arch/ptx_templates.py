"""PTX generated from templates: `ptx/templates/NAME.ptx.in` -> `ptx/NAME.ptx`.

Most of ptx/ is hand-written, one function at a time. One file is not: wgmma.ptx holds the same
few tile products for two input types (f16, bf16), two head dims, two key tiles and, in phase
09, issued-and-not-awaited twins of the awaited ones. Written by hand, its bf16 half was its
f16 half with the type name swapped, and a fix had to be made in up to eight places. Its
template writes each function once, with the loops over the variants spelled out.

The generated file is committed: it is what the kernels load (`arch/ptx.py` reads ptx/ only)
and what a reader opens, so its comments are the template's. Its first lines say it is
generated, from which template, and how to regenerate it.

A template is PTX plus three kinds of line:

    % for d in (64, 128):        a Python statement: `for` and `if` (with `elif`, `else`) open a
    % end for d                  block, `% end` closes it (what follows `end` is a note); any
    %   n = 2 * d                other statement just runs. Spaces after the % are free
    %# a note                    for the template's reader only, not copied
    .reg .f32   %s<${n // 2}>;   text: copied, each ${expression} replaced by its value

and one helper, `registers(stem, count, first=0)`: the operand list {%s0, %s1, ..., %s31}
wrapped at 96 columns below its brace (after the 8 spaces of an operand line). An error names
the template's line.

Templates are never rendered at run time, and the generated files are never edited by hand.
After changing a template:

    python -m flashcore_numba.arch.ptx_templates           # which files are out of date? (exit 1 if any)
    python -m flashcore_numba.arch.ptx_templates --write   # regenerate them all

Every `ptx/templates/*.ptx.in` is one generated file: a new template needs no new code here.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout holding flashcore_numba/ and ptx/
PTX_DIR = REPO_ROOT / "ptx"
TEMPLATES_DIR = PTX_DIR / "templates"
SUFFIX = ".ptx.in"
COMMAND = "python -m flashcore_numba.arch.ptx_templates"

SUBSTITUTION = re.compile(r"\$\{(?P<expression>[^}]*)\}")
BLOCK = re.compile(r"^(for|if)\b.*:$")
CONTINUED = re.compile(r"^(elif\b.*|else\s*):$")
END = re.compile(r"^end(\s.*)?$")  # `% end`, or `% end for d`: words after it are a note


class TemplateError(ValueError):
    """A template that cannot be rendered; names the file and line."""


def registers(stem: str, count: int, first: int = 0) -> str:
    """`{%s0, %s1, ..., %s<count-1>}` (from `%s<first>` on) as an operand line of this folder writes
    it: wrapped at 96 columns, the first line after 8 spaces, the next ones under the first register."""
    names = ", ".join(f"%{stem}{i}" for i in range(first, first + count))
    lines = textwrap.wrap("{" + names + "}", width=96, initial_indent=" " * 8, subsequent_indent=" " * 9,
                          break_on_hyphens=False)
    return "\n".join(lines)[8:]  # the template writes the 8 spaces before `${registers(...)}`


def to_python(template: str, filename: str = "<template>") -> str:
    """The template as a Python program that calls `_emit(line)` for each line of output.

    Line i of the program is line i of the template, so Python's errors name the template's line.
    """
    program, depth = [], 0
    for number, line in enumerate(template.splitlines(), 1):
        indent = "    " * depth
        if line.startswith("%#"):
            program.append("")
        elif line.startswith("%"):
            code = line[1:].strip()
            if END.match(code):
                if depth == 0:
                    raise TemplateError(f"{filename}:{number}: `% end` with no open `% for` or `% if`")
                program.append(indent + "pass")  # a block may hold nothing but other control lines
                depth -= 1
            elif CONTINUED.match(code):
                if depth == 0:
                    raise TemplateError(f"{filename}:{number}: `% {code}` with no open `% if`")
                program.append("    " * (depth - 1) + code)
            elif code.endswith(":"):
                if not BLOCK.match(code):
                    raise TemplateError(f"{filename}:{number}: `% {code}`: only `for` and `if` open a block")
                program.append(indent + code)
                depth += 1
            else:
                program.append(indent + code)
        else:
            pieces, start = [], 0
            for m in SUBSTITUTION.finditer(line):
                pieces += [repr(line[start:m.start()]), f"str({m['expression']})"]
                start = m.end()
            pieces.append(repr(line[start:]))
            program.append(f"{indent}_emit({' + '.join(pieces)})")
    if depth:
        raise TemplateError(f"{filename}: {depth} block(s) never closed with `% end`")
    return "\n".join(program) + "\n"


def render(template: str, filename: str = "<template>") -> str:
    """The text a template writes. Raises TemplateError naming the template's line on any error."""
    program = to_python(template, filename)
    out: list[str] = []
    try:
        code = compile(program, filename, "exec")
    except SyntaxError as e:
        raise TemplateError(f"{filename}:{e.lineno}: {e.msg}") from None
    try:
        exec(code, {"_emit": out.append, "registers": registers})  # noqa: S102 - a template of this checkout
    except Exception as e:  # noqa: BLE001 - any error in a template's Python, reported with its line
        line = [frame.lineno for frame in traceback.extract_tb(e.__traceback__) if frame.filename == filename]
        raise TemplateError(f"{filename}:{line[-1] if line else '?'}: {type(e).__name__}: {e}") from None
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# ptx/templates/NAME.ptx.in -> ptx/NAME.ptx
# ---------------------------------------------------------------------------------------------
def _relative(path: Path) -> str:
    try:
        return Path(path).resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(path)


def templates(directory: Path = TEMPLATES_DIR) -> list[Path]:
    return sorted(Path(directory).glob("*" + SUFFIX))


def output_path(template: Path, ptx_dir: Path = PTX_DIR) -> Path:
    return Path(ptx_dir) / template.name.removesuffix(".in")


def header(template: Path) -> str:
    """The lines the generated file starts with: generated, from what, how to regenerate."""
    return (f"// Generated from {_relative(template)} by `{COMMAND} --write`:\n"
            f"// edit the template, not this file (tests/test_ptx_templates.py checks that the two agree).\n"
            f"//\n")


def generated_source(template: Path) -> str:
    """The generated file of a template, exactly as committed under ptx/."""
    return header(template) + render(template.read_text(encoding="utf-8"), _relative(template))


def out_of_date(directory: Path = TEMPLATES_DIR, ptx_dir: Path = PTX_DIR) -> list[Path]:
    return [output_path(t, ptx_dir) for t in templates(directory)
            if not output_path(t, ptx_dir).exists()
            or output_path(t, ptx_dir).read_text(encoding="utf-8") != generated_source(t)]


def write_all(directory: Path = TEMPLATES_DIR, ptx_dir: Path = PTX_DIR) -> list[Path]:
    written = []
    for template in templates(directory):
        path, text = output_path(template, ptx_dir), generated_source(template)
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            written.append(path)
    return written


# ---------------------------------------------------------------------------------------------
# python -m flashcore_numba.arch.ptx_templates [--write]
# ---------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="Check or regenerate the PTX files of ptx/ "
                                                               "that are written from ptx/templates/.")
    parser.add_argument("--write", action="store_true",
                        help="rewrite the generated files from their templates")
    args = parser.parse_args(argv)
    try:
        if args.write:
            written = write_all()
            for path in written:
                print(f"wrote {_relative(path)}")
            print(f"{len(written)} file(s) rewritten" if written
                  else "all generated PTX files were up to date")
            return 0
        stale = out_of_date()
    except TemplateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in stale:
        print(f"out of date: {_relative(path)}")
    if stale:
        print(f"regenerate with: {COMMAND} --write")
        return 1
    print("all generated PTX files are up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""PTX generated from templates (flashcore_numba.arch.ptx_templates): ptx/templates/NAME.ptx.in
-> ptx/NAME.ptx.

The committed files are what their templates write (as the exercise stubs are what their phases
write, tests/test_exercises.py); the template language renders what it says and names the line
of any error; and wgmma.ptx's copies differ only where the template says they do.
"""

from __future__ import annotations

import re

import pytest

from flashcore_numba.arch import ptx, ptx_templates


def test_every_generated_file_is_current():
    assert [t.name for t in ptx_templates.templates()] == ["wgmma.ptx.in"]
    stale = [p.name for p in ptx_templates.out_of_date()]
    assert not stale, f"{stale} out of date: run python -m flashcore_numba.arch.ptx_templates --write"


def test_templates_command_reports_in_sync(capsys):
    assert ptx_templates.main([]) == 0
    assert "up to date" in capsys.readouterr().out


def test_a_generated_file_says_so_at_its_top():
    head = (ptx.ptx_dir() / "wgmma.ptx").read_text().splitlines()[:3]
    assert "Generated from ptx/templates/wgmma.ptx.in" in head[0]
    assert "python -m flashcore_numba.arch.ptx_templates --write" in head[0]
    assert "edit the template, not this file" in head[1]


def test_template_language():
    template = """\
%# a note, not copied
.reg .f32   %s<${2 * 4}>;
% for d in (64, 128):
%   steps = d // 16
% if d == 64:
short ${steps}
% elif d == 96:
never
% else:
long ${steps}, ${"x" * 2}
% end if
% end for d
        ${registers("frag", 4, first=8)};
"""
    assert ptx_templates.render(template) == (".reg .f32   %s<8>;\nshort 4\nlong 8, xx\n"
                                              "        {%frag8, %frag9, %frag10, %frag11};\n")


def test_long_register_lists_wrap_under_their_first_register():
    lines = ("        " + ptx_templates.registers("s", 64)).splitlines()
    assert [len(re.findall("%s", line)) for line in lines] == [16, 14, 14, 14, 6]
    assert lines[0].startswith("        {%s0,") and all(line.startswith("         %") for line in lines[1:])
    assert max(map(len, lines)) <= 96 and lines[-1].endswith("%s63}")


@pytest.mark.parametrize("template, error", [
    ("a\n% for d in (1, 2):\nb\n", "t.ptx.in: 1 block(s) never closed"),
    ("a\n% end\n", "t.ptx.in:2: `% end` with no open"),
    ("% else:\n", "t.ptx.in:1: `% else:` with no open `% if`"),
    ("% while True:\n% end\n", "t.ptx.in:1: `% while True:`: only `for` and `if` open a block"),
    ("% for d in (1,):\nx ${d + e}\n% end\n", "t.ptx.in:2: NameError"),
    ("x\n% d = (\n", "t.ptx.in:2:"),
])
def test_template_errors_name_their_line(template, error):
    with pytest.raises(ptx_templates.TemplateError) as e:
        ptx_templates.render(template, "t.ptx.in")
    assert error in str(e.value)


def test_a_missing_or_edited_file_is_out_of_date_until_written(tmp_path, capsys):
    templates, out = tmp_path / "templates", tmp_path
    templates.mkdir()
    (templates / "x.ptx.in").write_text("% for i in range(2):\nline ${i}\n% end\n")
    assert ptx_templates.out_of_date(templates, out) == [out / "x.ptx"]
    assert ptx_templates.write_all(templates, out) == [out / "x.ptx"]
    assert (out / "x.ptx").read_text().endswith("//\nline 0\nline 1\n")
    assert ptx_templates.out_of_date(templates, out) == [] and ptx_templates.write_all(templates, out) == []
    (out / "x.ptx").write_text((out / "x.ptx").read_text() + "// a hand edit\n")
    assert ptx_templates.out_of_date(templates, out) == [out / "x.ptx"]


# ---------------------------------------------------------------------------------------------
# wgmma.ptx: the copies the template writes differ only where it says
# ---------------------------------------------------------------------------------------------
WGMMA = ptx.parse(ptx.ptx_dir() / "wgmma.ptx")


def _code(body: str) -> list[str]:
    return [line.split("//")[0].strip() for line in body.splitlines() if line.split("//")[0].strip()]


@pytest.mark.parametrize("name", [n for n in WGMMA if n.endswith("_f16")])
def test_bf16_functions_are_the_f16_ones_with_the_type_named(name):
    f16, bf16 = WGMMA[name], WGMMA[name.removesuffix("_f16") + "_bf16"]
    assert f16.params == bf16.params and f16.results == bf16.results
    assert [line.replace(".f16.f16", ".bf16.bf16") for line in _code(f16.body)] == _code(bf16.body)


@pytest.mark.parametrize("name", [n for n in WGMMA if "_issue_" in n])
def test_issue_functions_are_their_twins_without_the_wait(name):
    issued, awaited = WGMMA[name], WGMMA[name.replace("_issue", "")]
    assert issued.params == awaited.params and issued.results == awaited.results
    assert _code(issued.body) == [line for line in _code(awaited.body) if not line.startswith("wgmma.wait_group")]
    assert sum(line.startswith("wgmma.wait_group") for line in _code(awaited.body)) == 1

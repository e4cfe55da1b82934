"""What a wrong output says about the code that made it: the grader's diagnoses, pictures and excerpts.

Pure NumPy, no kernel: flashcore_numba.course.grade runs the kernels and hands the outputs here.

- `diagnose(runs)`: the known patterns of a wrong attention output, over the cases of one check
  (rules below, first match wins). Each pattern has a generic message; a region may word its
  own (flashcore_numba.course.hints, `diagnoses`), and a check of the whole kernel words it as the
  regions it most likely comes from do (course.student.kernel_diagnoses).

      nan        every output of every case is NaN: the region writes nothing yet
      zeros      every case fails, with all outputs zero: what should reach the output never does
      columns    every wrong output lies in one range of columns d (of every case that fails)
                 and the other columns are right: a strip of the head dim is never computed or
                 stored (a loop over column strips that stops early)
      s_one      the one-key case (S = 1) passes, every case with more keys fails: the state
                 is not carried from key to key
    and on the largest failing case:
      factor     out ≈ c · expected for one constant c != 1: a scale is wrong
      rows       each row is out by a factor of its own: the row's normalization (l_i) is wrong
      magnitude  the signs are right but the sizes are not, by a typical factor: a sum or a
                 scale is off (dividing by a partial sum, for one)

- `picture(out, expected, allowed)`: which rows and columns are wrong, a grid of '.' and 'X'
  over the (rows x columns) of one head, downsampled to fit a terminal.
- `excerpt(out, expected, allowed)`: the worst element, got against expected, with its neighbours.
- `student_line(e, path, lines)`: where in the student's file an exception was raised, from
  its traceback (the CUDA simulator runs the kernel's Python code, so its frames are there).
"""

from __future__ import annotations

import linecache
import re
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..arch.sim import BarrierError, file_line

MAX_PICTURE_ROWS = 16
MAX_PICTURE_COLS = 32
FACTOR_TOLERANCE = 0.02  # relative misfit of out ≈ c · expected still called "a constant factor"

MESSAGES = {
    "nan": "NaN everywhere: the region writes nothing yet (the output was filled with NaN before the launch, "
           "and nothing replaced it)",
    "zeros": "all zeros: nothing that should reach the output does (a state, a weight or a tile is left as it "
             "started)",
    "s_one": "only S = 1 passes: one key is right (its output is its v, whatever the scores), several are "
             "not: the state (m_i, l_i, acc) is not carried from one key to the next, or the scores are wrong",
    "factor": "off by a constant factor {factor:.4g} (got ≈ {factor:.4g} × expected): a scale is wrong",
    "rows": "each row is off by a factor of its own (from {low:.3g} to {high:.3g}): the row's "
            "normalization, its sum l_i, is wrong",
    "magnitude": "the signs are right but the sizes are not (typically {factor:.3g} × expected): a sum or a "
                 "scale is off",
    "columns": "only columns {first}..{last} of the head dim are wrong, every other column is right: that "
               "strip of the output is never computed or stored (does a loop over column strips stop early?)",
}
SAME_SIGN = 0.95  # the share of clearly non-zero outputs whose sign must match for "magnitude"


@dataclass(frozen=True)
class CaseRun:
    """One launch of a check: its case, and the output (None when it raised) against the oracle."""

    label: str  # how the case reads in a report, e.g. "S_q=1 S_k=1 D=64 non-causal"
    seq_k: int
    out: np.ndarray | None  # (B, H, S_q, D)
    expected: np.ndarray  # float64, same shape
    allowed: float  # the largest error the oracle allows, per element
    error: str = ""  # what the launch raised, when out is None

    @property
    def wrong(self) -> np.ndarray:
        return wrong_mask(self.out, self.expected, self.allowed)

    @property
    def ok(self) -> bool:
        return self.out is not None and not self.wrong.any()


def wrong_mask(out, expected, allowed: float) -> np.ndarray:
    """True where an element is NaN, infinite, or further from expected than allowed."""
    out = np.asarray(out, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return ~np.isfinite(out) | (np.abs(out - expected) > allowed)


def constant_factor(out, expected) -> float | None:
    """c when out ≈ c · expected (least squares, misfit within FACTOR_TOLERANCE of the size), else None."""
    out, expected = np.asarray(out, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    if not np.isfinite(out).all():
        return None
    norm = float(np.sum(expected * expected))
    if norm == 0.0:
        return None
    c = float(np.sum(out * expected)) / norm
    misfit = float(np.max(np.abs(out - c * expected)))
    return c if misfit <= FACTOR_TOLERANCE * max(float(np.max(np.abs(expected))), 1e-12) * max(1.0, abs(c)) else None


def row_factors(out, expected) -> np.ndarray | None:
    """Per row (last axis = columns), c_r when every row is out ≈ c_r · expected; else None."""
    out, expected = np.asarray(out, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    rows_out, rows_exp = out.reshape(-1, out.shape[-1]), expected.reshape(-1, expected.shape[-1])
    factors = []
    for o, e in zip(rows_out, rows_exp):
        if not np.any(e):
            if np.any(o):
                return None
            continue
        c = constant_factor(o, e)
        if c is None:
            return None
        factors.append(c)
    return np.array(factors) if factors else None


def diagnose(runs: list[CaseRun], messages: dict[str, str] | None = None) -> str:
    """The known pattern of a failing check's cases, as a sentence; "" when none fits."""
    messages = {**MESSAGES, **(messages or {})}
    ran = [r for r in runs if r.out is not None]
    failing = [r for r in ran if not r.ok]
    if not failing:
        return ""
    if all(np.isnan(np.asarray(r.out, dtype=np.float64)).all() for r in ran):
        return messages["nan"]
    if len(failing) == len(runs) and all(not np.any(r.out) for r in failing):
        return messages["zeros"]
    strip = wrong_columns(failing)  # before s_one: a strip missing at D = 128 fails every case with D = 128
    if strip is not None:
        return messages["columns"].format(first=strip[0], last=strip[1])
    one_key = [r for r in ran if r.seq_k == 1]
    more_keys = [r for r in runs if r.seq_k > 1]
    if one_key and all(r.ok for r in one_key) and more_keys and all(not r.ok for r in more_keys):
        return messages["s_one"]
    worst = max(failing, key=lambda r: r.out.size)
    c = constant_factor(worst.out, worst.expected)
    if c is not None and abs(c - 1.0) > FACTOR_TOLERANCE:
        return messages["factor"].format(factor=c)
    per_row = row_factors(worst.out, worst.expected)
    if per_row is not None and np.ptp(per_row) > FACTOR_TOLERANCE:
        return messages["rows"].format(low=float(per_row.min()), high=float(per_row.max()))
    typical = same_sign_factor(worst.out, worst.expected, worst.allowed)
    if typical is not None:
        return messages["magnitude"].format(factor=typical)
    return ""


def wrong_columns(failing: list[CaseRun]) -> tuple[int, int] | None:
    """(first, last) when the wrong outputs of every failing case fill one range of columns that is
    not the whole head dim, and every column outside it is right; else None."""
    strips = set()
    for r in failing:
        cols = np.flatnonzero(r.wrong.reshape(-1, r.wrong.shape[-1]).any(axis=0))
        if len(cols) == 0 or len(cols) == r.wrong.shape[-1] or cols[-1] - cols[0] + 1 != len(cols):
            return None
        strips.add((int(cols[0]), int(cols[-1])))
    return strips.pop() if len(strips) == 1 else None


def same_sign_factor(out, expected, allowed: float) -> float | None:
    """The median of |out| / |expected| when the signs agree (on the clearly non-zero expected values)
    and that median is far from 1; else None."""
    out, expected = np.asarray(out, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    clear = np.abs(expected) > max(10 * allowed, 1e-6)
    if not np.isfinite(out).all() or clear.sum() < 4:
        return None
    o, e = out[clear], expected[clear]
    if np.mean(np.sign(o) == np.sign(e)) < SAME_SIGN:
        return None
    typical = float(np.median(np.abs(o) / np.abs(e)))
    return typical if abs(typical - 1.0) > 0.1 else None


def picture(out, expected, allowed: float, *, max_rows: int = MAX_PICTURE_ROWS,
            max_cols: int = MAX_PICTURE_COLS) -> str:
    """Which outputs of head (0, 0) are wrong: 'X' where any in the cell is, '.' where all are right.

    Rows are query rows, columns the head dim; both are downsampled to fit max_rows x max_cols.
    """
    wrong = wrong_mask(out, expected, allowed)
    wrong = wrong.reshape(-1, *wrong.shape[-2:])[0]
    n_rows, n_cols = wrong.shape
    row_step, col_step = -(-n_rows // max_rows), -(-n_cols // max_cols)
    if wrong.all() or all(wrong[r0:r0 + row_step, c0:c0 + col_step].any()
                          for r0 in range(0, n_rows, row_step) for c0 in range(0, n_cols, col_step)):
        return f"    wrong outputs in every row and column: {int(wrong.sum())} of {wrong.size} wrong"
    lines = []
    for r0 in range(0, n_rows, row_step):
        cells = "".join("X" if wrong[r0:r0 + row_step, c0:c0 + col_step].any() else "."
                        for c0 in range(0, n_cols, col_step))
        rows = f"{r0}" if row_step == 1 else f"{r0}-{min(r0 + row_step, n_rows) - 1}"
        lines.append(f"    {rows:>9} {cells}")
    per = lambda n, what: f"{n} {what}{'s' * (n != 1)} per {'line' if what == 'row' else 'character'}"
    head = (f"    wrong outputs (X) by query row ({per(row_step, 'row')}) and column d "
            f"({per(col_step, 'column')}); {int(wrong.sum())} of {wrong.size} wrong:")
    return "\n".join([head] + lines)


def excerpt(out, expected, allowed: float, width: int = 4) -> str:
    """The worst element of head (0, 0), got against expected, with the next few of its row."""
    out = np.asarray(out, dtype=np.float64).reshape(-1, *np.shape(out)[-2:])[0]
    expected = np.asarray(expected, dtype=np.float64).reshape(-1, *np.shape(expected)[-2:])[0]
    with np.errstate(invalid="ignore"):
        err = np.where(np.isfinite(out), np.abs(out - expected), np.inf)
    row, col = np.unravel_index(int(np.argmax(err)), err.shape)
    c0 = max(0, min(col, out.shape[1] - width))
    cols = slice(c0, c0 + width)
    fmt = lambda xs: "[" + ", ".join(f"{x:.4f}" for x in xs) + "]"
    return (f"    worst at row {row}, column {col}: got {out[row, col]:.5f}, expected {expected[row, col]:.5f} "
            f"(allowed error {allowed:.2e})\n"
            f"    row {row}, columns {c0}..{c0 + width - 1}: got      {fmt(out[row, cols])}\n"
            f"    {'':>{len(f'row {row}, columns {c0}..{c0 + width - 1}:')}} expected {fmt(expected[row, cols])}")


# ---------------------------------------------------------------------------------------------
# Exceptions: the student's line
# ---------------------------------------------------------------------------------------------
THREAD_PREFIX = re.compile(r"^tid=\[[^\]]*\] ctaid=\[[^\]]*\]:\s*")  # the CUDA simulator's
COMPILER_LOCATION = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def barrier_lines(path, lines: dict[int, int] | None, shown_as):
    """How a BarrierError names a line (its `where`): the line of the student's file where the file
    that ran (`path`) is the student's or a splice of it (`lines` maps its lines, `shown_as` is the
    student's file; a line it does not map is the solution's, of another region); `file:line`
    elsewhere (the package's own code)."""
    ran = Path(path).resolve()

    def where(filename: str, line: int) -> str:
        if Path(filename).resolve() != ran:
            return file_line(filename, line)
        if lines is None:
            return file_line(str(ran), line)
        if line in lines:
            shown = Path(shown_as or path)
            code = linecache.getline(str(shown), lines[line]).strip()
            return f"{shown.name}:{lines[line]}" + (f" (`{code}`)" if code else "")
        code = linecache.getline(str(ran), line).strip()
        return f"the solution's code of another region (`{code}`)"

    return where


def _student_location(m: re.Match, path, lines: dict[int, int], shown_as) -> str:
    line = int(m["line"])
    if Path(m["file"]).resolve() == Path(path).resolve() and line in lines:
        return f'File "{Path(shown_as or path).name}", line {lines[line]}'
    return m.group()


def student_line(e: BaseException, path, lines: dict[int, int] | None = None,
                 shown_as=None) -> tuple[int, str] | None:
    """(line, code) of the innermost frame of e's traceback in the student's file, or None.

    `path` is the file that ran. When it is a spliced copy (a region check), `lines` maps its
    lines to the student's and `shown_as` is the student's file, whose line is read back.
    """
    path = Path(path).resolve()
    found = None
    tb = e.__traceback__
    for frame in traceback.extract_tb(tb):
        if Path(frame.filename).resolve() != path:
            continue
        if lines is None:
            found = (frame.lineno, (frame.line or "").strip())
        elif frame.lineno in lines:
            line = lines[frame.lineno]
            found = (line, linecache.getline(str(shown_as or path), line).strip() or (frame.line or "").strip())
    return found


def describe_exception(e: BaseException, path, lines: dict[int, int] | None = None, shown_as=None,
                       outside: dict[int, int] | None = None) -> str:
    """'line 97 (`foo = acc[d, 3]`): IndexError: ...' with the student's line when the traceback has one.

    The simulator's thread ids lead its messages; they move to the end, as the thread that raised.
    A BarrierError (threads that can never meet again) is told in full, each barrier at its line of
    the student's file: `outside` maps the spliced file's other lines (exercises.Spliced.outside).
    """
    if isinstance(e, BarrierError):
        mapped = None if lines is None else {**(outside or {}), **lines}
        return f"raised BarrierError: {e.describe(barrier_lines(path, mapped, shown_as))}"
    message = " ".join(str(e).split())
    if lines is not None:  # a compiler's message (numba on a GPU) quotes the spliced file by line
        message = COMPILER_LOCATION.sub(lambda m: _student_location(m, path, lines, shown_as), message)
    thread = THREAD_PREFIX.match(message)
    if thread:
        message = message[thread.end():] + f" (in thread {thread.group().rstrip(': ')})"
    if len(message) > 400:
        message = message[:400] + " ..."
    text = f"{type(e).__name__}: {message}" if message else type(e).__name__
    where = student_line(e, path, lines, shown_as)
    if where:
        name = Path(shown_as or path).name
        return f"{name} line {where[0]} (`{where[1]}`) raised {text}"
    return f"raised {text}"


def explain(runs: list[CaseRun], messages: dict[str, str] | None = None) -> str:
    """The diagnosis of the failing cases (where the pattern is known), then the largest failing case's
    worst element and its picture of wrong rows and columns."""
    lines = []
    diagnosis = diagnose(runs, messages)
    if diagnosis:
        lines.append(f"diagnosis: {diagnosis}")
    failing = [r for r in runs if r.out is not None and not r.ok]
    if failing:
        worst = max(failing, key=lambda r: r.out.size)
        if len(runs) > 1:
            lines.append(f"in case {worst.label}:")
        if not np.isnan(np.asarray(worst.out, dtype=np.float64)).all():
            lines.append(excerpt(worst.out, worst.expected, worst.allowed))
        lines.append(picture(worst.out, worst.expected, worst.allowed))
    return "\n".join(lines)

"""`flashcore report`: every performance figure in the README, docs/performance.md, the plots and
the phase docstrings is regenerated from the committed benchmark records (docs/bench/*.json), never
typed.

It writes four things:

1. the README's headline, between the lines `<!-- headline:begin -->` and `<!-- headline:end -->`:
   one table on one GPU (phase 09's forward and phase 13's backward at the reference problems,
   phase 10's decode steps, each beside SDPA flash, SDPA cuDNN and FlexAttention, "not measured"
   where a record lacks one) and the ladder plot;
2. the full tables in docs/performance.md, between the lines `<!-- bench:begin -->` and
   `<!-- bench:end -->`;
3. docs/bench/ladder.png (TFLOPS per phase on a log scale, torch SDPA as reference lines)
   and docs/bench/sweep.png (TFLOPS over S, when a sweep record exists; a point whose launches
   spread, `sweep_spreads`, is drawn hollow, listed under the plot and FLAGGED in the summary);
4. the "Measured effect" block of each phase module's docstring, between the lines
   `[measured:begin]` and `[measured:end]`. A phase slower than its predecessor says so.

The exercise stubs copy the phase sources, docstrings included, so `flashcore report` then
regenerates them (course.exercises): the CLI wires the two, as measurement never imports the
course.

`load_records` (from flashcore_numba.measure.records, re-exported here) and `measured_phase` are the
read side, for the lessons.
"""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

from .. import phases as phase_registry
from . import first_call
from .backward import BACKWARD_FLOPS, FLOPS_RULE
from .bench import (
    MEAN_OVER_MEDIAN,
    REFERENCE_SHAPE,
    SHORT_DTYPE,
    SLOW,
    Problem,
    format_tflops,
    ladder_speedups,
)
from .records import RecordError, default_records_dir, load_records, repo_root
from .serving import serving_records, serving_table

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"  # docs/performance.md
HEADLINE_BEGIN, HEADLINE_END = "<!-- headline:begin -->", "<!-- headline:end -->"  # README.md
MEASURED_BEGIN, MEASURED_END = "[measured:begin]", "[measured:end]"
DOCSTRING_INDENT = "    "
NOT_MEASURED = "not measured yet"


class ReportError(Exception):
    """A problem with the inputs of the report (a bad record, a missing marker)."""


# ---------------------------------------------------------------------------------------------
# Reading records
# ---------------------------------------------------------------------------------------------
def _shape_key(record) -> tuple:
    """Everything of the problem except the causal flag, plus the GPU."""
    c = record["config"]
    return (record["provenance"]["gpu_name"], c["B"], c["H"], c["S_q"], c["S_k"], c["D"], c["dtype"],
            c.get("H_kv"), c.get("D_v"))


def _is_reference_shape(record) -> bool:
    B, H, S, D = REFERENCE_SHAPE
    return _shape_key(record)[1:] == (B, H, S, S, D, "float16", None, None)


def _preference(record) -> tuple:
    """Most phases first, then newest: a later run of a few phases never hides the full ladder."""
    results = record["results"] if "results" in record else record["sweep"][0]["results"]
    return sum(r["kind"] == "phase" for r in results), record["created"]


def _latest_pair(records):
    """(non-causal, causal) records of one GPU and shape, each the preferred one or None."""
    if not records:
        return None, None
    anchor = max(records, key=_preference)
    same = [r for r in records if _shape_key(r) == _shape_key(anchor)]
    pick = {}
    for causal in (False, True):
        candidates = [r for r in same if r["config"]["causal"] == causal]
        pick[causal] = max(candidates, key=_preference) if candidates else None
    return pick[False], pick[True]


def ladder_records(records):
    """The (non-causal, causal) records of the ladder table (docs/performance.md): single-problem
    records at the reference shape when there are any; among those the most complete, then the newest."""
    singles = [r for r in records if "sweep" not in r]
    return _latest_pair([r for r in singles if _is_reference_shape(r)] or singles)


def other_ladders(records, anchor) -> list[tuple]:
    """(non-causal, causal) pairs of the other single-problem shapes measured on the anchor's GPU
    (e.g. D=128 beside the reference shape), each pair the most complete, then newest."""
    if anchor is None:
        return []
    singles = [r for r in records if "sweep" not in r
               and r["provenance"]["gpu_name"] == anchor["provenance"]["gpu_name"]
               and _shape_key(r) != _shape_key(anchor)
               # a ladder, not one kernel's latency; or a problem only one phase runs (v's own head dim)
               and (sum(x["kind"] == "phase" for x in r["results"]) > 1 or r["config"].get("D_v"))]
    pairs = []
    def order(key):  # fp16 first, then bf16, then grouped-query shapes; by head dim within each
        gpu, B, H, S_q, S_k, D, dtype, H_kv, D_v = key
        return (H_kv is not None, dtype != "float16", D, D_v or 0, S_q, S_k, B, H, str(dtype), H_kv or 0)

    for key in sorted({_shape_key(r) for r in singles}, key=order):
        pairs.append(_latest_pair([r for r in singles if _shape_key(r) == key]))
    return pairs


def sweep_records(records) -> list[tuple]:
    """(non-causal, causal) sweep records, one pair per head dim (ascending), each the newest."""
    sweeps = [r for r in records if "sweep" in r]
    return [_latest_pair([r for r in sweeps if r["config"]["D"] == D])
            for D in sorted({r["config"]["D"] for r in sweeps})]


def _result(record, name):
    if record is None:
        return None
    return next((r for r in record["results"] if r["name"] == name), None)


def measured_phase(phase_id: str, records=None) -> dict | None:
    """What the committed records say about one phase, for a lesson to quote.

    Returns None when no record exists, else {"gpu", "date", "config", "noncausal",
    "causal", "speedup_noncausal", "speedup_causal"}: the result dicts as stored in the
    record (or None), and (previous phase id, ratio) pairs (or None).
    """
    records = load_records() if records is None else records
    nc, c = ladder_records(records)
    anchor = nc or c
    if anchor is None:
        return None
    return {
        "gpu": anchor["provenance"]["gpu_name"],
        "date": anchor["created"][:10],
        "config": {k: v for k, v in anchor["config"].items() if k != "causal"},
        "noncausal": _result(nc, phase_id),
        "causal": _result(c, phase_id),
        "speedup_noncausal": ladder_speedups(nc["results"]).get(phase_id) if nc else None,
        "speedup_causal": ladder_speedups(c["results"]).get(phase_id) if c else None,
    }


# ---------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------
def _describe(config) -> str:
    """'B=16 H=16 S=2048 D=64 fp16': the problem of a record, causal or not (other config keys, such
    as a backward record's "pass", are not the problem's)."""
    fields = {name: config[name] for name in Problem.__dataclass_fields__ if name in config}
    return Problem(**dict(fields, causal=False)).describe()


def _mode(record) -> str:
    return "causal" if record["config"]["causal"] else "non-causal"


def _cell(result) -> str:
    """TFLOPS, or why there is no figure."""
    if result is None:
        return "—"
    if not result["available"]:
        return "n/a"
    if not result["correct"]:
        return "FAILED check"
    return format_tflops(result["tflops"])


def _speedup_cell(speedup) -> str:
    if speedup is None:
        return ""
    prev, ratio = speedup
    return f"{ratio:.2f}× vs {prev}" + (" (**slower**)" if ratio < 1 else "")


def _machine_line(record) -> str:
    p = record["provenance"]
    details = [f"compute capability {p.get('compute_capability')}"]
    if p.get("driver"):
        details.append(f"driver {p['driver']}")
    clocks = [p.get("sm_clock_mhz_start"), p.get("sm_clock_mhz_end")]
    if any(x is not None for x in clocks):
        details.append("SM clock " + " → ".join("?" if x is None else str(x) for x in clocks) + " MHz")
    return f"**{p['gpu_name']}** ({', '.join(details)})"


def _code_of(*records) -> str:
    """Which code the records measured: ", code at commit abc1234" (records may differ in commit), "abc1234
    with uncommitted changes" where the record says the checkout had some."""
    commits = []
    for r in records:
        provenance = (r or {}).get("provenance") or {}
        commit = provenance.get("git_commit")
        if commit:
            text = f"`{commit[:7]}`" + (" with uncommitted changes" if provenance.get("git_dirty") else "")
            if text not in commits:
                commits.append(text)
    return f", code at commit {' and '.join(commits)}" if commits else ""


def _with_tail(records, nc, c):
    """(non-causal, causal) of the shape of nc or c: the newest records that carry a tail (a run of a
    few kernels, made after the ladder's), else nc and c themselves."""
    pair = []
    for r in (nc, c):
        if r is None:
            pair.append(None)
            continue
        same = [x for x in records if "sweep" not in x and _shape_key(x) == _shape_key(r)
                and x["config"]["causal"] == r["config"]["causal"] and any(y.get("tail") for y in x["results"])]
        pair.append(max(same, key=lambda x: x["created"]) if same else r)
    return pair


def performance_table(nc, c, readme_dir: Path, plots: list[Path], others=(), latency=(), all_records=(), varlen=(),
                      kvcache=(), backward=(), first_calls=(), serving=(), flex=()) -> str:
    """The markdown between docs/performance.md's markers (`readme_dir`: that page's folder)."""
    lines = ["<!-- generated by `flashcore report` from the benchmark records; do not edit by hand -->", ""]
    anchor = nc or c
    if anchor is None:
        lines.append("No benchmark record yet: run `flashcore bench` (and `flashcore bench --causal`) on a "
                     "GPU, commit the records in docs/bench/, then run `flashcore report`.")
        return "\n".join(lines)
    timing = anchor["timing"]
    lines += [f"#### The ladder, {_describe(anchor['config'])}", ""]
    ceilings = [f"{format_tflops(r['ceiling_tflops'])} TFLOPS ({_mode(r)} run)"
                for r in (nc, c) if r is not None and r.get("ceiling_tflops")]
    lines.append(f"Measured on {_machine_line(anchor)} on {anchor['created'][:10]}{_code_of(nc, c)}, "
                 f"{_describe(anchor['config'])}; median of {timing['repeats']} runs, "
                 "L2 flushed before each. "
                 + (f"Tensor-core ceiling measured in the same runs ({anchor['ceiling']['what']}): "
                    f"{', '.join(ceilings)}." if ceilings else "No tensor-core ceiling in these records."))
    lines += ladder_table(nc, c)
    rel = [_rel(r["_path"], readme_dir) for r in (nc, c) if r is not None]
    lines += ["", "Records: " + ", ".join(f"[`{p}`]({p})" for p in rel) + "."]
    lines += launch_times_table(nc, c)
    lines += latency_table(latency)
    lines += first_call_table(first_calls, readme_dir)
    for plot in plots:
        lines += ["", f"![{plot.stem}]({_rel(plot, readme_dir)})"]
    for o_nc, o_c in others:
        o_anchor = o_nc or o_c
        lines += ["", f"#### {_describe(o_anchor['config'])}", "",
                  f"Measured on the same GPU on {o_anchor['created'][:10]}{_code_of(o_nc, o_c)}, same protocol."]
        lines += bandwidth_table(o_anchor) if _bandwidth_bound(o_nc, o_c) else ladder_table(o_nc, o_c)
        rel = [_rel(r["_path"], readme_dir) for r in (o_nc, o_c) if r is not None]
        lines += ["", "Records: " + ", ".join(f"[`{p}`]({p})" for p in rel) + "."]
        tail = tail_summary(*_with_tail(all_records, o_nc, o_c))
        if tail:
            lines += ["", tail]
    lines += varlen_table(varlen, readme_dir)
    lines += kvcache_table(kvcache, readme_dir)
    lines += flex_table(flex, readme_dir)
    if serving:
        lines += ["", "#### Serving: a decode step as a server calls it", ""] + serving_table(serving)
        lines += ["Records: " + ", ".join(f"[`{p}`]({p})" for p in (_rel(r["_path"], readme_dir) for r in serving))
                  + "."]
    lines += backward_table(backward, readme_dir)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The README's headline: one table on one GPU
# ---------------------------------------------------------------------------------------------
# (result name, column title) of the peers the headline sets every row beside, read from the row's own
# record, forward or backward (bench --backward names FlexAttention's backward flex_attention too); a
# peer no record of the row has is "not measured", never left out
HEADLINE_PEERS = (("sdpa_flash", "SDPA flash (FlashAttention-2)"), ("sdpa_cudnn", "SDPA cuDNN"),
                  ("flex_attention", "FlexAttention"))
HEADLINE_HEAD_DIMS = (64, 128)  # the reference problems: REFERENCE_SHAPE at each head dim, causal and not
NOT_MEASURED_CELL = "not measured"


def _reference_problem(record, D: int, causal: bool) -> bool:
    B, H, S, _ = REFERENCE_SHAPE
    c = record["config"]
    return ((c["B"], c["H"], c["S_q"], c["S_k"], c["D"], c["dtype"], c.get("H_kv"), c.get("D_v"), c["causal"])
            == (B, H, S, S, D, "float16", None, None, causal))


def _decode_step(record) -> bool:
    """A decode step: few query rows per K/V head (api.DECODE_ROWS)."""
    from ..api import DECODE_ROWS

    c = record["config"]
    return "sweep" not in record and c["S_q"] * c["H"] // (c.get("H_kv") or c["H"]) <= DECODE_ROWS


def _newest_with(records, name):
    """Of `records` in which kernel `name` was timed, the one with the most of the headline's peers
    timed beside it (a run made for the headline, FlexAttention included, before a newer ladder
    without it), the newest among those; or None."""
    timed = [r for r in records if _result(r, name) and _result(r, name).get("median_ms")]

    def peers(r):
        return sum(1 for peer, _ in HEADLINE_PEERS if _result(r, peer) and _result(r, peer).get("median_ms"))

    return max(timed, key=lambda r: (peers(r), r["created"])) if timed else None


def headline_rows(gpu, records, backward) -> list[tuple]:
    """(pass, phase id, unit, record or None, problem text) of the headline on one GPU: phase 09's
    forward and phase 12's backward at each reference problem, then each decode step's phase 10."""
    B, H, S, _ = REFERENCE_SHAPE
    mine = [r for r in records if "sweep" not in r and r["provenance"]["gpu_name"] == gpu]
    rows = []
    for what, phase, pool in (("forward", "09", mine),
                              ("backward", "13", [r for r in backward if r["provenance"]["gpu_name"] == gpu])):
        for D in HEADLINE_HEAD_DIMS:
            for causal in (False, True):
                problem = f"B={B} H={H} S={S} D={D} fp16" + (" causal" if causal else "")
                found = _newest_with([r for r in pool if _reference_problem(r, D, causal)], phase)
                rows.append((what, phase, "TFLOPS", found, problem))
    decode = {}
    for r in (r for r in mine if _decode_step(r) and _result(r, "10") and _result(r, "10").get("median_ms")):
        key = _shape_key(r)
        if key not in decode or r["created"] > decode[key]["created"]:
            decode[key] = r
    for r in sorted(decode.values(), key=lambda r: (r["config"]["S_k"], r["config"]["B"])):
        rows.append(("decode step", "10", "µs", r, _describe(r["config"])))
    return rows


def _headline_value(result, unit) -> str:
    if result is None:
        return NOT_MEASURED_CELL
    if not result.get("median_ms"):
        return _cell(result)
    return format_tflops(result["tflops"]) if unit == "TFLOPS" else _us(result["median_ms"])


def _headline_ratio(ours, peers) -> str:
    """Our kernel's speed beside the fastest peer measured in the same run: '1.10× SDPA cuDNN'."""
    timed = [(r["median_ms"], title) for r, title in peers if r is not None and r.get("median_ms")]
    if ours is None or not ours.get("median_ms") or not timed:
        return "—"
    fastest_ms, title = min(timed)
    return f"{fastest_ms / ours['median_ms']:.2f}× {title.split(' (')[0]}"


def headline_gpu(records, backward):
    """The GPU whose records fill most of the headline (the most recently measured among equals)."""
    gpus = {r["provenance"]["gpu_name"] for r in [*records, *backward]}
    def filled(gpu):
        rows = headline_rows(gpu, records, backward)
        newest = max((r["created"] for r in [*records, *backward] if r["provenance"]["gpu_name"] == gpu), default="")
        return sum(record is not None for _, _, _, record, _ in rows), newest
    return max(sorted(gpus), key=filled) if gpus else None


def headline_table(records, backward, readme_dir: Path, plot: Path | None, performance: Path,
                   ladder=None, flex=()) -> list[str]:
    """The markdown between the README's headline markers: phase 09's forward and phase 13's backward
    at the reference problems and phase 10's decode steps, each beside the peers of its own run, on
    the GPU whose records fill most of it, then phase 14's mods beside FlexAttention (flex_rows); then
    the ladder plot and a link to the full tables."""
    lines = ["<!-- generated by `flashcore report` from the benchmark records; do not edit by hand -->", ""]
    gpu = headline_gpu(records, backward)
    if gpu is None:
        lines.append("No benchmark record yet: run `flashcore bench` on a GPU, commit the records in docs/bench/, "
                     "then run `flashcore report`.")
        return lines
    rows = headline_rows(gpu, records, backward)
    flex = [r for r in flex if r["provenance"]["gpu_name"] == gpu]
    used = sorted([*(record for _, _, _, record, _ in rows if record is not None), *flex_headline_records(flex)],
                  key=lambda r: r["created"])
    dates = " to ".join(dict.fromkeys([used[0]["created"][:10], used[-1]["created"][:10]])) if used else "no record"
    commits = _code_of(*used).replace("` and `", "`, `")
    if commits.count("`") > 2:
        commits = commits.replace("at commit `", "at commits `", 1)
    intro = (f"On the **{gpu}** ({dates}{commits}): kernel time, the median of launches each after an L2 flush, "
             "every kernel checked against the float64 reference before it was timed; TFLOPS of the forward's "
             f"FLOPs (halved for causal), the backward's counted as {BACKWARD_FLOPS} x those, as FlashAttention's "
             "benchmark counts them. Each row is one run: flashcore's kernel and the peers beside it.")
    mods = flex_rows(flex, readme_dir)
    if mods:
        intro += (" Your own mods (phase 14, `flex_attention`): each case beside torch's FlexAttention with the "
                  "same mods (SDPA takes none), TFLOPS of the work the mask leaves.")
    peer_titles = " | ".join(title for _, title in HEADLINE_PEERS)
    lines += [intro, "",
              f"| pass, phase (unit) | problem | flashcore | {peer_titles} | beside the fastest peer |",
              "|---|---|---:|" + "---:|" * len(HEADLINE_PEERS) + "---|"]
    last = None
    for what, phase, unit, record, problem in rows:
        label = f"{what}, {phase} ({unit})" if (what, phase) != last else ""
        last = (what, phase)
        if record is not None:
            problem = f"[{problem}]({_rel(record['_path'], readme_dir)})"
        ours = _result(record, phase)
        peers = [(_result(record, name), title) for name, title in HEADLINE_PEERS]
        cells = [label, problem, _headline_value(ours, unit), *(_headline_value(r, unit) for r, _ in peers),
                 _headline_ratio(ours, peers)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += mods
    if plot is not None and ladder is not None:
        caption = (f"The ladder, every phase's TFLOPS beside SDPA's backends: the {ladder['provenance']['gpu_name']}, "
                   f"{_describe(ladder['config'])}, non-causal and causal ({ladder['created'][:10]}).")
        lines += ["", caption, "", f"![ladder]({_rel(plot, readme_dir)})"]
    page = _rel(performance, readme_dir)
    lines += ["", f"Every phase, every shape, each GPU and the records: [{page}]({page})."]
    return lines


FLEX_HEADLINE_S = 4096  # the mods' rows: issue 77's problems, B=16 H=16 S=4096 at each head dim


def flex_headline_records(records) -> list[dict]:
    """The newest flex record at B=16 H=16 S=FLEX_HEADLINE_S of each head dim, by head dim."""
    newest = {}
    for r in records:
        c = r["config"]
        if (c["B"], c["H"], c["S_q"]) == (16, 16, FLEX_HEADLINE_S) and r["created"] > newest.get(c["D"], {}).get(
                "created", ""):
            newest[c["D"]] = r
    return [newest[D] for D in sorted(newest)]


def flex_rows(records, readme_dir) -> list[str]:
    """The headline's rows of phase 14 (your own mods): a row per case, its figures at each head dim
    of flex_headline_records side by side ("D=64 / D=128"), TFLOPS of the work the mask leaves,
    beside FlexAttention with the same mods in the same run (SDPA takes no mods: "—")."""
    chosen = flex_headline_records(records)
    pairs = [dict((case, (mine, theirs)) for case, mine, theirs in _flex_pairs(r)) for r in chosen]
    links = " / ".join(f"[D={r['config']['D']}]({_rel(r['_path'], readme_dir)})" for r in chosen)
    cases = list(dict.fromkeys(case for by_case in pairs for case in by_case))
    lines, label = [], "your own mods, 14 (TFLOPS of the work the mask leaves)"
    for case in cases:
        got = [by_case.get(case, (None, None)) for by_case in pairs]

        def each(pick):
            return " / ".join(NOT_MEASURED_CELL if r is None else format_tflops(r["tflops"]) for r in map(pick, got))

        ratios = " / ".join("—" if None in (mine, theirs) else f"{theirs['median_ms'] / mine['median_ms']:.2f}×"
                            for mine, theirs in got)
        cells = [label, f"{case}, B=16 H=16 S={FLEX_HEADLINE_S} fp16, {links}", each(lambda g: g[0]), "—", "—",
                 each(lambda g: g[1]), f"{ratios} FlexAttention"]
        lines.append("| " + " | ".join(cells) + " |")
        label = ""
    return lines


def missing_headline(records, backward) -> list[str]:
    """What the headline lacks on its GPU, one line per missing cell (for the command's summary)."""
    gpu = headline_gpu(records, backward)
    if gpu is None:
        return []
    out = []
    for what, phase, unit, record, problem in headline_rows(gpu, records, backward):
        if record is None:
            out.append(f"{gpu}: {what} phase {phase}, {problem}: no record")
            continue
        for name, title in HEADLINE_PEERS:
            if _result(record, name) is None:
                out.append(f"{gpu}: {what} phase {phase}, {problem}: {title} not in {Path(record['_path']).name}")
    return out


def _by_gpu(records) -> list[tuple[str, list[dict]]]:
    """(GPU name, its records) for each GPU of `records`, the GPU measured most recently first (by
    the records' dates): a table per GPU, since one GPU's figures say nothing of another's."""
    newest = {}
    for r in records:
        gpu = r["provenance"]["gpu_name"]
        newest[gpu] = max(newest.get(gpu, ""), r["created"])
    return [(gpu, [r for r in records if r["provenance"]["gpu_name"] == gpu])
            for gpu in sorted(newest, key=lambda g: newest[g], reverse=True)]


def backward_table(records, readme_dir) -> list[str]:
    """The backward records (docs/bench/backward/, measure/backward.py), a table per GPU: per
    problem, phases 11's, 12's and 13's backward (atomics and deterministic) and SDPA's flash and cuDNN backward
    (and FlexAttention's, where the run had it), then one training step (forward and backward) of each;
    TFLOPS as FlashAttention counts them."""
    if not records:
        return []
    lines = ["", "#### The backward pass (phases 11, 12 and 13: attention()'s autograd runs 13 on Hopper, 12 there when "
             "deterministic, 11 elsewhere)"]
    for gpu, own in _by_gpu(records):
        lines += _backward_gpu_table(own, gpu, readme_dir)
    return lines


def _backward_gpu_table(records, gpu, readme_dir) -> list[str]:
    lines = ["", f"Measured on the {gpu}: kernel time, L2 flushed before each launch; "
             f"TFLOPS: {FLOPS_RULE}. Every row passed the gradient "
             f"oracle (batch 0 against torch's float64 autograd) before it was timed. Call: the same "
             f"launch back to back as a training loop runs it, median (p99), where the record has it.", "",
             "| Problem | Kernel | ms | TFLOPS | beside SDPA flash | call ms (p99) |",
             "|---|---|---:|---:|---|---:|"]
    for record in sorted(records, key=lambda r: (r["config"]["D"], r["config"]["causal"], r["config"]["dtype"])):
        c = record["config"]
        problem = (f"B={c['B']} H={c['H']}" + (f" H_kv={c['H_kv']}" if c.get("H_kv") else "")
                   + f" S={c['S_q']} D={c['D']} {SHORT_DTYPE.get(c['dtype'], c['dtype'])}"
                   + (" causal" if c["causal"] else "") + f" ({record['created'][:10]}{_code_of(record)})")
        timed = {r["name"]: r for r in record["results"] if r.get("tflops")}
        for r in record["results"]:
            if r["name"] not in timed:
                why = r.get("reason") if not r["available"] else f"FAILED the gate: {r['message']}"
                lines.append(f"| {problem} | {r['title']} | — | — | {why} | — |")
            else:
                flash = timed.get("sdpa_flash-step" if r["name"].endswith("-step") else "sdpa_flash")
                beside = "" if flash is None or r is flash else f"{r['tflops'] / flash['tflops']:.2f}×"
                call = r.get("call")
                call = f"{call['median_ms']:.3f} ({call['p99_ms']:.3f})" if call else "—"
                lines.append(f"| {problem} | {r['name']}: {r['title']} | {r['median_ms']:.3f} | "
                             f"{format_tflops(r['tflops'])} | {beside} | {call} |")
            problem = ""
    rel = [_rel(r["_path"], readme_dir) for r in records]
    lines += ["", "Records: " + ", ".join(f"[`{p}`]({p})" for p in rel) + "."]
    return lines


def _flex_pairs(record) -> list[tuple[str, dict | None, dict | None]]:
    """(case, phase 14's row, FlexAttention's row) of a flex record, in its order (None where untimed)."""
    timed = {r["name"]: r for r in record["results"] if r.get("tflops")}
    cases = [r["name"].removeprefix("14 ") for r in record["results"] if r["name"].startswith("14 ")]
    return [(case, timed.get(f"14 {case}"), timed.get(f"flex_attention {case}")) for case in cases]


def flex_table(records, readme_dir) -> list[str]:
    """The flex records (docs/bench/flex/, measure/flex.py), a table per GPU: per problem and case,
    phase 14 (flex_attention) beside torch's FlexAttention with the same mods, and causal as a
    mask_mod beside attention(causal=True); TFLOPS of the work the mask leaves."""
    if not records:
        return []
    lines = ["", "#### Your own mods: flex_attention (phase 14) beside torch's FlexAttention"]
    for gpu, own in _by_gpu(records):
        lines += ["", f"Measured on the {gpu}: kernel time, L2 flushed before each launch; TFLOPS count the "
                  "work the mask leaves (the forward's FLOPs times the share of (row, key) pairs it keeps). "
                  "Every row passed the oracle with the same mods (batch 0) before it was timed. "
                  "FlexAttention is torch.compile'd, with its own block mask made once. Call: the same call "
                  "back to back, median / p99 (the host's median per call), where the record has it.", "",
                  "| Problem | Case | phase 14 ms | TFLOPS | FlexAttention ms | TFLOPS | phase 14 beside it | "
                  "phase 14's call ms |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for record in sorted(own, key=lambda r: (r["config"]["D"], r["config"]["dtype"])):
            c = record["config"]
            problem = (f"B={c['B']} H={c['H']} S={c['S_q']} D={c['D']} {SHORT_DTYPE.get(c['dtype'], c['dtype'])} "
                       f"({record['created'][:10]}{_code_of(record)})")
            timed = {r["name"]: r for r in record["results"] if r.get("tflops")}
            for case, mine, theirs in _flex_pairs(record):
                cells = [f"{x['median_ms']:.3f} | {format_tflops(x['tflops'])}" if x else "— | —" for x in (mine, theirs)]
                ratio = f"{mine['tflops'] / theirs['tflops']:.2f}×" if mine and theirs else "—"
                lines.append(f"| {problem} | {case} | {cells[0]} | {cells[1]} | {ratio} | {_call_cell(mine)} |")
                problem = ""
            fast = timed.get("attention causal=True")
            for case in ("causal_mask", "sliding_window"):  # the fast path's time over the case's
                mine = timed.get(f"14 {case}")
                if fast and mine:
                    lines.append(f"| | {case} beside attention(causal=True) ({fast['median_ms']:.3f} ms) | | | | | "
                                 f"{fast['median_ms'] / mine['median_ms']:.2f}× | |")
        rel = [_rel(r["_path"], readme_dir) for r in own]
        lines += ["", "Records: " + ", ".join(f"[`{p}`]({p})" for p in rel) + "."]
    return lines


def first_call_table(records, readme_dir) -> list[str]:
    """The first-call records (docs/bench/first_call/, measure/first_call.py): per GPU, each problem's
    first attention() call in a new process, with the kernel cache warm (and empty, where measured),
    the median of the record's processes."""
    lines = []
    for gpu, group in _by_gpu(records):
        commits = sorted({(r["provenance"]["git_commit"] or "unknown")[:7] for r in group})
        dates = sorted({r["created"][:10] for r in group})
        n = sorted({r["config"]["processes"] for r in group})
        lines += ["", "#### The first call of a new process", "",
                  f"`attention()` in new Python processes on the {gpu} ({', '.join(dates)}; code at commit"
                  f"{'s' * (len(commits) > 1)} {', '.join(f'`{c}`' for c in commits)}): the first call, from "
                  "the call until the GPU has finished it (the kernel loaded from the kernel cache, or "
                  "compiled); before it, the import of torch and flashcore_numba and torch.cuda.is_available(), "
                  "which starts the CUDA driver (torch's context, made with the inputs, is in neither; "
                  "Numba's attach to it is in the first call); after "
                  "it, the second call. "
                  f"Median of {'/'.join(map(str, n))} processes; a warm cache holds the kernel (`flashcore "
                  "compile` or an earlier process put it there), an empty one makes each process compile.", "",
                  "| B, H, S, D | kernel | kernel cache | first call | import | second call | loaded / compiled |",
                  "|---|---|---|---:|---:|---:|---|"]
        for record in group:
            c = record["config"]
            heads = f"{c['H']}/{c['H_kv']}" if c["H_kv"] != c["H"] else str(c["H"])
            problem = (f"{c['B']}, {heads}, {c['S']}, {c['D']} {SHORT_DTYPE.get(c['dtype'], c['dtype'])}"
                       + (" causal" if c["causal"] else ""))
            for r in record["results"]:
                loaded = sum(run["loaded"] for run in r["runs"])
                built = sum(run["built"] for run in r["runs"])
                check = "" if r["ok"] else " (WRONG OUTPUT)"
                lines.append(f"| {problem} | {r['phase'] or 'attention() chooses'} | {r['cache']} | "
                             f"{r['first_call_s']:.2f} s{check} | {r['import_s']:.2f} s | "
                             f"{1e3 * r['second_call_s']:.2f} ms | {loaded} / {built} |")
        rel = [_rel(r["_path"], readme_dir) for r in group]
        lines += ["", "Records: " + ", ".join(f"[`{p}`]({p})" for p in rel) + "."]
    return lines


def kvcache_table(records, readme_dir) -> list[str]:
    """The KV-cache records (docs/bench/kvcache/, measure/kvcache.py), one table each: the contiguous
    cache and each paged one, in µs, GB/s of the keys held (K and V read once) and its share of the
    copy measured in the same run, each paged cache beside the contiguous one."""
    lines = []
    for record in records:
        c, results = record["config"], record["results"]
        lengths = c["lengths"]
        contiguous = next((r for r in results if r["name"] == "10-kvcache" and r.get("median_ms")), None)
        caches = f"{len(lengths)} KV cache{'s' * (len(lengths) != 1)} of {min(lengths)}..{max(lengths)} keys" \
            if min(lengths) != max(lengths) else f"{len(lengths)} KV cache{'s' * (len(lengths) != 1)} of {max(lengths)} keys"
        lines += ["", f"#### A decode step against {caches}, "
                      f"H={c['H']} H_kv={c.get('H_kv', c['H'])} D={c['D']} {SHORT_DTYPE.get(c['dtype'], c['dtype'])}",
                  "", f"`attention_kvcache`, measured on the {record['provenance']['gpu_name']} on "
                      f"{record['created'][:10]}{_code_of(record)}: kernel time, L2 flushed before each launch. "
                      f"GB/s: the {c['kv_bytes'] / 2**20:.0f} MiB of K and V the caches hold, read once; % of copy: "
                      f"of a device-to-device copy of as many bytes in the same run, "
                      f"{record['bandwidth_gb_per_s']:.0f} GB/s.", "",
                  "| Cache | µs | GB/s | % of copy | beside the contiguous cache |", "|---|---:|---:|---:|---|"]
        for r in results:
            if not r.get("median_ms"):
                why = r.get("reason") if not r["available"] else f"FAILED the gate: {r['message']}"
                lines.append(f"| {r['title']} | — | — | — | {why} |")
                continue
            beside = "" if r is contiguous or contiguous is None else \
                f"{r['median_ms'] / contiguous['median_ms']:.2f}× its time"
            lines.append(f"| {r['title']} | {_us(r['median_ms'])} | {r['gb_per_s']:.0f} | "
                         f"{r['pct_of_bandwidth']:.1f}% | {beside} |")
        lines += ["", f"Record: [`{_rel(record['_path'], readme_dir)}`]({_rel(record['_path'], readme_dir)})."]
    return lines


def varlen_table(records, readme_dir) -> list[str]:
    """The packed-sequence records (docs/bench/varlen/, measure/varlen.py), one table each: every
    kernel's time and TFLOPS, a packed phase beside the same phase on the dense batch, and each
    peer (SDPA on the padded batch) beside the fastest packed phase."""
    lines = []
    for record in records:
        c, results = record["config"], record["results"]
        timed = {r["name"]: r for r in results if r.get("tflops")}
        packed = [r for r in timed.values() if r["name"].endswith("-varlen")]
        fastest = min(packed, key=lambda r: r["median_ms"]) if packed else None
        lengths = c["lengths"]
        lines += ["", f"#### {len(lengths)} packed sequences of {min(lengths)}..{max(lengths)} "
                      f"({c['packed_tokens']} tokens), H={c['H']} D={c['D']} {SHORT_DTYPE.get(c['dtype'], c['dtype'])}"
                      + (" causal" if c["causal"] else ""), "",
                  f"`attention_varlen`, measured on the {record['provenance']['gpu_name']} on "
                  f"{record['created'][:10]}{_code_of(record)}: "
                  f"kernel time, L2 flushed before each launch; TFLOPS of the useful FLOPs.", "",
                  "| Kernel | ms | TFLOPS | beside |", "|---|---:|---:|---|"]
        for r in results:
            if r["name"] not in timed:
                why = r.get("reason") if not r["available"] else f"FAILED the gate: {r['message']}"
                lines.append(f"| {r['title']} | — | — | {why} |")
                continue
            beside = ""
            dense = timed.get(r["name"].removesuffix("-varlen"))
            if r["name"].endswith("-varlen") and dense:
                beside = f"{r['tflops'] / dense['tflops']:.2f}× the TFLOPS of {dense['name']} on the dense batch"
            elif r["kind"] == "peer" and fastest:
                beside = (f"{fastest['name']} on the packed sequences is {r['median_ms'] / fastest['median_ms']:.2f}× "
                          f"faster")
            lines.append(f"| {r['title']} | {r['median_ms']:.3f} | {format_tflops(r['tflops'])} | {beside} |")
        lines += ["", f"Record: [`{_rel(record['_path'], readme_dir)}`]({_rel(record['_path'], readme_dir)})."]
    return lines


# ---------------------------------------------------------------------------------------------
# The tail: mean, p99 and max beside the median, slow launches, the call
# ---------------------------------------------------------------------------------------------
def _timed(result) -> bool:
    return bool(result and result.get("available") and result.get("correct") and result.get("mean_ms") is not None)


def mean_flag(result) -> float | None:
    """How far the mean exceeds the median, as a fraction, when by more than MEAN_OVER_MEDIAN."""
    if not _timed(result):
        return None
    excess = result["mean_ms"] / result["median_ms"] - 1
    return excess if excess > MEAN_OVER_MEDIAN - 1 else None


def flagged(*records) -> list[str]:
    """'09 (causal): mean 12% above the median, ...' for every kernel whose mean exceeds its median by
    more than MEAN_OVER_MEDIAN, in the kernel time or in the tail's launches."""
    out = []
    for record in records:
        for r in (record or {}).get("results", []):
            where = f"{r['name']} ({_describe(record['config'])}{' causal' if record['config']['causal'] else ''})"
            excess = mean_flag(r)
            if excess is not None:
                out.append(f"{where}: kernel time's mean {100 * excess:.0f}% above its median")
            tail = r.get("tail")
            if tail and tail["mean_ms"] > MEAN_OVER_MEDIAN * tail["median_ms"]:
                out.append(f"{where}: tail's mean {100 * (tail['mean_ms'] / tail['median_ms'] - 1):.0f}% above its "
                           f"median, {tail['slow']} of {tail['n']} launches above {SLOW}x")
    return out


def _ms(x) -> str:
    return f"{x:.3g}" if x < 1 else f"{x:.4g}"


def _times_cell(r) -> str:
    if not _timed(r):
        return _cell(r) if r is not None else "—"
    text = " / ".join(_ms(r[k]) for k in ("median_ms", "mean_ms", "p99_ms", "max_ms"))
    excess = mean_flag(r)
    return text + (f" (**mean +{100 * excess:.0f}%**)" if excess is not None else "")


def _tail_cell(r) -> str:
    tail = (r or {}).get("tail")
    if not tail:
        return "—"
    text = f"{tail['slow']} of {tail['n']}"
    return f"**{text}**" if tail["slow"] else text


def _call_cell(r) -> str:
    call = (r or {}).get("call")
    if not call:
        return "—"
    return f"{_ms(call['median_ms'])} / {_ms(call['p99_ms'])} ({call['host_median_us']:.0f} µs)"


def launch_times_table(nc, c) -> list[str]:
    """Per kernel, non-causal and causal: the kernel time's median / mean / p99 / max, the tail's slow
    launches, and the call time (median / p99, the host's median per call). Only for records that
    carry the mean (those of the device-only protocol)."""
    if not any(_timed(r) for record in (nc, c) for r in (record or {}).get("results", [])):
        return []
    names = []
    for record in (nc, c):
        for r in (record or {}).get("results", []):
            if _timed(r) and r["name"] not in names:
                names.append(r["name"])
    tail_n = max([r["tail"]["n"] for record in (nc, c) for r in (record or {}).get("results", []) if r.get("tail")],
                 default=0)
    lines = ["", "#### Launch times", "",
             "Kernel time in ms, each launch alone on the device after an L2 flush: median / mean / p99 / max. "
             f"Slow: launches above {SLOW}x their median among back-to-back device-only launches "
             f"({tail_n} where a kernel's 5 s of GPU time allow). "
             "Call: `attention()` (or the SDPA call) back to back as a user's loop calls it, ms per call, "
             "median / p99 (the host's median time per call).", "",
             "| Kernel | kernel time | slow | call | causal: kernel time | slow | call |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name in names:
        r_nc, r_c = _result(nc, name), _result(c, name)
        label = name if (r_nc or r_c)["kind"] == "phase" else (r_nc or r_c)["title"].replace("torch SDPA, ", "SDPA ")
        lines.append(f"| {label} | {_times_cell(r_nc)} | {_tail_cell(r_nc)} | {_call_cell(r_nc)} | "
                     f"{_times_cell(r_c)} | {_tail_cell(r_c)} | {_call_cell(r_c)} |")
    flags = flagged(nc, c)
    lines.append("")
    lines.append("Mean more than 5 % above the median: " + ("; ".join(flags) if flags else "none") + ".")
    return lines


def latency_records(records) -> list[dict]:
    """The newest single-problem record of each problem (shape, dtype, causal, GPU) that carries call
    times, smallest problem first."""
    newest = {}
    for r in records:
        if "sweep" not in r and any(x.get("call") for x in r["results"]):
            key = (_shape_key(r), r["config"]["causal"])
            if key not in newest or r["created"] >= newest[key]["created"]:
                newest[key] = r
    return sorted(newest.values(), key=lambda r: (r["flops"], r["config"]["causal"]))


def _us(ms) -> str:
    return f"{ms * 1e3:.0f}" if ms * 1e3 >= 10 else f"{ms * 1e3:.1f}"


def latency_table(records) -> list[str]:
    """What a call costs: attention() back to back (the fastest phase that has call times) against its
    kernel time and torch SDPA's calls, per problem, in microseconds; a table per GPU."""
    if not records:
        return []
    lines = ["", "#### What a call costs", "",
             "`attention()` called back to back on torch tensors, as a model's loop calls it (no L2 flush): "
             "microseconds per call, median / p99, beside the kernel's own time (each launch alone on the "
             "device) and torch SDPA's calls measured the same way in the same run. Host: the time one "
             "`attention()` call keeps the host, microseconds (where the kernels outlast the host, the calls "
             "run ahead until the launch queue is full, and from then on this is mostly the wait for room in "
             "it). Op: the same call through `torch.ops.flashcore.attention`, the custom op "
             "a `torch.compile`d model calls (torch's dispatcher adds its cost). Call / launches: the call "
             "against the kernel's own launch timed the same way, back to back, in runs alternating with the "
             "calls': the plan's driver launch that `attention()` makes, without the call's checks and "
             "allocation (— in older records; host where the launch's host time was "
             f"{100 * HOST_BOUND:.0f} % or more of the loop's time per launch, so that the loop measured "
             "the host, not the board: the records before the plan's loop timed the lessons' launch "
             "through Numba's dispatcher, 0.2-0.4 ms a launch). The kernel time flushes L2 before each "
             "launch and runs in short batches; the calls run without a pause, with K and V in L2 where they "
             "fit, and a board at its power cap lowers its clock under that load (docs/guide.md): so this "
             "ratio is what the call's path adds under the same load, and call / kernel what a user "
             "sees.", ""]
    for gpu, own in _by_gpu(records):  # a table per GPU
        lines += _latency_gpu_table(own, gpu) + [""]
    return lines[:-1]


# a launch loop whose host time per launch is this share of its GPU time or more waited on the host
HOST_BOUND = 0.85


def _latency_gpu_table(records, gpu) -> list[str]:
    dates = sorted({r["created"][:10] for r in records})
    commits = list(dict.fromkeys((r["provenance"].get("git_commit") or "unknown")[:7]  # oldest record first
                                 for r in sorted(records, key=lambda r: r["created"])))
    lines = [f"On the {gpu} ({', '.join(dates)}; code at commit{'s' if len(commits) > 1 else ''} "
             f"{', '.join(f'`{c}`' for c in commits)}):", "",
             "| B, H, S_q, S_k, D | kernel | call median / p99 | kernel time | call / kernel | "
             "call / launches | host per call | op call | SDPA flash call | SDPA cuDNN call |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for record in records:
        c = record["config"]
        ours = [r for r in record["results"] if r["kind"] == "phase" and r.get("call")]
        if not ours:
            continue
        phases = [x for x in ours if "-" not in x["name"]] or ours  # a phase before its variants
        # the fastest kernel of the run, which is what attention()'s "best" runs where a run has phases
        # 09 and 10 (tests/test_api.py holds api.best_for_shape to within 3 % of the faster of them)
        r = min(phases, key=lambda x: x["median_ms"])
        call = r["call"]
        peers = {x["name"]: x for x in record["results"] if x["kind"] == "peer" and x.get("call")}
        flash, cudnn = (_us(peers[n]["call"]["median_ms"]) if n in peers else "—" for n in ("sdpa_flash", "sdpa_cudnn"))

        shape = f"{c['B']}, {c['H']}{'/' + str(c['H_kv']) if c.get('H_kv') else ''}, {c['S_q']}, {c['S_k']}, {c['D']}"
        shape += f" {SHORT_DTYPE.get(c['dtype'], c['dtype'])}" + (" causal" if c["causal"] else "")
        loop = r.get("launch_loop")
        host_bound = loop and loop["host_median_us"] >= HOST_BOUND * 1e3 * loop["median_ms"]
        loop = "—" if not loop else "host" if host_bound else f"{call['median_ms'] / loop['median_ms']:.2f}"
        lines.append(f"| {shape} | {r['name']} | {_us(call['median_ms'])} / {_us(call['p99_ms'])} | "
                     f"{_us(r['median_ms'])} | {call['median_ms'] / r['median_ms']:.2f} | {loop} | "
                     f"{call['host_median_us']:.0f} | {_us(r['call_op']['median_ms']) if r.get('call_op') else '—'} | "
                     f"{flash} | {cudnn} |")
    return lines


def tail_summary(nc, c) -> str:
    """One sentence on a shape's tail, for the shapes beside the reference one."""
    results = [r for record in (nc, c) for r in (record or {}).get("results", []) if _timed(r)]
    if not results:
        return ""
    worst = max(results, key=lambda r: r["mean_ms"] / r["median_ms"])
    tails = [r["tail"] for r in results if r.get("tail")]
    slow = sum(t["slow"] for t in tails)
    names = sorted({r["name"] for r in results if r["kind"] == "phase"})
    files = ", ".join(f"`{Path(r['_path']).name}`" for r in (nc, c) if r is not None and "_path" in r)
    text = (f"Launch times ({', '.join(names)} and the SDPA peers{'; ' + files if files else ''}): every kernel's "
            f"mean within {100 * (worst['mean_ms'] / worst['median_ms'] - 1):.1f} % of its median (largest: "
            f"{worst['name']})")
    if tails:
        text += (f"; {slow} slow launch{'es' if slow != 1 else ''} (above {SLOW}x the median) in "
                 f"{sum(t['n'] for t in tails)} back-to-back device-only launches")
    flags = flagged(nc, c)
    return text + (". Flagged: " + "; ".join(flags) if flags else "") + "."


def _bandwidth_bound(nc, c) -> bool:
    """A decode step (few query rows per K/V head: api.DECODE_ROWS) with the copy measured beside it:
    bound by reading K and V, so told in GB/s rather than TFLOPS. One mode only (no causal twin)."""
    from ..api import DECODE_ROWS

    if (nc is None) == (c is None):
        return False
    record = nc or c
    config = record["config"]
    return bool(record.get("bandwidth_gb_per_s")) and \
        config["S_q"] * config["H"] // config.get("H_kv", config["H"]) <= DECODE_ROWS


def bandwidth_table(record) -> list[str]:
    """The markdown table of a decode step's record: kernel time, GB/s of K and V read once and its share
    of the copy measured in the same run, and each phase's speed over the phase above it."""
    speedups = ladder_speedups(record["results"])
    names = sorted(record["results"], key=lambda r: (r["kind"] != "phase", r["name"] if r["kind"] == "phase" else ""))
    lines = ["", "| Phase | Kernel | µs | GB/s | % of copy | vs previous |", "|---|---|---:|---:|---:|---:|"]
    for r in names:
        label = r["name"] if r["kind"] == "phase" else "SDPA"
        if r.get("pct_of_bandwidth") is None:
            lines.append(f"| {label} | {r['title']} | {_cell(r) if not _timed(r) else _us(r['median_ms'])} | — | — | |")
            continue
        lines.append(f"| {label} | {r['title']} | {_us(r['median_ms'])} | {r['gb_per_s']:.0f} | "
                     f"{r['pct_of_bandwidth']:.1f}% | {_speedup_cell(speedups.get(r['name']))} |")
    copy = record["bandwidth"]
    lines += ["", f"GB/s: K and V's {copy['bytes'] / 2**20:.0f} MiB read once, over the median kernel time. "
                  f"% of copy: of a device-to-device copy of as many bytes in the same run, "
                  f"{record['bandwidth_gb_per_s']:.0f} GB/s (its reads and writes counted)."]
    lines += [f"- n/a — {r['title']}: {r['reason']}" for r in record["results"] if not r["available"]]
    lines += [f"- FAILED the correctness gate, so not timed — {r['name']} {r['title']}: {r['message']}"
              for r in record["results"] if r["available"] and not r["correct"]]
    return lines


def ladder_table(nc, c) -> list[str]:
    """The markdown table of one shape's (non-causal, causal) records, with its notes."""
    lines = []
    lines += ["", "| Phase | Kernel | TFLOPS | vs previous | causal TFLOPS | vs previous | % of ceiling |",
              "|---|---|---:|---:|---:|---:|---:|"]
    sp_nc = ladder_speedups(nc["results"]) if nc else {}
    sp_c = ladder_speedups(c["results"]) if c else {}
    names = []  # phases first, then peers, in record order, without duplicates
    for record in (nc, c):
        for r in (record or {}).get("results", []):
            if (r["name"], r["kind"], r["title"]) not in names:
                names.append((r["name"], r["kind"], r["title"]))
    names.sort(key=lambda n: (n[1] != "phase", n[0] if n[1] == "phase" else ""))
    # a phase that could not run this problem at all (bf16 on an fp16-only phase) gets no row,
    # only its reason in the notes below
    names = [n for n in names if n[1] != "phase" or _ran(n[0], nc, c)]
    for name, kind, title in names:
        r_nc, r_c = _result(nc, name), _result(c, name)
        pct = " / ".join("—" if r is None or r.get("pct_of_ceiling") is None
                         else f"{r['pct_of_ceiling']:.1f}%" for r in (r_nc, r_c))
        label = name if kind == "phase" else "SDPA"
        lines.append(f"| {label} | {title} | {_cell(r_nc)} | {_speedup_cell(sp_nc.get(name))} | "
                     f"{_cell(r_c)} | {_speedup_cell(sp_c.get(name))} | {pct} |")
    unavailable = [f"{r['title']}: {r['reason']}" for record in (nc, c) if record
                   for r in record["results"] if not r["available"] and (r["kind"] == "peer" or _ran(r["name"], nc, c))]
    # phases that ran nothing here (bf16 on an fp16-only phase) share one line per reason
    skipped = {}
    for record in (nc, c):
        for r in (record or {}).get("results", []):
            if r["kind"] == "phase" and not _ran(r["name"], nc, c):
                reason = r["reason"].replace(f"phase {r['name']} ", "", 1)
                skipped.setdefault(reason, [])
                if r["name"] not in skipped[reason]:
                    skipped[reason].append(r["name"])
    unavailable += [f"{', '.join(ids)}: {reason}" for reason, ids in skipped.items()]
    failed = [f"{r['name']} {r['title']}: {r['message']}" for record in (nc, c) if record
              for r in record["results"] if r["available"] and not r["correct"]]
    lines.append("")
    lines.append("% of ceiling: non-causal / causal. Causal FLOPs are half of the non-causal ones.")
    for note in sorted(set(unavailable)):
        lines.append(f"- n/a — {note}")
    for note in sorted(set(failed)):
        lines.append(f"- FAILED the correctness gate, so not timed — {note}")
    return lines


def _rel(path, start) -> str:
    return Path(os.path.relpath(Path(path).resolve(), Path(start).resolve())).as_posix()


def _figures(kernel_id: str, nc, c) -> list[str]:
    """'29.7 TFLOPS (1.27x phase 04)', 'causal 26.1 TFLOPS (...)': one kernel in a record pair."""
    parts = []
    for label, r, record in (("", _result(nc, kernel_id), nc), ("causal ", _result(c, kernel_id), c)):
        if r is None:
            continue
        if not r["available"]:
            parts.append(f"{label}not run ({r['reason']})")
        elif not r["correct"]:
            parts.append(f"{label}FAILED the correctness gate ({r['message']})")
        else:
            text = f"{label}{format_tflops(r['tflops'])} TFLOPS"
            speedup = ladder_speedups(record["results"]).get(kernel_id)
            if speedup is not None:
                prev, ratio = speedup
                prev = prev if "-" in prev else f"phase {prev}"  # "phase 05", "06-inline"
                slower = f", SLOWER than {prev}" if ratio < 1 else ""
                text += f" ({ratio:.2f}x {prev}{slower})"
            parts.append(text)
    return parts


def _ran(kernel_id: str, *records) -> bool:
    """Whether a kernel ran in any of the records (a bf16 record lists fp16-only phases as n/a)."""
    return any(r is not None and r["available"] for r in (_result(rec, kernel_id) for rec in records))


def _variant_ids(phase_id: str, *records) -> list[str]:
    """Ids of a phase's other builds ("06-inline") present in the records, in order."""
    ids = []
    for record in records:
        for r in (record or {}).get("results", []):
            if r["kind"] == "phase" and r["name"].startswith(f"{phase_id}-") and r["name"] not in ids:
                ids.append(r["name"])
    return sorted(ids)


_PHASES_SUFFIX = re.compile(r"^(.*?)(_p\d[\w-]*)?\.json$")  # 'x_fp16' and '_p07-09' of 'x_fp16_p07-09.json'


def _file_list(names) -> str:
    """Record file names for a docstring, a non-causal record and its causal twin as one:
    'x_fp16[_causal].json', 'x_fp16[_causal]_p07-09.json' (the causal flag comes before the phases)."""
    names = list(dict.fromkeys(names))
    out = []
    for name in names:
        head, phases = _PHASES_SUFFIX.match(name).groups(default="")
        if head.endswith("_causal") and f"{head[:-len('_causal')]}{phases}.json" in names:
            continue  # written with its twin
        twin = f"{head}_causal{phases}.json"
        out.append(f"{head}[_causal]{phases}.json" if twin in names else name)
    return ", ".join(out)


def _decode_figures(kernel_id: str, record) -> str:
    """'29 µs, 48.9% of the copy (1.82x phase 09)': one kernel at a decode step (told in time and
    bandwidth, not TFLOPS), or why it has no figure."""
    r = _result(record, kernel_id)
    if not _timed(r) or r.get("pct_of_bandwidth") is None:
        return ", ".join(_figures(kernel_id, record, None)) or "—"
    text = f"{_us(r['median_ms'])} µs, {r['pct_of_bandwidth']:.1f}% of the copy"
    speedup = ladder_speedups(record["results"]).get(kernel_id)
    if speedup is not None:
        prev, ratio = speedup
        text += f" ({ratio:.2f}x {prev if '-' in prev else f'phase {prev}'}{', SLOWER' if ratio < 1 else ''})"
    return text


def measured_lines(phase_id: str, nc, c, others=()) -> list[str]:
    """The generated lines of one phase's "Measured effect" docstring block: the reference shape with
    the phase's variants (the ablation of its ideas), then the phase alone at the other shapes of the
    reference dtype measured on the same GPU (e.g. D=128); a decode step, told in time and bandwidth,
    only for a phase the reference shape does not run (phase 10). docs/performance.md has the rest."""
    anchor = nc or c
    in_anchor = anchor is not None and (_result(nc, phase_id) is not None or _result(c, phase_id) is not None)
    if anchor is None or not (in_anchor or any(_ran(phase_id, o_nc, o_c) for o_nc, o_c in others)):
        return [DOCSTRING_INDENT + NOT_MEASURED]
    text = f"{anchor['provenance']['gpu_name']}, {anchor['created'][:10]}, {_describe(anchor['config'])}: "
    files = []
    if not in_anchor:  # a phase for other shapes (phase 10, decoding): its own records below
        text += "not measured at this shape (the phase serves others)"
    else:
        text += ", ".join(_figures(phase_id, nc, c))
        r_nc, r_c = _result(nc, phase_id), _result(c, phase_id)
        resources = r_nc if r_nc and r_nc.get("registers") is not None else r_c
        if resources and resources.get("registers") is not None:
            local = resources.get("local_bytes_per_thread")
            text += f"; {resources['registers']} registers, {local} B local memory"
        for vid in _variant_ids(phase_id, nc, c):
            text += f". {vid}: " + ", ".join(_figures(vid, nc, c))
        files = [Path(r["_path"]).name for r in (nc, c) if r is not None]
    for o_nc, o_c in others:
        o_anchor = o_nc or o_c
        if not _ran(phase_id, o_nc, o_c):
            continue
        if _bandwidth_bound(o_nc, o_c):
            if in_anchor:
                continue
            figures = _decode_figures(phase_id, o_anchor)
        elif o_anchor["config"]["dtype"] == anchor["config"]["dtype"]:
            figures = ", ".join(_figures(phase_id, o_nc, o_c))
        else:
            continue
        text += f". At {_describe(o_anchor['config'])}: {figures}"
        files += [Path(r["_path"]).name for r in (o_nc, o_c) if r is not None]
    text += f" ({_file_list(files)}). Every shape and dtype measured: docs/performance.md."
    # the lines land inside a docstring: keep messages from closing it or adding escapes
    return docstring_lines(text)


BACKWARD_ROWS = {pid: (pid, f"{pid}-deterministic", f"{pid}-step") for pid in ("11", "12", "13")}
def docstring_lines(text: str) -> list[str]:
    """A generated "Measured effect" text as a docstring block's lines: indented, wrapped at 100
    columns, with no backslash or triple quote that would end or escape the docstring."""
    text = text.replace("\\", "/").replace(3 * '"', 3 * "'")
    return textwrap.wrap(text, width=100, initial_indent=DOCSTRING_INDENT, subsequent_indent=DOCSTRING_INDENT,
                         break_on_hyphens=False)


FLEX_PHASE = "14"  # its "Measured effect" comes from the flex records (flex_measured_lines)
PREVIOUS_BACKWARD = {"12": "11", "13": "12"}  # the backward phase each one changes: its rows are compared


def backward_measured_lines(records, phase_id: str = "11") -> list[str]:
    """A backward phase's "Measured effect" block (11, 12 or 13: its rows in the same records), from the
    backward records (docs/bench/backward/): per GPU, then per problem, the backward's TFLOPS with
    atomics and deterministic, and its share of SDPA flash's (phases 12 and 13 also of the phase they
    change, PREVIOUS_BACKWARD, in the same run). The commit is the record's, not the docstring's. The reference problems' head dims
    only (HEADLINE_HEAD_DIMS): the records at other head dims are docs/performance.md's."""
    records = [r for r in records if r["config"]["D"] in HEADLINE_HEAD_DIMS
               and any(x["name"] == phase_id and x.get("tflops") for x in r["results"])]
    if not records:
        return [DOCSTRING_INDENT + NOT_MEASURED]
    parts, files = [], []
    for gpu, own in sorted(_by_gpu(records)):
        dates = sorted({r["created"][:10] for r in own})
        problems = []
        for record in sorted(own, key=lambda r: (r["config"]["D"], r["config"]["causal"], r["config"]["dtype"])):
            timed = {r["name"]: r for r in record["results"] if r.get("tflops")}
            flash = timed.get("sdpa_flash")
            figures = []
            for name in BACKWARD_ROWS[phase_id]:
                r = timed.get(name)
                if r is None:
                    why = ""
                    ran = [x for x, row in timed.items() if x.endswith("-step") and row["kind"] == "phase"]
                    if name.endswith("-step") and ran:  # this GPU's autograd ran the other phase's backward
                        why = f" (autograd ran {ran[0]})"
                    figures.append(f"{name} not timed{why}")
                    continue
                peer = timed.get("sdpa_flash-step" if name.endswith("-step") else "sdpa_flash")
                before = PREVIOUS_BACKWARD.get(phase_id)
                previous = timed.get(name.replace(phase_id, before, 1)) if before else None
                beside = [f"{r['tflops'] / x['tflops']:.2f}x {who}"
                          for x, who in ((peer, "SDPA flash"), (previous, f"phase {before}")) if x is not None]
                figures.append(f"{name} {format_tflops(r['tflops'])}" + (f" ({', '.join(beside)})" if beside else ""))
            problems.append(f"{_describe(record['config'])}{' causal' if record['config']['causal'] else ''}: "
                            + ", ".join(figures) + ("" if flash else " (no SDPA flash backward in this run)"))
            files.append(Path(record["_path"]).name)
        parts.append(f"{gpu}, {' and '.join(dates)}, TFLOPS: " + "; ".join(problems))
    text = f"{FLOPS_RULE[0].upper()}{FLOPS_RULE[1:]}. " + ". ".join(parts)
    text += f" ({_file_list(files)})."
    return docstring_lines(text)


def flex_measured_lines(records) -> list[str]:
    """Phase 14's "Measured effect" block, from the flex records (docs/bench/flex/): per GPU and head
    dim, each case's TFLOPS beside torch's FlexAttention with the same mods, and causal as a mask_mod
    beside attention(causal=True)."""
    if not records:
        return [DOCSTRING_INDENT + NOT_MEASURED]
    parts, files = [], []
    for gpu, own in sorted(_by_gpu(records)):
        dates = sorted({r["created"][:10] for r in own})
        problems = []
        for record in sorted(own, key=lambda r: (r["config"]["D"], r["config"]["dtype"])):
            timed = {r["name"]: r for r in record["results"] if r.get("tflops")}
            figures = [f"{case} {format_tflops(mine['tflops'])}"
                       + (f" ({mine['tflops'] / theirs['tflops']:.2f}x FlexAttention)" if theirs else "")
                       for case, mine, theirs in _flex_pairs(record) if mine]
            fast, mask = timed.get("attention causal=True"), timed.get("14 causal_mask")
            window = timed.get("14 sliding_window")
            if fast and mask:
                figures.append(f"causal as a mask_mod at {fast['median_ms'] / mask['median_ms']:.2f}x the speed of "
                               "attention(causal=True)")
            if fast and window:
                figures.append(f"the window at {fast['median_ms'] / window['median_ms']:.2f}x it")
            problems.append(f"{_describe(record['config'])}: " + ", ".join(figures))
            files.append(Path(record["_path"]).name)
        parts.append(f"{gpu}, {' and '.join(dates)}, TFLOPS of the work the mask leaves: " + "; ".join(problems))
    text = ". ".join(parts) + f" ({_file_list(files)})."
    return docstring_lines(text)


def replace_between(text: str, begin: str, end: str, new_lines: list[str], where: str) -> str:
    """Replace the lines strictly between the line holding `begin` and the one holding `end`."""
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if line.strip() == begin]
    ends = [i for i, line in enumerate(lines) if line.strip() == end]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise ReportError(f"{where}: expected one line {begin!r} followed by one line {end!r}")
    return "\n".join(lines[: starts[0] + 1] + new_lines + lines[ends[0]:])


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None})  # no version stamp: diffs show real changes


def plot_ladder(nc, c, path: Path) -> Path:
    """Horizontal bars: TFLOPS per phase (non-causal, causal) on a log scale, one phase per row so
    that no label meets another; lines: SDPA peers and the ceiling; the legend beside the axes."""
    plt = _pyplot()
    anchor = nc or c
    runs = [(label, record) for label, record in (("non-causal", nc), ("causal", c)) if record is not None]
    phase_ids = sorted({r["name"] for _, rec in runs for r in rec["results"] if r["kind"] == "phase"})
    fig, ax = plt.subplots(figsize=(10, 1.4 + 0.45 * len(phase_ids)))
    height = 0.8 / len(runs)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {"non-causal": "-", "causal": "--"}
    top = 0.0
    for i, (label, record) in enumerate(runs):
        ys, xs = [], []
        for y, pid in enumerate(phase_ids):
            r = _result(record, pid)
            y_bar = y + (i - (len(runs) - 1) / 2) * height
            if r is not None and r.get("tflops"):
                ys.append(y_bar)
                xs.append(r["tflops"])
            elif r is not None:  # no bar: say why at the foot of the axis
                ax.text(0.01, y_bar, "n/a" if not r["available"] else "FAILED", color=colors[i], fontsize=7,
                        va="center", transform=ax.get_yaxis_transform())
        bars = ax.barh(ys, xs, height, label=f"phases, {label}", color=colors[i], alpha=0.85)
        ax.bar_label(bars, labels=[format_tflops(x) for x in xs], fontsize=7, padding=2, zorder=3,
                     bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5, "alpha": 0.8})  # over the lines
        top = max([top, *xs])
        peers = [r for r in record["results"] if r["kind"] == "peer" and r.get("tflops")]
        for j, r in enumerate(peers):
            name = r["title"].replace("torch SDPA, ", "SDPA ")
            ax.axvline(r["tflops"], color=colors[(2 + j) % len(colors)], linestyle=styles[label], linewidth=1,
                       label=f"{name}, {label}: {format_tflops(r['tflops'])}")
            top = max(top, r["tflops"])
        if record.get("ceiling_tflops") and i == 0:
            ax.axvline(record["ceiling_tflops"], color="gray", linestyle=":", linewidth=1,
                       label=f"tensor-core ceiling (matmul): {format_tflops(record['ceiling_tflops'])}")
            top = max(top, record["ceiling_tflops"])
    ax.set_xscale("log")
    ax.set_xlim(right=top * 1.6)  # room for the value beside the longest bar
    ax.set_yticks(range(len(phase_ids)), phase_ids)
    ax.set_ylim(len(phase_ids) - 0.5, -0.5)  # phase 01 on top, a row for every phase, bar or not
    ax.set_ylabel("phase")
    ax.set_xlabel("TFLOPS (log scale)")
    gpu = anchor["provenance"]["gpu_name"]
    ax.set_title(f"{gpu}, {_describe(anchor['config'])}, {anchor['created'][:10]}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


SPREAD = MEAN_OVER_MEDIAN - 1  # beyond 5 % a median is not taken at its word


def _point_key(gpu, config) -> tuple:
    return (gpu, *(config.get(k) for k in ("B", "H", "H_kv", "S_q", "S_k", "D", "D_v", "dtype", "causal")))


def _timings_by_shape(records) -> dict:
    """(GPU and problem, kernel) -> [(TFLOPS, record file)] over every record, sweep points included."""
    out = {}
    for record in records:
        gpu = record["provenance"]["gpu_name"]
        for point in record.get("sweep", [record]):  # a sweep's points, or the record's one problem
            for r in point["results"]:
                if r.get("tflops"):
                    out.setdefault((_point_key(gpu, point["config"]), r["name"]), []).append(
                        (r["tflops"], Path(record.get("_path", "?")).name))
    return out


def sweep_spreads(record, records=()) -> dict:
    """{(S, kernel): why} for the points of a sweep record whose median is in doubt: the fastest
    launch more than 5 % faster than the median (then at least half the launches ran that much
    slower than the kernel can; a slow maximum alone does not move the median), a mean more than
    5 % above it, or another record of the same problem on the same GPU more than 5 % apart."""
    others = _timings_by_shape(records)
    gpu = record["provenance"]["gpu_name"]
    spreads = {}
    for point in record["sweep"]:
        for r in point["results"]:
            if not r.get("tflops"):
                continue
            why = []
            if r.get("min_ms") and r["min_ms"] < (1 - SPREAD) * r["median_ms"]:
                why.append(f"fastest launch {100 * (1 - r['min_ms'] / r['median_ms']):.0f}% below the median")
            if mean_flag(r) is not None:
                why.append(f"mean {100 * mean_flag(r):.0f}% above the median")
            for tflops, name in others.get((_point_key(gpu, point["config"]), r["name"]), []):
                if name != Path(record.get("_path", "?")).name and abs(tflops / r["tflops"] - 1) > SPREAD:
                    why.append(f"{format_tflops(tflops)} TFLOPS in {name}")
            if why:
                spreads[(point["S"], r["name"])] = f"{format_tflops(r['tflops'])} TFLOPS, " + "; ".join(why)
    return spreads


def plot_sweep(pairs, path: Path, records=()) -> Path:
    """TFLOPS over S, one line per kernel; a row of panels per head dim, one panel per causal mode.
    One legend for every panel, below them; a point whose launches spread (`sweep_spreads`) is
    drawn hollow and listed in a note under the legend, to be measured again."""
    plt = _pyplot()
    from matplotlib.lines import Line2D

    rows = [[(label, record) for label, record in (("non-causal", nc), ("causal", c)) if record is not None]
            for nc, c in pairs]
    width = max(len(runs) for runs in rows)
    kernels = {}  # name -> (kind, title), in the order the records list them: one colour each
    for runs in rows:
        for _, record in runs:
            for r in record["sweep"][0]["results"]:
                kernels.setdefault(r["name"], (r["kind"], r["title"]))
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {name: cycle[i % len(cycle)] for i, name in enumerate(kernels)}
    notes = []
    for runs in rows:
        for label, record in runs:
            c0 = record["config"]
            for (S, name), why in sorted(sweep_spreads(record, records).items()):
                notes += textwrap.wrap(f"D={c0['D']} {label}, S={S}, {name}: {why}", 100 * width,
                                       subsequent_indent="    ")
    columns = min(2, width)  # of the legend
    legend_rows = -(-(len(kernels) + bool(notes)) // columns)
    foot = 0.3 + 0.2 * legend_rows + 0.17 * (len(notes) + bool(notes))  # inches below the panels
    fig = plt.figure(figsize=(6 * width, 4.5 * len(rows) + foot))
    grid = fig.add_gridspec(len(rows) + 1, width, height_ratios=[4.5] * len(rows) + [foot])
    for i, runs in enumerate(rows):
        for j in range(width):
            ax = fig.add_subplot(grid[i, j])
            if j >= len(runs):
                ax.axis("off")  # a head dim measured in one causal mode only
                continue
            label, record = runs[j]
            spreads = sweep_spreads(record, records)
            for name, (kind, _) in kernels.items():
                points = []
                for point in record["sweep"]:
                    r = next((x for x in point["results"] if x["name"] == name), None)
                    if r is not None and r.get("tflops"):
                        points.append((point["S"], r["tflops"], (point["S"], name) in spreads))
                if not points:
                    continue
                xs, ys, _ = zip(*points)
                style = "-o" if kind == "phase" else "--s"
                ax.plot(xs, ys, style, markersize=3, color=color[name])
                for x, y, spread in points:
                    if spread:  # hollow: the median of this point is in doubt
                        ax.plot([x], [y], "o" if kind == "phase" else "s", markersize=8, color=color[name],
                                markerfacecolor="white", markeredgewidth=1.5)
            c0 = record["config"]
            ax.set_xscale("log", base=2)
            lengths = [point["S"] for point in record["sweep"]]
            ax.set_xticks(lengths, [str(S) for S in lengths])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_xlabel(f"S (B·S = {c0['B'] * c0['S_q']} tokens)")
            ax.set_ylabel("TFLOPS (log scale)")
            ax.set_title(f"{record['provenance']['gpu_name']}, {label}, H={c0['H']} D={c0['D']}", fontsize=10)
            ax.grid(which="both", alpha=0.3)
    handles = [Line2D([], [], linestyle="-" if kind == "phase" else "--", marker="o" if kind == "phase" else "s",
                      markersize=3, color=color[name]) for name, (kind, _) in kernels.items()]
    labels = [f"{name} {title}" if kind == "phase" else title for name, (kind, title) in kernels.items()]
    if notes:
        handles.append(Line2D([], [], linestyle="", marker="o", markersize=8, color="gray",
                              markerfacecolor="white", markeredgewidth=1.5))
        labels.append("hollow: the launches of this point spread (below); to measure again")
    foot_ax = fig.add_subplot(grid[len(rows), :])
    foot_ax.axis("off")
    foot_ax.legend(handles, labels, loc="upper center", ncol=columns, fontsize=8, frameon=False)
    if notes:
        foot_ax.text(0.0, 0.0, "Launches that spread:\n" + "\n".join(notes), fontsize=7, va="bottom",
                     transform=foot_ax.transAxes)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------
def phase_files(phases_dir: Path) -> dict[str, Path]:
    """Phase id -> module file, from the file names pNN_*.py."""
    files = {}
    for path in sorted(Path(phases_dir).glob("p[0-9][0-9]_*.py")):
        files[path.name[1:3]] = path
    return files


def _write_between(path: Path, begin: str, end: str, lines: list[str], what: str) -> str:
    """Replace the generated block of `path`; one line for the summary."""
    text = path.read_text()
    new = replace_between(text, begin, end, lines, str(path))
    if new != text:
        path.write_text(new)
    return f"{path}: {what} {'updated' if new != text else 'unchanged'}"


def generate(records_dir=None, readme=None, phases_dir=None, plots_dir=None, performance=None) -> list[str]:
    """Regenerate the README's headline, docs/performance.md's tables, the plots and the phase
    docstrings. Returns one line per file written."""
    records_dir = Path(records_dir) if records_dir is not None else default_records_dir()
    readme = Path(readme) if readme is not None else repo_root("the README (README.md)") / "README.md"
    performance = Path(performance) if performance is not None else readme.parent / "docs" / "performance.md"
    phases_dir = Path(phases_dir) if phases_dir is not None else Path(phase_registry.__file__).parent
    plots_dir = Path(plots_dir) if plots_dir is not None else records_dir
    if records_dir.exists() and not records_dir.is_dir():
        raise ReportError(f"--records: {records_dir} is not a directory")
    for path, option in ((readme, "--readme"), (performance, "--performance")):
        if not path.exists():
            raise ReportError(f"{option}: {path} does not exist")
    try:
        records = load_records(records_dir)
        varlen, kvcache = load_records(records_dir / "varlen"), load_records(records_dir / "kvcache")
        backward = load_records(records_dir / "backward")
        flex = load_records(records_dir / "flex")
        first_calls = first_call.load(records_dir / first_call.KIND)
        serving = serving_records(load_records(records_dir / "serving"))
    except RecordError as e:
        raise ReportError(str(e)) from None
    nc, c = ladder_records(records)
    sweeps = sweep_records(records)
    summary = [f"{len(records)} record(s) in {records_dir}"]

    plots = []
    if nc or c or sweeps:
        try:
            _pyplot()
        except ImportError:
            summary.append("plots skipped: matplotlib is not installed (pip install matplotlib)")
        else:
            if nc or c:
                plots.append(plot_ladder(nc, c, plots_dir / "ladder.png"))
            if sweeps:
                plots.append(plot_sweep(sweeps, plots_dir / "sweep.png", records))
            summary += [f"{p}: written" for p in plots]

    ladder_plot = next((p for p in plots if p.name == "ladder.png"), None)
    headline = headline_table(records, backward, readme.parent, ladder_plot, performance, nc or c, flex)
    summary.append(_write_between(readme, HEADLINE_BEGIN, HEADLINE_END, headline, "headline"))
    summary += [f"NOT MEASURED: {line}" for line in missing_headline(records, backward)]
    table = performance_table(nc, c, performance.parent, plots, other_ladders(records, nc or c),
                              latency_records(records), records, varlen, kvcache, backward, first_calls, serving,
                              flex)
    summary.append(_write_between(performance, BEGIN, END, table.split("\n"), "performance tables"))
    for pair in [(nc, c), *other_ladders(records, nc or c)]:
        summary += [f"FLAGGED: {flag}" for flag in flagged(*pair)]
    for record in (r for pair in sweeps for r in pair if r is not None):
        where = f"sweep D={record['config']['D']} {_mode(record)}"
        summary += [f"FLAGGED: {where}, S={S}, {name}: {why}"
                    for (S, name), why in sorted(sweep_spreads(record, records).items())]

    for phase_id, path in phase_files(phases_dir).items():
        text = path.read_text()
        if MEASURED_BEGIN not in text:
            summary.append(f"{path}: no {MEASURED_BEGIN} block, left alone")
            continue
        lines = (backward_measured_lines(backward, phase_id) if phase_id in BACKWARD_ROWS else
                 flex_measured_lines(flex) if phase_id == FLEX_PHASE else
                 measured_lines(phase_id, nc, c, other_ladders(records, nc or c)))
        new = replace_between(text, MEASURED_BEGIN, MEASURED_END, lines, str(path))
        if new != text:
            path.write_text(new)
        summary.append(f"{path}: measured effect {'updated' if new != text else 'unchanged'}")
    return summary

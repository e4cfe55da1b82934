"""Device-only launch times of phase 09 (and peers), their tail, and where a slow launch waited.

A diagnostic for the tail of phase 09's launch times (issue 36), run on a GPU with torch:

    python3 tools/stalls.py --out DIR [--launches 1000] [--only NAME ...]

Device-only timing: every batch of launches is queued behind a sleep kernel long enough that the
host has queued the whole batch before the GPU reaches it, with an event between launches, so
each launch's time is the GPU's alone (the host's launch time cannot enter; batches where the host
was still queuing when the sleep ended are counted and left out). Garbage collection is off while
timing. Each kernel is checked against torch's float32 SDPA first, on a poisoned output.

For each case it prints median, mean, p99 and max over the launches and how many took more than
1.5x and 2x the median, then, for the trace builds (phase 09 built with trace=True: every barrier
wait timed with %globaltimer, read by flashcore_numba.measure.trace), the slowest launches against
a typical one: the kernel's span on the GPU clock against the events' time, and the longest waits
(which block, which role, which barrier, which query block). Raw times and traces go to DIR.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPE = (16, 16, 2048)  # B, H, S


@dataclass(frozen=True)
class Case:
    name: str  # row label
    kernel: str  # "09", "09-ws", "09-overlap", "08", "cudnn"
    D: int
    dtype: str
    causal: bool
    trace: bool = False
    mode: str = "queued"  # "queued" (batches behind a sleep), "isolated" (sleep, launch, sync), "loop"
    sleep_ms: float = 3.0  # isolated: the sleep before each launch

    @property
    def shape(self) -> str:
        return f"D={self.D} {self.dtype}{' causal' if self.causal else ''}"


def default_cases() -> list[Case]:
    """The cases of docs/tuning/09_history.md: phase 09 and cuDNN queued at six shapes; one shape
    timed launch by launch after a long sleep and after a short one (host time then enters), and in
    a loop as a model calls it; the variants 09-ws and 09-overlap; the trace build at two shapes."""
    cases = []
    shapes = ((128, "float16", True), (64, "bfloat16", False), (64, "float16", True), (128, "bfloat16", True),
              (64, "float16", False), (128, "float16", False))
    for D, dtype, causal in shapes:
        cases += [Case("09", "09", D, dtype, causal), Case("cudnn", "cudnn", D, dtype, causal)]
    cases += [
        Case("09 isolated", "09", 128, "float16", True, mode="isolated"),
        Case("09 isolated short sleep", "09", 128, "float16", True, mode="isolated", sleep_ms=0.05),
        Case("cudnn isolated", "cudnn", 128, "float16", True, mode="isolated"),
        Case("09 loop", "09", 128, "float16", True, mode="loop"),
        Case("cudnn loop", "cudnn", 128, "float16", True, mode="loop"),
        Case("09 loop", "09", 64, "bfloat16", False, mode="loop"),
        Case("09-ws", "09-ws", 128, "float16", True),
        Case("09-overlap", "09-overlap", 128, "float16", True),
        Case("09 trace", "09", 128, "float16", True, trace=True),
        Case("09 trace", "09", 64, "bfloat16", False, trace=True),
    ]
    return cases


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------
def build(case: Case):
    """The KernelConfig of a case: a phase or variant as `attention` builds it, or the trace build."""
    from flashcore_numba.measure.trace import trace_config
    from flashcore_numba.phases import build as build_phase
    from flashcore_numba.phases import get_phase

    if case.trace:
        return trace_config(case.D, case.dtype, case.kernel[3:] or None)
    return build_phase(get_phase(case.kernel), case.D, case.dtype)


class Problem:
    def __init__(self, D, dtype, causal, seed=0):
        import torch

        B, H, S = SHAPE
        g = torch.Generator(device="cuda").manual_seed(seed)
        t = getattr(torch, dtype)
        self.q, self.k, self.v = (torch.randn(B, H, S, D, device="cuda", dtype=t, generator=g) for _ in range(3))
        self.D, self.dtype, self.causal = D, dtype, causal
        self.flops = 4 * B * H * S * S * D // (2 if causal else 1)
        with torch.no_grad():
            self.ref = torch.nn.functional.scaled_dot_product_attention(
                self.q.float(), self.k.float(), self.v.float(), is_causal=causal)

    def check(self, out, label):
        err = (out.float() - self.ref).abs().max().item()
        if not math.isfinite(err) or err > 2e-2:
            raise AssertionError(f"{label}: max |out - ref| = {err} (NaN: output not written or wrong)")
        return err


def launcher(case: Case, problem: Problem, stream_ptr):
    """(launch, out, trace): a function that launches the case once on torch's current stream."""
    import torch
    from numba import cuda

    from flashcore_numba.api import torch_to_kernel
    from flashcore_numba.phases.common import LOG2E

    out = torch.full_like(problem.q, float("nan"))
    if case.kernel == "cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                result = torch.nn.functional.scaled_dot_product_attention(problem.q, problem.k, problem.v,
                                                                          is_causal=problem.causal)
            if run.first:  # the first call's result is the one checked
                out.copy_(result)
                run.first = False

        run.first = True
        return run, out, None
    config = build(case)
    stream = cuda.external_stream(stream_ptr)
    arrays = [torch_to_kernel(t) for t in (problem.q, problem.k, problem.v, out)]
    qk_scale = LOG2E / math.sqrt(problem.D)
    if not case.trace:
        def run():
            config.launch(*arrays, problem.causal, qk_scale, stream=stream)

        return run, out, None
    from flashcore_numba.measure import trace as tr

    trace = tr.trace_array(config, problem.q.shape, problem.causal)

    def run():
        trace.copy_to_device(run.zeros, stream=stream)
        tr.launch_with_trace(config, trace, *arrays, problem.causal, qk_scale, stream=stream)

    run.zeros, run.config = np.zeros(trace.shape, dtype=np.int32), config
    return run, out, trace


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def sleep_for(ms: float):
    import torch

    torch.cuda._sleep(int(ms * 1e-3 * sleep_for.cycles_per_s))


def calibrate_sleep():
    """Cycles per second of torch.cuda._sleep on this GPU (its clock as it runs now)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    sleep_for.cycles_per_s = 10_000_000 / (start.elapsed_time(end) * 1e-3)


def queued_times(run, n: int, batch: int = 25):
    """Device-only times (ms) of n launches, in batches queued behind a sleep. Returns
    (times, batches in which the host was still queuing when the GPU reached the launches)."""
    import torch

    t0 = time.perf_counter()
    for _ in range(batch):
        run()
    torch.cuda.synchronize()
    host_ms = (time.perf_counter() - t0) * 1e3  # an upper bound of the host's time for a batch
    sleep_ms = 3 * host_ms + 2
    times, leaked = [], 0
    while len(times) < n:
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(batch + 1)]
        before.record()
        sleep_for(sleep_ms)
        after.record()
        h0 = time.perf_counter()
        for i in range(batch):
            events[i].record()
            run()
        events[batch].record()
        queued_ms = (time.perf_counter() - h0) * 1e3
        torch.cuda.synchronize()
        if queued_ms > 0.9 * before.elapsed_time(after):
            leaked += 1
            continue
        times += [events[i].elapsed_time(events[i + 1]) for i in range(batch)]
    return times[:n], leaked


def isolated_times(run, n: int, sleep_ms: float = 3.0, trace=None):
    """Each launch alone: a sleep, the launch between two events, synchronize (and read the trace).
    Returns (times, traces, host ms of each launch call)."""
    import torch

    times, traces, host = [], [], []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sleep_for(sleep_ms)
        start.record()
        h0 = time.perf_counter()
        run()
        host.append((time.perf_counter() - h0) * 1e3)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        if trace is not None:
            traces.append(trace.copy_to_host())
    return times, traces, host


def loop_times(run, n: int):
    """What a model's loop sees: launches back to back, no sleep, garbage collection on; events
    between them (host time enters wherever the GPU waits for the host). Returns (times, host ms of
    each call, garbage collections during the loop and their total ms)."""
    import torch

    collections = []

    def on_gc(phase, info, t=[0.0]):  # noqa: B006 - the start time of the collection under way
        if phase == "start":
            t[0] = time.perf_counter()
        else:
            collections.append((info["generation"], (time.perf_counter() - t[0]) * 1e3))

    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    host = []
    gc.enable()
    gc.callbacks.append(on_gc)
    try:
        events[0].record()
        for i in range(n):
            h0 = time.perf_counter()
            run()
            host.append((time.perf_counter() - h0) * 1e3)
            events[i + 1].record()
        torch.cuda.synchronize()
    finally:
        gc.callbacks.remove(on_gc)
        gc.disable()
    return [events[i].elapsed_time(events[i + 1]) for i in range(n)], host, collections


def summary(times) -> dict:
    t = np.asarray(times)
    med = float(np.median(t))
    return {"n": len(t), "median_ms": med, "mean_ms": float(t.mean()), "p99_ms": float(np.percentile(t, 99)),
            "max_ms": float(t.max()), "over_1_5x": int((t > 1.5 * med).sum()), "over_2x": int((t > 2 * med).sum())}


# ---------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=1000)
    parser.add_argument("--trace-launches", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("stalls_out"))
    parser.add_argument("--only", nargs="*", help="case names to run (default: all)")
    args = parser.parse_args(argv)
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    calibrate_sleep()
    stream_ptr = torch.cuda.current_stream().cuda_stream
    problems, rows, raw = {}, [], {}
    print(f"{torch.cuda.get_device_name()}, B={SHAPE[0]} H={SHAPE[1]} S={SHAPE[2]}", flush=True)
    for case in default_cases():
        if args.only and case.name not in args.only:
            continue
        key = (case.D, case.dtype, case.causal)
        if key not in problems:
            problems[key] = Problem(*key)
        problem = problems[key]
        label = f"{case.name} {case.shape}"
        t = time.perf_counter()
        run, out, trace = launcher(case, problem, stream_ptr)
        run()
        torch.cuda.synchronize()
        err = problem.check(out, label)
        built_s = time.perf_counter() - t
        for _ in range(10):
            run()
        torch.cuda.synchronize()
        gc.collect()
        gc.disable()
        try:
            extra = {}
            if case.trace:
                times, traces, host = isolated_times(run, args.trace_launches, trace=trace)
            elif case.mode == "isolated":
                times, traces, host = isolated_times(run, min(args.launches, 300), sleep_ms=case.sleep_ms)
                extra = {"sleep_ms": case.sleep_ms, "host_ms_max": max(host),
                         "host_ms_median": float(np.median(host)),
                         "launches_host_over_sleep": sum(h > case.sleep_ms for h in host)}
            elif case.mode == "loop":
                times, host, collections = loop_times(run, args.launches)
                traces = []
                extra = {"host_ms_median": float(np.median(host)), "host_ms_p99": float(np.percentile(host, 99)),
                         "host_ms_max": max(host), "gc_collections": len(collections),
                         "gc_ms_max": max((c[1] for c in collections), default=0.0),
                         "gc_ms_total": sum(c[1] for c in collections)}
            else:
                (times, leaked), traces = queued_times(run, args.launches), []
                extra = {"batches_left_out": leaked}
        finally:
            gc.enable()
        s = summary(times)
        s.update(extra)
        s.update(case=case.name, shape=case.shape, mode="isolated" if case.trace else case.mode, max_err=err,
                 build_s=round(built_s, 1), tflops_median=problem.flops / (s["median_ms"] * 1e-3) / 1e12,
                 tflops_mean=problem.flops / (s["mean_ms"] * 1e-3) / 1e12)
        rows.append(s)
        raw[label] = times
        print(f"{label:40s} {s['median_ms']:.3f} med {s['mean_ms']:.3f} mean {s['p99_ms']:.3f} p99 "
              f"{s['max_ms']:.3f} max  >1.5x {s['over_1_5x']:3d}  >2x {s['over_2x']:3d}  ({s['n']}, "
              f"built in {built_s:.0f} s) {json.dumps(extra)}", flush=True)
        if case.trace:
            from flashcore_numba.measure.trace import describe, records_of

            recs = np.stack([records_of(t, run.config) for t in traces])
            np.savez_compressed(args.out / f"trace_{case.D}_{case.dtype}{'_causal' if case.causal else ''}.npz",
                                records=recs, event_ms=np.asarray(times))
            order = np.argsort(times)
            for i in [*order[::-1][:3], order[len(order) // 2]]:
                print(f" launch {i} ({'median' if i == order[len(order) // 2] else 'slow'}):")
                print("\n".join(describe(recs[i], times[i])), flush=True)
        del run, out, trace
        torch.cuda.empty_cache()
    (args.out / "stalls.json").write_text(json.dumps({"rows": rows, "times_ms": raw}, indent=1))
    print("\ncase                                     median     mean      p99      max  >1.5x  >2x  TFLOPS med/mean")
    for s in rows:
        print(f"{s['case'] + ' ' + s['shape']:40s} {s['median_ms']:.3f}  {s['mean_ms']:.3f}  {s['p99_ms']:.3f}  "
              f"{s['max_ms']:7.3f}  {s['over_1_5x']:4d} {s['over_2x']:4d}  {s['tflops_median']:.0f}/{s['tflops_mean']:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

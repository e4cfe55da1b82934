"""Timelines of phase 09's blocks from the GPU's own clock: the trace build, launched and read.

Phase 09 built with trace=True (flashcore_numba.phases.tracing) times every barrier wait with
%globaltimer, one nanosecond clock for the whole GPU, and each warpgroup leaves a record of
TRACE_WORDS words per block: when it started and ended, how many query blocks it took, per kind
of wait its total, count and longest, and the waits longer than TRACE_EVENT_NS as events. This
module launches that build and reads the records:

    records = traced_launch(config, q, k, v, o, causal, qk_scale)   # (blocks, roles, TRACE_WORDS)
    print("\n".join(describe(records)))

What a trace can answer that an event pair cannot: how long the kernel ran on the GPU's clock
(first block start to last block end), so a launch time that exceeds it was spent outside the
kernel (the host, the queue); and, for a launch that is slow on the GPU, which block, which role
and which barrier waited. tools/stalls.py runs it against many launches
(docs/tuning/09_history.md).
"""

from __future__ import annotations

import numpy as np

KINDS = ("full", "empty", "q_full", "q_empty", "bar.sync")  # the kinds of wait, in record order
ROLES = ("producer", "consumer 0", "consumer 1", "consumer 2")


def trace_config(head_dim: int, dtype: str = "float16", variant: str | None = None):
    """Phase 09 (or a variant: "ws", "turns", "overlap") built with the trace (phases.build_trace:
    its kernel is kept in the disk cache, and `flashcore compile` builds the default one ahead)."""
    from ..phases import build_trace

    return build_trace(head_dim, dtype, variant)


def roles_of(config) -> int:
    from ..phases.p09_warp_specialized import WG_M

    return 1 + config.block_m // WG_M  # the producer, then the consumers


def trace_array(config, q_shape, causal: bool):
    """A zeroed trace array for one launch of `config` (the work counter at index 0)."""
    from numba import cuda

    from ..phases.tracing import TRACE_WORDS

    (blocks,) = config.grid(q_shape, causal)
    return cuda.to_device(np.zeros(1 + blocks * roles_of(config) * TRACE_WORDS, dtype=np.int32))


def launch_with_trace(config, trace, q, k, v, o, causal: bool, qk_scale: float, stream=0) -> None:
    """Launch the trace build with `trace` (from trace_array, zeroed) in place of the work counter."""
    from ..phases.common import launch

    args = (*config.arguments(q, k, v, o, causal, qk_scale, stream)[:-1], trace)
    launch(config.kernel, config.grid(q.shape, causal), config.n_threads, config.smem_bytes, args, stream,
           config.cache_key)


def records_of(trace, config) -> np.ndarray:
    """The records of a finished launch: uint32 (blocks, roles, TRACE_WORDS)."""
    from ..phases.tracing import TRACE_WORDS

    host = trace.copy_to_host() if hasattr(trace, "copy_to_host") else np.asarray(trace)
    return host[1:].view(np.uint32).reshape(-1, roles_of(config), TRACE_WORDS)


def traced_launch(config, q, k, v, o, causal: bool, qk_scale: float, stream=0) -> np.ndarray:
    """One launch of the trace build; returns its records (synchronizes)."""
    trace = trace_array(config, q.shape, causal)
    launch_with_trace(config, trace, q, k, v, o, causal, qk_scale, stream)
    return records_of(trace, config)


def rel(t, t0) -> np.ndarray:
    """Nanoseconds from t0 to t, both the low 32 bits of %globaltimer: exact modulo 2^32, which a
    launch never comes near (4.3 s)."""
    return (np.asarray(t, dtype=np.int64) - int(t0) + 2**31) % 2**32 - 2**31


def summary(records: np.ndarray) -> dict:
    """What one launch's records say: the kernel's span on the GPU clock, the spread of the block
    starts, the longest wait of each kind and the waits kept as events, longest first."""
    from ..phases.tracing import TRACE_EVENTS, TRACE_HEADER, TRACE_KINDS

    H, K = TRACE_HEADER, TRACE_KINDS
    t0 = records[0, 0, 0]
    start, after_regs, end = (rel(records[:, :, i], t0) for i in range(3))
    per_kind = records[:, :, H:H + 3 * K].reshape(*records.shape[:2], K, 3).astype(np.int64)
    events = []
    for b in range(records.shape[0]):
        for r in range(records.shape[1]):
            for e in range(min(int(records[b, r, 4]), TRACE_EVENTS)):
                at, dt, code, unit = records[b, r, H + 3 * K + 4 * e: H + 3 * K + 4 * e + 4]
                events.append({"ns": int(dt), "block": b, "role": ROLES[r], "at_ns": int(start[b, r] + int(at)),
                               "barrier": (f"bar.sync {code & 0xFF}" if code & 0x10000 else
                                           f"mbarrier {code & 0xFF} parity {(code >> 8) & 1}"),
                               "query_block": int(unit)})
    events.sort(key=lambda e: -e["ns"])
    return {
        "span_ns": int(end.max() - start.min()),
        "start_spread_ns": int(start[:, 0].max() - start[:, 0].min()),
        "setmaxnreg_max_ns": int((after_regs - start).max()),
        "units": records[:, 0, 3].astype(int).tolist(),
        "last_blocks": [(int(b), int(end[b].max())) for b in np.argsort(end.max(axis=1))[::-1][:3]],
        "wait_mean_ns": {KINDS[k]: float(per_kind[:, :, k, 0].sum() / max(1, per_kind[:, :, k, 1].sum()))
                         for k in range(K)},
        "wait_count": {KINDS[k]: int(per_kind[:, :, k, 1].sum()) for k in range(K)},
        "wait_max_ns": {KINDS[k]: int(per_kind[:, :, k, 2].max()) for k in range(K)},
        "events": events,
    }


def describe(records: np.ndarray, event_ms: float | None = None, n_events: int = 6) -> list[str]:
    """A few lines on one launch: its span against the events' time, the last blocks to finish,
    the longest waits kept as events, and the waits by kind."""
    s = summary(records)
    head = f"  kernel span on the GPU clock {s['span_ns'] * 1e-6:.3f} ms"
    if event_ms is not None:
        head = f"  events {event_ms:.3f} ms, " + head.strip()
    lines = [head + f" (block starts spread {s['start_spread_ns'] * 1e-3:.1f} us, setmaxnreg waits up to "
                    f"{s['setmaxnreg_max_ns'] * 1e-3:.1f} us)",
             "  last blocks to finish: " + ", ".join(f"block {b} at {t * 1e-6:.3f} ms ({s['units'][b]} units)"
                                                       for b, t in s["last_blocks"])]
    for e in s["events"][:n_events]:
        lines.append(f"  wait {e['ns'] * 1e-3:9.1f} us  block {e['block']:3d} {e['role']:10s} {e['barrier']:22s} "
                     f"at {e['at_ns'] * 1e-6:.3f} ms, query block #{e['query_block']} of the role")
    lines.append("  waits by kind (mean / longest, us): " + ", ".join(
        f"{k} {s['wait_mean_ns'][k] * 1e-3:.2f} / {s['wait_max_ns'][k] * 1e-3:.1f}" for k in KINDS))
    return lines

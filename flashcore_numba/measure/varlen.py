"""`flashcore bench --varlen N,LO,HI`: packed sequences of their own lengths (attention_varlen).

N sequences of random lengths LO..HI (seeded, recorded), H heads of D, causal or not, packed end to
end. In one run, each checked by the gate of bench.py against the float64 reference (sequence by
sequence) before it is timed (kernel time, L2 flushed before each launch):

- phases 07 and 09 on the packed sequences (`<id>-varlen`), launched as attention_varlen launches
  them (its checks and allocations done once, before the timing);
- the same phases on a dense batch of as many tokens (N sequences of the mean length): what the
  packing costs, if anything, beside a batch that needs none;
- torch SDPA's flash and cuDNN backends on the batch padded to the longest sequence, as a caller
  without packed sequences runs it (causal only: right padding is then never seen by a real row;
  without the mask the padded keys would need one, which those backends do not take).

TFLOPS count the useful FLOPs of each problem (the packed sequences' own, for the padded SDPA too:
the padding is work it does, not work asked for). The record has bench.py's schema, with the
lengths in its config; it is written under docs/bench/varlen/ (the ladder's reports read only
docs/bench/), and `flashcore report` puts its table in docs/performance.md.
"""

from __future__ import annotations

import sys

import numpy as np

from ..phases import get_phase
from .bench import (
    DTYPES,
    PEERS,
    Problem,
    Timing,
    raised,
    attention_flops,
    check_phase,
    gate,
    open_device,
    phase_skip_reason,
    set_timing,
)
from .records import Result, build_record, default_records_dir, gpu_slug, nvidia_smi, provenance, unavailable

VARLEN_PHASES = ("07", "09")
VARLEN_PEERS = ("sdpa_flash", "sdpa_cudnn")


def random_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(lo, hi + 1, n)]


def record_path(gpu_name: str, n: int, lo: int, hi: int, H: int, D: int, dtype: str, causal: bool):
    short = {v: k for k, v in DTYPES.items()}.get(dtype, dtype)
    name = f"{gpu_slug(gpu_name)}_varlen_n{n}_{lo}-{hi}_h{H}d{D}_{short}" + ("_causal" if causal else "")
    return default_records_dir() / "varlen" / f"{name}.json"


def _packed_oracle(device, q, k, v, lengths, causal, H, D, dtype):
    """float64 reference and same-dtype yardstick of the packed problem, (total, H, D) each, from
    bench's oracle on every sequence (a slice of heads at a time on the GPU)."""
    total = int(sum(lengths))
    ref, lowp = np.zeros((total, H, D)), np.zeros((total, H, D))
    start = 0
    for n in lengths:
        rows = slice(start, start + n)
        seq = tuple(x[rows].transpose(0, 1)[None].contiguous() for x in (q, k, v))  # (1, H, n, D)
        r, lo, oracle = device.oracle(None, seq, Problem(1, H, n, n, D, dtype, causal))
        ref[rows], lowp[rows] = r[0].transpose(1, 0, 2), lo[0].transpose(1, 0, 2)
        start += n
    return ref, lowp, oracle


def run_varlen_benchmark(n: int, lo: int, hi: int, *, H: int = 16, D: int = 128, dtype: str = "float16",
                         causal: bool = True, phase_ids=VARLEN_PHASES, peer_names=VARLEN_PEERS, timing=Timing(),
                         seed: int | None = None, device=None, command=None, progress=None) -> dict:
    """The whole protocol on one packing (see the module docstring), returned as a record."""
    from ..inference import varlen_launcher

    device = device or open_device()
    if device.kind != "torch":
        raise RuntimeError(f"the packed-sequence benchmark needs torch with CUDA: {device.no_peers_reason}")
    torch = device.torch
    step = progress or (lambda label: None)
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % 2**32)
    lengths = random_lengths(n, lo, hi, seed)
    total, longest = sum(lengths), max(lengths)
    flops = sum(attention_flops(1, H, s, s, D, causal) for s in lengths)
    clock_start = nvidia_smi().get("sm_clock_mhz")
    step("inputs and reference")
    gen = torch.Generator(device=device.device).manual_seed(seed)
    t = getattr(torch, dtype)
    q, k, v = (torch.randn(total, H, D, device=device.device, generator=gen).to(t) for _ in range(3))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device.device)
    ref, lowp, oracle = _packed_oracle(device, q, k, v, lengths, causal, H, D, dtype)
    results = []
    for pid in phase_ids:
        phase = get_phase(pid)
        step(f"phase {pid}, packed")
        name, title = f"{pid}-varlen", f"{phase.TITLE}, on the packed sequences (attention_varlen)"
        reason = phase_skip_reason(phase, Problem(n, H, longest, longest, D, dtype, causal), device)
        if reason:
            results.append(unavailable(name, "phase", title, reason))
            continue
        result = Result(name, "phase", title)
        out = torch.full_like(q, float("nan"))
        try:
            launch, _, _ = varlen_launcher(q, k, v, cu, cu, longest, longest, causal=causal, phase=pid, out=out)
            launch()
            torch.cuda.synchronize()
            gate(result, device.host(out), ref, lowp, poisoned=True)
            if result.correct:
                set_timing(result, device.time_ms(launch, timing), flops, None)
        except Exception as e:  # noqa: BLE001 - recorded in the result, the run goes on
            result.correct, result.message = False, f"raised {raised(e)}"
        results.append(result)
        device.release()
    # the same phases on a dense batch of as many tokens: n sequences of the mean length
    mean = max(1, round(total / n))
    dense = Problem(n, H, mean, mean, D, dtype, causal)
    step(f"dense batch of {n} x {mean}: inputs and reference")
    _, dense_qkv = device.inputs(dense, seed)
    dense_ref, dense_lowp, _ = device.oracle(None, dense_qkv, dense)
    for pid in phase_ids:
        step(f"phase {pid}, dense")
        result, launch = check_phase(get_phase(pid), device, dense_qkv, dense, dense_ref, dense_lowp)
        result.title = f"{result.title}, on a dense batch of {n} x {mean} (as many tokens)"
        if launch is not None:
            set_timing(result, device.time_ms(launch, timing), dense.flops, None)
        results.append(result)
        device.release()
    del dense_qkv, dense_ref, dense_lowp
    # SDPA on the batch padded to the longest sequence
    padded = Problem(n, H, longest, longest, D, dtype, causal)
    for name in peer_names:
        step(f"{name}, padded")
        backend, title = PEERS[name]
        title = f"{title}, on the batch padded to {longest} (useful FLOPs counted)"
        if not causal:
            results.append(unavailable(name, "peer", title, "without the causal mask the padded keys need a key "
                                       "mask, which this backend does not take"))
            continue
        result = Result(name, "peer", title)
        pq, pk, pv = (torch.zeros(n, H, longest, D, device=device.device, dtype=t) for _ in range(3))
        start = 0
        for b, s in enumerate(lengths):
            for padded_x, x in ((pq, q), (pk, k), (pv, v)):
                padded_x[b, :, :s] = x[start:start + s].transpose(0, 1)
            start += s
        try:
            out = device.sdpa(backend, pq, pk, pv, padded)
            torch.cuda.synchronize()
            rows = torch.cat([out[b, :, :s].transpose(0, 1) for b, s in enumerate(lengths)])
            gate(result, device.host(rows), ref, lowp, poisoned=False)
            if result.correct:
                def launch(backend=backend, qkv=(pq, pk, pv)):
                    device.sdpa(backend, *qkv, padded)

                set_timing(result, device.time_ms(launch, timing), flops, None)
        except Exception as e:  # noqa: BLE001 - a backend that cannot run says why
            results.append(unavailable(name, "peer", title, raised(e)))
            continue
        results.append(result)
        device.release()
    problem = Problem(n, H, longest, longest, D, dtype, causal)
    oracle = dict(oracle, rule="max|out - ref| <= 2 * max|yardstick - ref| + atol", per_sequence=True)
    record = build_record(problem=problem, results=results, provenance=provenance(device, sm_clock_start=clock_start),
                          timing=timing, ceiling=None, oracle=oracle,
                          command=command if command is not None else ["flashcore", *sys.argv[1:]], seed=seed)
    record["config"].update(lengths=lengths, packed_tokens=total, dense_batch=[n, mean])
    record["flops"] = int(flops)
    return record

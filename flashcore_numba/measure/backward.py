"""`flashcore bench --backward`: the backward pass (phases/p11_backward.py) beside SDPA's.

One problem (--shape, --causal, --dtype, --kv-heads), in one run. Every candidate is first checked
by the oracle of the gradient tests: dq, dk and dv of batch 0 against torch's autograd on float64
copies (SDPA's math backend), each within twice what the same autograd in the inputs' dtype errs
by, plus bench's atol (reference.check_close). Then timed, kernel time, L2 flushed before each:

- `11`: the backward as attention()'s autograd runs it off Hopper (flashcore::attention_backward's body: Δ, dQ
  zeroed, kv_kernel with dQ by atomics, dQ converted to the inputs' dtype), from the forward's O and
  log-sum-exp; `11-deterministic`: the same with deterministic=True (kv_kernel's serial build: a
  block per part of dQ takes its key blocks in turn, so each addition to dQ comes in one order);
- on Hopper `12` and `12-deterministic`: the same with phase 12's kv_kernel (phases/p12_backward_wgmma.py,
  its products on wgmma);
- `sdpa_flash`, `sdpa_cudnn`: torch's autograd.grad through SDPA's flash and cuDNN backends, the
  forward's graph kept (retain_graph), so only their backward is timed;
- `flex_attention`, when asked for (`--peers flash,cudnn,flex`; not a default peer, as in the forward's
  bench: torch.compile builds its kernels for each shape first): the same through torch's FlexAttention
  as bench's peer runs it (TorchDevice.flex: flex_attention compiled once, causal as a block mask
  aligned bottom-right, GQA by enable_gqa), compiled without donated buffers (`retained_graph`).
  Where it cannot run (torch before 2.5, no triton, a compile that fails) its rows are recorded
  unavailable with the reason;
- `11-step` (on Hopper `13-step`: autograd runs phase 13's backward there, runtime/torch_ops.autograd_backward_phase),
  `sdpa_flash-step`, `sdpa_cudnn-step` (and `flex_attention-step`): one training step of attention
  alone, forward and backward (the gradients taken by autograd.grad, so no .grad accumulates between
  launches).

With --calls N each row also gets its *call time*: the same launch back to back, as a training loop
calls it, host time included where the GPU waits for it (bench.call_times; the `-step` rows are what
a loop's forward and loss.backward() cost).

FLOPs are counted as FlashAttention counts them: the backward does five matrix products where the
forward does two, 2.5 x the forward's (bench.attention_flops), and a step 3.5 x. The record has
bench.py's schema, written under docs/bench/backward/; `flashcore report` puts its table in
docs/performance.md.
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np

from ..reference import check_close, default_scale
from .bench import (PEERS, Problem, Timing, raised, call_times, capped, flex_skip_reason, open_device,
                    set_timing)
from .records import Result, build_record, default_records_dir, gpu_slug, nvidia_smi, provenance, unavailable

BACKWARD_PEERS = ("sdpa_flash", "sdpa_cudnn")  # the default; flex_attention is asked for by name (--peers)
BACKWARD_FLOPS = 2.5  # x the forward's: five products of the same size where the forward has two
STEP_FLOPS = 1 + BACKWARD_FLOPS
FLOPS_RULE = (f"the backward rows count {BACKWARD_FLOPS} x the forward's FLOPs, the -step rows (forward and backward) "
              f"{STEP_FLOPS} x, as FlashAttention's benchmark counts them")


def record_path(gpu_name: str, problem: Problem):
    return default_records_dir() / "backward" / f"{gpu_slug(gpu_name)}_backward_{problem.tag}.json"


def _gradient_oracle(device, q, k, v, do, problem: Problem):
    """Batch 0's float64 gradients (torch autograd through SDPA's math backend on float64 copies)
    and the yardstick's (the same in the inputs' dtype), each a list of three host arrays."""
    one = Problem(1, problem.H, problem.S_q, problem.S_k, problem.D, problem.dtype, problem.causal, problem.H_kv)

    def grads(q, k, v, do):
        q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
        out = device.sdpa("MATH", q, k, v, one)
        return [g.double().cpu().numpy() for g in device.torch.autograd.grad(out, (q, k, v), do)]

    first = [x[:1] for x in (q, k, v, do)]
    ref = grads(*(x.double() for x in first))
    lowp = grads(*first)
    device.release()
    return ref, lowp


def gate_gradients(result: Result, got, ref, lowp) -> None:
    """check_close on each of batch 0's dq, dk, dv; the result is correct when all three are."""
    messages, worst = [], None
    result.correct = True
    for name, g, r, lo in zip(("dq", "dk", "dv"), got, ref, lowp):
        g = g[:1].double().cpu().numpy()
        verdict = check_close(g, r, lo)
        result.correct = result.correct and bool(verdict.ok)
        messages.append(f"{name}: {verdict.message}")
        if worst is None or verdict.max_err - verdict.allowed > worst[0] - worst[1]:
            worst = (verdict.max_err, verdict.allowed)
    result.message = "; ".join(messages)
    result.max_err, result.allowed_err = worst


def check_backward(problem: Problem, seed: int | None = None, *, deterministic: bool = False,
                   cc: tuple | None = None, phase: str = "11") -> Result:
    """Phase 11 on `problem` from NumPy arrays (what `flashcore run` checks in the simulator, where
    nothing is timed): dq, dk and dv of fresh fp16 inputs against the float64 reference's gradients,
    each within twice the yardstick's error (the same formulas as the kernels compute them) plus
    gradient_atol. The Result's max_err and allowed_err are the worst gradient's. deterministic: dQ by
    the serial build; cc: build the kernels for this compute capability (p11_backward.build); phase:
    "12" checks phase 12's kv_kernel instead (wgmma: Hopper, or the simulator)."""
    from ..arch.sim import simulator_enabled
    from ..phases import backward_phase, cc_reason
    from ..reference import gradient_atol, gradient_oracle, random_qkv, reference_attention, reference_lse

    module = backward_phase(phase)
    result = Result(phase, "phase", module.TITLE)
    if not module.runs_head_dim(problem.D) or problem.dtype != "float16":
        result.available = False
        result.reason = (f"phase {phase}'s backward is checked here at fp16 and the head dims it builds, multiples "
                         f"of 8 up to {module.MAX_HEAD_DIM}")
        return result
    if phase != "11" and not simulator_enabled():  # phase 12: wgmma, Hopper alone
        from numba import cuda

        why = cc_reason(module, cuda.get_current_device().compute_capability)
        if why:
            result.available, result.reason = False, why
            return result
    shape = (problem.B, problem.H, problem.S_q, problem.D)
    q, k, v = random_qkv(shape, problem.S_k, heads_kv=problem.H_kv, seed=seed)
    do = np.random.default_rng(seed).standard_normal(shape).astype(np.float16)
    o = reference_attention(q, k, v, causal=problem.causal).astype(np.float16)
    lse = reference_lse(q, k, causal=problem.causal).astype(np.float32)
    try:
        built_for = {"cc": cc} if phase == "11" else {}  # phase 12 is built for Hopper alone
        got = module.backward(q, k, v, o, do, lse, causal=problem.causal, deterministic=deterministic, **built_for)
    except Exception as e:  # noqa: BLE001 - recorded in the result
        result.correct, result.message = False, f"raised {raised(e)}"
        return result
    ref, yardstick = gradient_oracle(q, k, v, do, causal=problem.causal)
    verdicts = [check_close(np.asarray(g, np.float64), r, y, atol=gradient_atol(r)) for g, r, y in zip(got, ref, yardstick)]
    result.correct = all(v.ok for v in verdicts)
    result.message = "; ".join(f"{name}: {v.message}" for name, v in zip(("dq", "dk", "dv"), verdicts))
    worst = max(verdicts, key=lambda v: v.max_err - v.allowed)
    result.max_err, result.allowed_err = worst.max_err, worst.allowed
    return result


def retained_graph(backend: str):
    """Where a peer's backward is timed again and again on one forward's graph (retain_graph): for
    FlexAttention, whose backward torch.compile builds, the graph is compiled without donated buffers.
    A compiled backward may reuse the memory of what the forward saved for it (the log-sum-exp), and
    torch refuses retain_graph for such a backward, which would overwrite what its next run reads. The
    -step rows, a fresh forward each, run the same compiled graph."""
    try:
        from torch._functorch import config
    except ImportError:
        config = None
    if backend != "FLEX" or not hasattr(config, "donated_buffer"):  # a torch without the setting donates none
        return contextlib.nullcontext()
    return config.patch(donated_buffer=False)


def backward_rows(device) -> list[tuple[str, bool]]:
    """(backward phase, deterministic) of each row of ours: phase 11's two builds, and on Hopper
    (the device's cc 9.0) phase 12's, whose kv_kernel runs on wgmma, and phase 13's, warp-specialized."""
    from ..phases import backward_phase, cc_reason

    phases = ["11"] + [p for p in ("12", "13") if cc_reason(backward_phase(p), device.cc) is None]
    return [(phase, deterministic) for phase in phases for deterministic in (False, True)]


def run_backward_benchmark(problem: Problem, *, peer_names=BACKWARD_PEERS, timing=Timing(), seed: int | None = None,
                           device=None, command=None, progress=None) -> dict:
    """The whole protocol on one problem (see the module docstring), returned as a record."""
    from ..api import attention
    from ..phases import backward_phase
    from ..runtime.torch_ops import attention_backward, autograd_backward_phase

    device = device or open_device()
    if device.kind != "torch":
        raise RuntimeError(f"the backward benchmark needs torch with CUDA: {getattr(device, 'no_peers_reason', '')}")
    torch = device.torch
    step = progress or (lambda label: None)
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % 2**32)
    clock_start = nvidia_smi().get("sm_clock_mhz")
    step("inputs and reference gradients")
    _, (q, k, v) = device.inputs(problem, seed)
    do = torch.randn(q.shape, device=q.device, dtype=q.dtype, generator=torch.Generator(q.device).manual_seed(seed))
    ref, lowp = _gradient_oracle(device, q, k, v, do, problem)
    backward_flops = int(BACKWARD_FLOPS * problem.flops)
    step_flops = int(STEP_FLOPS * problem.flops)
    with torch.no_grad():
        out, lse = attention(q, k, v, causal=problem.causal, return_lse=True)

    def timed(result, launch, flops):
        """The device time of `launch` (behind the GPU kept busy); with timing.calls also the call
        time, `launch` back to back as a training loop calls it (measure/bench.call_times)."""
        set_timing(result, device.time_ms(launch, timing), flops, None)
        if timing.calls:
            result.call = call_times(device, launch, capped(timing.calls, result.median_ms, timing.cap_seconds))

    results = []
    for phase, deterministic in backward_rows(device):
        name = f"{phase}-deterministic" if deterministic else phase
        step(f"phase {name}")
        how = "dQ summed key block after key block, bit-identical" if deterministic else "dQ by float32 atomics"
        on = {"11": "mma.sync", "12": "wgmma", "13": "wgmma, warp-specialized"}[phase]
        result = Result(name, "phase", f"The backward on {on} ({how})")
        module = backward_phase(phase)
        if not module.runs_head_dim(problem.D):  # phases 12 and 13 up to 128
            result.available = False
            result.reason = f"phase {phase} builds head dims up to {module.MAX_HEAD_DIM}"
            results.append(result)
            continue

        def launch(deterministic=deterministic, phase=phase):
            return attention_backward(q, k, v, out, lse, do, None, problem.causal, default_scale(problem.D), deterministic,
                                      phase)

        try:
            gate_gradients(result, launch(), ref, lowp)
            if result.correct:
                timed(result, launch, backward_flops)
        except Exception as e:  # noqa: BLE001 - recorded in the result, the run goes on
            result.correct, result.message = False, f"raised {raised(e)}"
        results.append(result)
        device.release()
    skip = {name: flex_skip_reason(torch) if PEERS[name][0] == "FLEX" else None for name in peer_names}
    for name in peer_names:
        step(name)
        backend, title = PEERS[name]
        title = f"{title}, backward"
        if skip[name]:
            results.append(unavailable(name, "peer", title, skip[name]))
            continue
        leaves = tuple(x.detach().clone().requires_grad_() for x in (q, k, v))
        try:
            with retained_graph(backend):
                peer_out = device.sdpa(backend, *leaves, problem)

                def launch(peer_out=peer_out, leaves=leaves):
                    return torch.autograd.grad(peer_out, leaves, do, retain_graph=True)

                result = Result(name, "peer", title)
                gate_gradients(result, launch(), ref, lowp)
                if result.correct:
                    timed(result, launch, backward_flops)
        except Exception as e:  # noqa: BLE001 - a backend that cannot run says why
            results.append(unavailable(name, "peer", title, raised(e)))
            continue
        results.append(result)
        del peer_out, leaves
        device.release()
    # one training step of attention alone: forward and backward
    leaves = tuple(x.detach().clone().requires_grad_() for x in (q, k, v))
    autograd = autograd_backward_phase(device.cc, problem.D)  # what attention()'s autograd runs on this GPU
    steps = {f"{autograd}-step": ("phase", f"attention() forward and backward (phase {autograd}'s), one training step",
                                  lambda: attention(*leaves, causal=problem.causal), None)}
    for name in peer_names:
        backend, title = PEERS[name]
        steps[f"{name}-step"] = ("peer", f"{title}, forward and backward",
                                 lambda backend=backend: device.sdpa(backend, *leaves, problem), skip[name])
    for name, (kind, title, forward, why) in steps.items():
        step(name)
        if why:
            results.append(unavailable(name, "peer", title, why))
            continue
        result = Result(name, kind, title)

        def launch(forward=forward):
            return torch.autograd.grad(forward(), leaves, do)

        try:
            gate_gradients(result, launch(), ref, lowp)
            if result.correct:
                timed(result, launch, step_flops)
        except Exception as e:  # noqa: BLE001
            if kind == "peer":
                results.append(unavailable(name, "peer", title, raised(e)))
                continue
            result.correct, result.message = False, f"raised {raised(e)}"
        results.append(result)
        device.release()
    oracle = {"reference": "torch autograd through SDPA's math backend on float64 copies, batch 0",
              "yardstick": f"the same autograd in {problem.dtype}",
              "rule": "max|grad - ref| <= 2 * max|yardstick - ref| + atol, for each of dq, dk, dv"}
    record = build_record(problem=problem, results=results, provenance=provenance(device, sm_clock_start=clock_start),
                          timing=timing, ceiling=None, oracle=oracle,
                          command=command if command is not None else ["flashcore", *sys.argv[1:]], seed=seed)
    record["flops"] = backward_flops
    record["config"]["pass"] = "backward"
    record["flops_rule"] = FLOPS_RULE
    return record

"""attention(q, k, v): input validation and dispatch to a phase.

Inputs follow torch's scaled_dot_product_attention: (B, H, S, D) — batch, heads, sequence,
head dim — with q of length S_q and k, v of length S_k. Three kinds of input are accepted,
and the output is of the same kind:

- torch CUDA tensors (zero-copy, on torch's current stream) -> torch tensor;
- Numba device arrays -> Numba device array;
- NumPy arrays -> NumPy array (copied to the GPU and back; with NUMBA_ENABLE_CUDASIM=1 the
  kernel runs in Numba's simulator instead).

Every bad input raises TypeError or ValueError whose message starts with the argument's
name and says what was expected and what was given.

The call on torch tensors is the one users make in a loop, so it costs what its kernel costs
(runtime/): the first call of a problem (its shapes, dtype, device, flags and scale) validates it
all and makes its plan; a later call of the same problem checks only what could make it
different (the key of `_torch_call`), then fills in the pointers and launches on torch's current
stream. No host synchronization, no allocation outside torch's caching allocator: a call can be
captured in a CUDA graph. Under torch.compile the call is the custom op flashcore::attention
(`torch.ops.flashcore.attention`), so a compiled model has no graph break there.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import math
import numbers
import sys
import warnings

import numpy as np

from .arch.sim import simulator_enabled
from .runtime.inputs import current_stream, describe, is_torch, torch_module, torch_to_kernel
from .phases import PHASES, build, cc_reason, get_phase, min_cc, supports_gqa, supports_lse
from .phases import dtypes as phase_dtypes
from .phases.common import LOG2E
from .reference import default_scale
from .runtime.plan import Plans


def _grad_enabled() -> bool:
    import torch

    return torch.is_grad_enabled()


def _validate(ops, phase, causal, scale, return_lse=False):
    q, k, v = ops
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal: expected True or False, got {causal!r}")
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse: expected True or False, got {return_lse!r}")
    if return_lse and not supports_lse(phase):
        raise ValueError(f"return_lse: phase {phase.ID} does not write the log-sum-exp; phases 07 on do "
                         f"(phase='best' picks one where the GPU runs it)")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale: expected a real number or None, got {type(scale).__name__}")
        if not math.isfinite(float(scale)):
            raise ValueError(f"scale: expected a finite number, got {float(scale)}")
    for op in (k, v):
        if op.kind != q.kind or op.device != q.device:
            where = {"numpy": "a NumPy (host) array", "numba": "a Numba device array",
                     "torch": "a torch tensor"}
            raise TypeError(f"{op.name}: all inputs must live together; q is {where[q.kind]} on {q.device} "
                            f"but {op.name} is {where[op.kind]} on {op.device}")
    for op in ops:
        if len(op.shape) != 4:
            raise ValueError(f"{op.name}: expected 4 dimensions (B, H, S, D), got shape {op.shape}")
    for op in ops:
        if 0 in op.shape:
            raise ValueError(f"{op.name}: empty input, shape {op.shape} has a zero-length dimension")
    allowed = phase_dtypes(phase)
    for op in ops:
        if op.dtype not in allowed:
            raise TypeError(f"{op.name}: expected dtype {' or '.join(allowed)} for phase {phase.ID}, "
                            f"got {op.dtype}")
    for op in (k, v):
        if op.dtype != q.dtype:
            raise TypeError(f"{op.name}: dtype {op.dtype} differs from q's {q.dtype}")
    for op in ops:
        if not op.contiguous:
            raise ValueError(f"{op.name}: expected a contiguous (row-major B, H, S, D) layout; "
                             f"make one with .contiguous() or np.ascontiguousarray")
    B, H, Sq, D = q.shape
    for op in (k, v):
        if op.shape[0] != B:
            raise ValueError(f"{op.name}: batch size {op.shape[0]} differs from q's {B} (shape {op.shape})")
        if op.shape[3] != D:
            raise ValueError(f"{op.name}: head dim {op.shape[3]} differs from q's {D} (shape {op.shape})")
    if v.shape[1:3] != k.shape[1:3]:
        raise ValueError(f"v: heads and length {v.shape[1:3]} differ from k's {k.shape[1:3]}")
    if k.shape[1] != H:
        if not supports_gqa(phase):
            raise ValueError(f"k: {k.shape[1]} heads differ from q's {H}; phase {phase.ID} needs equal "
                             f"head counts (grouped-query attention arrives with phase 07)")
        if H % k.shape[1]:
            raise ValueError(f"k: {k.shape[1]} key/value heads must divide q's {H} heads")
    if D not in phase.HEAD_DIMS:
        raise ValueError(f"q: head dim {D} is not supported by phase {phase.ID}; "
                         f"supported: {', '.join(map(str, phase.HEAD_DIMS))}")


def require_device(phase):
    """Fail early, with the fix, when there is nowhere to run the kernel."""
    if simulator_enabled():
        return
    from numba import cuda

    if not cuda.is_available():
        raise RuntimeError("no CUDA GPU is available; to run the kernels in Numba's simulator on the CPU, "
                           "set NUMBA_ENABLE_CUDASIM=1 before importing flashcore_numba")
    reason = cc_reason(phase, cuda.get_current_device().compute_capability)
    if reason:
        raise RuntimeError(f"{reason}; pass phase='best' for the fastest phase this GPU can run")


def best_for_this_gpu():
    """"best": the registry's best kernel, or on a GPU that cannot run it the newest phase it can."""
    best = get_phase("best")
    if simulator_enabled():
        return best
    from numba import cuda

    if not cuda.is_available():
        return best  # require_device says what to do
    cc = tuple(cuda.get_current_device().compute_capability)
    if cc_reason(best, cc) is None:
        return best
    runnable = [p for p in PHASES.values() if cc_reason(p, cc) is None and not getattr(p, "DECODE", False)]
    return max(runnable, key=lambda p: p.ID) if runnable else best


# Where "best" on the H100 (phase 09) hands over to phase 08: nowhere since commit e167d50. Its
# sweep records (docs/bench/*_sweep_*.json) have 09 ahead of 08 at every length, causal or not, D = 64
# and 128; the last point where 08 kept the work, D = 64 causal S = 512, went from level (182 and 183
# TFLOPS at 3c00a39) to 201 against 183 once phase 09 released Q at each block's last S.
# (head dim, causal) -> the most keys (S_k) at which phase 08 runs instead. tests/test_api.py checks
# the rule against every committed record: where it says 08, 08 was not slower, and where it says
# 09, 09 was not (points whose launches spread are left out).
SHORT_SEQUENCES_TO_08 = {}

# Where "best" hands the work to phase 10 (split keys): where each K/V head has at most DECODE_ROWS
# query rows (its group of query heads times S_q: the rows of one phase-10 block). Phases 07-09 give
# such a head a tile of 64 or 128 query rows that holds one to sixteen: with few K/V heads they leave
# SMs idle, with many they read each K/V head once per tile of mostly empty rows. Phase 10 packs the
# group's rows and splits each head's keys only where the batch leaves SMs idle (split_count). The
# H100's records (docs/bench/*s1k*_p*09-10.json) have it ahead of phase 09 with 8, 16, 512 and 2048
# K/V heads and level with 256 (MHA, B=8 H=32); tests/test_api.py checks the rule against every
# committed record that has both.
DECODE_ROWS = 16


def best_for_shape(phase, head_dim: int, causal: bool, seq_k: int, rows_per_kv_head: int):
    """The kernel "best" runs at this shape: phase 10 where each K/V head has few query rows
    (`rows_per_kv_head`, its query heads times S_q, at most DECODE_ROWS) and the GPU runs phase 10;
    else `phase` (the newest the GPU runs), or phase 08 where the records have it faster than phase
    09 (SHORT_SEQUENCES_TO_08)."""
    decode = PHASES["10"]
    if rows_per_kv_head <= DECODE_ROWS and tuple(min_cc(phase)) >= tuple(min_cc(decode)):
        return decode  # a GPU that runs `phase` runs phase 10 too
    if phase.ID == "09" and seq_k <= SHORT_SEQUENCES_TO_08.get((head_dim, bool(causal)), 0):
        return PHASES["08"]
    return phase


# ---------------------------------------------------------------------------------------------
# torch tensors: a plan per problem, and the custom op
# ---------------------------------------------------------------------------------------------
_PLANS = Plans()  # the key of a call (see _torch_call) -> its runtime.Plan
_BACKWARD_PLANS = Plans()  # the backward's plans (runtime/backward.py), by problem
_OP = None
_OP_LSE = None
_OP_TRAIN = None


def _torch_call(q, k, v, causal, scale, phase, return_lse=False):
    """attention() on torch tensors: the plan of this problem, made on its first call.

    This is the path a model's loop takes on every call, so each line here is paid per call
    (docs/tuning/call_path.md has what each costs): torch is imported once (inputs.torch_module), the
    stream comes from torch's raw accessor, and nothing is built that the plan already holds."""
    torch = torch_module()
    if torch.compiler.is_compiling():  # torch.compile traces the custom op, not the launch
        return _custom_op(return_lse)(q, k, v, causal, scale, phase if isinstance(phase, str) else str(phase))
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    # everything the validation looks at, so that a call with the same key passes as the first did
    # (devices by index: comparing two torch.device objects costs a microsecond each)
    try:
        key = (phase, type(causal), causal, type(scale), scale, grad, type(q), type(k), type(v), q.shape, k.shape,
               v.shape, q.dtype, k.dtype, v.dtype, q.get_device(), k.get_device(), v.get_device(), q.is_contiguous(),
               k.is_contiguous(), v.is_contiguous(), type(return_lse), return_lse)
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not a tensor, or unhashable: the validation says which, and how
        _resolve(q, k, v, causal, scale, phase, return_lse)
        raise
    if plan is None:
        plan = _PLANS.keep(key, make_plan(q, k, v, causal, scale, phase, return_lse))
    if plan is _NUMBA_LAUNCH:
        return _launch(q, k, v, causal, scale, phase, return_lse)
    out = torch.empty_like(q)  # q is contiguous (the key says so): so is out
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device) if return_lse else None
    plan(q, k, v, out, current_stream(plan.device_index), lse)  # in the device's context, from any thread
    return (out, lse) if return_lse else out


_NUMBA_LAUNCH = object()  # the plan of a problem that runs through Numba's own launch (the simulator)


def make_plan(q, k, v, causal, scale, phase, return_lse=False):
    """Validate the problem as a first call does (every message of `attention`), and plan it."""
    kernel, ops, qk_scale = _resolve(q, k, v, causal, scale, phase, return_lse)
    if simulator_enabled():
        return _NUMBA_LAUNCH
    from .runtime import Plan

    return Plan(kernel.ID, ops[0].shape[3], ops[0].dtype, ops[0].shape, ops[1].shape, bool(causal), qk_scale,
                q.device.index or 0, return_lse=bool(return_lse))


def _custom_op(return_lse: bool = False):
    """flashcore::attention (and flashcore::attention_lse, the call with return_lse=True, which
    returns the pair), registered on first use: what torch.compile sees of attention()."""
    global _OP, _OP_LSE
    if _OP is None:
        import torch

        # the schemas spelled out: this module's annotations are strings (from __future__ import annotations)
        args = "(Tensor q, Tensor k, Tensor v, bool causal, float? scale, str phase)"

        @torch.library.custom_op("flashcore::attention", mutates_args=(), schema=f"{args} -> Tensor")
        def attention_op(q, k, v, causal, scale, phase):
            return _torch_call(q, k, v, causal, scale, phase)

        @attention_op.register_fake
        def _(q, k, v, causal, scale, phase):
            return torch.empty_like(q)

        @torch.library.custom_op("flashcore::attention_lse", mutates_args=(), schema=f"{args} -> (Tensor, Tensor)")
        def attention_lse_op(q, k, v, causal, scale, phase):
            return _torch_call(q, k, v, causal, scale, phase, True)

        @attention_lse_op.register_fake
        def _(q, k, v, causal, scale, phase):
            return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)

        _OP, _OP_LSE = attention_op, attention_lse_op
    return _OP_LSE if return_lse else _OP


def _train_call(q, k, v, causal, scale, phase, return_lse, deterministic):
    """attention() on torch tensors that need gradients: the forward keeps O and the LSE, and
    backward() runs the backward kernels (phase 12's on Hopper, phase 11's elsewhere:
    autograd_backward_phase) through flashcore::attention_train."""
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic: expected True or False, got {deterministic!r}")
    # only an imported torch can be tracing this call: the phase is checked first, before torch is
    # imported, so that a phase without a backward is refused by name even where torch is absent
    torch = sys.modules.get("torch")
    if torch is not None and torch.compiler.is_compiling():  # traced: the op checks the phase when it runs
        out, lse = _train_op()(q, k, v, causal, scale, phase if isinstance(phase, str) else str(phase),
                               bool(deterministic))
    else:
        _require_backward(phase, q.device)
        out, lse = _train_function().apply(q, k, v, causal, scale, phase, bool(deterministic))
    return (out, lse) if return_lse else out


_BACKWARD_CHECKED: set = set()  # (phase, q's device) where _require_backward has passed


def _require_backward(phase, device=None) -> None:
    """A call that needs gradients must run a phase that writes the log-sum-exp: "best" does, unless
    the GPU is too old for phase 07. Checked before the call, and inside flashcore::attention_train,
    which runs eagerly even under torch.compile (numba's device queries cannot be traced). With the
    tensors' device given, a phase that passed for it once is not asked about again (the question
    costs about 9 us of Numba's device queries, docs/tuning/call_path.md run 11). Where a phase
    without the LSE slipped through, the forward's validation (return_lse) still refuses it."""
    key = (phase, device) if isinstance(phase, (str, int)) and device is not None else None
    if key in _BACKWARD_CHECKED:
        return
    resolved = best_for_this_gpu() if phase == "best" else get_phase(phase)
    if not supports_lse(resolved):
        raise ValueError(f"q: requires grad, but phase {resolved.ID} has no backward pass (the backward "
                         f"recomputes the softmax from the forward's log-sum-exp, which phases 07 on write); "
                         f"pick phase='best' or 07 on, or call it under torch.no_grad()")
    if key is not None:
        _BACKWARD_CHECKED.add(key)


_AUTOGRAD_BACKWARD: dict = {}  # device index -> the backward phase autograd runs there


def autograd_backward_phase(cc) -> str:
    """The backward phase attention()'s autograd runs on a GPU of compute capability `cc`: "12"
    (its kv_kernel on wgmma) on Hopper, where it is the faster (docs/tuning/12_history.md, the
    records under docs/bench/backward/), and "11" (mma.sync) on every other GPU from sm_80."""
    from .phases import backward_phase, cc_reason

    return "12" if cc_reason(backward_phase("12"), cc) is None else "11"


def attention_backward(q, k, v, out, lse, dout, dlse, causal, scale, deterministic, phase=None):
    """(dq, dk, dv) of q's dtype from the backward kernels (phases/p11_backward.py): dk and dv are
    written in q's dtype, dq is summed in float32 and converted here. The launches go through the
    problem's BackwardPlan (runtime/backward.py), made on its first backward: no Numba dispatch per
    call, every buffer from torch's caching allocator. phase: "11" or "12" (phase 12's kv_kernel,
    wgmma, Hopper only); None, as autograd calls it: the tensors' GPU's (autograd_backward_phase)."""
    torch = torch_module()
    device = q.device.index or 0
    if phase is None:  # as autograd calls it: the backward of the tensors' GPU, asked once per device
        if device not in _AUTOGRAD_BACKWARD:
            _AUTOGRAD_BACKWARD[device] = autograd_backward_phase(torch.cuda.get_device_capability(device))
        phase = _AUTOGRAD_BACKWARD[device]
    D = q.shape[-1]
    scale = default_scale(D) if scale is None else float(scale)
    # the kernels copy 16 bytes at a time: a tensor off a 16-byte boundary (autograd's gradient may be
    # a view) is copied to one that is not
    operands = [_on_16_bytes(x.detach().to(q.dtype).contiguous()) for x in (q, k, v, out, dout)]
    lse = lse.detach().float().contiguous()
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(operands[1]), torch.empty_like(operands[2])
    if q.shape[2] == 0 or k.shape[2] == 0:  # nothing to recompute: every gradient is 0
        return dq.zero_().to(q.dtype), dk.zero_(), dv.zero_()
    delta = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    key = (D, q.dtype, tuple(q.shape), tuple(k.shape), bool(causal), scale, bool(deterministic), dlse is not None,
           device, phase)
    plan = _BACKWARD_PLANS.get(key)
    if plan is None:
        from .runtime import BackwardPlan

        plan = _BACKWARD_PLANS.keep(key, BackwardPlan(D, str(q.dtype).replace("torch.", ""), tuple(q.shape),
                                                      tuple(k.shape), bool(causal), scale, bool(deterministic),
                                                      dlse is not None, device, phase))
    # deterministic=True with fewer (batch, K/V head) pairs than SMs: dQ summed in parts, in torch's memory
    sums = torch.empty((plan.parts, *q.shape), dtype=torch.float32, device=q.device) if plan.parts > 1 else None
    extra = None if dlse is None else dlse.detach().float().contiguous()
    # in the device's context, from any thread (autograd runs the backward on a thread of its own)
    plan(*operands, lse, dq, dk, dv, delta, current_stream(device), dq_sums=sums, dlse=extra)
    return dq.to(q.dtype), dk, dv


def _on_16_bytes(t):
    return t if t.data_ptr() % 16 == 0 else t.clone()


_FUNCTION = None


def _train_function():
    """attention()'s autograd in eager mode: a torch.autograd.Function around the forward and the
    backward that flashcore::attention_train and flashcore::attention_backward run under
    torch.compile. Eagerly, torch's custom-op machinery cost the host about 140 us of a forward with
    grad and 600 us of a forward and backward at B=1 H=16 S=128 D=64, where the launches take 12 and
    55 (docs/tuning/call_path.md run 11). A gradient that does not reach the loss comes as None (no
    materialized zeros): an unused lse costs the backward nothing."""
    global _FUNCTION
    if _FUNCTION is None:
        import torch

        class AttentionFunction(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v, causal, scale, phase, deterministic):
                out, lse = _torch_call(q, k, v, causal, scale, phase, True)  # grad is off in here
                ctx.save_for_backward(q, k, v, out, lse)
                ctx.causal, ctx.scale, ctx.deterministic = causal, scale, deterministic
                ctx.set_materialize_grads(False)
                return out, lse

            @staticmethod
            def backward(ctx, dout, dlse):
                if dout is None and dlse is None:
                    return (None,) * 7
                q, k, v, out, lse = ctx.saved_tensors
                dout = torch.zeros_like(out) if dout is None else dout.contiguous()  # only the lse was used
                grads = attention_backward(q, k, v, out, lse, dout, dlse, ctx.causal, ctx.scale, ctx.deterministic)
                return (*grads, None, None, None, None)

        _FUNCTION = AttentionFunction
    return _FUNCTION


def _train_op():
    """flashcore::attention_train, with its backward registered (flashcore::attention_backward):
    what a call that needs gradients runs under torch.compile (eagerly, `_train_function`)."""
    global _OP_TRAIN
    if _OP_TRAIN is None:
        import torch

        args = "(Tensor q, Tensor k, Tensor v, bool causal, float? scale, str phase, bool deterministic)"

        @torch.library.custom_op("flashcore::attention_train", mutates_args=(), schema=f"{args} -> (Tensor, Tensor)")
        def train_op(q, k, v, causal, scale, phase, deterministic):
            _require_backward(phase)
            with torch.no_grad():
                return _torch_call(q.detach(), k.detach(), v.detach(), causal, scale, phase, True)

        @train_op.register_fake
        def _(q, k, v, causal, scale, phase, deterministic):
            return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)

        @torch.library.custom_op("flashcore::attention_backward", mutates_args=(),
                                 schema="(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout, "
                                        "Tensor? dlse, bool causal, float? scale, bool deterministic) "
                                        "-> (Tensor, Tensor, Tensor)")
        def backward_op(q, k, v, out, lse, dout, dlse, causal, scale, deterministic):
            return attention_backward(q, k, v, out, lse, dout, dlse, causal, scale, deterministic)

        @backward_op.register_fake
        def _(q, k, v, out, lse, dout, dlse, causal, scale, deterministic):
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

        def setup_context(ctx, inputs, output):
            q, k, v, causal, scale, _, deterministic = inputs
            ctx.save_for_backward(q, k, v, *output)
            ctx.causal, ctx.scale, ctx.deterministic = causal, scale, deterministic

        def backward(ctx, dout, dlse):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = backward_op(q, k, v, out, lse, dout.contiguous(), dlse, ctx.causal, ctx.scale,
                                     ctx.deterministic)
            return dq, dk, dv, None, None, None, None

        train_op.register_autograd(backward, setup_context=setup_context)
        _OP_TRAIN = train_op
    return _OP_TRAIN


def _register_ops() -> None:
    _custom_op()
    _train_op()


def register_torch_op() -> None:
    """Register the ops (flashcore::attention and its LSE form; flashcore::attention_train and
    flashcore::attention_backward, what a compiled call that needs gradients runs) as soon as torch
    is imported: at once when it is, else right after its import (a one-shot import hook), never by
    importing it here. torch.compile cannot register an op while it traces, so the ops must exist
    before the first compiled call; eager calls do not register them (they run without them)."""
    if "torch" in sys.modules:
        _register_ops()
        return

    class AfterTorchImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "torch":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec("torch")
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def exec_and_register(module):
                    exec_module(module)
                    try:
                        _register_ops()
                    except Exception as e:  # noqa: BLE001 - never break the import of torch
                        warnings.warn(f"flashcore_numba: torch.compile will not see attention() as one op "
                                      f"({type(e).__name__}: {e})", stacklevel=2)

                spec.loader.exec_module = exec_and_register
            return spec

    if not any(type(f).__name__ == "AfterTorchImport" for f in sys.meta_path):
        sys.meta_path.insert(0, AfterTorchImport())


def _resolve(q, k, v, causal, scale, phase, return_lse=False):
    """(kernel, described operands, qk_scale) of a call, or the error that names its bad argument."""
    best = isinstance(phase, str) and phase == "best"
    phase = best_for_this_gpu() if best else get_phase(phase)
    ops = tuple(describe(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
    _validate(ops, phase, causal, scale, return_lse)
    _, H, S_q, D = ops[0].shape
    if best and not simulator_enabled():  # the simulator has no speed to choose by
        phase = best_for_shape(phase, D, causal, ops[1].shape[2], rows_per_kv_head=H // ops[1].shape[1] * S_q)
    require_device(phase)
    qk_scale = (default_scale(D) if scale is None else float(scale)) * LOG2E
    return phase, ops, qk_scale


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, phase="best",
              return_lse: bool = False, deterministic: bool = False):
    """softmax(q·kᵀ·scale [+ causal mask])·v for (B, H, S, D) fp16 or bf16 inputs, fp32 accumulation.

    Args:
        q: (B, H, S_q, D); k, v: (B, H, S_k, D). torch CUDA tensors, Numba device arrays or
           NumPy arrays, all of one kind, contiguous, fp16; bf16 torch tensors for the phases
           whose DTYPES list it (07 on). k and v may have fewer heads than q (grouped-query
           attention, H_q a multiple of H_kv) for phases that support it (07 on).
        causal: mask future keys; with S_q != S_k the mask is aligned to the bottom-right
           corner (query i sees keys j <= i + S_k - S_q), as in FlashAttention-2. A query
           that sees no key at all gets a zero output row.
           Infinities and NaN follow torch's scaled_dot_product_attention (docs/guide.md,
           "Infinities and NaN in the inputs"): a +inf or NaN score of a visible key makes its row
           NaN, a -inf score is a key of weight 0 (a row with only -inf scores gets zeros), inf or
           NaN in v[..., j, d] reaches column d of the rows that weigh key j, and masked keys are
           dropped before the softmax, as in SDPA's flash backend.
        scale: multiplier of q·kᵀ; default 1/sqrt(D).
        phase: which kernel of the ladder runs: "best" (default: the newest phase, built its
           fastest way; on a GPU too old for it, the newest phase the GPU can run; on the
           H100 phase 08 where the records have it faster, see SHORT_SEQUENCES_TO_08), an id
           such as "03" or 3, a build variant such as "06-inline", or a name such as "padding".
        return_lse: also return each row's log-sum-exp (phases 07 on): log(sum_j exp(q_i·k_j·scale))
           over the keys row i sees, natural log, as torch and FlashAttention define it; -inf
           for a row that sees no key (FlashAttention writes +inf there). It is what merges
           partial results over key ranges: outputs o_1, o_2 with LSEs l_1, l_2 combine into
           (exp(l_1 - l) o_1 + exp(l_2 - l) o_2) with l = logaddexp(l_1, l_2).
        deterministic: for torch tensors that require grad (phases 07 on): the backward sums dQ in
           a fixed order, so that the gradients are the same bit for bit on every run (a second
           pass over the keys instead of atomic additions; phases/p11_backward.py).
    Returns:
        (B, H, S_q, D) output of q's dtype, of the same kind as q; with return_lse, the pair
        (output, lse), lse a (B, H, S_q) float32 array of the same kind. Torch tensors that
        require grad (with grad enabled) give an output with a grad_fn: backward() computes dq,
        dk and dv (and takes the lse's gradient too, where it is used).
    """
    if is_torch(q):
        if (q.requires_grad or k.requires_grad or v.requires_grad) and _grad_enabled():
            return _train_call(q, k, v, causal, scale, phase, return_lse, deterministic)
        return _torch_call(q, k, v, causal, scale, phase, return_lse)
    return _launch(q, k, v, causal, scale, phase, return_lse)


def _launch(q, k, v, causal, scale, phase, return_lse=False):
    """Validate and launch through Numba: NumPy arrays, Numba device arrays, and the simulator."""
    phase, ops, qk_scale = _resolve(q, k, v, causal, scale, phase, return_lse)
    B, H, Sq, D = ops[0].shape
    config = build(phase, D, ops[0].dtype)
    kind = ops[0].kind

    if kind == "torch":
        import torch
        from numba import cuda

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device) if return_lse else None
        with cuda.gpus[q.device.index or 0]:
            stream = cuda.external_stream(torch.cuda.current_stream(q.device).cuda_stream)
            arrays = [torch_to_kernel(t) for t in (q, k, v, out)]
            config.launch(*arrays, causal, qk_scale, stream=stream,
                          lse=None if lse is None else cuda.as_cuda_array(lse))
        return (out, lse) if return_lse else out

    from numba import cuda

    lse = cuda.device_array((B, H, Sq), dtype=np.float32) if return_lse else None
    if kind == "numba":
        out = cuda.device_array(q.shape, dtype=q.dtype)
        config.launch(q, k, v, out, causal, qk_scale, lse=lse)
        return (out, lse) if return_lse else out

    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    dout = cuda.device_array(q.shape, dtype=q.dtype)
    config.launch(dq, dk, dv, dout, causal, qk_scale, lse=lse)
    return (dout.copy_to_host(), lse.copy_to_host()) if return_lse else dout.copy_to_host()

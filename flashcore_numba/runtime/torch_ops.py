"""What torch sees of attention(): the custom ops that torch.compile traces, the autograd Function
that an eager call with gradients runs, and the backward's call.

    custom_op          flashcore::attention and flashcore::attention_lse: attention() on torch
                       tensors as one op, so that a compiled model has no graph break there
    train_call         attention() on tensors that need gradients: eagerly a torch.autograd.Function,
                       under torch.compile flashcore::attention_train with its backward registered
                       (flashcore::attention_backward)
    attention_backward (dq, dk, dv) through the problem's BackwardPlan (backward.py): phase 13's
                       backward on Hopper (12's when deterministic), phase 11's elsewhere
                       (autograd_backward_phase)
    register_torch_op  the ops registered as soon as torch is imported, never by importing it here

The forward of every one of them is api.torch_call, the plan-based call of attention() on torch
tensors (plan.py), and a call that needs gradients is first checked by api.require_backward: api.py
hands both over (`connect`) when it is imported, since the runtime never imports the face above it.
api.py is the library's face; this module is its glue to torch's machinery.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

import numpy as np

from .inputs import current_stream, torch_module
from .plan import Plans

_BACKWARD_PLANS = Plans()  # the backward's plans (backward.py), by problem
_forward = None  # api.torch_call: attention() on torch tensors, the forward of every op here
_check_backward = None  # api.require_backward: refuses, by name, a phase without a backward
_OP = None
_OP_LSE = None
_OP_TRAIN = None


def connect(forward, check_backward) -> None:
    """api.py hands over its call on torch tensors (`forward`, api.torch_call) and its check of a
    phase that must have a backward (`check_backward`, api.require_backward) when it is imported:
    the ops and the autograd Function below run them, and the runtime never imports the face above it."""
    global _forward, _check_backward
    _forward, _check_backward = forward, check_backward


def custom_op(return_lse: bool = False):
    """flashcore::attention (and flashcore::attention_lse, the call with return_lse=True, which
    returns the pair), registered on first use: what torch.compile sees of attention()."""
    global _OP, _OP_LSE
    if _OP is None:
        import torch

        # the schemas spelled out: this module's annotations are strings (from __future__ import annotations)
        args = "(Tensor q, Tensor k, Tensor v, bool causal, float? scale, str phase)"

        @torch.library.custom_op("flashcore::attention", mutates_args=(), schema=f"{args} -> Tensor")
        def attention_op(q, k, v, causal, scale, phase):
            return _forward(q, k, v, causal, scale, phase)

        @attention_op.register_fake
        def _(q, k, v, causal, scale, phase):
            return q.new_empty((*q.shape[:-1], v.shape[-1]))  # v's head dim (MLA: other than q's)

        @torch.library.custom_op("flashcore::attention_lse", mutates_args=(), schema=f"{args} -> (Tensor, Tensor)")
        def attention_lse_op(q, k, v, causal, scale, phase):
            return _forward(q, k, v, causal, scale, phase, True)

        @attention_lse_op.register_fake
        def _(q, k, v, causal, scale, phase):
            return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:3], dtype=torch.float32)

        _OP, _OP_LSE = attention_op, attention_lse_op
    return _OP_LSE if return_lse else _OP


def train_call(q, k, v, causal, scale, phase, return_lse, deterministic):
    """attention() on torch tensors that need gradients: the forward keeps O and the LSE, and
    backward() runs the backward kernels (phase 13's on Hopper, 12's when deterministic, phase 11's
    elsewhere: autograd_backward_phase) through flashcore::attention_train."""
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic: expected True or False, got {deterministic!r}")
    # only an imported torch can be tracing this call: the phase is checked first, before torch is
    # imported, so that a phase without a backward is refused by name even where torch is absent
    torch = sys.modules.get("torch")
    if torch is not None and torch.compiler.is_compiling():  # traced: the op checks the phase when it runs
        out, lse = _train_op()(q, k, v, causal, scale, phase if isinstance(phase, str) else str(phase),
                               bool(deterministic))
    else:
        _check_backward(phase, q.device, q.shape[-1], v.shape[-1])
        out, lse = _train_function().apply(q, k, v, causal, scale, phase, bool(deterministic))
    return (out, lse) if return_lse else out


_AUTOGRAD_BACKWARD: dict = {}  # (device index, head dim, deterministic) -> the backward phase autograd runs there


def autograd_backward_phase(cc, head_dim: int | None = None, deterministic: bool = False) -> str:
    """The backward phase attention()'s autograd runs on a GPU of compute capability `cc` (for head
    dim `head_dim`, or any up to 128). On Hopper, up to phase 12's MAX_HEAD_DIM: "13" (phase 12's
    kernel, warp-specialized and fed by TMA), ahead of phase 12 at the four reference problems in
    the records under docs/bench/backward/ (rows 12 and 13); with deterministic=True "12", whose
    serial build is level with 13's or ahead there (rows 12-deterministic and 13-deterministic).
    "11" (mma.sync) past 128 and on every other GPU from sm_80."""
    from ..phases import backward_phase, cc_reason

    wgmma = backward_phase("12")
    fits = head_dim is None or wgmma.runs_head_dim(head_dim)
    if not fits or cc_reason(wgmma, cc) is not None:
        return "11"
    return "12" if deterministic else "13"


def attention_backward(q, k, v, out, lse, dout, dlse, causal, scale, deterministic, phase=None):
    """(dq, dk, dv) of q's dtype from the backward kernels (phases/p11_backward.py): dk and dv are
    written in q's dtype, dq is summed in float32 and converted here. The launches go through the
    problem's BackwardPlan (runtime/backward.py), made on its first backward: no Numba dispatch per
    call, every buffer from torch's caching allocator. phase: "11", "12" (phase 12's kv_kernel,
    wgmma, Hopper only) or "13" (phase 13's, warp-specialized, Hopper only); None, as autograd calls
    it: the tensors' GPU's (autograd_backward_phase).
    scale: the number the forward used (attention() resolves its default, 1/sqrt(D), before it).

    v of a head dim of its own (MLA: 128 beside q's and k's 192): the backward runs at the wider of
    the two, the narrower operands padded with zero columns, and the gradients are cut back to their
    inputs' widths (`_padded_backward`)."""
    if v.shape[-1] != q.shape[-1]:
        return _padded_backward(q, k, v, out, lse, dout, dlse, causal, scale, deterministic, phase)
    torch = torch_module()
    device = q.device.index or 0
    D = q.shape[-1]
    if phase is None:  # as autograd calls it: the backward of the tensors' GPU, asked once per device and D
        choice = (device, D, bool(deterministic))
        if choice not in _AUTOGRAD_BACKWARD:
            _AUTOGRAD_BACKWARD[choice] = autograd_backward_phase(torch.cuda.get_device_capability(device), D,
                                                                 bool(deterministic))
        phase = _AUTOGRAD_BACKWARD[choice]
    scale = float(scale)  # attention() resolves the default (1/sqrt(D)) before its forward
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
        from . import BackwardPlan  # looked up per plan made: a test stands one in

        plan = _BACKWARD_PLANS.keep(key, BackwardPlan(D, str(q.dtype).replace("torch.", ""), tuple(q.shape),
                                                      tuple(k.shape), bool(causal), scale, bool(deterministic),
                                                      dlse is not None, device, phase))
    # deterministic=True with fewer (batch, K/V head) pairs than SMs: dQ summed in parts, in torch's memory
    sums = torch.empty((plan.parts, *q.shape), dtype=torch.float32, device=q.device) if plan.parts > 1 else None
    extra = None if dlse is None else dlse.detach().float().contiguous()
    # in the device's context, from any thread (autograd runs the backward on a thread of its own)
    plan(*operands, lse, dq, dk, dv, delta, current_stream(device), dq_sums=sums, dlse=extra)
    return dq.to(q.dtype), dk, dv


def _padded_backward(q, k, v, out, lse, dout, dlse, causal, scale, deterministic, phase):
    """The backward of a problem whose v has a head dim of its own, as one of a single head dim W, the
    wider: zero columns added to q and k (the scores q·kᵀ do not change: the scale is the forward's,
    given) or to v, the output and its gradient (P·v's extra columns are zeros, and their gradient
    is zero: dP = dO vᵀ and Δ = rowsum(dO ∘ O) do not change). The gradients of the zero columns
    are cut off. The kernels then do the work of W columns where one operand has fewer: what MLA's
    backward costs here until a kernel takes the two widths (issue: every head dim)."""
    import torch.nn.functional as F

    D, Dv = q.shape[-1], v.shape[-1]
    W = max(D, Dv)

    def wide(x):
        return x if x.shape[-1] == W else F.pad(x.detach(), (0, W - x.shape[-1]))

    dq, dk, dv = attention_backward(wide(q), wide(k), wide(v), wide(out), lse, wide(dout), dlse, causal, scale,
                                    deterministic, phase)
    return dq[..., :D].contiguous(), dk[..., :D].contiguous(), dv[..., :Dv].contiguous()


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
                out, lse = _forward(q, k, v, causal, scale, phase, True)  # grad is off in here
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
            _check_backward(phase, None, q.shape[-1], v.shape[-1])
            with torch.no_grad():
                return _forward(q.detach(), k.detach(), v.detach(), causal, scale, phase, True)

        @train_op.register_fake
        def _(q, k, v, causal, scale, phase, deterministic):  # the output has v's head dim (MLA's may be its own)
            return q.new_empty((*q.shape[:3], v.shape[-1])), q.new_empty(q.shape[:3], dtype=torch.float32)

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
    custom_op()
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

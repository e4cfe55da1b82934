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
different (the key of `torch_call`), then fills in the pointers and launches on torch's current
stream. No host synchronization, no allocation outside torch's caching allocator: a call can be
captured in a CUDA graph. Under torch.compile the call is the custom op flashcore::attention
(`torch.ops.flashcore.attention`), so a compiled model has no graph break there; that op and
attention()'s autograd are runtime/torch_ops.py.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from .arch.sim import simulator_enabled
from .phases import (PHASES, VARIANTS, build, cc_reason, get_phase, head_dims_text, min_cc, supports_gqa,
                     supports_head_dim, supports_lse, supports_value_dim, unsupported_head_dim)
from .phases import dtypes as phase_dtypes
from .phases.common import LOG2E
from .phases.p11_backward import HEAD_DIMS_TEXT as BACKWARD_HEAD_DIMS_TEXT
from .phases.p11_backward import runs_head_dim as backward_runs_head_dim
from .reference import default_scale
from .runtime import torch_ops  # the torch glue (it calls back into this module: torch_call)
from .runtime.inputs import current_stream, describe, is_torch, torch_module, torch_to_kernel
from .runtime.plan import ALIGNMENT, Plans


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
    B, H, _, D = q.shape
    for op in (k, v):
        if op.shape[0] != B:
            raise ValueError(f"{op.name}: batch size {op.shape[0]} differs from q's {B} (shape {op.shape})")
    if k.shape[3] != D:
        raise ValueError(f"k: head dim {k.shape[3]} differs from q's {D} (shape {k.shape})")
    if v.shape[3] != D and not supports_value_dim(phase, D, v.shape[3]):  # (MLA: 07 and 09 take v's of its own)
        takes = ("takes one head dim for q, k and v" if not supports_value_dim(phase)
                 else f"does not take v's head dim {v.shape[3]} beside q's {D}")
        raise ValueError(f"v: head dim {v.shape[3]} differs from q's {D} (shape {v.shape}); phase {phase.ID} "
                         f"{takes} (phase 07 takes v's of its own: {head_dims_text(PHASES['07'])})")
    if v.shape[1:3] != k.shape[1:3]:
        raise ValueError(f"v: heads and length {v.shape[1:3]} differ from k's {k.shape[1:3]}")
    if k.shape[1] != H:
        if not supports_gqa(phase):
            raise ValueError(f"k: {k.shape[1]} heads differ from q's {H}; phase {phase.ID} needs equal "
                             f"head counts (grouped-query attention arrives with phase 07)")
        if H % k.shape[1]:
            raise ValueError(f"k: {k.shape[1]} key/value heads must divide q's {H} heads")
    for op in (q, v):
        if not supports_head_dim(phase, op.shape[3]):
            raise ValueError(unsupported_head_dim(op.name, op.shape[3], phase))


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


def best_for_this_gpu(head_dim=None, value_dim=None):
    """"best": the registry's best kernel, or on a GPU that cannot run it the newest phase it can.
    With `head_dim`, the newest of those built for it (phases.supports_head_dim), and with a `value_dim`
    (v's head dim) other than head_dim, for that pair (phases.supports_value_dim: 09 where its tiles
    take it, 07 otherwise); where none is, the answer without them (the validation says why)."""
    best = get_phase("best")
    cc = None
    if not simulator_enabled():
        from numba import cuda

        if cuda.is_available():  # (else require_device says what to do)
            cc = tuple(cuda.get_current_device().compute_capability)

    def built_for(p):  # the head dims asked for
        if head_dim is not None and not supports_head_dim(p, head_dim):
            return False
        return value_dim in (None, head_dim) or (supports_value_dim(p, head_dim, value_dim)
                                                  and supports_head_dim(p, value_dim))

    # best first, then the newest phases: those this GPU runs
    runnable = [p for p in (best, *sorted(PHASES.values(), key=lambda p: p.ID, reverse=True))
                if (cc is None or cc_reason(p, cc) is None) and not getattr(p, "DECODE", False)]
    return next((p for p in runnable if built_for(p)), runnable[0] if runnable else best)


_BACKWARD_CHECKED: set = set()  # (phase, q's device) where require_backward has passed


def require_backward(phase, device=None, head_dim=None, value_dim=None) -> None:
    """A call that needs gradients must run a phase that writes the log-sum-exp: "best" does, unless
    the GPU is too old for phase 07. Checked before the call, and inside flashcore::attention_train
    (runtime/torch_ops.py), which runs eagerly even under torch.compile (numba's device queries
    cannot be traced). With the
    tensors' device given, a phase that passed for it once is not asked about again (the question
    costs about 9 us of Numba's device queries, docs/tuning/call_path.md run 11). Where a phase
    without the LSE slipped through, the forward's validation (return_lse) still refuses it. With
    `head_dim`, it must be one the backward builds (phase 11: any multiple of 8 up to 256),
    and v's (`value_dim`) too: v of a head dim of its own (MLA) runs the backward at the wider of
    the two (torch_ops.attention_backward pads the narrower operands with zero columns)."""
    for name, dim in (("q", head_dim), ("v", value_dim)):
        if dim is not None and not backward_runs_head_dim(dim):
            # the same head dims as the forward's phases 07-10: refused here, before any forward runs
            raise ValueError(f"{name}: requires grad, but the backward takes head dims {BACKWARD_HEAD_DIMS_TEXT}, "
                             f"not {dim}")
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


def best_for_shape(phase, head_dim: int, causal: bool, seq_k: int, rows_per_kv_head: int, kv_heads: int = 1):
    """The kernel "best" runs at this shape: phase 10 where each K/V head has few query rows
    (`rows_per_kv_head`, its query heads times S_q, at most DECODE_ROWS) and the GPU runs phase 10,
    built as its variant "batch" where the row tiles of the batch's `kv_heads` (B x H_kv) fill the
    GPU (p10.batch_fills_gpu); else `phase` (the newest the GPU runs), or phase 08 where the records
    have it faster than phase 09 (SHORT_SEQUENCES_TO_08)."""
    decode = PHASES["10"]
    if (rows_per_kv_head <= DECODE_ROWS and tuple(min_cc(phase)) >= tuple(min_cc(decode))
            and supports_head_dim(decode, head_dim)):  # a GPU that runs `phase` runs phase 10 too
        return VARIANTS["10-batch"] if decode.batch_fills_gpu(kv_heads, rows_per_kv_head) else decode
    if phase.ID == "09" and seq_k <= SHORT_SEQUENCES_TO_08.get((head_dim, bool(causal)), 0):
        return PHASES["08"]
    return phase


# ---------------------------------------------------------------------------------------------
# torch tensors: a plan per problem (the custom ops and autograd around it: runtime/torch_ops.py)
# ---------------------------------------------------------------------------------------------
_PLANS = Plans()  # the key of a call (see torch_call) -> its runtime.Plan


def torch_call(q, k, v, causal, scale, phase, return_lse=False):
    """attention() on torch tensors: the plan of this problem, made on its first call.

    This is the path a model's loop takes on every call, so each line here is paid per call
    (docs/tuning/call_path.md has what each costs): torch is imported once (inputs.torch_module), the
    stream comes from torch's raw accessor, and nothing is built that the plan already holds."""
    torch = torch_module()
    if torch.compiler.is_compiling():  # torch.compile traces the custom op, not the launch
        return torch_ops.custom_op(return_lse)(q, k, v, causal, scale, phase if isinstance(phase, str) else str(phase))
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
    # q is contiguous (the key says so): so is out; v's head dim where it has one of its own (MLA)
    out = torch.empty_like(q) if plan.out_shape is None else q.new_empty(plan.out_shape)
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
                q.device.index or 0, return_lse=bool(return_lse), value_dim=ops[2].shape[3])


def _resolve(q, k, v, causal, scale, phase, return_lse=False):
    """(kernel, described operands, qk_scale) of a call, or the error that names its bad argument."""
    best = isinstance(phase, str) and phase == "best"
    if not best:
        phase = get_phase(phase)
    ops = tuple(describe(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
    if best:  # the newest phase the GPU runs that is built for q's head dim (and v's)
        dims = [op.shape[-1] if len(op.shape) == 4 else None for op in (ops[0], ops[2])]
        phase = best_for_this_gpu(*dims)
    _validate(ops, phase, causal, scale, return_lse)
    _, H, S_q, D = ops[0].shape
    if best and not simulator_enabled():  # the simulator has no speed to choose by
        phase = best_for_shape(phase, D, causal, ops[1].shape[2], rows_per_kv_head=H // ops[1].shape[1] * S_q,
                               kv_heads=ops[0].shape[0] * ops[1].shape[1])
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
            shape = getattr(q, "shape", ())
            if scale is None and len(shape):  # the backward takes the number the forward used
                scale = default_scale(shape[-1])
            return torch_ops.train_call(q, k, v, causal, scale, phase, return_lse, deterministic)
        return torch_call(q, k, v, causal, scale, phase, return_lse)
    return _launch(q, k, v, causal, scale, phase, return_lse)


_ARRAY_PLANS = Plans()  # attention() on NumPy and Numba arrays on a GPU: the plans, by problem


def _launch(q, k, v, causal, scale, phase, return_lse=False):
    """attention() on NumPy arrays and Numba device arrays: validated, then on a GPU the problem's plan,
    as torch tensors get (runtime/plan.py: the driver's launch on the default stream, the plan's
    memory Numba's; NumPy arrays copied to the device and the output back). The simulator has no
    driver: there, and for torch tensors there, Numba's launch."""
    phase, ops, qk_scale = _resolve(q, k, v, causal, scale, phase, return_lse)
    if simulator_enabled():
        return _simulated(q, k, v, causal, phase, ops, qk_scale, return_lse)
    from numba import cuda

    from .runtime import Plan
    from .runtime.inputs import DeviceArray

    B, H, S_q, D = ops[0].shape
    Dv = ops[2].shape[3]  # the output's head dim: v's (MLA: other than q's)
    device_index = cuda.get_current_device().id
    # the problem as Plan takes it: every argument but the memory's owner
    problem = (phase.ID, D, ops[0].dtype, ops[0].shape, ops[1].shape, bool(causal), qk_scale, device_index,
               bool(return_lse), Dv)
    plan = _ARRAY_PLANS.get(problem)
    if plan is None:
        plan = _ARRAY_PLANS.keep(problem, Plan(*problem, torch_memory=False))
    host = ops[0].kind == "numpy"
    with cuda.gpus[device_index]:
        if host:
            q, k, v = (cuda.to_device(x) for x in (q, k, v))
        out = cuda.device_array((B, H, S_q, Dv), dtype=np.dtype(ops[0].dtype))
        lse = cuda.device_array((B, H, S_q), dtype=np.float32) if return_lse else None
        plan(DeviceArray(q), DeviceArray(k), DeviceArray(v), DeviceArray(out), 0,
             None if lse is None else DeviceArray(lse))
        if host:
            out, lse = out.copy_to_host(), None if lse is None else lse.copy_to_host()
    return (out, lse) if return_lse else out


def _simulated(q, k, v, causal, phase, ops, qk_scale, return_lse):
    """The simulator's launch: Numba's, of the phase's build (NumPy, Numba and torch arrays)."""
    B, H, Sq, D = ops[0].shape
    Dv = ops[2].shape[3]
    config = build(phase, D, ops[0].dtype, value_dim=Dv)
    from numba import cuda

    if ops[0].kind == "torch":
        import torch

        out = torch.empty((B, H, Sq, Dv), dtype=q.dtype, device=q.device)
        lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device) if return_lse else None
        arrays = [torch_to_kernel(t) for t in (q, k, v, out)]
        config.launch(*arrays, causal, qk_scale, lse=None if lse is None else cuda.as_cuda_array(lse))
        return (out, lse) if return_lse else out
    host = ops[0].kind == "numpy"
    if host:
        q, k, v = (cuda.to_device(x) for x in (q, k, v))
    out = cuda.device_array((B, H, Sq, Dv), dtype=q.dtype)
    lse = cuda.device_array((B, H, Sq), dtype=np.float32) if return_lse else None
    config.launch(q, k, v, out, causal, qk_scale, lse=lse)
    if host:
        out, lse = out.copy_to_host(), None if lse is None else lse.copy_to_host()
    return (out, lse) if return_lse else out


def flex_attention(q, k, v, score_mod=None, block_mask=None, *, mask_mod=None,
                   scale: float | None = None, return_lse: bool = False, phase: str | None = None,
                   deterministic: bool = False):
    """Attention with your mods, as torch's flex_attention takes them: softmax(score_mod(q·kᵀ·scale))
    over the keys the mask leaves, times v, for (B, H, S, D) fp16 or bf16 inputs (k and v may have
    fewer heads: grouped-query attention); a row that sees no key gives zeros (and an LSE of -inf).

    score_mod: a ScoreMod (flex.score_mod, or a built-in: softcap, alibi) or a plain function
        score_mod(score, b, h, q_idx, kv_idx); None: the scores as they are.
    block_mask: from create_block_mask, made once and reused: its mask decides which keys a row
        sees, its tiles which the kernel skips. One at other block sizes than the kernel's tiles is
        made again at the kernel's (once per block mask and head dim). Or mask_mod=: the block
        mask is made here from it, per call, for every batch and head, on the GPU where the inputs
        are (give a block_mask made with B=None or H=None when the mask does not depend on them,
        to make it once and smaller).
    scale: the scores' factor, 1/sqrt(D) by default. return_lse: also each row's log-sum-exp.
    phase: the kernel the mods go into, "09" (Hopper: TMA, wgmma) or "07" (any GPU from sm_80);
    None: 09 where the GPU runs it, else 07 (and 07 in the simulator, where 09 is slow).
    deterministic: on torch tensors that require grad, the backward sums dQ in a fixed order
    (phase 11's serial build of kv_kernel, as attention()'s deterministic=True): the same bits every
    run; the forward is deterministic either way.

    The kernel is phase 14's (phases/p14_flex.py), compiled once per mods' functions, head dim,
    dtype and phase, and kept in the kernel cache by the mods' fingerprints (their bound arrays are arguments:
    new values need no compile). NumPy
    arrays, Numba device arrays and torch CUDA tensors; in the simulator on the CPU too."""
    from numba import cuda

    from . import flex
    from .phases import p14_flex as p14
    from .runtime.inputs import DeviceArray

    if is_torch(q) and _grad_enabled() and any(getattr(x, "requires_grad", False) for x in (q, k, v)):
        return _flex_with_grad(q, k, v, score_mod, block_mask, mask_mod, scale, return_lse, phase, deterministic)
    ops = tuple(describe(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
    _validate(ops, PHASES["07"], False, scale, return_lse)  # phase 14's first build: phase 07's inputs
    B, H, S_q, D = ops[0].shape
    S_k = ops[1].shape[2]
    if ops[2].shape[3] != D:
        raise ValueError(f"v: head dim {ops[2].shape[3]} differs from q's {D}; flex_attention takes one head dim")
    smod = None if score_mod is None else flex.score_mod(score_mod)
    if block_mask is not None and mask_mod is not None:
        raise ValueError("mask_mod: give either a block_mask or a mask_mod, not both")
    if block_mask is not None and not isinstance(block_mask, flex.BlockMask):
        raise TypeError(f"block_mask: expected a BlockMask (flex.create_block_mask), got {type(block_mask).__name__}")
    if block_mask is not None and (block_mask.seq_q, block_mask.seq_k) != (S_q, S_k):
        raise ValueError(f"block_mask: made for {block_mask.seq_q} query rows and {block_mask.seq_k} keys, "
                         f"but q has {S_q} and k {S_k}")
    mmod = block_mask.mask if block_mask is not None else (None if mask_mod is None else flex.mask_mod(mask_mod))
    base = _flex_base(phase)
    tile = p14.tiles(D, base)
    on_gpu = ops[0].kind != "numpy" and not simulator_enabled()  # (in the simulator NumPy is the faster)
    kinds = flex.kernel_kinds(block_mask, mmod, B, H, S_q, S_k, tile["block_m"], tile["block_n"], on_gpu)
    config = p14.build_for(D, ops[0].dtype, smod, mmod, base)
    qk_scale = np.float32((default_scale(D) if scale is None else float(scale)) * LOG2E)
    torch_inputs = ops[0].kind == "torch"
    if ops[0].kind != "numpy" and not simulator_enabled():  # the kernel copies 16 bytes at a time
        for name, x in (("q", q), ("k", k), ("v", v)):
            offset = (x.data_ptr() if torch_inputs else x.__cuda_array_interface__["data"][0]) % ALIGNMENT
            if offset:
                raise ValueError(f"{name}: its address is {offset} bytes past a {ALIGNMENT}-byte boundary; the "
                                 f"kernel copies {ALIGNMENT} bytes at a time, so each input must start on one (a "
                                 f"fresh tensor, or .clone(), does)")
    device = (q.device.index or 0) if torch_inputs else getattr(cuda.get_current_device(), "id", 0)  # (simulator: 0)
    # the block mask's lists and the mods' arrays on the device, kept from the first call: a call
    # copies nothing to the GPU (a copy from pageable memory would wait for the work queued there)
    if base == "09":  # (phase 09's walk: the tiles that need no mask first, p14.hopper_lists)
        lists = _kept(kinds, device, lambda: tuple(cuda.to_device(x) for x in (
            *p14.hopper_lists(kinds, S_k, tile["block_n"]), kinds)), "09")
    else:
        lists = _kept(kinds, device, lambda: tuple(cuda.to_device(x) for x in (*p14.block_lists(kinds), kinds)))
    # (a mod without arrays, made anew from a plain function each call, shares one stand-in array)
    score_args = _kept(smod if smod is not None and smod.arrays else None, device,
                       lambda: _bound_arrays(smod, ops[0], "score_mod"))
    mask_args = _kept(mmod if mmod is not None and mmod.arrays else None, device,
                      lambda: _bound_arrays(mmod, ops[0], "mask_mod"))
    if torch_inputs:
        import torch

        out = torch.empty((B, H, S_q, D), dtype=q.dtype, device=q.device)
        lse = torch.empty((B, H, S_q) if return_lse else (0, 0, 0), dtype=torch.float32, device=q.device)
    else:
        if ops[0].kind == "numpy":
            q, k, v = (cuda.to_device(x) for x in (q, k, v))
        out = cuda.device_array((B, H, S_q, D), dtype=q.dtype)
        lse = cuda.device_array((B, H, S_q) if return_lse else (0, 0, 0), dtype=np.float32)
    identity = p14.cache_identity(D, ops[0].dtype, smod, mmod, base)
    tail = (*lists, score_args, mask_args)
    if simulator_enabled():
        _flex_launch_in_simulator(config, base, (q, k, v, out, lse), qk_scale, tail, identity)
    else:  # a plan per problem (runtime/flex.py): the driver's launch, on torch's current stream
        from .runtime.flex import flat_arrays

        flat = flat_arrays(tail)
        plan = _flex_plan(config, base, identity, ops, qk_scale, tail, flat, device, bool(return_lse), torch_inputs)
        if torch_inputs:
            plan(q, k, v, out, lse, flat, current_stream(device))
        else:
            plan(*(DeviceArray(x) for x in (q, k, v, out, lse)), flat, 0)
    if not torch_inputs and ops[0].kind == "numpy":
        out, lse = out.copy_to_host(), lse.copy_to_host()
    return (out, lse) if return_lse else out


_FLEX_FUNCTION = None  # the torch.autograd.Function of flex_attention with gradients (_flex_with_grad)


def _flex_with_grad(q, k, v, score_mod, block_mask, mask_mod, scale, return_lse, phase, deterministic=False):
    """flex_attention on torch tensors that need gradients: the forward as without them (its LSE
    kept), and a backward through phase 11's kernels with the same mods compiled in
    (p14_flex.backward_for: dS = P ∘ (dP − Δ) ∘ the score mod's grad; each key block against the
    query rows its block mask leaves, backward_rows; deterministic: its serial build, dQ summed in
    order), launched by Numba on torch's current stream. A score mod
    without its grad is refused here, by name, before anything runs. The LSE, if returned, is
    outside the graph (its gradient is not taken)."""
    import torch

    from . import flex
    from .phases import p11_backward as p11
    from .phases import p14_flex as p14

    smod = None if score_mod is None else flex.score_mod(score_mod)
    if smod is not None and smod.grad is None:
        raise ValueError(f"score_mod {smod.name}: gradients through it need its derivative by the score: "
                         f"flex.score_mod(fn, ..., grad=fn_grad) (the built-ins have theirs)")
    D = q.shape[-1]
    if not p11.runs_head_dim(D):
        raise ValueError(f"q: head dim {D}: the backward takes {p11.HEAD_DIMS_TEXT}")
    global _FLEX_FUNCTION
    if _FLEX_FUNCTION is None:
        class FlexFunction(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v, forward, backward):
                out, lse = forward(q, k, v)
                ctx.save_for_backward(q, k, v, out, lse)
                ctx.backward_call = backward
                ctx.mark_non_differentiable(lse)
                return out, lse

            @staticmethod
            def backward(ctx, dout, dlse):
                return (*ctx.backward_call(*ctx.saved_tensors, dout), None, None)

        _FLEX_FUNCTION = FlexFunction

    def forward(q, k, v):
        with torch.no_grad():
            return flex_attention(q, k, v, score_mod=smod, block_mask=block_mask, mask_mod=mask_mod, scale=scale,
                                  return_lse=True, phase=phase)

    def backward(q, k, v, out, lse, dout):
        from numba import cuda

        mmod = block_mask.mask if block_mask is not None else (None if mask_mod is None else flex.mask_mod(mask_mod))
        dtype = str(q.dtype).replace("torch.", "")
        bw = p14.backward_for(D, dtype, smod, mmod)
        device = q.device.index or 0
        args = tuple(_kept(m if m is not None and m.arrays else None, device,
                           lambda m=m: _bound_arrays(m, describe("q", q), m.kind if m is not None else "mod"))
                     for m in (smod, mmod))
        # the block mask at kv_kernel's tiles: the query rows it visits for each key block, and which
        # tiles are full (no mask_mod there)
        B, H, S_q, _ = q.shape
        block_m, block_n = bw.kv["STREAM_ROWS"], bw.kv["OWN_ROWS"]
        kinds = flex.kernel_kinds(block_mask, mmod, B, H, S_q, k.shape[2], block_m, block_n, True)
        tiles = _kept(kinds, device, lambda: (cuda.to_device(p14.backward_rows(kinds, H // k.shape[1], S_q, block_m)),
                                              cuda.to_device(np.ascontiguousarray(kinds))), "backward")
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        delta = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        # (deterministic: the parts of dQ summed in order, in torch's memory: one of Numba's would be
        # freed by cuMemFree, which waits for the whole GPU)
        parts = bw.dq_parts(B, k.shape[1], k.shape[2], True) if deterministic else 1
        sums = torch.empty((parts, *q.shape), dtype=torch.float32, device=q.device) if parts > 1 else None
        with cuda.gpus[device]:
            stream = cuda.external_stream(current_stream(device))
            arrays = [torch_to_kernel(x) for x in (q, k, v, out, dout.contiguous())]
            bw.run(*arrays, cuda.as_cuda_array(lse), cuda.as_cuda_array(dq), torch_to_kernel(dk),
                   torch_to_kernel(dv), False, float(default_scale(D) if scale is None else scale), deterministic,
                   stream=stream, delta=cuda.as_cuda_array(delta), mod_args=(*args, tiles), parts=parts,
                   dq_sums=None if sums is None else cuda.as_cuda_array(sums))
        return dq.to(q.dtype), dk, dv

    out, lse = _FLEX_FUNCTION.apply(q, k, v, forward, backward)
    return (out, lse) if return_lse else out


_FLEX_PLANS = Plans()  # flex_attention's plans, by problem (_flex_plan)


def _flex_plan(config, base, identity, ops, qk_scale, tail, flat, device, return_lse, torch_inputs):
    """The FlexPlan of this problem: the build (config, which holds the mods' code), the shapes and
    dtypes of the inputs and of the tail's arrays (flat: flat_arrays(tail)), the scale; made on the
    first call."""
    from .runtime.flex import FlexPlan

    key = (id(config), identity, base, tuple(op.shape for op in ops), ops[0].dtype, return_lse, float(qk_scale),
           device, torch_inputs, tuple((a.shape, a.dtype.str) for a in flat),
           tuple(len(t) for t in tail[-2:]))
    plan = _FLEX_PLANS.get(key)
    if plan is None:
        plan = _FLEX_PLANS.keep(key, FlexPlan(base, config, identity, ops[0].dtype, *(op.shape for op in ops),
                                              qk_scale, tail, device, return_lse, torch_memory=torch_inputs))
    return plan


def _flex_launch_in_simulator(config, base, arrays, qk_scale, tail, identity) -> None:
    """Phase 14's launch through Numba's dispatcher: the simulator's (a GPU call takes a FlexPlan).
    arrays: q, k, v, out and lse, NumPy-like device arrays."""
    from .phases.common import launch

    arrays = list(arrays)
    if base == "07":
        arrays[3] = arrays[3].view(np.uint32)  # the kernel stores O as packed pairs
    B, H, S_q, D = arrays[0].shape
    if base == "09":  # phase 09's arguments (its tensor maps and work counter), then the tail
        args = config.arguments(*arrays[:4], False, qk_scale, 0, arrays[4])
        launch(config.kernel, config.grid((B, H, S_q, D), False), config.n_threads, config.smem_bytes,
               (*args, *tail), 0, identity)
    else:
        launch(config.kernel, (-(-S_q // config.block_m), H, B), config.n_threads, config.smem_bytes,
               (*arrays, qk_scale, *tail), 0, identity)


def _flex_base(phase: str | None) -> str:
    """The phase flex_attention's mods go into: the one asked for, or 09 where this GPU runs it, else
    07 (in the simulator 07: phase 09 there is a slow emulation of TMA and wgmma)."""
    from .phases import p14_flex as p14

    if phase is not None:
        if phase not in p14.BASES:
            raise ValueError(f"phase: flex_attention runs on phase {' or '.join(p14.BASES)}, not {phase!r}")
        if not simulator_enabled():
            require_device(PHASES[phase])
        return phase
    if simulator_enabled():
        return "07"
    from numba import cuda

    if cuda.is_available() and cc_reason(PHASES["09"], cuda.get_current_device().compute_capability) is None:
        return "09"
    return "07"


_KEPT: dict = {}  # (id of a block mask's kinds or a mod, device) -> (it, its arrays on the device)
_KEPT_AT_MOST = 64


def _kept(obj, device: int, make, tag: str = ""):
    """What `make()` puts on the device for `obj` (the block lists of a kinds array, a mod's bound
    arrays), made on the first call with that object and kept while it is among the last few;
    `tag` tells apart two things made for one object (phase 07's lists and phase 09's)."""
    key = (id(obj), device, tag)
    found = _KEPT.get(key)
    if found is None or found[0] is not obj:
        if len(_KEPT) >= _KEPT_AT_MOST:
            _KEPT.clear()
        found = _KEPT[key] = (obj, make())
    return found[1]


def _bound_arrays(mod, q, kind: str) -> tuple:
    """A mod's bound arrays as the kernel takes them (flex.device_arrays), on q's device: a torch
    tensor elsewhere is refused by the mod's name."""
    from . import flex

    if mod is None or not mod.arrays:
        return flex.device_arrays(flex.Mod(None))
    for i, a in enumerate(mod.arrays):
        if hasattr(a, "detach") and (q.kind != "torch" or str(a.device) != str(q.device)):
            raise ValueError(f"{kind} {mod.name}: bound array {i} is a torch tensor on {a.device}, but q is on "
                             f"{q.device}; move it there (.to(q.device))")
    return flex.device_arrays(mod)


torch_ops.connect(torch_call, require_backward)  # the custom ops and autograd run this module's call

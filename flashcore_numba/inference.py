"""attention_kvcache: a decode step (or a few drafted rows) against a KV cache, contiguous or paged.

Phase 10's kernel (phases/p10_split_keys.py), built `paged`: the keys of each sequence are split
across blocks and merged by their log-sum-exps, each sequence with its own length. The names and
layouts are FlashAttention's `flash_attn_with_kvcache`, so that a caller can switch:

    q              (B, S_q, H, D)                    fp16, or bf16 (torch)
    k_cache        (B, S_max, H_kv, D)               contiguous: sequence b's keys are k_cache[b]
                   (num_pages, page_size, H_kv, D)   paged: with block_table
    v_cache        as k_cache
    cache_seqlens  (B,) int32                        keys of each sequence, 0 .. its capacity
    block_table    (B, max_pages) int32              paged: page i of sequence b is block_table[b, i]
    out            (B, S_q, H, D), q's dtype; with return_lse also lse (B, H, S_q) float32

With `causal`, query row i of a sequence of length L sees keys j <= L - S_q + i (the rows are the
last S_q positions of the sequence, as in FlashAttention). Where it differs from
flash_attn_with_kvcache: it reads the cache and never writes it (there are no k, v arguments to
append: write the new keys into the cache first); no rotary embedding, sliding window, ALiBi or
softcap; the page size may be any multiple of 16 (FlashAttention-2 asks for multiples of 256); a row
that sees no key (a sequence of length 0) gives zeros and an LSE of -inf (FlashAttention: +inf).

A contiguous cache is the paged kernel with one page per sequence, page b being k_cache[b].

attention_varlen: sequences of their own lengths packed end to end, as FlashAttention's
`flash_attn_varlen_func` takes them, with no work spent on padding:

    q              (total_q, H, D)       sequence b's rows are q[cu_seqlens_q[b] : cu_seqlens_q[b + 1]]
    k, v           (total_k, H_kv, D)    and its keys k[cu_seqlens_k[b] : cu_seqlens_k[b + 1]]; v's head dim
                                         may be its own, D_v (MLA's 128 beside 192)
    cu_seqlens_q   (B + 1,) int32        0, then the running total of the lengths (so for _k)
    max_seqlen_q   int                   the longest sequence's rows (sizes the grid; max_seqlen_k is checked)
    out            (total_q, H, D_v), q's dtype; with return_lse also lse (H, total_q) float32

With `causal`, the mask is aligned to each sequence's last key (bottom-right), as FlashAttention
2.1 on. It runs phase 09's kernel (phase="best" where the GPU runs it, else 07's; or phase="07" or
"09") built `varlen`: only where a head's rows lie (H x D elements apart) and each sequence's lengths
differ; phase 09 passes over the query blocks past a sequence's rows. Where it differs from flash_attn_varlen_func: the scale is named
`scale` (softmax_scale there); no dropout, window, ALiBi or softcap; a sequence with no key gives
zeros and an LSE of -inf.
"""

from __future__ import annotations

import math
import os

import numpy as np

from . import api
from .arch import tma
from .arch.sim import simulator_enabled
from .runtime.inputs import DeviceArray, current_stream, describe, is_torch, torch_module
from .phases import (PHASES, build_kvcache, build_varlen, head_dims_text, supports_head_dim, supports_value_dim,
                     unsupported_head_dim)
from .phases import p07_mma_sync as p07
from .phases import p10_split_keys as p10
from .phases.common import LOG2E, cdiv, no_lse, split_workspace
from .phases.common import launch as launch_kernel  # (the launchers below name their closures `launch`)
from .reference import default_scale
from .runtime.plan import Plans

PAGE_MULTIPLE = 16
# FLASHCORE_VALIDATE=1: every call checks the index arrays' values on the host (validate=True)
VALIDATE = os.environ.get("FLASHCORE_VALIDATE", "0") not in ("", "0")
_PLANS = Plans()  # attention_kvcache's and attention_varlen's plans on torch tensors, by the key of a call


def _host_ints(x):
    """An int32 index array's values on the host, to check them (validate=True: a copy from the GPU,
    which waits for it; none while a CUDA graph is being captured, where the check is skipped)."""
    if is_torch(x):
        torch = torch_module()
        if torch.cuda.is_current_stream_capturing():
            return None
        return x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return x
    return x.copy_to_host()


def _index_array(name: str, x, shape_text: str, ndim: int, like) -> tuple:
    """Check an int32 index array (cache_seqlens, block_table): kind, dtype, dimensions; its shape."""
    kind = "torch" if is_torch(x) else "numpy" if isinstance(x, np.ndarray) else "numba"
    if kind != like.kind:
        raise TypeError(f"{name}: must be of the same kind as q ({like.kind}), got {type(x).__name__}")
    dtype = str(x.dtype).replace("torch.", "")
    if dtype != "int32":
        raise TypeError(f"{name}: expected int32 {shape_text}, got {dtype}")
    shape = tuple(x.shape)
    if len(shape) != ndim:
        raise ValueError(f"{name}: expected {shape_text}, got shape {shape}")
    if kind == "torch" and (str(x.device) != like.device or not x.is_contiguous()):
        raise ValueError(f"{name}: expected a contiguous tensor on {like.device}, got one on {x.device}"
                         f"{'' if x.is_contiguous() else ', not contiguous'}")
    return shape


def _check_flags(causal, scale, return_lse):
    for name, flag in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name}: expected True or False, got {flag!r}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)):
            raise TypeError(f"scale: expected a real number or None, got {type(scale).__name__}")
        if not math.isfinite(float(scale)):
            raise ValueError(f"scale: expected a finite number, got {float(scale)}")


def _operands(named, ndim: int, phase):
    """Describe q and its companions (inputs.describe) and check them together: one kind and device,
    `ndim` dimensions, contiguous, one 16-bit dtype, a head dim the phase builds."""
    ops = [describe(name, x) for name, x in named]
    qd = ops[0]
    for op in ops:
        if op.kind != qd.kind or op.device != qd.device:
            raise TypeError(f"{op.name}: must live with q ({qd.kind} on {qd.device}), got {op.kind} on {op.device}")
        if len(op.shape) != ndim:
            raise ValueError(f"{op.name}: expected {ndim} dimensions, got shape {op.shape}")
        if 0 in op.shape[1:] or (ndim == 4 and op.shape[0] == 0):
            raise ValueError(f"{op.name}: empty input, shape {op.shape} has a zero-length dimension")
        if not op.contiguous:
            raise ValueError(f"{op.name}: expected a contiguous layout; make one with .contiguous()")
        if op.dtype not in phase.DTYPES:
            raise TypeError(f"{op.name}: expected float16 or bfloat16, got {op.dtype}")
        if op.dtype != qd.dtype:
            raise TypeError(f"{op.name}: dtype {op.dtype} differs from q's {qd.dtype}")
    D = qd.shape[-1]
    if not supports_head_dim(phase, D):
        raise ValueError(f"q: head dim {D} is not supported; supported: {head_dims_text(phase)}")
    return ops


def _validate(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, return_lse):
    """Every check of attention_kvcache's arguments but their values: kinds, dtypes, shapes, devices
    (the values are the caller's promise; `_check_kvcache_values` checks them, validate=True).
    Returns (B, S_q, H, D, H_kv, page_size, capacity, paged, q's Operand)."""
    _check_flags(causal, scale, return_lse)
    qd, kd, vd = _operands((("q", q), ("k_cache", k_cache), ("v_cache", v_cache)), 4, p10)
    B, S_q, H, D = qd.shape
    if vd.shape != kd.shape:
        raise ValueError(f"v_cache: shape {vd.shape} differs from k_cache's {kd.shape}")
    num_pages, page_size, H_kv, D_k = kd.shape
    if D_k != D:
        raise ValueError(f"k_cache: head dim {D_k} differs from q's {D} (shape {kd.shape})")
    if H % H_kv:
        raise ValueError(f"k_cache: its {H_kv} key/value heads must divide q's {H} heads (shape {kd.shape})")
    (n,) = _index_array("cache_seqlens", cache_seqlens, "(B,)", 1, qd)
    if n != B:
        raise ValueError(f"cache_seqlens: {n} lengths for a batch of {B}")
    paged = block_table is not None
    if paged:
        rows, max_pages = _index_array("block_table", block_table, "(B, max_pages)", 2, qd)
        if rows != B or max_pages == 0:
            raise ValueError(f"block_table: expected shape ({B}, max_pages >= 1), got {(rows, max_pages)}")
        if page_size % PAGE_MULTIPLE:
            raise ValueError(f"k_cache: page size {page_size} (its dimension 1) must be a multiple of {PAGE_MULTIPLE}")
        capacity = max_pages * page_size
    else:
        if num_pages != B:
            raise ValueError(f"k_cache: a contiguous cache has one row per sequence: {num_pages} rows for a batch "
                             f"of {B} (pass block_table for a paged cache)")
        capacity = page_size
    return B, S_q, H, D, H_kv, page_size, capacity, paged, qd


def _check_kvcache_values(cache_seqlens, block_table, num_pages: int, page_size: int, capacity: int) -> None:
    """validate=True: each length within the cache's capacity, each page id of the pages a sequence
    uses within the pool (read back from the GPU: this waits for it)."""
    lengths = _host_ints(cache_seqlens)
    if lengths is None:
        return
    bad = np.flatnonzero((lengths < 0) | (lengths > capacity))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"cache_seqlens: sequence {i} has length {int(lengths[i])}, outside 0 .. {capacity} "
                         f"(the cache holds {capacity} keys per sequence)")
    table = None if block_table is None else _host_ints(block_table)
    if table is not None:
        for b in range(len(lengths)):
            used = table[b, :cdiv(int(lengths[b]), page_size)]
            wrong = np.flatnonzero((used < 0) | (used >= num_pages))
            if wrong.size:
                i = int(wrong[0])
                raise ValueError(f"block_table: sequence {b}'s page {i} is {int(used[i])}, outside the "
                                 f"cache's {num_pages} pages")


def attention_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=None, *, causal: bool = True,
                      scale: float | None = None, return_lse: bool = False, out=None, validate: bool = False):
    """softmax(q·kᵀ·scale)·v of each sequence against its first cache_seqlens[b] keys (see the module
    docstring for the layouts). torch CUDA tensors, Numba device arrays or NumPy arrays (the
    simulator), all of one kind; returns the output of that kind, and with return_lse the pair
    (out, lse). `out` (torch only): a tensor like q to write the output into.

    A call never waits for the GPU: the lengths and page ids are the caller's promise, as in
    FlashAttention, and the kernel clamps what it reads by them, so a wrong value gives a wrong
    row, never a read outside the cache. `validate=True` (or FLASHCORE_VALIDATE=1) checks them on
    the host first, for debugging: that copies them back and waits for the GPU."""
    if is_torch(q):
        return _kvcache_torch(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, return_lse, out,
                              validate)
    launch, out, lse = kvcache_launcher(q, k_cache, v_cache, cache_seqlens, block_table, causal=causal, scale=scale,
                                        return_lse=return_lse, out=out, validate=validate)
    launch()
    if isinstance(q, np.ndarray):
        out = out.copy_to_host()
        lse = lse.copy_to_host() if return_lse else None
    return (out, lse) if return_lse else out


def _kvcache_plan(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, return_lse):
    """The plan of this attention_kvcache problem on torch tensors (runtime/kvcache.py), made on its
    first call; a later call of the same problem checks only what could make it another (the key)."""
    table = block_table
    # (devices by index: comparing two torch.device objects costs a microsecond each)
    try:
        key = ("kvcache", type(q), type(k_cache), type(v_cache), type(cache_seqlens), type(table), q.shape,
               k_cache.shape, v_cache.shape, cache_seqlens.shape, None if table is None else table.shape, q.dtype,
               k_cache.dtype, v_cache.dtype, cache_seqlens.dtype, None if table is None else table.dtype,
               q.get_device(), k_cache.get_device(), v_cache.get_device(), cache_seqlens.get_device(),
               None if table is None else table.get_device(), q.is_contiguous(), k_cache.is_contiguous(),
               v_cache.is_contiguous(), cache_seqlens.is_contiguous(), None if table is None else table.is_contiguous(),
               type(causal), causal, type(scale), scale, type(return_lse), return_lse)
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not a tensor, or unhashable: the validation says which
        _validate(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, return_lse)
        raise
    if plan is None:
        _, _, _, D, _, _, _, paged, qd = _validate(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale,
                                                  return_lse)
        api.require_device(p10)
        from .runtime import KVCachePlan

        qk_scale = (default_scale(D) if scale is None else float(scale)) * LOG2E
        plan = _PLANS.keep(key, KVCachePlan(D, qd.dtype, q.shape, k_cache.shape, block_table.shape if paged else None,
                                            bool(causal), qk_scale, q.device.index or 0, bool(return_lse)))
    return plan


def _capacity(k_cache, block_table) -> int:
    return k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])


def _kvcache_torch(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, return_lse, out, validate):
    """attention_kvcache on torch tensors: its plan, the output, one launch; nothing read back."""
    plan = _kvcache_plan(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, return_lse)
    if validate or VALIDATE:
        _check_kvcache_values(cache_seqlens, block_table, k_cache.shape[0], k_cache.shape[1],
                              _capacity(k_cache, block_table))
    out = _torch_out(q, out)
    lse = _torch_lse(q, (q.shape[0], q.shape[2], q.shape[1])) if return_lse else None
    plan(q, k_cache, v_cache, cache_seqlens, block_table, out, current_stream(plan.device_index), lse)
    return (out, lse) if return_lse else out


def kvcache_launcher(q, k_cache, v_cache, cache_seqlens, block_table=None, *, causal=True, scale=None,
                     return_lse=False, out=None, validate=False):
    """attention_kvcache's checks, then (launch, out, lse): `launch()` runs the kernel with nothing
    checked or allocated again (what the benchmark times; on torch tensors, the plan's launch)."""
    B, S_q, H, D, H_kv, page_size, capacity, paged, qd = _validate(
        q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, return_lse)
    if validate or VALIDATE:
        _check_kvcache_values(cache_seqlens, block_table, k_cache.shape[0], page_size, capacity)
    if qd.kind == "torch":
        plan = _kvcache_plan(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, return_lse)
        out = _torch_out(q, out)
        lse = _torch_lse(q, (B, H, S_q)) if return_lse else None

        def launch():
            plan(q, k_cache, v_cache, cache_seqlens, block_table, out, current_stream(plan.device_index), lse)

        return launch, out, lse
    if out is not None:
        raise ValueError("out: only with torch tensors")
    qk_scale = (default_scale(D) if scale is None else float(scale)) * LOG2E
    if not simulator_enabled():
        return _kvcache_arrays(qd, q, k_cache, v_cache, cache_seqlens, block_table, causal, qk_scale, return_lse)
    config = build_kvcache(D, qd.dtype)
    # the grid and the workspace as for a dense problem whose keys are the cache's capacity
    splits = config.split_keys((B, H, S_q, D), (B, H_kv, capacity, D), causal)
    from numba import cuda

    host = qd.kind == "numpy"
    dev = (lambda x: cuda.to_device(np.ascontiguousarray(x))) if host else (lambda x: x)
    # (B, 1), made by reshape: arange(B)[:, None] has a zero stride that Numba's device array calls
    # non-contiguous, a kernel of its own argument types that the disk cache does not hold
    table = block_table if paged else np.arange(B, dtype=np.int32).reshape(B, 1)
    arrays = [dev(x) for x in (q, k_cache, v_cache)]
    out = cuda.device_array(qd.shape, dtype=np.dtype(qd.dtype))
    lse = cuda.device_array((B, H, S_q), dtype=np.float32) if return_lse else None
    extra = [dev(cache_seqlens), dev(table) if (paged or host) else cuda.to_device(table)]

    def launch():
        _launch(config, splits, arrays + [out], extra, lse, causal, qk_scale, 0)

    return launch, out, lse


def _kvcache_arrays(qd, q, k_cache, v_cache, cache_seqlens, block_table, causal, qk_scale, return_lse):
    """(launch, out, lse) of attention_kvcache on NumPy or Numba arrays on a GPU: the problem's plan,
    as torch tensors get (runtime/kvcache.py), its memory Numba's, on the default stream."""
    from numba import cuda

    from .runtime import KVCachePlan

    api.require_device(p10)
    B, S_q, H, D = qd.shape
    paged = block_table is not None
    device_index = cuda.get_current_device().id
    key = ("kvcache-arrays", D, qd.dtype, tuple(q.shape), tuple(k_cache.shape),
           tuple(block_table.shape) if paged else None, bool(causal), qk_scale, device_index, bool(return_lse))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.keep(key, KVCachePlan(*key[1:], torch_memory=False))
    with cuda.gpus[device_index]:
        q, k_cache, v_cache, cache_seqlens, block_table = _on_device(qd, q, k_cache, v_cache, cache_seqlens,
                                                                     block_table)
        out = cuda.device_array(qd.shape, dtype=np.dtype(qd.dtype))
        lse = cuda.device_array((B, H, S_q), dtype=np.float32) if return_lse else None
    arrays = (q, k_cache, v_cache, cache_seqlens, block_table, DeviceArray(out))
    lse_array = None if lse is None else DeviceArray(lse)

    def launch():
        plan(*arrays, 0, lse_array)

    return launch, out, lse


def _on_device(qd, *arrays):
    """NumPy arrays copied to the device (Numba device arrays as they are), each as a plan takes it
    (inputs.DeviceArray); None stays None."""
    from numba import cuda

    host = qd.kind == "numpy"
    return [None if x is None else DeviceArray(cuda.to_device(np.ascontiguousarray(x)) if host else x)
            for x in arrays]


def _torch_out(q, out, value_dim: int | None = None):
    """The output tensor of a torch call: a new one like q (its last dimension v's head dim, where
    that is given), or the caller's `out`, checked."""
    shape = tuple(q.shape) if value_dim is None else (*q.shape[:-1], value_dim)
    if out is None:
        return q.new_empty(shape)
    if not is_torch(out) or tuple(out.shape) != shape or out.dtype != q.dtype or out.device != q.device \
            or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous tensor of shape {shape}, {q.dtype} on {q.device}")
    return out


def _torch_lse(q, shape, fill=None):
    """The float32 log-sum-exp tensor of a torch call, from torch's allocator (a CUDA graph may be
    capturing the call): uninitialized, or `fill`ed where the kernel may leave rows unwritten."""
    torch = torch_module()
    if fill is None:
        return torch.empty(shape, dtype=torch.float32, device=q.device)
    return torch.full(shape, fill, dtype=torch.float32, device=q.device)


def _launch(config, splits, arrays, extra, lse, causal, qk_scale, stream):
    """attention_kvcache's kernel through Numba's launch (NumPy and Numba arrays, the simulator)."""
    q, k, v, o = arrays
    args = (q, k, v, o.view(np.uint32), no_lse() if lse is None else lse, bool(causal), np.float32(qk_scale),
            *split_workspace(splits, stream), *extra)
    launch_kernel(config.kernel, splits.grid, config.n_threads, config.smem_bytes, args, stream, config.cache_key)


# ---------------------------------------------------------------------------------------------
# Packed sequences of their own lengths
# ---------------------------------------------------------------------------------------------
VARLEN_PHASES = ("07", "09")


def _check_varlen_phase(phase) -> None:
    """The phase argument names one attention_varlen runs (checked before the tensors)."""
    if phase != "best" and phase not in VARLEN_PHASES:
        raise ValueError(f"phase: attention_varlen runs phase {' or '.join(VARLEN_PHASES)} (or 'best'), got {phase!r}")


def _varlen_phase(phase, head_dim: int, value_dim: int | None = None) -> str:
    """The phase attention_varlen runs: 09 where "best" is 09 or newer and it is built for the head dim
    (and for v's, where it has one of its own: MLA's 128 beside 192), else 07 (any multiple of 8 up to
    256, for q's and v's alike)."""
    _check_varlen_phase(phase)
    value_dim = None if value_dim == head_dim else value_dim
    if phase == "best":
        newest = api.best_for_this_gpu(head_dim).ID >= "09"
        return "09" if newest and (value_dim is None or supports_value_dim(PHASES["09"], head_dim, value_dim)) else "07"
    for name, dim in (("q", head_dim), ("v", value_dim)):
        if dim is not None and not supports_head_dim(PHASES[phase], dim):
            raise ValueError(unsupported_head_dim(name, dim, PHASES[phase]))
    if value_dim is not None and not supports_value_dim(PHASES[phase], head_dim, value_dim):
        raise ValueError(f"v: head dim {value_dim} differs from q's {head_dim}; phase {phase} does not take v's "
                         f"head dim {value_dim} beside q's {head_dim} (phase 07 takes v's of its own: "
                         f"{head_dims_text(PHASES['07'])})")
    return phase


def _check_offsets(name: str, offsets, total: int, max_seqlen: int, max_name: str) -> None:
    """cu_seqlens (host values): 0 first, never decreasing, `total` last, no length above max_seqlen."""
    if offsets[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {int(offsets[0])}")
    lengths = np.diff(offsets.astype(np.int64))
    bad = np.flatnonzero(lengths < 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{name}: must not decrease, but entry {i + 1} ({int(offsets[i + 1])}) is below entry {i} "
                         f"({int(offsets[i])})")
    if offsets[-1] != total:
        raise ValueError(f"{name}: its last entry ({int(offsets[-1])}) must be the number of packed rows, {total}")
    if lengths.size and lengths.max() > max_seqlen:
        i = int(np.argmax(lengths))
        raise ValueError(f"{max_name}: {max_seqlen}, but sequence {i} has {int(lengths[i])} ({name})")


def _check_lengths(max_seqlen_q, max_seqlen_k, n_q: int, n_k: int) -> None:
    """What a varlen call checks every time: the longest lengths are whole numbers, the offsets agree."""
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
            raise TypeError(f"{name}: expected a whole number >= 0, got {value!r}")
    if n_q < 1:
        raise ValueError("cu_seqlens_q: expected B + 1 >= 1 offsets, got none")
    if n_k != n_q:
        raise ValueError(f"cu_seqlens_k: {n_k} offsets, but cu_seqlens_q has {n_q} (both are B + 1)")


def _validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, return_lse):
    """Every check of attention_varlen's arguments but the offsets' values (the caller's promise;
    `_check_varlen_values` checks them, validate=True). Returns (B, total_q, H, D, D_v, q's Operand):
    D_v is v's head dim, which may be its own (MLA: 128 beside q's and k's 192)."""
    _check_flags(causal, scale, return_lse)
    qd, kd, vd = _operands((("q", q), ("k", k), ("v", v)), 3, p07)
    total_q, H, D = qd.shape
    if vd.shape[:2] != kd.shape[:2]:
        raise ValueError(f"v: packed rows and heads {vd.shape[:2]} differ from k's {kd.shape[:2]} (shape {vd.shape})")
    _, H_kv, D_k = kd.shape
    if D_k != D:
        raise ValueError(f"k: head dim {D_k} differs from q's {D} (shape {kd.shape})")
    if H % H_kv:
        raise ValueError(f"k: its {H_kv} key/value heads must divide q's {H} heads (shape {kd.shape})")
    (n_q,) = _index_array("cu_seqlens_q", cu_seqlens_q, "(B + 1,)", 1, qd)
    (n_k,) = _index_array("cu_seqlens_k", cu_seqlens_k, "(B + 1,)", 1, qd)
    _check_lengths(max_seqlen_q, max_seqlen_k, n_q, n_k)
    return n_q - 1, total_q, H, D, vd.shape[2], qd


def _check_varlen_values(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k) -> None:
    """validate=True: each offsets array from 0 to its packed rows, never decreasing, no sequence longer
    than its max_seqlen (read back from the GPU: this waits for it)."""
    for name, offsets, total, longest in (("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q),
                                          ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k)):
        host = _host_ints(offsets)
        if host is not None:
            _check_offsets(name, host, total, int(longest), name.replace("cu_seqlens", "max_seqlen"))


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: bool = False, scale: float | None = None, return_lse: bool = False,
                     phase: str = "best", out=None, validate: bool = False):
    """softmax(q·kᵀ·scale)·v of each of B sequences packed end to end (see the module docstring for the
    layouts). torch CUDA tensors, Numba device arrays or NumPy arrays (the simulator), all of one
    kind; returns the output of that kind, and with return_lse the pair (out, lse). `out` (torch
    only): a tensor like q to write the output into.

    A call never waits for the GPU: the offsets and max_seqlen_q are the caller's promise, as in
    FlashAttention, and the kernel clamps the offsets to the packed rows, so a wrong value gives a
    wrong row, never a read outside q, k or v. `validate=True` (or FLASHCORE_VALIDATE=1) checks
    them on the host first, for debugging: that copies them back and waits for the GPU."""
    if is_torch(q):
        return _varlen_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                             return_lse, phase, out, validate)
    launch, out, lse = varlen_launcher(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       causal=causal, scale=scale, return_lse=return_lse, phase=phase, out=out,
                                       validate=validate)
    launch()
    out = out.reshape((*q.shape[:2], v.shape[-1]))  # (v's head dim: MLA's may be its own)
    if isinstance(q, np.ndarray):
        out = out.copy_to_host()
        lse = lse.copy_to_host() if return_lse else None
    return (out, lse[0]) if return_lse else out


def _varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, return_lse, phase):
    """The plan of this kind of attention_varlen problem on torch tensors (runtime/varlen.py): one
    for every packing of the same heads, head dim, dtype, flags and scale. What the key leaves out
    (the packed lengths, the number of sequences) is checked on every call."""
    try:
        key = ("varlen", phase, type(q), type(k), type(v), type(cu_seqlens_q), type(cu_seqlens_k), q.shape[1:],
               k.shape[1:], v.shape[1:], q.dim(), k.dim(), v.dim(), q.dtype, k.dtype, v.dtype, cu_seqlens_q.dtype,
               cu_seqlens_k.dtype, cu_seqlens_q.dim(), cu_seqlens_k.dim(), q.get_device(), k.get_device(),
               v.get_device(), cu_seqlens_q.get_device(), cu_seqlens_k.get_device(), q.is_contiguous(),
               k.is_contiguous(), v.is_contiguous(), cu_seqlens_q.is_contiguous(), cu_seqlens_k.is_contiguous(),
               type(causal), causal, type(scale), scale, type(return_lse), return_lse)
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not a tensor, or unhashable: the validation says which
        _check_varlen_phase(phase)
        _validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, return_lse)
        raise
    if plan is None:
        _check_varlen_phase(phase)
        _, _, H, D, D_v, qd = _validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               causal, scale, return_lse)
        phase_id = _varlen_phase(phase, D, D_v)
        api.require_device(api.get_phase(phase_id))
        from .runtime import VarlenPlan

        qk_scale = (default_scale(D) if scale is None else float(scale)) * LOG2E
        plan = _PLANS.keep(key, VarlenPlan(phase_id, D, qd.dtype, H, k.shape[1], bool(causal), qk_scale,
                                           q.device.index or 0, bool(return_lse), value_dim=D_v))
    else:  # the same kind of problem: only the packed lengths may differ
        if v.shape[0] != k.shape[0]:
            raise ValueError(f"v: shape {tuple(v.shape)} differs from k's {tuple(k.shape)}")
        _check_lengths(max_seqlen_q, max_seqlen_k, cu_seqlens_q.shape[0], cu_seqlens_k.shape[0])
    return plan


def _varlen_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, return_lse, phase,
                  out, validate):
    """attention_varlen on torch tensors: its plan, the output, one launch; nothing read back."""
    launch, out, lse = _varlen_torch_launcher(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                              scale, return_lse, phase, out, validate)
    launch()
    return (out, lse[0]) if return_lse else out


def _varlen_torch_launcher(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                           return_lse, phase, out, validate):
    plan = _varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, return_lse,
                        phase)
    if validate or VALIDATE:
        _check_varlen_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    out = _torch_out(q, out, v.shape[-1])
    # -inf: the LSE of a row that sees no key; the kernel writes every row of every sequence
    lse = _torch_lse(q, (1, q.shape[1], q.shape[0]), -math.inf) if return_lse else None
    B, max_seqlen_q = cu_seqlens_q.shape[0] - 1, int(max_seqlen_q)
    if B == 0 or q.shape[0] == 0 or max_seqlen_q == 0:
        return out.zero_, out, lse

    def launch():
        plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, out, current_stream(plan.device_index), lse)

    return launch, out, lse


def varlen_launcher(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, scale=None,
                    return_lse=False, phase="best", out=None, validate=False):
    """attention_varlen's checks, then (launch, out, lse): `launch()` runs the kernel with nothing
    checked or allocated again (what the benchmark times; out and lse as the kernel sees them)."""
    if is_torch(q):
        return _varlen_torch_launcher(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                                      return_lse, phase, out, validate)
    _check_varlen_phase(phase)
    B, total_q, H, D, D_v, qd = _validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                 causal, scale, return_lse)
    phase_id = _varlen_phase(phase, D, D_v)
    if validate or VALIDATE:
        _check_varlen_values(cu_seqlens_q, cu_seqlens_k, total_q, k.shape[0], max_seqlen_q, max_seqlen_k)
    if out is not None:
        raise ValueError("out: only with torch tensors")
    qk_scale = (default_scale(D) if scale is None else float(scale)) * LOG2E
    max_seqlen_q = int(max_seqlen_q)
    launches = B > 0 and total_q > 0 and max_seqlen_q > 0
    if not simulator_enabled():
        return _varlen_arrays(qd, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, qk_scale, return_lse,
                              phase_id, launches, D_v)
    config = build_varlen(phase_id, D, qd.dtype, D_v)
    if config.work_units is None:
        grid = (cdiv(max_seqlen_q, config.block_m), H, B)
    else:  # phase 09: its units of work, one block per SM when it is persistent
        grid = config.grid((B, H, max_seqlen_q, D), causal) if launches else None
    from numba import cuda

    host = qd.kind == "numpy"
    dev = (lambda x: cuda.to_device(np.ascontiguousarray(x))) if host else (lambda x: x)
    arrays = [dev(x).reshape((1, *x.shape)) for x in (q, k, v)]
    out = cuda.to_device(np.zeros((1, total_q, H, D_v), dtype=np.dtype(qd.dtype)))
    lse = cuda.to_device(np.full((1, H, total_q), -np.inf, np.float32)) if return_lse else None
    offsets = [dev(cu_seqlens_q), dev(cu_seqlens_k)]
    if config.work_units is not None:
        offsets.insert(0, cuda.to_device(np.zeros(1, np.int32)))
    args = _varlen_arguments(config, arrays + [out], offsets, lse, causal, qk_scale, max_seqlen_q) if launches else ()

    def launch():
        if launches:
            launch_kernel(config.kernel, grid, config.n_threads, config.smem_bytes, args, 0, config.cache_key)

    return launch, out, lse


def _varlen_arrays(qd, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal, qk_scale, return_lse, phase_id,
                   launches, value_dim):
    """(launch, out, lse) of attention_varlen on NumPy or Numba arrays on a GPU: the plan of this kind of
    problem, as torch tensors get (runtime/varlen.py), its memory Numba's, on the default stream.
    out starts at zero and lse at -inf: rows past the last sequence are written by no block."""
    from numba import cuda

    from .runtime import VarlenPlan

    api.require_device(api.get_phase(phase_id))
    total_q, H, D = qd.shape
    device_index = cuda.get_current_device().id
    key = ("varlen-arrays", phase_id, D, qd.dtype, H, k.shape[1], bool(causal), qk_scale, device_index,
           bool(return_lse), value_dim)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.keep(key, VarlenPlan(*key[1:-1], torch_memory=False, value_dim=value_dim))
    with cuda.gpus[device_index]:
        arrays = _on_device(qd, q, k, v, cu_seqlens_q, cu_seqlens_k)
        out = cuda.to_device(np.zeros((1, total_q, H, value_dim), dtype=np.dtype(qd.dtype)))
        lse = cuda.to_device(np.full((1, H, total_q), -np.inf, np.float32)) if return_lse else None
    output = DeviceArray(out.reshape((total_q, H, value_dim)))
    lse_array = None if lse is None else DeviceArray(lse)

    def launch():
        if launches:
            plan(*arrays, max_seqlen_q, output, 0, lse_array)

    return launch, out, lse


def _varlen_arguments(config, arrays, offsets, lse, causal, qk_scale, max_seqlen_q) -> list:
    """The kernel's arguments, made once per launcher. Phase 07: (..., cu_seqlens_q, cu_seqlens_k);
    phase 09 also its tensor maps and work counter (offsets = [counter, cu_q, cu_k]) and max_seqlen_q."""
    q, k, v, o = arrays
    args = [q, k, v, o.view(np.uint32), no_lse() if lse is None else lse, bool(causal), np.float32(qk_scale)]
    if config.tma_box is None:
        return args + offsets
    for name, x in zip("qkv", (q, k, v)):
        if not tma.simulator_enabled() and x.__cuda_array_interface__["data"][0] % 16:
            raise ValueError(f"{name}: phase 09 loads it by TMA, which needs a 16-byte aligned address; "
                             f"pass a fresh tensor (or phase='07')")
    return args + [tma.packed_maps((q, k, v), config.tma_box), *offsets, np.int32(max_seqlen_q)]
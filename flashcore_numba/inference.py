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
    k, v           (total_k, H_kv, D)    and its keys k[cu_seqlens_k[b] : cu_seqlens_k[b + 1]]
    cu_seqlens_q   (B + 1,) int32        0, then the running total of the lengths (so for _k)
    max_seqlen_q   int                   the longest sequence's rows (sizes the grid; max_seqlen_k is checked)
    out            (total_q, H, D), q's dtype; with return_lse also lse (H, total_q) float32

With `causal`, the mask is aligned to each sequence's last key (bottom-right), as FlashAttention
2.1 on. It runs phase 09's kernel (phase="best" where the GPU runs it, else 07's; or phase="07" or
"09") built `varlen`: only where a head's rows lie (H x D elements apart) and each sequence's lengths
differ; phase 09 passes over the query blocks past a sequence's rows. Where it differs from flash_attn_varlen_func: the scale is named
`scale` (softmax_scale there); no dropout, window, ALiBi or softcap; a sequence with no key gives
zeros and an LSE of -inf.
"""

from __future__ import annotations

import math

import numpy as np

from .api import _best_for_this_gpu, _describe, _is_torch, torch_to_kernel
from .arch import tma
from .phases import build_kvcache, build_varlen
from .phases import p07_mma_sync as p07
from .phases import p10_split_keys as p10
from .phases.common import LOG2E, cdiv, no_lse, split_workspace
from .phases.common import launch as launch_kernel  # (the launchers below name their closures `launch`)
from .reference import default_scale

PAGE_MULTIPLE = 16


def _host_ints(x) -> np.ndarray:
    """An int32 index array's values on the host, to check them (a copy from the GPU; none while a
    CUDA graph is being captured, where the check is skipped)."""
    if _is_torch(x):
        import torch

        if torch.cuda.is_current_stream_capturing():
            return None
        return x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return x
    return x.copy_to_host()


def _index_array(name: str, x, shape_text: str, ndim: int, like) -> tuple:
    """Check an int32 index array (cache_seqlens, block_table): kind, dtype, dimensions; its shape."""
    kind = "torch" if _is_torch(x) else "numpy" if isinstance(x, np.ndarray) else "numba"
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
    """Describe q and its companions (api._describe) and check them together: one kind and device,
    `ndim` dimensions, contiguous, one 16-bit dtype, a head dim the phase builds."""
    ops = [_describe(name, x) for name, x in named]
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
    if D not in phase.HEAD_DIMS:
        raise ValueError(f"q: head dim {D} is not supported; supported: {', '.join(map(str, phase.HEAD_DIMS))}")
    return ops


def _validate(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, return_lse):
    """Every check of attention_kvcache; returns (B, S_q, H, D, H_kv, page_size, num_pages, paged)."""
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
    lengths = _host_ints(cache_seqlens)
    if lengths is not None:
        bad = np.flatnonzero((lengths < 0) | (lengths > capacity))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"cache_seqlens: sequence {i} has length {int(lengths[i])}, outside 0 .. {capacity} "
                             f"(the cache holds {capacity} keys per sequence)")
        if paged:
            table = _host_ints(block_table)
            if table is not None:
                for b in range(B):
                    used = table[b, :cdiv(int(lengths[b]), page_size)]
                    wrong = np.flatnonzero((used < 0) | (used >= num_pages))
                    if wrong.size:
                        i = int(wrong[0])
                        raise ValueError(f"block_table: sequence {b}'s page {i} is {int(used[i])}, outside the "
                                         f"cache's {num_pages} pages")
    return B, S_q, H, D, H_kv, page_size, capacity, paged, qd


def attention_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=None, *, causal: bool = True,
                      scale: float | None = None, return_lse: bool = False, out=None):
    """softmax(q·kᵀ·scale)·v of each sequence against its first cache_seqlens[b] keys (see the module
    docstring for the layouts). torch CUDA tensors, Numba device arrays or NumPy arrays (the
    simulator), all of one kind; returns the output of that kind, and with return_lse the pair
    (out, lse). `out` (torch only): a tensor like q to write the output into."""
    launch, out, lse = kvcache_launcher(q, k_cache, v_cache, cache_seqlens, block_table, causal=causal, scale=scale,
                                        return_lse=return_lse, out=out)
    launch()
    if isinstance(q, np.ndarray):
        out = out.copy_to_host()
        lse = lse.copy_to_host() if return_lse else None
    return (out, lse) if return_lse else out


def kvcache_launcher(q, k_cache, v_cache, cache_seqlens, block_table=None, *, causal=True, scale=None,
                     return_lse=False, out=None):
    """attention_kvcache's checks, then (launch, out, lse): `launch()` runs the kernel with nothing
    checked or allocated again (what the benchmark times)."""
    B, S_q, H, D, H_kv, _, capacity, paged, qd = _validate(
        q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, return_lse)
    config = build_kvcache(D, qd.dtype)
    qk_scale = (default_scale(D) if scale is None else float(scale)) * LOG2E
    # the grid and the workspace as for a dense problem whose keys are the cache's capacity
    plan = config.split_keys((B, H, S_q, D), (B, H_kv, capacity, D), causal)
    from numba import cuda

    if qd.kind == "torch":
        import torch

        out = _torch_out(q, out)
        lse = torch.empty((B, H, S_q), dtype=torch.float32, device=q.device) if return_lse else None
        table = block_table if paged else torch.arange(B, dtype=torch.int32, device=q.device).reshape(B, 1)
        device_index = q.device.index or 0
        with cuda.gpus[device_index]:
            arrays = [torch_to_kernel(t) for t in (q, k_cache, v_cache, out)]
            extra = [cuda.as_cuda_array(t) for t in (cache_seqlens, table)]
            kernel_lse = cuda.as_cuda_array(lse if lse is not None else _no_lse_torch(q.device))
            workspace = _torch_workspace(plan, q.device)

        def launch():
            with cuda.gpus[device_index]:
                stream = cuda.external_stream(torch.cuda.current_stream(q.device).cuda_stream)
                _launch(config, plan, arrays, extra, kernel_lse, causal, qk_scale, stream, workspace)

        return launch, out, lse
    if out is not None:
        raise ValueError("out: only with torch tensors")
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
        _launch(config, plan, arrays + [out], extra, lse, causal, qk_scale, 0)

    return launch, out, lse


_TORCH_WORKSPACES: dict = {}  # (device, stream, shapes) -> a split-keys workspace from torch's allocator


def _torch_workspace(plan, device) -> list:
    """The split-keys workspace of a torch call on the current stream, as common.split_workspace keeps
    one per stream, but from torch's allocator, so that a call can be captured in a CUDA graph: made
    on the first call on that stream (its counters zeroed there, on the stream), then left at zero by
    every launch's merging blocks."""
    import torch
    from numba import cuda

    key = (str(device), torch.cuda.current_stream(device).cuda_stream, plan.o_part, plan.lse_part, plan.counters)
    found = _TORCH_WORKSPACES.get(key)
    if found is None:
        found = _TORCH_WORKSPACES[key] = [
            cuda.as_cuda_array(torch.empty(plan.o_part, dtype=torch.float32, device=device)),
            cuda.as_cuda_array(torch.empty(plan.lse_part, dtype=torch.float32, device=device)),
            cuda.as_cuda_array(torch.zeros(plan.counters, dtype=torch.int32, device=device))]
    return found


def _torch_out(q, out):
    """The output tensor of a torch call: a new one like q, or the caller's `out`, checked."""
    if out is None:
        return q.new_empty(q.shape)
    if not _is_torch(out) or out.shape != q.shape or out.dtype != q.dtype or out.device != q.device \
            or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous tensor like q ({tuple(q.shape)}, {q.dtype} on {q.device})")
    return out


def _no_lse_torch(device):
    """The empty LSE argument (no_lse) from torch's allocator: nothing allocated by Numba in a call
    that a CUDA graph may be capturing."""
    import torch

    return torch.empty((0, 0, 0), dtype=torch.float32, device=device)


def _launch(config, plan, arrays, extra, lse, causal, qk_scale, stream, workspace=None):
    q, k, v, o = arrays
    args = (q, k, v, o.view(np.uint32), no_lse() if lse is None else lse, bool(causal), np.float32(qk_scale),
            *(workspace or split_workspace(plan, stream)), *extra)
    launch_kernel(config.kernel, plan.grid, config.n_threads, config.smem_bytes, args, stream, config.cache_key)


# ---------------------------------------------------------------------------------------------
# Packed sequences of their own lengths
# ---------------------------------------------------------------------------------------------
VARLEN_PHASES = ("07", "09")


def _varlen_phase(phase) -> str:
    if phase == "best":
        return "09" if _best_for_this_gpu().ID >= "09" else "07"
    if phase not in VARLEN_PHASES:
        raise ValueError(f"phase: attention_varlen runs phase {' or '.join(VARLEN_PHASES)} (or 'best'), got {phase!r}")
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


def _validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, return_lse):
    """Every check of attention_varlen; returns (B, total_q, H, D, qd)."""
    _check_flags(causal, scale, return_lse)
    qd, kd, vd = _operands((("q", q), ("k", k), ("v", v)), 3, p07)
    total_q, H, D = qd.shape
    if vd.shape != kd.shape:
        raise ValueError(f"v: shape {vd.shape} differs from k's {kd.shape}")
    total_k, H_kv, D_k = kd.shape
    if D_k != D:
        raise ValueError(f"k: head dim {D_k} differs from q's {D} (shape {kd.shape})")
    if H % H_kv:
        raise ValueError(f"k: its {H_kv} key/value heads must divide q's {H} heads (shape {kd.shape})")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
            raise TypeError(f"{name}: expected a whole number >= 0, got {value!r}")
    (n_q,) = _index_array("cu_seqlens_q", cu_seqlens_q, "(B + 1,)", 1, qd)
    (n_k,) = _index_array("cu_seqlens_k", cu_seqlens_k, "(B + 1,)", 1, qd)
    if n_q < 1:
        raise ValueError("cu_seqlens_q: expected B + 1 >= 1 offsets, got none")
    if n_k != n_q:
        raise ValueError(f"cu_seqlens_k: {n_k} offsets, but cu_seqlens_q has {n_q} (both are B + 1)")
    for name, offsets, total, longest in (("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q),
                                          ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k)):
        host = _host_ints(offsets)
        if host is not None:
            _check_offsets(name, host, total, int(longest), name.replace("cu_seqlens", "max_seqlen"))
    return n_q - 1, total_q, H, D, qd


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: bool = False, scale: float | None = None, return_lse: bool = False,
                     phase: str = "best", out=None):
    """softmax(q·kᵀ·scale)·v of each of B sequences packed end to end (see the module docstring for the
    layouts). torch CUDA tensors, Numba device arrays or NumPy arrays (the simulator), all of one
    kind; returns the output of that kind, and with return_lse the pair (out, lse). `out` (torch
    only): a tensor like q to write the output into."""
    launch, out, lse = varlen_launcher(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       causal=causal, scale=scale, return_lse=return_lse, phase=phase, out=out)
    launch()
    if not _is_torch(q):
        out = out.reshape(tuple(q.shape))
        if isinstance(q, np.ndarray):
            out = out.copy_to_host()
            lse = lse.copy_to_host() if return_lse else None
    return (out, lse[0]) if return_lse else out


def varlen_launcher(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, scale=None,
                    return_lse=False, phase="best", out=None):
    """attention_varlen's checks, then (launch, out, lse): `launch()` runs the kernel with nothing
    checked or allocated again (what the benchmark times; out and lse as the kernel sees them)."""
    phase_id = _varlen_phase(phase)
    B, total_q, H, D, qd = _validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            causal, scale, return_lse)
    config = build_varlen(phase_id, D, qd.dtype)
    qk_scale = (default_scale(D) if scale is None else float(scale)) * LOG2E
    max_seqlen_q = int(max_seqlen_q)
    launches = B > 0 and total_q > 0 and max_seqlen_q > 0
    if config.work_units is None:
        grid = (cdiv(max_seqlen_q, config.block_m), H, B)
    else:  # phase 09: its units of work, one block per SM when it is persistent
        grid = config.grid((B, H, max_seqlen_q, D), causal) if launches else None
    from numba import cuda

    if qd.kind == "torch":
        import torch

        out = _torch_out(q, out)
        lse = torch.full((1, H, total_q), -math.inf, dtype=torch.float32, device=q.device) if return_lse else None
        if not launches:
            return out.zero_, out, lse
        device_index = q.device.index or 0
        with cuda.gpus[device_index]:
            arrays = [torch_to_kernel(t[None]) for t in (q, k, v, out)]
            offsets = [cuda.as_cuda_array(c) for c in (cu_seqlens_q, cu_seqlens_k)]
            if config.work_units is not None:  # its work counter (the kernel leaves it at zero)
                offsets.insert(0, cuda.as_cuda_array(torch.zeros(1, dtype=torch.int32, device=q.device)))
            kernel_lse = cuda.as_cuda_array(lse if lse is not None else _no_lse_torch(q.device))
            args = _varlen_arguments(config, arrays, offsets, kernel_lse, causal, qk_scale, max_seqlen_q)

        def launch():
            with cuda.gpus[device_index]:
                stream = cuda.external_stream(torch.cuda.current_stream(q.device).cuda_stream)
                launch_kernel(config.kernel, grid, config.n_threads, config.smem_bytes, args, stream, config.cache_key)

        return launch, out, lse
    if out is not None:
        raise ValueError("out: only with torch tensors")
    host = qd.kind == "numpy"
    dev = (lambda x: cuda.to_device(np.ascontiguousarray(x))) if host else (lambda x: x)
    arrays = [dev(x).reshape((1, *x.shape)) for x in (q, k, v)]
    out = cuda.to_device(np.zeros((1, *qd.shape), dtype=np.dtype(qd.dtype)))
    lse = cuda.to_device(np.full((1, H, total_q), -np.inf, np.float32)) if return_lse else None
    offsets = [dev(cu_seqlens_q), dev(cu_seqlens_k)]
    if config.work_units is not None:
        offsets.insert(0, cuda.to_device(np.zeros(1, np.int32)))
    args = _varlen_arguments(config, arrays + [out], offsets, lse, causal, qk_scale, max_seqlen_q) if launches else ()

    def launch():
        if launches:
            launch_kernel(config.kernel, grid, config.n_threads, config.smem_bytes, args, 0, config.cache_key)

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
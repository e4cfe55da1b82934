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
"""

from __future__ import annotations

import math

import numpy as np

from .api import _describe, _is_torch, torch_to_kernel
from .phases import p10_split_keys as p10
from .phases.common import LOG2E, cdiv, launch, no_lse, split_workspace
from .reference import default_scale

PAGE_MULTIPLE = 16


def _config(head_dim: int, dtype: str):
    import dataclasses

    config = p10.build(head_dim, dtype, paged=True)
    return dataclasses.replace(config, cache_key=("10-kvcache", int(head_dim), dtype))


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


def _validate(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, return_lse):
    """Every check of attention_kvcache; returns (B, S_q, H, D, H_kv, page_size, num_pages, paged)."""
    for name, flag in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name}: expected True or False, got {flag!r}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)):
            raise TypeError(f"scale: expected a real number or None, got {type(scale).__name__}")
        if not math.isfinite(float(scale)):
            raise ValueError(f"scale: expected a finite number, got {float(scale)}")
    ops = [_describe(name, x) for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache))]
    qd, kd, vd = ops
    for op in ops:
        if op.kind != qd.kind or op.device != qd.device:
            raise TypeError(f"{op.name}: must live with q ({qd.kind} on {qd.device}), got {op.kind} on {op.device}")
        if len(op.shape) != 4:
            raise ValueError(f"{op.name}: expected 4 dimensions, got shape {op.shape}")
        if 0 in op.shape:
            raise ValueError(f"{op.name}: empty input, shape {op.shape} has a zero-length dimension")
        if not op.contiguous:
            raise ValueError(f"{op.name}: expected a contiguous layout; make one with .contiguous()")
        if op.dtype not in p10.DTYPES:
            raise TypeError(f"{op.name}: expected float16 or bfloat16, got {op.dtype}")
        if op.dtype != qd.dtype:
            raise TypeError(f"{op.name}: dtype {op.dtype} differs from q's {qd.dtype}")
    B, S_q, H, D = qd.shape
    if D not in p10.HEAD_DIMS:
        raise ValueError(f"q: head dim {D} is not supported; supported: {', '.join(map(str, p10.HEAD_DIMS))}")
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
                      scale: float | None = None, return_lse: bool = False):
    """softmax(q·kᵀ·scale)·v of each sequence against its first cache_seqlens[b] keys (see the module
    docstring for the layouts). torch CUDA tensors, Numba device arrays or NumPy arrays (the
    simulator), all of one kind; returns the output of that kind, and with return_lse the pair
    (out, lse)."""
    B, S_q, H, D, H_kv, page_size, capacity, paged, qd = _validate(
        q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, return_lse)
    config = _config(D, qd.dtype)
    qk_scale = (default_scale(D) if scale is None else float(scale)) * LOG2E
    # the grid and the workspace as for a dense problem whose keys are the cache's capacity
    plan = config.split_keys((B, H, S_q, D), (B, H_kv, capacity, D), causal)
    from numba import cuda

    if qd.kind == "torch":
        import torch

        out = torch.empty_like(q)
        lse = torch.empty((B, H, S_q), dtype=torch.float32, device=q.device) if return_lse else None
        table = block_table if paged else torch.arange(B, dtype=torch.int32, device=q.device)[:, None]
        with cuda.gpus[q.device.index or 0]:
            stream = cuda.external_stream(torch.cuda.current_stream(q.device).cuda_stream)
            arrays = [torch_to_kernel(t) for t in (q, k_cache, v_cache, out)]
            extra = [cuda.as_cuda_array(t) for t in (cache_seqlens, table)]
            _launch(config, plan, arrays, extra, lse if lse is None else cuda.as_cuda_array(lse), causal, qk_scale,
                    stream)
        return (out, lse) if return_lse else out
    host = qd.kind == "numpy"
    dev = (lambda x: cuda.to_device(np.ascontiguousarray(x))) if host else (lambda x: x)
    table = block_table if paged else np.arange(B, dtype=np.int32)[:, None]
    arrays = [dev(x) for x in (q, k_cache, v_cache)]
    out = cuda.device_array(qd.shape, dtype=np.dtype(qd.dtype))
    lse = cuda.device_array((B, H, S_q), dtype=np.float32) if return_lse else None
    extra = [dev(cache_seqlens), dev(table) if (paged or host) else cuda.to_device(table)]
    _launch(config, plan, arrays + [out], extra, lse, causal, qk_scale, 0)
    if host:
        out = out.copy_to_host()
        lse = lse.copy_to_host() if return_lse else None
    return (out, lse) if return_lse else out


def _launch(config, plan, arrays, extra, lse, causal, qk_scale, stream):
    q, k, v, o = arrays
    args = (q, k, v, o.view(np.uint32), no_lse() if lse is None else lse, bool(causal), np.float32(qk_scale),
            *split_workspace(plan, stream), *extra)
    launch(config.kernel, plan.grid, config.n_threads, config.smem_bytes, args, stream, config.cache_key)

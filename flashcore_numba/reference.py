"""The exact reference every phase is checked against, and the pass/fail oracle.

`reference_attention` computes softmax(q·kᵀ·scale)·v in float64: the "true" answer up to
float64 rounding. `lowp_attention` computes the same thing the way a plain fp16 framework
does (q·kᵀ, the softmax and p·v each rounded to fp16, as torch's math backend does).

The oracle (the one FlashAttention's own tests use): a kernel passes when

    max |out - ref|  <=  2 * max |lowp - ref|  +  atol

that is, it may be at most twice as far from the truth as ordinary fp16 arithmetic is,
plus a small absolute slack. NaN or Inf anywhere in the output never passes.

Masking conventions shared with every kernel:
- causal masks align to the bottom-right corner when the query and key lengths differ
  (FlashAttention-2's convention): query row i sees keys j <= i + (seq_k - seq_q);
- a query row that sees no key at all (possible only when causal and seq_q > seq_k)
  produces zeros;
- inf and NaN in the inputs follow torch's SDPA (docs/guide.md, "Infinities and NaN in the
  inputs"): a +inf or NaN visible score makes its row NaN, a -inf score weighs 0, a row of -inf
  scores produces zeros, masked keys are dropped before the softmax. `check_nonfinite` is the
  oracle for such inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ATOL = 1e-3


def visible_mask(seq_q: int, seq_k: int, causal: bool) -> np.ndarray:
    """Boolean (seq_q, seq_k) matrix: True where query row i may attend to key j."""
    if not causal:
        return np.ones((seq_q, seq_k), dtype=bool)
    rows = np.arange(seq_q)[:, None]
    cols = np.arange(seq_k)[None, :]
    return cols <= rows + (seq_k - seq_q)


def _softmax_rows(s: np.ndarray, mask: np.ndarray) -> np.ndarray:
    s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(m == -np.inf, 0.0, m)  # rows with no finite visible score: avoid (-inf) - (-inf)
    p = np.exp(s - m)  # a +inf score gives inf - inf = NaN: its row becomes NaN, as in torch
    denom = p.sum(axis=-1, keepdims=True)
    return np.divide(p, denom, out=np.zeros_like(p), where=denom != 0)  # no visible key: zeros


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def kv_head(h: int, heads_q: int, heads_kv: int) -> int:
    """The K/V head that query head h reads: grouped-query attention gives each group of
    heads_q / heads_kv consecutive query heads one K/V head (MQA: heads_kv = 1)."""
    return h * heads_kv // heads_q


def reference_attention(q, k, v, *, causal: bool = False, scale: float | None = None) -> np.ndarray:
    """float64 attention of (B, H, S, D) arrays; returns a float64 NumPy array.

    Accepts NumPy arrays or torch tensors. Torch tensors are computed with torch in float64
    on their own device (fast on a GPU); NumPy arrays with NumPy, one head at a time. k and v
    may have fewer heads than q (grouped-query attention; see `kv_head`).
    """
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    if type(q).__module__.startswith("torch"):
        return _reference_torch(q, k, v, causal, scale)
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, H, Sq, _ = q.shape
    mask = visible_mask(Sq, k.shape[2], causal)
    out = np.empty((B, H, Sq, v.shape[-1]), dtype=np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf, 0 * inf: NaN where the inputs hold inf or NaN
        for b, h in np.ndindex(B, H):
            hk = kv_head(h, H, k.shape[1])
            p = _softmax_rows(q[b, h] @ k[b, hk].T * scale, mask)
            out[b, h] = p @ v[b, hk]
    return out


def reference_flex(q, k, v, *, score_mod=None, mask_mod=None, causal: bool = False,
                   scale: float | None = None, rows=None) -> tuple[np.ndarray, np.ndarray]:
    """float64 output (B, H, S_q, D_v) and log-sum-exp (B, H, S_q) of attention with FlexAttention's
    mods (flashcore_numba/flex.py), NumPy arrays: the scores scaled, then score_mod(score, b, h,
    q_idx, kv_idx) element by element, then the keys mask_mod (and causal, if set) hides dropped
    before the softmax. A row that sees no key gives zeros and an LSE of -inf. `rows` (query rows of
    q, whole numbers): only those, in that order ((B, H, len(rows), D_v) and (B, H, len(rows))), for a
    sequence whose whole S_q x S_k scores would not fit in memory."""
    from . import flex

    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    smod = None if score_mod is None else flex.score_mod(score_mod)
    mmod = None if mask_mod is None else flex.mask_mod(mask_mod)
    B, H, Sq, _ = q.shape
    rows = np.arange(Sq) if rows is None else np.asarray(rows)
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q[:, :, rows], k, v))
    Sk = k.shape[2]
    out = np.empty((B, H, len(rows), v.shape[-1]), dtype=np.float64)
    lse = np.full((B, H, len(rows)), -np.inf)
    q_idx, kv_idx = rows[:, None], np.arange(Sk)[None, :]
    visible = kv_idx <= q_idx + (Sk - Sq) if causal else True  # visible_mask's rows
    with np.errstate(invalid="ignore", over="ignore"):
        for b, h in np.ndindex(B, H):
            hk = kv_head(h, H, k.shape[1])
            s = q[b, h] @ k[b, hk].T * scale
            if smod is not None:
                s = np.broadcast_to(flex.evaluate(smod, s, b, h, q_idx, kv_idx), s.shape).astype(np.float64)
            mask = visible & flex.mask_matrix(mmod, b, h, Sq, Sk, rows)
            out[b, h] = _softmax_rows(s, mask) @ v[b, hk]
            masked = np.where(mask, s, -np.inf)
            m = masked.max(axis=-1)
            seen = m > -np.inf
            lse[b, h, seen] = m[seen] + np.log(np.exp(masked[seen] - m[seen, None]).sum(axis=-1))
    return out, lse


def reference_flex_gradients(q, k, v, do, *, score_mod=None, mask_mod=None, scale: float | None = None):
    """float64 (dq, dk, dv) of reference_flex's output against its gradient `do`, NumPy arrays: with
    s = scale · q kᵀ, s' = score_mod(s) (its ScoreMod's grad g = d s' / d s) and P the softmax of s'
    over the keys mask_mod leaves, dv = Pᵀ do, dS' = P ∘ (do vᵀ − rowsum(do ∘ o)), dS = dS' ∘ g(s),
    dq = scale · dS k, dk = scale · dSᵀ q; a K/V head's dk and dv summed over its group."""
    from . import flex

    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    smod = None if score_mod is None else flex.score_mod(score_mod)
    mmod = None if mask_mod is None else flex.mask_mod(mask_mod)
    if smod is not None and smod.grad is None:
        raise ValueError(f"score_mod {smod.name}: no grad given (flex.score_mod(fn, ..., grad=...))")
    q, k, v, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, do))
    B, H, Sq, _ = q.shape
    Sk = k.shape[2]
    q_idx, kv_idx = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    with np.errstate(invalid="ignore", over="ignore"):
        for b, h in np.ndindex(B, H):
            hk = kv_head(h, H, k.shape[1])
            s = q[b, h] @ k[b, hk].T * scale
            slope = np.ones_like(s)
            if smod is not None:
                slope = np.broadcast_to(flex.evaluate(smod, s, b, h, q_idx, kv_idx, fn=smod.grad), s.shape)
                s = np.broadcast_to(flex.evaluate(smod, s, b, h, q_idx, kv_idx), s.shape).astype(np.float64)
            p = _softmax_rows(s, flex.mask_matrix(mmod, b, h, Sq, Sk))
            dp = do[b, h] @ v[b, hk].T
            ds = p * (dp - np.sum(dp * p, axis=1, keepdims=True)) * slope
            dv[b, hk] += p.T @ do[b, h]
            dq[b, h] = scale * ds @ k[b, hk]
            dk[b, hk] += scale * ds.T @ q[b, h]
    return dq, dk, dv


def reference_gradients(q, k, v, do, *, causal: bool = False, scale: float | None = None, dlse=None,
                        dtype=np.float64, lowp: str | None = None):
    """float64 (dq, dk, dv) of attention's output against its gradient `do`, NumPy arrays: with
    P = softmax(scale · q kᵀ) (masked) and o = P v, dv = Pᵀ do, dS = P ∘ (do vᵀ − rowsum(do ∘ o)),
    dq = scale · dS k, dk = scale · dSᵀ q; dk and dv of a K/V head summed over its group's query
    heads. A row that sees no key has P = 0: it adds nothing. `dlse`, the gradient of the rows'
    log-sum-exps (B, H, S_q), if they were used too: d lse_i / d s_ij = P_ij, added to dS.
    The yardstick of a backward's error, the same formulas computed the way a tensor-core backward
    computes them: `dtype` np.float32 for float32 arithmetic, and `lowp` ("float16" or "bfloat16")
    for the 16-bit values it works from: o rounded to it (the forward stored it so), P and dS rounded
    to it before their products (the tensor cores take 16-bit operands), dk and dv at the end."""
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    q, k, v, do = (np.asarray(x, dtype=dtype) for x in (q, k, v, do))

    def rounded(x):
        return x if lowp is None else round_to(x, lowp).astype(dtype)

    B, H, Sq, _ = q.shape
    mask = visible_mask(Sq, k.shape[2], causal)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b, h in np.ndindex(B, H):
        hk = kv_head(h, H, k.shape[1])
        p = _softmax_rows(q[b, h] @ k[b, hk].T * scale, mask)
        dp = do[b, h] @ v[b, hk].T
        # Δ = rowsum(dp ∘ p) = rowsum(do ∘ o), the second as FlashAttention computes it (from the output)
        ds = p * (dp - np.sum(do[b, h] * rounded(p @ v[b, hk]), axis=1, keepdims=True))
        if dlse is not None:
            ds += p * np.asarray(dlse, dtype=dtype)[b, h][:, None]
        dv[b, hk] += rounded(p).T @ do[b, h]
        dq[b, h] = scale * rounded(ds) @ k[b, hk]
        dk[b, hk] += scale * rounded(ds).T @ q[b, h]
    return dq, rounded(dk), rounded(dv)


def gradient_oracle(q, k, v, do, *, lowp: str = "float16", **kw):
    """(float64 gradients, the yardstick's) of the same problem: the yardstick is the same formulas
    computed as a tensor-core backward computes them (float32 sums of `lowp` P and dS,
    reference_gradients(lowp=...)). A gradient passes check_close(grad, ref, yardstick,
    atol=gradient_atol(ref)). `kw`: causal, scale, dlse."""
    return (reference_gradients(q, k, v, do, **kw),
            reference_gradients(q, k, v, do, dtype=np.float32, lowp=lowp, **kw))


def gradient_atol(ref, rounding: float = 0.0) -> float:
    """The absolute term of the gradients' oracle (check_close(grad, ref, yardstick, atol=...)): 1e-3
    of the gradient's largest value, plus 1e-6, plus `rounding` (gradient_rounding: what float32
    leaves where dS cancels). Where the softmax is nearly one-hot, dS = P ∘ (dP − Δ) cancels, and
    rounding loses digits there whoever computes it, so a fixed ATOL does not fit gradients whose
    size varies with the problem."""
    return 1e-3 * (float(np.max(np.abs(ref))) if np.size(ref) else 0.0) + 1e-6 + rounding


def gradient_rounding(q, k, v, do, *, causal: bool = False, scale: float | None = None) -> tuple:
    """(dq, dk, dv) bounds of what float32's rounding of dP − Δ leaves in the gradients where dS
    cancels. dP_ij and Δ_i are two float32 sums of D products each, in different orders, so their
    difference is good to about one unit of float32's last place of T_ij = Σ_d |dO_id| (|V_jd| +
    max|V|) (2^-23 T_ij here: |O_id| <= max|V|, O being a mix of V's rows), and dS_ij = P_ij (dP_ij − Δ_i)
    carries P_ij times that. Where a row's softmax is one-hot (a row that sees one key: S_k = 1) dS is
    exactly 0 and so is the reference's dq, while a backward's dq keeps the residue
    (tests/test_backward.py found 1.07e-6 at S_q = 13, S_k = 1, D = 64, scale 0.3). dq_i = scale
    Σ_j dS_ij k_j and dk_j = scale Σ_i dS_ij q_i then carry at most scale · Σ_j P_ij 2^-23 T_ij max|k|
    and scale · Σ_i P_ij 2^-23 T_ij max|q| (over a K/V head's query rows); dv has no dS."""
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    q, k, v, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, do))
    B, H, Sq, _ = q.shape
    mask = visible_mask(Sq, k.shape[2], causal)
    dq_bound, dk_rows = 0.0, np.zeros(k.shape[:3])
    for b, h in np.ndindex(B, H):
        hk = kv_head(h, H, k.shape[1])
        p = _softmax_rows(q[b, h] @ k[b, hk].T * scale, mask)
        do_abs, v_abs = np.abs(do[b, h]), np.abs(v[b, hk])
        terms = do_abs @ v_abs.T + np.sum(do_abs, axis=1, keepdims=True) * np.max(v_abs)  # T_ij
        residue = 2.0 ** -23 * scale * p * terms  # (S_q, S_k): what dS_ij may carry
        dq_bound = max(dq_bound, float(np.max(residue.sum(axis=1))) * float(np.max(np.abs(k[b, hk]))))
        dk_rows[b, hk] += residue.sum(axis=0) * float(np.max(np.abs(q[b, h])))
    return dq_bound, float(np.max(dk_rows)), 0.0


def reference_lse(q, k, *, causal: bool = False, scale: float | None = None) -> np.ndarray:
    """float64 log-sum-exp of every row's scores, (B, H, S_q): log(sum_j exp(q_i·k_j·scale)) over
    the keys row i sees, natural log (torch's and FlashAttention's convention); -inf for a row that
    sees no key. What attention(..., return_lse=True) returns beside the output. NumPy arrays or
    torch tensors (computed with torch in float64 on their own device)."""
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    if type(q).__module__.startswith("torch"):
        return _reference_lse_torch(q, k, causal, scale)
    q, k = (np.asarray(x, dtype=np.float64) for x in (q, k))
    B, H, Sq, _ = q.shape
    mask = visible_mask(Sq, k.shape[2], causal)
    lse = np.empty((B, H, Sq), dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        for b, h in np.ndindex(B, H):
            s = np.where(mask, q[b, h] @ k[b, kv_head(h, H, k.shape[1])].T * scale, -np.inf)
            m = s.max(axis=-1, keepdims=True)
            m = np.where(np.isfinite(m), m, 0.0)  # a row of -inf only: log(0) = -inf below
            lse[b, h] = np.log(np.exp(s - m).sum(axis=-1)) + m[:, 0]
    return lse


def _masked_scores_torch(q, k, causal, scale):
    """(b, scores of batch b) in float64 on q's device, masked keys -inf, one batch at a time (that
    keeps the float64 score matrix small); grouped K/V heads spelled out per query head."""
    import torch

    H, Sq = q.shape[1], q.shape[2]
    mask = torch.from_numpy(visible_mask(Sq, k.shape[2], causal)).to(q.device)
    if k.shape[1] != H:  # grouped-query attention: each K/V head serves H / H_kv query heads
        k = k.repeat_interleave(H // k.shape[1], dim=1)
    for b in range(q.shape[0]):
        s = torch.matmul(q[b].double(), k[b].double().transpose(-1, -2)) * scale
        yield b, s.masked_fill(~mask, float("-inf"))


def _reference_lse_torch(q, k, causal, scale):
    import torch

    lse = torch.empty(q.shape[:3], dtype=torch.float64, device=q.device)
    for b, s in _masked_scores_torch(q, k, causal, scale):
        lse[b] = torch.logsumexp(s, dim=-1)  # -inf for a row of -inf
    return lse.cpu().numpy()


def _reference_torch(q, k, v, causal, scale):
    import torch

    B, H, Sq, _ = q.shape
    out = torch.empty((B, H, Sq, v.shape[-1]), dtype=torch.float64, device=q.device)
    if v.shape[1] != H:
        v = v.repeat_interleave(H // v.shape[1], dim=1)
    for b, s in _masked_scores_torch(q, k, causal, scale):
        out[b] = torch.matmul(_softmax_torch(s), v[b].double())
    return out.cpu().numpy()


def _softmax_torch(s):
    """_softmax_rows of masked scores (-inf where masked) in torch, in their own dtype."""
    import torch

    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)  # as in _softmax_rows
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    return torch.where(denom != 0, p / denom, torch.zeros_like(p))


# ---------------------------------------------------------------------------------------------
# bfloat16 on the host: NumPy has no bf16 type, so bf16 arrays travel as their 16-bit patterns
# ---------------------------------------------------------------------------------------------
def bf16_bits(x) -> np.ndarray:
    """float32 values -> the int16 bit patterns of their bf16 roundings (round to nearest even).

    bf16 is the upper half of an fp32: rounding adds 0x7FFF plus the lowest kept bit, then
    drops the low 16 bits. NaN stays NaN (a quiet one).
    """
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint32)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    rounded = np.where(nan, (bits >> 16).astype(np.uint32) | 0x40, rounded)
    return rounded.astype(np.uint16).view(np.int16)


def bf16_to_float(bits) -> np.ndarray:
    """int16 (or uint16) bf16 bit patterns -> float32 values."""
    return (np.asarray(bits).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_to(x, dtype) -> np.ndarray:
    """x rounded to `dtype` ("float16", "bfloat16" or a NumPy dtype), returned as float32."""
    if str(dtype) == "bfloat16":
        return bf16_to_float(bf16_bits(x))
    return np.asarray(x, dtype=np.float32).astype(dtype).astype(np.float32)


def cache_sequences(k_cache, v_cache, cache_seqlens, block_table=None):
    """Each sequence's keys and values out of a KV cache (flashcore_numba.inference's layouts), as
    NumPy arrays (H_kv, L_b, D): the contiguous cache's row b, or the pages block_table[b] names."""
    k_cache, v_cache = (np.asarray(x.float().cpu() if hasattr(x, "cpu") else x) for x in (k_cache, v_cache))
    lengths = np.asarray(cache_seqlens.cpu() if hasattr(cache_seqlens, "cpu") else cache_seqlens)
    table = None if block_table is None else np.asarray(block_table.cpu() if hasattr(block_table, "cpu")
                                                        else block_table)
    out = []
    for b, n in enumerate(lengths):
        n = int(n)
        if table is None:
            k, v = k_cache[b, :n], v_cache[b, :n]
        else:
            page_size = k_cache.shape[1]
            keys = np.arange(n)
            pages = table[b, keys // page_size]
            k, v = k_cache[pages, keys % page_size], v_cache[pages, keys % page_size]
        out.append((k.transpose(1, 0, 2), v.transpose(1, 0, 2)))
    return out


def reference_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=None, *, causal: bool = True,
                      scale: float | None = None, lowp_dtype=None):
    """float64 output (B, S_q, H, D) and LSE (B, H, S_q) of attention_kvcache, one sequence at a time
    through reference_attention and reference_lse (a sequence without keys: zeros and -inf); with
    `lowp_dtype`, also the plain fp16 (or "bfloat16") yardstick of lowp_attention, for check_close."""
    q = np.asarray(q.float().cpu() if hasattr(q, "cpu") else q, dtype=np.float64)
    B, S_q, H, D = q.shape
    out, lse = np.zeros((B, S_q, H, D)), np.full((B, H, S_q), -np.inf)
    lowp = np.zeros_like(out)
    for b, (k, v) in enumerate(cache_sequences(k_cache, v_cache, cache_seqlens, block_table)):
        if k.shape[1] == 0:
            continue
        qb = q[b].transpose(1, 0, 2)[None]  # (1, H, S_q, D)
        out[b] = reference_attention(qb, k[None], v[None], causal=causal, scale=scale)[0].transpose(1, 0, 2)
        lse[b] = reference_lse(qb, k[None], causal=causal, scale=scale)[0]
        if lowp_dtype is not None:
            lowp[b] = lowp_attention(qb, k[None], v[None], causal=causal, scale=scale,
                                     dtype=lowp_dtype)[0].transpose(1, 0, 2)
    return (out, lse, lowp) if lowp_dtype is not None else (out, lse)


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal: bool = False, scale: float | None = None,
                     lowp_dtype=None):
    """float64 output (total_q, H, D_v) and LSE (H, total_q) of attention_varlen, one sequence at a time
    through reference_attention and reference_lse (a sequence without keys: zeros and -inf); with
    `lowp_dtype`, also the plain fp16 (or "bfloat16") yardstick of lowp_attention, for check_close."""
    def host(x, dtype=np.float64):
        return np.asarray(x.float().cpu() if hasattr(x, "cpu") and x.is_floating_point() else
                          x.cpu() if hasattr(x, "cpu") else x, dtype=dtype)

    if not type(q).__module__.startswith("torch"):  # torch tensors stay where they are (the GPU)
        q, k, v = (host(x) for x in (q, k, v))
    cu_q, cu_k = (host(c, np.int64) for c in (cu_seqlens_q, cu_seqlens_k))
    total_q, H, _ = q.shape
    out, lse = np.zeros((total_q, H, v.shape[-1])), np.full((H, total_q), -np.inf)  # (v's head dim: MLA's own)
    lowp = np.zeros_like(out)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if cu_q[b + 1] == cu_q[b] or cu_k[b + 1] == cu_k[b]:
            continue  # no row, or rows that see no key: zeros
        qb, kb, vb = (x[None].permute(0, 2, 1, 3) if hasattr(x, "permute") else x[None].transpose(0, 2, 1, 3)
                      for x in (q[rows], k[keys], v[keys]))  # (1, heads, S, D)
        out[rows] = reference_attention(qb, kb, vb, causal=causal, scale=scale)[0].transpose(1, 0, 2)
        lse[:, rows] = reference_lse(qb, kb, causal=causal, scale=scale)[0]
        if lowp_dtype is not None:
            lowp[rows] = lowp_attention(qb, kb, vb, causal=causal, scale=scale, dtype=lowp_dtype)[0].transpose(1, 0, 2)
    return (out, lse, lowp) if lowp_dtype is not None else (out, lse)


def lowp_attention(q, k, v, *, causal: bool = False, scale: float | None = None,
                   dtype=np.float16) -> np.ndarray:
    """Attention the way plain fp16 (or bf16) framework code computes it (the oracle's yardstick).

    Each of the three steps is accumulated in float32 and rounded to `dtype` (np.float16 or
    "bfloat16"), as torch's math backend does. Returns float64 for comparison.
    """
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    if type(q).__module__.startswith("torch"):
        return _lowp_torch(q, k, v, causal, scale, dtype)
    q, k, v = (np.asarray(x, dtype=np.float32) for x in (q, k, v))
    B, H, Sq, _ = q.shape
    mask = visible_mask(Sq, k.shape[2], causal)
    out = np.empty((B, H, Sq, v.shape[-1]), dtype=np.float64)
    with np.errstate(invalid="ignore"):  # as in reference_attention
        for b, h in np.ndindex(B, H):
            hk = kv_head(h, H, k.shape[1])
            s = round_to(q[b, h] @ k[b, hk].T * np.float32(scale), dtype)
            p = round_to(_softmax_rows(s, mask), dtype)
            out[b, h] = round_to(p @ v[b, hk], dtype)
    return out



def _lowp_torch(q, k, v, causal, scale, dtype):
    """lowp_attention of torch tensors, with torch on their own device (fast on a GPU): the same
    three roundings to `dtype` (torch rounds to fp16 and bf16 to nearest even, as round_to does).
    Each product is taken in float64 (the reference's scores, _masked_scores_torch) and rounded to
    float32 before it is rounded to `dtype`: within a last bit of NumPy's float32 sums, and never
    TF32's 10-bit ones, whatever a user set torch's TF32 flags to (they are left alone)."""
    import torch

    low = torch.bfloat16 if str(dtype) == "bfloat16" else torch.float16
    B, H, Sq, _ = q.shape
    if v.shape[1] != H:  # grouped-query attention (_masked_scores_torch does the same for k)
        v = v.repeat_interleave(H // v.shape[1], dim=1)
    out = torch.empty((B, H, Sq, v.shape[-1]), dtype=torch.float64, device=q.device)
    for b, s in _masked_scores_torch(q, k, causal, scale):
        p = _softmax_torch(s.float().to(low).float()).to(low)
        out[b] = torch.matmul(p.double(), v[b].double()).float().to(low).double()
    return out.cpu().numpy()


@dataclass(frozen=True)
class Verdict:
    """Outcome of the oracle: `ok`, the measured errors and a one-line explanation."""

    ok: bool
    max_err: float
    allowed: float
    lowp_err: float
    nonfinite: int
    message: str

    def __bool__(self) -> bool:  # `if check_close(...):` reads naturally
        return self.ok


def check_close(out, ref, lowp, *, atol: float = ATOL) -> Verdict:
    """Apply the oracle to an output `out` given the float64 `ref` and the fp16 `lowp` result."""
    out = np.asarray(out, dtype=np.float64)
    if out.shape != ref.shape:
        return Verdict(False, math.inf, 0.0, 0.0, 0, f"shape {out.shape} != reference shape {ref.shape}")
    nonfinite = int(np.count_nonzero(~np.isfinite(out)))
    lowp_err = float(np.max(np.abs(lowp - ref))) if ref.size else 0.0
    allowed = 2.0 * lowp_err + atol
    if nonfinite:
        where = np.argwhere(~np.isfinite(out))[0].tolist()
        return Verdict(False, math.inf, allowed, lowp_err, nonfinite,
                       f"{nonfinite} non-finite outputs (first at index {where})")
    err = np.abs(out - ref)
    max_err = float(err.max()) if ref.size else 0.0
    if max_err <= allowed:
        return Verdict(True, max_err, allowed, lowp_err, 0,
                       f"max error {max_err:.2e} <= allowed {allowed:.2e}")
    worst = np.unravel_index(int(np.argmax(err)), err.shape)
    return Verdict(False, max_err, allowed, lowp_err, 0,
                   f"max error {max_err:.2e} > allowed {allowed:.2e} at index {list(map(int, worst))}: "
                   f"got {out[worst]:.5f}, expected {ref[worst]:.5f}")


def scaled_to_logits(q, k, logits: float):
    """(q, k) scaled alike so that the largest |score| of batch 0, head 0 (default scale) is about
    `logits`: inputs whose softmax is nearly one-hot."""
    scores = np.abs(q[0, 0] @ k[0, 0].T) * default_scale(q.shape[-1])
    factor = math.sqrt(logits / max(float(scores.max()), 1e-6))
    return q * factor, k * factor


def random_qkv(shape_q, seq_k=None, *, seed=None, dtype=np.float16, scale=1.0, heads_kv=None, value_dim=None):
    """Fresh random (q, k, v) NumPy arrays of shape (B, H, S, D), normal * `scale`; k and v
    have `heads_kv` heads when given (grouped-query attention), v `value_dim` columns when given (MLA)."""
    B, H, Sq, D = shape_q
    Sk = Sq if seq_k is None else seq_k
    rng = np.random.default_rng(seed)
    Hk = H if heads_kv is None else heads_kv
    q = (rng.standard_normal((B, H, Sq, D)) * scale).astype(dtype)
    k = (rng.standard_normal((B, Hk, Sk, D)) * scale).astype(dtype)
    v = rng.standard_normal((B, Hk, Sk, value_dim or D)).astype(dtype)
    return q, k, v


# ---------------------------------------------------------------------------------------------
# Inputs holding inf and NaN (docs/guide.md, "Infinities and NaN")
# ---------------------------------------------------------------------------------------------
def nonfinite_qkv(shape_q, *, causal: bool, seed=0):
    """(q, k, v) with infinities and NaN placed to exercise each case of the rule in docs/guide.md.

    Not causal (needs S >= 13, D >= 13): k[key 3, dim 0] = +inf and k[key 5, dim 1] = -inf, with
    q[:, 0] and q[:, 1] cycling over four kinds of rows, so that row i gets
      i % 4 == 0: q0 = +1, a +inf score (key 3)             -> NaN row
      i % 4 == 1: q0 = -1, q1 = +1, two -inf scores          -> keys 3 and 5 weigh 0, the row is finite
      i % 4 == 2: q0 = 0, a NaN score (0 * inf)              -> NaN row
      i % 4 == 3: q0 = -2, q1 = -1, a +inf score (key 5)     -> NaN row
    and v[key 7, dim 10] = NaN, v[key 8, dim 11] = +inf, v[key 9, dim 12] = -inf, which the finite
    rows carry into columns 10, 11 and 12.
    Causal: k[key 0, dim 0] = -inf with q[:, 0] = +1, so row 0, which sees key 0 only, has no
    finite score (zeros) and every other row gives key 0 no weight; k[last key, dim 2] = +inf with
    q[:, 2] = +1, which makes the last row NaN and no other row, since no other row sees that key.
    """
    q, k, v = random_qkv(shape_q, seed=seed)
    S = shape_q[2]
    kind = np.arange(S) % 4
    if causal:
        q[..., 0] = 1.0
        k[..., 0, 0] = -np.inf
        q[..., 2] = 1.0
        k[..., S - 1, 2] = np.inf
        return q, k, v
    q[..., 0] = np.array([1.0, -1.0, 0.0, -2.0])[kind]
    q[..., 1] = np.array([1.0, 1.0, 1.0, -1.0])[kind]
    k[..., 3, 0] = np.inf
    k[..., 5, 1] = -np.inf
    v[..., 7, 10] = np.nan
    v[..., 8, 11] = np.inf
    v[..., 9, 12] = -np.inf
    return q, k, v


def check_nonfinite(out, ref, lowp, *, atol: float = ATOL) -> Verdict:
    """The oracle for inputs holding inf or NaN: NaN exactly where the reference has NaN, the same
    infinities where it has them, and `check_close` on every other element."""
    out = np.asarray(out, dtype=np.float64)
    if out.shape != ref.shape:
        return Verdict(False, math.inf, 0.0, 0.0, 0, f"shape {out.shape} != reference shape {ref.shape}")
    for what, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        differ = test(out) != test(ref)
        if differ.any():
            where = np.argwhere(differ)[0].tolist()
            return Verdict(False, math.inf, 0.0, 0.0, int(differ.sum()),
                           f"{int(differ.sum())} outputs disagree with the reference about {what} (first at "
                           f"index {where}: got {out[tuple(where)]}, expected {ref[tuple(where)]})")
    finite = np.isfinite(ref)
    return check_close(out[finite], ref[finite], lowp[finite], atol=atol)

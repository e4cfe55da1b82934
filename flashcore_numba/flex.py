"""Your own attention in Python: score_mod and mask_mod, as torch's FlexAttention defines them.

A *score mod* changes one score before the softmax, a *mask mod* says whether a query row sees a
key at all:

    score_mod(score, b, h, q_idx, kv_idx) -> score      e.g. score + slope * (kv_idx - q_idx)
    mask_mod(b, h, q_idx, kv_idx) -> bool               e.g. q_idx - kv_idx <= 1024

Each is a plain Python function of scalars, the way a kernel thread sees one element: the batch
b, the query head h, the query row q_idx and the key kv_idx, all whole numbers. A mod that needs
data (ALiBi's slopes per head, each token's document id) takes it as trailing parameters, bound
to arrays here, so that the kernel can receive them as arguments of its own instead of freezing
them into its code:

    def alibi_mod(score, b, h, q_idx, kv_idx, slopes):
        return score + slopes[h] * (kv_idx - q_idx)

    mod = score_mod(alibi_mod, slopes)        # ScoreMod: the function and its arrays

`sliding_window`, `softcap`, `alibi`, `document_mask`, `prefix_lm` and `causal_mask` are written
this way. `flashcore_numba.flex_attention(q, k, v, score_mod, block_mask)` runs them in phase 14's
kernel (phases/p14_flex.py). `create_block_mask` evaluates a mask mod once per tile of BLOCK_M query rows by BLOCK_N
keys and says of each tile whether it is empty (no row sees a key: skipped), full (every row sees
every key: no mask_mod call) or partial (mask_mod per element), so that the work done follows the
work the mask leaves. `flashcore_numba.reference.reference_flex` is the float64 oracle with mods.

A mod is checked before anything uses it (`score_mod`, `mask_mod`): its parameters, the arrays
bound to it, and one call on sample indices that must give a number (a bool for a mask mod). A
mistake raises a TypeError or ValueError naming the mod and what was expected.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from .phases.p14_flex import (
    alibi_mod,
    bias_grad,
    causal_mod,
    document_causal_mod,
    document_mod,
    prefix_lm_mod,
    sliding_window_mod,
    softcap_grad,
    softcap_mod,
)

SCORE_PARAMS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_PARAMS = ("b", "h", "q_idx", "kv_idx")
EMPTY, PARTIAL, FULL = 0, 1, 2  # a tile of a block mask


@dataclass(frozen=True)
class Mod:
    """A mod and the arrays bound to its trailing parameters (`score_mod`, `mask_mod` make them)."""

    fn: object
    arrays: tuple = ()
    kind: str = "mask_mod"
    name: str = field(default="", compare=False)
    grad: object = None  # a score mod's derivative by the score, grad(score, b, h, q_idx, kv_idx, *arrays)

    def __call__(self, *args):
        return self.fn(*args, *self.arrays)

    def host_arrays(self) -> tuple:
        """The bound arrays as NumPy arrays (the oracle's and the block mask's view of them)."""
        return tuple(_host(a) for a in self.arrays)


class ScoreMod(Mod):
    pass


class MaskMod(Mod):
    pass


def _host(array):
    if hasattr(array, "detach"):  # a torch tensor, on any device
        return array.detach().cpu().numpy()
    if hasattr(array, "copy_to_host"):  # a Numba device array
        return array.copy_to_host()
    return np.asarray(array)


def _named(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _check(fn, arrays, kind: str, params: tuple) -> str:
    """Check `fn`'s parameters against `params` and the bound arrays; returns its name."""
    name = _named(fn)
    if not callable(fn):
        raise TypeError(f"{kind}: expected a function {kind}({', '.join(params)}), got {fn!r}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{kind} {name}: its parameters cannot be read ({e})") from None
    listed = list(signature.parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.KEYWORD_ONLY) for p in listed):
        raise TypeError(f"{kind} {name}: expected plain positional parameters ({', '.join(params)}, then one per "
                        f"bound array), got {signature}")
    want = len(params) + len(arrays)
    if len(listed) != want:
        extra = f" and {len(arrays)} bound array{'s' * (len(arrays) != 1)}" if arrays else ""
        hint = (f"; its last {len(listed) - want} take arrays: bind them, flex.{kind}({name}, array, ...)"
                if len(listed) > want else "")
        raise TypeError(f"{kind} {name}: expected {want} parameters ({', '.join(params)}{extra}), got {len(listed)}: "
                        f"{signature}{hint}")
    for i, array in enumerate(arrays):
        shape = getattr(array, "shape", None)
        if shape is None or not hasattr(array, "dtype"):
            raise TypeError(f"{kind} {name}: bound argument {i} ({listed[len(params) + i].name}) must be an array "
                            f"(NumPy, Numba or torch), got {type(array).__name__}")
    return name


def _sample(fn, arrays, kind: str, name: str, args: tuple):
    """One call on sample indices (all 0): a number for a score mod, a bool for a mask mod."""
    try:
        value = fn(*args, *(_host(a) for a in arrays))
    except Exception as e:  # noqa: BLE001 - said with the mod's name
        raise ValueError(f"{kind} {name}: calling it on sample indices ({', '.join(map(str, args))}) raised "
                         f"{type(e).__name__}: {e}") from None
    if np.ndim(value) != 0:
        raise ValueError(f"{kind} {name}: expected a scalar, got a value of shape {np.shape(value)}")
    if kind == "mask_mod" and not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{kind} {name}: expected a bool (True where the row sees the key), got "
                         f"{type(value).__name__}")
    if kind == "score_mod" and not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{kind} {name}: expected a number (the new score), got {type(value).__name__}")
    return value


def score_mod(fn, *arrays, grad=None) -> ScoreMod:
    """fn(score, b, h, q_idx, kv_idx, *arrays) -> the new score, checked, with `arrays` bound.
    grad: its derivative by the score, a function of the same parameters, for the backward (the
    chain rule through the mod: torch's FlexAttention differentiates the mod itself; here the
    mod's author says what it is, as the built-ins do). Without one, gradients through the mod are
    refused by its name."""
    if isinstance(fn, ScoreMod) and not arrays and grad is None:
        return fn
    name = _check(fn, arrays, "score_mod", SCORE_PARAMS)
    _sample(fn, arrays, "score_mod", name, (0.0, 0, 0, 0, 0))
    if grad is not None:
        _check(grad, arrays, "score_mod", SCORE_PARAMS)
        _sample(grad, arrays, "score_mod", f"{name}'s grad", (0.0, 0, 0, 0, 0))
    return ScoreMod(fn, tuple(arrays), "score_mod", name, grad)


def mask_mod(fn, *arrays) -> MaskMod:
    """fn(b, h, q_idx, kv_idx, *arrays) -> whether the row sees the key, checked, with `arrays` bound."""
    if isinstance(fn, MaskMod) and not arrays:
        return fn
    name = _check(fn, arrays, "mask_mod", MASK_PARAMS)
    _sample(fn, arrays, "mask_mod", name, (0, 0, 0, 0))
    return MaskMod(fn, tuple(arrays), "mask_mod", name)


# ---------------------------------------------------------------------------------------------
# Built-ins: the mods of phase 14's module (phases/p14_flex.py: causal_mod, sliding_window_mod, ...,
# written as a user writes one), their numbers bound as arrays
# ---------------------------------------------------------------------------------------------
def causal_mask() -> MaskMod:
    """Each row sees the keys up to its own position (S_q = S_k; `causal=True` is the fast path)."""
    return mask_mod(causal_mod)


def sliding_window(left: int, right: int = 0) -> MaskMod:
    """FlashAttention's window_size=(left, right): row i sees keys i - left .. i + right (right = 0:
    causal within the window, as Mistral's)."""
    for name, value in (("left", left), ("right", right)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"sliding_window: {name} must be a whole number >= 0, got {value!r}")
    return mask_mod(sliding_window_mod, np.array([left, right], np.int32))


def prefix_lm(prefix_len: int) -> MaskMod:
    """A prefix LM: every row sees the first prefix_len keys, and causally after them."""
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, (int, np.integer)) or prefix_len < 0:
        raise ValueError(f"prefix_lm: prefix_len must be a whole number >= 0, got {prefix_len!r}")
    return mask_mod(prefix_lm_mod, np.array([prefix_len], np.int32))


def document_mask(doc_ids, causal: bool = True) -> MaskMod:
    """Packed documents: a row sees only the keys of its own document (doc_ids: one int per token of
    the packed sequence, (S,) or (B, S)), causally within it unless causal=False."""
    ids = _host(doc_ids)
    if ids.ndim not in (1, 2) or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"document_mask: doc_ids must be integers of shape (S,) or (B, S), got {ids.dtype} "
                         f"{ids.shape}")
    ids = doc_ids if ids.ndim == 2 else (doc_ids[None] if hasattr(doc_ids, "shape") else ids[None])
    return mask_mod(document_causal_mod if causal else document_mod, ids)


def softcap(cap: float) -> ScoreMod:
    """Gemma 2's logit soft-capping: cap · tanh(score / cap)."""
    if not (isinstance(cap, (int, float, np.floating)) and np.isfinite(cap) and cap > 0):
        raise ValueError(f"softcap: cap must be a finite number > 0, got {cap!r}")
    return score_mod(softcap_mod, np.array([cap, 1.0 / cap], np.float32), grad=softcap_grad)


def alibi(slopes) -> ScoreMod:
    """ALiBi: score + slopes[h] · (kv_idx − q_idx), a linear bias by distance, one slope per query head."""
    host = _host(slopes)
    if host.ndim != 1:
        raise ValueError(f"alibi: slopes must be one number per query head, shape (H,), got {host.shape}")
    return score_mod(alibi_mod, slopes, grad=bias_grad)


def alibi_slopes(H: int) -> np.ndarray:
    """The slopes of ALiBi's paper for H heads (a power of two): 2^(-8 i / H), i = 1 .. H."""
    return (2.0 ** (-8.0 * np.arange(1, H + 1) / H)).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Evaluating a mod over many elements at once (the oracle and the block mask)
# ---------------------------------------------------------------------------------------------
class _MathOnArrays:
    """`math` for a mod called on NumPy arrays: math.tanh(x) is np.tanh(x) there (a mod is written for
    scalars, and math's functions take no arrays)."""

    _RENAMED = {"pow": np.power, "atan": np.arctan, "atan2": np.arctan2, "asin": np.arcsin, "acos": np.arccos,
                "fabs": np.abs}

    def __getattr__(self, name):
        return self._RENAMED.get(name) or getattr(np, name, None) or getattr(math, name)


@lru_cache(maxsize=256)
def _on_arrays(fn):
    """fn with `math` standing for NumPy's functions (_MathOnArrays), or fn itself where it reads no
    `math` (a lambda, a callable object)."""
    import types

    code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
    if code is None or scope is None or scope.get("math") is not math or "math" not in code.co_names:
        return fn
    return types.FunctionType(code, {**scope, "math": _MathOnArrays()}, fn.__name__, fn.__defaults__, fn.__closure__)


def evaluate(mod: Mod, *grids, fn=None):
    """mod over broadcast index grids (and, for a score mod, scores): one call with NumPy arrays where
    the mod's arithmetic broadcasts (its math.tanh as np.tanh), else one call per element (a mod with
    `if` or `and`). fn: another function of the mod's parameters and arrays (its grad) in its place."""
    arrays = mod.host_arrays()
    if fn is not None:
        mod = Mod(fn, mod.arrays, mod.kind, mod.name)
    shape = np.broadcast_shapes(*(np.shape(g) for g in grids))
    try:
        with np.errstate(all="ignore"):
            value = np.asarray(_on_arrays(mod.fn)(*grids, *arrays))
    except Exception:  # noqa: BLE001 - a mod written for scalars: element by element below
        value = None
    try:  # (a mask by head alone gives a scalar: broadcast)
        if value is not None and np.broadcast_shapes(value.shape, shape) == shape:
            return np.broadcast_to(value, shape)
    except ValueError:  # a shape of its own: element by element below
        pass
    out = np.empty(shape, dtype=bool if mod.kind == "mask_mod" else np.float64)
    for index in np.ndindex(shape):
        out[index] = mod.fn(*(g[index] if np.ndim(g) else g for g in np.broadcast_arrays(*grids)), *arrays)
    return out


def mask_matrix(mask: MaskMod | None, b: int, h: int, seq_q: int, seq_k: int, rows=None) -> np.ndarray:
    """The (seq_q, seq_k) bool matrix of `mask` for batch b and query head h (all True without one);
    with `rows` (query rows, whole numbers below seq_q), only those rows, in that order."""
    q_idx = (np.arange(seq_q) if rows is None else np.asarray(rows))[:, None]
    if mask is None:
        return np.ones((len(q_idx), seq_k), dtype=bool)
    kv_idx = np.arange(seq_k)[None, :]
    return np.broadcast_to(evaluate(mask, b, h, q_idx, kv_idx), (len(q_idx), seq_k)).astype(bool)


@dataclass(frozen=True)
class BlockMask:
    """Which tiles of BLOCK_M query rows by BLOCK_N keys a mask leaves: kinds[b, h, m, n] is EMPTY,
    PARTIAL or FULL; b and h are 1 where the mask does not depend on them (broadcast)."""

    kinds: np.ndarray
    seq_q: int
    seq_k: int
    block_m: int
    block_n: int
    mask: MaskMod

    @property
    def density(self) -> float:
        """The share of tiles a kernel visits (partial or full)."""
        return float(np.mean(self.kinds != EMPTY)) if self.kinds.size else 0.0

    def kv_blocks(self, b: int, h: int, m: int) -> np.ndarray:
        """The key blocks query block m of (b, h) visits, in order (what a kernel iterates over)."""
        kinds = self.kinds[b % self.kinds.shape[0], h % self.kinds.shape[1], m]
        return np.flatnonzero(kinds != EMPTY)


def create_block_mask(mask, B: int | None, H: int | None, seq_q: int, seq_k: int, block_m: int = 128,
                      block_n: int = 128, device: bool = False) -> BlockMask:
    """The BlockMask of `mask` (a MaskMod, or a function mask_mod takes) over B batches and H query
    heads (None: the mask does not depend on it, one entry broadcast), computed once and reused for
    every call with the same mask. Rows and keys past seq_q and seq_k do not count: a tile at the
    edge is full when every row and key it has is visible. On the host by default (NumPy, the whole
    matrix of a batch and head at once); device=True: on the GPU, mask_mod compiled into a kernel
    with a block of threads per tile (phases/p14_flex.build_block_mask_kernel), for long sequences
    (its bound arrays copied there unless they are torch CUDA tensors or Numba device arrays)."""
    mask = mask_mod(mask)
    for name, value in (("seq_q", seq_q), ("seq_k", seq_k), ("block_m", block_m), ("block_n", block_n)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < (1 if "block" in name else 0):
            raise ValueError(f"create_block_mask: {name} must be a whole number >= {1 if 'block' in name else 0}, "
                             f"got {value!r}")
    n_m, n_n = -(-seq_q // block_m), -(-seq_k // block_n)
    if device:
        return BlockMask(_device_kinds(mask, B or 1, H or 1, seq_q, seq_k, block_m, block_n), seq_q, seq_k,
                         block_m, block_n, mask)
    kinds = np.empty((B or 1, H or 1, n_m, n_n), np.int8)
    pad_q, pad_k = n_m * block_m - seq_q, n_n * block_n - seq_k
    for b, h in np.ndindex(kinds.shape[:2]):
        seen = np.pad(mask_matrix(mask, b, h, seq_q, seq_k), ((0, pad_q), (0, pad_k)))
        tiles = seen.reshape(n_m, block_m, n_n, block_n)
        real = np.pad(np.ones((seq_q, seq_k), bool), ((0, pad_q), (0, pad_k))).reshape(n_m, block_m, n_n, block_n)
        any_seen = tiles.any(axis=(1, 3))
        all_seen = (tiles | ~real).all(axis=(1, 3))
        kinds[b, h] = np.where(all_seen & any_seen, FULL, np.where(any_seen, PARTIAL, EMPTY))
    return BlockMask(kinds, seq_q, seq_k, block_m, block_n, mask)


def device_arrays(mod: Mod) -> tuple:
    """A mod's bound arrays as a kernel takes them: a tuple of device arrays (one stand-in array for
    none). NumPy arrays are copied to the device; torch CUDA tensors and Numba device arrays are
    taken as they are."""
    from numba import cuda

    if not mod.arrays:
        return (cuda.to_device(np.zeros(1, np.int32)),)
    return tuple(cuda.as_cuda_array(a.detach().contiguous()) if hasattr(a, "detach")
                 else a if hasattr(a, "copy_to_host") else cuda.to_device(np.ascontiguousarray(a))
                 for a in mod.arrays)


def _device_kinds(mask: MaskMod, B: int, H: int, seq_q: int, seq_k: int, block_m: int, block_n: int) -> np.ndarray:
    """create_block_mask's kinds computed on the GPU (see there)."""
    from numba import cuda

    from .arch.cache import function_fingerprint
    from .phases.common import launch
    from .phases.p14_flex import BLOCK_MASK_THREADS, build_block_mask_kernel

    for i, a in enumerate(mask.arrays):
        if hasattr(a, "detach") and a.device.type != "cuda":
            raise ValueError(f"mask_mod {mask.name}: bound array {i} is a torch tensor on {a.device}; device=True "
                             f"needs it on the GPU (.cuda()) or as a NumPy array")
    n_m, n_n = -(-seq_q // block_m), -(-seq_k // block_n)
    kinds = cuda.device_array((B, H, n_m, n_n), np.int8)
    if kinds.size:
        fingerprint = function_fingerprint(mask.fn)
        launch(build_block_mask_kernel(mask.fn, len(mask.arrays)), (n_n, n_m, B * H), BLOCK_MASK_THREADS, 0,
               (kinds, np.int32(seq_q), np.int32(seq_k), np.int32(block_m), np.int32(block_n), device_arrays(mask)),
               0, () if fingerprint is None else ("14-block-mask", fingerprint))
    return kinds.copy_to_host()


# ---------------------------------------------------------------------------------------------
# The block mask at a kernel's tiles (api.flex_attention runs phase 14's kernel with it)
# ---------------------------------------------------------------------------------------------
_KINDS: dict = {}  # (id of a block mask, tiles) -> (the block mask, its kinds at the kernel's tiles)
_KINDS_KEPT = 16  # block masks remade at the kernel's tiles, kept at most


@lru_cache(maxsize=64)
def _all_full(n_m: int, n_n: int) -> np.ndarray:
    """The kinds without a mask, one array per shape: a call keeps its lists on the device by this
    array (api.flex_attention), so a new one per call would copy them again each call."""
    kinds = np.full((1, 1, n_m, n_n), FULL, np.int8)
    kinds.flags.writeable = False
    return kinds


def kernel_kinds(block_mask, mask, B, H, S_q, S_k, block_m, block_n, device: bool = False) -> np.ndarray:
    """The kinds of the tiles at the kernel's BLOCK_M x BLOCK_N: a block mask's own where it was made
    at those, else made again from its mask (the last few kept); all FULL without a mask. device:
    made on the GPU (create_block_mask's device=True)."""
    if mask is None:
        return _all_full(-(-S_q // block_m), -(-S_k // block_n))
    if block_mask is None:
        return create_block_mask(mask, B, H, S_q, S_k, block_m, block_n, device).kinds
    Bm, Hm = block_mask.kinds.shape[:2]
    for name, got, want in (("batches", Bm, B), ("query heads", Hm, H)):
        if got not in (1, want):
            raise ValueError(f"block_mask: made for {got} {name}, the call has {want} (make it with that many, or "
                             f"with None to broadcast one)")
    if (block_mask.block_m, block_mask.block_n) == (block_m, block_n):
        return block_mask.kinds
    key = (id(block_mask), block_m, block_n)
    found = _KINDS.get(key)
    if found is None or found[0] is not block_mask:
        if len(_KINDS) >= _KINDS_KEPT:
            _KINDS.clear()
        found = _KINDS[key] = (block_mask, create_block_mask(mask, Bm if Bm > 1 else None, Hm if Hm > 1 else None,
                                                             S_q, S_k, block_m, block_n, device).kinds)
    return found[1]

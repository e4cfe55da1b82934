"""The phase ladder: one module per optimization, in teaching order.

Each phase module defines ID ("01"), NAME, TITLE, HEAD_DIMS, a docstring changelog, and
`build(head_dim) -> KernelConfig`. A phase may also be built another way (phase 06 on the
inline PTX route): its VARIANTS name those builds, `build(head_dim, variant)` makes them (VARIANTS maps each to its title), and
each is a kernel of its own here ("06-inline"), benchmarked beside the phase. Every kernel has the signature
`kernel(Q, K, V, O, causal, qk_scale)` (see flashcore_numba.phases.common). Later phases add
DTYPES (bf16), GQA support and a minimum compute capability; the defaults below say what
phases 01-05 support.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from types import ModuleType

from .common import KernelConfig

_MODULES = (
    "p01_naive",
    "p02_smem_tiling",
    "p03_warp_shuffle",
    "p04_padding",
    "p05_double_buffer",
    "p06_wmma",
    "p07_mma_sync",
    "p08_wgmma",
    "p09_warp_specialized",
    "p10_split_keys",
)

DEFAULT_DTYPES = ("float16",)
DEFAULT_MIN_CC = (7, 0)


def _load() -> dict[str, ModuleType]:
    phases = {}
    for name in _MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        phases[module.ID] = module
    return phases


class Variant:
    """Another build of a phase's kernel ("06-inline"): the phase's attributes, its own id and build.

    It is not a lesson or an exercise of its own (PHASES holds those); it is a row of the
    benchmark and a value of `attention(..., phase=...)`.
    """

    def __init__(self, phase: ModuleType, key: str, title: str):
        self.phase = phase
        self.key = key
        self.ID = f"{phase.ID}-{key}"
        self.NAME = f"{phase.NAME}-{key}"
        self.TITLE = title
        self.__doc__ = phase.__doc__

    def build(self, head_dim: int, **options):
        return self.phase.build(head_dim, self.key, **options)

    def __getattr__(self, name):  # HEAD_DIMS, DTYPES, MIN_CC, ... are the phase's
        return getattr(self.phase, name)

    def __repr__(self):
        return f"<variant {self.ID} of phase {self.phase.ID}>"


PHASES: dict[str, ModuleType] = _load()
VARIANTS: dict[str, Variant] = {
    v.ID: v for phase in PHASES.values()
    for v in (Variant(phase, key, text) for key, text in getattr(phase, "VARIANTS", {}).items())
}
# Every kernel, in ladder order: each phase followed by its variants ("06", "06-inline").
KERNELS: dict = {k.ID: k for k in sorted([*PHASES.values(), *VARIANTS.values()], key=lambda k: k.ID)}

# Phases of the course that are no rung of the forward ladder: phase 11 (the backward pass), phase
# 12 (its kv_kernel on wgmma) and phase 13 (that kv_kernel warp-specialized, fed by TMA) have a
# lesson and an exercise each, but no kernel(Q, K, V, O, causal, qk_scale) to benchmark beside the
# others or to pick with attention(phase=...): attention()'s autograd runs 13 on Hopper (12 when
# deterministic) and 11 elsewhere (runtime/torch_ops.autograd_backward_phase). Phase 14's kernel
# takes a user's mods and a block mask: flashcore_numba.flex_attention calls it.
_COURSE_ONLY = ("p11_backward", "p12_backward_wgmma", "p13_backward_ws", "p14_flex")
# Every phase with a lesson and an exercise, in course order.
LESSONS: dict[str, ModuleType] = {**PHASES, **{m.ID: m for m in (importlib.import_module(f"{__name__}.{name}")
                                                              for name in _COURSE_ONLY)}}


def backward_phase(phase_id: str = "11") -> ModuleType:
    """The module whose kernels a backward runs: "11" (mma.sync, sm_80 on), "12" (phase 11's with
    its kv_kernel on wgmma, Hopper only) or "13" (phase 12's, warp-specialized and fed by TMA,
    Hopper only). Each builds a p11_backward.Backward."""
    names = {"11": "p11_backward", "12": "p12_backward_wgmma", "13": "p13_backward_ws"}
    if phase_id not in names:
        raise ValueError(f"phase: the backward phases are {', '.join(names)}, not {phase_id!r}")
    return importlib.import_module(f"{__name__}.{names[phase_id]}")


def _best() -> str:
    """The newest phase of the ladder for every shape, built the fastest way it has (its FASTEST
    variant, when it names one). A phase for decoding (DECODE: phase 10 splits the keys of a few
    query rows) is not: `attention(phase="best")` gives it the shapes it serves (api.best_for_shape)."""
    newest = PHASES[max(i for i, p in PHASES.items() if not getattr(p, "DECODE", False))]
    fastest = getattr(newest, "FASTEST", None)
    return f"{newest.ID}-{fastest}" if fastest else newest.ID


BEST = _best()


def dtypes(phase: ModuleType) -> tuple[str, ...]:
    return getattr(phase, "DTYPES", DEFAULT_DTYPES)


def build(phase, head_dim: int, dtype: str = "float16", value_dim: int | None = None):
    """`phase.build(head_dim)`, or for another dtype `phase.build(head_dim, dtype=dtype)`.

    Phases 01-06 build fp16 kernels only and take no dtype; a phase whose DTYPES lists more
    builds one kernel per dtype. The caller has checked that the phase supports `dtype`. The
    config comes back with its `cache_key`, (id, head dim, dtype): launches of it load the
    kernel from the disk cache instead of compiling it in every process.
    """
    if dtype not in dtypes(phase):
        raise ValueError(f"dtype: phase {phase.ID} supports {' and '.join(dtypes(phase))}, not {dtype}")
    value_dim = None if value_dim == head_dim else value_dim
    if value_dim is not None:  # V and O of a head dim of their own (MLA): phase 07 (supports_value_dim)
        if not supports_value_dim(phase, head_dim, value_dim):
            raise ValueError(f"value head dim: phase {phase.ID} does not take v's head dim {value_dim} beside "
                             f"q's {head_dim}")
        config = phase.build(head_dim, dtype=dtype, value_dim=value_dim)
    else:
        config = phase.build(head_dim) if dtype == DEFAULT_DTYPES[0] else phase.build(head_dim, dtype=dtype)
    if not isinstance(config, KernelConfig):
        return config
    keyed = _KEYED.get(config)
    if keyed is None:  # the same kernel, named: its compiled code is kept on disk under this name (arch/cache.py)
        identity = (phase.ID, int(head_dim), dtype) + (() if value_dim is None else (int(value_dim),))
        keyed = _KEYED[config] = dataclasses.replace(config, cache_key=identity)
    return keyed


_KEYED: dict = {}  # a phase's config -> the same config with its cache key


@functools.lru_cache(maxsize=None)
def build_kvcache(head_dim: int, dtype: str = "float16", variant: str | None = None) -> KernelConfig:
    """attention_kvcache's kernel (flashcore_numba.inference): phase 10 built `paged` (its variant
    "batch" for batches that fill the GPU, p10.batch_fills_gpu), kept in the disk cache as
    ("10-kvcache", head dim, dtype) or ("10-batch-kvcache", ...). One config per kernel, made once:
    every call asks for it."""
    config = PHASES["10"].build(head_dim, variant, dtype=dtype, paged=True)
    name = "10-kvcache" if variant is None else f"10-{variant}-kvcache"
    return dataclasses.replace(config, cache_key=(name, int(head_dim), dtype))


@functools.lru_cache(maxsize=None)
def build_trace(head_dim: int, dtype: str = "float16", variant: str | None = None) -> KernelConfig:
    """Phase 09 (or its variant "ws", "turns", "overlap") built with the trace (phases/tracing.py,
    read by measure/trace.py), kept in the disk cache as ("09-trace" or "09-<variant>-trace", head
    dim, dtype); made once, as build_kvcache."""
    p09 = PHASES["09"]
    traced = dataclasses.replace(p09.BUILDS[variant], trace=True)
    config = p09.build_kernel(p09.layout(head_dim), dtype, traced)
    name = "09" + (f"-{variant}" if variant else "") + "-trace"
    return dataclasses.replace(config, cache_key=(name, int(head_dim), dtype))


@functools.lru_cache(maxsize=None)
def build_varlen(phase_id: str, head_dim: int, dtype: str = "float16", value_dim: int | None = None) -> KernelConfig:
    """attention_varlen's kernel on phase 07 or 09 (flashcore_numba.inference), built `varlen`,
    kept in the disk cache as ("<phase>-varlen", head dim, dtype[, v's head dim]); made once, as
    build_kvcache. value_dim: v's and the output's head dim where it is not q's (MLA's 128 beside
    192: supports_value_dim says which phase takes the pair)."""
    value_dim = None if value_dim == head_dim else value_dim
    if phase_id == "09":
        config = PHASES["09"].build(head_dim, None, dtype, varlen=True, value_dim=value_dim)
    else:
        config = PHASES["07"].build(head_dim, dtype, varlen=True, value_dim=value_dim)
    identity = (f"{phase_id}-varlen", int(head_dim), dtype) + (() if value_dim is None else (int(value_dim),))
    return dataclasses.replace(config, cache_key=identity)


def min_cc(phase: ModuleType) -> tuple[int, int]:
    return getattr(phase, "MIN_CC", DEFAULT_MIN_CC)


def cc_reason(phase, cc) -> str | None:
    """Why `phase` cannot run on a GPU of compute capability `cc`, or None when it can.

    A phase names its lowest capability (MIN_CC) and, when its instructions exist on one
    architecture only, its highest (MAX_CC): wgmma is Hopper's (sm_90a), not Blackwell's.
    """
    cc = tuple(cc)
    low, high = min_cc(phase), getattr(phase, "MAX_CC", None)
    if cc < tuple(low):
        return f"phase {phase.ID} needs compute capability {low[0]}.{low[1]}, this GPU has {cc[0]}.{cc[1]}"
    if high is not None and cc > tuple(high):
        return (f"phase {phase.ID} runs on compute capability {high[0]}.{high[1]} only (its instructions exist "
                f"there alone), this GPU has {cc[0]}.{cc[1]}")
    return None


def supports_gqa(phase: ModuleType) -> bool:
    return getattr(phase, "GQA", False)


def supports_head_dim(phase, head_dim) -> bool:
    """Whether `phase` is built for head dim `head_dim`: one of its HEAD_DIMS, or for a phase that
    takes more (phase 07: `runs_head_dim`, any multiple of 8 up to 256), whatever that says."""
    runs = getattr(phase, "runs_head_dim", None)
    return bool(runs(head_dim)) if runs is not None else head_dim in phase.HEAD_DIMS


def supports_value_dim(phase, head_dim=None, value_dim=None) -> bool:
    """Whether `phase` takes v (and writes the output) with a head dim of its own, as MLA's 192 for q
    and k and 128 for v (VALUE_HEAD_DIM: phases 07 and 09); with both head dims, whether it takes
    that pair (phase 09's `runs_value_dim`, where it has one)."""
    if not getattr(phase, "VALUE_HEAD_DIM", False):
        return False
    runs = getattr(phase, "runs_value_dim", None)
    if runs is None or head_dim is None or value_dim is None:
        return True
    return bool(runs(head_dim, value_dim))


def head_dims_text(phase) -> str:
    """The head dims `phase` takes, as a sentence's end: "64, 128", or phase 07's HEAD_DIMS_TEXT."""
    return getattr(phase, "HEAD_DIMS_TEXT", None) or ", ".join(map(str, phase.HEAD_DIMS))


def unsupported_head_dim(name: str, head_dim: int, phase) -> str:
    """The message refusing argument `name`'s head dim on `phase`: what that phase takes, and what
    phase 07, the phase built for every head dim it can be, takes."""
    wider = PHASES["07"]
    also = "" if phase is wider else f"; phase 07 takes {head_dims_text(wider)}"
    return f"{name}: head dim {head_dim} is not supported by phase {phase.ID} (it takes {head_dims_text(phase)}){also}"


def supports_lse(phase: ModuleType) -> bool:
    """Whether the phase's kernels can write each row's log-sum-exp (`return_lse`; 07 on)."""
    return getattr(phase, "LSE", False)


def get_lesson(phase):
    """Look a phase of the course up (LESSONS: the ladder, then phase 11) by id ("11", 11), name
    ("backward") or module; a kernel's variant ("06-inline") gives its phase."""
    if isinstance(phase, ModuleType) and getattr(phase, "ID", None) in LESSONS:
        return phase
    if isinstance(phase, int) and not isinstance(phase, bool):
        phase = f"{phase:02d}"
    if isinstance(phase, str):
        key = f"{int(phase):02d}" if phase.strip().isdigit() else phase.strip()
        for module in LESSONS.values():
            if key in (module.ID, module.NAME, module.__name__.rsplit(".", 1)[-1]):
                return module
    try:
        kernel = get_phase(phase)
    except ValueError:
        known = ", ".join(f"{m.ID} ({m.NAME})" for m in LESSONS.values())
        raise ValueError(f"phase: unknown phase {phase!r}; the course's phases are {known}") from None
    return getattr(kernel, "phase", kernel)


def get_phase(phase):
    """Look a kernel up by id ("03", 3, "06-inline"), name ("warp_shuffle"), module name or "best"."""
    if isinstance(phase, (ModuleType, Variant)) and getattr(phase, "ID", None) in KERNELS:
        return phase
    key = phase
    if isinstance(phase, bool) or not isinstance(phase, (str, int)):
        raise TypeError(f"phase: expected a phase id such as '03', an int or 'best'; got {type(phase).__name__}")
    if isinstance(phase, int):
        key = f"{phase:02d}"
    elif phase == "best":
        key = BEST
    elif phase.isdigit():
        key = f"{int(phase):02d}"
    else:
        for kernel in KERNELS.values():
            if phase in (kernel.NAME, getattr(kernel, "__name__", "").rsplit(".", 1)[-1]):
                return kernel
    if key in KERNELS:
        return KERNELS[key]
    known = ", ".join(f"{m.ID} ({m.NAME})" for m in KERNELS.values())
    raise ValueError(f"phase: unknown phase {phase!r}; expected 'best' or one of {known}")

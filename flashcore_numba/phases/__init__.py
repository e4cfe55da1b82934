"""The phase ladder: one module per optimization, in teaching order.

Each phase module defines ID ("01"), NAME, TITLE, HEAD_DIMS, a docstring changelog, and
`build(head_dim) -> KernelConfig`. Every kernel has the signature
`kernel(Q, K, V, O, causal, qk_scale)` (see flashcore_numba.phases.common). Later phases add
DTYPES (bf16), GQA support and a minimum compute capability; the defaults below say what
phases 01-05 support.
"""

from __future__ import annotations

import importlib
from types import ModuleType

_MODULES = (
    "p01_naive",
    "p02_smem_tiling",
    "p03_warp_shuffle",
    "p04_padding",
    "p05_double_buffer",
)

DEFAULT_DTYPES = ("float16",)
DEFAULT_MIN_CC = (7, 0)


def _load() -> dict[str, ModuleType]:
    phases = {}
    for name in _MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        phases[module.ID] = module
    return phases


PHASES: dict[str, ModuleType] = _load()
BEST = max(PHASES)


def dtypes(phase: ModuleType) -> tuple[str, ...]:
    return getattr(phase, "DTYPES", DEFAULT_DTYPES)


def min_cc(phase: ModuleType) -> tuple[int, int]:
    return getattr(phase, "MIN_CC", DEFAULT_MIN_CC)


def supports_gqa(phase: ModuleType) -> bool:
    return getattr(phase, "GQA", False)


def get_phase(phase) -> ModuleType:
    """Look a phase up by id ("03", 3), name ("warp_shuffle"), module name or "best"."""
    if isinstance(phase, ModuleType) and getattr(phase, "ID", None) in PHASES:
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
        for module in PHASES.values():
            if phase in (module.NAME, module.__name__.rsplit(".", 1)[-1]):
                return module
    if key in PHASES:
        return PHASES[key]
    known = ", ".join(f"{m.ID} ({m.NAME})" for m in PHASES.values())
    raise ValueError(f"phase: unknown phase {phase!r}; expected 'best' or one of {known}")

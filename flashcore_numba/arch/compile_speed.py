"""Numba's inliner, made to copy a device function's IR once per inlined call instead of once per block.

Every phase builds its kernel from device functions declared `inline=True`, which Numba inlines
into the kernel's own IR (InlineWorker.inline_ir) before typing. numba-cuda 0.30 copies the
callee's IR there block by block, each block with a deepcopy of its own, and each of those drags
a copy of the callee's whole Scope (every variable it has) along. For phase 09 at D = 128 that is
61 million deepcopy calls, 80 % of a compile (docs/tuning/compile_time.md; numba-cuda issue 688
reports the same). `shared_inline_memo()` runs the package's compiles with one deepcopy memo per
inline_ir call, so the callee's blocks share one copied Scope, as the callee's own blocks do. The
code Numba makes is unchanged: the PTX of 25 kernels (every phase at D = 64, the slow ones at
D = 128, the backward's) was the same both ways, and their compiles took 362 s instead of 639 s
together on an H200 machine's cores (docs/tuning/compile_time/). Only the package's own compiles
run with it (the kernel cache's build_cubin, the machine-code reports), only on the numba-cuda
versions it was checked on (CHECKED), and `FLASHCORE_SHARED_INLINE_MEMO=0` turns it off.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading

CHECKED = ("0.30.",)  # numba-cuda versions whose inline_ir this was checked against


class _SharedMemo:
    """What inline_ir sees as its `copy` module: deepcopy with the memo of the current inline_ir call."""

    memo = None

    def deepcopy(self, x, memo=None):
        return copy.deepcopy(x, memo if memo is not None else self.memo)

    def __getattr__(self, name):
        return getattr(copy, name)


def _applies() -> bool:
    if os.environ.get("FLASHCORE_SHARED_INLINE_MEMO", "1") == "0":
        return False
    try:
        import numba_cuda
        from numba.cuda.core import inline_closurecall
    except ImportError:
        return False
    return (numba_cuda.__version__.startswith(CHECKED) and getattr(inline_closurecall, "copy", None) is copy
            and hasattr(inline_closurecall.InlineWorker, "inline_ir"))


_depth = 0  # shared_inline_memo() blocks open (a compile inside another's keeps the outer patch)
_lock = threading.Lock()  # for _depth and the patch's going in and out, should two threads compile
_restore = None


@contextlib.contextmanager
def shared_inline_memo():
    """Within the block, Numba's inliner shares one deepcopy memo per inlined call (see above).
    Numba compiles under its global compiler lock, so no two compiles of a process copy at once."""
    global _depth, _restore
    with _lock:
        if _depth == 0 and _applies():
            _restore = _install()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _restore is not None:
                _restore()
                _restore = None


def _install():
    """The patch put in place; returns what takes it out."""
    from numba.cuda.core import inline_closurecall

    worker = inline_closurecall.InlineWorker
    original = worker.inline_ir
    shared = _SharedMemo()

    def inline_ir(self, *args, **kwargs):
        outer, shared.memo = shared.memo, {}
        try:
            return original(self, *args, **kwargs)
        finally:
            shared.memo = outer

    inline_closurecall.copy, worker.inline_ir = shared, inline_ir

    def restore():
        inline_closurecall.copy, worker.inline_ir = copy, original

    return restore

"""Kernels compiled ahead of time into the kernel cache (arch/cache.py): `flashcore compile`.

Each kernel compiles on one core, in a process of its own, so a machine with many cores fills the
cache for every phase, head dim and dtype in the time of the slowest few:

    flashcore compile --phases 09,09-ws --head-dims 64,128 --dtypes fp16,bf16 --jobs 16
"""

from __future__ import annotations


def kernels_to_compile(kernel_ids, head_dims, dtypes) -> list[tuple[str, int, str]]:
    """(kernel id, head dim, dtype) of every requested kernel that exists (a phase builds only the
    head dims and dtypes it lists)."""
    from ..phases import dtypes as phase_dtypes
    from ..phases import get_phase

    items = []
    for kernel_id in kernel_ids:
        kernel = get_phase(kernel_id)
        for head_dim in head_dims:
            for dtype in dtypes:
                if head_dim in kernel.HEAD_DIMS and dtype in phase_dtypes(kernel):
                    items.append((kernel.ID, int(head_dim), dtype))
    return items


def compile_one(kernel_id: str, head_dim: int, dtype: str, cc) -> bool:
    """Make sure the cache holds this kernel; True when it had to be compiled (a worker's job)."""
    from numba.cuda.core import sigutils

    from ..arch.cache import cached_cubin
    from ..phases import build, get_phase

    config = build(get_phase(kernel_id), head_dim, dtype)
    argtypes, _ = sigutils.normalize_signature(config.signature(dtype))
    return cached_cubin(config.kernel, argtypes, config.cache_key, tuple(cc)).built


def compile_all(items, cc, jobs: int = 1, done=None) -> list[tuple[tuple, bool | str]]:
    """Each (kernel id, head dim, dtype) of `items` compiled into the cache, `jobs` processes at a
    time (each kernel compiles on one core); `done(item, result)` after each. Returns (item, True
    compiled / False already cached / an error message) per item."""
    results = []
    if jobs <= 1:
        for item in items:
            try:
                result = compile_one(*item, cc)
            except Exception as e:  # noqa: BLE001 - reported per kernel, the others go on
                result = f"{type(e).__name__}: {e}"
            results.append((item, result))
            if done:
                done(item, result)
        return results
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(compile_one, *item, tuple(cc)): item for item in items}
        for future in as_completed(futures):
            item = futures[future]
            try:
                result = future.result()
            except Exception as e:  # noqa: BLE001
                result = f"{type(e).__name__}: {e}"
            results.append((item, result))
            if done:
                done(item, result)
    return results

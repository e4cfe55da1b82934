"""Kernels compiled ahead of time into the kernel cache (arch/cache.py): `flashcore compile`.

Each kernel compiles on one core, in a process of its own, so a machine with many cores fills the
cache for every phase, head dim and dtype in the time of the slowest few:

    flashcore compile --phases 09,09-ws --head-dims 64,128 --dtypes fp16,bf16 --jobs 16

Besides the ladder's kernels (the ids of `flashcore bench --phases`), it compiles what the other
entry points launch: "10-kvcache" (attention_kvcache), "07-varlen" and "09-varlen"
(attention_varlen), "11", "12" and "13" (the backward of attention()'s autograd: phase 13's on
Hopper, 12's there when deterministic, phase 11's elsewhere; `flashcore bench --backward` times all three) and "09-trace" (phase 09's
trace build, measure/trace.py: the GPU suite launches it), each cached under the key
its own launch looks up, so that none of them compiles in a new process either. With value head
dims (`--value-dims`: MLA's v of 128 beside q's and k's 192) it also compiles the forward kernels
that take such a pair (phases 07 and 09, attention() and attention_varlen), keyed as their launches
key them.
"""

from __future__ import annotations


def _of_config(config, dtype: str) -> list:
    """A config's one kernel, as its launch keys it in the cache (phases.build and its kin)."""
    return [(config.kernel, config.signature(dtype), config.cache_key)]


def _kvcache_kernels(head_dim: int, dtype: str, cc) -> list:
    """attention_kvcache's kernels (phases.build_kvcache): phase 10 built paged, and its variant
    "batch" (KVCachePlan runs it for batches that fill the GPU)."""
    from ..phases import build_kvcache

    return _of_config(build_kvcache(head_dim, dtype), dtype) + _of_config(build_kvcache(head_dim, dtype, "batch"),
                                                                           dtype)


def _varlen_kernels(phase_id: str):
    """attention_varlen's kernel on phase `phase_id` (phases.build_varlen), v of its own head dim
    where value_dim is given."""

    def kernels(head_dim: int, dtype: str, cc, value_dim: int | None = None) -> list:
        from ..phases import build_varlen

        return _of_config(build_varlen(phase_id, head_dim, dtype, value_dim), dtype)

    return kernels


def _trace_kernels(head_dim: int, dtype: str, cc) -> list:
    """Phase 09's trace build (phases.build_trace; measure/trace.py and tools/stalls.py launch it)."""
    from ..phases import build_trace

    return _of_config(build_trace(head_dim, dtype, None), dtype)  # as measure.trace.trace_config calls it


def _backward_kernels(phase_id: str):
    """The backward's kernels, as runtime/backward.py's plan loads them: every kernel view of phase
    11 (or of phase 12: its kv_kernel on wgmma, phase 11's Δ and sum) under its cache id, one after
    another in one job. (11-sum, one kernel for every head dim and dtype, is in every job: jobs that
    run at once may each compile it; the cache keeps one.) Phase 12 exists on Hopper (cc 9.0) alone:
    for another GPU it has nothing to compile."""

    def kernels(head_dim: int, dtype: str, cc) -> list:
        from ..phases import backward_phase, cc_reason

        module = backward_phase(phase_id)
        if cc_reason(module, cc[:2]):
            return []
        bw = module.build(head_dim, dtype, cc)
        return [(view.kernel, view.types, bw.cache_id(kernel_id))
                for kernel_id, view in module.kernel_views(head_dim, dtype, cc).items()]

    return kernels


# The kernels no rung of the ladder names, which the other entry points launch: id -> (the phase
# whose head dims and dtypes it has, a function (head dim, dtype, cc) -> [(kernel, its signature,
# its cache identity)], each as that entry point keys it in the disk cache (arch/cache.py)
EXTRA_KERNELS = {
    "10-kvcache": ("10", _kvcache_kernels),
    "07-varlen": ("07", _varlen_kernels("07")),
    "09-varlen": ("09", _varlen_kernels("09")),
    "11": ("11", _backward_kernels("11")),
    "12": ("12", _backward_kernels("12")),  # phase 12's kv_kernel: autograd's on Hopper up to D = 128
    "13": ("13", _backward_kernels("13")),  # phase 13's: warp-specialized, fed by TMA (Hopper)
    "09-trace": ("09", _trace_kernels),
}


def kernel_ids() -> list[str]:
    """Every id `flashcore compile` takes: the ladder's kernels (phases.KERNELS), then EXTRA_KERNELS."""
    from ..phases import KERNELS

    return [*KERNELS, *EXTRA_KERNELS]


def kernels_to_compile(kernel_ids, head_dims, dtypes, value_dims=()) -> list[tuple]:
    """(kernel id, head dim, dtype) of every requested kernel that exists (a phase builds only the
    head dims and dtypes it lists; an id of EXTRA_KERNELS, those of its phase); for each of
    value_dims, (kernel id, head dim, dtype, value dim) of the kernels that take that pair."""
    from ..phases import LESSONS, get_phase
    from ..phases import dtypes as phase_dtypes
    from ..phases import supports_head_dim

    items = []
    for kernel_id in kernel_ids:
        if kernel_id in EXTRA_KERNELS:
            kernel = LESSONS[EXTRA_KERNELS[kernel_id][0]]
        else:
            kernel = get_phase(kernel_id)
            kernel_id = kernel.ID
        for head_dim in head_dims:
            for dtype in dtypes:
                if supports_head_dim(kernel, head_dim) and dtype in phase_dtypes(kernel):
                    items.append((kernel_id, int(head_dim), dtype))
                for value_dim in value_dims:  # (kernel id, head dim, dtype, v's head dim): MLA's pairs
                    if takes_value_dim(kernel_id, kernel, head_dim, value_dim) and dtype in phase_dtypes(kernel):
                        items.append((kernel_id, int(head_dim), dtype, int(value_dim)))
    return items


VALUE_DIM_KERNELS = ("07-varlen", "09-varlen")  # besides the ladder's phases that take one (07, 09)


def takes_value_dim(kernel_id: str, kernel, head_dim: int, value_dim: int) -> bool:
    """Whether the kernel `kernel_id` (of phase `kernel`) is built for v of head dim value_dim beside
    q's and k's head_dim: a forward kernel of a phase that takes the pair (supports_value_dim)."""
    from ..phases import KERNELS, supports_head_dim, supports_value_dim

    forward = kernel_id in VALUE_DIM_KERNELS or (kernel_id in KERNELS and "-" not in kernel_id)
    return (forward and value_dim != head_dim and supports_head_dim(kernel, head_dim)
            and supports_head_dim(kernel, value_dim) and supports_value_dim(kernel, head_dim, value_dim))


def kernels_of(kernel_id: str, head_dim: int, dtype: str, cc, value_dim: int | None = None) -> list:
    """[(kernel, signature, cache identity)] that compiling `kernel_id` at this head dim and dtype
    (and v's head dim, value_dim) puts in the cache: a ladder kernel's one (phases.build), or an
    EXTRA_KERNELS entry's."""
    if kernel_id in EXTRA_KERNELS:
        extra = EXTRA_KERNELS[kernel_id][1]
        return extra(head_dim, dtype, tuple(cc)) if value_dim is None else extra(head_dim, dtype, tuple(cc), value_dim)
    from ..phases import build, get_phase

    return _of_config(build(get_phase(kernel_id), head_dim, dtype, value_dim=value_dim), dtype)


def compile_one(kernel_id: str, head_dim: int, dtype: str, cc, value_dim: int | None = None) -> bool:
    """Make sure the cache holds this kernel (or an extra id's kernels); True when one had to be
    compiled (a worker's job)."""
    from numba.cuda.core import sigutils

    from ..arch.cache import cached_cubin

    built = False
    for kernel, signature, identity in kernels_of(kernel_id, head_dim, dtype, cc, value_dim):
        argtypes, _ = sigutils.normalize_signature(signature)
        built |= cached_cubin(kernel, argtypes, identity, tuple(cc)).built
    return built


def compile_all(items, cc, jobs: int = 1, done=None) -> list[tuple[tuple, bool | str]]:
    """Each (kernel id, head dim, dtype) of `items` compiled into the cache, `jobs` processes at a
    time (each kernel compiles on one core); `done(item, result)` after each. Returns (item, True
    compiled / False already cached / an error message) per item."""
    results = []
    if jobs <= 1:
        for item in items:
            try:
                result = compile_one(*item[:3], cc, *item[3:])
            except Exception as e:  # noqa: BLE001 - reported per kernel, the others go on
                result = f"{type(e).__name__}: {e}"
            results.append((item, result))
            if done:
                done(item, result)
        return results
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(compile_one, *item[:3], tuple(cc), *item[3:]): item for item in items}
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

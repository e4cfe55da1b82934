"""Dynamic shared memory beyond the 48 KB a block may use without asking.

A launch that asks for more dynamic shared memory than 48 KB fails with
CUDA_ERROR_INVALID_VALUE unless the kernel's limit was raised first with the driver attribute
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES. Numba has no API for it, so the driver call is
made here, on the compiled function; `phases.common.launch` calls it whenever a phase asks for
more than STATIC_SMEM_LIMIT. The attribute cannot go past the hardware's per-block maximum:
227 KB on an H100 (sm_90), 163 KB on an A100 (sm_80), 99 KB on most GeForce RTX cards.
"""

from __future__ import annotations

from numba import cuda, types

STATIC_SMEM_LIMIT = 48 * 1024  # bytes a block may use without raising its dynamic limit

# The most shared memory a block can have (the driver's opt-in limit), by compute capability
_SMEM_PER_BLOCK = {(8, 0): 166_912, (8, 7): 166_912, (9, 0): 232_448, (10, 0): 232_448}
_SMEM_PER_BLOCK_LEAST = 101_376  # sm_86, sm_89, sm_120: GeForce RTX and workstation cards


def smem_per_block(cc: tuple) -> int:
    """The most shared memory, static and dynamic, one block can have on a GPU of compute capability
    cc, in bytes; a GPU not listed is assumed to have the least of them."""
    return _SMEM_PER_BLOCK.get(tuple(cc)[:2], _SMEM_PER_BLOCK_LEAST)

_smem_limit_raised: set = set()


def raise_dynamic_smem_limit(kernel, args, nbytes: int) -> None:
    """Allow `kernel` to use more than 48 KB of dynamic shared memory.

    Numba has no API for this; the driver call is made on the compiled function. Done once
    per compiled specialization, the one the Numba types of `args` select. This runs before
    every launch, so the types are found the quick way where there is one: a device array
    carries its Numba type (cached on the array); typing every array again cost more host time
    than a short launch of phase 09 takes on the GPU.
    """
    argtypes = argument_types(kernel, args)
    key = (id(kernel), argtypes, nbytes)
    if key in _smem_limit_raised:
        return
    from cuda.bindings import driver

    compiled = kernel.compile(argtypes)
    cufunc = compiled.library.get_cufunc()
    device_id = cuda.get_current_device().id
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    (err,) = driver.cuKernelSetAttribute(attr, nbytes, cufunc.handle, device_id)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"could not raise the dynamic shared memory limit to {nbytes} bytes: {err}")
    _smem_limit_raised.add(key)


def argument_types(kernel, args) -> tuple:
    """The Numba types `kernel` is launched with for `args` (the key of its compiled overloads)."""
    return tuple(_numba_type(kernel, a) for a in args)


# Python scalars Numba types by their class alone (an int's type depends on its value: typed)
_SCALAR_TYPES = {bool: types.boolean, float: types.float64}


def _numba_type(kernel, arg):
    """The Numba type `arg` is launched as: a device array's cached one, a bool's or a float's,
    else typed here (about 3 us each)."""
    numba_type = getattr(arg, "_numba_type_", None) or _SCALAR_TYPES.get(type(arg))
    return kernel.typeof_pyval(arg) if numba_type is None else numba_type

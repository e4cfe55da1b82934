"""A compiled kernel launched through the CUDA driver, below Numba's dispatcher.

Numba compiles the kernels; what it does on every launch costs more host time than a short
kernel runs (typing each argument, wrapping each array, packing the parameters: 100-500 us per
call, docs/tuning/09_history.md). A caller that launches the same kernel on
arrays of the same shapes again and again can do that work once. This module is the driver's
side of it:

    cubin, entry = build_cubin(dispatcher, argtypes, (9, 0))     # Numba's own compile, no launch
    kernel = load_kernel(cubin, entry)                           # cuLibraryLoadData + cuLibraryGetKernel
    with cuda.gpus[0]:
        kernel.function = function_of(kernel)                    # its CUfunction in the device's context
    slots = ArgSlots([ArrayArg(q_shape, 2), ..., ScalarArg("bool", True), ...])
    launcher = Launcher(kernel, grid, block, smem, slots)        # the launch's values, made once
    slots.set_pointer(0, q.data_ptr()); ...                      # per call: the data pointers only
    launcher(stream)                                             # cuLaunchKernel

Numba's kernel ABI (numba-cuda 0.30, dispatcher `_Kernel._prepare_args`): each argument becomes
consecutive kernel parameters. An array of N dimensions is 5 + 2N 64-bit parameters: meminfo and
parent (both 0 for a device array), the element count, the item size, the data pointer, the N
extents and the N strides in bytes. A boolean is one byte, a float32 four, an int32 four. There
is no hidden parameter. `ArgSlots` lays each parameter in an 8-byte slot of one buffer, with
the array of their addresses the driver reads (`kernelParams`), and `check` compares the count
and sizes with what the cubin declares for the kernel (its EIATTR_KPARAM_INFO), once per load.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from functools import lru_cache

_SCALARS = {"bool": ctypes.c_bool, "int32": ctypes.c_int32, "uint32": ctypes.c_uint32,
            "float32": ctypes.c_float, "int64": ctypes.c_int64, "uint64": ctypes.c_uint64}


@dataclass(frozen=True)
class ArrayArg:
    """A C-contiguous device array argument: its shape and item size (its pointer comes per call)."""

    shape: tuple
    itemsize: int

    @property
    def n_params(self) -> int:
        return 5 + 2 * len(self.shape)


@dataclass(frozen=True)
class ScalarArg:
    kind: str  # a key of _SCALARS
    value: object

    n_params = 1


class ArgSlots:
    """The kernel's parameters in 8-byte slots, and `params`, the address of the void*[] of their
    addresses that cuLaunchKernel reads. Everything but the arrays' data pointers is written once."""

    def __init__(self, args):
        self.args = tuple(args)
        n = sum(a.n_params for a in self.args)
        self._slots = (ctypes.c_uint64 * n)()
        base = ctypes.addressof(self._slots)
        self._pointers = (ctypes.c_void_p * n)(*(base + 8 * i for i in range(n)))
        self.params = ctypes.addressof(self._pointers)
        self.sizes, self.data_slot, self._arg_slot, i = [], [], [], 0
        self._last = [0] * len(self.args)  # the data pointers last written (set_pointers)
        for a in self.args:
            self._arg_slot.append(i)
            if isinstance(a, ArrayArg):
                strides, step = [], a.itemsize
                for extent in reversed(a.shape):
                    strides.insert(0, step)
                    step *= extent
                count = 1
                for extent in a.shape:
                    count *= extent
                values = [0, 0, count, a.itemsize, 0, *a.shape, *strides]
                for j, value in enumerate(values):
                    self._slots[i + j] = value
                self.data_slot.append(i + 4)
                self.sizes += [8] * len(values)
            else:
                value = _SCALARS[a.kind](a.value)
                ctypes.memmove(base + 8 * i, ctypes.addressof(value), ctypes.sizeof(value))
                self.data_slot.append(None)
                self.sizes.append(ctypes.sizeof(value))
            i += a.n_params

    def set_pointer(self, arg: int, address: int) -> None:
        """The data pointer of array argument number `arg` (its position in the argument list)."""
        self._slots[self.data_slot[arg]] = self._last[arg] = address

    def set_pointers(self, args, addresses) -> None:
        """The data pointers of array arguments `args` (their positions), written where they differ from
        the last ones written here: a plan's loop passes the same cache, lengths and workspace on
        every call, and a new q and output (a ctypes store costs about 0.3 us)."""
        last, slots, data_slot = self._last, self._slots, self.data_slot
        for arg, address in zip(args, addresses):
            if last[arg] != address:
                slots[data_slot[arg]] = last[arg] = address

    def set_shape(self, arg: int, shape) -> None:
        """A new shape for array argument number `arg` (C-contiguous, as every argument here): its
        element count, extents and strides, for a kernel whose arrays change length from call to
        call (attention_varlen's packed rows). Its number of dimensions is the compiled kernel's."""
        a = self.args[arg]
        if len(shape) != len(a.shape):
            raise ValueError(f"argument {arg}: {len(shape)} dimensions, the kernel takes {len(a.shape)}")
        first, n = self.data_slot[arg] - 4, len(shape)  # the slot of meminfo: count is 2 on
        count, step = 1, a.itemsize
        for j in range(n - 1, -1, -1):
            self._slots[first + 5 + j] = shape[j]
            self._slots[first + 5 + n + j] = step
            step *= shape[j]
            count *= shape[j]
        self._slots[first + 2] = count

    def set_scalar(self, arg: int, value) -> None:
        """A new value for scalar argument number `arg`, of the kind it was made with."""
        slot = self._arg_slot[arg]
        c_value = _SCALARS[self.args[arg].kind](value)
        ctypes.memmove(ctypes.addressof(self._slots) + 8 * slot, ctypes.addressof(c_value), ctypes.sizeof(c_value))

    def values(self) -> list[int]:
        """Every slot as an integer (for tests)."""
        return list(self._slots)

    def check(self, cubin: bytes, entry: str) -> None:
        """Refuse a kernel whose parameters (count, sizes) are not these."""
        declared = param_sizes(cubin, entry)
        if declared != self.sizes:
            raise ValueError(f"kernel {entry}: its parameters are {declared} bytes, the arguments packed here "
                             f"are {self.sizes}; the argument types do not match the compiled kernel")


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------
def _driver():
    from cuda.bindings import driver

    return driver


def _check(result, what: str):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    return rest[0] if len(rest) == 1 else rest


@dataclass
class Kernel:
    """A kernel loaded from a cubin: its CUkernel (the same in every context), the CUlibrary that must
    stay loaded while it is used, and `function`, its CUfunction in the context it is launched in
    (`function_of`, set by whoever knows that context: runtime/plan.py's `loaded_kernel`)."""

    library: object
    handle: object
    entry: str
    function: object = None


def load_kernel(cubin: bytes, entry: str) -> Kernel:
    driver = _driver()
    library = _check(driver.cuLibraryLoadData(cubin, None, None, 0, None, None, 0), "cuLibraryLoadData")
    handle = _check(driver.cuLibraryGetKernel(library, entry.encode()), f"cuLibraryGetKernel({entry})")
    return Kernel(library, handle, entry)


def function_of(kernel: Kernel):
    """The kernel's CUfunction in the current context. A launch of it costs the host about 1 us less
    than a launch of the CUkernel, which the driver resolves to the current context's function on
    every call (docs/tuning/call_path.md, run 8)."""
    return _check(_driver().cuKernelGetFunction(kernel.handle), f"cuKernelGetFunction({kernel.entry})")


def set_dynamic_smem(kernel: Kernel, nbytes: int, device_id: int) -> None:
    """Allow more than 48 KB of dynamic shared memory (the driver refuses such a launch otherwise)."""
    driver = _driver()
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    _check(driver.cuKernelSetAttribute(attr, nbytes, kernel.handle, device_id), "cuKernelSetAttribute")


# The launch, made on every call, goes to the driver through cuda.bindings' cuLaunchKernel with the
# kernel's CUfunction, the parameter buffer's address as an integer and the stream as torch gives it
# (an integer): docs/tuning/call_path.md, run 8, measured it against ctypes' call of the same
# function and of the CUkernel in seven alternating rounds (4.6, 5.6 and 7.7 us medians). The memset
# (a plan's work counter, zeroed once per stream) goes through ctypes.
@lru_cache(maxsize=None)
def _libcuda():
    import sys

    lib = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    lib.cuMemsetD32Async.argtypes = [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p]
    lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    for name in ("cuMemsetD32Async", "cuCtxGetCurrent", "cuCtxSetCurrent", "cuDeviceGet", "cuDevicePrimaryCtxRetain"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


# ---------------------------------------------------------------------------------------------
# The context a launch runs in
# ---------------------------------------------------------------------------------------------
# cuLaunchKernel launches into the calling thread's current context. A thread that has done no
# CUDA work has none (autograd's device threads, a server's worker threads): torch's device
# guard does not make one current (it sees device 0 "current" already), and the launch fails
# with CUDA_ERROR_INVALID_CONTEXT. So every launch path makes the device's primary context (the
# one Numba and torch share) current around its launches, and puts back what was there.
@lru_cache(maxsize=None)
def primary_context(device_index: int) -> int:
    """The handle of device `device_index`'s primary context, retained once for the process."""
    lib, device, context = _libcuda(), ctypes.c_int(), ctypes.c_void_p()
    _check_code(lib.cuDeviceGet(ctypes.byref(device), device_index), f"cuDeviceGet({device_index})")
    _check_code(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    return int(context.value)


def make_current(context: int) -> int:
    """Make `context` the calling thread's current context; returns the one that was current (0 for
    none), which `restore` puts back where there was one. One driver call when it already is
    (about 0.2 us)."""
    lib, current = _libcuda(), ctypes.c_void_p()
    _check_code(lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    previous = current.value or 0
    if previous != context:
        _check_code(lib.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    return previous


def restore(previous: int, context: int) -> None:
    """Undo `make_current(context)`, which returned `previous`: another context is made current again;
    a thread that had none keeps `context`, the device's primary context. That is the context CUDA's
    runtime (torch's) binds to such a thread at its first call anyway, and taking it away again made
    cuBLAS warn "no current CUDA context" in the next torch op of autograd's backward thread, the
    thread where the backward's plan launches."""
    if previous and previous != context:
        _check_code(_libcuda().cuCtxSetCurrent(previous or None), "cuCtxSetCurrent")


def _check_code(err: int, what: str) -> None:
    if err:
        raise RuntimeError(f"{what} failed: {_error_name(err)}")


class Launcher:
    """cuLaunchKernel of one kernel's CUfunction with one grid, block, shared memory and parameter
    buffer, all settled once: a call passes only the stream (a CUstream handle as an int; 0: the
    legacy default stream)."""

    def __init__(self, kernel: Kernel, grid, block: int, smem: int, slots: ArgSlots):
        if kernel.function is None:
            raise ValueError(f"kernel {kernel.entry}: no CUfunction (set kernel.function = "
                             f"function_of(kernel) in the context it is launched in)")
        gx, gy, gz = grid
        self.kernel, self.slots = kernel, slots  # the buffer `params` points into stays alive
        self._dims = (int(gx), int(gy), int(gz), int(block), 1, 1, int(smem))
        self._launch = _driver().cuLaunchKernel

    @property
    def grid(self) -> tuple:
        return self._dims[:3]

    @grid.setter
    def grid(self, grid) -> None:
        """A new grid (a kernel whose grid follows the call's lengths: attention_varlen's)."""
        gx, gy, gz = grid
        self._dims = (int(gx), int(gy), int(gz), *self._dims[3:])

    def __call__(self, stream: int) -> None:
        (err,) = self._launch(self.kernel.function, *self._dims, stream, self.slots.params, 0)
        if err:  # CUDA_SUCCESS is 0
            raise RuntimeError(f"cuLaunchKernel({self.kernel.entry}) failed: {_error_name(err)}")


def memset32(address: int, value: int, count: int, stream: int) -> None:
    """`count` 32-bit words at `address` set to `value`, in stream order (a CUDA graph captures it)."""
    err = _libcuda().cuMemsetD32Async(address, value, count, stream)
    if err:
        raise RuntimeError(f"cuMemsetD32Async failed: {_error_name(err)}")


def _error_name(code) -> str:
    return _driver().CUresult(int(code)).name


# ---------------------------------------------------------------------------------------------
# Numba's compile, without a launch (and without a GPU)
# ---------------------------------------------------------------------------------------------
def build_cubin(dispatcher, argtypes, cc) -> tuple[bytes, str]:
    """(cubin, entry name) of `dispatcher` compiled for `argtypes` (a tuple of Numba types) on a GPU
    of compute capability `cc`: the steps of numba-cuda's `_Kernel` (compile, kernel fixup, launch
    bounds, the files it links), with the capability given instead of read from a device, then the
    cubin its `get_cufunc` would load (nvJitLink, `sm_90a` from 9.0 on). Byte for byte what Numba
    itself loads, so a cubin cached here runs as Numba's would."""
    import os

    from numba.cuda import dispatcher as numba_dispatcher
    from numba.cuda import types
    from numba.cuda.compiler import compile_cuda, kernel_fixup
    from numba.cuda.cudadrv import nvvm

    opts = dict(dispatcher.targetoptions)
    debug, fastmath = opts.get("debug", False), opts.get("fastmath", False)
    nvvm_options = {"fastmath": fastmath, "opt": 3 if opts.get("opt", True) else 0}
    from .compile_speed import shared_inline_memo

    with shared_inline_memo():  # the same code, compiled sooner (compile_speed.py)
        cres = compile_cuda(dispatcher.py_func, types.void, tuple(argtypes), debug=debug,
                            lineinfo=opts.get("lineinfo", False), forceinline=opts.get("forceinline", False),
                            fastmath=fastmath, nvvm_options=nvvm_options, cc=tuple(cc[:2]),
                            max_registers=opts.get("max_registers"), lto=opts.get("lto", False))
    library = cres.library
    entry = cres.fndesc.llvm_func_name
    function = library.get_function(entry)
    library._entry_name = entry
    kernel_fixup(function, debug)
    nvvm.set_launch_bounds(function, opts.get("launch_bounds"))
    full_cc = (cc[0], cc[1], "a" if tuple(cc[:2]) >= (9, 0) else "")
    link = list(opts.get("link") or [])
    asm = library.get_asm_str(cc=full_cc)  # what numba scans for the helpers it must link
    if any(name in asm for name in numba_dispatcher.reshape_funcs):
        link.append(os.path.join(os.path.dirname(numba_dispatcher.__file__), "reshape_funcs.cu"))
    numba_dispatcher._Kernel.maybe_link_nrt(numba_dispatcher._Kernel.__new__(numba_dispatcher._Kernel), link,
                                            cres.target_context, asm)
    for path in link:
        library.add_linking_file(path)
    return bytes(library.get_cubin(cc=full_cc).code), entry


# ---------------------------------------------------------------------------------------------
# What a cubin declares (its ELF sections), without nvdisasm
# ---------------------------------------------------------------------------------------------
def _sections(cubin: bytes) -> dict[str, bytes]:
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = cubin[headers[shstrndx][4]:headers[shstrndx][4] + headers[shstrndx][5]]
    return {names[h[0]:names.index(b"\0", h[0])].decode(): (cubin[h[4]:h[4] + h[5]] if h[1] != 8 else b"")
            for h in headers}


def kernel_names(cubin: bytes) -> list[str]:
    return [name[len(".text."):] for name in _sections(cubin) if name.startswith(".text.")]


def param_sizes(cubin: bytes, entry: str) -> list[int]:
    """The size in bytes of each of the kernel's parameters, in order (EIATTR_KPARAM_INFO, 0x17)."""
    info, i, params = _sections(cubin)[".nv.info." + entry], 0, []
    while i < len(info):
        fmt, attr = info[i], info[i + 1]
        if fmt == 0x04:  # a payload with its length
            (size,) = struct.unpack_from("<H", info, i + 2)
            payload, i = info[i + 4:i + 4 + size], i + 4 + size
        else:
            payload, i = info[i + 2:i + 4], i + (2 if fmt == 0x01 else 4)
        if attr == 0x17:
            _, ordinal, _, flags = struct.unpack_from("<IHHI", payload)
            params.append((ordinal, (flags >> 18) & 0x3FFF))
    return [size for _, size in sorted(params)]

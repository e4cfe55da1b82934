"""What the entry points take: an argument described (its kind, shape, dtype, device), torch
tensors as the arrays a kernel takes, and torch's current stream.

attention(), attention_kvcache() and attention_varlen() accept torch CUDA tensors, Numba device
arrays or NumPy arrays; each describes its arguments here, so that every message about a bad one
starts with the argument's name and the three entry points say it the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..arch.sim import simulator_enabled


@dataclass(frozen=True)
class Operand:
    name: str
    kind: str  # "numpy" | "numba" | "torch"
    shape: tuple
    dtype: str
    contiguous: bool
    device: str  # "host", "cuda:N"


def is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def is_device_array(x) -> bool:
    if simulator_enabled():  # the simulator's device arrays have no __cuda_array_interface__
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return isinstance(x, FakeCUDAArray)
    from numba import cuda

    return cuda.is_cuda_array(x) and hasattr(x, "dtype")


def describe(name: str, x) -> Operand:
    """`x` as an Operand named `name`, or the TypeError that says what it should have been."""
    if isinstance(x, np.ndarray):
        return Operand(name, "numpy", tuple(x.shape), x.dtype.name, bool(x.flags.c_contiguous), "host")
    if is_torch(x):
        device = str(x.device)
        if not x.is_cuda:
            raise TypeError(f"{name}: expected a CUDA torch tensor, got a tensor on {device}; "
                            f"move it with {name}.cuda() or pass a NumPy array")
        return Operand(name, "torch", tuple(x.shape), str(x.dtype).replace("torch.", ""),
                       bool(x.is_contiguous()), device)
    if is_device_array(x):
        contiguous = x.is_c_contiguous() if hasattr(x, "is_c_contiguous") else True
        return Operand(name, "numba", tuple(x.shape), np.dtype(x.dtype).name, bool(contiguous), "cuda")
    raise TypeError(f"{name}: expected a torch CUDA tensor, a Numba device array or a NumPy array; "
                    f"got {type(x).__name__}")


class DeviceArray:
    """A Numba device array as a plan takes arrays: its address by data_ptr() and its shape, as a torch
    tensor gives them (runtime/plan.py), and its __cuda_array_interface__ (the tensor maps read it)."""

    __slots__ = ("array", "shape")

    def __init__(self, array):
        self.array, self.shape = array, tuple(array.shape)

    def data_ptr(self) -> int:
        return self.array.__cuda_array_interface__["data"][0]

    @property
    def __cuda_array_interface__(self) -> dict:
        return self.array.__cuda_array_interface__


def torch_to_kernel(t):
    """A torch CUDA tensor as the Numba device array a kernel takes: the same memory.

    detach(): a tensor that requires grad (allowed under no_grad) hides its memory from
    __cuda_array_interface__; detach() is the same memory without the autograd record.
    bf16 travels as its int16 bit patterns: Numba has no bf16 type, and the kernels only move
    the bits to the tensor cores, which know them as bf16.
    """
    import torch
    from numba import cuda

    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return cuda.as_cuda_array(t)


_TORCH = None  # the torch module, once a call has imported it
_RAW_STREAM = None  # torch's raw current-stream accessor, where this torch has one


def torch_module():
    """torch, imported once: a call on torch tensors asks for it every time."""
    global _TORCH, _RAW_STREAM
    if _TORCH is None:
        import torch

        _RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _TORCH = torch
    return _TORCH


def current_stream(device: int) -> int:
    """torch's current stream on `device`, as the CUstream handle: torch's raw accessor (what
    Triton's launcher uses, 0.1 us) where it exists, else the public one (1.6 us)."""
    torch = _TORCH or torch_module()
    return _RAW_STREAM(device) if _RAW_STREAM is not None else torch.cuda.current_stream(device).cuda_stream

"""flex_attention's plan: phase 14's launch of one problem, settled once, as attention()'s Plan is.

What runtime/plan.py does for attention(), for phase 14's kernel with a user's mods compiled in
(on phase 09's kernel on Hopper, phase 07's elsewhere): the kernel loaded (from the disk cache, by
the mods' fingerprints), its parameters packed, the grid. A call writes the addresses of q, k, v,
the output and the LSE, of the block mask's lists and of the mods' bound arrays, and launches on
torch's current stream, in the device's primary context whatever thread calls:

    plan = FlexPlan("09", config, identity, "float16", q.shape, k.shape, v.shape, qk_scale, tail, 0)
    plan(q, k, v, out, lse, flat_arrays(tail), stream)

`tail` is what the kernel takes after its phase's own arguments: the block mask's lists (device
arrays, kept by flex_attention from the first call with that mask) and a tuple of each mod's bound
arrays. Numba passes a tuple of arrays as its arrays one after another, and so does the plan.

Phase 09's tensor maps of q, k and v come from the plan's DeviceMaps (runtime/plan.py): built on
the first call that uses those addresses, copied on the launch's stream from pinned memory. So a
call never waits for the GPU, where Numba's launch (phases.common.launch) built them with a
synchronous copy for every new address, and typed every argument on every call.
"""

from __future__ import annotations

import threading

import numpy as np

from ..arch import launch as driver
from ..arch import scratch
from ..arch.cache import CachedKernel, cached_cubin
from ..arch.launch import ArgSlots, ArrayArg, ScalarArg, build_cubin
from ..arch.smem import argument_types
from ..phases.common import ELEMENT
from .plan import ALIGNMENT_MASK, DeviceMaps, loaded_kernel, memory_device, misaligned


def flat_arrays(args) -> list:
    """The device arrays of `args`, a tuple's members in its place: the kernel's array parameters."""
    out = []
    for a in args:
        if isinstance(a, tuple):
            out += flat_arrays(a)
        else:
            out.append(a)
    return out


def address(array) -> int:
    """A Numba device array's data pointer (0 for an empty one)."""
    return array.__cuda_array_interface__["data"][0] or 0


class FlexPlan:
    """One flex_attention problem's launch on phase `base`'s kernel ("09" or "07") with the mods
    compiled in (`config`, cached under `identity`), for inputs of these shapes and the first call's
    `tail` (its arrays' shapes and types are the plan's). `torch_memory=False`: a plan of NumPy or
    Numba arrays (runtime/plan.py)."""

    def __init__(self, base: str, config, identity: tuple, dtype: str, q_shape, k_shape, v_shape, qk_scale, tail,
                 device_index: int, return_lse: bool = False, torch_memory: bool = True):
        from numba.cuda.core import sigutils

        B, H, S_q, D = q_shape
        cc, self.grid = device_facts(config, base, q_shape, device_index)
        if base == "09":  # phase 09's own arguments, as its signature types them
            head = config.signature(dtype)
        else:  # phase 07's: O as uint32 pairs, the LSE, the scale
            element = ELEMENT[dtype]
            head = f"void({', '.join(3 * [f'{element}[:,:,:,::1]'])}, uint32[:,:,:,::1], float32[:,:,::1], float32)"
        # then the tail, typed as Numba's launch types it (a tuple of arrays: a Tuple type)
        argtypes = self.argtypes = tuple(sigutils.normalize_signature(head)[0]) + argument_types(config.kernel, tail)
        if identity:
            cached = cached_cubin(config.kernel, argtypes, identity, cc)
        else:  # a mod whose code cannot be told (flex.py): compiled in this process, never cached
            cubin, entry = build_cubin(config.kernel, argtypes, cc)
            cached = CachedKernel(cubin, entry, ("unkept", id(config.kernel), argtypes), built=True)
        self.kernel = loaded_kernel(cached, device_index, config.smem_bytes)
        self.device_index, self.device = device_index, memory_device(device_index, torch_memory)
        self.return_lse, self.base = return_lse, base
        packed = base == "07" or config.packed_output  # O stored as uint32 pairs of 16-bit values
        out = ArrayArg((B, H, S_q, D // 2), 4) if packed else ArrayArg((B, H, S_q, D), 2)
        args = [ArrayArg(tuple(q_shape), 2), ArrayArg(tuple(k_shape), 2), ArrayArg(tuple(v_shape), 2), out,
                ArrayArg((B, H, S_q) if return_lse else (0, 0, 0), 4)]
        if base == "09":
            from ..arch.tma import describe_heads

            args += [ScalarArg("bool", False), ScalarArg("float32", float(np.float32(qk_scale))),
                     ArrayArg((3, 16), 8), ArrayArg((1,), 4)]  # the tensor maps, the work counter
            self.maps = DeviceMaps(self.device, config.tma_box, describe_heads, device_index)
        else:
            args.append(ScalarArg("float32", float(np.float32(qk_scale))))
        first_tail = len(args)
        args += [ArrayArg(tuple(a.shape), a.dtype.itemsize) for a in flat_arrays(tail)]
        self.slots = ArgSlots(args)
        self.slots.check(cached.cubin, cached.entry)
        # the array arguments a call writes, in the order of its addresses: q, k, v, out, lse, (09: the
        # maps and the counter), the tail's arrays
        self.arrays = (0, 1, 2, 3, 4) + ((7, 8) if base == "09" else ()) + tuple(range(first_tail, len(args)))
        self.launch = driver.Launcher(self.kernel, self.grid, config.n_threads, config.smem_bytes, self.slots)
        self.context = driver.primary_context(device_index)
        self._counters: dict = {}  # stream -> the address of its work counter (phase 09)
        self._lock = threading.Lock()

    def __call__(self, q, k, v, out, lse, flat_tail, stream: int) -> None:
        """Launch on these arrays (objects with data_ptr(): torch tensors, inputs.DeviceArray) and the
        tail's device arrays, flat (flat_arrays), of the shapes the plan was made for."""
        qkv = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        if (qkv[0] | qkv[1] | qkv[2]) & ALIGNMENT_MASK:
            misaligned("q, k, v", (q, k, v))
        addresses = [*qkv, out.data_ptr(), lse.data_ptr() if self.return_lse else 0]
        previous = driver.make_current(self.context)
        try:
            if self.base == "09":
                counter = self._counters.get(stream)
                if counter is None:  # the stream's counter at zero (arch/scratch.py), kept from then on
                    counter = self._counters[stream] = scratch.work_counter(self.device_index, stream,
                                                                            self.device).addresses[0]
                addresses += [self.maps.address(qkv, (q, k, v)), counter]
            addresses += [address(a) for a in flat_tail]
            with self._lock:  # the slots are this plan's: one launch packs them at a time
                self.slots.set_pointers(self.arrays, addresses)
                self.launch(stream)
        finally:
            driver.restore(previous, self.context)


def device_facts(config, base: str, q_shape, device_index: int) -> tuple:
    """(the device's compute capability, the launch grid) of phase `base`'s kernel for q's shape:
    phase 09's from its config (a block per SM where it is persistent), phase 07's a block per 64
    or 128 query rows of each head."""
    from numba import cuda

    B, H, S_q, D = q_shape
    with cuda.gpus[device_index]:
        cc = tuple(cuda.get_current_device().compute_capability)
        if base == "09":
            return cc, (tuple(config.grid((B, H, S_q, D), False)) + (1, 1))[:3]
    return cc, (-(-S_q // config.block_m), H, B)

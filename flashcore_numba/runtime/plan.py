"""A plan per problem: what a call of attention() on torch tensors needs, computed once.

Everything that depends only on the problem (the kernel, the shapes, the dtype, the causal flag,
the scale, the device) is settled when the plan is made: the kernel's cubin loaded (from the disk
cache, arch/cache.py, or compiled once), its shared-memory limit raised, the grid, and every
kernel parameter but the arrays' addresses packed in place (arch/launch.py). A call then writes
four data pointers and launches with one driver call on torch's current stream:

    plan = Plan("09", 64, "float16", q.shape, k.shape, causal=False, qk_scale=..., device_index=0)
    plan(q, k, v, out, stream)            # plan(q, k, v, out, stream, lse) with return_lse=True

A call runs in the device's primary context whatever thread makes it (arch/launch.py: a thread
that has done no CUDA work has no current context), and refuses an address the kernel cannot
take (its 16-byte copies) with a ValueError naming the argument, before anything launches.
Phase 10 also gets its workspace and phase 09 its work counter (arch/scratch.py: per stream,
zeroed once in that stream's order, then left at zero by every launch); phase 09 also gets, per
call, the tensor maps of q, k and v (built on the first call that uses those addresses, then
found by them; their device copy is made on the stream, from pinned host memory, so a CUDA graph
captures it). Nothing in a call synchronizes with the host or allocates outside torch's caching
allocator.

NumPy arrays and Numba device arrays take the same plans on a GPU (api.attention, inference.py):
made with `torch_memory=False`, a plan takes its own memory (scratch, tensor maps) from Numba's
allocator and torch is never imported; the arrays come as inputs.DeviceArray (a torch tensor's
data_ptr() and shape), and the call runs on the default stream (0), as Numba's own launches do.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from ..arch import launch as driver
from ..arch import scratch
from ..arch.cache import cached_cubin
from ..arch.launch import ArgSlots, ArrayArg, ScalarArg
from ..arch.smem import STATIC_SMEM_LIMIT
from ..phases import build, get_phase

_LOADED: dict = {}  # (cache key, device index) -> Kernel: one load and one attribute call per process
MAPS_KEPT = 16  # tensor maps kept per plan, by (q, k, v) addresses
# Every kernel's operands take 16-byte copies (cp.async, TMA, 16-byte stores): an address off a
# 16-byte boundary would stop the kernel with "misaligned address" and lose the CUDA context
ALIGNMENT = 16
ALIGNMENT_MASK = ALIGNMENT - 1


def misaligned(names: str, tensors) -> None:
    """Raise the ValueError of the first of `tensors` (named by `names`, ", "-separated) whose
    address is off a 16-byte boundary (a view that starts mid-row, a slice of a larger buffer)."""
    for name, t in zip(names.split(", "), tensors):
        if t is not None and t.data_ptr() % ALIGNMENT:
            raise ValueError(f"{name}: its address is {t.data_ptr() % ALIGNMENT} bytes past a {ALIGNMENT}-byte "
                             f"boundary; the kernels copy {ALIGNMENT} bytes at a time, so each tensor must start "
                             f"on one (a fresh tensor, or .clone(), does)")


def loaded_kernel(cached, device_index: int, smem_bytes: int):
    kernel = _LOADED.get((cached.key, device_index))
    if kernel is None:
        from numba import cuda

        kernel = driver.load_kernel(cached.cubin, cached.entry)
        if smem_bytes > STATIC_SMEM_LIMIT:  # the driver refuses more unless the limit is raised
            driver.set_dynamic_smem(kernel, smem_bytes, device_index)
        with cuda.gpus[device_index]:  # the device's primary context: Numba's and torch's
            kernel.function = driver.function_of(kernel)
        _LOADED[(cached.key, device_index)] = kernel
    return kernel


class Plans:
    """Plans by the key of a call, the oldest forgotten first once `kept` are kept (a model whose
    lengths change from call to call makes a plan per length). A plan is a few KB; the compiled
    kernels themselves are shared by all plans."""

    def __init__(self, kept: int = 512):
        self.kept = kept
        self._plans: dict = {}
        self._lock = threading.Lock()

    def get(self, key):
        return self._plans.get(key)

    def keep(self, key, plan):
        with self._lock:
            while len(self._plans) >= self.kept:
                del self._plans[next(iter(self._plans))]
            self._plans[key] = plan
        return plan

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


class DeviceMaps:
    """The tensor maps of a TMA kernel's q, k and v on the device (one row of 16 words each), by the
    arrays' addresses (and whatever else `key` holds): built on the first call that uses them, their
    device copy made on torch's current stream (the launch's) from pinned host memory, so that a
    CUDA graph captures it; the last MAPS_KEPT kept. `describe` turns the arrays into what
    arch/tma.head_map_words takes (describe_heads: (B, H, S, D); describe_packed: packed rows).
    With `device` None (a plan of NumPy or Numba arrays), the copy is Numba's, on the default stream
    the launch runs on: it is ordered before the launch, and nothing captures those calls."""

    def __init__(self, device, box, describe, device_index: int = 0):
        self.device, self.box, self.describe, self.device_index = device, box, describe, device_index
        self._kept: OrderedDict = OrderedDict()  # key -> (maps on the device, pinned source, address)
        self._last_key, self._last = None, 0  # a model's loop passes the same buffers again and again

    def address(self, key, arrays) -> int:
        if key == self._last_key:
            return self._last
        found = self._kept.get(key)
        if found is None:
            from ..arch.tma import head_map_words

            words = head_map_words(self.describe(arrays), self.box).view(np.int64)
            if self.device is None:
                from numba import cuda

                with cuda.gpus[self.device_index]:
                    device = cuda.to_device(words)
                found = self._kept[key] = (device, None, device.device_ctypes_pointer.value)
            else:
                import torch

                host = torch.from_numpy(words).pin_memory()
                device = torch.empty(host.shape, dtype=torch.int64, device=self.device)
                device.copy_(host, non_blocking=True)  # on torch's current stream, the launch's: ordered before it
                # the pinned source lives as long as its copy may be pending
                found = self._kept[key] = (device, host, device.data_ptr())
            if len(self._kept) > MAPS_KEPT:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(key)
        self._last_key, self._last = key, found[2]
        return found[2]


def memory_device(device_index: int, torch_memory: bool):
    """Where a plan's own memory comes from: the torch.device of torch's caching allocator for a plan
    of torch tensors (a CUDA graph's capture takes it from the graph's pool), None for Numba's."""
    if not torch_memory:
        return None
    import torch

    return torch.device("cuda", device_index)


def load(config, dtype: str, device_index: int):
    """(the loaded Kernel, the cached cubin) of a phase's `config` for `dtype` on a device, and its
    compute capability: compiled once, from the disk cache where it is there (arch/cache.py)."""
    from numba import cuda
    from numba.cuda.core import sigutils

    with cuda.gpus[device_index]:
        cc = tuple(cuda.get_current_device().compute_capability)
    argtypes, _ = sigutils.normalize_signature(config.signature(dtype))
    cached = cached_cubin(config.kernel, argtypes, config.cache_key, cc)
    return loaded_kernel(cached, device_index, config.smem_bytes), cached


class Plan:
    """One problem's launch, settled; `plan(q, k, v, out, stream)` runs it on those tensors. `out_shape`:
    the output's shape where it is not q's (v's head dim of its own, `value_dim`: MLA), else None.
    `torch_memory=False`: a plan of NumPy or Numba arrays (memory_device)."""

    out_shape = None

    def __init__(self, kernel_id: str, head_dim: int, dtype: str, q_shape, k_shape, causal: bool, qk_scale: float,
                 device_index: int, return_lse: bool = False, value_dim: int | None = None,
                 torch_memory: bool = True):
        from numba import cuda

        value_dim = head_dim if value_dim is None else value_dim
        config = build(get_phase(kernel_id), head_dim, dtype, value_dim=value_dim)
        with cuda.gpus[device_index]:
            self.grid = (tuple(config.grid(tuple(q_shape), causal, tuple(k_shape))) + (1, 1))[:3]
            self.splits = config.split_keys(tuple(q_shape), tuple(k_shape), causal) if config.split_keys else None
        self.kernel, cached = load(config, dtype, device_index)
        self.block, self.smem = config.n_threads, config.smem_bytes
        self.device_index = device_index
        self.device = memory_device(device_index, torch_memory)
        self.tma_box = config.tma_box
        self.looping = config.work_units is not None
        B, H, S, D = q_shape
        v_shape = (*tuple(k_shape)[:3], value_dim)
        if value_dim != D:
            self.out_shape = (B, H, S, value_dim)
        out = ArrayArg((B, H, S, value_dim // 2), 4) if config.packed_output else ArrayArg((B, H, S, value_dim), 2)
        args = [ArrayArg(tuple(q_shape), 2), ArrayArg(tuple(k_shape), 2), ArrayArg(v_shape, 2), out]
        self.return_lse = return_lse
        if config.lse:  # the (B, H, S_q) float32 log-sum-exp, or an empty array with no address
            args.append(ArrayArg((B, H, S) if return_lse else (0, 0, 0), 4))
        args += [ScalarArg("bool", bool(causal)), ScalarArg("float32", float(np.float32(qk_scale)))]
        if self.tma_box:
            self.maps_arg = len(args)
            args.append(ArrayArg((3, 16), 8))
        if self.looping:
            self.counter_arg = len(args)
            args.append(ArrayArg((1,), 4))
        if self.splits is not None:  # phase 10's workspace: partial outputs, their LSEs, the counters
            self.workspace_arg = len(args)
            args += [ArrayArg(self.splits.o_part, 4), ArrayArg(self.splits.lse_part, 4),
                     ArrayArg((self.splits.counters,), 4)]
        self.slots = ArgSlots(args)
        self.slots.check(cached.cubin, cached.entry)
        self.launch = driver.Launcher(self.kernel, self.grid, self.block, self.smem, self.slots)
        if self.tma_box:
            from ..arch.tma import describe_heads

            self.maps = DeviceMaps(self.device, self.tma_box, describe_heads, device_index)
        # the array arguments a call writes, in the order of its addresses: q, k, v, out, lse (phases
        # 07 on), the maps (09), then the scratch
        self.has_lse = bool(config.lse)
        self.arrays = (0, 1, 2, 3, 4)[:4 + self.has_lse]
        if self.tma_box:
            self.arrays += (self.maps_arg,)
        if self.looping:
            self.arrays += (self.counter_arg,)
        if self.splits is not None:
            self.arrays += (self.workspace_arg, self.workspace_arg + 1, self.workspace_arg + 2)
        self.context = driver.primary_context(device_index)
        self._scratch: dict = {}  # stream -> the addresses of its scratch
        self._lock = threading.Lock()

    def __call__(self, q, k, v, out, stream: int, lse=None) -> None:
        qkv = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        if (qkv[0] | qkv[1] | qkv[2]) & ALIGNMENT_MASK:
            misaligned("q, k, v", (q, k, v))
        addresses = [*qkv, out.data_ptr()]
        if self.has_lse:  # the kernel takes an LSE array: the caller's, or the empty one (no address)
            addresses.append(lse.data_ptr() if self.return_lse else 0)
        context = self.context
        previous = driver.make_current(context)
        try:
            if self.tma_box:
                addresses.append(self.maps.address(qkv, (q, k, v)))
            scratch_addresses = self._scratch.get(stream)
            if scratch_addresses is None:  # the stream's scratch (arch/scratch.py), kept by the plan from then on
                scratch_addresses = self._scratch[stream] = self._scratch_of(stream)
            with self._lock:  # the slots are this plan's: one launch packs them at a time
                self.slots.set_pointers(self.arrays, (*addresses, *scratch_addresses))
                self.launch(stream)
        finally:
            driver.restore(previous, context)

    def _scratch_of(self, stream: int) -> tuple:
        """The addresses of the work counter (phase 09) and the split workspace (phase 10) on `stream`."""
        addresses = ()
        if self.looping:
            addresses += scratch.work_counter(self.device_index, stream, self.device).addresses
        if self.splits is not None:
            addresses += scratch.split_workspace(self.splits, self.device_index, stream, self.device).addresses
        return addresses

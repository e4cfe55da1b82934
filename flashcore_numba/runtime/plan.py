"""A plan per problem: what a call of attention() on torch tensors needs, computed once.

Everything that depends only on the problem (the kernel, the shapes, the dtype, the causal flag,
the scale, the device) is settled when the plan is made: the kernel's cubin loaded (from the disk
cache, arch/cache.py, or compiled once), its shared-memory limit raised, the grid, and every
kernel parameter but the arrays' addresses packed in place (arch/launch.py). A call then writes
four data pointers and launches with one driver call on torch's current stream:

    plan = Plan("09", 64, "float16", q.shape, k.shape, causal=False, qk_scale=..., device_index=0)
    plan(q, k, v, out, stream)            # plan(q, k, v, out, stream, lse) with return_lse=True

Phase 10 also gets its workspace (the partial outputs of its key splits, their log-sum-exps and
the counters that elect the block that merges them): one per stream, made on the first call on
that stream, its counters zeroed then and left at zero by every launch. Phase 09 also gets, per call, the tensor maps of q, k and v (built on the first call that uses
those addresses, then found by them; their device copy is made on the stream, from pinned host
memory, so a CUDA graph captures it) and its work counter: one per stream, zeroed once in that
stream's order, then left at zero by each launch's last request (no memset per call, and a
replayed graph finds it zero too). Nothing in a call synchronizes with the host or
allocates outside torch's caching allocator.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from ..arch import launch as driver
from ..arch.cache import cached_cubin
from ..arch.launch import ArgSlots, ArrayArg, ScalarArg
from ..arch.smem import STATIC_SMEM_LIMIT
from ..phases import build, get_phase

_LOADED: dict = {}  # (cache key, device index) -> Kernel: one load and one attribute call per process
MAPS_KEPT = 16  # tensor maps kept per plan, by (q, k, v) addresses


def _loaded(cached, device_index: int, smem_bytes: int):
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


class Plan:
    """One problem's launch, settled; `plan(q, k, v, out, stream)` runs it on those tensors."""

    def __init__(self, kernel_id: str, head_dim: int, dtype: str, q_shape, k_shape, causal: bool, qk_scale: float,
                 device_index: int, return_lse: bool = False):
        import torch
        from numba import cuda
        from numba.cuda.core import sigutils

        config = build(get_phase(kernel_id), head_dim, dtype)
        with cuda.gpus[device_index]:
            cc = tuple(cuda.get_current_device().compute_capability)
            self.grid = (tuple(config.grid(tuple(q_shape), causal, tuple(k_shape))) + (1, 1))[:3]
            self.splits = config.split_keys(tuple(q_shape), tuple(k_shape), causal) if config.split_keys else None
        argtypes, _ = sigutils.normalize_signature(config.signature(dtype))
        cached = cached_cubin(config.kernel, argtypes, config.cache_key, cc)
        self.kernel = _loaded(cached, device_index, config.smem_bytes)
        self.block, self.smem = config.n_threads, config.smem_bytes
        self.device_index = device_index
        self.device = torch.device("cuda", device_index)
        self.tma_box = config.tma_box
        self.looping = config.work_units is not None
        B, H, S, D = q_shape
        out = ArrayArg((B, H, S, D // 2), 4) if config.packed_output else ArrayArg(tuple(q_shape), 2)
        args = [ArrayArg(tuple(q_shape), 2), ArrayArg(tuple(k_shape), 2), ArrayArg(tuple(k_shape), 2), out]
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
        self._maps: OrderedDict = OrderedDict()  # (q, k, v addresses) -> (maps on the device, pinned source, address)
        self._last_qkv, self._last_maps = None, 0  # the last call's addresses and their maps
        self._counters: dict = {}  # stream -> the address of its work counter
        self._counter_tensors: list = []
        self._workspaces: dict = {}  # stream -> the addresses of its workspace (split keys)
        self._lock = threading.Lock()

    def __call__(self, q, k, v, out, stream: int, lse=None) -> None:
        qkv = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        with self._lock:  # the slots are this plan's: one launch packs them at a time
            slots = self.slots
            slots.set_pointer(0, qkv[0])
            slots.set_pointer(1, qkv[1])
            slots.set_pointer(2, qkv[2])
            slots.set_pointer(3, out.data_ptr())
            if self.return_lse:
                slots.set_pointer(4, lse.data_ptr())
            if self.tma_box:
                # a model's loop calls with the same q, k, v buffers again and again: the last maps first
                maps = self._last_maps if qkv == self._last_qkv else self._maps_of(q, k, v, qkv)
                slots.set_pointer(self.maps_arg, maps)
            if self.looping:
                counter = self._counters.get(stream)
                if counter is None:
                    counter = self._counters[stream] = self._new_counter(stream)
                slots.set_pointer(self.counter_arg, counter)
            if self.splits is not None:
                workspace = self._workspaces.get(stream)
                if workspace is None:
                    workspace = self._workspaces[stream] = self._new_workspace(stream)
                for i, address in enumerate(workspace):
                    slots.set_pointer(self.workspace_arg + i, address)
            self.launch(stream)

    def _new_counter(self, stream: int) -> int:
        """The address of a work counter for launches on `stream`, zeroed in that stream's order
        (once: the kernel's last request sets it back to zero, see phase 09's `next_unit`)."""
        import torch

        counter = torch.empty(1, dtype=torch.int32, device=self.device)
        driver.memset32(counter.data_ptr(), 0, 1, stream)
        self._counter_tensors.append(counter)  # the memory stays the plan's
        return counter.data_ptr()

    def _new_workspace(self, stream: int) -> tuple[int, int, int]:
        """The addresses of a split-keys workspace for launches on `stream`: the partial outputs and
        their LSEs (written before they are read), and counters zeroed once in that stream's order
        (the kernel's merging block sets each back to zero)."""
        import torch

        splits = self.splits
        o_part = torch.empty(splits.o_part, dtype=torch.float32, device=self.device)
        lse_part = torch.empty(splits.lse_part, dtype=torch.float32, device=self.device)
        counters = torch.empty(splits.counters, dtype=torch.int32, device=self.device)
        driver.memset32(counters.data_ptr(), 0, splits.counters, stream)
        self._counter_tensors += [o_part, lse_part, counters]  # the memory stays the plan's
        return o_part.data_ptr(), lse_part.data_ptr(), counters.data_ptr()

    def _maps_of(self, q, k, v, key) -> int:
        """The device address of the tensor maps of q, k and v (one row of 16 words each)."""
        found = self._maps.get(key)
        if found is not None:
            self._maps.move_to_end(key)
            self._last_qkv, self._last_maps = key, found[2]
            return found[2]
        import torch

        from ..arch.tma import describe_heads, head_map_words

        words = head_map_words(describe_heads((q, k, v)), self.tma_box)
        host = torch.from_numpy(words.view(np.int64)).pin_memory()
        device = torch.empty(host.shape, dtype=torch.int64, device=self.device)
        device.copy_(host, non_blocking=True)  # on torch's current stream, the launch's: ordered before it
        # the pinned source lives as long as its copy may be pending
        self._maps[key] = (device, host, device.data_ptr())
        if len(self._maps) > MAPS_KEPT:
            self._maps.popitem(last=False)
        self._last_qkv, self._last_maps = key, device.data_ptr()
        return device.data_ptr()

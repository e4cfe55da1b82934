"""attention_kvcache's plan: a decode step against a KV cache, settled once per problem.

What runtime/plan.py does for attention(), for phase 10 built `paged` (phases.build_kvcache; its
variant "batch", two warps a block, where the batch's row tiles fill the GPU): the kernel loaded,
the grid and the workspace's shapes worked out for the cache's capacity, every parameter but the
addresses packed. A call writes the addresses of q, the caches, the output, the
lengths and the block table, and launches on torch's current stream:

    plan = KVCachePlan(128, "float16", q.shape, k_cache.shape, block_table.shape, causal=True,
                       qk_scale=..., device_index=0)
    plan(q, k_cache, v_cache, cache_seqlens, block_table, out, stream)    # + lse with return_lse

It reads no value from the GPU: the lengths and page ids are the caller's promise, as in
FlashAttention's flash_attn_with_kvcache, and the kernel clamps what it reads by them (a length
past the cache's capacity reads the capacity, a page id outside the pool page 0), so a wrong value
gives a wrong row, never a read outside the cache. A contiguous cache is the paged kernel with one
page per sequence, page b being k_cache[b]: its block table, (B, 1) of 0 .. B - 1, is the plan's.
"""

from __future__ import annotations

import threading

import numpy as np

from ..arch import launch as driver
from ..arch import scratch
from ..arch.launch import ArgSlots, ArrayArg, ScalarArg
from ..phases import build_kvcache
from ..phases import p10_split_keys as p10
from .inputs import DeviceArray
from .plan import ALIGNMENT_MASK, load, memory_device, misaligned

# the array arguments a call writes: q, k_cache, v_cache, out, lse, the workspace's three, the lengths, the table
ARRAYS = (0, 1, 2, 3, 4, 7, 8, 9, 10, 11)


class KVCachePlan:
    """One attention_kvcache problem's launch; `plan(...)` runs it on tensors of those shapes
    (`torch_memory=False`: on NumPy or Numba arrays, runtime/plan.py)."""

    def __init__(self, head_dim: int, dtype: str, q_shape, cache_shape, table_shape, causal: bool, qk_scale: float,
                 device_index: int, return_lse: bool = False, torch_memory: bool = True):
        from numba import cuda

        B, S_q, H, D = q_shape
        _, page_size, H_kv, _ = cache_shape
        paged = table_shape is not None
        capacity = table_shape[1] * page_size if paged else page_size
        with cuda.gpus[device_index]:
            batch = p10.batch_fills_gpu(B * H_kv, (H // H_kv) * S_q)
            config = build_kvcache(head_dim, dtype, "batch" if batch else None)
            # the grid and the workspace as for a dense problem whose keys are the cache's capacity
            self.splits = config.split_keys((B, H, S_q, D), (B, H_kv, capacity, D), causal)
        self.kernel, cached = load(config, dtype, device_index)
        self.device_index, self.device = device_index, memory_device(device_index, torch_memory)
        self.return_lse = return_lse
        # a contiguous cache: page b of the "pool" k_cache is sequence b's whole cache
        self.table = None if paged else self._pages_in_order(B)
        args = [ArrayArg(tuple(q_shape), 2), ArrayArg(tuple(cache_shape), 2), ArrayArg(tuple(cache_shape), 2),
                ArrayArg((B, S_q, H, D // 2), 4),  # O as uint32 pairs of 16-bit values
                ArrayArg((B, H, S_q) if return_lse else (0, 0, 0), 4),
                ScalarArg("bool", bool(causal)), ScalarArg("float32", float(np.float32(qk_scale))),
                ArrayArg(self.splits.o_part, 4), ArrayArg(self.splits.lse_part, 4),
                ArrayArg((self.splits.counters,), 4),
                ArrayArg((B,), 4), ArrayArg(tuple(table_shape) if paged else (B, 1), 4)]
        self.slots = ArgSlots(args)
        self.slots.check(cached.cubin, cached.entry)
        self.launch = driver.Launcher(self.kernel, (self.splits.grid + (1, 1))[:3], config.n_threads,
                                      config.smem_bytes, self.slots)
        self.context = driver.primary_context(device_index)
        self._workspaces: dict = {}  # stream -> the addresses of its split workspace
        self._lock = threading.Lock()

    def _pages_in_order(self, B: int):
        """The block table of a contiguous cache, (B, 1) of 0 .. B - 1, in the plan's memory."""
        if self.device is not None:
            import torch

            return torch.arange(B, dtype=torch.int32, device=self.device).reshape(B, 1)
        from numba import cuda

        with cuda.gpus[self.device_index]:
            return DeviceArray(cuda.to_device(np.arange(B, dtype=np.int32).reshape(B, 1)))

    def __call__(self, q, k_cache, v_cache, cache_seqlens, block_table, out, stream: int, lse=None) -> None:
        qkvo = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr())
        if (qkvo[0] | qkvo[1] | qkvo[2] | qkvo[3]) & ALIGNMENT_MASK:
            misaligned("q, k_cache, v_cache, out", (q, k_cache, v_cache, out))
        table = self.table if block_table is None else block_table
        previous = driver.make_current(self.context)
        try:
            workspace = self._workspaces.get(stream)
            if workspace is None:  # the stream's workspace (arch/scratch.py), kept by the plan from then on
                workspace = self._workspaces[stream] = scratch.split_workspace(self.splits, self.device_index, stream,
                                                                               self.device).addresses
            with self._lock:  # the slots are this plan's: one launch packs them at a time
                self.slots.set_pointers(ARRAYS, (*qkvo, lse.data_ptr() if self.return_lse else 0, *workspace,
                                                 cache_seqlens.data_ptr(), table.data_ptr()))
                self.launch(stream)
        finally:
            driver.restore(previous, self.context)

"""attention_varlen's plan: packed sequences of their own lengths, settled once per kind of problem.

A serving loop packs a different set of sequences into every call: the number of packed rows,
the number of sequences and the longest one change from call to call, the heads, the head dim,
the dtype and the flags do not. So a plan is made per (phase, head dim, dtype, heads, K/V heads,
causal, scale, return_lse, device) and a call writes, beside the addresses, the arrays' lengths
(ArgSlots.set_shape), the grid and, for phase 09, the longest sequence and the tensor maps of
its packed q, k and v (by their addresses and lengths, runtime/plan.DeviceMaps):

    plan = VarlenPlan("09", 128, "float16", H=16, H_kv=16, causal=True, qk_scale=..., device_index=0)
    plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, out, stream)   # + lse with return_lse

It reads no value from the GPU: the offsets are the caller's promise, as in FlashAttention's
flash_attn_varlen_func, and the kernel clamps them to the packed rows, so a wrong offset gives a
wrong row, never a read outside q, k or v.
"""

from __future__ import annotations

import threading

import numpy as np

from ..arch import launch as driver
from ..arch import scratch
from ..arch.launch import ArgSlots, ArrayArg, ScalarArg
from ..phases import build_varlen
from ..phases.common import cdiv, sm_count
from .plan import ALIGNMENT_MASK, DeviceMaps, load, memory_device, misaligned


class VarlenPlan:
    """One kind of attention_varlen problem's launch; `plan(...)` runs it on any packed lengths
    (`torch_memory=False`: on NumPy or Numba arrays, runtime/plan.py)."""

    def __init__(self, phase_id: str, head_dim: int, dtype: str, H: int, H_kv: int, causal: bool, qk_scale: float,
                 device_index: int, return_lse: bool = False, torch_memory: bool = True, value_dim: int | None = None):
        """value_dim: v's and the output's head dim, where it is not q's and k's (MLA)."""
        from numba import cuda

        config = self.config = build_varlen(phase_id, head_dim, dtype, value_dim)
        self.kernel, cached = load(config, dtype, device_index)
        self.device_index, self.device = device_index, memory_device(device_index, torch_memory)
        self.H, self.H_kv, self.D, self.causal = H, H_kv, head_dim, bool(causal)
        self.D_v = Dv = head_dim if value_dim is None else value_dim
        self.return_lse = return_lse
        self.tma = config.tma_box is not None
        if self.tma:  # phase 09: persistent blocks, one an SM, taking query blocks from a counter
            with cuda.gpus[device_index]:
                self.sms = sm_count()
            from ..arch.tma import describe_packed

            self.maps = DeviceMaps(self.device, config.tma_box, describe_packed, device_index)
        D = head_dim
        # shapes for one packed row each; every call writes its own lengths
        args = [ArrayArg((1, 1, H, D), 2), ArrayArg((1, 1, H_kv, D), 2), ArrayArg((1, 1, H_kv, Dv), 2),
                ArrayArg((1, 1, H, Dv // 2), 4),  # O as uint32 pairs of 16-bit values
                ArrayArg((1, H, 1) if return_lse else (0, 0, 0), 4),
                ScalarArg("bool", self.causal), ScalarArg("float32", float(np.float32(qk_scale)))]
        if self.tma:
            args += [ArrayArg((3, 16), 8), ArrayArg((1,), 4)]  # the maps, the work counter
        self.offsets_arg = len(args)
        args += [ArrayArg((1,), 4), ArrayArg((1,), 4)]  # cu_seqlens_q, cu_seqlens_k
        if self.tma:
            args.append(ScalarArg("int32", 0))  # max_seqlen_q
        self.slots = ArgSlots(args)
        self.slots.check(cached.cubin, cached.entry)
        self.launch = driver.Launcher(self.kernel, (1, 1, 1), config.n_threads, config.smem_bytes, self.slots)
        self.context = driver.primary_context(device_index)
        self._counters: dict = {}  # stream -> its work counter's address (phase 09)
        self._lock = threading.Lock()

    def grid(self, B: int, max_seqlen_q: int) -> tuple:
        if not self.tma:  # phase 07: a block per (query block, head, sequence)
            return cdiv(max_seqlen_q, self.config.block_m), self.H, B
        units = self.config.work_units((B, self.H, max_seqlen_q, self.D), self.causal)
        return (min(units, self.sms) if self.config.persistent else units), 1, 1

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, out, stream: int, lse=None) -> None:
        addresses = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
        if (addresses[0] | addresses[1] | addresses[2] | addresses[3]) & ALIGNMENT_MASK:
            misaligned("q, k, v, out", (q, k, v, out))
        total_q, total_k, B = q.shape[0], k.shape[0], cu_seqlens_q.shape[0] - 1
        H, H_kv, D, Dv = self.H, self.H_kv, self.D, self.D_v
        grid = self.grid(B, max_seqlen_q)
        previous = driver.make_current(self.context)
        try:
            with self._lock:  # the slots are this plan's: one launch packs them at a time
                slots = self.slots
                for i, (address, shape) in enumerate(zip(addresses, ((1, total_q, H, D), (1, total_k, H_kv, D),
                                                                     (1, total_k, H_kv, Dv), (1, total_q, H, Dv // 2)))):
                    slots.set_pointer(i, address)
                    slots.set_shape(i, shape)
                if self.return_lse:
                    slots.set_pointer(4, lse.data_ptr())
                    slots.set_shape(4, (1, H, total_q))
                n = self.offsets_arg
                slots.set_pointer(n, cu_seqlens_q.data_ptr())
                slots.set_pointer(n + 1, cu_seqlens_k.data_ptr())
                slots.set_shape(n, (B + 1,))
                slots.set_shape(n + 1, (B + 1,))
                if self.tma:
                    slots.set_pointer(7, self.maps.address((*addresses[:3], total_q, total_k), (q, k, v)))
                    counter = self._counters.get(stream)
                    if counter is None:  # the stream's work counter (arch/scratch.py), kept by the plan
                        counter = self._counters[stream] = scratch.work_counter(self.device_index, stream,
                                                                                self.device).addresses[0]
                    slots.set_pointer(8, counter)
                    slots.set_scalar(n + 2, max_seqlen_q)
                self.launch.grid = grid
                self.launch(stream)
        finally:
            driver.restore(previous, self.context)

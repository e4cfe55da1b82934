"""The backward's plan: what attention()'s autograd launches for one problem, settled once.

`Backward.run` (phases/p11_backward.py) launches its kernels through Numba, which types and wraps
every argument on every launch: hundreds of microseconds of host time per backward, on top of
the conversions of seven torch tensors to Numba arrays. A plan does, for the backward, what
runtime/plan.py does for the forward: the kernels' cubins loaded once (from the disk cache), their
grids and parameters packed once, and a call that writes the data pointers and launches through
the driver on torch's current stream:

    plan = BackwardPlan(64, "float16", q.shape, k.shape, causal=True, scale=0.125,
                        deterministic=False, with_dlse=False, device_index=0)
    plan(q, k, v, out, dout, lse, dq, dk, dv, delta, stream)   # + dq_sums (parts > 1), dlse

The launches are exactly Backward.run's (tests/test_runtime.py packs both and compares the bytes):
Δ (delta_kernel), dQ zeroed (a driver memset instead of a zeroing kernel), kv_kernel (or its
serial build), and with deterministic parts their sum. Nothing synchronizes with the host or
allocates: the caller passes every buffer, from torch's caching allocator.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..arch import launch as driver
from ..arch.cache import cached_cubin
from ..arch.launch import ArgSlots, ArrayArg, ScalarArg
from .plan import ALIGNMENT_MASK, DeviceMaps, loaded_kernel, memory_device, misaligned


@dataclass
class Launch:
    """One kernel launch of the plan: which kernel (its id in p11_backward.kernel_views), where,
    and its parameters; `tensors` names the buffer behind each array argument, in order."""

    kernel_id: str
    grid: tuple
    block: int
    smem: int
    args: list
    tensors: tuple
    slots: ArgSlots | None = None
    kernel: object = None

    def pointers(self):
        """(argument number, buffer name) of each array argument: what a call writes."""
        return [(i, name) for i, name in zip((i for i, a in enumerate(self.args) if isinstance(a, ArrayArg)),
                                            self.tensors, strict=True)]


def backward_launches(bw, q_shape, k_shape, causal: bool, scale: float, deterministic: bool, parts: int,
                      with_dlse: bool) -> list[Launch]:
    """The kernel launches of `bw.run` (a p11_backward.Backward) for this problem, without arrays:
    their grids and argument layouts, and which buffer each array argument is ("q", "k", "v", "out",
    "dout", "lse", "dlse", "delta", "dq", "dk", "dv", "sums": the parts of dQ, or dq itself; phase
    13's "maps": the tensor maps of q, k, v and dout, on the device)."""
    from ..phases import p11_backward as p11
    from ..phases.common import cdiv

    B, H, S_q, D = q_shape
    H_kv, S_k = k_shape[1], k_shape[2]
    kv = bw.kv
    words = (B, H, S_q, D // 2)  # O and dO as uint32 pairs of 16-bit values
    stats = (B, H, S_q)
    delta = Launch("11-delta", bw.delta_grid(B, H, S_q), 32 * p11.DELTA_WARPS, 0,
                   [ArrayArg(words, 4), ArrayArg(words, 4), ArrayArg(stats, 4), ScalarArg("bool", with_dlse),
                    ArrayArg(stats, 4)],
                   ("out", "dout", "dlse" if with_dlse else "delta", "delta"))
    key_blocks = cdiv(S_k, kv["OWN_ROWS"])
    kv_words = (B, H_kv, S_k, D // 2)  # dK and dV as uint32 pairs
    main = Launch(bw.kv_id(deterministic), p11.kv_grid(kv, parts if deterministic else key_blocks, H_kv, B),
                  p11.kv_threads(kv), kv["SMEM_BYTES"],
                  [ArrayArg(tuple(q_shape), 2), ArrayArg(tuple(k_shape), 2), ArrayArg(tuple(k_shape), 2),
                   ArrayArg(tuple(q_shape), 2), ArrayArg(stats, 4), ArrayArg(stats, 4),
                   ArrayArg((parts, *q_shape), 4), ArrayArg(kv_words, 4), ArrayArg(kv_words, 4),
                   ScalarArg("bool", causal), ScalarArg("float32", scale)],
                  ("q", "k", "v", "dout", "lse", "delta", "sums", "dk", "dv"))
    if "TMA_BOX" in kv:  # phase 13: the tensor maps of q, k, v and dout, one row of 16 words each
        main.args.append(ArrayArg((4, 16), 8))
        main.tensors += ("maps",)
    launches = [delta, main]
    if parts > 1:
        n = B * H * S_q * D
        launches.append(Launch("11-sum", (cdiv(n, p11.SUM_THREADS), 1, 1), p11.SUM_THREADS, 0,
                               [ArrayArg((parts, n), 4), ArrayArg((n,), 4)], ("sums", "dq")))
    return launches


class BackwardPlan:
    """One backward problem's launches, settled; `plan(...)` runs them on those tensors. phase: whose
    kv_kernel ("11", "12": phase 12's on wgmma, or "13": phase 13's, fed by TMA; 12 and 13 Hopper
    only; phases.backward_phase). Phase 13's tensor maps are made on the first call that uses
    those addresses and kept (plan.DeviceMaps): a training loop's activations come back at the
    addresses of the step before from torch's caching allocator."""

    def __init__(self, head_dim: int, dtype: str, q_shape, k_shape, causal: bool, scale: float,
                 deterministic: bool, with_dlse: bool, device_index: int, phase: str = "11"):
        from numba import cuda
        from numba.cuda.core import sigutils

        from ..phases import backward_phase

        module = backward_phase(phase)
        with cuda.gpus[device_index]:
            cc = tuple(cuda.get_current_device().compute_capability)
            bw = module.build(head_dim, dtype, cc)
            self.parts = bw.dq_parts(q_shape[0], k_shape[1], k_shape[2], deterministic)
        views = module.kernel_views(head_dim, dtype, cc)
        self.launches = backward_launches(bw, q_shape, k_shape, causal, scale, deterministic, self.parts, with_dlse)
        for launch in self.launches:
            view = views[launch.kernel_id]
            argtypes, _ = sigutils.normalize_signature(view.types)
            cached = cached_cubin(view.kernel, argtypes, bw.cache_id(launch.kernel_id), cc)
            launch.kernel = loaded_kernel(cached, device_index, launch.smem)
            launch.slots = ArgSlots(launch.args)
            launch.slots.check(cached.cubin, cached.entry)
        self._pointers = [launch.pointers() for launch in self.launches]  # worked out once, not per call
        self._launchers = [driver.Launcher(launch.kernel, launch.grid, launch.block, launch.smem, launch.slots)
                           for launch in self.launches]
        B, H, S_q, D = q_shape
        self.zeroed = self.parts * B * H * S_q * D  # 32-bit words of the sums dQ is added into
        self.device_index = device_index
        self.maps = None
        if "TMA_BOX" in bw.kv:
            from ..arch.tma import describe_heads

            self.maps = DeviceMaps(memory_device(device_index, True), bw.kv["TMA_BOX"], describe_heads,
                                   device_index)
        self.context = driver.primary_context(device_index)
        self._lock = threading.Lock()

    def __call__(self, q, k, v, out, dout, lse, dq, dk, dv, delta, stream: int, dq_sums=None, dlse=None) -> None:
        """The backward on contiguous tensors of the plan's shapes (q, k, v, out, dout in the inputs'
        dtype; lse, delta, dq float32; dq_sums (parts, *q.shape) float32 where parts > 1)."""
        sums = dq if self.parts == 1 else dq_sums
        if sums is None:
            raise ValueError(f"dq_sums: this plan sums dQ in {self.parts} parts and needs their float32 buffer")
        pointers = {"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "out": out.data_ptr(),
                    "dout": dout.data_ptr(), "lse": lse.data_ptr(), "delta": delta.data_ptr(), "dq": dq.data_ptr(),
                    "dk": dk.data_ptr(), "dv": dv.data_ptr(), "sums": sums.data_ptr(),
                    "dlse": None if dlse is None else dlse.data_ptr()}
        if (pointers["q"] | pointers["k"] | pointers["v"] | pointers["out"] | pointers["dout"]) & ALIGNMENT_MASK:
            misaligned("q, k, v, out, grad of out", (q, k, v, out, dout))
        if self.maps is not None:  # made on torch's current stream, the launches' (ordered before them)
            key = (pointers["q"], pointers["k"], pointers["v"], pointers["dout"])
            pointers["maps"] = self.maps.address(key, (q, k, v, dout))
        # in the device's primary context, whatever thread calls (autograd runs the backward on its own)
        previous = driver.make_current(self.context)
        try:
            with self._lock:  # the slots are this plan's: one call packs them at a time
                self._launch(0, pointers, stream)  # Δ
                driver.memset32(pointers["sums"], 0, self.zeroed, stream)  # the reductions add into zeros
                for n in range(1, len(self.launches)):  # kv_kernel, and with parts their sum
                    self._launch(n, pointers, stream)
        finally:
            driver.restore(previous, self.context)

    def _launch(self, n: int, pointers: dict, stream: int) -> None:
        launch = self.launches[n]
        for i, name in self._pointers[n]:
            launch.slots.set_pointer(i, pointers[name])
        self._launchers[n](stream)

"""The benchmark harness: every speed figure this project quotes comes from here.

The protocol (../shared/DESIGN.md), in the order the code runs it:

1. Fresh random inputs, never zeros (a kernel that reads nothing can look right on zeros).
2. Correctness gate before any timing: the output buffer is poisoned with NaN, the kernel
   runs once, every element must have been overwritten, and the oracle of
   `reference.check_close` must pass against the float64 reference. A kernel that fails
   gets no speed figure: a fast wrong answer is not a result.
3. Warm-up launches (the first launch also compiles the kernel).
4. The *kernel time*: CUDA-event timing of `repeats` launches; before each one a buffer larger
   than L2 is overwritten (outside the timed region), so no launch finds K and V already in
   cache. Device only: the launches go in batches, each queued behind a sleep kernel that lasts
   longer than the host takes to queue the batch, so the host's launch time never enters an
   event's interval (a batch where it could have is dropped and queued again behind a longer
   sleep). Median, mean, p99, min and max are kept (docs/tuning/09_history.md: a median alone
   hides a tail, and a timing the host can enter shows one the kernel does not have).
   With `tail`: that many launches more, back to back on the device with no flush, as a model's
   loop runs them there, and how many took more than SLOW times their median.
   With `calls`: the *call time*, `attention()` (or the peer's SDPA call) called back to back
   with garbage collection on, as a user's loop calls it: events between the calls, so the host's
   time enters wherever the GPU waits for it; with the host's own time per call. For a phase, also
   its kernel's own launch timed the same way (`launch_loop`: the plan's driver launch that
   attention() makes, without the call's checks and allocation), in runs alternating with the calls'.
   The kernel time flushes L2 before each launch and runs in short batches behind a sleep; the
   calls and the launch loop find K and V in L2 where they fit and run without a pause, and a board
   at its power cap lowers its clock under that load (docs/tuning/call_path.md). So call /
   launch_loop is what attention()'s path adds, and call / kernel time what a user sees beside the
   kernel's figure.
5. FLOPs = 4·B·H·S_q·S_k·D (two matmuls, 2 FLOPs per multiply-add), halved when causal;
   TFLOPS from the median; and the percentage of the tensor-core ceiling, a large fp16
   matmul measured in the same run on the same card. Bytes = K and V read once: GB/s from
   the median, and the percentage of the memory-bandwidth ceiling, a device-to-device copy
   of that many bytes in the same run (what bounds a decode step, where the FLOPs do not).
6. Peers in the same run, same inputs, same gate: torch SDPA with the flash, cuDNN,
   efficient and math backends. One that cannot run says why.
7. A JSON record with the provenance needed to trust or reproduce the numbers: its schema, its
   files under docs/bench/ and the provenance are records.py's.

Two device back ends keep one code path per situation: with torch installed, tensors are
torch CUDA tensors (the kernels see them through `cuda.as_cuda_array`), timing uses torch
events, and the peers and the ceiling exist. Without torch, Numba device arrays and Numba
events are used; there are no peers and no ceiling, and the record says so.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import lru_cache

import numpy as np

from .. import phases as phase_registry
from ..arch.sim import simulator_enabled
from ..phases.common import LOG2E
from ..reference import ATOL, check_close, default_scale, lowp_attention, random_qkv, reference_attention
from .records import Result, build_record, nvidia_smi, provenance, unavailable

REFERENCE_SHAPE = (16, 16, 2048, 64)  # B, H, S, D of the ladder in DESIGN.md
SWEEP_S = (512, 1024, 2048, 4096, 8192, 16384)
L2_FLUSH_BYTES = 256 * 2**20  # H100 L2 is 50 MB: 256 MB evicts all of it
CEILING_N = 8192  # the ceiling is an N×N×N matmul
DTYPES = {"fp16": "float16", "bf16": "bfloat16"}  # CLI name -> dtype name used everywhere else
SHORT_DTYPE = {v: k for k, v in DTYPES.items()}

# Peer name -> (torch SDPBackend member, title)
PEERS = {
    "sdpa_flash": ("FLASH_ATTENTION", "torch SDPA, flash backend"),
    "sdpa_cudnn": ("CUDNN_ATTENTION", "torch SDPA, cuDNN backend"),
    "sdpa_efficient": ("EFFICIENT_ATTENTION", "torch SDPA, memory-efficient backend"),
    "sdpa_math": ("MATH", "torch SDPA, math backend"),
    "flex_attention": ("FLEX", "torch FlexAttention, torch.compile'd"),
}
# the peers a run compares by default: FlexAttention compiles a kernel per shape first (asked for by name)
DEFAULT_PEERS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math")
PEER_NAMES = {"flex": "flex_attention"}  # --peers' short names that are no "sdpa_" backend


# ---------------------------------------------------------------------------------------------
# What is measured: the problem and its FLOP count
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    """One attention problem: q is (B, H, S_q, D), k and v are (B, H_kv, S_k, D).

    H_kv is None when k and v have H heads too; fewer is grouped-query attention (MQA at 1). D_v is
    None when v has D columns too; another is v's (and the output's) head dim of its own (MLA).
    """

    B: int
    H: int
    S_q: int
    S_k: int
    D: int
    dtype: str = "float16"
    causal: bool = False
    H_kv: int | None = None
    D_v: int | None = None

    def __post_init__(self):
        if self.H_kv is not None and (self.H_kv < 1 or self.H % self.H_kv):
            raise ValueError(f"H_kv: {self.H_kv} key/value heads must divide the {self.H} query heads")
        if self.H_kv == self.H:
            object.__setattr__(self, "H_kv", None)  # one spelling of "no grouping"
        if self.D_v == self.D:
            object.__setattr__(self, "D_v", None)  # and of "v's head dim is q's"

    @classmethod
    def from_shape(cls, shape, *, dtype="float16", causal=False, kv_heads=None, value_dim=None) -> Problem:
        B, H, S, D = shape
        return cls(B, H, S, S, D, dtype, bool(causal), kv_heads, value_dim)

    @property
    def heads_kv(self) -> int:
        return self.H if self.H_kv is None else self.H_kv

    @property
    def value_dim(self) -> int:
        """v's head dim, the output's: D_v, or D."""
        return self.D if self.D_v is None else self.D_v

    def as_dict(self) -> dict:
        """The record's "config"; H_kv only when K/V heads are grouped (older records lack it), D_v only
        when v has a head dim of its own."""
        d = asdict(self)
        for key in ("H_kv", "D_v"):
            if d[key] is None:
                del d[key]
        return d

    @property
    def flops(self) -> int:
        return attention_flops(self.B, self.H, self.S_q, self.S_k, self.D, self.causal, self.D_v)

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V: what a kernel must read at least once, the work of a decode step."""
        itemsize = 2  # fp16 and bf16
        return self.B * self.heads_kv * self.S_k * (self.D + self.value_dim) * itemsize

    @property
    def tag(self) -> str:
        """File-name fragment, e.g. b16h16s2048d64_fp16_causal."""
        s = f"s{self.S_q}" if self.S_q == self.S_k else f"s{self.S_q}k{self.S_k}"
        dtype = SHORT_DTYPE.get(self.dtype, self.dtype)
        kv = "" if self.H_kv is None else f"kv{self.H_kv}"
        dv = "" if self.D_v is None else f"v{self.D_v}"
        return f"b{self.B}h{self.H}{kv}{s}d{self.D}{dv}_{dtype}" + ("_causal" if self.causal else "")

    def describe(self) -> str:
        s = f"S={self.S_q}" if self.S_q == self.S_k else f"S_q={self.S_q} S_k={self.S_k}"
        dtype = SHORT_DTYPE.get(self.dtype, self.dtype)
        kv = "" if self.H_kv is None else f" H_kv={self.H_kv}"
        dv = "" if self.D_v is None else f" D_v={self.D_v}"
        return f"B={self.B} H={self.H}{kv} {s} D={self.D}{dv} {dtype}" + (" causal" if self.causal else "")


def visible_pairs(S_q: int, S_k: int, causal: bool) -> int:
    """Number of (query, key) pairs the mask lets through: the work a kernel must do.

    The rule is the kernels' `key_end`: query row i sees keys j < min(S_k, max(0, i+1+S_k-S_q)).
    """
    if not causal:
        return S_q * S_k
    rows = np.arange(S_q, dtype=np.int64)
    return int(np.clip(rows + 1 + (S_k - S_q), 0, S_k).sum())


def attention_flops(B: int, H: int, S_q: int, S_k: int, D: int, causal: bool, D_v: int | None = None) -> int:
    """FLOPs of one forward pass: 2·D for q·k and 2·D for p·v per visible pair (2·D_v for p·v where v
    has a head dim of its own: the products' sum, counted as 4·(D + D_v) / 2).

    Non-causal: 4·B·H·S_q·S_k·D. Causal with S_q == S_k: exactly half of that, the convention
    of the FlashAttention papers and torch's benchmarks, so our TFLOPS compare with theirs
    (the exact count, S(S+1)/2 pairs, differs by 1/S). Causal with S_q != S_k: no convention
    exists, so the visible pairs are counted exactly.
    """
    if D_v is not None and D_v != D:
        return (attention_flops(B, H, S_q, S_k, D, causal) + attention_flops(B, H, S_q, S_k, D_v, causal)) // 2
    if causal and S_q == S_k:
        return 2 * B * H * S_q * S_k * D
    return 4 * B * H * D * visible_pairs(S_q, S_k, causal)


def sweep_problems(base: Problem, lengths=SWEEP_S) -> list[Problem]:
    """One problem per sequence length, keeping B·S (tokens per launch) as in `base`.

    The FlashAttention papers sweep this way: the work grows like S, not S², so the longest
    point stays affordable and short sequences still fill the GPU.
    """
    tokens = base.B * base.S_q
    return [Problem(max(1, tokens // S), base.H, S, S, base.D, base.dtype, base.causal, base.H_kv)
            for S in lengths]


# ---------------------------------------------------------------------------------------------
# How launches are timed, and one result's figures
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    warmup: int = 3
    repeats: int = 100  # kernel-time launches, each after an L2 flush
    l2_flush_bytes: int = L2_FLUSH_BYTES
    tail: int = 0  # device-only back-to-back launches per kernel for the tail (0: not measured)
    calls: int = 0  # back-to-back calls per kernel for the call time (0: not measured)
    cap_seconds: float = 5.0  # tail and calls: at most about this much GPU time per kernel


def set_timing(result: Result, times_ms, flops: int, ceiling_tflops: float | None, *,
               kv_bytes: int | None = None, ceiling_gb_per_s: float | None = None) -> None:
    """Fill median/mean/p99/min/max, TFLOPS (from the median) and the share of the ceiling;
    with kv_bytes, GB/s of K and V read once (from the median) and the share of the copy's."""
    times = np.asarray(times_ms, dtype=np.float64)
    result.median_ms = float(np.median(times))
    result.min_ms = float(times.min())
    result.max_ms = float(times.max())
    result.mean_ms = float(times.mean())
    result.p99_ms = float(np.percentile(times, 99))
    result.tflops = flops / (result.median_ms * 1e-3) / 1e12
    if ceiling_tflops:
        result.pct_of_ceiling = 100.0 * result.tflops / ceiling_tflops
    if kv_bytes:
        result.gb_per_s = kv_bytes / (result.median_ms * 1e-3) / 1e9
        if ceiling_gb_per_s:
            result.pct_of_bandwidth = 100.0 * result.gb_per_s / ceiling_gb_per_s


# ---------------------------------------------------------------------------------------------
# Devices: where tensors live and how launches are timed
# ---------------------------------------------------------------------------------------------
def _events_to_ms(pairs, elapsed) -> list[float]:
    return [float(elapsed(start, end)) for start, end in pairs]


# ---------------------------------------------------------------------------------------------
# Timing on the device alone, the tail, the call
# ---------------------------------------------------------------------------------------------
SLOW = 1.5  # a launch longer than SLOW times the median counts as slow (the tail's count)
MEAN_OVER_MEDIAN = 1.05  # `flashcore report` flags a kernel whose mean exceeds its median by more
BATCH = 20  # launches queued behind one sleep


def distribution(times_ms) -> dict:
    """n, median, mean, p99, max (ms) of a list of times, and how many exceed SLOW x the median."""
    t = np.asarray(times_ms, dtype=np.float64)
    median = float(np.median(t))
    return {"n": int(t.size), "median_ms": median, "mean_ms": float(t.mean()),
            "p99_ms": float(np.percentile(t, 99)), "max_ms": float(t.max()), "slow": int((t > SLOW * median).sum())}


def queued_times(device, fn: Callable[[], None], n: int, *, flush: bool, batch: int = BATCH) -> list[float]:
    """n device-only times (ms) of fn's launches, an L2 flush before each when `flush`.

    In batches: a sleep kernel, then the batch's launches with an event pair around each. The
    sleep is sized from the host's time to queue one batch (three times as long, plus a
    millisecond), and checked against it afterwards: a batch whose queuing took longer than the
    GPU slept, so that the GPU may have waited for the host inside an interval, is dropped and
    queued again behind a sleep twice as long. Garbage collection is off meanwhile.
    `device` gives event(), record(event), elapsed(a, b) in ms, synchronize(), sleep(ms), flush().
    """
    batch = max(1, min(batch, n))
    t0 = time.perf_counter()
    for _ in range(batch):
        if flush:
            device.flush()
        fn()
    device.synchronize()
    sleep_ms = 3 * (time.perf_counter() - t0) * 1e3 + 1.0
    times, dropped = [], 0
    collecting = gc.isenabled()
    gc.disable()
    try:
        while len(times) < n:
            m = min(batch, n - len(times))
            gate = device.event(), device.event()
            device.record(gate[0])
            device.sleep(sleep_ms)
            device.record(gate[1])
            queued = time.perf_counter()
            pairs = []
            for _ in range(m):
                if flush:
                    device.flush()
                start, end = device.event(), device.event()
                device.record(start)
                fn()
                device.record(end)
                pairs.append((start, end))
            queued = (time.perf_counter() - queued) * 1e3
            device.synchronize()
            if queued >= device.elapsed(*gate):
                dropped += 1
                if dropped > 8:
                    raise RuntimeError(f"the host could not queue {m} launches within a {sleep_ms:.0f} ms sleep "
                                       f"of the GPU: the timing would include host time")
                sleep_ms *= 2
                continue
            times += _events_to_ms(pairs, device.elapsed)
    finally:
        if collecting:
            gc.enable()
    return times


def capped(n: int, median_ms: float, cap_seconds: float) -> int:
    """n, or fewer where n launches of median_ms would take more than cap_seconds (at least 20)."""
    return max(min(n, 20), min(n, int(cap_seconds * 1e3 / max(median_ms, 1e-6))))


def call_times(device, call: Callable[[], object], n: int) -> dict:
    """The call time: `call` back to back n times, garbage collection on, as a user's loop runs it,
    with events between the calls (the GPU's time from one call's work to the next, host time
    included wherever the GPU waited for it) and the host's own time per call."""
    return _call_summary(*_call_samples(device, call, n))


def paired_call_times(device, call: Callable[[], object], launch: Callable[[], object], n: int,
                      rounds: int = 4) -> tuple[dict, dict]:
    """call_times of `call` and of `launch` (its kernel's own launch), n each, taken in `rounds`
    alternating runs, so that both meet the board in the same states (a board at its power cap
    lowers its clock as back-to-back work goes on: measured one after the other, the second would
    run on a hotter board)."""
    calls, launches = ([], []), ([], [])  # (GPU times, host times) of each
    for i in range(rounds):
        m = n // rounds + (i < n % rounds)
        runs = ((call, calls), (launch, launches))
        for f, (times, host) in runs if i % 2 == 0 else runs[::-1]:
            t, h = _call_samples(device, f, m)
            times += t
            host += h
    return _call_summary(*calls), _call_summary(*launches)


def _call_samples(device, call, n: int) -> tuple[list, list]:
    """(GPU times in ms, host times in us) of n back-to-back calls, after three more unmeasured."""
    for _ in range(3):
        call()
    device.synchronize()
    events = [device.event() for _ in range(n + 1)]
    host = []
    device.record(events[0])
    for i in range(n):
        t0 = time.perf_counter()
        call()
        host.append((time.perf_counter() - t0) * 1e6)
        device.record(events[i + 1])
    device.synchronize()
    return [device.elapsed(events[i], events[i + 1]) for i in range(n)], host


def _call_summary(times, host) -> dict:
    result = distribution(times)
    result.update(host_median_us=float(np.median(host)), host_p99_us=float(np.percentile(host, 99)),
                  host_max_us=float(max(host)))
    return result


class NumbaDevice:
    """Numba device arrays and Numba events: the path without torch (also the simulator's)."""

    kind = "numba"
    torch_cuda = None
    no_peers_reason = "torch is not installed (pip install -e '.[torch]')"

    def __init__(self):
        from numba import cuda

        self.cuda = cuda
        if simulator_enabled():
            self.name, self.cc, self.stream = "CUDA simulator (CPU)", (0, 0), 0
        else:
            dev = cuda.get_current_device()
            name = dev.name
            self.name = name.decode() if isinstance(name, bytes) else str(name)
            self.cc = tuple(dev.compute_capability)
            # Our own stream: the L2 flush is queued asynchronously before each timed launch,
            # so the host's launch overhead hides behind it instead of landing in the timing.
            self.stream = cuda.stream()
        self._flush = None

    def inputs(self, problem: Problem, seed):
        if problem.dtype != "float16":
            raise ValueError(f"dtype: {problem.dtype} needs torch (NumPy has no bfloat16); "
                             f"install torch or use fp16")
        host = random_qkv((problem.B, problem.H, problem.S_q, problem.D), problem.S_k, seed=seed,
                          heads_kv=problem.heads_kv, value_dim=problem.D_v)
        return host, tuple(self.cuda.to_device(x) for x in host)

    def poisoned_output(self, q, value_dim=None):
        return self.cuda.to_device(np.full((*q.shape[:3], value_dim or q.shape[3]), np.nan, dtype=np.float16))

    def kernel_arrays(self, *arrays):
        return arrays

    def host(self, x) -> np.ndarray:
        return x.copy_to_host()

    def oracle(self, host_qkv, device_qkv, problem):
        """float64 reference and fp16 yardstick, in NumPy on the CPU (slow for big shapes)."""
        q, k, v = host_qkv
        ref = reference_attention(q, k, v, causal=problem.causal)
        lowp = lowp_attention(q, k, v, causal=problem.causal)
        return ref, lowp, {"reference": "reference_attention: float64 NumPy on the CPU",
                           "yardstick": "lowp_attention: NumPy, each step rounded to float16"}

    def ceiling(self, dtype, timing):
        return None  # the ceiling is a torch matmul

    def bandwidth(self, nbytes, timing):
        return None  # the bandwidth ceiling is a torch copy, beside the matmul

    def time_ms(self, fn: Callable[[], None], timing: Timing) -> list[float]:
        """The kernel time of fn's launches: device only, an L2 flush before each (queued_times)."""
        if self._flush is None or self._flush.size != timing.l2_flush_bytes:
            self._flush = self.cuda.device_array(timing.l2_flush_bytes, dtype=np.uint8)
        for _ in range(timing.warmup):
            fn()
        return queued_times(self, fn, timing.repeats, flush=True)

    # the primitives queued_times and call_times use, on this device's stream
    def event(self):
        return self.cuda.event()

    def record(self, event):
        event.record(self.stream)

    def elapsed(self, start, end) -> float:
        return self.cuda.event_elapsed_time(start, end)

    def synchronize(self):
        self.stream.synchronize()

    def flush(self):
        from numba.cuda.cudadrv.driver import device_memset

        self._flushes = getattr(self, "_flushes", 0) + 1
        device_memset(self._flush, self._flushes & 0xFF, self._flush.size, stream=self.stream)  # evict L2

    def sleep(self, ms: float):
        if simulator_enabled():  # no sleep there (nor any timing that means something)
            return
        _sleep_kernel()[1, 1, self.stream](np.uint64(ms * 1e6))

    def release(self):
        pass


class TorchDevice:
    """torch CUDA tensors and torch events: the path that can also run the SDPA peers."""

    kind = "torch"

    def __init__(self):
        import torch
        from numba import cuda

        self.torch, self.cuda = torch, cuda
        self.name = torch.cuda.get_device_name()
        self.cc = tuple(torch.cuda.get_device_capability())
        self.torch_cuda = torch.version.cuda
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._flush = None
        self._cycles_per_ms = None

    @property
    def stream(self):
        # Numba launches go to torch's current stream, so torch's events bracket them.
        return self.cuda.external_stream(self.torch.cuda.current_stream().cuda_stream)

    def inputs(self, problem: Problem, seed):
        torch = self.torch
        dtype = getattr(torch, problem.dtype)
        host = random_qkv((problem.B, problem.H, problem.S_q, problem.D), problem.S_k, seed=seed,
                          dtype=np.float32, heads_kv=problem.heads_kv, value_dim=problem.D_v)
        qkv = tuple(torch.from_numpy(x).to(self.device, dtype) for x in host)
        return None, qkv

    def poisoned_output(self, q, value_dim=None):
        return q.new_full((*q.shape[:3], value_dim or q.shape[3]), float("nan"))

    def kernel_arrays(self, *tensors):
        from ..api import torch_to_kernel

        return tuple(torch_to_kernel(t) for t in tensors)

    def host(self, x) -> np.ndarray:
        return x.float().cpu().numpy()

    def _chunks(self, problem: Problem):
        """(b, h0, h1) slices small enough that a float64 score matrix stays near 2 GB."""
        per_head = problem.S_q * problem.S_k
        heads = max(1, min(problem.H, 2**28 // per_head))
        for b in range(problem.B):
            for h0 in range(0, problem.H, heads):
                yield b, h0, min(problem.H, h0 + heads)

    def oracle(self, host_qkv, device_qkv, problem):
        """float64 reference on the GPU, and torch's math SDPA in the input dtype as the yardstick.

        Both go a slice of heads at a time: at S = 16384 a whole batch of float64 scores
        would not fit in GPU memory. The math backend is allowed to reduce in fp16/bf16
        (torch >= 2.5 otherwise upcasts to fp32), so the yardstick is what plain
        same-dtype framework arithmetic achieves, as the oracle intends.
        """
        torch = self.torch
        q, k, v = device_qkv
        if problem.H_kv is not None:  # the oracle sees every query head's K/V head spelled out
            k, v = (x.repeat_interleave(problem.H // problem.H_kv, dim=1) for x in (k, v))
        shape = (problem.B, problem.H, problem.S_q, problem.value_dim)
        ref, lowp = np.empty(shape), np.empty(shape)
        backends = torch.backends.cuda
        can_reduce = hasattr(backends, "allow_fp16_bf16_reduction_math_sdp")
        if can_reduce:
            previous = backends.fp16_bf16_reduction_math_sdp_allowed()
            backends.allow_fp16_bf16_reduction_math_sdp(True)
        try:
            for b, h0, h1 in self._chunks(problem):
                sl = (slice(b, b + 1), slice(h0, h1))
                ref[sl] = reference_attention(q[sl], k[sl], v[sl], causal=problem.causal)
                lowp[sl] = self.host(self.sdpa("MATH", q[sl], k[sl], v[sl], problem))
        finally:
            if can_reduce:
                backends.allow_fp16_bf16_reduction_math_sdp(previous)
        torch.cuda.empty_cache()
        return ref, lowp, {
            "reference": "reference_attention: float64 torch on the GPU",
            "yardstick": f"torch SDPA math backend in {problem.dtype}"
                         + (", fp16/bf16 reductions allowed" if can_reduce else ""),
        }

    def sdpa(self, backend: str, q, k, v, problem: Problem):
        """torch's scaled_dot_product_attention restricted to one backend (or FlexAttention: FLEX)."""
        torch = self.torch
        if backend == "FLEX":
            return self.flex(q, k, v, problem)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kwargs = {}
        if problem.causal and problem.S_q == problem.S_k:
            kwargs["is_causal"] = True
        elif problem.causal:  # torch's is_causal aligns top-left; ours is bottom-right
            from torch.nn.attention.bias import causal_lower_right

            kwargs["attn_mask"] = causal_lower_right(problem.S_q, problem.S_k)
        if k.shape[1] != q.shape[1]:
            kwargs["enable_gqa"] = True  # torch >= 2.5; a backend without GQA refuses, and says so
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)

    def flex(self, q, k, v, problem: Problem):
        """torch's FlexAttention, compiled once (torch.compile of flex_attention, as its users run
        it), the causal mask as a block mask aligned bottom-right, made once per problem."""
        torch = self.torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if getattr(self, "_flex_fn", None) is None:
            self._flex_fn, self._flex_masks = torch.compile(flex_attention, dynamic=False), {}
        block_mask = None
        if problem.causal:
            key = (problem.S_q, problem.S_k)
            if key not in self._flex_masks:
                offset = problem.S_k - problem.S_q

                def causal(b, h, q_idx, kv_idx):
                    return kv_idx <= q_idx + offset

                self._flex_masks[key] = create_block_mask(causal, None, None, problem.S_q, problem.S_k,
                                                          device=self.device)
            block_mask = self._flex_masks[key]
        return self._flex_fn(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])

    def ceiling(self, dtype: str, timing: Timing) -> dict:
        """Tensor-core ceiling of this card now: median TFLOPS of an N×N×N matmul."""
        torch = self.torch
        n = CEILING_N
        operands = [torch.randn(n, n, device=self.device, dtype=getattr(torch, dtype)) for _ in range(3)]
        a, b, c = operands
        times = self.time_ms(lambda: torch.matmul(a, b, out=c), Timing(3, 10, timing.l2_flush_bytes))
        median = float(np.median(times))
        operands.clear()
        torch.cuda.empty_cache()
        return {"what": f"torch.matmul {n}x{n}x{n} {dtype}, median of {len(times)}",
                "median_ms": median, "tflops": 2 * n**3 / (median * 1e-3) / 1e12}

    def bandwidth(self, nbytes: int, timing: Timing) -> dict:
        """Memory-bandwidth ceiling of this card now: a device-to-device copy of `nbytes` (the
        problem's K and V), each after the L2 flush. A copy reads and writes every byte, so its
        GB/s counts both: 2·nbytes per copy, what the memory moved."""
        torch = self.torch
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        times = self.time_ms(lambda: dst.copy_(src), Timing(3, 20, timing.l2_flush_bytes))
        median = float(np.median(times))
        del src, dst
        torch.cuda.empty_cache()
        return {"what": f"device-to-device copy of {nbytes} bytes (K and V), read and written, median of "
                        f"{len(times)}", "bytes": nbytes, "median_ms": median,
                "gb_per_s": 2 * nbytes / (median * 1e-3) / 1e9}

    def time_ms(self, fn: Callable[[], None], timing: Timing) -> list[float]:
        """The kernel time of fn's launches: device only, an L2 flush before each (queued_times)."""
        torch = self.torch
        if self._flush is None or self._flush.numel() != timing.l2_flush_bytes:
            self._flush = torch.empty(timing.l2_flush_bytes, dtype=torch.uint8, device=self.device)
        for _ in range(timing.warmup):
            fn()
        return queued_times(self, fn, timing.repeats, flush=True)

    # the primitives queued_times and call_times use, on torch's current stream
    def event(self):
        return self.torch.cuda.Event(enable_timing=True)

    def record(self, event):
        event.record()

    def elapsed(self, start, end) -> float:
        return start.elapsed_time(end)

    def synchronize(self):
        self.torch.cuda.synchronize()

    def flush(self):
        self._flush.zero_()  # evict L2; queued before the start event, so not timed

    def sleep(self, ms: float):
        """torch's spin kernel, for about `ms` (its cycles per ms measured once)."""
        torch = self.torch
        if self._cycles_per_ms is None:
            start, end = self.event(), self.event()
            torch.cuda._sleep(1_000_000)
            start.record()
            torch.cuda._sleep(10_000_000)
            end.record()
            torch.cuda.synchronize()
            self._cycles_per_ms = 10_000_000 / start.elapsed_time(end)
        torch.cuda._sleep(int(ms * self._cycles_per_ms))

    def release(self):
        self.torch.cuda.empty_cache()


@lru_cache(maxsize=None)
def _sleep_kernel():
    """A one-thread kernel that sleeps for about `ns` nanoseconds (NumbaDevice.sleep)."""
    from numba import cuda

    @cuda.jit
    def sleep(ns):
        slept = 0
        while slept < ns:
            cuda.nanosleep(1000)
            slept += 1000

    return sleep


def open_device(prefer_torch: bool = True):
    """TorchDevice when torch with CUDA is importable, else NumbaDevice."""
    if prefer_torch and not simulator_enabled():
        try:
            import torch
        except ImportError:
            return NumbaDevice()
        if torch.cuda.is_available():
            return TorchDevice()
        device = NumbaDevice()
        device.no_peers_reason = f"torch {torch.__version__} cannot see a CUDA GPU (a CPU-only build?)"
        return device
    return NumbaDevice()


# ---------------------------------------------------------------------------------------------
# The gate and the timing of one candidate
# ---------------------------------------------------------------------------------------------
def gate(result: Result, out: np.ndarray, ref: np.ndarray, lowp: np.ndarray, *, poisoned: bool) -> None:
    """Apply the correctness gate to a host copy of a candidate's output."""
    out = np.asarray(out, dtype=np.float64)
    if poisoned and out.shape == ref.shape:
        left = int(np.count_nonzero(np.isnan(out)))
        if left:
            first = np.argwhere(np.isnan(out))[0].tolist()
            result.correct = False
            result.message = (f"{left} of {out.size} outputs still NaN after the launch (never written, "
                              f"or NaN computed); first at index {first}")
            return
    verdict = check_close(out, ref, lowp)
    result.correct = verdict.ok
    result.message = verdict.message
    result.max_err = verdict.max_err
    result.allowed_err = verdict.allowed


def raised(e: Exception) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:300]


def flex_skip_reason(torch) -> str | None:
    """Why torch's FlexAttention cannot run here, or None: it came with torch 2.5
    (torch.nn.attention.flex_attention), and torch.compile builds its kernels with triton. A compile
    that fails all the same raises where the peer is called, and its row says so."""
    try:
        importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError as e:
        return f"torch {torch.__version__} has no FlexAttention (torch >= 2.5): {raised(e)}"
    triton = sys.modules["triton"] if "triton" in sys.modules else importlib.util.find_spec("triton")
    if triton is None:  # not installed, or its import blocked (None in sys.modules)
        return "no triton: torch.compile builds FlexAttention's kernels with triton, which is not installed"
    return None


def phase_skip_reason(phase, problem: Problem, device) -> str | None:
    """Why `phase` cannot run `problem` on `device`, or None."""
    allowed = phase_registry.dtypes(phase)
    if problem.dtype not in allowed:
        return f"phase {phase.ID} supports {', '.join(allowed)} only, not {problem.dtype}"
    if not phase_registry.supports_head_dim(phase, problem.D):
        return f"phase {phase.ID} supports head dim {phase_registry.head_dims_text(phase)}, not {problem.D}"
    if problem.D_v is not None and not phase_registry.supports_value_dim(phase, problem.D, problem.D_v):
        if phase_registry.supports_value_dim(phase):
            return f"phase {phase.ID} does not take D={problem.D} beside D_v={problem.D_v}"
        return f"phase {phase.ID} takes one head dim for q, k and v, not D={problem.D} and D_v={problem.D_v}"
    if not phase_registry.supports_head_dim(phase, problem.value_dim):
        return f"phase {phase.ID} supports head dim {phase_registry.head_dims_text(phase)}, not D_v={problem.D_v}"
    if problem.H_kv is not None and not phase_registry.supports_gqa(phase):
        return f"phase {phase.ID} needs as many K/V heads as query heads (no grouped-query attention)"
    if not simulator_enabled():
        return phase_registry.cc_reason(phase, device.cc)
    return None


def kernel_resources(kernel, args) -> dict:
    """Registers, static shared memory and local memory of the specialization `args` ran.

    The dispatcher reports them per compiled signature; we take the one matching the launch
    arguments (the only one, in practice).
    """
    argtypes = tuple(kernel.typeof_pyval(a) for a in args)

    def pick(table):
        if not isinstance(table, dict):
            return table
        if argtypes in table:
            return table[argtypes]
        return next(iter(table.values())) if len(table) == 1 else None

    return {"registers": pick(kernel.get_regs_per_thread()),
            "static_smem_bytes": pick(kernel.get_shared_mem_per_block()),
            "local_bytes_per_thread": pick(kernel.get_local_mem_per_thread())}


def check_phase(phase, device, qkv, problem: Problem, ref, lowp):
    """Run `phase` once on poisoned output and gate it. Returns (result, launch) where
    `launch()` repeats the launch for timing (None when the phase did not pass)."""
    result = Result(phase.ID, "phase", phase.TITLE)
    reason = phase_skip_reason(phase, problem, device)
    if reason:
        return unavailable(phase.ID, "phase", phase.TITLE, reason), None
    qk_scale = default_scale(problem.D) * LOG2E
    try:
        config = phase_registry.build(phase, problem.D, problem.dtype, value_dim=problem.D_v)
        result.dynamic_smem_bytes = int(config.smem_bytes)
        out = device.poisoned_output(qkv[0], problem.D_v)
        arrays = device.kernel_arrays(*qkv, out)
        stream = device.stream

        def launch():
            config.launch(*arrays, problem.causal, qk_scale, stream=stream)

        launch()
        host_out = device.host(out)
    except Exception as e:  # noqa: BLE001 - a compile or launch error is this phase's result, not a crash
        result.correct, result.message = False, f"raised {raised(e)}"
        return result, None
    gate(result, host_out, ref, lowp, poisoned=True)
    if not simulator_enabled():
        try:
            resources = kernel_resources(config.kernel, config.arguments(*arrays, problem.causal, qk_scale))
            for key, value in resources.items():
                setattr(result, key, None if value is None else int(value))
        except Exception as e:  # noqa: BLE001 - resources are informative; never lose a measurement
            warnings.warn(f"phase {phase.ID}: kernel resources unavailable ({raised(e)})", stacklevel=2)
    return result, (launch if result.correct else None)


def check_peer(name: str, device, qkv, problem: Problem, ref, lowp):
    """Run a torch SDPA backend once and gate it. Returns (result, launch or None)."""
    backend, title = PEERS[name]
    if device.kind != "torch":
        return unavailable(name, "peer", title, device.no_peers_reason), None
    from torch.nn.attention import SDPBackend

    if backend != "FLEX" and not hasattr(SDPBackend, backend):
        return unavailable(name, "peer", title, f"this torch has no SDPBackend.{backend}"), None
    if backend == "FLEX" and (why := flex_skip_reason(device.torch)):
        return unavailable(name, "peer", title, why), None
    q, k, v = qkv
    try:
        # torch says why a backend refuses an input in warnings; keep them for the reason
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = device.sdpa(backend, q, k, v, problem)
            device.torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - whatever torch raises is the reason it is unavailable
        why = "; ".join(str(w.message).splitlines()[0] for w in caught[:2])
        return unavailable(name, "peer", title, f"{raised(e)}" + (f" ({why})" if why else "")), None
    result = Result(name, "peer", title)
    gate(result, device.host(out), ref, lowp, poisoned=False)
    del out

    def launch():
        device.sdpa(backend, q, k, v, problem)

    return result, (launch if result.correct else None)


def bench_problem(problem: Problem, phase_list, peer_names, device, timing: Timing, *,
                  ceiling_tflops=None, ceiling_gb_per_s=None, seed=None,
                  progress: Callable[[str], None] | None = None):
    """Check and time every phase and peer on one problem. Returns (results, oracle, seed)."""
    step = progress or (lambda label: None)
    if seed is None:  # fresh inputs every run, but the seed is recorded so they can be remade
        seed = int(np.random.SeedSequence().entropy % 2**32)
    step(f"{problem.describe()}: inputs and reference")
    host_qkv, qkv = device.inputs(problem, seed)
    ref, lowp, oracle = device.oracle(host_qkv, qkv, problem)
    oracle = dict(oracle, atol=ATOL, rule="max|out - ref| <= 2 * max|yardstick - ref| + atol")
    candidates = [(f"phase {p.ID}", lambda p=p: check_phase(p, device, qkv, problem, ref, lowp))
                  for p in phase_list]
    candidates += [(name, lambda n=name: check_peer(n, device, qkv, problem, ref, lowp))
                   for name in peer_names]
    results = []
    for label, check in candidates:
        step(f"{problem.describe()}: {label}")
        result, launch = check()
        if launch is not None:
            try:
                set_timing(result, device.time_ms(launch, timing), problem.flops, ceiling_tflops,
                           kv_bytes=problem.kv_bytes, ceiling_gb_per_s=ceiling_gb_per_s)
                if timing.tail:
                    n = capped(timing.tail, result.median_ms, timing.cap_seconds)
                    result.tail = distribution(queued_times(device, launch, n, flush=False))
                if timing.calls and device.kind == "torch":
                    n = capped(timing.calls, result.median_ms, timing.cap_seconds)
                    if result.kind == "peer":
                        result.call = call_times(device, launch, n)
                    else:
                        result.call, result.launch_loop = paired_call_times(
                            device, _attention_call(result.name, qkv, problem),
                            _plan_launch(result.name, qkv, problem), n)
                        result.launch_loop["launch"] = "plan"
                        result.call_op = call_times(device, _attention_call(result.name, qkv, problem, op=True), n)
            except Exception as e:  # noqa: BLE001 - recorded in the result, the run goes on
                result.correct = False
                result.message = f"passed the gate, then timing raised {raised(e)}"
                for key in ("median_ms", "min_ms", "max_ms", "mean_ms", "p99_ms", "tflops", "pct_of_ceiling",
                            "gb_per_s", "pct_of_bandwidth", "tail", "call", "call_op", "launch_loop"):
                    setattr(result, key, None)  # an incorrect result carries no speed figure
        results.append(result)
        device.release()
    return results, oracle, seed


def _plan_launch(kernel_id: str, qkv, problem: Problem) -> Callable[[], object]:
    """The kernel's launch as attention() makes it, less the call around it: the problem's plan
    (api.make_plan, validated once here) launched by the driver on torch's current stream into one
    output made beforehand, without the call's plan lookup, checks and allocation. The lessons'
    launch through Numba's dispatcher would not do as this yardstick: its 0.2-0.4 ms of host time
    a launch outlasts the small problems' kernels, so back to back it times the host."""
    import torch

    from ..api import current_stream, make_plan

    q, k, v = qkv
    plan = make_plan(q, k, v, problem.causal, None, kernel_id)
    out = torch.empty_like(q)
    stream = current_stream(q.device.index or 0)

    def launch():
        plan(q, k, v, out, stream)

    return launch


def _attention_call(kernel_id: str, qkv, problem: Problem, op: bool = False) -> Callable[[], object]:
    """What a user calls: attention() on the benchmark's tensors, this kernel chosen by id; with op,
    the custom op a compiled model calls instead, torch.ops.flashcore.attention."""
    from ..api import attention

    q, k, v = qkv
    if op:
        import torch

        attention_op = torch.ops.flashcore.attention

        def call():
            return attention_op(q, k, v, problem.causal, None, kernel_id)
    else:
        def call():
            return attention(q, k, v, causal=problem.causal, phase=kernel_id)

    return call


def run_benchmark(problem: Problem, *, phase_ids=None, peer_names=DEFAULT_PEERS, timing=Timing(),
                  sweep_lengths=None, measure_ceiling=True, command=None, progress=None,
                  device=None) -> dict:
    """`flashcore bench`: the whole protocol on one problem (or a sweep), returned as a record."""
    device = device or open_device()
    phase_list = [phase_registry.get_phase(p) for p in (phase_ids or phase_registry.KERNELS)]
    clock_start = nvidia_smi().get("sm_clock_mhz")
    step = progress or (lambda label: None)
    ceiling = bandwidth = None
    if measure_ceiling:
        step("tensor-core ceiling (fp16 matmul) and bandwidth ceiling (copy)")
        ceiling = device.ceiling(problem.dtype, timing)
        bandwidth = device.bandwidth(problem.kv_bytes, timing)
    ceiling_tflops = ceiling["tflops"] if ceiling else None
    common = {"device": device, "timing": timing, "ceiling_tflops": ceiling_tflops, "progress": progress,
              "ceiling_gb_per_s": bandwidth["gb_per_s"] if bandwidth else None}
    command = command if command is not None else ["flashcore", *sys.argv[1:]]
    if sweep_lengths is None:
        results, oracle, seed = bench_problem(problem, phase_list, peer_names, **common)
        return build_record(problem=problem, results=results, provenance=provenance(
            device, sm_clock_start=clock_start), timing=timing, ceiling=ceiling, oracle=oracle,
            command=command, seed=seed, bandwidth=bandwidth)
    points = []
    for point in sweep_problems(problem, sweep_lengths):
        results, oracle, seed = bench_problem(point, phase_list, peer_names, **common)
        points.append({"S": point.S_q, "B": point.B, "config": point.as_dict(), "flops": point.flops,
                       "seed": seed, "results": results})
    oracle = dict(oracle, sweep_rule=f"B*S held at {problem.B * problem.S_q} tokens")
    return build_record(problem=problem, results=None, provenance=provenance(
        device, sm_clock_start=clock_start), timing=timing, ceiling=ceiling, oracle=oracle,
        command=command, sweep=points, bandwidth=bandwidth)


def ladder_speedups(results) -> dict[str, tuple[str, float]]:
    """Phase id -> (id of the nearest earlier timed phase, TFLOPS ratio to it).

    A phase that failed or was skipped is passed over, and the comparison names the phase it
    is made against, so a regression reads "0.8x phase 03", never a silent gap.
    """
    speedups, previous = {}, None
    phase_results = sorted((r for r in results if r["kind"] == "phase"), key=lambda r: r["name"])
    for r in phase_results:
        if r.get("tflops"):
            if previous is not None:
                speedups[r["name"]] = (previous["name"], r["tflops"] / previous["tflops"])
            previous = r
    return speedups


def format_tflops(value) -> str:
    """About 3 significant digits, without exponents: 0.81, 1.00, 11.4, 298."""
    if value is None:
        return "—"
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"

"""Where the host time of one attention() call goes (torch fp16, B=1 H=16 S=128 D=64), part by part.

Run on a GPU with torch: `python3 tools/call_profile.py`. Each line is the host's time per call
of that part (see `us`: batches of calls queued while the GPU sleeps, so only the host is timed):
attention() itself through phase 09's and phase 07's plans, the plan's own launch, the driver
launch alone, and each piece a call pays for (the output's allocation, the current stream, the
plan's key), beside torch SDPA; the backward as attention()'s autograd calls it, beside SDPA
flash's; and a training step's calls (the forward with grad, forward and backward), beside SDPA
flash's. docs/tuning/call_path.md holds its runs (runs 1 and 2 timed 5000
calls back to back, where a line near the kernel's 10 us could be the GPU's pace).
"""

import contextlib
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashcore_numba import api, attention
from flashcore_numba.runtime import torch_ops


def us(fn, n=200, reps=9):
    """The host's time per call of fn, median of `reps` batches of n calls, each queued while the
    GPU sleeps (so the launch queue never fills and the GPU's pace cannot enter); a batch the GPU
    woke up during is dropped."""
    for _ in range(3): fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda._sleep(150_000_000)  # about 75 ms at 1.98 GHz
        asleep = torch.cuda.Event(); asleep.record()
        t = time.perf_counter()
        for _ in range(n): fn()
        dt = (time.perf_counter() - t) / n * 1e6
        if not asleep.query():
            times.append(dt)
        torch.cuda.synchronize()
    return statistics.median(times) if times else float("nan")


q = torch.randn(1, 16, 128, 64, device="cuda", dtype=torch.float16); k = torch.randn_like(q); v = torch.randn_like(q)
attention(q, k, v); attention(q, k, v, phase="07")
plan09 = next(p for key, p in api._PLANS.items() if key[0] == "best")
plan07 = next(p for key, p in api._PLANS.items() if key[0] == "07")
out = torch.empty_like(q)
out9, lse9 = attention(q, k, v, return_lse=True)
leaves = [x.clone().requires_grad_() for x in (q, k, v)]
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    sdpa_out = torch.nn.functional.scaled_dot_product_attention(*leaves)
s = torch.cuda.current_stream().cuda_stream
flash = torch.nn.functional.scaled_dot_product_attention  # the FLASH rows run inside sdpa_kernel (below)

rows = {
 "attention() 09": lambda: attention(q, k, v),
 "attention() 07": lambda: attention(q, k, v, phase="07"),
 "plan09(q,k,v,out,s)": lambda: plan09(q, k, v, out, s),
 "plan07(q,k,v,out,s)": lambda: plan07(q, k, v, out, s),
 "plan07.launch(s), the driver launch only": lambda: plan07.launch(s),
 "torch.empty": lambda: torch.empty(q.shape, dtype=q.dtype, device=q.device),
 "torch.cuda.current_stream(dev).cuda_stream": lambda: torch.cuda.current_stream(0).cuda_stream,
 "torch._C._cuda_getCurrentRawStream(0)": lambda: torch._C._cuda_getCurrentRawStream(0),
 "torch.cuda.current_device()": lambda: torch.cuda.current_device(),
 "torch.compiler.is_compiling()": lambda: torch.compiler.is_compiling(),
 "grad check": lambda: torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
 "key tuple": lambda: ("best", bool, False, type(None), None, False, type(q), type(k), type(v), q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, q.is_contiguous(), k.is_contiguous(), v.is_contiguous()),
 "3x data_ptr": lambda: (q.data_ptr(), k.data_ptr(), v.data_ptr()),
 "q.device.index": lambda: q.device.index,
 "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
 # the backward (phase 11) as attention()'s autograd calls it, through its plan (runtime/backward.py)
 "backward (torch_ops.attention_backward)": lambda: torch_ops.attention_backward(q, k, v, out9, lse9, out9, None, False, q.shape[-1] ** -0.5, False),
 "backward, deterministic": lambda: torch_ops.attention_backward(q, k, v, out9, lse9, out9, None, False, q.shape[-1] ** -0.5, True),
 "sdpa flash backward": lambda: torch.autograd.grad(sdpa_out, leaves, out9, retain_graph=True),
 # a training step's calls: the forward with grad (flashcore::attention_train and its autograd
 # node), and forward and backward together
 "attention() with grad (forward)": lambda: attention(*leaves),
 "sdpa flash with grad (forward)": lambda: flash(*leaves),
 "attention() forward + backward": lambda: torch.autograd.grad(attention(*leaves), leaves, out9),
 "sdpa flash forward + backward": lambda: torch.autograd.grad(flash(*leaves), leaves, out9),
}
# the rows of SDPA's flash backend run inside one sdpa_kernel context: entering it costs several us
IN_FLASH = {"sdpa flash with grad (forward)", "sdpa flash forward + backward"}
# rows of several launches each take smaller batches, so that a batch fits the launch queue
FEWER = {"backward (torch_ops.attention_backward)": 100, "backward, deterministic": 100, "sdpa flash backward": 100,
         "attention() forward + backward": 50, "sdpa flash forward + backward": 50}
for name, fn in rows.items():
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if name in IN_FLASH else contextlib.nullcontext():
        t = us(fn, n=FEWER.get(name, 200))
    print(f"{name:45s} {t:7.2f} us", flush=True)

"""Host time per launch against GPU time per launch: phases 08 and 09 at a short shape.

A launch whose host work (building arguments, typing them, the driver call) takes longer than the
kernel runs leaves the GPU waiting between back-to-back launches: a benchmark then times the host.
Run on a GPU with torch: `python tools/host_time.py`. It prints, per phase, the host time of one
launch (200 launches by the host clock, without synchronizing) and the GPU time of one launch
(200 launches queued behind long matmuls, so that the host is never what the GPU waits for),
then the profile of phase 09's launches by host time. docs/tuning/09_history.md
is its output.
"""

import argparse
import cProfile
import io
import math
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(B=64, H=16, S=512, D=64, causal=True, n=200):
    import torch
    from numba import cuda

    from flashcore_numba.api import torch_to_kernel
    from flashcore_numba.phases import p08_wgmma, p09_warp_specialized
    from flashcore_numba.phases.common import LOG2E

    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3))
    arrays = [torch_to_kernel(x) for x in (q, k, v, torch.empty_like(q))]
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    big = torch.empty(8192, 8192, device="cuda", dtype=torch.float16)
    for name, config in (("08", p08_wgmma.build(D)), ("09", p09_warp_specialized.build(D))):
        def launch():
            config.launch(*arrays, causal, LOG2E / math.sqrt(D), stream=stream)

        for _ in range(20):
            launch()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            launch()
        host = (time.perf_counter() - t) / n
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(80):  # some 100 ms of work ahead of the launches
            big @ big
        start.record()
        for _ in range(n):
            launch()
        end.record()
        torch.cuda.synchronize()
        print(f"{name}: host {host * 1e6:.0f} us per launch; GPU {start.elapsed_time(end) / n * 1e3:.0f} us "
              f"per launch (queued)", flush=True)
        if name == "09":
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(n):
                launch()
            profile.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
            print(text.getvalue())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="64,16,512,64", help="B,H,S,D (default 64,16,512,64)")
    parser.add_argument("--no-causal", action="store_true", help="without the causal mask")
    args = parser.parse_args()
    try:
        B, H, S, D = (int(x) for x in args.shape.split(","))
    except ValueError:
        parser.error(f"--shape: expected four integers B,H,S,D, got {args.shape!r}")
    main(B, H, S, D, causal=not args.no_causal)

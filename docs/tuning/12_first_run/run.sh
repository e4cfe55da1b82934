#!/usr/bin/env bash
# Phase 12's first GPU run, one device call (about 9 of its 10 minutes), from the repository root:
#
#   run(command="bash docs/tuning/12_first_run/run.sh", carry=[".whl"], timeout_s=600)
#
# with .whl holding numpy 2.4's wheel (DEVELOPERS.md). Each step's log goes to $OUT; the A/B's JSON
# lines (tools/ab_backward.py: checked against torch's float32 autograd, then timed by turns with
# phase 11) are what docs/tuning/12_history.md records. A step that fails does not stop the next.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export FLASHCORE_CACHE_DIR=/tmp/fcc PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
# 1. the kernels the tests and the A/B load (09: attention()'s forward, whose O and LSE the GPU tests use)
( time python3 -m flashcore_numba compile --phases 09,11,12 --head-dims 64,128 --dtypes fp16,bf16 --jobs 16 ) \
  > "$OUT/compile.txt" 2>&1; tail -3 "$OUT/compile.txt"
# 2. the new wgmma forms against NumPy on the hardware, then phase 12 against torch's autograd
FLASHCORE_GPU=1 timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_ptx.py -k "wgmma_backward_products or wgmma_128_key or wgmma_tiles" tests/test_backward_wgmma.py \
  > "$OUT/gpu_tests.txt" 2>&1; tail -6 "$OUT/gpu_tests.txt"
# 3. phase 11 against phase 12 and its variant with dQ one tile late (make_dq_late.py writes it into
#    phases/, where the kernel cache keeps its kernels), by turns, at B=16 H=16 S=2048 and B=1 H=16
#    S=4096 (ms per backward); each version's first process compiles what the cache lacks
python3 docs/tuning/12_first_run/make_dq_late.py
LATE=flashcore_numba/phases/_ab_12late.py
for D in 64 128; do
  for version in new 12 "$LATE" new 12 "$LATE"; do
    timeout 150 python3 tools/ab_backward.py time "$version" "$D" | tee -a "$OUT/ab.jsonl"
  done
done
# 4. each kernel's device time in one backward of phase 12 (torch.profiler)
timeout 100 python3 tools/ab_backward.py kernels 12 64 | tee -a "$OUT/kernels.jsonl"

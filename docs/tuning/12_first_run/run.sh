#!/usr/bin/env bash
# Phase 12's first GPU runs, from the repository root, one device call a step (each well inside the
# 10 minutes of a call), with .whl holding numpy 2.4's wheel (DEVELOPERS.md):
#
#   run(command="bash docs/tuning/12_first_run/run.sh check", carry=[".whl"])    # about 6 minutes
#   run(command="bash docs/tuning/12_first_run/run.sh ab 64", carry=[".whl"])    # a few minutes each
#   run(command="bash docs/tuning/12_first_run/run.sh ab 128", carry=[".whl"])
#   run(command="bash docs/tuning/12_first_run/run.sh verify", carry=[".whl"])  # about 6 minutes
#
# A fresh machine has an empty kernel cache: each step compiles what it needs first (all cores).
# Logs go to $OUT; the A/B's JSON lines (tools/ab_backward.py: checked against torch's float32
# autograd, then timed by turns) are what docs/tuning/12_history.md records. A failing step does not
# stop the next within a call.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export FLASHCORE_CACHE_DIR=/tmp/fcc PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
# (the first run also A/B'd a variant with dQ one tile late, written by make_dq_late.py: since taken
# into phase 12's serial build at D = 128 (dq_late), the script is gone; see it at commit c69a6db)

case "${1:-check}" in
  check)
    # the kernels the tests load (09: attention()'s forward, whose O and LSE the GPU tests use)
    ( time python3 -m flashcore_numba compile --phases 09,11,12 --head-dims 64,128 --dtypes fp16,bf16 --jobs 16 ) \
      > "$OUT/compile.txt" 2>&1; tail -3 "$OUT/compile.txt"
    # the new wgmma forms against NumPy on the hardware, then phase 12 against torch's autograd
    # (test_ptx's wgmma tests are not marked `gpu`: they run on whichever target the session has)
    FLASHCORE_GPU=1 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_ptx.py \
      -k "wgmma_backward_products or wgmma_128_key or wgmma_tiles" > "$OUT/gpu_tests.txt" 2>&1
    FLASHCORE_GPU=1 timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_backward_wgmma.py \
      >> "$OUT/gpu_tests.txt" 2>&1; grep -E "passed|failed|error" "$OUT/gpu_tests.txt"
    # phase 12's kernels' device times
    timeout 100 python3 tools/ab_backward.py kernels 12 64 | tee "$OUT/kernels.jsonl"
    ;;
  ab)
    D=${2:?head dim}
    python3 -m flashcore_numba compile --phases 11,12 --head-dims "$D" --dtypes fp16 --jobs 16 > "$OUT/compile.txt" 2>&1
    # phase 11 (new) and phase 12 by turns, three times: B=16 H=16 S=2048 and B=1 H=16 S=4096, ms per
    # backward, both dQ modes, causal and not
    for version in new 12 new 12 new 12; do
      timeout 150 python3 tools/ab_backward.py time "$version" "$D" | tee -a "$OUT/ab_d$D.jsonl"
    done
    ;;
  verify)
    # the GPU checks of a build no device call has tested yet (both dtypes): phase 12's and phase 11's
    # GPU tests (autograd runs 12 on Hopper), then the sanitizer's backward cases
    ( time python3 -m flashcore_numba compile --phases 09,11,12 --head-dims 64,128 --dtypes fp16,bf16 --jobs 16 ) \
      > "$OUT/compile.txt" 2>&1; tail -3 "$OUT/compile.txt"
    FLASHCORE_GPU=1 timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_backward_wgmma.py \
      tests/test_backward.py > "$OUT/gpu_tests.txt" 2>&1; grep -E "passed|failed|error" "$OUT/gpu_tests.txt"
    timeout 150 python3 tools/sanitize.py --backward --out "$OUT/sanitizer" 2>&1 | tail -6
    ;;
  after)
    # a change to phase 12, checked and recorded in one call (fp16: what the records time): the
    # records at D = 128 first (tools/records.sh backward's benches), its GPU tests, the
    # sanitizer's backward cases, the records at D = 64; each record copied to $OUT as soon as it is
    # written (a call cut short keeps those). Pass the commit the tree holds:
    #   FLASHCORE_GIT_COMMIT=<sha> FLASHCORE_GIT_DIRTY=0 bash docs/tuning/12_first_run/run.sh after
    python3 -m flashcore_numba compile --phases 09,11,12 --head-dims 64,128 --dtypes fp16 --jobs 16 \
      > "$OUT/compile.txt" 2>&1; tail -1 "$OUT/compile.txt"
    records_at() {
      for causal in "" --causal; do
        timeout 100 python3 -m flashcore_numba bench --backward --shape "16,16,2048,$1" $causal --calls 1000 \
          --cap-seconds 1 --out "$OUT/backward_d$1${causal:+_causal}.json" 2>&1 | grep -E "^(11|12|SDPA)"
      done
    }
    records_at 128
    FLASHCORE_GPU=1 timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_backward_wgmma.py \
      -k "not bfloat16" > "$OUT/gpu_tests.txt" 2>&1; grep -E "passed|failed|error" "$OUT/gpu_tests.txt"
    timeout 120 python3 tools/sanitize.py --backward --out "$OUT/sanitizer" 2>&1 | tail -4
    records_at 64
    ;;
esac

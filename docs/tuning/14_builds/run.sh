#!/usr/bin/env bash
# Phase 14 on a GPU in one device call (about 8 minutes on an H100, most of it compiling): its kernels
# compiled in parallel (warm.py), the GPU tests, the flex records and the sanitizers.
#   FLASHCORE_GIT_COMMIT=<commit> FLASHCORE_GIT_DIRTY=0 docs/tuning/14_builds/run.sh
# (the commit the tree holds, where the machine's .git is not the tree's: tools/records.sh)
set -uo pipefail
cd "$(dirname "$0")/../../.."
export FLASHCORE_GPU=1
python3 -m flashcore_numba compile --phases 09 --head-dims 64,128 --dtypes fp16 --jobs 2 &
python3 docs/tuning/14_builds/warm.py 16
wait
python3 -m pytest -q -m gpu tests/test_flex_kernel.py --durations=5
tools/records.sh flex
for tool in memcheck racecheck synccheck; do
  compute-sanitizer --tool "$tool" --report-api-errors no python3 tools/sanitize_flex.py > "docs/sanitizer/flex/$tool.log" 2>&1
  tail -1 "docs/sanitizer/flex/$tool.log"
done

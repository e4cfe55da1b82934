# One call after the change (carry [".whl"]; from the repository root; COMMIT: the commit the tree
# holds, short as the other records name theirs: COMMIT=$(git rev-parse --short HEAD) here):
# phase 10's GPU tests, then tools/records.sh decode and latency_decode (the records of docs/bench/
# that have phase 10), with the kernels compiled first side by side.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLASHCORE_GIT_COMMIT=$COMMIT FLASHCORE_GIT_DIRTY=0
python3 -m flashcore_numba compile --phases 07,09,10,10-kvcache --head-dims 64,128 --dtypes fp16,bf16 --jobs 16 2>&1 | tail -3
FLASHCORE_GPU=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
    -k "split_keys or kvcache or phase10 or lse" 2>&1 | tail -5 | tee $OUT/gpu_tests.log
tools/records.sh decode latency_decode > $OUT/records.log 2>&1; echo "records rc $?"
grep -E "^\+|phase 10|  10 " $OUT/records.log | head -40
# only the records this run wrote, in one tarball with the log (the device returns at most 8 files:
# the first run of this script lost its records copying the whole of docs/bench, the second lost four
# of seven copying them one by one)
grep -l "$COMMIT" -r docs/bench | tar czf $OUT/records.tgz -T - $OUT/records.log $OUT/gpu_tests.log 2>/dev/null
tar tzf $OUT/records.tgz

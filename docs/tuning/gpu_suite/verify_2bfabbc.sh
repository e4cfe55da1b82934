# Check the suite's cache fixes (2bfabbc) on tests that compiled with a warm cache; per-test wall times.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/numpy*.whl
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/nbformat*.whl .whl/fastjsonschema*.whl \
  .whl/jsonschema*.whl .whl/jupyter_core*.whl .whl/platformdirs*.whl .whl/pyrsistent*.whl .whl/traitlets*.whl \
  .whl/attrs*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLASHCORE_CACHE_DIR=/tmp/fcc FLASHCORE_GPU=1
stamp() { python3 -u -c '
import sys, time
t0 = time.time()
for line in sys.stdin:
    sys.stdout.write(f"{time.time()-t0:7.1f} {line}"); sys.stdout.flush()'; }
P="python3 -m pytest -m gpu -v -p no:cacheprovider"
(timeout 270 $P tests/test_gpu.py -k "warm_cache or corrupted or compile_fills" 2>&1 | stamp > $OUT/cache_tests.log) &
s=$(date +%s)
timeout 120 python3 -m flashcore_numba compile --phases 07,09,10-kvcache,09-trace --head-dims 64,128 --dtypes fp16 --jobs 10 2>&1 | tail -1
echo "compile $(( $(date +%s)-s )) s"
(timeout 150 $P tests/test_exercises.py -k "09" 2>&1 | stamp > $OUT/exercises09.log) &
timeout 130 $P "tests/test_properties.py::test_random_problems_on_gpu[07]" "tests/test_properties.py::test_random_problems_on_gpu[09]" \
  tests/test_inference.py::test_random_caches_on_gpu tests/test_gpu.py::test_trace_build_on_gpu 2>&1 | stamp > $OUT/others.log
wait
echo "all $(( $(date +%s)-s )) s"
for f in $OUT/*.log; do echo "== $f"; grep -E "PASSED|FAILED|ERROR|passed|failed" $f | tail -12; done

# Call 1 (#37 item 7): every kernel into an empty cache, returned compressed; the toolchain's versions;
# a cProfile of one property test (why ~125 ms per example). carry [".whl", ".scratch/exp62"]
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/numpy*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLASHCORE_CACHE_DIR=/tmp/fcc FLASHCORE_GPU=1
python3 -c "from flashcore_numba.arch import cache; import json; print(json.dumps(cache.toolchain()))" | tee $OUT/toolchain.json
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
s=$(date +%s)
timeout 400 python3 -m flashcore_numba compile --jobs 16 2>&1 | tr '\r' '\n' | tail -4
echo "compile $(( $(date +%s)-s )) s"; du -sh /tmp/fcc; ls /tmp/fcc | wc -l
tar czf - -C /tmp fcc | split -b 15M - $OUT/fcc.tgz.part
ls -la $OUT
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/hypothesis*.whl 2>/dev/null
s=$(date +%s)
timeout 100 python3 -m cProfile -o /tmp/prop07.prof -m pytest -m gpu -q -p no:cacheprovider \
  "tests/test_properties.py::test_random_problems_on_gpu[07]" 2>&1 | tail -3
echo "prop07 $(( $(date +%s)-s )) s"
python3 - <<'PY' | tee $OUT/prop07_profile.txt
import pstats
p = pstats.Stats("/tmp/prop07.prof"); p.sort_stats("cumulative").print_stats(40)
p.sort_stats("tottime").print_stats(20)
PY

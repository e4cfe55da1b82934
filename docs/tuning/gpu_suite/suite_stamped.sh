# Call 2 (#37 item 7): the whole `-m gpu` suite with the cache of call 1 carried; every line stamped.
# carry [".whl", ".scratch/fccz", ".scratch/exp62"]
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
cat .scratch/fccz/fcc.tgz.part* | tar xzf - -C /tmp && du -sh /tmp/fcc
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLASHCORE_CACHE_DIR=/tmp/fcc FLASHCORE_GPU=1
python3 -c "import numpy, hypothesis, nbformat; print('numpy', numpy.__version__, 'hypothesis', hypothesis.__version__, 'nbformat', nbformat.__version__)"
stamp() { python3 -u -c '
import sys, time
t0 = time.time()
for line in sys.stdin:
    sys.stdout.write(f"{time.time()-t0:7.1f} {line}"); sys.stdout.flush()'; }
s=$(date +%s)
set -o pipefail
timeout ${T:-555} python3 -m pytest -m gpu -v --durations=30 -p no:cacheprovider 2>&1 | stamp > $OUT/suite.log
echo "rc=$? suite $(( $(date +%s)-s )) s"
grep -E "passed|failed|error" $OUT/suite.log | tail -3
sed -n '/slowest/,$p' $OUT/suite.log | head -70

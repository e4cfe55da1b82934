# GPU suite with per-test wall times even when killed: two pytest processes in parallel (test_gpu.py;
# everything else), each line stamped with seconds since start; then the cache entries the suite added.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/numpy*.whl
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/nbformat*.whl .whl/fastjsonschema*.whl \
  .whl/jsonschema*.whl .whl/jupyter_core*.whl .whl/platformdirs*.whl .whl/pyrsistent*.whl .whl/traitlets*.whl \
  .whl/attrs*.whl > /dev/null 2>&1
rm -rf /tmp/fcc; cat .scratch/fccz/fcc.tgz.part* | tar xzf - -C /tmp && ls /tmp/fcc > /tmp/before.txt
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLASHCORE_CACHE_DIR=/tmp/fcc FLASHCORE_GPU=1
stamp() { python3 -u -c '
import sys, time
t0 = time.time()
for line in sys.stdin:
    sys.stdout.write(f"{time.time()-t0:7.1f} {line}"); sys.stdout.flush()'; }
T=${1:-520}
(timeout $T python3 -m pytest -m gpu -v -p no:cacheprovider tests/test_gpu.py 2>&1 | stamp > $OUT/gpu.log) &
timeout $T python3 -m pytest -m gpu -v -p no:cacheprovider --ignore=tests/test_gpu.py 2>&1 | stamp > $OUT/rest.log
wait
ls /tmp/fcc | sort > /tmp/after.txt
python3 - <<'PY' > $OUT/new_entries.txt
import json
before = set(open("/tmp/before.txt").read().split())
for name in sorted(set(open("/tmp/after.txt").read().split()) - before):
    if not name.endswith(".cubin"): continue
    data = open("/tmp/fcc/" + name, "rb").read()
    i = data.index(b"\n"); j = data.index(b"\n", i + 1)
    h = json.loads(data[i + 1:j])
    print(name[:12], h["kernel"], h["cc"], h["argtypes"][:160])
PY
wc -l $OUT/new_entries.txt; tail -3 $OUT/gpu.log $OUT/rest.log

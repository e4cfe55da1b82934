# GPU suite with the carried warm cache (#37 item 7), in chunks that each fit one call.
# usage: bash .scratch/exp60/suite.sh <all | 1..3>; carry [".whl", ".scratch/fccz", ".scratch/exp60"]
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/numpy*.whl
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/nbformat*.whl .whl/fastjsonschema*.whl \
  .whl/jsonschema*.whl .whl/jupyter_core*.whl .whl/platformdirs*.whl .whl/pyrsistent*.whl .whl/traitlets*.whl \
  .whl/attrs*.whl 2>&1 | tail -2
cat .scratch/fccz/fcc.tgz.part* | tar xzf - -C /tmp && du -sh /tmp/fcc   # the cache where call A wrote it
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLASHCORE_CACHE_DIR=/tmp/fcc FLASHCORE_GPU=1
python3 -c "import numpy, hypothesis, nbformat; print('numpy', numpy.__version__, 'hypothesis', hypothesis.__version__, 'nbformat', nbformat.__version__)"
case "$1" in
  1) timeout 560 python3 -m pytest -m gpu -q tests/test_gpu.py --durations=15 2>&1 | tail -25 ;;
  2) timeout 560 python3 -m pytest -m gpu -q tests/test_properties.py tests/test_backward.py tests/test_ptx.py \
       tests/test_varlen.py tests/test_inference.py --durations=15 2>&1 | tail -25 ;;
  3) timeout 560 python3 -m pytest -m gpu -q tests/test_exercises.py --durations=15 2>&1 | tail -25 ;;
  all) s=$(date +%s); timeout 570 python3 -m pytest -m gpu -q --durations=30 -p no:cacheprovider > $OUT/suite.log 2>&1
       echo "rc=$? suite $(( $(date +%s)-s )) s"; tail -45 $OUT/suite.log ;;
esac

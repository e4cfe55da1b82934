# The parts of phase 10's time (parts_*.txt): five builds compiled side by side, timed in turn.
# From the repository root: python3 docs/tuning/10_read_ceiling/make_variant.py first.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/numpy*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLASHCORE_CACHE=0
S=docs/tuning/10_read_ceiling
python3 $S/make_variant.py
python3 $S/var.py full & NOROOT=1 python3 $S/var.py noroot & NOMERGE=1 python3 $S/var.py nomerge &
NOMATH=1 python3 $S/var.py nomath & NOMATH=1 NOMERGE=1 python3 $S/var.py nomath_nomerge &
wait

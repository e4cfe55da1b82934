# The A/B of make_variant<N>.py's p10v<N> against the package's phase 10, one call from the
# repository root, carry [".whl"]: N=5 (tile t + 1's q · kᵀ before tile t's softmax; timed, table5_*),
# N=6 (the merges' loads before their stores; not yet timed).
N=${N:?N: which make_variant<N>.py}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/numpy*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLASHCORE_CACHE=0
S=docs/tuning/10_ilp
python3 $S/make_variant$N.py
printf 0 > $OUT/turn
export VARIANTS=base,v$N
(MODULE=package python3 $S/ab.py base 4 32 3 2>&1 | grep -v -i warn | tail -3) &
(MODULE=p10v$N python3 $S/ab.py v$N 4 32 3 2>&1 | grep -v -i warn | tail -3) &
wait
python3 $S/table.py $OUT | tee $OUT/table.txt
rm -f $OUT/turn

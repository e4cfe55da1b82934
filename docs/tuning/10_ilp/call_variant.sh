# The A/B of make_variant<N>.py's p10v<N> against the package's phase 10, one call from the
# repository root, carry [".whl"]; N may list several ("7 8"), each its own process taking turns:
# N=5 (tile t + 1's q · kᵀ before tile t's softmax; table5_*), N=6 (the merges' loads before their
# stores; table6_*), N="7 8" (the padding rows' softmax skipped; and a look at the team's counter
# before the block's merge; table78_*), N=11 (each tile's copy issued before the wait for the tile; table11_*), N="12 13" (Q and the first two or three tiles prefetched into L2 at the start; table1213_*).
N=${N:?N: which make_variant<N>.py}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/numpy*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLASHCORE_CACHE=0
S=docs/tuning/10_ilp
VARIANTS=base
for n in $N; do
    (cd $S && python3 make_variant$n.py)
    VARIANTS=$VARIANTS,v$n
done
export VARIANTS
printf 0 > $OUT/turn
(MODULE=package python3 $S/ab.py base 4 32 3 2>&1 | grep -v -i warn | tail -3) &
for n in $N; do
    (MODULE=p10v$n python3 $S/ab.py v$n 4 32 3 2>&1 | grep -v -i warn | tail -3) &
done
wait
python3 $S/table.py $OUT | tee $OUT/table.txt
rm -f $OUT/turn

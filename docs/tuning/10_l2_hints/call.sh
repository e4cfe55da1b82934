# The A/B of cp.async's L2 hints (make_variants.py, ab.py): one call, from the repository root, carry [".whl"].
# The argument: the variants, comma-separated (default base,p128,p256; ef and ef256 stop the GPU, README.md).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/numpy*.whl
export PYTHONUNBUFFERED=1 FLASHCORE_CACHE=0
S=$PWD/docs/tuning/10_l2_hints
export VARIANTS=$(python3 $S/make_variants.py /tmp/l2v ${1:-base,p128,p256})
printf 0 > $OUT/turn
for v in ${VARIANTS//,/ }; do
  (cd /tmp && PYTHONPATH=/tmp/site:/tmp/l2v/$v python3 $S/ab.py $v 2>&1 | grep -v -i warn | tail -4) &
done
wait
python3 $S/table.py $OUT | tee $OUT/table.txt
rm -f $OUT/turn

# The next A/B (not yet run): the package's phase 10 against make_variant3.py's two layouts of the
# ldmatrix addresses (p10v3: offsets a warp, p10v3a: addresses a warp) and make_variant4.py's
# p10v4 (p10v3a with the whole-tile copies' destinations from bases a warp), one call from the
# repository root, carry [".whl"]. ab.py checks every output against SDPA before timing.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/numpy*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLASHCORE_CACHE=0
S=docs/tuning/10_ilp
python3 $S/make_variant3.py && python3 $S/make_variant4.py
printf 0 > $OUT/turn
export VARIANTS=base,v3,v3a,v4
(MODULE=package python3 $S/ab.py base 4 32 3 2>&1 | grep -v -i warn | tail -3) &
(MODULE=p10v3 python3 $S/ab.py v3 4 32 3 2>&1 | grep -v -i warn | tail -3) &
(MODULE=p10v3a python3 $S/ab.py v3a 4 32 3 2>&1 | grep -v -i warn | tail -3) &
(MODULE=p10v4 python3 $S/ab.py v4 4 32 3 2>&1 | grep -v -i warn | tail -3) &
wait
python3 $S/table.py $OUT | tee $OUT/table.txt
rm -f $OUT/turn

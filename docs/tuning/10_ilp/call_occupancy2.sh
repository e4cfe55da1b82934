# The second occupancy A/B (call_occupancy.sh's builds were 4.7-6.7 µs slower at the long decode
# step, with 32 blocks a K/V head and so two merge levels at FAN_IN 16). Here the same two-blocks-an-SM
# builds merge their 32 partials in one level (FAN_IN 32, env FAN), so the extra level is taken out of
# the comparison. One call from the repository root, carry [".whl"].
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/numpy*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLASHCORE_CACHE=0
S=docs/tuning/10_ilp
export VARIANTS=base,w4b16s3f32,w4b16s2f32,w2b32s3f32
printf 0 > $OUT/turn
(MODULE=package python3 $S/ab.py base 4 32 3 2>&1 | grep -v -i warn | tail -3) &
(FAN=32 MODULE=package python3 $S/ab.py w4b16s3f32 4 16 3 2>&1 | grep -v -i warn | tail -3) &
(FAN=32 MODULE=package python3 $S/ab.py w4b16s2f32 4 16 2 2>&1 | grep -v -i warn | tail -3) &
(FAN=32 MODULE=package python3 $S/ab.py w2b32s3f32 2 32 3 2>&1 | grep -v -i warn | tail -3) &
wait
python3 $S/table.py $OUT | tee $OUT/table.txt
rm -f $OUT/turn

# Prepared, not yet timed: the package's phase 10 at cuDNN's occupancy, two blocks an SM, against
# the package's one block of four warps (32-key tiles, three stages). One call from the repository
# root, carry [".whl"]; each build its own process, taking turns (ab.py), every output checked
# against SDPA first. Shared memory a block at D = 128 (p10.smem_size; plus about 1 KB each that
# the driver and done_s take): w4b16s3 112 KB and w4b16s2 80 KB (four warps, 16-key tiles: eight
# warps an SM, two a scheduler, as cuDNN's decode kernel), w2b32s3 104 KB (two warps, 32-key
# tiles). Registers (here, nvJitLink): 209, 203, 221, no spills. split_count then gives the long
# decode step 32 blocks a K/V head instead of 16, so its merge has two levels (ab.py prints the grid).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/numpy*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLASHCORE_CACHE=0
S=docs/tuning/10_ilp
export VARIANTS=base,w4b16s3,w4b16s2,w2b32s3
printf 0 > $OUT/turn
(MODULE=package python3 $S/ab.py base 4 32 3 2>&1 | grep -v -i warn | tail -3) &
(MODULE=package python3 $S/ab.py w4b16s3 4 16 3 2>&1 | grep -v -i warn | tail -3) &
(MODULE=package python3 $S/ab.py w4b16s2 4 16 2 2>&1 | grep -v -i warn | tail -3) &
(MODULE=package python3 $S/ab.py w2b32s3 2 32 3 2>&1 | grep -v -i warn | tail -3) &
wait
python3 $S/table.py $OUT | tee $OUT/table.txt
rm -f $OUT/turn

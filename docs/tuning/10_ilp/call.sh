# The A/B of make_variant.py's key-loop changes and of 8 warps a block: one call from the repository
# root, carry [".whl"]. Variants: name env warps block_n stages.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/numpy*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLASHCORE_CACHE=0
S=docs/tuning/10_ilp
python3 $S/make_variant.py
printf 0 > $OUT/turn
export VARIANTS=base,lazy,splitqk,both,w8,w8lazy
run() { (env $2 python3 $S/ab.py $1 $3 $4 $5 2>&1 | grep -v -i warn | tail -3) & }
run base X=0 4 32 3; run lazy LAZY=1 4 32 3; run splitqk SPLITQK=1 4 32 3; run both "LAZY=1 SPLITQK=1" 4 32 3
run w8 X=0 8 16 3; run w8lazy LAZY=1 8 16 3
wait
python3 $S/table.py $OUT | tee $OUT/table.txt
rm -f $OUT/turn

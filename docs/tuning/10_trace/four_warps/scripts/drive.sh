python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
cd .scratch/exp48
mkdir -p /tmp/logs
python3 var.py old old 32 1 3 "" > /tmp/logs/old.log 2>&1 &
python3 var.py w4 new 32 4 3 "8,12" > /tmp/logs/w4.log 2>&1 &
python3 var.py w4s2 new 32 4 2 "" > /tmp/logs/w4s2.log 2>&1 &
python3 var.py w2 new 32 2 3 "" > /tmp/logs/w2.log 2>&1 &
python3 var.py w4b16 new 16 4 4 "" > /tmp/logs/w4b16.log 2>&1 &
D=64 python3 var.py old64 old 64 1 3 "" > /tmp/logs/old64.log 2>&1 &
D=64 python3 var.py w4d64 new 64 4 3 "" > /tmp/logs/w4d64.log 2>&1 &
wait
python3 table.py > /tmp/logs/table.txt; cat /tmp/logs/table.txt
tar czf $OUT/logs.tgz -C /tmp logs
cp $OUT/../*.json $OUT/ 2>/dev/null; true

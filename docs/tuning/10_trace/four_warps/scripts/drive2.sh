python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
python3 .scratch/exp48/mktrace.py
cd .scratch/exp48
mkdir -p /tmp/logs
python3 var.py old old 32 1 3 "" > /tmp/logs/old.log 2>&1 &
python3 var.py w4 new 32 4 3 "" > /tmp/logs/w4.log 2>&1 &
python3 var.py w4s2 new 32 4 2 "" > /tmp/logs/w4s2.log 2>&1 &
python3 var.py w8b16s2 new 16 8 2 "" > /tmp/logs/w8b16s2.log 2>&1 &
python3 var.py w6b16s3 new 16 6 3 "" > /tmp/logs/w6b16s3.log 2>&1 &
D=64 python3 var.py w4s2d64 new 64 4 2 "" > /tmp/logs/w4s2d64.log 2>&1 &
python3 trace_run.py > /tmp/logs/trace.log 2>&1 &
wait
python3 table.py > /tmp/logs/table.txt; cat /tmp/logs/table.txt; tail -n 40 /tmp/logs/trace.log
rm -f $OUT/*.json $OUT/gpu.lock
tar czf $OUT/logs.tgz -C /tmp logs

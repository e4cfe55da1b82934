python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
python3 .scratch/exp48/mktrace4.py
cd .scratch/exp48
mkdir -p /tmp/logs
python3 var.py old old 32 4 3 "" > /tmp/logs/old.log 2>&1 &
python3 var.py dyn new 32 4 3 "" > /tmp/logs/dyn.log 2>&1 &
python3 var.py dyns2 new 32 4 2 "" > /tmp/logs/dyns2.log 2>&1 &
D=64 python3 var.py old64 old 64 4 3 "" > /tmp/logs/old64.log 2>&1 &
D=64 python3 var.py dyn64 new 64 4 3 "" > /tmp/logs/dyn64.log 2>&1 &
python3 trace_run.py > /tmp/logs/trace.log 2>&1 &
wait
python3 table.py > /tmp/logs/table.txt; cat /tmp/logs/table.txt; tail -n 10 /tmp/logs/trace.log
mkdir -p /tmp/logs/json; cp $OUT/*.json /tmp/logs/json/; rm -f $OUT/*.json $OUT/gpu.lock
tar czf $OUT/logs.tgz -C /tmp logs

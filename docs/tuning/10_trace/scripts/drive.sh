cd .scratch/exp47
mkdir -p /tmp/logs
python3 var.py old old 32 16 2 "" > /tmp/logs/old.log 2>&1 &
python3 var.py n2 new 32 16 2 64,66 > /tmp/logs/n2.log 2>&1 &
python3 var.py n3 new 32 16 3 64,66 > /tmp/logs/n3.log 2>&1 &
D=64 python3 var.py old64 old 64 16 2 "" > /tmp/logs/old64.log 2>&1 &
D=64 python3 var.py n2d64 new 64 16 2 "" > /tmp/logs/n2d64.log 2>&1 &
D=64 python3 var.py n3d64 new 64 16 3 "" > /tmp/logs/n3d64.log 2>&1 &
python3 trace_run.py > /tmp/logs/trace.log 2>&1 &
wait
python3 table.py > /tmp/logs/table.txt; cat /tmp/logs/table.txt; tail -n 16 /tmp/logs/trace.log
tar czf $OUT/logs.tgz -C /tmp logs

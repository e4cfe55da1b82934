# The whole GPU suite on a fresh machine, in two device calls (each under a call's 10 minutes):
#   run(command="bash docs/tuning/gpu_suite/two_calls.sh compile", carry=[".whl"])
#   run(command="bash docs/tuning/gpu_suite/two_calls.sh suite", carry=[".whl", ".scratch/fccz"])
# `compile` fills an empty kernel cache (`flashcore compile --jobs 16`, every kernel) and returns it
# compressed; copy $OUT's fcc.tgz.part* to .scratch/fccz/ here. `suite` uses the cache the same
# machine still holds (a call soon after the first), else unpacks the carried one, and runs
# `FLASHCORE_GPU=1 python3 -m pytest -m gpu` with every line stamped with seconds since its start.
# .whl holds numpy 2.4 and hypothesis with its two dependencies (DEVELOPERS.md).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLASHCORE_CACHE_DIR=/tmp/fcc FLASHCORE_GPU=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee "$OUT/gpu.txt"
case "$1" in
  compile)
    s=$(date +%s)
    timeout 540 python3 -m flashcore_numba compile --jobs 16 2>&1 | tr '\r' '\n' | tail -4 | tee "$OUT/compile.txt"
    echo "compile $(( $(date +%s)-s )) s" | tee -a "$OUT/compile.txt"; du -sh /tmp/fcc; ls /tmp/fcc | wc -l
    tar czf - -C /tmp fcc | split -b 15M - "$OUT/fcc.tgz.part"
    ;;
  suite)
    if [ -d /tmp/fcc ]; then echo "the cache of the last call: $(ls /tmp/fcc | wc -l) entries"
    else cat .scratch/fccz/fcc.tgz.part* | tar xzf - -C /tmp && echo "the carried cache: $(ls /tmp/fcc | wc -l) entries"; fi
    stamp() { python3 -u -c '
import sys, time
t0 = time.time()
for line in sys.stdin:
    sys.stdout.write(f"{time.time()-t0:7.1f} {line}"); sys.stdout.flush()'; }
    s=$(date +%s)
    set -o pipefail
    timeout "${T:-560}" python3 -m pytest -m gpu -v --durations=30 -p no:cacheprovider 2>&1 | stamp > "$OUT/suite.log"
    echo "rc=$? suite $(( $(date +%s)-s )) s"
    grep -E "passed|failed|error" "$OUT/suite.log" | tail -3
    grep -E "FAILED|ERROR" "$OUT/suite.log" | head -20
    ;;
esac

# From the repository root, carry [".whl"]: run.sh's profile of cuDNN's and phase 10's kernels
# (details.txt), then phase 10's alone with its source counters (stall samples a SASS instruction:
# source.txt, the summary; sass.csv.gz, the source page), the kernel as the package ships it.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/numpy*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=docs/tuning/10_ncu_cudnn
[ "$1" = source ] || bash $S/run.sh  # `source`: the second profile only
python3 - <<'PY' > /tmp/p10_only.py
src = open("docs/tuning/10_ncu_cudnn/ncu_both.py").read()
# the same script with cuDNN's profiled call and the flush between them left out
src = src.replace("cudnn()\ntorch.cuda.synchronize()\nflush.zero_()", "flush.zero_()")
print(src)
PY
ncu --clock-control none --profile-from-start off --cache-control all \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters --section InstructionStats \
    --kernel-name regex:split_keys \
    --export /tmp/p10 python3 /tmp/p10_only.py > $OUT/source.txt 2> $OUT/source_stderr.txt
echo "ncu rc $?"; grep -v "^==PROF==" $OUT/source_stderr.txt | grep -iv warn | tail -5
ncu --import /tmp/p10.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > $OUT/sass.csv.gz
ncu --import /tmp/p10.ncu-rep --page details > $OUT/source.txt
ls -la $OUT
grep -E "Duration|Warp Cycles Per Issued|Stall|Issued Ipc" $OUT/source.txt | head -30

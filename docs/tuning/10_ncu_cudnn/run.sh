# From the repository root, carry [".whl"]: ncu on cuDNN's and phase 10's kernels at the long decode step
# (no argument: ncu_both.py, into details.txt), or with the bare readers too (`readers`: ncu_readers.py, readers.txt).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/numpy*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
S=docs/tuning/10_ncu_cudnn
ncu --clock-control none --profile-from-start off --cache-control all \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats \
    python3 $S/ncu_${1:-both}.py > $OUT/${1:-details}.txt 2> $OUT/stderr.txt
echo "ncu rc $?"; grep -v "^==PROF==" $OUT/stderr.txt | grep -iv warn | tail -5
grep -E "^  [^ ].*\(|Duration|DRAM Throughput|Memory Throughput|Grid Size|Block Size|Registers Per|Dynamic Shared|Achieved Occupancy|Theoretical Occupancy|Waves Per SM|L2 Hit|Eligible Warps|No Eligible" $OUT/${1:-details}.txt

# arch/compile_speed.py on the GPU machine (carry .whl): the PTX A/B of shared_memo.py with the
# package's own patch, then the kernel cache's cubins (arch.launch.build_cubin, what attention()
# loads) compiled with it and without it (FLASHCORE_SHARED_INLINE_MEMO=0), compared byte for byte.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/numpy*.whl && export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 docs/tuning/compile_time/shared_memo.py all 16 > "$OUT/table.txt" 2> "$OUT/results.jsonl"
cat "$OUT/table.txt"
ids=07,09,10,10-kvcache,11,12
( time FLASHCORE_CACHE_DIR=/tmp/c_on python3 -m flashcore_numba compile --phases $ids --dtypes fp16 --jobs 8 --cc 9.0 ) > "$OUT/compile_on.txt" 2>&1 &
( time FLASHCORE_SHARED_INLINE_MEMO=0 FLASHCORE_CACHE_DIR=/tmp/c_off python3 -m flashcore_numba compile --phases $ids --dtypes fp16 --jobs 8 --cc 9.0 ) > "$OUT/compile_off.txt" 2>&1 &
wait
tail -4 "$OUT/compile_on.txt" "$OUT/compile_off.txt" | tr '\r' '\n' | grep -E "compiled|real|==>"
python3 - <<'PY' | tee "$OUT/cubins.txt"
import json
from pathlib import Path
same = differ = 0
for on in sorted(Path("/tmp/c_on").rglob("*")):
    if not on.is_file() or on.suffix in (".lock",):
        continue
    off = Path("/tmp/c_off") / on.relative_to("/tmp/c_on")
    if not off.exists():
        print("only with the patch:", on.name); continue
    a, b = on.read_bytes(), off.read_bytes()
    if a == b:
        same += 1
    else:
        differ += 1
        print("differ:", on.name, len(a), len(b))
print(f"cache files byte-identical: {same}, different: {differ}")
PY

# The cache files cubins.sh found different: the backward's, compiled with the patch, without it,
# and without it a second time (is the difference the patch, or two compiles differing anyway?).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/numpy*.whl && export PYTHONPATH=/tmp/site:$PWD
ids=11,12
FLASHCORE_CACHE_DIR=/tmp/d_on python3 -m flashcore_numba compile --phases $ids --dtypes fp16 --head-dims 64 --jobs 5 --cc 9.0 > /dev/null 2>&1 &
FLASHCORE_SHARED_INLINE_MEMO=0 FLASHCORE_CACHE_DIR=/tmp/d_off python3 -m flashcore_numba compile --phases $ids --dtypes fp16 --head-dims 64 --jobs 5 --cc 9.0 > /dev/null 2>&1 &
FLASHCORE_SHARED_INLINE_MEMO=0 FLASHCORE_CACHE_DIR=/tmp/d_off2 python3 -m flashcore_numba compile --phases $ids --dtypes fp16 --head-dims 64 --jobs 5 --cc 9.0 > /dev/null 2>&1 &
wait
python3 - <<'PY' | tee "$OUT/cubins_diff.txt"
import json, re
from pathlib import Path
def read(p):
    data = p.read_bytes()[len(b"flashcore-numba cubin 1\n"):]  # arch/cache.py's MAGIC, then the header
    head, _, cubin = data.partition(b"\n")
    return json.loads(head), cubin
for other in ("/tmp/d_off", "/tmp/d_off2"):
    for on in sorted(Path("/tmp/d_on").rglob("*.cubin")):
        off = Path(other) / on.relative_to("/tmp/d_on")
        (ha, a), (hb, b) = read(on), read(off)
        if a == b:
            print(other, on.name[:12], "same"); continue
        na = a.replace(ha["entry"].encode(), b"E" * len(ha["entry"]))
        nb = b.replace(hb["entry"].encode(), b"E" * len(hb["entry"]))
        names = re.findall(rb"_ZN[\w]+", a)
        print(other, on.name[:12], "differ; entries equal:", ha["entry"] == hb["entry"], "; equal with the entry names masked:", na == nb,
              "; bytes differing:", sum(x != y for x, y in zip(a, b)))
PY

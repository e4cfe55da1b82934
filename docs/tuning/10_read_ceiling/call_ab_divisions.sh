# The A/B of the 32-bit divisions (phase 10 old and new, two processes taking turns). Here first:
# python3 docs/tuning/10_read_ceiling/make_old.py (writes p10_old.py, ignored), then run with
# carry [".whl", "docs/tuning/10_read_ceiling/p10_old.py"].
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/numpy*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLASHCORE_CACHE=0
S=docs/tuning/10_read_ceiling
printf 0 > $OUT/turn
(python3 $S/ab_divisions.py old 2>&1 | grep -v -i warn | tail -3) & (python3 $S/ab_divisions.py new 2>&1 | grep -v -i warn | tail -3) &
wait
python3 - <<'PY'
import json, os, torch
O = os.environ["OUT"]
old, new = (json.load(open(f"{O}/ab_{n}.json")) for n in ("old", "new"))
for k in old:
    print(f"{k:26s} old {old[k]['median_us']:7.1f} us  new {new[k]['median_us']:7.1f} us  {old[k]['median_us'] / new[k]['median_us']:5.3f}x  err {old[k]['err']:.1e} / {new[k]['err']:.1e}")
for lab in ("kvcache_B1_32768", "kvcache_B64_1..8192"):
    a, b = (torch.load(f"{O}/{n}_{lab}.pt").float() for n in ("old", "new"))
    print(lab, "old vs new max diff", float((a - b).abs().max()))
PY
rm -f $OUT/*.pt $OUT/turn

# The A/B of the 32-bit divisions (phase 10 old and new, two processes taking turns). Here first:
# python3 docs/tuning/10_read_ceiling/make_old.py and make_paged_variant.py (write p10_old.py and
# p10_paged.py, ignored), then run with carry [".whl", "docs/tuning/10_read_ceiling/p10_old.py",
# "docs/tuning/10_read_ceiling/p10_paged.py"]: three processes, old, new and paged, taking turns.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/numpy*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLASHCORE_CACHE=0
S=docs/tuning/10_read_ceiling
printf 0 > $OUT/turn
export VARIANTS=old,new,paged
for v in old new paged; do (python3 $S/ab_divisions.py $v 2>&1 | grep -v -i warn | tail -3) & done
wait
python3 - <<'PY'
import json, os, torch
O = os.environ["OUT"]
old, new, paged = (json.load(open(f"{O}/ab_{n}.json")) for n in ("old", "new", "paged"))
for k in old:
    print(f"{k:26s} old {old[k]['median_us']:7.1f}  new {new[k]['median_us']:7.1f}  paged {paged[k]['median_us']:7.1f} us"
          f"  err {old[k]['err']:.1e} / {new[k]['err']:.1e} / {paged[k]['err']:.1e}")
for lab in ("kvcache_B1_32768", "kvcache_B64_1..8192"):
    a, b, c = (torch.load(f"{O}/{n}_{lab}.pt").float() for n in ("old", "new", "paged"))
    print(lab, "max diff old/new", float((a - b).abs().max()), "old/paged", float((a - c).abs().max()))
PY
rm -f $OUT/*.pt $OUT/turn

"""The A/B's table: median (p99) µs of every kernel in every variant, from ab_<variant>.json in argv[1]."""
import json, os, sys
d = sys.argv[1]
names = os.environ.get("VARIANTS", "base,p128,p256,ef,ef256").split(",")
res = {n: json.load(open(os.path.join(d, f"ab_{n}.json"))) for n in names if os.path.exists(os.path.join(d, f"ab_{n}.json"))}
base = res.get("base", {})
keys = list(base) or list(next(iter(res.values())))
print(f"{'kernel':30s}" + "".join(f"{n:>18s}" for n in res))
for k in keys:
    cells = "".join(f"{res[n][k]['median_us']:9.1f} ({res[n][k]['p99_us']:5.0f})" if k in res[n] else f"{'':18s}"
                    for n in res)
    errs = max(res[n][k]["err"] for n in res if k in res[n])
    print(f"{k:30s}{cells}   max err {errs:.1e}")

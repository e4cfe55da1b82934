"""The A/B's table, median µs (p99) of every shape in every variant, from ab_<variant>.json in argv[1]."""
import json, os, sys
d = sys.argv[1]
res = [json.load(open(os.path.join(d, f))) for f in sorted(os.listdir(d)) if f.startswith("ab_") and f.endswith(".json")]
res.sort(key=lambda r: r["variant"] != "base")
keys = list(res[0]["rows"])
print(f"{'shape':28s}" + "".join(f"{r['variant']:>16s}" for r in res))
for k in keys:
    print(f"{k:28s}" + "".join(f"{r['rows'][k]['median_us']:8.1f} ({r['rows'][k]['p99_us']:4.0f})" if k in r["rows"] else " " * 16
                               for r in res) + f"   max err {max(r['rows'][k]['err'] for r in res if k in r['rows']):.1e}")
for r in res:
    print(r["variant"], "module", r.get("module", "p10v"), "warps", r["warps"], "block_n", r["block_n"], "stages", r["stages"], "lazy", r["lazy"],
          "splitqk", r["splitqk"], "grid at S_k 32768", r["grid"])

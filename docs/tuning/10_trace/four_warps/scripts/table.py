import json, os, glob
out = os.environ["OUT"]
for f in sorted(glob.glob(f"{out}/*.json")):
    r = json.load(open(f))
    print("==", r["name"], "compile %.0f s" % r.get("compile_s", -1), r.get("error", "")[-600:])
    for x in r["rows"]:
        print("  %-22s forced=%-5s splits=%-4d err=%.1e  med %7.1f  mean %7.1f  p99 %7.1f us" % (
            x["shape"], x["forced"], x["splits"], x["err"], x["median_us"], x["mean_us"], x["p99_us"]))
    for p in r.get("peers", []):
        print("  peers", p)

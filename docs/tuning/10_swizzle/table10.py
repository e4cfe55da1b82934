import json, glob, os, sys
d = sys.argv[1] if len(sys.argv) > 1 else os.environ["OUT"]
for f in sorted(glob.glob(os.path.join(d, "ab10_d*.json"))):
    r = json.load(open(f))
    if "error" in r:
        print(f, r["error"][-1500:])
    peers = {tuple(p["shape"]): p for p in r["peers"]}
    rows = {}
    for x in r["rows"]:
        rows.setdefault(tuple(x["shape"]), {})[x["variant"]] = x
    print(f"D={r['D']}  shape (B,H,Hkv,Sk): variant median us [rounds] mean p99 err | copy-bw% ; cudnn")
    for shape, vs in rows.items():
        p = peers.get(shape, {})
        copy = p.get("copy_us")
        for name, x in vs.items():
            bw = 100 * copy / (2 * x["median_us"]) if copy else float("nan")
            print(f"  {shape} {name:9s} {x['median_us']:7.1f} {[round(m, 1) for m in x['round_medians_us']]} "
                  f"{x['mean_us']:7.1f} {x['p99_us']:7.1f} err={x['err']:.2e} | {bw:5.1f}%")
        cud = p.get("cudnn_us")
        print(f"  {shape} copy {copy and round(copy,1)} cudnn {cud and round(cud,1)} ({cud and round(100*copy/(2*cud),1)}%)")

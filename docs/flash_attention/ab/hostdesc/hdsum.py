"""Summarize the host-descriptor A/B: per shape, median over rounds and processes of ours/cuDNN GPU µs, per tree."""
import glob, sys
import pandas as pd
root = sys.argv[1]
rows = []
for f in glob.glob(f"{root}/hd_*_*_*.csv"):
    tree, part, rnd = f.split("/")[-1][3:-4].split("_")
    d = pd.read_csv(f).assign(tree=tree, proc=rnd)
    rows.append(d)
d = pd.concat(rows)
d["shape"] = d[["batch", "heads", "seq_len", "head_dim"]].astype(str).agg(",".join, axis=1)
kcols = [c for c in d.columns if c.startswith("kernel: ")]
def kind(c):
    n = c.lower()
    for key in ("preprocess", "dkdv", "dq_kernel", "forward_gluon", "forward_kernel"):
        if key in n: return key
    if "cudnn" in n or "sdpa" in n or "fmha" in n: return "cudnn_" + ("bprop" if "bprop" in n or "bwd" in n else "fprop")
    return "other"
for k in sorted({kind(c) for c in kcols}):
    d[k] = d[[c for c in kcols if kind(c) == k]].sum(axis=1, min_count=1)
kinds = sorted({kind(c) for c in kcols})
g = d.groupby(["shape", "tree", "impl"])[["gpu_us", "host_us", *kinds]].median()
spread = d.groupby(["shape", "tree", "impl"])["gpu_us"].agg(lambda s: s.max() - s.min()).rename("gpu_spread")
out = g.join(spread).round(1)
pd.set_option("display.width", 250)
print(out.to_string())
piv = d.groupby(["shape", "tree", "impl"])["gpu_us"].median().unstack(["tree", "impl"])
res = pd.DataFrame({"old_ours": piv[("old", "ours")], "new_ours": piv[("new", "ours")],
                    "cudnn": (piv[("old", "sdpa_cudnn")] + piv[("new", "sdpa_cudnn")]) / 2})
res["new/old"] = res.new_ours / res.old_ours
res["cudnn/old"] = res.cudnn / res.old_ours
res["cudnn/new"] = res.cudnn / res.new_ours
print(res.round(3).to_string())

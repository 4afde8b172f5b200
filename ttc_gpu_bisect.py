"""Bisect the multi-gpu 5+3 divergence: per-step losses of variants against the sequential run."""
import json, os, subprocess, sys, time
OUT = os.environ["OUT"]
BASE = [sys.executable, "examples/specdec/train.py", "--preset", "multi-gpu", "--steps", "10", "--eval-every", "0",
        "--no-checkpoint", "--log-every", "1000", "--measure-after", "2"]
VARIANTS = [
    ("seq", ["--layout", "sequential", "--drafter-threads", "3"]),
    ("5+3", []),
    ("5+3 no-step-graphs", ["--no-step-graphs"]),
    ("5+3 no-streams no-graphs", ["--no-streams", "--no-step-graphs"]),
    ("5+3 queue1", ["--queue-size", "1"]),
    ("3+3", ["--target-threads", "3"]),
    ("5+3 host-lock", ["--host-lock"]),
    ("6+3", ["--target-threads", "6"]),
    ("5+3 dense-mask", ["--mask-builder", "dense"]),
    ("seq again", ["--layout", "sequential", "--drafter-threads", "3"]),
]
t0 = time.time()
res = {}
for i, (name, extra) in enumerate(VARIANTS):
    if time.time() - t0 > float(os.environ.get("BUDGET", 480)):
        res[name] = "skipped (time)"; continue
    out = f"/tmp/run{i}"
    t = time.time()
    p = subprocess.run(BASE + extra + ["--out", out], capture_output=True, text=True)
    losses = []
    try:
        for line in open(f"{out}/metrics.jsonl"):
            r = json.loads(line)
            if r.get("kind") == "train":
                losses.append(round(r["loss"], 4))
    except OSError:
        pass
    res[name] = {"rc": p.returncode, "s": round(time.time() - t, 1), "losses": losses,
                 "err": p.stderr[-600:] if p.returncode else ""}
    print(name, res[name]["rc"], res[name]["s"], losses, flush=True)
    json.dump(res, open(f"{OUT}/bisect.json", "w"), indent=1)

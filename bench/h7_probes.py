"""H7 probes: shared state that other reports name, reproduced and classified (results: docs/hazards.md).

    python bench/h7_probes.py cudagraphs      # CUDA: torch.compile(mode="reduce-overhead") from 16 threads (pytorch#123177)
    python bench/h7_probes.py killed_cache    # inductor/Triton on-disk cache after a multi-threaded run killed mid-compile

Each probe runs its workload in fresh interpreters, unpatched (TTC_DISABLE=1) and active, and prints JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from _harness import child_env, kill_group, result_line, run_proc

CUDAGRAPHS = r"""
import json, threading, torch, collections
errs = collections.Counter(); ok = [0]
def foo(x, y):
    return torch.sin(x) + torch.cos(y)
f = torch.compile(foo, mode="reduce-overhead")
def w():
    try:
        for _ in range(5):
            f(torch.rand(2, 3, device="cuda"), torch.rand(2, 3, device="cuda")); ok[0] += 1
    except Exception as e:
        errs[type(e).__name__ + ": " + str(e)[:80]] += 1
ts = [threading.Thread(target=w) for _ in range(16)]
[t.start() for t in ts]; [t.join() for t in ts]
print("RESULT " + json.dumps(dict(ok_calls=ok[0], errors=sum(errs.values()), kinds=list(errs)[:3])))
"""

KILLED = r"""
import json, threading, torch, sys
fns = [torch.compile(lambda x, i=i: (x * (i + 1)).sin().cumsum(0) @ x.T) for i in range(4)]
def w(f):
    f(torch.randn(64, 64))
ts = [threading.Thread(target=w, args=(f,)) for f in fns]
[t.start() for t in ts]; [t.join() for t in ts]
print("RESULT " + json.dumps(dict(ok=True)))
"""


def _env(disabled: bool, **extra: str) -> dict[str, str]:
    return {**child_env(disabled), **extra}


def cudagraphs() -> dict:
    res = {}
    for disabled in (True, False):
        with tempfile.TemporaryDirectory() as cache:
            pr = run_proc([sys.executable, "-c", CUDAGRAPHS], _env(disabled, TORCHINDUCTOR_CACHE_DIR=cache), 300)
        res["unpatched" if disabled else "active"] = result_line(pr["stdout"]) or {"rc": pr["rc"], "tail": pr["stderr"][-400:]}
    return res


def killed_cache(kill_after: float = 6.0) -> dict:
    """Kill (SIGKILL) a run whose 4 threads compile with inductor, then run again on the same cache dir."""
    res = {}
    for disabled in (True, False):
        with tempfile.TemporaryDirectory() as cache:
            env = _env(disabled, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
            p = subprocess.Popen([sys.executable, "-c", KILLED], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, start_new_session=True)
            time.sleep(kill_after)
            killed = p.poll() is None
            if killed:
                kill_group(p)
            p.communicate()
            files = sum(len(f) for _, _, f in os.walk(cache))
            again = run_proc([sys.executable, "-c", KILLED], env, 600)
            res["unpatched" if disabled else "active"] = {
                "killed_mid_compile": killed, "cache_files_left": files,
                "rerun_ok": bool((result_line(again["stdout"]) or {}).get("ok")), "rerun_rc": again["rc"],
                "rerun_tail": "" if again["rc"] == 0 else again["stderr"][-300:],
            }
    return res


if __name__ == "__main__":
    probes = {"cudagraphs": cudagraphs, "killed_cache": killed_cache}
    names = sys.argv[1:] or list(probes)
    for name in names:
        print(json.dumps({"probe": name, **probes[name]()}), flush=True)

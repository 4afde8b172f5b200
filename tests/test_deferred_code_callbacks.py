"""H13 patch ``deferred_code_callbacks``: what dynamo's weak dictionaries show is upstream's, in both modes.

The hazard test (``tests/test_crash_hazards.py::test_h13_*``) shows the deadlock unpatched and none active.
These check the other side: a program reads the same from ``ExactWeakKeyDictionary``, ``CleanupManager`` and
``Tracker`` with the package as without it -- single-threaded (upstream's callbacks, untouched) and with a
thread of the program's running (the callbacks deferred, run before the next read) -- and
``torch._dynamo.reset()`` leaves no compiled function behind in the module's globals in either mode. Each case
runs in a fresh interpreter, ``TTC_DISABLE=1`` and active, and the two results must be equal.
"""

from __future__ import annotations

import json

import pytest

from conftest import run_py

BODY = """
import gc, json, sys, threading, time, types
import torch, torch._dynamo
from torch._dynamo.convert_frame import Tracker
from torch._dynamo.utils import CleanupManager, ExactWeakKeyDictionary
import torch_threadsafe_compile as ttc

stop = threading.Event()
if THREADED:
    threading.Thread(target=stop.wait, daemon=True).start()  # a thread of the program's, idle

def check():
    out = {}
    d = ExactWeakKeyDictionary()
    keys = [type("K", (), {})() for _ in range(5)]
    for i, k in enumerate(keys):
        d[k] = i
    del keys[1:3]
    gc.collect()
    out["after_death"] = sorted(d.get(k) for k in keys)
    out["values_left"] = len(d.values)  # a read above ran what was deferred
    out["refs_left"] = len(d.refs)
    new = type("K", (), {})()
    out["new_key_in"] = new in d
    d[new] = 9
    out["new_key_value"] = d[new]
    d.clear()
    out["cleared"] = (len(d.values), len(d.refs), keys[0] in d)

    t = Tracker()
    codes = [compile(f"x = {i}", "<t>", "exec") for i in range(4)]
    for c in codes:
        t.add(c)
    del codes[2:]
    gc.collect()
    probe = compile("y = 1", "<t>", "exec")
    out["tracker_probe_in"] = probe in t
    out["tracker_ids"] = len(t.seen_ids)
    out["tracker_alive_in"] = all(c in t for c in codes)

    # Cleanup hooks: a compiled function's globals are gone once its code is gone (reset frees the caches).
    mod = types.ModuleType("m_h13")
    exec("import torch\\ndef f(x):\\n    return torch.sin(x) + 1\\n", mod.__dict__)
    sys.modules["m_h13"] = mod
    torch.compile(mod.f, backend="eager")(torch.ones(3))
    out["compiled_globals"] = any(k.startswith("__compiled_fn") for k in mod.__dict__)
    count = CleanupManager.count
    torch._dynamo.reset()
    out["globals_after_reset"] = sorted(k for k in mod.__dict__ if k.startswith("__compiled_fn"))
    out["cleanup_count_drop"] = count - CleanupManager.count
    return out

res = check()
stop.set()
st = {p["id"]: p for p in ttc.status()["patches"]} if ttc.status().get("patches") else {}
res_meta = {"state": st.get("deferred_code_callbacks", {}).get("state"),
            "stats": st.get("deferred_code_callbacks", {}).get("stats")}
print("RESULT " + json.dumps({"res": res, "meta": res_meta}))
"""


def _result(threaded: bool, disable: bool) -> dict:
    env = {"TTC_DISABLE": "1"} if disable else {}
    p = run_py(f"THREADED = {threaded}\n" + BODY, env=env, timeout=240)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, p.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("threaded", [False, True], ids=["single-threaded", "a-program-thread-running"])
def test_h13_dynamo_weak_dictionaries_read_the_same_in_both_modes(threaded: bool) -> None:
    off = _result(threaded, disable=True)
    on = _result(threaded, disable=False)
    assert on["meta"]["state"] == "applied", on["meta"]
    assert on["res"] == off["res"], (on, off)
    assert off["res"]["values_left"] == 3 and off["res"]["globals_after_reset"] == [], off
    deferred = on["meta"]["stats"]["deferred"]
    if threaded:  # the entries took the deferred callback, and every one that died has run
        # ("pending" is not asserted: keys may die after the last read, as reset's own garbage does on 2.11.)
        assert deferred > 0 and on["meta"]["stats"]["run"] > 0, on["meta"]
    else:  # upstream's entries, Python callbacks and all
        assert deferred == 0, on["meta"]


def test_h13_a_key_at_a_dead_keys_address_keeps_its_entry() -> None:
    """The window upstream never meets (its callback runs before an address can be reused): a key dies, its
    deferred callback is taken by one thread but has not run, and a new key at the same address is set. The new
    key must get a weakref of its own, and the old callback, run late, must leave the new entry alone. The
    address reuse is set up by hand (the dead key's weakref put where the new key's would be)."""
    p = run_py("""
import json, threading, torch, torch._dynamo
from torch._dynamo.convert_frame import Tracker
from torch._dynamo.utils import ExactWeakKeyDictionary
from torch_threadsafe_compile.patches import deferred_code_callbacks as dcc

stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()
out = {}
d, t = ExactWeakKeyDictionary(), Tracker()
new_key, new_code = type("K", (), {})(), compile("z = 1", "<n>", "exec")
for owner, run, idx in ((d, dcc._run_dict_entry, id(new_key)), (t, dcc._run_tracker_entry, id(new_code))):
    old = type("Old", (), {})()
    ref = dcc._Ref(old, owner, idx, run)  # the dead key's weakref, as if it had lived at the new key's address
    if owner is d:
        d.refs[idx], d.values[idx] = ref, "old"
    else:
        t.seen_ids.add(idx)
        t.__dict__.setdefault(dcc.TRACKER_REFS, {})[idx] = ref
    del old
    taken = dcc.DEAD.popleft()  # one thread took it, and has not run it yet
    assert taken is ref
    if owner is d:
        d[new_key] = "new"
    else:
        t.add(new_code)
    out[type(owner).__name__ + "_late_callback_ran"] = run(taken)
out["dict_value"] = d.get(new_key)
out["dict_ref_is_new"] = d.refs[id(new_key)]() is new_key
out["tracker_sees_new"] = new_code in t
stop.set()
print("RESULT " + json.dumps(out))
""", timeout=120)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, p.stderr[-3000:]
    assert json.loads(lines[-1][len("RESULT "):]) == {
        "ExactWeakKeyDictionary_late_callback_ran": False, "Tracker_late_callback_ran": False,
        "dict_value": "new", "dict_ref_is_new": True, "tracker_sees_new": True}

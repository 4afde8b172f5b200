"""H6 costs (patch ``config_overrides``): config writes from a worker thread, and upstream's mock-delete race.

1. ``setattr``/``delattr``/read of a config key (``fake_config_module.e_bool``) in a worker thread: best of
   7 x 20,000 per interpreter, active vs ``TTC_DISABLE=1``, interpreters alternating; medians over rounds.
2. Upstream's race that ``test_utils_config_module.py::test_unittest_patch`` hits in N threads: 4 threads x
   300 rounds of the test's nested ``unittest.mock.patch`` of that key with ``sys.setswitchinterval(1e-4)``;
   ``AttributeError``s per run (``mock``'s exit deletes the key, which ``ConfigModule`` hides from every
   thread until the exit assigns it back). Upstream's in both modes; the timing alone decides the count.

    python bench/config_writes.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics

from _harness import alternating, run_child_json

WRITES = """
import json, threading, timeit
from torch.testing._internal import fake_config_module as config
out = {}
def work():
    n = 20000
    def best(f):
        return min(timeit.repeat(f, number=n, repeat=7)) / n * 1e9
    out["setattr_ns"] = best(lambda: setattr(config, "e_bool", False))
    out["delattr_ns"] = best(lambda: delattr(config, "e_bool"))
    config.e_bool = True
    out["read_ns"] = best(lambda: config.e_bool)
t = threading.Thread(target=work); t.start(); t.join()
print(json.dumps(out))
"""

RACE = """
import json, sys, threading
from unittest.mock import patch
from torch.testing._internal import fake_config_module as config
errors = []
sys.setswitchinterval(1e-4)
def body():
    for _ in range(300):
        try:
            with patch("torch.testing._internal.fake_config_module.e_bool", False):
                with patch("torch.testing._internal.fake_config_module.e_bool", False):
                    config.e_bool
        except AttributeError as e:
            errors.append(e)
ts = [threading.Thread(target=body) for _ in range(4)]
[t.start() for t in ts]; [t.join() for t in ts]
print(json.dumps({"attribute_errors": len(errors)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    writes: dict[str, dict[str, list[float]]] = {"active": {}, "off": {}}
    races: dict[str, list[int]] = {"active": [], "off": []}
    for _, disabled in alternating(args.rounds, disabled_first=False):
        mode = "off" if disabled else "active"
        for key, value in run_child_json(WRITES, disabled).items():
            writes[mode].setdefault(key, []).append(value)
        races[mode].append(run_child_json(RACE, disabled)["attribute_errors"])
    print(f"config writes in a worker thread, median of {args.rounds} interpreters (best of 7 x 20,000 each):")
    for key in writes["off"]:
        off, on = statistics.median(writes["off"][key]), statistics.median(writes["active"][key])
        print(f"  {key:<11} off {off:7.0f} ns   active {on:7.0f} ns   +{on - off:5.0f} ns")
    print("upstream's mock-delete race, AttributeErrors per run (4 threads x 300 rounds, switch interval 1e-4 s):")
    print(f"  off {races['off']}   active {races['active']}")


if __name__ == "__main__":
    main()

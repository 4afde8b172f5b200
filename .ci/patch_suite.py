"""CI's patch suite for the torch 2.11 / 2.15 / free-threaded legs: the package's own tests, then every
hazard-test file the patch table names (``registry.PatchSpec.test``), so that a new patch's test runs on
every leg because of its row. One path per line. Standard library only: runs before any venv has torch.

    python3 .ci/patch_suite.py [--leg gil|ft] [--root DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

# Tests of the package itself (lifecycle, environment, start-up, ordering, conformance, ...): not a patch's.
CORE = [
    "tests/test_registry.py", "tests/test_startup.py", "tests/test_env.py", "tests/test_first_compile.py",
    "tests/test_do_no_harm.py", "tests/test_same_thread.py", "tests/test_robustness.py", "tests/test_ordering.py",
    "tests/test_graph_break_shapes.py", "tests/test_conformance.py", "tests/test_first_compile_waits.py",
    "tests/test_newcomer.py", "tests/test_deferred_code_callbacks.py",
]

# Tests that do not depend on which torch release is installed: settings parsing, and the plumbing that picks
# a newcomer's patch up from its row (a copy of the tree). The README's test command (torch 2.13, every test)
# runs them; the other legs leave them out, for CI's time. (tests/test_startup.py stays: it checks that a real
# `import torch` of the leg's release loads no extra torch module.)
VERSION_INDEPENDENT = {"tests/test_env.py", "tests/test_newcomer.py"}

# The free-threaded leg (GIL off) leaves these to the GIL legs, for its share of CI's time: the stress runs
# (many fresh interpreters), the crash hazards (unpatched runs that crash by design) and the CUDA-graph
# random-number tests (CUDA graphs: no GPU in CI), the package's start-up/ordering/robustness tests,
# which do not depend on the GIL, and H13's reads (its deadlock is a hand-over of the GIL).
FT_LEFT_OUT = {
    "tests/test_stress.py", "tests/test_crash_hazards.py", "tests/test_cudagraph_rng.py",
    "tests/test_robustness.py", "tests/test_ordering.py", "tests/test_graph_break_shapes.py",
    "tests/test_deferred_code_callbacks.py",
}


def suite(root: str, leg: str = "gil") -> list[str]:
    sys.path.insert(0, root)
    from torch_threadsafe_compile import registry

    files = [f for f in dict.fromkeys(CORE + registry.patch_test_files()) if f not in VERSION_INDEPENDENT]
    return [f for f in files if leg != "ft" or f not in FT_LEFT_OUT]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--leg", choices=("gil", "ft"), default="gil", help="ft: the free-threaded leg's share")
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args = ap.parse_args()
    for path in suite(os.path.abspath(args.root), args.leg):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

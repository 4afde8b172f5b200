#!/usr/bin/env python
"""Reference EAGLE-3 style speculative-decoding trainer: one process per node, one thread per device.

Target threads run a frozen target LM (compiled forward under no_grad) and push fused low/mid/high hidden states
plus the target's next-token logits into bounded per-drafter queues. Drafter threads each hold an identical
drafter replica, train it with training-time-test (TTT) unrolling through a compiled loss (compiled flex_attention
on CUDA, compiled SDPA with the same mask evaluated densely on CPU), and average gradients across threads every
step (plus an all-reduce across processes under torchrun). ``--layout sequential`` runs the usual alternative
(one thread per device: target forward, then drafter step) on the same models and data. See docs/trainer.md.

    python examples/specdec/train.py --preset cpu-tiny --out runs/tiny

The command line is parsed and checked before torch is imported: a bad invocation gets one line on stderr and
exit code 2 within a second or two.
"""
from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # Run as a script (the documented command): this file's package is ``examples.specdec`` of the repository
    # root, which the relative imports below then load (PEP 366).
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    __package__ = "examples.specdec"

from . import cli


def main(argv: list[str] | None = None) -> int:
    cfg = cli.parse(argv)
    problem = cli.validate(cfg)
    if problem:
        cli.fail(problem)
    if cfg.no_ttc:
        cli.reexec_without_ttc()  # before torch is imported; returns only when TTC_DISABLE=1 already
    try:
        import torch
    except ImportError as e:
        cli.fail(f"torch is not importable ({e})")
    from . import build, package_state, trainer
    from .checkpoint_files import CheckpointError
    problem = build.check_devices(cfg)
    if problem:
        cli.fail(problem)
    if cfg.dry_run:
        print(json.dumps({"config": cfg.as_dict(), "ttc": package_state.state(), "torch": torch.__version__},
                         default=str))
        return 0
    print(package_state.start_line(package_state.state(), cfg.error_policy), flush=True)
    # A crash in native code (a segfault in a CUDA or compiler path) then still says where every thread was.
    faulthandler.enable(all_threads=True)
    try:
        return trainer.run_training(cfg)
    except CheckpointError as e:  # --resume: the checkpoint does not fit the model built (checkpoint.check_fits)
        cli.fail(f"--resume {cfg.resume}: {e}")


if __name__ == "__main__":
    sys.exit(main())

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

``run_training`` is the run, top to bottom; each part lives in a module of its own, none of which imports another
of them (docs/trainer.md, "Reading the code"):

1. ``build.setup``: devices, data, the frozen target and its compiled forward, the drafter replicas, the eval set;
2. ``leader.Leader``: what happens after each optimizer step (logging, evaluation, checkpoints);
3. ``loops``: the worker threads of the layout, started and watched by ``loops.supervise``;
4. ``report``: the summary and the exit code.

Layouts:

* ``threaded`` (default): T target threads feed D drafter threads through bounded queues; each drafter trains its
  own replica on one batch per step; gradients are averaged across drafters (``runtime.Reducer``).
* ``sequential``: the usual alternative (SpecForge / EAGLE-3 style): one thread per device runs the target forward
  and then the drafter step, one batch after the other. It trains on the same D batches per step (accumulating
  gradients), with the same models, compile settings and data, so the two layouts differ only in threading.
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
from .config import Config


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
    from . import package_state, runtime
    from .checkpoint_files import CheckpointError
    problem = runtime.check_devices(cfg)
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
        return run_training(cfg)
    except CheckpointError as e:  # --resume: the checkpoint does not fit the model built (checkpoint.check_fits)
        cli.fail(f"--resume {cfg.resume}: {e}")


def run_training(cfg: Config) -> int:
    """The run from a validated configuration (``main``) to the exit code."""
    from . import build, graphs, loops, metrics, report
    from .leader import Leader

    print(f"building the data, the target ({cfg.target_hf or 'built-in'}), {cfg.drafter_threads} drafter "
          f"replica(s) and the eval set on {cfg.devices}…", flush=True)
    setup = build.setup(cfg)
    if setup.start_step >= cfg.steps:
        print(f"train.py: error: --resume {cfg.resume} is at step {setup.start_step}, not before --steps "
              f"{cfg.steps}: nothing to train", file=sys.stderr, flush=True)
        return 2
    leader = Leader(setup)
    leader.evaluate_first()
    if setup.cuda:
        # Worker streams do not wait for the default streams, on which everything above was built.
        graphs.synchronize(setup.devices)
    counts, keys = report.flop_counts(setup)
    leader.start_progress()
    leader.note(first_step_line(cfg, setup.cuda))

    threads = loops.workers(setup, leader.step_done)
    util = None
    if setup.cuda and cfg.gpu_util == "auto":
        util = metrics.GpuUtil(sorted({d.index for d in list(setup.t_dev) + list(setup.d_dev)}))
    setup.run.gpu_util = util
    if cfg.measure_after == 0:
        setup.run.throughput.mark()
    status = loops.supervise(setup.run, threads)
    leader.close()
    sync_error = report.settle(setup, util)
    if sync_error is None:
        leader.flush()
    return report.finish(setup, status, leader.summary, leader.saved_step, sync_error, util, counts, keys)


def first_step_line(cfg: Config, cuda: bool) -> str:
    """What the threads do before the first progress line: the first step compiles (no line comes until it is done;
    the line after it says how long it took)."""
    threads = (f"{cfg.target_threads} target + {cfg.drafter_threads} drafter threads" if cfg.layout == "threaded"
               else "the sequential workers")
    if cfg.no_compile:
        return f"starting {threads} (eager: --no-compile)…"
    how_long = "" if cuda else "; on CPU about a minute with cold compile caches, less with warm ones"
    return (f"starting {threads}; the first step compiles the target forward and the drafter loss, forward and "
            f"backward ({cfg.compile_backend}{how_long})…")


if __name__ == "__main__":
    sys.exit(main())

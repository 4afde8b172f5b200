"""The training run behind examples/specdec/train.py, from a validated configuration to the exit code.

Entered after the command line was validated (``cli.validate``), so everything here may assume sane values.
``run_training`` reads top to bottom; each part lives in its own module:

1. ``build.setup``: devices, data, the frozen target and its compiled forward, the drafter replicas, the eval set;
2. ``leader.Leader``: what happens after each optimizer step (logging, evaluation, checkpoints);
3. ``loops``: the worker threads of the layout, started and watched by ``loops.supervise``;
4. ``report.finish``: the summary and the exit code.

Layouts:

* ``threaded`` (default): T target threads feed D drafter threads through bounded queues; each drafter trains its
  own replica on one batch per step; gradients are averaged across drafters (``runtime.Reducer``).
* ``sequential``: the usual alternative (SpecForge / EAGLE-3 style): one thread per device runs the target forward
  and then the drafter step, one batch after the other. It trains on the same D batches per step (accumulating
  gradients), with the same models, compile settings and data, so the two layouts differ only in threading.
"""
from __future__ import annotations

import sys

from . import build, graphs, loops, metrics, report
from .config import Config
from .leader import Leader


def run_training(cfg: Config) -> int:
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

    threads = loops.workers(setup, leader)
    util = None
    if setup.cuda and cfg.gpu_util == "auto":
        util = metrics.GpuUtil(sorted({d.index for d in list(setup.t_dev) + list(setup.d_dev)}))
    setup.run.gpu_util = util
    if cfg.measure_after == 0:
        setup.run.throughput.mark()
    status = loops.supervise(setup.run, threads)
    leader.close()
    return report.finish(setup, leader, status, util, counts, keys)


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

"""The worker threads' loops, and the main thread's watch over them.

* ``threaded`` layout: ``target_loop`` (one per target thread) runs target forwards and puts their outputs into
  the queue of the drafter that trains on them; ``drafter_loop`` (one per drafter thread) takes them, in step order,
  and trains its replica, one batch per step; the replicas average their gradients every step (``runtime.Reducer``).
* ``sequential`` layout: ``sequential_loop`` (one per device) runs the target forward and then the drafter step,
  batch after batch, on the same batches.

Which batch goes where is a pure function of the step: local batch ``n = step·D + d`` is made by target thread
``n mod T`` and trained on by drafter ``d`` (data index ``(step·WORLD + rank)·D + d``). ``supervise`` starts the
threads and watches them: hang (``hang_exit``), Ctrl-C, a thread's error.

The leading worker calls ``on_step(steps done)`` after each optimizer step it issued (``leader.Leader.step_done``):
a callable, so that the loops do not depend on what the leader does with it.
"""
from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from . import package_state
from .metrics import emit_line
from .runtime import Lane, Run, worker
from .steps import Setup, TargetCall, inject_fault, lr_at, target_step

# --host-lock: one thread at a time issues a target forward or a drafter forward/backward (never held while waiting
# for a queue or a barrier). Without it, every torch call releases the GIL and another thread takes it, so threads
# hand the interpreter to each other thousands of times per step; with it, the threads that wait sleep on the lock
# and the one issuing work keeps the GIL between its calls.
HostLock = Any  # threading.Lock or contextlib.nullcontext
OnStep = Callable[[int], None]  # the leader's hook after an optimizer step (argument: steps done, 1-based)


def workers(setup: Setup, on_step: OnStep) -> list[threading.Thread]:
    """The worker threads of the configured layout, not started yet."""
    cfg, run = setup.cfg, setup.run
    if cfg.layout != "threaded":
        return [worker(run, f"sequential-{w}@{setup.d_dev[w]}", functools.partial(sequential_loop, setup, on_step, w))
                for w in range(len(setup.replicas))]
    host_lock: HostLock = threading.Lock() if cfg.host_lock else contextlib.nullcontext()
    t_lanes = [Lane(dev, cfg.streams, cfg.stream_priority == "target", cfg.target_sms) for dev in setup.t_dev]
    queues: list[queue.Queue[Any]] = [queue.Queue(maxsize=cfg.queue_size) for _ in range(cfg.drafter_threads)]
    threads = [worker(run, f"target-{j}@{setup.t_dev[j]}",
                      functools.partial(target_loop, setup, j, t_lanes[j], queues, host_lock))
               for j in range(cfg.target_threads)]
    threads += [worker(run, f"drafter-{d}@{setup.d_dev[d]}",
                       functools.partial(drafter_loop, setup, on_step, d, queues[d], host_lock))
                for d in range(cfg.drafter_threads)]
    return threads


def target_loop(setup: Setup, j: int, lane: Lane, queues: list[queue.Queue[Any]], host_lock: HostLock) -> None:
    """Target thread ``j``: local batches n ≡ j (mod T), in increasing order, each into drafter ``n mod D``'s queue."""
    cfg, run = setup.cfg, setup.run
    t_threads, d_threads = cfg.target_threads, cfg.drafter_threads
    call = TargetCall(cfg, setup.target_fns[setup.t_dev[j]], lane)
    with lane.context():
        n = setup.start_step * d_threads + (j - setup.start_step * d_threads) % t_threads
        while n < cfg.steps * d_threads:
            step, d = divmod(n, d_threads)
            if j == 0:
                inject_fault(cfg, "target", step)
            with host_lock:
                index = (step * setup.world + setup.rank) * d_threads + d
                feats = target_step(run, cfg, setup.data, call, lane, index, step, setup.timer)
                ready = lane.record()
            run.put(queues[d], (n, feats, ready))
            run.throughput.add("target", setup.tokens_per_batch)
            n += t_threads


def drafter_loop(setup: Setup, on_step: OnStep, d: int, inbox: queue.Queue[Any], host_lock: HostLock) -> None:
    """Drafter thread ``d``: one batch per step from its queue (reordered: several target threads feed it), forward
    + backward, gradient average, update. Drafter 0 leads (``on_step``)."""
    cfg, run, rep = setup.cfg, setup.run, setup.replicas[d]
    with rep.lane.context():
        pending: dict[int, tuple[Any, Any]] = {}
        for step in range(setup.start_step, cfg.steps):
            n = step * cfg.drafter_threads + d
            if d == 0:
                inject_fault(cfg, "drafter", step)
            while n not in pending:
                got_n, item, ev = run.get(inbox)
                pending[got_n] = (item, ev)
            item, ev = pending.pop(n)
            with host_lock:
                feats = rep.lane.fetch(item, ev)
                del item
                started = setup.timer.start(step)
                rep.forward_backward(run, feats, first=True)
                rep.lane.release(feats)  # referenced until this stream has read them (not record_stream)
                del feats
            rep.update(run, d, step, lr_at(cfg, step))
            setup.timer.stop("drafter", step + 1, started)
            run.throughput.add("drafter", setup.tokens_per_batch)
            if d == 0:
                on_step(step + 1)


def sequential_loop(setup: Setup, on_step: OnStep, w: int) -> None:
    """Worker ``w`` of the sequential layout: per step, for each of its batches (batch ``d`` of the step goes to
    worker ``d mod workers``), the target forward and then the drafter's forward + backward, gradients accumulated;
    then the average and the update. Worker 0 leads."""
    cfg, run, rep = setup.cfg, setup.run, setup.replicas[w]
    call = TargetCall(cfg, setup.target_fns[setup.d_dev[w]], rep.lane)
    mine = [d for d in range(cfg.drafter_threads) if d % len(setup.replicas) == w]
    with rep.lane.context():
        for step in range(setup.start_step, cfg.steps):
            if w == 0:
                inject_fault(cfg, "target", step)
                inject_fault(cfg, "drafter", step)
            for m, d in enumerate(mine):
                index = (step * setup.world + setup.rank) * cfg.drafter_threads + d
                feats = target_step(run, cfg, setup.data, call, rep.lane, index, step, setup.timer)
                run.throughput.add("target", setup.tokens_per_batch)
                started = setup.timer.start(step)  # drafter interval per batch; the last one includes the update
                rep.forward_backward(run, feats, first=(m == 0))
                del feats
                if m == len(mine) - 1:
                    rep.update(run, w, step, lr_at(cfg, step))
                setup.timer.stop("drafter", step + 1, started)
            run.throughput.add("drafter", setup.tokens_per_batch * len(mine))
            if w == 0:
                on_step(step + 1)


def supervise(run: Run, threads: list[threading.Thread]) -> str:
    """Main thread: start workers, watch for hangs, handle Ctrl-C. Returns 'ok', 'error' or 'interrupted'
    (a hang exits the process from here: hung threads cannot be joined)."""
    timeout = run.cfg.hang_timeout
    run.last_progress = time.monotonic()
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            # Backstop if this thread itself stops running: faulthandler's own thread dumps stacks and exits.
            faulthandler.dump_traceback_later(timeout * 1.5 + 60, exit=True)
            for t in threads:
                t.join(timeout=0.2)
            idle = time.monotonic() - run.last_progress
            if idle > timeout and not run.stop.is_set():
                hang_exit(run, idle)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping worker threads ...", file=sys.stderr, flush=True)
        run.halt()
        deadline = time.monotonic() + 60
        for t in threads:
            t.join(timeout=max(0.1, deadline - time.monotonic()))
        faulthandler.cancel_dump_traceback_later()
        return "interrupted"
    faulthandler.cancel_dump_traceback_later()
    return "error" if run.errors.first is not None else "ok"


def hang_exit(run: Run, idle: float) -> None:
    """No drafter step for ``--hang-timeout`` seconds: every thread's stack, summary.json with ``"hung": true``, the
    ``SUMMARY`` line, exit 3 (hung threads cannot be joined, so the process ends here)."""
    print(f"\nHANG DETECTED: no drafter step completed in {idle:.0f} s (--hang-timeout {run.cfg.hang_timeout:g}); "
          f"last completed step {run.steps_done}. Stacks of all threads follow.", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    summary = {"status": "hung", "hung": True, "steps_done": run.steps_done, "idle_s": round(idle, 1),
               "errors": {"total": run.errors.total(), "counted": dict(run.errors.counts)},
               "ttc": package_state.state()["label"]}
    if run.gpu_util is not None:
        run.gpu_util.close()
    if run.cfg.out and run.rank == 0:
        Path(run.cfg.out, "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    emit_line("SUMMARY " + json.dumps(summary, default=str))
    print(f"train.py: error: hang: no drafter step completed in {idle:.0f} s (last completed step {run.steps_done})",
          file=sys.stderr, flush=True)
    sys.stderr.flush()
    os._exit(3)

"""What the leading thread (drafter 0; sequential layout: worker 0) does after each optimizer step it issued.

Measurement marks (the steady window), the ``--profile`` window, the step's statistics (copied off the device
without waiting), evaluation (τ), the metrics log and progress line, checkpoints. Only evaluation and checkpoints
wait for the GPU. The ``Leader`` also keeps what the summary reads: τ before and after, the first and last loss,
the last checkpoint written.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from . import graphs, metrics
from .runtime import StatsLog
from .steps import Setup, lr_at, save_checkpoint


class Leader:
    def __init__(self, setup: Setup) -> None:
        self.setup, self.cfg = setup, setup.cfg
        self.replica = setup.replicas[0]
        self.layout = self.replica.layout
        self.stats_log = StatsLog(self.replica.lane, self.cfg.pin_memory)
        # summary.json starts with these (loss_first and loss_last follow once logged); see report.finish
        self.summary: dict[str, Any] = {"tau_initial": None, "tau_final": None}
        self.saved_step: int | None = None  # the last checkpoint written
        self.progress: metrics.Progress | None = None
        self.prof_range: tuple[int, int] | None = None
        if self.cfg.profile and setup.rank == 0:
            self.prof_range = self.cfg.profile_window(setup.mark_after)
        self.profiler: list[Any] = []

    def evaluate_first(self) -> None:
        """τ of the drafter before training (rank 0)."""
        setup = self.setup
        if setup.evalset is None:
            return
        ev = setup.evalset.evaluate(self.replica.model, self.cfg)
        self.summary["tau_initial"] = ev["tau"]
        setup.log.write({"kind": "eval", "step": setup.start_step, **ev})
        print(f"τ of the drafter at step {setup.start_step} (before training): {ev['tau']:.3f}  "
              f"accept={ev['accept']}", flush=True)

    def start_progress(self) -> None:
        if self.setup.rank == 0:
            self.progress = metrics.Progress(self.cfg.steps, self.setup.start_step, self.cfg.log_every)

    def note(self, line: str) -> None:
        """One line about what the run is doing (rank 0), between the progress lines."""
        if self.progress is not None:
            self.progress.note(line)

    def step_done(self, step: int) -> None:
        """Optimizer step ``step`` (1-based: steps done) was issued by every replica: ``after_step``, then the
        watchdog hears of the progress."""
        self.after_step(step)
        self.setup.run.steps_done = step
        self.setup.run.last_progress = time.monotonic()

    def after_step(self, step: int) -> None:
        setup, cfg, run = self.setup, self.cfg, self.setup.run
        if step == setup.mark_after:
            if setup.cuda:
                graphs.synchronize(setup.devices)
            run.throughput.mark()
        if step == cfg.steps:
            if setup.cuda:
                graphs.synchronize(setup.devices)
            run.throughput.close()
        self.profile_window(step)
        if setup.rank != 0:
            return
        elapsed = time.monotonic() - run.throughput.start
        if step == setup.start_step + 1:
            self.note(f"first step done after {elapsed:.1f} s" + ("" if cfg.no_compile else " (compiles included)"))
        self.stats_log.push(step, self.layout.stats(self.replica.flat), {"lr": lr_at(cfg, step - 1),
                                                                         "elapsed_s": round(elapsed, 2)})
        taus: dict[int, Any] = {}
        eval_due = setup.evalset is not None and ((cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps)
        save_due = setup.out is not None and not cfg.no_checkpoint and (
            step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0))
        if eval_due and setup.evalset is not None:
            ev = setup.evalset.evaluate(self.replica.model, cfg)
            self.summary["tau_final"] = ev["tau"]
            setup.log.write({"kind": "eval", "step": step, **ev})
            taus[step] = ev["tau"]
        self.write_records(self.stats_log.drain(wait=bool(eval_due or save_due)), taus)
        if save_due and setup.out is not None:
            save_checkpoint(setup.out, self.replica, step, cfg, setup.batches_per_step)
            self.saved_step = step

    def write_records(self, items: list[tuple[int, list[float], dict[str, Any]]], taus: dict[int, Any]) -> None:
        """Steps' statistics, once copied off the device: metrics log, progress line, first and last loss."""
        for step, vals, extra in items:
            st = self.layout.unpack(vals)
            self.summary.setdefault("loss_first", st.loss)
            self.summary["loss_last"] = st.loss
            self.setup.log.write({"kind": "train", "step": step, **st.record(), **extra})
            info: dict[str, object] = {"loss": f"{st.loss:.3f}", "acc0": f"{st.acc[0]:.2f}"}
            if step in taus:
                info["tau"] = f"{taus[step]:.2f}"
            if self.progress is not None:
                self.progress.update(step, self.cfg.steps, info)

    def profile_window(self, step: int) -> None:
        """``--profile``: the profiler runs from the start of step ``a`` to the start of step ``b``."""
        if self.prof_range is None:
            return
        if step == self.prof_range[0] and not self.profiler:
            self.profiler.append(start_profiler(self.setup.cuda))
        elif step == self.prof_range[1] and self.profiler:
            stop_profiler(self.profiler.pop(), Path(str(self.cfg.profile)), self.setup.cuda)

    def flush(self) -> None:
        """After the threads ended and the devices finished (``report.settle``): the statistics still on their way
        to the host (rank 0)."""
        if self.setup.rank == 0:
            self.write_records(self.stats_log.drain(wait=True), {})

    def close(self) -> None:
        """After the threads ended: the progress bar, a profiler still running."""
        if self.progress is not None:
            self.progress.close()
        for p in self.profiler:
            stop_profiler(p, Path(str(self.cfg.profile)), self.setup.cuda)


def start_profiler(cuda: bool) -> Any:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:  # every thread's ops, not only the profiling thread's (torch >= 2.7)
        from torch.profiler import _ExperimentalConfig

        prof = profile(activities=activities, experimental_config=_ExperimentalConfig(profile_all_threads=True))
    except (ImportError, TypeError):
        prof = profile(activities=activities)
    prof.__enter__()
    return prof


def stop_profiler(prof: Any, directory: Path, cuda: bool) -> None:
    prof.__exit__(None, None, None)
    directory.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(directory / "trace.json"))
    avg = prof.key_averages()
    parts = []
    for key in (["self_device_time_total"] if cuda else []) + ["self_cpu_time_total"]:
        try:
            parts.append(f"sorted by {key}\n" + avg.table(sort_by=key, row_limit=30))
        except Exception as e:  # older names (self_cuda_time_total)
            parts.append(f"sorted by {key}: {e}")
    (directory / "ops.txt").write_text("\n\n".join(parts))

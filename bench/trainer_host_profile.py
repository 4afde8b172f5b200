#!/usr/bin/env python
"""Where the reference trainer's worker threads spend their interpreter time, by sampling their stacks.

    python bench/trainer_host_profile.py REPORT.md -- --preset cuda-small --layout sequential --steps 150

Everything after ``--`` goes to ``examples/specdec/train.py``, which runs in this process. During the steady window
(from ``--measure-after`` to the end) a sampler thread reads every worker thread's Python stack
(``sys._current_frames``) every ``--interval`` seconds and counts, per thread kind (``target``, ``drafter``,
``sequential``, and ``native`` for threads that torch started, such as the autograd engine's device thread that
runs backward on CUDA):

* the innermost line of the trainer itself (``examples/specdec/*.py``): which statement of the loop the thread
  was in, whatever torch was doing beneath it;
* the innermost function (self time, Python level: a C call is charged to the Python function that made it);
* every function on the stack (inclusive time).

A sample is taken when the sampler gets the GIL, so the switch interval is lowered to ``--switch`` seconds while
sampling, or samples would pile up where threads release the GIL. Sampling and the lower switch interval slow the
run down a little: the shares are what to read, not the run's tokens/s. No profiler C extension is needed
(py-spy is not always installable next to a GPU).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time
from pathlib import Path
from typing import Counter

from _repo import ROOT

TRAINER_DIR = str(ROOT / "examples" / "specdec")


def where(code_file: str) -> str:
    """A short, machine-independent name for a source file."""
    for marker, prefix in (("site-packages" + os.sep, ""), ("examples" + os.sep, ""),
                           ("torch_threadsafe_compile" + os.sep, "torch_threadsafe_compile/")):
        if marker in code_file:
            return prefix + code_file.rsplit(marker, 1)[1]
    return os.path.basename(code_file)


class Sampler:
    """Counts stack samples of the trainer's worker threads (names carry ``@device``) per thread kind."""

    def __init__(self, interval: float, switch: float) -> None:
        self.interval, self.switch = interval, switch
        self.samples: Counter[str] = collections.Counter()
        self.lines: dict[str, Counter[str]] = collections.defaultdict(collections.Counter)
        self.leaf: dict[str, Counter[str]] = collections.defaultdict(collections.Counter)
        self.incl: dict[str, Counter[str]] = collections.defaultdict(collections.Counter)
        self.stop_ev = threading.Event()
        self.thread: threading.Thread | None = None
        self.old_switch = sys.getswitchinterval()
        self.wall = 0.0

    def start(self) -> None:
        if self.thread is not None:
            return
        sys.setswitchinterval(self.switch)
        self.t0 = time.monotonic()
        self.thread = threading.Thread(target=self._loop, name="host-sampler", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.thread is None or self.stop_ev.is_set():
            return
        self.stop_ev.set()
        self.thread.join()
        self.wall = time.monotonic() - self.t0
        sys.setswitchinterval(self.old_switch)

    def _loop(self) -> None:
        me = threading.get_ident()
        while not self.stop_ev.wait(self.interval):
            threads = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                name = threads.get(ident)
                if ident == me or (name is not None and "@" not in name):
                    continue  # the sampler, the main thread, helpers of the trainer
                # Threads that Python did not start run Python code too: on CUDA, the autograd engine's device
                # thread runs every backward (and with it the compiled backward's Python wrappers).
                self._record(name.split("-")[0] if name else "native", frame)

    def _record(self, kind: str, frame) -> None:
        self.samples[kind] += 1
        seen = set()
        trainer_line = None
        first = True
        f = frame
        while f is not None:
            code = f.f_code
            key = f"{where(code.co_filename)}:{code.co_name}"
            if first:
                self.leaf[kind][key] += 1
                first = False
            if key not in seen:
                seen.add(key)
                self.incl[kind][key] += 1
            if trainer_line is None and code.co_filename.startswith(TRAINER_DIR):
                trainer_line = f"{where(code.co_filename)}:{f.f_lineno} ({code.co_name})"
            f = f.f_back
        self.lines[kind][trainer_line or "(outside the trainer)"] += 1

    def report(self, top: int) -> str:
        out = [f"Sampled for {self.wall:.1f} s every {self.interval * 1e3:.2f} ms (switch interval "
               f"{self.switch * 1e3:.2f} ms).", ""]
        for kind in sorted(self.samples):
            n = self.samples[kind]
            out += [f"## {kind} threads: {n} samples", ""]
            for title, table in (("innermost trainer line", self.lines[kind]),
                                 ("innermost Python function (self)", self.leaf[kind]),
                                 ("on the stack (inclusive)", self.incl[kind])):
                out += [f"### {title}", "", "| share | where |", "|---|---|"]
                out += [f"| {c / n:6.1%} | `{k}` |" for k, c in table.most_common(top)]
                out.append("")
        return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, train_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", help="markdown report to write")
    ap.add_argument("--interval", type=float, default=0.0005, help="seconds between samples")
    ap.add_argument("--switch", type=float, default=0.0001, help="sys.setswitchinterval while sampling")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args(argv)
    if a.interval <= 0 or a.switch <= 0:
        ap.error("--interval and --switch must be positive")

    from examples.specdec import metrics, train

    sampler = Sampler(a.interval, a.switch)
    mark, close = metrics.Throughput.mark, metrics.Throughput.close

    def mark_and_sample(self) -> None:  # the steady window starts: sample from here
        mark(self)
        sampler.start()

    def close_and_stop(self) -> None:
        sampler.stop()
        close(self)

    metrics.Throughput.mark = mark_and_sample  # type: ignore[method-assign]
    metrics.Throughput.close = close_and_stop  # type: ignore[method-assign]
    try:
        rc = train.main(train_args)
    finally:
        sampler.stop()
        metrics.Throughput.mark, metrics.Throughput.close = mark, close  # type: ignore[method-assign]
    header = f"# Host profile: `train.py {' '.join(train_args)}` (exit {rc})\n\n"
    Path(a.report).write_text(header + sampler.report(a.top) + "\n")
    print(f"host profile written to {a.report}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())

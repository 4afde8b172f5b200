"""Metrics: acceptance length τ, throughput per thread kind, compile counts, errors; JSONL log, progress, plot.

Acceptance (τ) definition used everywhere in this example
---------------------------------------------------------
An evaluation sequence is a held-out prompt followed by the *target's own greedy continuation* (generated once
at start-up, the target is frozen). For a sampled position t (the last context position; token t+1 is the
target's "bonus" token from the previous verification), the drafter proposes k tokens autoregressively with the
TTT unrolling (step 0 reads the fused target features at t and token t+1; step i reads its own step-(i-1) hidden
state and proposal). Proposal i is accepted iff it and all earlier proposals equal the target's greedy tokens
t+2 .. t+2+i. Because the continuation *is* greedy, "equal to the target's greedy token given the drafted
prefix" is a comparison against the stored sequence.

* ``accept[i]``: fraction of positions whose first i+1 proposals are all accepted (non-increasing in i).
* ``tau``: mean accepted-prefix length in 0..k, which equals ``sum(accept)``. (Tokens per target forward in real
  speculative decoding would be τ + 1, counting the bonus token.)
"""
from __future__ import annotations

import collections
import json
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


def acceptance(proposals: torch.Tensor, tokens: torch.Tensor, first: int, last: int) -> dict[str, object]:
    """τ and per-position acceptance. proposals ``[k, B, S]`` (proposal i at t targets token t+2+i), tokens
    ``[B, S]`` greedy beyond the prompt; positions t in ``[first, last]`` are scored."""
    k = proposals.shape[0]
    t = torch.arange(first, last + 1, device=tokens.device)
    match = torch.stack([proposals[i][:, t] == tokens[:, t + 2 + i] for i in range(k)])  # [k, B, T]
    accepted = match.long().cumprod(dim=0).float()
    per_pos = accepted.mean(dim=(1, 2))
    return {"tau": float(accepted.sum(0).mean()), "accept": [round(float(a), 4) for a in per_pos]}


@dataclass
class ErrorLog:
    """Thread-safe error bookkeeping: the first fatal error (with traceback) and counted, tolerated errors."""

    counts: collections.Counter = field(default_factory=collections.Counter)
    first: str | None = None
    first_exc: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, where: str, exc: BaseException) -> None:
        with self.lock:
            self.counts[f"{where}: {type(exc).__name__}: {str(exc).splitlines()[0][:90] if str(exc) else ''}"] += 1

    def fatal(self, where: str, exc: BaseException) -> bool:
        """Record a fatal error; True if it is the first one."""
        with self.lock:
            if self.first is None:
                self.first = f"[{where}] " + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                self.first_exc = exc
                return True
            self.counts[f"{where} (after first): {type(exc).__name__}"] += 1
            return False

    def total(self) -> int:
        return sum(self.counts.values()) + (self.first is not None)


class Throughput:
    """Tokens and steps per thread kind, each kind's time to first completed step, and a steady-state window.

    Times are host times at which a thread finished *issuing* a step; the GPU may still be behind. The steady
    window therefore starts and ends at a device synchronisation (``mark``, once after the warm-up steps, and
    ``close`` at the end), so its tokens/s is what the GPU completed, compile and warm-up excluded."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.lock = threading.Lock()
        self.tokens: dict[str, int] = collections.Counter()
        self.steps: dict[str, int] = collections.Counter()
        self.first_step: dict[str, float] = {}
        self.last_step: dict[str, float] = {}
        self.window_start: tuple[float, dict[str, int]] | None = None
        self.window_end: tuple[float, dict[str, int]] | None = None
        self.cpu_start = self.cpu_end = 0.0

    def add(self, kind: str, tokens: int) -> None:
        now = time.monotonic() - self.start
        with self.lock:
            self.tokens[kind] += tokens
            self.steps[kind] += 1
            self.first_step.setdefault(kind, now)
            self.last_step[kind] = now

    def mark(self) -> None:
        """Start of the steady window (call right after a device synchronisation)."""
        with self.lock:
            self.window_start = (time.monotonic(), dict(self.tokens))
            self.cpu_start = time.process_time()

    def close(self) -> None:
        """End of the steady window (after the last step and a device synchronisation)."""
        with self.lock:
            if self.window_start is not None and self.window_end is None:
                self.window_end = (time.monotonic(), dict(self.tokens))
                self.cpu_end = time.process_time()

    def window(self) -> tuple[float, float] | None:
        if self.window_start is None or self.window_end is None:
            return None
        return self.window_start[0], self.window_end[0]

    def steady(self, kind: str) -> float | None:
        if self.window_start is None or self.window_end is None:
            return None
        (t0, n0), (t1, n1) = self.window_start, self.window_end
        if t1 <= t0:
            return None
        return (n1.get(kind, 0) - n0.get(kind, 0)) / (t1 - t0)

    def summary(self) -> dict[str, dict[str, float | None]]:
        out: dict[str, dict[str, float | None]] = {}
        with self.lock:
            kinds = sorted(self.tokens)
        for kind in kinds:
            steady = self.steady(kind)
            with self.lock:
                wall = max(self.last_step[kind], 1e-9)
                out[kind] = {
                    "steps": self.steps[kind],
                    "tokens": self.tokens[kind],
                    "time_to_first_step_s": round(self.first_step[kind], 2),
                    "tokens_per_s": round(self.tokens[kind] / wall, 1),
                    "steady_tokens_per_s": round(steady, 1) if steady else None,
                }
        window = self.window()
        if window is not None:
            t0, t1 = window
            # Host CPU seconds of the whole process per second of the window: near 1 with the GPU idle much of the
            # time means the interpreter (one GIL) bounds the run; torch releases the GIL inside its ops, so it
            # can exceed 1.
            cpu = (self.cpu_end - self.cpu_start) / max(t1 - t0, 1e-9)
            out["window"] = {"start_s": round(t0 - self.start, 2), "seconds": round(t1 - t0, 3),
                             "host_cpu_per_s": round(cpu, 2)}
        return out


class GpuUtil:
    """Samples GPU utilisation (NVML's "percent of time a kernel was running", as nvidia-smi shows it) a few times a
    second, through pynvml when installed, else an ``nvidia-smi`` child process (killed with the trainer, even
    by ``os._exit``). ``mean(t0, t1)`` averages the samples of the given monotonic-time window over the GPUs."""

    def __init__(self, cuda_indices: list[int], period_s: float = 0.2) -> None:
        self.samples: list[tuple[float, float]] = []
        self.source: str | None = None
        self.reason: str | None = None
        self._stop = threading.Event()
        self._proc = None
        ids = self._physical_ids(cuda_indices)
        try:
            import pynvml

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByUUID(i) if not i.isdigit() else
                       pynvml.nvmlDeviceGetHandleByIndex(int(i)) for i in ids]
            self.source = "nvml"
            target = lambda: self._poll_nvml(pynvml, handles, period_s)  # noqa: E731
        except Exception:
            import shutil
            import subprocess

            exe = shutil.which("nvidia-smi")
            if exe is None:
                self.reason = "neither pynvml nor nvidia-smi available"
                return
            self._proc = subprocess.Popen(
                [exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                 f"--loop-ms={int(period_s * 1000)}", f"--id={','.join(ids)}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, preexec_fn=_die_with_parent)
            self.source = "nvidia-smi"
            target = self._read_smi
        threading.Thread(target=target, name="gpu-util", daemon=True).start()

    @staticmethod
    def _physical_ids(indices: list[int]) -> list[str]:
        import os

        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        return [visible[i] if i < len(visible) else str(i) for i in indices]

    def _poll_nvml(self, pynvml: Any, handles: list[Any], period_s: float) -> None:
        while not self._stop.wait(period_s):
            try:
                util = [pynvml.nvmlDeviceGetUtilizationRates(h).gpu for h in handles]
            except Exception as e:  # pragma: no cover - driver trouble
                self.reason = f"NVML: {e}"
                return
            self.samples.append((time.monotonic(), sum(util) / len(util)))

    def _read_smi(self) -> None:
        if self._proc is None or self._proc.stdout is None:
            return
        for line in self._proc.stdout:
            try:
                self.samples.append((time.monotonic(), float(line.strip())))
            except ValueError:
                continue

    def mean(self, window: tuple[float, float] | None) -> float | None:
        if window is None:
            return None
        vals = [u for t, u in self.samples if window[0] <= t <= window[1]]
        return round(sum(vals) / len(vals), 1) if vals else None

    def close(self) -> None:
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=2)
            except Exception:
                self._proc.kill()


def _die_with_parent() -> None:
    """Child process setup: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG), so a sampler never
    outlives a trainer that exits through ``os._exit`` (hang watchdog)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except Exception:
        pass


def compile_counts() -> dict[str, int]:
    """Dynamo's own counters: unique graphs compiled and frames seen (process-wide)."""
    try:
        from torch._dynamo.utils import counters
    except Exception:  # pragma: no cover - dynamo unavailable
        return {}
    stats = counters.get("stats", {})
    return {"unique_graphs": int(stats.get("unique_graphs", 0)), "calls_captured": int(stats.get("calls_captured", 0)),
            "frames_ok": int(counters.get("frames", {}).get("ok", 0)),
            "recompiles": int(sum(counters.get("recompiles", {}).values()))}


class Progress:
    """tqdm when installed and stderr is a terminal; otherwise one plain line every ``every`` steps."""

    def __init__(self, total: int, initial: int, every: int) -> None:
        self.every, self.bar = max(1, every), None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step: int, total: int, info: dict[str, object]) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(dict(info), refresh=False)
        elif step % self.every == 0 or step == total:
            print(f"step {step}/{total} " + " ".join(f"{k}={v}" for k, v in info.items()), flush=True)

    def note(self, line: str) -> None:
        """One line about what the run is doing, above the bar when there is one (tqdm keeps its bar intact)."""
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class MetricsLog:
    """Append-only JSONL (one record per step or eval) plus an in-memory copy for the summary and plot."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.records: list[dict[str, object]] = []
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        # open for the whole run, closed by close()
        self.fh = open(path, "a", encoding="utf-8") if path is not None else None  # noqa: SIM115

    def write(self, record: dict[str, object]) -> None:
        self.records.append(record)
        if self.fh is not None:
            self.fh.write(json.dumps(record) + "\n")
            self.fh.flush()

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()


def plot(records: list[dict[str, object]], path: Path) -> str | None:
    """PNG of training loss and τ against step; returns a note instead when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: plot skipped"
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.plot([r["step"] for r in train], [r["loss"] for r in train])
    a.set_xlabel("step"), a.set_ylabel("TTT loss"), a.set_title("drafter loss")
    b.plot([r["step"] for r in evals], [r["tau"] for r in evals], marker="o")
    b.set_xlabel("step"), b.set_ylabel("τ (accepted tokens)"), b.set_title("acceptance length")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def emit_line(line: str) -> None:
    """Print one machine-read line (SUMMARY, PARAM_CHECKSUM) in a single write. Ranks of a torchrun job share
    stdout, and print() writes the text and its newline separately: with unbuffered stdout another rank's line
    could land between the two (seen once in CI as two checksums on one line)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()

#!/usr/bin/env python
"""The serving example (examples/serve/) in four set-ups, one after the other in one run, the same requests to each:

* ``active``: torch-threadsafe-compile active, no lock: the request threads call the compiled model at once;
* ``off``: ``TTC_DISABLE=1``, no lock: what torch does from threads without the package;
* ``lock``: ``TTC_DISABLE=1`` and one global lock around the model: what programs do today to be safe;
* ``workers``: ``TTC_DISABLE=1``, ``--workers N`` uvicorn processes with one model each, each behind its lock
  (one request at a time per process, as one-process-per-worker servers run).

Each set-up starts its server cold (a fresh inductor cache directory; the model compiles on the first requests),
on 127.0.0.1, then runs three phases with bounded request counts and a deadline per set-up:

1. cold: ``--cold`` requests (default 64) sent at once: the time until the last one is answered;
2. warm: ``--warm`` requests (default 384), ``--concurrency`` in flight (default 64): throughput, p50/p99;
3. new shape: open-loop traffic of ordinary requests at ``--rate`` per second for ``--seconds``, and one request
   with a sequence length the server has not seen (``--new-seq``) sent ``--new-at`` seconds in: the p99 of the
   ordinary requests that were in flight while the new-shape request was (a compile, or a wait for one).

Reported per set-up: failed requests (no 200), wrong answers (not equal to eager within 1e-4), answers that the
model gave uncompiled, compiles and distinct graphs (a graph compiled twice with one input signature is a duplicate
compile), the phases' numbers, and the peak RSS of the server's processes (the sum of each process's peak, read
from /proc before the server stops). Writes serve.json, serve.md (the table) and serve.png into ``--out``.

    python bench/serve.py --model mlp --out runs/serve-mlp
    python bench/serve.py --model block --out runs/serve-block --setups active,lock
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from _harness import child_env, kill_group, own_group
from _repo import ROOT

from examples.serve import load, models

SERVER = ROOT / "examples" / "serve" / "server.py"


@dataclass(frozen=True)
class Setup:
    name: str
    label: str
    ttc_disable: str | None  # the server's TTC_DISABLE, None: the package active
    lock: bool
    workers: int


def setups(workers: int) -> dict[str, Setup]:
    return {
        "active": Setup("active", "package active", None, False, 1),
        "off": Setup("off", "TTC_DISABLE=1", "1", False, 1),
        "lock": Setup("lock", "TTC_DISABLE=1 + global lock", "1", True, 1),
        "workers": Setup("workers", f"TTC_DISABLE=1, {workers} worker processes", "1", True, workers),
        # Not in the default run: the package without its H3 patch, to tell which patch a difference comes from.
        "no-first-compile": Setup("no-first-compile", "TTC_DISABLE=first_compile", "first_compile", False, 1),
    }


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(proc: subprocess.Popen[bytes], log: Path, workers: int, timeout: float) -> float:
    """Seconds until every worker process said "Application startup complete." (model built, nothing compiled)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready:\n{log.read_text()[-3000:]}")
        if log.read_text(errors="replace").count("Application startup complete.") >= workers:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise RuntimeError(f"server not ready after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """Ctrl-C, as a user stops uvicorn (each process then writes its stats); the process group is killed if it
    does not end in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
            return
        except subprocess.TimeoutExpired:
            pass
    kill_group(proc)
    proc.wait(10)


def process_tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def tree_peak_rss_mib(pid: int) -> tuple[float | None, int]:
    """The sum of VmHWM (peak RSS) over the server's process and its descendants, and how many there were."""
    if not Path("/proc/self/status").exists():
        return None, 0
    total_kib, count = 0, 0
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total_kib += int(line.split()[1])
                    count += 1
        except OSError:
            continue
    return round(total_kib / 1024, 1), count


def server_stats(stats_dir: Path) -> dict[str, Any]:
    """The final /v1/stats of each server process (written at shutdown), summed."""
    files = sorted(stats_dir.glob("stats-*.json"))
    per_process = [json.loads(f.read_text()) for f in files]
    keys = ("model_calls", "failed_calls", "uncompiled_calls", "compiles", "distinct_graphs", "duplicate_compiles",
            "dynamo_unique_graphs")
    total: dict[str, Any] = {k: sum(int(s.get(k, 0)) for s in per_process) for k in keys}
    total["processes"] = len(per_process)
    total["ttc"] = [s.get("ttc") for s in per_process]
    total["graph_signatures"] = [s.get("graph_signatures") for s in per_process]
    return total


@dataclass(frozen=True)
class Workload:
    cold: list[load.Job]
    warm: list[load.Job]
    steady: list[load.Job]
    new_shape: load.Job


def workload(args: argparse.Namespace) -> Workload:
    """The same requests for every set-up. The cold burst meets every batch size (1 to --max-batch), so that
    every graph of ordinary traffic is compiled before the warm phase starts."""
    def jobs(count: int, seed: int) -> list[load.Job]:
        return load.make_jobs(args.model, load.batch_sizes(count, args.max_batch, seed), seed=seed)

    new_shape = load.make_jobs(args.model, [4], seq=args.new_seq, seed=4)[0]
    return Workload(jobs(args.cold, 1), jobs(args.warm, 2), jobs(max(1, int(args.rate * args.seconds)), 3), new_shape)


async def phases(port: int, w: Workload, args: argparse.Namespace) -> dict[str, Any]:
    deadline = time.perf_counter() + args.max_seconds
    async with load.new_client(port, max(args.concurrency, len(w.cold)), args.timeout) as client:
        cold = await load.closed_loop(client, w.cold, len(w.cold), deadline)
        warm = await load.closed_loop(client, w.warm, args.concurrency, deadline)
        steady, new = await load.open_loop(client, w.steady, args.rate, deadline, w.new_shape, args.new_at)
    assert new is not None
    overlapping = [o for o in steady if o.status == 200 and o.start < new.end and o.end > new.start]
    before = [o for o in steady if o.status == 200 and o.end <= new.start]
    everything = cold + warm + steady + [new]
    return {
        "cold": load.summarize(cold), "warm": load.summarize(warm),
        "new_shape": {
            "steady": load.summarize(steady),
            "steady_before_p99_s": load.percentile([o.latency for o in before], 99),
            "overlapping": len(overlapping),
            "overlapping_p50_s": load.percentile([o.latency for o in overlapping], 50),
            "overlapping_p99_s": load.percentile([o.latency for o in overlapping], 99),
            "new_request_status": new.status, "new_request_s": round(new.latency, 3),
            "new_request_compiled": new.compiled, "new_request_correct": load.is_correct(new),
        },
        "all": load.summarize(everything),
    }


def run_setup(s: Setup, w: Workload, args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"serve-{s.name}-"))
    (work / "stats").mkdir()
    env = child_env(s.ttc_disable)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor")  # cold: nothing compiled by an earlier run
    env["PYTHONUNBUFFERED"] = "1"
    port = free_port()
    cmd = [sys.executable, str(SERVER), "--model", args.model, "--device", args.device, "--port", str(port),
           "--stats-dir", str(work / "stats"), "--max-batch", str(args.max_batch)]
    cmd += ["--lock"] if s.lock else []
    cmd += ["--workers", str(s.workers)] if s.workers > 1 else []
    log = work / "server.log"
    print(f"[serve] {s.name}: {' '.join(shlex.quote(c) for c in cmd)} (log: {log})", file=sys.stderr, flush=True)
    load_before = os.getloadavg()
    t0 = time.monotonic()
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                preexec_fn=own_group)  # a stuck run ends with its worker and compile processes
        try:
            ready_s = wait_ready(proc, log, s.workers, args.start_timeout)
            result = asyncio.run(phases(port, w, args))
            rss, processes = tree_peak_rss_mib(proc.pid)
        finally:
            stop(proc)
            shutil.rmtree(work / "inductor", ignore_errors=True)  # the compiled kernels; the log and stats stay
    result.update(setup=s.name, label=s.label, ready_s=round(ready_s, 2), wall_s=round(time.monotonic() - t0, 1),
                  peak_rss_mib=rss, rss_processes=processes, server=server_stats(work / "stats"),
                  loadavg_before=load_before, loadavg_after=os.getloadavg())
    print(f"[serve] {s.name}: {row(result)}", file=sys.stderr, flush=True)
    return result


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:,.0f}"


def _n(v: Any) -> str:
    return "-" if v is None else f"{v:,}" if isinstance(v, int) else f"{v:,.1f}" if isinstance(v, float) else str(v)


HEADER = ("| set-up | failed | wrong | uncompiled answers | compiles (distinct graphs) | first 64 from cold, s "
          "| warm req/s | warm p50 / p99, ms | new shape: p50 / p99 of requests beside it, ms (n) | new-shape request, s "
          "| peak RSS, MiB |\n|" + " --- |" * 11)


def row(r: dict[str, Any]) -> str:
    a, c, wm, ns, sv = r["all"], r["cold"], r["warm"], r["new_shape"], r["server"]
    new = f"{ns['new_request_s']:.2f}" + ("" if ns["new_request_compiled"] else " (uncompiled)")
    if ns["new_request_status"] != 200:
        new = f"failed ({ns['new_request_status']})"
    return (f"| {r['label']} | {a['failed']} | {a['wrong']} | {a['uncompiled']} | {sv['compiles']} ({sv['distinct_graphs']}) "
            f"| {c['wall_s']:.2f} | {_n(wm['throughput_rps'])} | {_ms(wm['p50_s'])} / {_ms(wm['p99_s'])} "
            f"| {_ms(ns['overlapping_p50_s'])} / {_ms(ns['overlapping_p99_s'])} ({ns['overlapping']}) | {new} "
            f"| {_n(r['peak_rss_mib'])} |")


def plot(results: Sequence[dict[str, Any]], path: Path, title: str) -> str | None:
    """Bars per set-up: warm throughput, time to the first 64 answers from cold, p99 beside a new shape."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: plot skipped"
    labels = [r["setup"] for r in results]
    panels = [("warm throughput, req/s", [r["warm"]["throughput_rps"] or 0 for r in results]),
              ("first 64 answers from cold, s", [r["cold"]["wall_s"] for r in results]),
              ("p99 beside a new shape, s", [r["new_shape"]["overlapping_p99_s"] or 0 for r in results])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4))
    eager_new_shape = [r["new_shape"]["new_request_compiled"] is False for r in results]
    for ax, (name, values) in zip(axes, panels):
        bars = ax.bar(labels, values, color=["tab:green", "tab:red", "tab:blue", "tab:orange", "tab:gray"][:len(labels)])
        texts = [f"{v:.1f}" for v in values]
        if name.startswith("p99"):  # a new shape that was never compiled cannot have made anyone wait
            texts = [t + (" (ran eagerly)" if e else "") for t, e in zip(texts, eager_new_shape)]
        ax.bar_label(bars, labels=texts, fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="serve.py", description="examples/serve in four set-ups (see the docstring)")
    p.add_argument("--model", choices=sorted(models.MODELS), default="mlp")
    p.add_argument("--device", default="cpu", help="the server's --device: cpu, or cuda (compiled with reduce-overhead)")
    p.add_argument("--setups", default="active,off,lock,workers", help="comma-separated, in running order")
    p.add_argument("--workers", type=int, default=2, help="processes of the workers set-up (default 2)")
    p.add_argument("--cold", type=int, default=64)
    p.add_argument("--warm", type=int, default=384)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--rate", type=float, default=30, help="requests/s of the new-shape phase's ordinary traffic")
    p.add_argument("--seconds", type=float, default=6, help="length of the new-shape phase's ordinary traffic")
    p.add_argument("--new-at", type=float, default=2, help="when the new-shape request is sent, s into the phase")
    p.add_argument("--new-seq", type=int, default=models.SEQ + 4, help=f"its sequence length (ordinary: {models.SEQ})")
    p.add_argument("--timeout", type=float, default=120, help="seconds before one request counts as failed")
    p.add_argument("--max-seconds", type=float, default=300, help="deadline of one set-up's three phases")
    p.add_argument("--start-timeout", type=float, default=120)
    p.add_argument("--out", type=Path, default=None, help="output directory (default runs/serve-<model>)")
    a = p.parse_args(argv)
    known = setups(a.workers)
    for name in a.setups.split(","):
        if name not in known:
            p.error(f"unknown set-up {name!r}: choose from {', '.join(known)}")
    for name in ("workers", "cold", "warm", "concurrency", "max_batch", "new_seq"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if a.new_seq == models.SEQ:
        p.error(f"--new-seq must differ from the ordinary sequence length {models.SEQ}")
    if not 0 <= a.new_at < a.seconds or a.rate <= 0:
        p.error("--new-at must fall inside --seconds, and --rate must be positive")
    a.out = a.out or ROOT / "runs" / f"serve-{a.model}"
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    started = datetime.datetime.now(datetime.timezone.utc)
    load_start = os.getloadavg()
    w = workload(args)
    chosen = [setups(args.workers)[n] for n in args.setups.split(",")]
    results = [run_setup(s, w, args) for s in chosen]
    meta = {"command": "python bench/serve.py " + " ".join(shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:])),
            "date": started.isoformat(timespec="seconds"), "torch": torch.__version__,
            "python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine(),
            "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
            "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
            "requests_per_setup": len(w.cold) + len(w.warm) + len(w.steady) + 1, "args": {
                k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    (args.out / "serve.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    table = "\n".join([HEADER, *(row(r) for r in results)])
    (args.out / "serve.md").write_text(f"`{meta['command']}`, {meta['date']}, torch {meta['torch']}, "
                                       f"{meta['cpus']} CPUs, load average {load_start[0]:.1f} → "
                                       f"{meta['loadavg_end'][0]:.1f}\n\n{table}\n")
    note = plot(results, args.out / "serve.png", f"{args.model} on {args.device}, torch {meta['torch']}, {meta['cpus']} CPUs")
    print(table)
    print(f"[serve] wrote {args.out / 'serve.json'}, serve.md" + (f"; {note}" if note else ", serve.png"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Load generator for server.py: a bounded burst of concurrent requests of varying batch size, every answer
checked against the same model run eagerly here.

    python examples/serve/load.py --port 8000 --requests 448 --concurrency 64

It sends to 127.0.0.1 only, sends at most ``--requests`` requests, gives up on each after ``--timeout`` seconds and
on the whole run after ``--max-seconds`` (what was not sent by then counts as failed), and exits 1 when a request
failed or an answer was wrong. The model and its seed are read from the server's ``/v1/stats``. bench/serve.py
uses the same functions for its phases.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

if not __package__:  # run as a script: this file's package is examples.serve of the repository root (PEP 366)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    __package__ = "examples.serve"

import httpx
import torch

from . import models

HOST = "127.0.0.1"
RTOL = ATOL = 1e-4  # inductor may reorder float32 sums: its answers differ from eager in the last bits only


@dataclass(frozen=True)
class Job:
    """One request, built before any timing starts: its JSON body and the eager answer it must get."""

    index: int
    batch: int
    seq: int
    body: bytes
    reference: torch.Tensor


@dataclass(frozen=True)
class Outcome:
    job: Job
    status: int  # HTTP status; 0: no answer (connection error, timeout, not sent before the deadline)
    start: float  # time.perf_counter() seconds
    end: float
    compiled: bool | None  # the server's word: did a compiled graph answer (False: the model ran eagerly)
    outputs: Any
    error: str | None

    @property
    def latency(self) -> float:
        return self.end - self.start


def batch_sizes(count: int, max_batch: int, seed: int) -> list[int]:
    """``count`` batch sizes: every size from 1 to ``max_batch`` in turn (so that a burst of ``max_batch`` or more
    requests meets every shape the server will see), each round shuffled by ``seed``."""
    rng = random.Random(seed)
    sizes: list[int] = []
    while len(sizes) < count:
        round_ = list(range(1, max_batch + 1))
        rng.shuffle(round_)
        sizes += round_
    return sizes[:count]


def make_jobs(model: str, sizes: Sequence[int], *, seq: int = models.SEQ, model_seed: int = 0, seed: int = 0) -> list[Job]:
    """One request per batch size in ``sizes``, inputs drawn from ``seed``, answers from ``model`` run eagerly."""
    reference_model = models.build(model, model_seed)
    jobs = []
    with torch.no_grad():
        for i, batch in enumerate(sizes):
            x = models.example_input(batch, seq, seed * 1_000_003 + i)
            body = json.dumps({"inputs": x.tolist()}, separators=(",", ":")).encode()
            jobs.append(Job(i, batch, seq, body, reference_model(x)))
    return jobs


def new_client(port: int, concurrency: int, timeout: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(base_url=f"http://{HOST}:{port}", limits=limits, timeout=timeout)


async def send(client: httpx.AsyncClient, job: Job) -> Outcome:
    start = time.perf_counter()
    try:
        r = await client.post("/v1/predict", content=job.body, headers={"content-type": "application/json"})
    except (httpx.HTTPError, OSError) as e:
        return Outcome(job, 0, start, time.perf_counter(), None, None, f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    if r.status_code != 200:
        return Outcome(job, r.status_code, start, end, None, None, r.text[:300])
    data = r.json()
    return Outcome(job, 200, start, end, data.get("compiled"), data.get("outputs"), None)


async def _bounded(tasks: list[asyncio.Task[Outcome]], jobs: Sequence[Job], deadline: float) -> list[Outcome]:
    """The tasks' outcomes; those still running at ``deadline`` (perf_counter seconds) are cancelled and count as
    failed, so that a run always ends."""
    await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
    outcomes = []
    for job, task in zip(jobs, tasks):
        if task.done() and not task.cancelled():
            outcomes.append(task.result())
        else:
            task.cancel()
            now = time.perf_counter()
            outcomes.append(Outcome(job, 0, now, now, None, None, "no answer before the run's deadline"))
    return outcomes


async def closed_loop(client: httpx.AsyncClient, jobs: Sequence[Job], concurrency: int, deadline: float) -> list[Outcome]:
    """Every job, at most ``concurrency`` in flight: each finished request lets the next one go."""
    gate = asyncio.Semaphore(concurrency)

    async def one(job: Job) -> Outcome:
        async with gate:
            return await send(client, job)

    return await _bounded([asyncio.create_task(one(j)) for j in jobs], jobs, deadline)


async def open_loop(client: httpx.AsyncClient, jobs: Sequence[Job], rate: float, deadline: float,
                    extra: Job | None = None, extra_at: float = 0.0) -> tuple[list[Outcome], Outcome | None]:
    """Job i is sent at ``i / rate`` seconds whatever the server's pace (arrivals do not wait for answers, as a
    server's clients do not); ``extra`` is sent at ``extra_at`` seconds. Returns the jobs' outcomes and extra's."""
    t0 = time.perf_counter()

    async def at(offset: float, job: Job) -> Outcome:
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        return await send(client, job)

    timed = [(i / rate, j) for i, j in enumerate(jobs)] + ([(extra_at, extra)] if extra is not None else [])
    tasks = [asyncio.create_task(at(offset, job)) for offset, job in timed]
    outcomes = await _bounded(tasks, [job for _, job in timed], deadline)
    return outcomes[:len(jobs)], (outcomes[-1] if extra is not None else None)


def _answer(o: Outcome) -> torch.Tensor | None:
    """The answer as a tensor of the reference's shape; None for no answer, an unreadable one or a wrong shape."""
    if o.status != 200 or o.outputs is None:
        return None
    try:
        out = torch.tensor(o.outputs, dtype=torch.float32)
    except (TypeError, ValueError):
        return None
    return out if out.shape == o.job.reference.shape else None


def abs_diff(o: Outcome) -> float | None:
    """The largest difference between an answer and its eager reference; None for no answer or a wrong shape."""
    out = _answer(o)
    return None if out is None else float((out - o.job.reference).abs().max())


def is_correct(o: Outcome) -> bool:
    out = _answer(o)
    return out is not None and bool(torch.allclose(out, o.job.reference, rtol=RTOL, atol=ATOL))


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100): a value that was measured; with fewer than 100 samples p99 is the
    largest."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Counts and latencies of one phase; throughput counts answered requests over the phase's wall time."""
    answered = [o for o in outcomes if o.status == 200]
    latencies = [o.latency for o in answered]
    wall = (max(o.end for o in outcomes) - min(o.start for o in outcomes)) if outcomes else 0.0
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.status != 200:
            key = f"{o.status}: {(o.error or '').splitlines()[0][:120] if o.error else ''}"
            errors[key] = errors.get(key, 0) + 1
    return {
        "requests": len(outcomes), "failed": len(outcomes) - len(answered),
        "wrong": sum(1 for o in answered if not is_correct(o)),
        "max_abs_diff": max((d for d in map(abs_diff, answered) if d is not None), default=None),
        "uncompiled": sum(1 for o in answered if o.compiled is False),
        "wall_s": round(wall, 3), "throughput_rps": round(len(answered) / wall, 1) if wall > 0 else None,
        "p50_s": _round(percentile(latencies, 50)), "p99_s": _round(percentile(latencies, 99)),
        "max_s": _round(max(latencies) if latencies else None), "errors": errors,
    }


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


async def server_stats(port: int, timeout: float = 30) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=f"http://{HOST}:{port}", timeout=timeout) as client:
        r = await client.get("/v1/stats")
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data


async def run(port: int, requests: int, concurrency: int, timeout: float, max_seconds: float, seed: int) -> dict[str, Any]:
    deadline = time.perf_counter() + max_seconds
    stats = await server_stats(port)
    limits = stats.get("limits", {})
    sizes = batch_sizes(requests, int(limits.get("max_batch", 32)), seed)
    jobs = make_jobs(stats["model"], sizes, model_seed=int(stats["seed"]), seed=seed)
    async with new_client(port, concurrency, timeout) as client:
        outcomes = await closed_loop(client, jobs, concurrency, deadline)
    summary = summarize(outcomes)
    after = await server_stats(port)
    summary["server"] = {k: after.get(k) for k in ("pid", "model", "lock", "ttc", "model_calls", "failed_calls",
                                                   "uncompiled_calls", "compiles", "distinct_graphs",
                                                   "duplicate_compiles", "peak_rss_mib")}
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="load.py", description="Bounded load against server.py on 127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--requests", type=int, default=448, help="requests to send (default 448)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight at most (default 64)")
    p.add_argument("--timeout", type=float, default=60, help="seconds before one request counts as failed")
    p.add_argument("--max-seconds", type=float, default=300, help="the whole run stops after this many seconds")
    p.add_argument("--seed", type=int, default=0, help="seed of the batch sizes and inputs")
    a = p.parse_args(argv)
    for name in ("requests", "concurrency"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be at least 1 (got {getattr(a, name)})")
    if a.timeout <= 0 or a.max_seconds <= 0:
        p.error("--timeout and --max-seconds must be positive")
    try:
        summary = asyncio.run(run(a.port, a.requests, a.concurrency, a.timeout, a.max_seconds, a.seed))
    except httpx.HTTPError as e:
        print(f"load.py: error: no server answers on {HOST}:{a.port} ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1))
    return 1 if summary["failed"] or summary["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""Devices, threads, CUDA streams and the hand-offs between them.

Every worker thread runs on a ``Lane``: its device and, on CUDA with ``--streams``, a stream of its own, so that
the GPU work of different threads can overlap (on the shared default stream it would run one kernel at a time,
whichever thread issued it). Work crosses lanes in three places, and each is ordered by a CUDA event, never by a
host synchronisation:

* target -> drafter (the queue): the target records an event after its forward; the drafter's stream waits for it,
  and the drafter keeps the tensors referenced until its stream has finished with them (``Lane.release``: an
  event, polled), so the caching allocator cannot hand their memory back to the target's stream while the
  drafter still reads it. Across GPUs the copy runs on a helper stream of the source GPU that waits for the event.

  Not ``record_stream``, the usual tool: the caching allocator drops a stream use recorded while *any* thread
  was capturing a CUDA graph when the tensor is also freed during a capture (it takes such streams to belong to
  the capture: ``remove_graph_stream_uses`` in CUDACachingAllocator.cpp, since pytorch#126809) and frees the
  block at once. With ``--step-graphs`` other threads capture while the drafters receive and drop batches, so a
  target thread could get a drafter's input buffer for its next batch while the drafter still read it: this made
  5 target + 3 drafter threads on one GPU depart from the sequential layout's losses after the first captures
  (docs/trainer.md; reproduced by tests/examples/test_specdec_units.py::test_handoff_outlives_another_threads_capture).
* drafter -> reducer -> drafter (gradient averaging): each thread records an event after its backward; the
  leader's stream waits for all of them, sums into a persistent buffer, records an event; every thread's stream
  waits for that one before copying the average back. Persistent buffers mean no allocator hazards, and the waits
  order every read before the next write.
* leader -> host (logging): statistics are copied into pinned memory with ``non_blocking=True`` and read once the
  copy's event has completed (``StatsLog``); nothing in the loop calls ``.item()``.

Without streams (``--no-streams``, or the CPU) every event is ``None`` and every wait a no-op: program order is
stream order.
"""
from __future__ import annotations

import contextlib
import functools
import queue
import threading
import time
from collections import deque
from typing import Any, Callable, Optional, Sequence

import torch

from . import config, graphs, metrics
from .config import Config

Event = Optional["torch.cuda.Event"]


class Stopped(Exception):
    """Raised inside a worker when the shared stop event is set (not an error)."""


_green: dict[tuple[int, int], Any] = {}  # (device index, SMs) -> green context; kept for the process's lifetime


def sm_limit_problem(device: torch.device, num_sms: int) -> str | None:
    """Why ``partition_stream(device, num_sms)`` cannot work here (one line), or None."""
    import ctypes

    try:
        from torch.cuda import green_contexts
    except ImportError:  # torch < 2.10
        green_contexts = None
    if not getattr(green_contexts, "SUPPORTED", False):
        return f"SM partitions need CUDA green contexts, which torch {torch.__version__} was built without"
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return f"SM partitions create their streams through the CUDA driver library: {e}"
    total = torch.cuda.get_device_properties(device).multi_processor_count
    if not 1 <= num_sms < total:
        return f"SM count {num_sms} is not in [1, {total}) for {device} ({total} SMs)"
    return None


def check_devices(cfg: Config) -> str | None:
    """CUDA requested but not there, a GPU index that does not exist, or an SM partition the GPU cannot make: one
    line, or None."""
    spec = cfg.devices
    entries = config.device_list(spec)
    if spec == "auto" and not torch.cuda.is_available():
        for flag, wanted in (("--step-graphs", cfg.step_graphs), ("--target-sms", cfg.target_sms)):
            if wanted:
                return f"{flag} needs CUDA, and --devices auto found none (torch {torch.__version__})"
    if spec != "auto" and any(e.startswith("cuda") for e in entries):
        preset = f" (preset {cfg.preset})" if cfg.preset else ""
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
            return (f"--devices {spec}{preset} needs CUDA, but {why} (torch {torch.__version__}); "
                    f"use --devices cpu or --preset cpu-tiny")
        n = torch.cuda.device_count()
        for e in entries:
            if ":" in e and int(e.split(":")[1]) >= n:
                return f"--devices {spec}: {e} does not exist ({n} GPU(s) visible)"
    if cfg.target_sms:
        for dev in dict.fromkeys(d for d in parse_devices(spec) if d.type == "cuda"):
            problem = sm_limit_problem(dev, cfg.target_sms)
            if problem:
                return f"--target-sms {cfg.target_sms}: {problem}"
    return None


def parse_devices(spec: str) -> list[torch.device]:
    """``--devices`` as torch devices (``auto``: every visible GPU, else the CPU)."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda":
        return [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    return [torch.device(d) for d in config.device_list(spec)]


def _call_compat(method: Callable[..., Any]) -> None:
    """``GreenContext.set_context``/``pop_context``: without arguments, or, in releases where their "order the
    streams" flag has no default, with it set (what the others default to)."""
    try:
        method()
    except TypeError:
        method(True)


def partition_stream(device: torch.device, num_sms: int, priority: int) -> torch.cuda.Stream:
    """A new stream of ``device`` whose kernels (CUDA graphs replayed on it included) run on the same ``num_sms``
    SMs, however many such streams there are: a CUDA green context (driver-side SM partition; the driver may round
    the count up to its granularity). torch's ``GreenContext.Stream()`` takes no priority, so the stream is
    created with the driver call while the green context is current."""
    import ctypes

    from torch.cuda import green_contexts

    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, num_sms)
    if key not in _green:
        _green[key] = green_contexts.GreenContext.create(num_sms=num_sms, device_id=index)
    ctx = _green[key]
    libcuda = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_void_p()
    with torch.cuda.device(index):
        _call_compat(ctx.set_context)
        try:
            # flags 1 = CU_STREAM_NON_BLOCKING, as torch's own streams (no implicit sync with the legacy stream)
            rc = libcuda.cuStreamCreateWithPriority(ctypes.byref(handle), ctypes.c_uint(1), ctypes.c_int(priority))
        finally:
            _call_compat(ctx.pop_context)
    if rc != 0:
        raise RuntimeError(f"cuStreamCreateWithPriority in a green context of {num_sms} SMs failed (CUresult {rc})")
    return torch.cuda.ExternalStream(handle.value, device=torch.device("cuda", index))


class Lane:
    """A worker thread's device and stream; ``high_priority``: the stream gets a higher scheduling priority than
    the default (the CUDA scheduler starts blocks of higher-priority streams first when SMs free up; a CUDA graph
    replayed on the stream runs at its priority). ``num_sms``: the stream's kernels run on a fixed set of that
    many SMs (``partition_stream``), shared by every lane given the same count on the device."""

    def __init__(self, device: torch.device, streams: bool, high_priority: bool = False,
                 num_sms: int | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = None
        if self.cuda and streams:
            # Lower is higher; torch maps a value past the device's range to its nearest valid priority.
            priority = -1 if high_priority else 0
            if num_sms:
                self.stream = partition_stream(device, num_sms, priority)
            else:
                self.stream = torch.cuda.Stream(device=device, priority=priority)
        self._helpers: dict[int, torch.cuda.Stream] = {}
        # (event, tensors): tensors used by a stream of this lane, kept alive until the event (recorded after their
        # last use was issued) has completed. Events complete in stream order, so the oldest is checked first.
        self._held: deque[tuple[torch.cuda.Event, Sequence[torch.Tensor]]] = deque()

    def context(self) -> contextlib.AbstractContextManager[Any]:
        """Enter once at the top of the thread: makes the lane's device and stream current for it."""
        ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if self.stream is not None:
            ctx = torch.cuda.stream(self.stream)
        elif self.cuda:
            ctx = torch.cuda.device(self.device)
        return ctx

    def record(self) -> Event:
        if self.stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def wait(self, ev: Event) -> None:
        if ev is not None and self.stream is not None:
            self.stream.wait_event(ev)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _helper(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._helpers:
            self._helpers[index] = torch.cuda.Stream(device=device)
        return self._helpers[index]

    def fetch(self, tensors: Sequence[torch.Tensor], ev: Event) -> list[torch.Tensor]:
        """Tensors produced on another lane (complete at ``ev``), made safe to use on this lane. The caller passes
        them to ``release`` once it has issued its last use of them."""
        if self.stream is None:
            return [t.to(self.device, non_blocking=True) for t in tensors]  # default streams: ordered already
        out: list[torch.Tensor] = []
        waited = False
        for t in tensors:
            if t.device == self.device:
                if not waited:
                    self.wait(ev)
                    waited = True
                out.append(t)
            else:
                # Across GPUs torch copies on the *source* GPU's current stream, which for this thread is not the
                # producer's: a helper stream of the source GPU waits for the producer and runs the copy (torch
                # orders it with this lane's stream); the source stays referenced until the copy is done.
                helper = self._helper(t.device)
                if ev is not None:
                    helper.wait_event(ev)
                with torch.cuda.stream(helper):
                    out.append(t.to(self.device, non_blocking=True))
                self._hold([t], helper)
        return out

    def release(self, tensors: Sequence[torch.Tensor]) -> None:
        """This thread has issued its last use of ``tensors`` (from ``fetch``): keep them referenced until this
        lane's stream has run that work, so that their memory cannot be reused by their producer's stream before
        (see the module docstring for why not ``record_stream``). Also drops what earlier calls held and the
        stream has finished with; nothing here waits."""
        if self.stream is not None:
            self._hold(tensors, self.stream)

    def _hold(self, tensors: Sequence[torch.Tensor], stream: torch.cuda.Stream) -> None:
        ev = torch.cuda.Event()
        ev.record(stream)
        self._held.append((ev, list(tensors)))
        while self._held and self._held[0][0].query():
            self._held.popleft()

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor, ev: Event) -> None:
        """``dst`` (on this lane) <- ``src`` (produced on another lane, complete at ``ev``)."""
        if self.stream is None:
            dst.copy_(src, non_blocking=True)
        elif src.device == dst.device:
            self.wait(ev)
            dst.copy_(src, non_blocking=True)
        else:
            helper = self._helper(src.device)
            if ev is not None:
                helper.wait_event(ev)
            with torch.cuda.stream(helper):
                dst.copy_(src, non_blocking=True)


class Reducer:
    """Average a flat tensor (gradients + statistics) over the drafter threads of this process, then over processes.

    Each thread passes its persistent buffer; after a barrier the leader (index 0) sums them in thread order
    (deterministic) into a persistent buffer, divides by ``divisor`` (the batches that went into the sums),
    all-reduces across ranks and post-processes (gradient clipping); after a second barrier every thread copies
    the result into its own buffer, in place. One thread and one process: no barrier, no copy.

    ``graph=True`` (``--step-graphs``, one process, every buffer on the leader's device and a stream): the leader's
    part (sum, average, clipping, its own copy of the result) is one ``graphs.StepGraph``, which reads the same
    persistent buffers at every replay; only the waits for the other threads' events stay outside it.
    """

    def __init__(self, n: int, divisor: int, world: int, post: Callable[[torch.Tensor], None],
                 graph: bool = False) -> None:
        self.n, self.divisor, self.world, self.post = n, divisor, world, post
        self.barrier = threading.Barrier(n) if n > 1 else None
        self.slots: list[tuple[torch.Tensor, Event] | None] = [None] * n
        self.total: torch.Tensor | None = None
        self.done: Event = None
        self.use_graph = graph and world == 1
        self.graph: graphs.StepGraph | None = None

    def _finish(self, total: torch.Tensor) -> None:
        if self.divisor != 1:
            total.div_(self.divisor)
        if self.world > 1:
            import torch.distributed as dist

            if dist.get_backend() == "gloo" and total.device.type != "cpu":
                buf = total.cpu()
                dist.all_reduce(buf)
                total.copy_(buf)
            else:
                dist.all_reduce(total)
            total.div_(self.world)
        self.post(total)

    def _parked(self) -> list[tuple[torch.Tensor, Event]]:
        """Every thread's (buffer, event), in thread order (all parked once the first barrier has passed)."""
        return [slot for slot in self.slots if slot is not None]

    def _sum_local(self) -> None:
        """Leader, every buffer on its device (events already waited for): total = average, clipped; the leader's
        own buffer = total."""
        total, bufs = self.total, [t for t, _ in self._parked()]
        assert total is not None
        total.copy_(bufs[0])
        for t in bufs[1:]:
            total.add_(t)
        self._finish(total)
        bufs[0].copy_(total)

    def _make_graph(self, fn: Callable[[], None], lane: Lane) -> None:
        """With graphs on: ``fn`` (which reads only persistent buffers) becomes this reducer's StepGraph on the
        lane's stream (captured after its eager warm-up calls)."""
        if self.use_graph and lane.stream is not None:
            self.graph = graphs.StepGraph(fn, lane.stream)

    def _leader(self, lane: Lane) -> None:
        parked = self._parked()
        if self.total is None:
            self.total = torch.empty_like(parked[0][0])
            if all(t.device == self.total.device for t, _ in parked):
                self._make_graph(self._sum_local, lane)
        # Every other thread's event first, before ``total`` is written: each was recorded after that thread's
        # copy of the previous step's result out of ``total`` (``copy_into``), which its stream may not have run
        # yet. (Waiting only before each ``add_`` let the leader's first write overwrite a result that a lagging
        # stream had still to read.)
        for _, ev in parked[1:]:
            lane.wait(ev)
        if self.graph is not None:
            self.graph()
            return
        self.total.copy_(parked[0][0])
        for t, ev in parked[1:]:
            self.total.add_(t if t.device == self.total.device else lane.fetch([t], ev)[0])
        self._finish(self.total)

    def __call__(self, idx: int, flat: torch.Tensor, lane: Lane) -> None:
        if self.barrier is None:
            if self.graph is None and self.use_graph:  # one buffer, the same at every call
                self._make_graph(functools.partial(self._finish, flat), lane)
            if self.graph is not None:
                self.graph()
            else:
                self._finish(flat)
            return
        self.slots[idx] = (flat, lane.record())
        self.barrier.wait()
        if idx == 0:
            self._leader(lane)
            self.done = lane.record()
        self.barrier.wait()
        if idx != 0 or self.graph is None:  # the leader's graph copied the result already
            assert self.total is not None
            lane.copy_into(flat, self.total, self.done)

    def abort(self) -> None:
        if self.barrier is not None:
            self.barrier.abort()


class StatsLog:
    """Per-step statistics leave the GPU without stalling it: each step's small vector is copied into pinned host
    memory asynchronously, with an event; ``drain`` hands out (step, values, extra) of the steps whose copy has
    finished, in order (``wait=True``: all of them, synchronising once)."""

    def __init__(self, lane: Lane, pin: bool) -> None:
        self.lane, self.pin = lane, pin and lane.cuda
        self.pending: deque[tuple[int, torch.Tensor, Any, dict[str, Any]]] = deque()

    def push(self, step: int, values: torch.Tensor, extra: dict[str, Any]) -> None:
        if not self.lane.cuda:
            self.pending.append((step, values.detach().clone(), None, extra))
            return
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=self.pin)
        host.copy_(values.detach(), non_blocking=self.pin)
        ev = torch.cuda.Event()
        ev.record()
        self.pending.append((step, host, ev, extra))

    def drain(self, wait: bool = False) -> list[tuple[int, list[float], dict[str, Any]]]:
        out = []
        while self.pending:
            step, host, ev, extra = self.pending[0]
            if ev is not None and not ev.query():
                if not wait:
                    break
                ev.synchronize()
            self.pending.popleft()
            out.append((step, host.tolist(), extra))
        return out


class PhaseTimer:
    """GPU time of target forwards and drafter steps, from CUDA events around them on the thread's stream (read
    once at the end, so no synchronisation in the loop), at every ``every``-th step (a sample: two events per
    interval are interpreter time that every thread pays under one GIL). With concurrent streams an interval also
    contains other threads' kernels that ran meanwhile: exact for the sequential layout, an upper bound otherwise."""

    def __init__(self, enabled: bool, every: int) -> None:
        self.enabled, self.every = enabled, max(1, every)
        self.lock = threading.Lock()
        self.events: dict[str, list[tuple[int, Any, Any]]] = {}

    def start(self, step: int) -> Any:
        """An event for an interval of step ``step`` (0-based), or None when that step is not sampled."""
        if not self.enabled or step % self.every:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, kind: str, step: int, start: Any) -> None:
        if start is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        with self.lock:
            self.events.setdefault(kind, []).append((step, start, end))

    def summary(self, after_step: int) -> dict[str, dict[str, float]]:
        """Mean milliseconds per call for calls at steps > ``after_step`` (call after a device synchronize)."""
        out = {}
        with self.lock:
            for kind, evs in self.events.items():
                times = [s.elapsed_time(e) for step, s, e in evs if step > after_step]
                if times:
                    out[kind] = {"calls": len(times), "mean_ms": round(sum(times) / len(times), 3)}
        return out


class Run:
    """State shared by all threads of one process."""

    def __init__(self, cfg: Config, rank: int = 0, world: int = 1) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        self.stop = threading.Event()
        self.errors = metrics.ErrorLog()
        self.throughput = metrics.Throughput()
        self.last_progress = time.monotonic()
        self.steps_done = 0
        self.reducer: Reducer | None = None
        self.gpu_util: Any = None  # metrics.GpuUtil while sampling (closed by the hang report too)

    def call(self, where: str, fn: Callable[[], Any]) -> Any:
        """Run one compiled call under the error policy: 'raise' propagates; 'count' counts the error and retries
        with a growing pause (1 ms .. 100 ms: the usual cause, another thread's compile, takes seconds), giving up
        after ``--retry-timeout`` seconds of consecutive failures."""
        first_failure: float | None = None
        pause = 0.001
        while True:
            if self.stop.is_set():
                raise Stopped
            try:
                return fn()
            except Exception as e:
                now = time.monotonic()
                first_failure = first_failure if first_failure is not None else now
                if self.cfg.error_policy == "raise" or now - first_failure > self.cfg.retry_timeout:
                    raise
                self.errors.count(where, e)
                time.sleep(pause)
                pause = min(0.1, pause * 2)

    def halt(self) -> None:
        self.stop.set()
        if self.reducer is not None:
            self.reducer.abort()

    def put(self, q: queue.Queue, item: Any) -> None:
        while True:
            try:
                return q.put(item, timeout=0.2)
            except queue.Full:
                if self.stop.is_set():
                    raise Stopped from None

    def get(self, q: queue.Queue) -> Any:
        while True:
            try:
                return q.get(timeout=0.2)
            except queue.Empty:
                if self.stop.is_set():
                    raise Stopped from None


def worker(run: Run, name: str, fn: Callable[[], None]) -> threading.Thread:
    """A thread whose first real error stops everyone (the stop event + barrier abort unblock all waits)."""

    def body() -> None:
        try:
            fn()
        except (Stopped, threading.BrokenBarrierError):
            if not run.stop.is_set():
                run.errors.fatal(name, RuntimeError("barrier broken without a stop request"))
                run.halt()
        except BaseException as e:
            run.errors.fatal(name, e)
            run.halt()

    return threading.Thread(target=body, name=name, daemon=True)

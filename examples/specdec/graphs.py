"""``--step-graphs``: whole pieces of a step as CUDA graphs, captured by hand, replayed from any thread.

With ``--target-compile-mode/--drafter-compile-mode reduce-overhead`` torch replays CUDA graphs too, but per compiled
function (the drafter's forward and its backward separately), and every call still runs dynamo's guards,
AOTAutograd's runtime wrappers, cudagraph-tree bookkeeping, the autograd engine (backward on its device thread),
the BlockMask builder and the optimizer's Python: milliseconds of interpreter time per batch, under one GIL for
every thread. Here each piece is one graph:

* target: BlockMask + forward, under ``no_grad``;
* drafter: its BlockMask, the forward of the k TTT steps, ``backward`` (gradients accumulate into the replica's
  flat buffer) and the step's statistics;
* update: the optimizer step (fused AdamW with ``capturable=True`` and a tensor learning rate);
* gradient average (``runtime.Reducer``, one process): the leader's sum of every replica's buffer, the division,
  the clipping and its own copy of the result.

A ``StepGraph`` runs its function eagerly for its first ``warmup`` calls (those are real steps: compilation,
autotuning, lazily built optimizer state and cuBLAS workspaces happen there), captures it on the next call and
replays it from then on: new inputs are copied into the static ones (one ``_foreach_copy_``), and the outputs are
always the same tensors, overwritten by the next replay (callers that keep them across calls copy them). Compiled
code inside runs in the default mode; the graph is ours.

Captures happen one at a time in the process (``CAPTURE_LOCK``), on the thread's own stream, with
``capture_error_mode="thread_local"``: other threads keep issuing work (and allocating) on their streams while one
thread captures, which the default ("global") mode forbids. What no mode allows is a device-wide synchronisation
while a stream captures, and first calls of compiled code make those (Triton autotuning benchmarks kernels and
synchronises). So a graph is captured only once *every* ``StepGraph`` of the process has made its eager warm-up
calls; until then calls past the warm-up stay eager (never blocking: a thread that waited for another thread's
warm-up could wait for a batch that thread is waiting for). Code that synchronises the device while graphs may be
captured takes ``CAPTURE_LOCK`` (``synchronize``).
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Iterable, Sequence

import torch

CAPTURE_LOCK = threading.Lock()
_ALL: weakref.WeakSet[StepGraph] = weakref.WeakSet()
_ALL_LOCK = threading.Lock()


def all_warm() -> bool:
    """Every live StepGraph has made its eager warm-up calls (so no thread compiles or autotunes any more)."""
    with _ALL_LOCK:
        return all(g.calls >= g.warmup for g in _ALL)


def synchronize(devices: Iterable[torch.device]) -> None:
    """``torch.cuda.synchronize`` of each device, never while a graph is being captured."""
    with CAPTURE_LOCK:
        for dev in dict.fromkeys(devices):
            torch.cuda.synchronize(dev)


class StepGraph:
    """``fn(*tensors)`` (``None`` allowed among them) eager ``warmup`` times, then captured and replayed."""

    def __init__(self, fn: Callable[..., Any], stream: torch.cuda.Stream, warmup: int = 2) -> None:
        if stream is None:
            raise ValueError("StepGraph needs a side stream (capture on the default stream is not allowed)")
        self.fn, self.stream, self.warmup = fn, stream, warmup
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: list[torch.Tensor] = []
        self.outputs: Any = None
        with _ALL_LOCK:
            _ALL.add(self)

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self, *inputs: torch.Tensor | None) -> Any:
        self.calls += 1
        if self.graph is None:
            if self.calls <= self.warmup or not all_warm():
                return self.fn(*inputs)
            self._capture(inputs)
        # One call for all input copies (a multi-tensor kernel where torch has it): per-call interpreter time is
        # what threads sharing one GIL run out of.
        if self.static:  # (a graph without inputs, e.g. the optimizer update, has nothing to copy)
            torch._foreach_copy_(self.static, [t for t in inputs if t is not None], non_blocking=True)
        self.graph.replay()  # type: ignore[union-attr]
        return self.outputs

    def _capture(self, inputs: Sequence[torch.Tensor | None]) -> None:
        # Static inputs are allocated outside the graph's pool; the copy into them happens before each replay.
        # ``None`` inputs stay None in every call (the function's signature decides), so only tensors are kept.
        self.static = [torch.empty_like(t) for t in inputs if t is not None]
        args = iter(self.static)
        static_args = [None if t is None else next(args) for t in inputs]
        graph = torch.cuda.CUDAGraph()
        with CAPTURE_LOCK:
            # torch.cuda.graph synchronises the device first, so everything issued so far (on every stream) is
            # done; the capture itself only records work, it does not run it.
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                self.outputs = self.fn(*static_args)
        self.graph = graph

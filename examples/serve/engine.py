"""One compiled model shared by the server's request threads, with the numbers that tell the set-ups apart.

* ``CountingBackend`` is the ``torch.compile`` backend: inductor (or any registered backend), plus a count of the
  graphs it compiled, each graph's input signature (shapes with dynamo's size symbols, dtypes, devices), and,
  per thread, how many calls ran a compiled graph. Two compiles with one signature are the same graph compiled
  twice: what threads racing into one cache miss do without torch-threadsafe-compile. A call that ran no compiled
  graph ran the model's Python code eagerly: what dynamo does once the recompile limit is reached.
* ``Engine`` checks a request's inputs, calls the compiled model (behind one global lock when asked: what
  programs do today to make ``torch.compile`` safe from threads), and keeps the counters ``/v1/stats`` shows.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import resource
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import fx

from . import models

DTYPE = "float32"


class BadInput(ValueError):
    """A request the server cannot serve; ``status`` is the HTTP status to answer with (4xx)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Limits:
    max_batch: int = 32
    max_seq: int = 64


def to_tensor(inputs: Sequence[Any], dtype: str, limits: Limits) -> torch.Tensor:
    """The request's ``inputs`` as a ``(batch, seq, FEATURES)`` float32 tensor, or ``BadInput`` saying what is wrong.

    JSON has one kind of number: ``dtype`` states what the client meant, and only the model's own dtype is served
    (a float64 model would be a second compiled graph and another set of numerics, not a silent cast).
    """
    if dtype != DTYPE:
        raise BadInput(422, f"dtype {dtype!r} is not served: the model computes in {DTYPE} (send {DTYPE}, or leave dtype out)")
    if len(inputs) == 0:
        raise BadInput(422, f"inputs is empty: send 1 to {limits.max_batch} items of shape [seq, {models.FEATURES}]")
    if len(inputs) > limits.max_batch:
        raise BadInput(413, f"a batch of {len(inputs)} items is more than this server takes (--max-batch {limits.max_batch})")
    try:
        x = torch.tensor(inputs, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as e:
        raise BadInput(422, f"inputs is not a rectangular array of numbers: {e}") from None
    if x.dim() != 3 or x.shape[1] == 0 or x.shape[2] != models.FEATURES:
        raise BadInput(422, f"inputs has shape {list(x.shape)}; expected [batch, seq, {models.FEATURES}]")
    if x.shape[1] > limits.max_seq:
        raise BadInput(413, f"a sequence of {x.shape[1]} is longer than this server takes (--max-seq {limits.max_seq})")
    if not bool(torch.isfinite(x).all()):
        raise BadInput(422, "inputs holds NaN or infinity")
    return x


def graph_signature(gm: fx.GraphModule) -> str:
    """The shapes (with dynamo's size symbols), dtypes and devices of a graph's inputs: equal for two compiles of
    one guard set; a static and a dynamic compile of the same sizes differ (``(8, 8, 16)`` vs ``(s27, 8, 16)``)."""
    parts = []
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            parts.append(f"{tuple(value.shape)}:{str(value.dtype).removeprefix('torch.')}:{value.device}")
        else:
            parts.append(repr(value))
    return " | ".join(parts)


class CountingBackend:
    """A ``torch.compile`` backend that compiles with ``inner`` and counts (see the module's docstring)."""

    def __init__(self, inner: str = "inductor", mode: str | None = None) -> None:
        self.inner = inner
        self.mode = mode
        self.__name__ = f"counting_{inner}"  # dynamo names a backend by its __name__ in logs
        self._lock = threading.Lock()
        self._signatures: collections.Counter[str] = collections.Counter()
        self._local = threading.local()

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        signature = graph_signature(gm)
        compiled = self._compile(gm, example_inputs)
        with self._lock:
            self._signatures[signature] += 1
        local = self._local

        def run(*args: Any) -> Any:
            local.calls = getattr(local, "calls", 0) + 1
            return compiled(*args)

        # Dynamo calls a "boxed" graph with one list of arguments; ``run`` passes it on as it came.
        run._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
        return run

    def _compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if self.inner == "inductor":
            # What torch.compile(backend="inductor", mode=...) does: the mode is a set of inductor config patches.
            from torch._inductor import list_mode_options
            from torch._inductor.compile_fx import compile_fx

            patches = list_mode_options(self.mode) if self.mode else None
            return compile_fx(gm, list(example_inputs), config_patches=patches)  # type: ignore[no-any-return]
        if self.mode:
            raise ValueError(f"mode={self.mode!r} needs the inductor backend, not {self.inner!r}")
        from torch._dynamo import lookup_backend

        return lookup_backend(self.inner)(gm, example_inputs)  # type: ignore[no-any-return]

    def calls_in_this_thread(self) -> int:
        return int(getattr(self._local, "calls", 0))

    def counts(self) -> dict[str, int]:
        with self._lock:
            compiles = sum(self._signatures.values())
            distinct = len(self._signatures)
        return {"compiles": compiles, "distinct_graphs": distinct, "duplicate_compiles": compiles - distinct}

    def signatures(self) -> dict[str, int]:
        with self._lock:
            return dict(self._signatures)


def ttc_state() -> dict[str, Any]:
    """Whether torch-threadsafe-compile protects this process, as its own ``status()`` reports it."""
    try:
        import torch_threadsafe_compile as ttc
    except ImportError:
        return {"installed": False, "active": False, "activation": None, "reason": "not installed"}
    st = ttc.status()
    first_compile = next((p["state"] for p in st["patches"] if p["id"] == "first_compile"), None)
    return {"installed": True, "active": st["activation"] not in ("disabled", "not activated"),
            "activation": st["activation"], "reason": st["inactive_reason"], "version": st["version"],
            "first_compile": first_compile}


def peak_rss_mib() -> float:
    """This process's peak resident set size (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1024 * 1024 if sys.platform == "darwin" else 1024), 1)


@dataclass(frozen=True)
class Prediction:
    outputs: torch.Tensor  # on the CPU, float32
    compiled: bool  # whether a compiled graph ran (False: the model ran eagerly)


class Engine:
    """The compiled model, its optional global lock, and the request counters."""

    def __init__(self, model: str = "mlp", *, device: str = "cpu", backend: str = "inductor", mode: str | None = None,
                 lock: bool = False, limits: Limits = Limits(), seed: int = 0) -> None:
        self.name, self.device, self.seed, self.limits = model, device, seed, limits
        self.model = models.build(model, seed, device)
        # CUDA graphs are what makes a small model fast on a GPU; reduce-overhead records and replays them.
        self.mode = mode if mode is not None else ("reduce-overhead" if device.startswith("cuda") else None)
        self.backend = CountingBackend(backend, self.mode)
        self.compiled = torch.compile(self.model, backend=self.backend)
        self.lock = threading.Lock() if lock else None
        self._counter_lock = threading.Lock()
        self.calls = self.failed = self.uncompiled = 0

    def predict(self, x: torch.Tensor) -> Prediction:
        before = self.backend.calls_in_this_thread()
        try:
            with self.lock if self.lock is not None else contextlib.nullcontext(), torch.no_grad():
                if self.mode == "reduce-overhead":
                    torch.compiler.cudagraph_mark_step_begin()  # each request is a new step of the graph tree
                # Copied out before this thread's next replay can overwrite a CUDA graph's output buffer.
                out = self.compiled(x.to(self.device)).float().cpu()
        except Exception:
            with self._counter_lock:
                self.calls += 1
                self.failed += 1
            raise
        compiled = self.backend.calls_in_this_thread() > before
        with self._counter_lock:
            self.calls += 1
            self.uncompiled += not compiled
        return Prediction(out, compiled)

    def stats(self) -> dict[str, Any]:
        from torch._dynamo.utils import counters

        with self._counter_lock:
            calls, failed, uncompiled = self.calls, self.failed, self.uncompiled
        return {"pid": os.getpid(), "model": self.name, "seed": self.seed, "device": self.device,
                "backend": self.backend.inner, "mode": self.mode, "lock": self.lock is not None,
                "limits": dataclasses.asdict(self.limits),
                "torch": torch.__version__, "ttc": ttc_state(),
                "model_calls": calls, "failed_calls": failed, "uncompiled_calls": uncompiled,
                **self.backend.counts(),
                "dynamo_unique_graphs": int(counters["stats"]["unique_graphs"]),
                "graph_signatures": self.backend.signatures(),
                "peak_rss_mib": peak_rss_mib()}

"""H7 — random numbers drawn in other threads while one thread records a CUDA graph.

Two process-wide effects of a CUDA graph recording break, or silently repeat, other threads' random
numbers. Both were found for ``torch.compile(mode="reduce-overhead")`` from a thread pool (pytorch#123177's
layout with fresh ``torch.rand(..., device="cuda")`` inputs); the first applies to every CUDA graph capture.

* **Capture mode of the default generator (torch 2.4-2.11).** ``CUDAGraph::capture_begin`` registers the
  *current state* of the capturing device's default CUDA generator with the graph and calls its
  ``capture_prologue``, which sets the state's ``capturing_`` flag until ``capture_end``. The state is one
  object per device, shared by every thread; ``CUDAGeneratorState::increase`` refuses an increment from a
  thread whose current stream is not capturing while the flag is set (``Offset increment outside graph
  capture encountered unexpectedly.``). So any CUDA random draw in another thread during a capture fails.
  From 2.12 (pytorch#176752) the generator keeps one capture state per capture id and the base state has no
  such flag. What the patch does, for every ``torch.cuda.CUDAGraph`` capture begun while the program has
  started threads of its own:

  - *a private generator state per graph*: before ``capture_begin``, the default generator is pointed at a
    fresh state (``Generator.graphsafe_set_state``; a new ``torch.Generator`` on that device, seeded from
    the default generator's seed and a process-wide capture counter, so its stream is not the default
    one's), ``capture_begin`` registers that state, and the default generator is pointed back at its own
    state at once. Other threads keep drawing from the default state, which is never in capture mode;
  - *the capturing thread draws from the graph's state*: until ``capture_end`` a dispatch mode in the
    capturing thread (modes are per thread) passes the private generator to every random ATen op on that
    device called without one (``randint.low_out``, inductor's seeds, becomes ``randint.low_generator_out``,
    and so on, matched by schema). Every replay advances the private state by what the graph drew, so each
    replay draws new numbers, and never numbers of the default stream;
  - *a graph that draws where no generator can be passed* (``native_dropout``, attention kernels with
    dropout, custom C++ ops: they take the default generator inside) hits the default state out of capture
    mode; upstream's ``Attempt to increase offset for a CUDA generator not in capture mode`` is re-raised
    as :class:`CUDAGraphRandomDrawError`, which names the rule. Never silent.

  Limit: between ``capture_begin`` registering the private state and the switch back (the rest of
  ``capture_begin``, and re-acquiring the GIL it releases), another thread's draw uses the private state:
  before its prologue it draws the private stream's numbers (unique, and the graph's replays start after
  them), after it the draw fails with upstream's error. Public APIs offer nothing narrower.

* **Rolled-back generators (all versions with CUDA graph trees).** Inductor records a tree node under
  ``preserve_rng_state()`` (``CUDAGraphNode._record``): it saves the CPU and CUDA default generators' states
  before the recording and *sets them back* afterwards, for the whole process. Every number another thread
  drew meanwhile is drawn again later: silent repeats (CPU inputs drawn in a thread pool are repeated as
  well). The recording itself advances neither (CUDA draws during a capture only move the capture's own
  offset; a graph with CPU work is not recorded), so while the program has started threads the patch
  records without the save and restore; a single-threaded program keeps upstream's.

"The program has started threads": a live ``threading`` thread other than the main thread (torch's own
autograd and device threads are not ``threading`` threads). A single-threaded program therefore keeps
upstream's behaviour exactly (graphs draw from the default stream, bitwise like eager). Revert restores
every patched object; graphs captured meanwhile keep their private states.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from torch_threadsafe_compile._journal import Changes
from torch_threadsafe_compile._torch import program_threads_started as threads_started
from torch_threadsafe_compile.registry import SPECS

log = logging.getLogger("torch_threadsafe_compile")

SPEC = SPECS["cudagraph_rng"]

CGT = SPEC.modules[0]
PRIVATE_STATE_BEFORE = (2, 12)  # from 2.12 a generator keeps one capture state per capture id
_NOT_IN_CAPTURE = "not in capture mode"  # upstream's refusal when a capture draws from a state not registered
_SEED_MASK = (1 << 63) - 1

RULE = (
    "While other threads run, a CUDA graph captured by torch_threadsafe_compile draws random numbers from a "
    "generator state of its own (H7, patch cudagraph_rng): only ops that take a generator argument can be "
    "given it. {op} draws from the default CUDA generator internally, which on this torch (< 2.12) is not in "
    "capture mode for this capture. Move the op out of the captured region, set its dropout to 0, give it an "
    "explicit generator registered with the graph, or capture while no other thread runs."
)


class CUDAGraphRandomDrawError(RuntimeError):
    """A CUDA graph captured with a private generator state drew from the default generator (see RULE)."""


def generator_variant(func: Any) -> Any:
    """The overload of ``func``'s ATen op that takes ``generator`` with otherwise the same arguments:
    ``func`` itself when it has one, a sibling (``rand.default`` -> ``rand.generator``, ``randint.low_out``
    -> ``randint.low_generator_out``), or None (not a random op, or one that cannot be given a generator)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return None
    names = [a.name for a in schema.arguments]
    if "generator" in names:
        return func
    packet = getattr(func, "overloadpacket", None)
    if packet is None:
        return None
    for overload in packet.overloads():
        other = getattr(packet, overload)
        other_names = [a.name for a in other._schema.arguments]
        if "generator" in other_names and [n for n in other_names if n != "generator"] == names:
            return other
    return None


def _op_device(torch: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The device an op runs on: its ``device`` argument (a factory) or its first tensor argument."""
    dev = kwargs.get("device")
    if dev is not None:
        return torch.device(dev)
    for a in itertools.chain(args, kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return None


def make_redirect_mode(torch: Any) -> type:
    """The dispatch mode class (built lazily: importing ``torch.utils._python_dispatch`` is not free)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class RedirectRandom(TorchDispatchMode):  # type: ignore[misc, valid-type]
        """In the capturing thread only: random ops on ``device`` without a generator get ``generator``."""

        # Higher-order operators (graphsafe_run_with_rng_state, ...) pass through: they have no schema, run
        # with this mode popped, and take the generator state they use explicitly. Without this flag a HOP
        # raised NotImplementedError under the mode (measured: test_cudagraph_trees.py's TestSAC on 2.11).
        supports_higher_order_operators = True

        def __init__(self, generator: Any, device: Any, stats: dict[str, int]) -> None:
            super().__init__()
            self.generator = generator
            self.device = torch.device(device)
            self.stats = stats
            self.redirected = 0
            self._variants: dict[Any, Any] = {}

        def _on_device(self, dev: Any) -> bool:
            if dev is None or dev.type != self.device.type:
                return False
            index = dev.index if dev.index is not None else (
                torch.cuda.current_device() if dev.type == "cuda" else None)
            return self.device.index is None or index == self.device.index

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            kwargs = dict(kwargs or {})
            if func not in self._variants:
                self._variants[func] = generator_variant(func)
            variant = self._variants[func]
            if variant is not None and kwargs.get("generator") is None and self._on_device(_op_device(torch, args, kwargs)):
                kwargs["generator"] = self.generator
                func = variant
                self.redirected += 1
                self.stats["redirected_ops"] += 1
            try:
                return func(*args, **kwargs)
            except RuntimeError as e:
                if _NOT_IN_CAPTURE in str(e) and not isinstance(e, CUDAGraphRandomDrawError):
                    self.stats["refused_draws"] += 1
                    raise CUDAGraphRandomDrawError(RULE.format(op=str(func))) from e
                raise

    return RedirectRandom


class _Capture:
    __slots__ = ("graph_id", "mode", "generator")

    def __init__(self, graph_id: int, mode: Any, generator: Any) -> None:
        self.graph_id = graph_id
        self.mode = mode
        self.generator = generator


class _Runtime:
    """What one application shares. The torch calls it makes are attributes, so that tests can give fakes."""

    def __init__(self, torch: Any, private_states: bool) -> None:
        self.torch = torch
        self.private_states = private_states
        self.local = threading.local()  # .captures: this thread's captures in progress (a stack)
        self.swap_lock = threading.Lock()  # one switch of a default generator at a time
        self.counter = itertools.count(1)
        self.stats = {"private_captures": 0, "captures_that_drew": 0, "redirected_ops": 0, "refused_draws": 0,
                      "upstream_captures": 0, "recordings_without_restore": 0, "recordings_with_restore": 0,
                      "switch_errors": 0, "window_us_total": 0.0, "window_us_max": 0.0}
        # A GIL switch interval (s) set while ``capture_begin`` runs, so that the capturing thread takes the
        # GIL back sooner after it (the window ends when it has): None keeps the program's. Measured on the
        # GPU with ``bench/cudagraph_rng.py --only window`` (docs/results).
        self.begin_switch_interval: float | None = None
        self.threads_started: Callable[[], bool] = threads_started
        self.current_device: Callable[[], int] = lambda: torch.cuda.current_device()
        self.default_generator: Callable[[int], Any] = lambda i: torch.cuda.default_generators[i]
        self.new_generator: Callable[[int], Any] = lambda i: torch.Generator(device=f"cuda:{i}")
        self.mode_class: Any = None

    def _captures(self) -> list[_Capture]:
        stack = getattr(self.local, "captures", None)
        if stack is None:
            stack = self.local.captures = []
        return stack

    def private_seed(self, default: Any) -> int:
        """A seed of the default generator's seed and a process-wide capture number (so not its stream)."""
        n = next(self.counter)
        return (int(default.initial_seed()) * 0x9E3779B97F4A7C15 + n * 0xBF58476D1CE4E5B9 + 1) & _SEED_MASK

    def begin(self, graph: Any, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.private_states or not self.threads_started():
            self.stats["upstream_captures"] += 1
            return original(graph, *args, **kwargs)
        index = self.current_device()
        default = self.default_generator(index)
        private = self.new_generator(index)
        private.manual_seed(self.private_seed(default))
        live = default.graphsafe_get_state()  # a generator object sharing the default's state
        interval = self.begin_switch_interval
        with self.swap_lock:
            saved = sys.getswitchinterval() if interval else None
            t0 = time.perf_counter()
            default.graphsafe_set_state(private)
            try:
                if saved is not None and interval is not None:
                    sys.setswitchinterval(interval)
                result = original(graph, *args, **kwargs)  # registers `private`'s state, not the live one
            finally:
                try:
                    default.graphsafe_set_state(live)
                except Exception:
                    self.stats["switch_errors"] += 1
                    raise
                finally:
                    window = (time.perf_counter() - t0) * 1e6  # the default generator pointed at `private`
                    if saved is not None:
                        sys.setswitchinterval(saved)
                    self.stats["window_us_total"] += window
                    self.stats["window_us_max"] = max(self.stats["window_us_max"], window)
        if self.mode_class is None:
            self.mode_class = make_redirect_mode(self.torch)
        mode = self.mode_class(private, f"cuda:{index}", self.stats)
        mode.__enter__()
        self._captures().append(_Capture(id(graph), mode, private))
        self.stats["private_captures"] += 1
        return result

    def end(self, graph: Any, original: Callable[..., Any]) -> Any:
        stack = self._captures()
        mine = stack[-1] if stack and stack[-1].graph_id == id(graph) else None
        try:
            return original(graph)
        finally:
            if mine is not None:
                stack.pop()
                try:
                    mine.mode.__exit__(None, None, None)
                except Exception as e:  # a mode pushed after ours and never popped: report, keep going
                    log.warning("cudagraph_rng: leaving the capture's random-op mode failed: %s", e)
                if mine.mode.redirected:
                    self.stats["captures_that_drew"] += 1

    @contextmanager
    def preserve_rng_state(self, original: Callable[[], Any]) -> Iterator[None]:
        """Upstream's save-and-restore of the default generators, unless the program has started threads."""
        if self.threads_started():
            self.stats["recordings_without_restore"] += 1
            yield
            return
        self.stats["recordings_with_restore"] += 1
        with original():
            yield


_RUNTIME: _Runtime | None = None


def _modules() -> tuple[Any, Any]:
    return sys.modules["torch"], sys.modules[CGT]


def _private_states_needed(torch: Any) -> bool:
    from torch_threadsafe_compile import _version_ranges

    v = _version_ranges.torch_version()  # a tuple on the fast path, a packaging Version otherwise
    if v is None:
        return False
    release = v if isinstance(v, tuple) else v.release
    return tuple(release[:2]) < PRIVATE_STATE_BEFORE


def check() -> str | None:
    torch, cgt = _modules()
    if not callable(getattr(cgt, "preserve_rng_state", None)):
        return f"{CGT}.preserve_rng_state not found"
    record = getattr(getattr(cgt, "CUDAGraphNode", None), "_record", None)
    if record is None or "preserve_rng_state" not in getattr(record.__code__, "co_names", ()):
        return "CUDAGraphNode._record does not use preserve_rng_state"
    if _private_states_needed(torch):
        graph_cls = getattr(getattr(torch.cuda, "graphs", None), "CUDAGraph", None)
        for name in ("capture_begin", "capture_end"):
            if not callable(getattr(graph_cls, "__dict__", {}).get(name)):
                return f"torch.cuda.graphs.CUDAGraph.{name} is not a Python method"
        for name in ("graphsafe_get_state", "graphsafe_set_state", "initial_seed", "manual_seed"):
            if not callable(getattr(torch.Generator, name, None)):
                return f"torch.Generator.{name} not found"
        try:
            from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401
        except ImportError:
            return "torch.utils._python_dispatch.TorchDispatchMode not found"
        if generator_variant(torch.ops.aten.randint.low_out) is not torch.ops.aten.randint.low_generator_out:
            return "aten.randint.low_out (inductor's seeds) has no generator overload"
    return None


def apply(changes: Changes) -> dict[str, Any]:
    global _RUNTIME
    torch, cgt = _modules()
    rt = _Runtime(torch, private_states=_private_states_needed(torch))
    original_preserve = cgt.preserve_rng_state

    def preserve_rng_state() -> Any:
        return rt.preserve_rng_state(original_preserve)

    preserve_rng_state.__wrapped__ = original_preserve  # type: ignore[attr-defined]
    preserve_rng_state.__doc__ = original_preserve.__doc__
    changes.setattr(cgt, "preserve_rng_state", preserve_rng_state)
    if rt.private_states:
        graph_cls = torch.cuda.graphs.CUDAGraph
        original_begin = graph_cls.__dict__["capture_begin"]
        original_end = graph_cls.__dict__["capture_end"]

        def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
            return rt.begin(self, original_begin, args, kwargs)

        def capture_end(self: Any) -> Any:
            return rt.end(self, original_end)

        for new, old in ((capture_begin, original_begin), (capture_end, original_end)):
            new.__wrapped__ = old  # type: ignore[attr-defined]
            new.__doc__ = old.__doc__
            new.__name__ = new.__qualname__ = old.__name__
            changes.setattr(graph_cls, old.__name__, new)
    _RUNTIME = rt

    def forget() -> None:
        global _RUNTIME
        if _RUNTIME is rt:
            _RUNTIME = None

    changes.on_revert(forget)
    return {"private_states": rt.private_states}


def verify() -> None:
    rt = _RUNTIME
    if rt is None:
        raise AssertionError("not applied")
    torch, cgt = _modules()
    if getattr(cgt.preserve_rng_state, "__wrapped__", None) is None:
        raise AssertionError("cudagraph_trees.preserve_rng_state is not the patch's")
    if rt.private_states:
        for name in ("capture_begin", "capture_end"):
            if getattr(torch.cuda.graphs.CUDAGraph.__dict__[name], "__wrapped__", None) is None:
                raise AssertionError(f"CUDAGraph.{name} is not the patch's")


def report() -> dict[str, Any]:
    if _RUNTIME is None:
        return {}
    return {"private_states": _RUNTIME.private_states, **_RUNTIME.stats}

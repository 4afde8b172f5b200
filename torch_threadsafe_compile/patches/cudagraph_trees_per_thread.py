"""H7 — CUDA graph trees (``torch.compile(mode="reduce-overhead")``) from any thread.

Upstream (torch ≤ 2.12), ``torch/_inductor/cudagraph_trees.py`` keeps its tree-manager containers (one
``TreeManagerContainer`` per device, each owning a ``CUDAGraphTreeManager`` with a private memory pool) in
a ``threading.local`` and in torch's C++ thread-local Python-object stash (``torch._C._stash_obj_in_tls``),
both filled once, at import, in the importing thread. ``get_obj`` reads the ``threading.local`` and falls back
to the stash; the stash is part of ``at::ThreadLocalState``, which every autograd ``GraphTask`` captures
and re-installs around each node it runs on an engine worker thread — that is how a backward running on
the CUDA device thread finds the container of the thread that ran the forward. Any other Python thread has
neither, so every reduce-overhead call from it fails with ``AssertionError`` at
``assert torch._C._is_key_in_tls(attr_name)`` (pytorch/pytorch#123177). Fixed upstream in torch 2.13
(pytorch/pytorch#184357: ``_initialize_tls`` for new threads, per-thread cudagraphified callables,
``graph_capture_lock``); this patch backports that and goes further where threads still share state.

What the patch does (a program whose CUDA graphs all run in the importing thread behaves as upstream: it keeps
upstream's containers, one callable per graph, the same generations; the added locks are uncontended):

* **Containers per thread.** ``get_obj`` keeps upstream's two lookups (``threading.local``, then the C++
  stash) and adds a third: a Python thread that has neither gets its own container dict and lock table,
  set on the ``threading.local`` *and* stashed in its own C++ TLS, so its autograd graph tasks carry them
  to the device threads — a thread's backward replays in that thread's trees. A thread that torch started
  (an autograd worker with no container in its graph task, e.g. a backward started by a thread that never
  ran a CUDA-graph function) gets one shared, process-wide fallback that is never stored on the worker's
  ``threading.local`` (that would shadow the stash of every later graph task on that worker).
* **Callables per owner.** ``cudagraphify_impl`` (what inductor's ``cudagraphify`` wraps once per compiled
  graph, for every thread) now returns a dispatcher that keeps one upstream ``deferred_cudagraphify`` per
  *owner* — the container dict that ``get_obj`` resolves in the calling context, so a backward running on
  an autograd worker is dispatched to the owner thread's callable and tree, not to whichever thread
  happened to run a backward first. Upstream 2.13 keys this by Python thread, which for backward is the
  shared worker thread.
* **One capture at a time.** Tree-manager creation (a synchronize and an empty capture), warm-up runs
  (allocations routed to a private pool) and recordings take one process-wide re-entrant lock, as upstream
  2.13's ``graph_capture_lock`` does; replays do not. ``TreeManagerContainer.get_tree_manager`` takes it
  before the container's own lock so that the lock order is always capture lock → container lock (a
  container lock can be needed by a finalizer that runs during another thread's capture).
* **No device-wide operation during a capture.** ``torch.cuda.synchronize()`` and
  ``torch.cuda.empty_cache()`` called by another thread while a capture runs on the device invalidate it
  (``cudaDeviceSynchronize`` from any thread does, whatever the capture mode), and inductor's autotuning
  benchmarks call ``synchronize`` at a kernel's first run — in a thread that is not using CUDA graphs at
  all (H4's drafters next to reduce-overhead targets). Both wait for the capture lock; the trees' own calls
  re-enter it. The function objects stay (their code is swapped, so dynamo's tables keyed by them hold).
* **Generations per owner.** A tree decides that a new ``torch.compile`` invocation started (and that
  outputs of the previous one may be overwritten) by comparing a process-wide counter that every compiled
  call in *any* thread increments; ``cudagraph_mark_step_begin()`` is process-wide too. Another thread's
  calls would start new generations in the middle of this thread's invocation (between a forward and the
  graph after a graph break) and free outputs it still needs. A thread given containers by the patch counts
  the compiled calls made by its own thread and its own mark-steps. The importing thread keeps upstream's
  counters themselves (``GenerationTracker.generation``, ``MarkStepBox``), less the compiled calls that
  other threads added to the first: what moves that counter directly (``torch._dynamo.run``'s entries,
  ``GenerationTracker.clear()`` in ``torch._dynamo.reset()``, a program or test that sets it) acts exactly
  as upstream, and a single-threaded program reads upstream's values unchanged. Other threads' mark-steps
  stay theirs. The fallback owner keeps upstream's global counter.
* **Memory at thread end.** When a thread that got containers from the patch ends, its tree managers are
  shut down (as ``reset_cudagraph_trees`` does for the calling thread), its tensors from CUDA graphs are
  invalidated (accessing one raises upstream's "overwritten by a subsequent run" error instead of reading
  freed memory) and its callables dropped, so its private pools are released (``torch.cuda.empty_cache()``
  returns them to the device). ``torch._dynamo.reset()`` frees the calling thread's trees, as upstream.
* **Interpreter exit.** A thread's C++ TLS outlives its Python state and is destroyed when the OS thread
  exits; destroying a stash entry takes the GIL, and if the interpreter is finalizing by then the process
  aborts ("terminate called without an active exception"). At thread end the stash entries are set to
  ``None`` (the containers are released under the interpreter), and an ``atexit`` hook waits (at most 2 s,
  Linux: until ``/proc/self/task/<tid>`` is gone) for ended threads to finish exiting. (Up to torch 2.11,
  ``_stash_obj_in_tls`` also steals a reference it was not given; every stash here then gives it one.)

Limits: a thread's CUDA-graph outputs must not be used after the thread ended (clone them first), as they
must not be used after that thread's next call upstream. ``reset_cudagraph_trees`` (``torch._dynamo.reset``)
still switches torch's cached-tensor flag off process-wide. Entries made through ``torch._dynamo.run``
count as new invocations for the importing thread only (they move upstream's counter without a hook):
in the importing thread, as upstream, also when another thread made them. When a graph's backward is not
cudagraph-able, inductor binds it to the compiling thread's tree manager (``maybe_handle_backward_generation``):
that path is not covered. A backward should be started by a thread that has run a CUDA-graph function
(normally the one that ran the forward); otherwise it is recorded in the shared fallback tree. Revert
restores every patched torch object; threads that already got containers keep them (upstream's lookup
finds them on the ``threading.local``), and what happens at their end stays as described above. From torch
2.13 upstream's own fix applies and this patch stays out (docs/hazards.md lists what 2.13 still shares).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import os
import sys
import threading
import time
import weakref
from collections import defaultdict
from typing import Any, Callable

from torch_threadsafe_compile._journal import Changes, run_in_thread
from torch_threadsafe_compile._rewrite import route_through
from torch_threadsafe_compile.registry import SPECS

log = logging.getLogger("torch_threadsafe_compile")

SPEC = SPECS["cudagraph_trees_per_thread"]

CGT = SPEC.modules[0]
EVAL_FRAME = SPEC.modules[1]
CONTAINERS = "tree_manager_containers"
LOCKS = "tree_manager_locks"
_KEYS = (CONTAINERS, LOCKS)
_LOCKED_MANAGER_METHODS = ("__init__", "run_eager", "record_function")
_STATIC_GENERATION_METHODS = ("get_curr_generation", "user_invoked_mark_step")


class _OwnerState:
    """What an owner (one thread's containers) keeps besides the containers themselves."""

    __slots__ = ("deferred", "follows_global", "generation", "mark_step", "mutex", "thread_ident")

    def __init__(self, thread_ident: int | None, follows_global: bool = False) -> None:
        # compiled graph (its dispatcher's key) -> upstream's deferred_cudagraphify for this owner. Weak
        # keys: when a compiled graph is freed (dynamo reset, function gone), its callables, and with them
        # the last references to this owner's tree manager, go too, as upstream's single callable would.
        self.deferred: weakref.WeakKeyDictionary[_GraphKey, Callable[..., Any]] = weakref.WeakKeyDictionary()
        self.generation = 0
        self.mark_step = 0
        self.mutex = threading.Lock()
        self.thread_ident = thread_ident
        self.follows_global = follows_global  # the fallback owner keeps upstream's process-wide counters


class _ThreadContainers(dict):  # type: ignore[type-arg]
    """A thread's ``{device_index: TreeManagerContainer}`` — the dict upstream creates, plus the owner's lock
    table and state (upstream's dict, the importing thread's, stays a plain ``dict``)."""

    __slots__ = ("ttc_locks", "ttc_state")
    ttc_locks: defaultdict[int, Any]
    ttc_state: _OwnerState


class _GraphKey:
    """Identifies one compiled graph's dispatcher in the owners' tables (weakly)."""

    __slots__ = ("__weakref__",)


class _ThreadEnd:
    """Lives in a per-thread slot only: its finalizer runs when the thread's thread-local storage is cleared."""

    __slots__ = ("__weakref__",)


def _new_owner(thread_ident: int | None, follows_global: bool = False) -> _ThreadContainers:
    owner = _ThreadContainers()
    owner.ttc_locks = defaultdict(threading.Lock)
    owner.ttc_state = _OwnerState(thread_ident, follows_global)
    return owner


def _incref(obj: Any) -> None:
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


class _StashProbe:
    __slots__ = ()


_PROBES: list[_StashProbe] = []  # kept for the process: the probe entry stays in the applying thread's TLS


def _binding_steals(raw_stash: Callable[[str, Any], None]) -> bool:
    """Whether ``torch._C._stash_obj_in_tls`` keeps the reference it is passed without taking one (measured,
    not assumed from the version: 2.4.1-2.11.0 steal, 2.12.1+ take their own)."""
    probe = _StashProbe()
    _PROBES.append(probe)
    before = sys.getrefcount(probe)
    raw_stash("_ttc_cudagraph_stash_probe", probe)
    steals = sys.getrefcount(probe) == before
    if steals:
        _incref(probe)  # what the entry will release when it is replaced or its thread exits
    return steals


def _started_by_torch(ident: int) -> bool:
    """A thread that ``threading`` did not start (autograd engine workers). ``threading.current_thread()``
    would register a dummy thread object as a side effect; ``_active`` is only read."""
    t = threading._active.get(ident)  # type: ignore[attr-defined]
    return t is None or isinstance(t, threading._DummyThread)  # type: ignore[attr-defined]


class _Runtime:
    """Everything one application of the patch shares. Dispatchers made while it was applied keep a
    reference to it, so graphs compiled then keep working (per owner) after a revert."""

    def __init__(self, cgt: Any) -> None:
        torch_c = sys.modules["torch"]._C
        self.cgt = cgt
        self.local: threading.local = cgt.local
        self.is_key: Callable[[str], bool] = torch_c._is_key_in_tls
        self.get_tls: Callable[[str], Any] = torch_c._get_obj_in_tls
        raw_stash = torch_c._stash_obj_in_tls
        self.binding_steals = _binding_steals(raw_stash)

        def stash(key: str, obj: Any) -> None:
            # Up to torch 2.11 the binding wraps its argument in a SafePyObject that *steals* a reference the
            # binding never took (upstream only stashes module globals that live as long as the process):
            # give it one, or the entry's release (replaced, or at the thread's exit) frees an object that
            # is still in use. From 2.12 the binding takes its own.
            if self.binding_steals:
                _incref(obj)
            raw_stash(key, obj)

        self.stash: Callable[[str, Any], None] = stash
        self.capture_lock = threading.RLock()
        self.upstream_state = _OwnerState(None)
        self.fallback: _ThreadContainers | None = None
        self.mutex = threading.Lock()
        self.thread_slot = threading.local()
        self.finalizers: dict[int, weakref.finalize] = {}
        self.exiting: list[int] = []  # native ids of ended threads whose OS thread may still be exiting
        self.stats = {"threads": 0, "threads_ended": 0, "managers_shut_down": 0, "end_errors": 0, "fallback_uses": 0}
        self.original_get_curr_generation: Callable[[], int] = cgt.CUDAGraphTreeManager.__dict__["get_curr_generation"].__func__
        # The importing thread's generation is upstream's counter less what other threads' compiled calls
        # added to it; both change together under this lock (a reader between the two would see a new
        # invocation that did not happen).
        self.tracker = cgt.GenerationTracker
        self.mark_step_box = cgt.MarkStepBox
        self.foreign = 0
        self.foreign_lock = threading.Lock()
        self.original_user_invoked_mark_step: Callable[[], bool] = cgt.CUDAGraphTreeManager.__dict__["user_invoked_mark_step"].__func__

    # -- owners ---------------------------------------------------------------------------------------
    def _stash_owner(self, owner: _ThreadContainers) -> None:
        self.stash(CONTAINERS, owner)
        self.stash(LOCKS, owner.ttc_locks)

    def owner(self, create: bool) -> Any:
        """The container dict of the calling context: the thread's own, or (on an autograd worker) the one
        its graph task carries; a new one when there is none and ``create``."""
        owner = getattr(self.local, CONTAINERS, None)
        if owner is not None:
            # Stashed while this thread ran a node of one of its own graph tasks, the entry was undone when
            # the node finished (autograd restores the TLS it saw before): put it back, or the thread's next
            # graph task would not carry it.
            if type(owner) is _ThreadContainers and not self.is_key(CONTAINERS):
                self._stash_owner(owner)
            return owner
        if self.is_key(CONTAINERS):
            return self.get_tls(CONTAINERS)
        return self.new_owner() if create else None

    def new_owner(self) -> _ThreadContainers:
        ident = threading.get_ident()
        if _started_by_torch(ident):
            return self._fallback()
        owner = _new_owner(ident)
        # As upstream does for the importing thread: the threading.local for this thread's own lookups, the
        # C++ stash for its graph tasks (autograd copies it to the worker that runs each backward node).
        setattr(self.local, CONTAINERS, owner)
        setattr(self.local, LOCKS, owner.ttc_locks)
        self._stash_owner(owner)
        sentinel = _ThreadEnd()
        self.thread_slot.sentinel = sentinel
        fin = weakref.finalize(sentinel, self._thread_ended, owner)
        fin.atexit = False  # at interpreter exit a daemon thread may still be running its trees
        with self.mutex:
            self.finalizers[id(owner)] = fin
            self.stats["threads"] += 1
        return owner

    def watch_applying_thread(self) -> None:
        """The applying thread's C++ TLS now holds stash entries too (the probe; upstream's containers when it
        is the thread that imported ``cudagraph_trees``, as under the import hook). When that is not the main
        thread (the first reduce-overhead compile ran in a worker), interpreter exit must wait for it as
        well. Nothing else changes at its end: its containers, if any, stay upstream's."""
        ident = threading.get_ident()
        if _started_by_torch(ident) or ident == threading.main_thread().ident:
            return
        sentinel = _ThreadEnd()
        self.thread_slot.applying = sentinel  # a slot of its own: new_owner() may fill `sentinel` later
        fin = weakref.finalize(sentinel, lambda: self._note_exit(threading.get_native_id()))
        fin.atexit = False

    def _fallback(self) -> _ThreadContainers:
        with self.mutex:
            if self.fallback is None:
                self.fallback = _new_owner(None, follows_global=True)
            self.stats["fallback_uses"] += 1
            return self.fallback

    def state(self, owner: Any) -> _OwnerState:
        return owner.ttc_state if type(owner) is _ThreadContainers else self.upstream_state

    def locks_of(self, owner: Any) -> Any:
        if type(owner) is _ThreadContainers:
            return owner.ttc_locks
        v = getattr(self.local, LOCKS, None)
        return v if v is not None else self.get_tls(LOCKS)

    # -- thread end ------------------------------------------------------------------------------------
    def _thread_ended(self, owner: _ThreadContainers) -> None:
        """Runs in the ending thread while its thread-local storage is cleared (never raises)."""
        with self.mutex:
            self.finalizers.pop(id(owner), None)
        try:
            with self.capture_lock:  # no graph is destroyed while another thread captures
                for device, container in list(owner.items()):
                    with owner.ttc_locks[device]:
                        manager = getattr(container, "tree_manager", None)
                        if manager is None:
                            continue
                        if getattr(manager, "current_node", None) is not None:
                            try:
                                # Outputs still referenced elsewhere would point into a released pool:
                                # make reading them an error (upstream's message for overwritten outputs).
                                manager.dealloc_current_path_weakrefs()
                            except Exception as e:
                                log.debug("cudagraph_trees_per_thread: invalidating outputs at thread end: %s", e)
                        manager.shutdown()
                        self.stats["managers_shut_down"] += 1
                owner.clear()
                # The callables hold the last references to the managers (and their pools' graphs).
                owner.ttc_state.deferred.clear()
            self.stats["threads_ended"] += 1
        except Exception as e:
            self.stats["end_errors"] += 1
            log.debug("cudagraph_trees_per_thread: releasing the trees of an ended thread failed: %s", e)
        if threading.get_ident() == owner.ttc_state.thread_ident:
            try:  # release the containers now, under the interpreter, rather than in the TLS destructor
                self.stash(CONTAINERS, None)
                self.stash(LOCKS, None)
            except Exception as e:
                log.debug("cudagraph_trees_per_thread: clearing an ended thread's stash failed: %s", e)
            self._note_exit(threading.get_native_id())

    def _note_exit(self, native_id: int) -> None:
        """Remember a thread whose C++ TLS still holds a stash entry until its OS thread exits.

        That TLS is destroyed after the thread's Python state, and destroying a stash entry takes the GIL:
        if the interpreter is finalizing by then (a program that joins its threads and exits at once), the
        thread is terminated inside the destructor and the process aborts ("terminate called without an
        active exception") or crashes. Measured with a bare stash in 4 threads: 18 of 40 exits aborted.
        ``wait_for_thread_exits`` (atexit, which runs after non-daemon threads were joined and before
        finalization) waits until these threads are gone."""
        with self.mutex:
            if len(self.exiting) > 64:
                self.exiting = [t for t in self.exiting if os.path.exists(f"/proc/self/task/{t}")]
            self.exiting.append(native_id)

    def wait_for_thread_exits(self, timeout: float = 2.0) -> None:
        if not os.path.isdir("/proc/self/task"):  # only Linux exposes thread exit this way
            return
        with self.mutex:
            pending = list(self.exiting)
        deadline = time.monotonic() + timeout
        for tid in pending:
            while os.path.exists(f"/proc/self/task/{tid}") and time.monotonic() < deadline:
                time.sleep(0.0005)

    def importing_generation(self) -> int:
        """``get_curr_generation`` of the importing thread: upstream's rule on upstream's counters, less the
        compiled calls of other threads (none in a single-threaded program: upstream's value itself)."""
        m = self.mark_step_box.mark_step_counter
        if m != 0:
            return int(m)
        with self.foreign_lock:
            return int(self.tracker.generation) - self.foreign

    def report(self) -> dict[str, Any]:
        with self.mutex:
            out: dict[str, Any] = dict(self.stats)
            out["threads_alive_with_trees"] = len(self.finalizers)  # one per thread until it ends
        out["stash_binding_steals"] = self.binding_steals
        return out


_RUNTIME: _Runtime | None = None


def _modules() -> tuple[Any, Any]:
    return sys.modules[CGT], sys.modules[EVAL_FRAME]


def check() -> str | None:
    cgt, ef = _modules()
    if hasattr(cgt, "_initialize_tls") or hasattr(cgt, "graph_capture_lock"):
        return "cudagraph_trees initializes its TLS per thread itself (pytorch#184357)"
    for name in ("local", "get_obj", "get_container", "cudagraphify_impl", "reset_cudagraph_trees", "mark_step_begin",
                 "TreeManagerContainer", "CUDAGraphTreeManager"):
        if getattr(cgt, name, None) is None:
            return f"{CGT}.{name} not found"
    if not isinstance(cgt.local, threading.local):
        return f"{CGT}.local is not a threading.local"
    code = getattr(cgt.get_obj, "__code__", None)
    if code is None or code.co_argcount != 2 or code.co_varnames[:2] != ("local", "attr_name"):
        return f"{CGT}.get_obj(local, attr_name) has another signature"
    code = getattr(cgt.cudagraphify_impl, "__code__", None)
    if code is None or code.co_varnames[:3] != ("model", "inputs", "static_input_idxs"):
        return f"{CGT}.cudagraphify_impl(model, inputs, static_input_idxs, ...) has another signature"
    mgr = cgt.CUDAGraphTreeManager
    for name in _LOCKED_MANAGER_METHODS + ("shutdown",):
        if not callable(mgr.__dict__.get(name)):
            return f"CUDAGraphTreeManager.{name} not found"
    for name in _STATIC_GENERATION_METHODS:
        if not isinstance(mgr.__dict__.get(name), staticmethod):
            return f"CUDAGraphTreeManager.{name} is not a staticmethod"
    if not callable(cgt.TreeManagerContainer.__dict__.get("get_tree_manager")):
        return "TreeManagerContainer.get_tree_manager not found"
    torch_c = sys.modules["torch"]._C
    for name in ("_stash_obj_in_tls", "_get_obj_in_tls", "_is_key_in_tls"):
        if not callable(getattr(torch_c, name, None)):
            return f"torch._C.{name} not found"
    if not callable(getattr(ef, "install_generation_tagging_init", None)):
        return f"{EVAL_FRAME}.install_generation_tagging_init not found (the per-call generation hook)"
    tracker, box = getattr(cgt, "GenerationTracker", None), getattr(cgt, "MarkStepBox", None)
    if not isinstance(getattr(tracker, "generation", None), int) or not isinstance(getattr(box, "mark_step_counter", None), int):
        return f"{CGT}.GenerationTracker.generation / MarkStepBox.mark_step_counter not found"
    if not isinstance(tracker.__dict__.get("clear"), classmethod):
        return "GenerationTracker.clear is not a classmethod"
    if not isinstance(getattr(threading, "_active", None), dict) or not hasattr(threading, "_DummyThread"):
        return "threading._active / threading._DummyThread not found"
    return _device_wide_problem()


def _synchronize_template(device=None):  # type: ignore[no-untyped-def]
    """The code ``torch.cuda.synchronize`` runs (same signature)."""
    return _ttc_cg_synchronize(device)  # type: ignore[name-defined]  # noqa: F821


def _empty_cache_template():  # type: ignore[no-untyped-def]
    """The code ``torch.cuda.empty_cache`` runs (same signature)."""
    return _ttc_cg_empty_cache()  # type: ignore[name-defined]  # noqa: F821


_DEVICE_WIDE = (("synchronize", _synchronize_template, ("device",)), ("empty_cache", _empty_cache_template, ()))


def _guard_device_wide(changes: Changes, rt: _Runtime) -> None:
    """Make ``torch.cuda.synchronize``/``empty_cache`` wait for the capture lock, keeping their objects."""
    cuda = sys.modules["torch"].cuda

    def around(original: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*a: Any) -> Any:
            with rt.capture_lock:
                return original(*a)

        return guarded

    for name, template, _args in _DEVICE_WIDE:
        route_through(changes, getattr(cuda, name), template, f"_ttc_cg_{name}", around)


def _device_wide_problem() -> str | None:
    cuda = getattr(sys.modules["torch"], "cuda", None)
    for name, _template, args in _DEVICE_WIDE:
        func = getattr(cuda, name, None)
        code = getattr(func, "__code__", None)
        if code is None:
            return f"torch.cuda.{name} is not a Python function"
        shape = (code.co_argcount, code.co_kwonlyargcount, code.co_varnames[: len(args)], code.co_freevars)
        if shape != (len(args), 0, args, ()) or code.co_flags & 0x0C:
            return f"torch.cuda.{name} has another signature"
        if f"_ttc_cg_{name}" in getattr(func, "__globals__", {}):
            return f"torch.cuda.{name} is guarded already"
    return None


def _locked(rt: _Runtime, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def locked(*args: Any, **kwargs: Any) -> Any:
        with rt.capture_lock:
            return fn(*args, **kwargs)

    return locked


def _own_counts(owner: Any) -> _OwnerState | None:
    """The state whose counters an owner reads: None for the importing thread and the fallback, which read
    upstream's."""
    if type(owner) is _ThreadContainers and not owner.ttc_state.follows_global:
        return owner.ttc_state
    return None


def _patch_generations(changes: Changes, rt: _Runtime, ef: Any) -> None:
    """Generations and mark-steps per owner; the importing thread reads upstream's (see the module doc)."""
    cgt = rt.cgt
    original_reset = cgt.reset_cudagraph_trees
    original_mark_step_begin = cgt.mark_step_begin
    original_tagging = ef.install_generation_tagging_init
    original_clear = rt.tracker.__dict__["clear"].__func__

    @functools.wraps(original_reset)
    def reset_cudagraph_trees() -> None:
        state = _own_counts(rt.owner(create=False))
        saved = rt.mark_step_box.mark_step_counter
        with rt.capture_lock:
            original_reset()  # ends with MarkStepBox.mark_step_counter = 0: the importing thread's counter
        if state is not None:
            state.mark_step = 0
            rt.mark_step_box.mark_step_counter = saved

    @functools.wraps(original_mark_step_begin)
    def mark_step_begin() -> None:
        state = _own_counts(rt.owner(create=True))
        if state is None:
            original_mark_step_begin()
        else:
            state.mark_step -= 1

    def get_curr_generation() -> int:
        owner = rt.owner(create=True)
        state = _own_counts(owner)
        if state is not None:
            return state.mark_step if state.mark_step != 0 else state.generation
        if type(owner) is _ThreadContainers:  # the fallback
            return rt.original_get_curr_generation()
        return rt.importing_generation()

    def user_invoked_mark_step() -> bool:
        state = _own_counts(rt.owner(create=True))
        return rt.original_user_invoked_mark_step() if state is None else state.mark_step != 0

    @functools.wraps(original_tagging)
    def install_generation_tagging_init() -> None:
        mine = getattr(rt.local, CONTAINERS, None)
        if mine is not None and type(mine) is not _ThreadContainers:
            original_tagging()  # the importing thread: upstream's counter is its own
            return
        with rt.foreign_lock:
            original_tagging()  # upstream bumps GenerationTracker.generation here, on every compiled call
            rt.foreign += 1
        state = _own_counts(rt.owner(create=False))  # threads without trees need no count
        if state is not None:
            state.generation += 1

    def clear(cls: Any) -> None:
        with rt.foreign_lock:
            original_clear(cls)  # torch._dynamo.reset(): the counter starts again at 0, for every thread
            rt.foreign = 0

    changes.setattr(cgt, "reset_cudagraph_trees", reset_cudagraph_trees)
    changes.setattr(cgt, "mark_step_begin", mark_step_begin)
    changes.setattr(cgt.CUDAGraphTreeManager, "get_curr_generation", staticmethod(get_curr_generation))
    changes.setattr(cgt.CUDAGraphTreeManager, "user_invoked_mark_step", staticmethod(user_invoked_mark_step))
    changes.setattr(ef, "install_generation_tagging_init", install_generation_tagging_init)
    changes.setattr(rt.tracker, "clear", classmethod(functools.wraps(original_clear)(clear)))


def apply(changes: Changes) -> dict[str, Any]:
    global _RUNTIME
    cgt, ef = _modules()
    rt = _Runtime(cgt)
    original_get_obj = cgt.get_obj
    original_impl = cgt.cudagraphify_impl

    @functools.wraps(original_get_obj)
    def get_obj(local: Any, attr_name: str) -> Any:
        if local is not rt.local or attr_name not in _KEYS:
            return original_get_obj(local, attr_name)
        owner = rt.owner(create=True)
        return owner if attr_name == CONTAINERS else rt.locks_of(owner)

    @functools.wraps(original_impl)
    def cudagraphify_impl(model: Any, inputs: list[Any], static_input_idxs: Any, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        key = _GraphKey()  # dies with this dispatcher (a self-reference would leave that to the GC)

        def deferred_cudagraphify(inputs: list[Any]) -> Any:
            state = rt.state(rt.owner(create=True))
            fn = state.deferred.get(key)
            if fn is None:
                with state.mutex:  # the owner's thread and an autograd worker running its backward
                    fn = state.deferred.get(key)
                    if fn is None:
                        # Upstream's constructor reads the inputs only for the positions of int inputs,
                        # which are the same for every call of one graph.
                        fn = original_impl(model, inputs, static_input_idxs, *args, **kwargs)
                        state.deferred[key] = fn
            return fn(inputs)

        return deferred_cudagraphify

    mgr = cgt.CUDAGraphTreeManager
    locked = {name: _locked(rt, mgr.__dict__[name]) for name in _LOCKED_MANAGER_METHODS}
    get_tree_manager = _locked(rt, cgt.TreeManagerContainer.__dict__["get_tree_manager"])

    # Threads given containers keep them after a revert (upstream's lookup finds them on the threading.local),
    # so what happens at their end (trees released, stash handed over, interpreter exit waiting for it) stays.
    atexit.register(rt.wait_for_thread_exits)
    rt.watch_applying_thread()
    changes.setattr(cgt, "get_obj", get_obj)
    changes.setattr(cgt, "cudagraphify_impl", cudagraphify_impl)
    for name, fn in locked.items():
        changes.setattr(mgr, name, fn)
    changes.setattr(cgt.TreeManagerContainer, "get_tree_manager", get_tree_manager)
    _patch_generations(changes, rt, ef)
    _guard_device_wide(changes, rt)
    _RUNTIME = rt

    def forget() -> None:
        global _RUNTIME
        if _RUNTIME is rt:
            _RUNTIME = None

    changes.on_revert(forget)
    return {}


def _probe() -> tuple[Any, Any]:
    """In a fresh thread: its containers are its own, stashed in its own TLS, and its generation counts alone."""
    rt = _RUNTIME
    assert rt is not None
    cgt = rt.cgt
    containers = cgt.get_obj(cgt.local, CONTAINERS)
    locks = cgt.get_obj(cgt.local, LOCKS)
    if type(containers) is not _ThreadContainers or locks is not containers.ttc_locks:
        raise AssertionError("a new thread did not get containers of its own")
    if cgt.get_obj(cgt.local, CONTAINERS) is not containers or rt.get_tls(CONTAINERS) is not containers:
        raise AssertionError("the thread's containers are not what its C++ TLS (its graph tasks) carry")
    before = cgt.CUDAGraphTreeManager.get_curr_generation()
    rt.state(containers).generation += 1  # what a compiled call in this thread does
    if cgt.CUDAGraphTreeManager.get_curr_generation() == before:
        raise AssertionError("the thread's generation does not follow its own calls")
    # The objects, not their ids: the caller keeps them alive, so a later thread's cannot reuse their addresses.
    return containers, locks


def verify() -> None:
    rt = _RUNTIME
    if rt is None:
        raise AssertionError("not applied")
    a = run_in_thread(_probe)
    b = run_in_thread(_probe)  # while ``a`` holds the first thread's containers (ids of freed objects recur)
    if a[0] is b[0] or a[1] is b[1]:
        raise AssertionError("two threads share one set of containers")
    del a, b
    # With no other thread's compiled call counted, the importing thread reads upstream's value itself (a
    # compiled call between the two reads can move both: a few tries).
    if rt.foreign == 0 and not any(rt.importing_generation() == rt.original_get_curr_generation() for _ in range(3)):
        raise AssertionError("the importing thread does not read upstream's generation")
    for name in _LOCKED_MANAGER_METHODS:
        if getattr(rt.cgt.CUDAGraphTreeManager.__dict__[name], "__wrapped__", None) is None:
            raise AssertionError(f"CUDAGraphTreeManager.{name} does not take the capture lock")
    cuda = sys.modules["torch"].cuda
    for name, _template, _args in _DEVICE_WIDE:  # not called: that would need (and initialize) CUDA
        if getattr(cuda, name).__code__.co_names != (f"_ttc_cg_{name}",):
            raise AssertionError(f"torch.cuda.{name} does not wait for captures")


def report() -> dict[str, Any]:
    return _RUNTIME.report() if _RUNTIME is not None else {}

"""Flights: a gated call that compiled something, and the wait of its function's other callers.

A gated call that compiles anything is a *flight* of its function until the call returns. Other threads
entering the gate of the same function (same first code object, so per-thread ``torch.compile(module
copy)`` counts as one function) wait for the flight to land before they call, holding no lock: so the
graph-break continuations and the functions called from compiled code that the flight compiles on its
way are compiled once, not once per thread. The wait is bounded: it lasts while the flight compiles
(upstream would wait for ``compile_lock`` as long) and at most ``FOLLOW_FACTOR`` times its compile time
after that (1 s … ``FOLLOW_MAX_S``), at most ``COMPILE_WAIT_MAX_S`` in all. It ends at once when the
flight queues for ``compile_lock`` behind another function's compile: then the waiters' own calls (which
may need nothing compiled) are not held up by compiles elsewhere, for instance a neighbour whose compiles
keep failing. A thread that is itself compiling or holds ``compile_lock`` (an export, an FX trace) never
waits.
"""

from __future__ import annotations

import threading
import time
import types
from typing import Any, Callable

from torch_threadsafe_compile import _forksafe
from torch_threadsafe_compile._torch import holds_compile_lock

FOLLOW_FACTOR = 4.0
FOLLOW_MAX_S = 10.0
COMPILE_WAIT_MAX_S = 60.0


class Flight:
    """One thread's gated call that compiled something."""

    __slots__ = ("owner", "landed", "compiling", "queued", "compile_s", "idle_since")

    def __init__(self) -> None:
        self.owner = threading.get_ident()
        self.landed = threading.Event()
        self.compiling = 0  # compiles of this flight under way (holding compile_lock)
        self.queued = 0  # compiles of this flight waiting for compile_lock
        self.compile_s = 0.0
        self.idle_since = time.monotonic()


# first code object of a gated function -> its flights. Non-empty only while first calls are under way, so
# the gate's warm path pays one truthiness test. _lock is a leaf lock: nothing else is acquired under it.
flights: dict[types.CodeType, list[Flight]] = {}
_lock = threading.Lock()


def _internal_init(self: Any) -> None:
    # Set while this thread runs the bookkeeping below. These helpers can run under an active dynamo
    # callback (a gated function called from compiled code), so the frames they create (threading's
    # Event, Condition) reach the frame callback, which must not re-enter the bookkeeping.
    self.busy = False
    # Dynamo callbacks (compiles) under way in this thread: such a thread never waits for a flight.
    self.compiling = 0


def _new_internal() -> Any:
    """Built on ``threading.local`` as it is now (gevent's greenlet-local once gevent patched threading)."""
    return type("_Internal", (threading.local,), {"__init__": _internal_init})()


internal = _new_internal()


def rebind_locals() -> None:
    """gevent patched threading after this module was imported (see ``_calls.rebind_locals``)."""
    global internal
    internal = _new_internal()


@_forksafe.in_child
def _after_fork() -> None:
    """In a forked child only the forking thread's flights go on; nobody would land the others."""
    global _lock
    _lock = threading.Lock()
    me = threading.get_ident()
    for key in list(flights):
        mine = [fl for fl in flights[key] if fl.owner == me]
        for fl in mine:
            fl.landed = threading.Event()  # its lock may be held by a thread that does not exist here
        if mine:
            flights[key] = mine
        else:
            del flights[key]


def takeoff(key: types.CodeType) -> Flight:
    """A new flight of ``key`` for the calling thread."""
    internal.busy = True
    try:
        fl = Flight()
        with _lock:
            flights.setdefault(key, []).append(fl)
        return fl
    finally:
        internal.busy = False


def land(key: types.CodeType, fl: Flight) -> None:
    """The gated call of flight ``fl`` returned (or raised): its waiters may go."""
    internal.busy = True
    try:
        with _lock:
            rest = flights.get(key)
            if rest is not None:
                for i in range(len(rest)):  # no comprehension: one frame less under a possibly active callback
                    if rest[i] is fl:
                        del rest[i]
                        break
                if not rest:
                    del flights[key]
        fl.landed.set()
    finally:
        internal.busy = False


def fly(key: types.CodeType | None, current: Any, compile_fn: Callable[[], Any], lock: Any) -> Any:
    """Run ``compile_fn`` (dynamo's callback) as part of the flight of gated call ``current``.

    Never waits for ``lock`` (dynamo's ``compile_lock``) itself: most frames that reach the callback here
    are frames upstream skips without taking any lock (torch's own functions called from compiled code,
    e.g. ``callback_handler.run_start_callbacks`` while that thread holds torch's callback lock in a lazy
    backward compile). Waiting for ``compile_lock`` there would invert upstream's lock order: the compile
    holding ``compile_lock`` waits for the callback lock (``compile_inner`` enters ``install_callbacks``),
    and neither moves (measured: a permanent deadlock under resets). So: free lock → hold it for the whole
    callback and time the compile; taken → hand the frame to upstream as it is, which takes the lock only
    if it compiles; the flight counts as queued meanwhile, so its waiters go ahead.
    """
    if key is None or current is None:
        return compile_fn()
    fl = current.flight
    if fl is None:
        fl = current.flight = takeoff(key)
    if not lock.acquire(False):
        fl.queued += 1
        try:
            return compile_fn()
        finally:
            fl.queued -= 1
            fl.idle_since = time.monotonic()
    fl.compiling += 1
    t1 = time.perf_counter()
    try:
        return compile_fn()
    finally:
        fl.compile_s += time.perf_counter() - t1
        fl.idle_since = time.monotonic()
        fl.compiling -= 1
        lock.release()


def await_others(key: types.CodeType) -> float:
    """Wait (bounded, no lock held) until other threads' flights of ``key`` have landed; seconds waited."""
    pending = flights.get(key)
    if not pending or internal.compiling or holds_compile_lock():
        return 0.0
    me = threading.get_ident()
    t0 = time.monotonic()
    internal.busy = True
    try:
        for fl in list(pending):
            if fl.owner == me:
                continue
            while not fl.landed.wait(0.02):
                now = time.monotonic()
                if now - t0 > COMPILE_WAIT_MAX_S:
                    return now - t0
                if fl.compiling:
                    continue
                if fl.queued or now - fl.idle_since > min(FOLLOW_MAX_S, max(1.0, FOLLOW_FACTOR * fl.compile_s)):
                    break
        return time.monotonic() - t0
    finally:
        internal.busy = False


# Code objects dynamo must run as they are when a gated call happens inside compiled code.
HELPER_CODES = (takeoff.__code__, land.__code__, fly.__code__, await_others.__code__, Flight.__init__.__code__,
                _internal_init.__code__)

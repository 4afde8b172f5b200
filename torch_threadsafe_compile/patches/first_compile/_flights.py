"""Flights: a gated call that compiled something, and the wait of the calls that missed meanwhile.

A gated call that compiles anything is a *flight* of its function until the call returns. Only a call that
*missed* the cache waits for it: its first frame was compiled by another thread while it waited for
``compile_lock`` (or found in the cache without it), dynamo's callback raised ``Retry``, and before it
looks again its gate waits (:func:`await_others`, no lock held) while the flights of the same function
(same first code object, so per-thread ``torch.compile(module copy)`` counts as one function) compile, and
for a short while after each of their compiles (``FOLLOW_S`` plus ``FOLLOW_FACTOR`` times the compile
time, at most ``FOLLOW_MAX_S``): a flight that goes on to compile the graph-break continuations and the
functions called from compiled code on its way does so in that window, once, and the waiter then finds
them cached. A call whose guards pass never waits, whatever other threads compile (issue 38: warm calls
used to wait for any flight of their function), and nobody waits for another thread's *call*: a flight
that runs user code between its compiles (a barrier, I/O, a collective in a ``torch.compiler.disable``d
helper) stops holding its waiters after the short window. The wait ends at once when the flight queues
for ``compile_lock`` behind another function's compile, and lasts at most ``COMPILE_WAIT_MAX_S``. A
thread that is itself compiling or holds ``compile_lock`` (an export, an FX trace) never waits.

What the window cannot cover: a call whose first frame is already cached runs on without waiting, and if
it reaches a function called from compiled code that another thread is compiling right now (not a gated
call or a continuation, which look again), it compiles that frame once more after it, as upstream does:
dynamo gives its callback no way to look at the cache again for such a frame.
"""

from __future__ import annotations

import threading
import time
import types
from typing import Any, Callable

from torch_threadsafe_compile import _forksafe
from torch_threadsafe_compile._torch import holds_compile_lock

# After each compile of a flight, its waiters follow it for FOLLOW_S + FOLLOW_FACTOR * (its compile time so
# far), at most FOLLOW_MAX_S: long enough for the flight to run the graph it just compiled and start the next
# compile of its call, short enough for a rendezvous between frames (a barrier with a timeout, a collective)
# to be reached by the waiters in time. Was max(1 s, 4 x compile time) up to 10 s, from the start of any call.
FOLLOW_S = 0.25
FOLLOW_FACTOR = 0.5
FOLLOW_MAX_S = 1.0
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
    # The lock is given back by this thread's hold count, not by a flag set after acquire() returns: an
    # asynchronous exception (KeyboardInterrupt, a signal handler that raises) can arrive between the two,
    # and must not leave compile_lock held (issue 38). acquire() is inside the try for the same reason.
    held = hold_count(lock)
    before = held()
    compiling = False
    t1 = 0.0
    try:
        if not lock.acquire(False):
            fl.queued += 1
            try:
                return compile_fn()
            finally:
                fl.queued -= 1
                fl.idle_since = time.monotonic()
        t1 = time.perf_counter()
        fl.compiling += 1
        compiling = True
        return compile_fn()
    finally:
        if compiling:
            fl.compile_s += time.perf_counter() - t1
            fl.idle_since = time.monotonic()
            fl.compiling -= 1
        while held() > before:
            lock.release()


def hold_count(lock: Any) -> Callable[[], int]:
    """How many times the calling thread holds ``lock`` (dynamo's compile_lock, a C ``RLock``, or the
    :class:`~torch_threadsafe_compile._compile_lock.InstrumentedRLock` around it), as a function to call."""
    inner = getattr(lock, "_inner", lock)
    count = getattr(inner, "_recursion_count", None)  # C RLock (CPython 3.11+) and Python's _RLock alike
    if count is None:  # an RLock without one: held once or not at all, as far as we can tell
        return lambda: 1 if inner._is_owned() else 0
    return count  # type: ignore[no-any-return]


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
                if fl.queued or now - fl.idle_since > min(FOLLOW_MAX_S, FOLLOW_S + FOLLOW_FACTOR * fl.compile_s):
                    break
        return time.monotonic() - t0
    finally:
        internal.busy = False


# Code objects dynamo must run as they are when a gated call happens inside compiled code.
HELPER_CODES = (takeoff.__code__, land.__code__, fly.__code__, await_others.__code__, Flight.__init__.__code__,
                _internal_init.__code__, hold_count.__code__)

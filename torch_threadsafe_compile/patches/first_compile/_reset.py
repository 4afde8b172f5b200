"""``torch._dynamo.reset()`` while other threads run compiled code.

``reset()`` takes ``compile_lock`` and frees dynamo's per-code cache entries. Dynamo's C ``lookup()``
walks those entries without that lock, and each guard check releases the GIL, so a thread calling a
compiled function while another resets can be walking freed memory: measured on torch 2.13 CPU, 6 threads
calling compiled functions while one thread resets every 2 s and another changes ``cache_size_limit``,
the process died (segmentation fault) in 5 of 5 runs of 30 s without the package.

What a reset means here: the reset closes the barrier and waits until no other thread is inside a gated
call (each call finishes, with any compile it started); then dynamo's caches are cleared, with this
package's tables of compile results; then the barrier opens and calls compile afresh. A thread that resets
from inside a gated call (a compiled function's callee) does not wait for itself, and a gated call nested
inside one already running never waits (the reset is waiting for that call).

New calls (depth 0) that find the barrier closed wait at their gate, but only up to ``GATE_WAIT_S`` while
the reset is still waiting for others: the call the reset waits for may itself wait for one of them (a
compiled consumer blocked on a queue that another compiled function feeds). Holding them until the reset is
done would be a cycle: reset → consumer → producer → reset (measured before: 120 s, then "resetting
anyway"). After ``GATE_WAIT_S`` a call goes in, and the reset keeps waiting until a moment when nobody is
inside. Only once the reset has seen that moment (``freeing``) does every new call wait until it is done:
that part depends on no other thread. The two sides publish first and look second: a call is visible from
the moment its gate pushed its entry on its thread's list (``_calls``), and one that waited pushes its entry
again before it reads ``freeing``; the reset sets ``freeing``, then reads the other threads' lists. So no
call slips into dynamo's lookup while entries are freed. The whole wait is bounded (``RESET_WAIT_MAX_S``: a
call that never returns; then the reset goes ahead, with a log line).

A reset that did not see that moment must not free what the others use (H11). A strict
``torch.export.export`` resets dynamo while it holds ``compile_lock`` (torch 2.13's graph capture for
export, inside ``export_lock``'s hold): threads inside gated calls that wait for that lock in dynamo's frame
callback cannot leave, and each holds its code object's cache state (``ExtraState``), into which it inserts
its compile result later. Waiting for them was a cycle that lasted ``RESET_WAIT_MAX_S``, after which the
reset freed that state under them (``SIGSEGV`` in ``create_cache_entry``). Now the reset stops waiting as
soon as every thread still inside waits for the lock it holds, and only a drained reset runs
``quiesced`` (``_graveyard``): otherwise ``code_reset`` invalidates the entries instead of freeing them and
``guard_invalidation`` keeps the trees, as for other threads' ``reset_code`` (H9).

Calls of functions compiled *before* an explicit ``install()`` have no gate and are not waited for.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from torch_threadsafe_compile import _forksafe, _graveyard
from torch_threadsafe_compile._torch import compile_lock_waiters, holds_compile_lock
from torch_threadsafe_compile.patches.first_compile import _calls

if TYPE_CHECKING:
    from torch_threadsafe_compile._journal import Capability

RESET_WAIT_MAX_S = 120.0
GATE_WAIT_S = 0.25
HELD_WAIT_S = 1.0

log = logging.getLogger("torch_threadsafe_compile")


class ResetBarrier:
    """Closed while a reset is under way: gates at depth 0 wait for it to open."""

    def __init__(self) -> None:
        self.resets = 0
        self._start()

    def _start(self) -> None:
        self.closed = False
        self.freeing = False  # the reset saw nobody inside and frees now: new calls wait until it is done
        self._cond = threading.Condition(threading.Lock())
        # One reset at a time; re-entrant, as reset() calls reset_code_caches() (both are wrapped).
        self._one_at_a_time = threading.RLock()
        self._depth = 0
        self._drained = True  # whether the reset under way saw nobody inside (set at depth 1)

    def after_fork(self) -> None:
        """In a forked child: no reset is under way there (the resetting thread, if it was another one,
        does not exist in the child), and its locks may be held by threads that do not exist."""
        self._start()

    def enter(self, inside: list[Any], target: Any) -> None:
        """Called by a gate, its call not begun, while a reset is under way (``inside``: the thread's list
        of gated calls, with this call's entry on top). A call nested in another gated call of its thread
        goes on (the reset waits for the outer one); the outermost waits as the module docstring says and
        returns when it may go on."""
        if len(inside) > 1:
            return
        t0 = time.monotonic()
        while True:
            inside.pop()  # not counted as inside while it waits
            try:
                with self._cond:
                    while self.closed:
                        left = GATE_WAIT_S - (time.monotonic() - t0)
                        if left <= 0 and not self.freeing:
                            break
                        self._cond.wait(left if left > 0 else 1.0)
            finally:
                # Counted again (publish), then look at ``freeing`` (see the module docstring).
                inside.append(target)
            if not self.freeing:
                return

    def _others_inside(self, me: int) -> set[int]:
        """The other threads inside a gated call now: those whose list is not empty. Every thread counts,
        also one that ``threading`` does not list (started by ``_thread`` or native code); a list stays
        non-empty only while its thread is inside a call (each gate takes its entry back in ``finally``)."""
        return {ident for ident, stack in list(_calls.all_stacks.values()) if stack and ident != me}

    def run(self, reset: Callable[..., Any], args: Any, kwargs: Any, after: Callable[[], None],
            waiters: Capability) -> Any:
        with self._one_at_a_time:
            self._depth += 1
            try:
                if self._depth == 1:
                    self._drained = self._close_and_drain(waiters)
                # Drained: nobody is inside, the reset frees as upstream. Not drained: code_reset and
                # guard_invalidation see other threads and reset softly (H11): nothing is freed under them.
                with _graveyard.quiesced() if self._drained else contextlib.nullcontext():
                    result = reset(*args, **kwargs)
                after()
                self.resets += self._depth == 1
                return result
            finally:
                self._depth -= 1
                if self._depth == 0:
                    with self._cond:
                        self.closed = self.freeing = False
                        self._cond.notify_all()

    def _close_and_drain(self, waiters: Capability) -> bool:
        """Close the barrier and wait until no other thread is inside a gated call: True. False when that
        cannot happen (they wait for ``compile_lock``, which this thread holds) or did not within
        ``RESET_WAIT_MAX_S``; the reset then goes ahead softly (H11), new calls waiting until it is done."""
        with self._cond:
            self.closed = True
        me = _calls.os_ident()  # the lists' idents: the OS thread's, under gevent too
        t0 = time.monotonic()
        while True:
            inside = self._others_inside(me)
            if not inside:
                self.freeing = True  # publish, then look again (a call may have pushed in between)
                if not self._others_inside(me):
                    return True
                with self._cond:
                    self.freeing = False
                    self._cond.notify_all()
            elif _blocked_by_me(inside, time.monotonic() - t0, waiters):
                log.info("torch._dynamo.reset() holding compile_lock while other threads' compiled calls wait for "
                         "it: cache entries are invalidated, not freed")
                self.freeing = True
                return False
            if time.monotonic() - t0 > RESET_WAIT_MAX_S:
                log.warning("torch._dynamo.reset(): other threads are still inside compiled calls after %.0f s; "
                            "resetting anyway (cache entries invalidated, not freed)", RESET_WAIT_MAX_S)
                self.freeing = True
                return False
            time.sleep(0.001)


def _blocked_by_me(inside: set[int], waited: float, waiters: Capability) -> bool:
    """Whether the threads still inside gated calls can only leave after this reset: this thread holds
    dynamo's ``compile_lock`` (a strict export resets dynamo inside ``export_lock``'s hold, torch 2.13) and
    each of them waits for it -- in dynamo's frame callback, holding its code's cache state. Waiting for them
    is a cycle (it lasted ``RESET_WAIT_MAX_S``, then the reset freed that state under them: H11). Where the
    lock's waiters are not recorded (``compile_lock_watchdog`` off), holding the lock for ``HELD_WAIT_S``
    with someone still inside counts as blocked."""
    if not holds_compile_lock():
        return False
    waiting = compile_lock_waiters(waiters)
    if waiting is None:
        return waited > HELD_WAIT_S
    return inside <= waiting


barrier = ResetBarrier()
_forksafe.in_child(barrier.after_fork)

# Code objects that may run under dynamo's active frame callback (a gate at depth 0 inside compiled code
# of a function compiled before install()).
HELPER_CODES = (ResetBarrier.enter.__code__,)


def wrap_reset(original: Callable[..., Any], barrier: ResetBarrier, after: Callable[[], None],
               waiters: Capability) -> Callable[..., Any]:
    @functools.wraps(original)
    def reset(*args: Any, **kwargs: Any) -> Any:
        return barrier.run(original, args, kwargs, after, waiters)

    return reset

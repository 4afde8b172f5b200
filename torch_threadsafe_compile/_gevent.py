"""gevent: greenlets of one OS thread must not share the per-thread state of the compile gate.

torch itself is not greenlet-safe (two greenlets compiling at once in one thread mix their fake-tensor modes,
or crash: measured unpatched), but programs that compile in one greenlet and call the compiled functions
from many work upstream, also when a greenlet switches inside a compiled call (I/O after a graph break).
The gate's bookkeeping keeps per-thread state (``first_compile/_flights``, and the list of gated calls in
progress, ``first_compile/_calls``); greenlets of one thread sharing it would mix their calls'.
(A gated call's own state is found from the greenlet's frames, which are its own.)

* gevent patched before torch was imported: ``threading.local`` is gevent's greenlet-local when the gate's
  state is built, and nothing more is needed.
* torch imported first: gevent calls :func:`did_patch_module` (a ``gevent.plugins.monkey.did_patch_module``
  entry point of this package) when it patches ``threading``; the gate's state is built anew on gevent's
  local, for gates made from then on.

Reads ``sys.modules`` only: nothing is imported by gevent's event.
"""

from __future__ import annotations

import sys
from typing import Any

STATE_MODULES = ("torch_threadsafe_compile.patches.first_compile._calls",
                 "torch_threadsafe_compile.patches.first_compile._flights")


def did_patch_module(event: Any) -> None:
    """gevent's event after it patched a module (``GeventDidPatchModuleEvent``)."""
    if getattr(event, "module_name", None) != "threading":
        return
    for name in STATE_MODULES:
        rebind = getattr(sys.modules.get(name), "rebind_locals", None)
        if rebind is not None:
            rebind()

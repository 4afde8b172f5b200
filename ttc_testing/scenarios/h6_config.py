"""H6, config overrides per context: across a fork from a worker thread, and ``config.patch`` beside
assignments in another thread."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from torch_threadsafe_compile.selftest import scenario
from ttc_testing.scenarios._common import _wait_child


@scenario
def config_after_fork_from_thread(child_timeout: float = 60.0) -> dict[str, Any]:
    """H6 in a child that a worker thread forked. The parent's main thread set ``recompile_limit = 64``
    first: the forking thread reads it in the child as it did before the fork (``child_main_sees``). The
    forking thread is the child's main thread, so its ``recompile_limit = 32`` is the program's configuration
    there and must reach a thread the child starts (``child_thread_sees``; None: the child failed or hung)."""
    import torch
    import torch._dynamo

    cfg = torch._dynamo.config
    name = "recompile_limit" if "recompile_limit" in cfg._config else "cache_size_limit"
    out: dict[str, Any] = {"default": getattr(cfg, name), "child_main_sees": None, "child_thread_sees": None}
    setattr(cfg, name, 64)  # the program's configuration, in the parent's main thread
    rfd, wfd = os.pipe()

    def forker() -> None:
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                before = getattr(cfg, name)
                setattr(cfg, name, 32)  # in the child's main thread, as its program would
                box: list[Any] = []
                t = threading.Thread(target=lambda: box.append(getattr(cfg, name)))
                t.start()
                t.join(30)
                os.write(wfd, json.dumps([before, box[0] if box else None]).encode())
                code = 0
            finally:
                os._exit(code)
        out["child_exit"] = _wait_child(pid, child_timeout)

    t = threading.Thread(target=forker)
    t.start()
    t.join()
    os.close(wfd)
    data = os.read(rfd, 100)
    os.close(rfd)
    if data:
        out["child_main_sees"], out["child_thread_sees"] = json.loads(data)
    return out


@scenario
def config_patch_isolation(seconds: float = 2.0) -> dict[str, Any]:
    """H6 (torch >= 2.12): thread A reads ``recompile_limit`` inside ``config.patch(recompile_limit=16)`` while
    the main thread assigns it over and over; after A's patch ends, A must follow the main thread's value.
    Also: the alias ``cache_size_limit`` assigned in the main thread, read by a new thread; a child thread's
    assignment must not change the main thread's ``get_hash()`` (upstream's per-thread isolation)."""
    import torch
    import torch._dynamo

    cfg = torch._dynamo.config
    name = "recompile_limit" if "recompile_limit" in cfg._config else "cache_size_limit"
    inside = threading.Event()
    stop = threading.Event()
    out: dict[str, Any] = {"reads": 0, "foreign_reads": 0}

    def patched() -> None:
        with cfg.patch(**{name: 16}):
            inside.set()
            while not stop.is_set():
                out["reads"] += 1
                if getattr(cfg, name) != 16:
                    out["foreign_reads"] += 1
        out["after_patch_sees"] = getattr(cfg, name)

    t = threading.Thread(target=patched)
    t.start()
    inside.wait(10)
    t_end = time.time() + seconds
    k = 0
    while time.time() < t_end:
        k += 1
        setattr(cfg, name, 64 + k % 2)
    setattr(cfg, name, 64)
    stop.set()
    t.join()
    out["main_value"] = getattr(cfg, name)
    box: list[Any] = []
    if "cache_size_limit" in cfg._config and name != "cache_size_limit":
        cfg.cache_size_limit = 40
        th = threading.Thread(target=lambda: box.append(getattr(cfg, name)))
        th.start()
        th.join()
    out["alias_seen_by_new_thread"] = box[0] if box else None
    before = cfg.get_hash()
    th = threading.Thread(target=lambda: setattr(cfg, "capture_scalar_outputs", not cfg.capture_scalar_outputs))
    th.start()
    th.join()
    out["main_hash_unchanged_by_child"] = cfg.get_hash() == before
    return out

"""H5, process-wide config writes: the flag that every ``dynamic=True`` call flips (torch < 2.12)."""

from __future__ import annotations

import threading
import time
from typing import Any

from torch_threadsafe_compile.selftest import _start_join, scenario


@scenario
def dynamic_flag_poll(seconds: float = 2.0) -> dict[str, Any]:
    """H5: one thread calls a function compiled with ``dynamic=True``; another polls dynamo's
    ``assume_static_by_default`` (True by default), which upstream (< 2.12) every such call flips process-wide."""
    import torch
    import torch._dynamo.config as config

    f = torch.compile(lambda t: t * 2 + 1, backend="eager", dynamic=True)
    x = torch.randn(8)
    f(x)
    default = config.assume_static_by_default
    stop = time.monotonic() + seconds
    seen = {"default": default, "polls": 0, "flipped": 0, "calls": 0}

    def caller() -> None:
        while time.monotonic() < stop:
            f(x)
            seen["calls"] += 1

    def poller() -> None:
        while time.monotonic() < stop:
            seen["polls"] += 1
            if config.assume_static_by_default != default:
                seen["flipped"] += 1

    _start_join([threading.Thread(target=caller), threading.Thread(target=poller)])
    seen["after"] = config.assume_static_by_default
    return seen

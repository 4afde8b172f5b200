"""H7, random numbers: a compile sets the process-wide generators back under other threads."""

from __future__ import annotations

import threading
from typing import Any

from torch_threadsafe_compile.selftest import scenario


@scenario
def compile_rng_rollback(compiles: int = 6, backend: str = "aot_eager", source: str = "torch") -> dict[str, Any]:
    """H7 (patch rng_rollback): one thread draws ``torch.rand(4)`` without pause while the main thread compiles
    ``compiles`` small functions. Dynamo sets the process-wide generator back after every compile, so the
    numbers drawn meanwhile are drawn again: ``repeats`` counts tensors seen twice (unpatched > 0).
    ``source="python"``: the thread draws four ``random.random()`` instead (Python's generator, which dynamo
    sets back too: in Python up to torch 2.11, in C++ from 2.12)."""
    import random

    import torch

    seen: dict[tuple[float, ...], int] = {}
    stop = threading.Event()

    def draw() -> tuple[float, ...]:
        if source == "python":
            return (random.random(), random.random(), random.random(), random.random())
        return tuple(torch.rand(4).tolist())

    def drawer() -> None:
        while not stop.is_set():
            key = draw()
            seen[key] = seen.get(key, 0) + 1

    t = threading.Thread(target=drawer)
    t.start()
    try:
        for i in range(compiles):
            f = torch.compile(lambda x, i=i: (x * (i + 1)).sin() + x.cos(), backend=backend)
            f(torch.randn(8))
    finally:
        stop.set()
        t.join()
    out: dict[str, Any] = {"draws": sum(seen.values()), "repeats": sum(n - 1 for n in seen.values() if n > 1)}
    if source == "python":
        import inspect

        import torch._dynamo.convert_frame as cf

        # Where torch sets Python's generator back: in preserve_global_state (Python, up to 2.11) or in the
        # C++ frame evaluation (2.12 on), which the package does not reach.
        out["restored_in_python"] = "random.setstate" in inspect.getsource(cf.preserve_global_state)
    return out

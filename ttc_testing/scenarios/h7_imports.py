"""H7, imports: the first ``torch.compile`` / ``torch.export.export`` calls of an interpreter, from
several threads at once."""

from __future__ import annotations

import threading
from typing import Any

from torch_threadsafe_compile.selftest import _start_join, scenario


@scenario
def first_import(threads: int = 16) -> dict[str, Any]:
    """H7 (imports): ``threads`` threads make the first ``torch.compile`` / ``torch.export.export`` calls of a
    fresh interpreter at once (half compile and call a function, half export a module). Upstream they enter
    dynamo's import cycles at different modules: ``_DeadlockError`` and partially-initialized-module errors."""
    import torch

    class M(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return x.relu() + 1

    errors: list[str] = []
    bar = threading.Barrier(threads)

    def work(i: int) -> None:
        bar.wait()
        try:
            if i % 2:
                torch.compile(lambda x: x + i, backend="aot_eager")(torch.randn(4))
            else:
                torch.export.export(M(), (torch.randn(4),))
        except BaseException as e:  # the import errors are the point
            errors.append(f"{type(e).__name__}: {str(e)[:100]}")

    _start_join([threading.Thread(target=work, args=(i,)) for i in range(threads)])
    import_errors = [e for e in errors if e.startswith(("ImportError", "_DeadlockError", "ModuleNotFoundError"))
                     or "partially initialized module" in e]
    return {"threads": threads, "errors": len(errors), "import_errors": len(import_errors),
            "kinds": sorted({e.split(":")[0] for e in errors}), "first_error": (import_errors or errors or [""])[0]}

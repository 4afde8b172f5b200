"""H4 — no deadlock between dynamo's compile lock and the autograd engine: lower backward eagerly.

AOTAutograd compiles the backward graph lazily, on the first ``.backward()``, inside the autograd engine;
for CUDA tensors that runs on the engine's per-device worker thread, and ``compile_fx_backward`` takes
dynamo's global ``compile_lock`` (torch 2.6 → 2.15). Meanwhile another thread that holds ``compile_lock``
while dynamo traces ``flex_attention``'s backward calls ``torch.autograd.grad``, which needs that same
worker thread. Each waits for the other: the seed trainer hung in 3 of 3 cold-cache runs on an H200.

``torch._functorch.config.force_non_lazy_backward_lowering = True`` (exists from 2.10) compiles the
backward inside the forward compile, in the thread that already holds the lock, so the autograd worker
never needs the lock: 0 hangs measured. Costs: the first call of a compiled function in training mode
also compiles its backward even if ``.backward()`` is never called (inference under ``torch.no_grad()``
compiles no backward at all, so it pays nothing). A value the program sets itself is respected: this
patch only changes the default, and only while the program has not set it.

For torch 2.6 → 2.9 (the lock exists, the option does not) see ``compile_lock_watchdog``: the hang is detected
and reported instead of silent.
"""

from __future__ import annotations

import sys
from contextvars import ContextVar
from typing import Any

from torch_threadsafe_compile._patching import Changes, run_in_thread
from torch_threadsafe_compile.patches.config_overrides import make_global, reset_config_caches
from torch_threadsafe_compile.registry import PatchSpec

SPEC = PatchSpec(
    id="lazy_backward",
    hazard="H4",
    summary="compile backward with the forward (force_non_lazy_backward_lowering) so the autograd engine never waits for compile_lock",
    upstream="lazy backward since pytorch/pytorch#83367; compile_fx_backward takes compile_lock (2.6+); option force_non_lazy_backward_lowering",
    torch_versions=">=2.10",
    modules=("torch._functorch.config",),
    after=("config_overrides",),
    tested="2.11.0 (H200), 2.13.0",
)

OPTION = "force_non_lazy_backward_lowering"


def _cfg() -> Any:
    return sys.modules["torch._functorch.config"]


def check() -> str | None:
    cfg = _cfg()
    if OPTION not in getattr(cfg, "_config", {}):
        return f"torch._functorch.config.{OPTION} not found"
    return None


def apply(changes: Changes) -> dict[str, Any]:
    cfg = _cfg()
    entry = cfg._config[OPTION]
    if getattr(cfg, OPTION) is True:
        return {"note": "already enabled by the program or the environment"}
    saved = entry.user_override
    if isinstance(saved, ContextVar):
        # 2.12+: set it process-wide the way config_overrides (H6) does, without writing the original
        # variable in this thread's context, so that revert is exact.
        make_global(cfg, OPTION, True)
    else:  # <= 2.11: config values are process-wide already
        setattr(cfg, OPTION, True)

    def undo() -> None:
        entry.user_override = saved  # a ContextVar on 2.12+, the plain value before
        reset_config_caches(cfg)

    changes.on_revert(undo)
    return {}


def verify() -> None:
    cfg = _cfg()
    if run_in_thread(lambda: getattr(cfg, OPTION)) is not True:
        raise AssertionError(f"{OPTION} is not seen by a new thread")

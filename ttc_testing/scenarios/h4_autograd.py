"""H4, the compile lock vs the autograd engine: the GPU layout (drafter threads training compiled
flex_attention) and its two halves on a CPU."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from torch_threadsafe_compile.selftest import _start_join, _uncompiled_frames, scenario


@scenario
def drafter_flex(drafters: int = 3, targets: int = 2, steps: int = 4, seq: int = 1024, target_mode: str = "default") -> dict[str, Any]:
    """H4 (CUDA): drafter threads train with compiled flex_attention (fwd+bwd, block-sparse causal
    document mask) while target threads run a compiled MLP forward. Run with a cold inductor cache
    (TORCHINDUCTOR_CACHE_DIR pointing at an empty directory) and a timeout: unpatched it can hang.
    ``target_mode``: the targets' ``torch.compile`` mode (``reduce-overhead``: CUDA graph trees, H7)."""
    import collections

    import torch
    import torch._dynamo.utils as du
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not torch.cuda.is_available():
        return {"skipped": "needs CUDA (flex_attention backward is not implemented on CPU)"}
    d = "cuda"
    errs: collections.Counter[str] = collections.Counter()
    done: collections.Counter[str] = collections.Counter()
    flex = torch.compile(flex_attention)
    B, H, S, D = 2, 8, seq, 64  # noqa: N806 - attention's shape names

    def doc_causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (q >= kv) & (q // 256 == kv // 256)

    bm = create_block_mask(doc_causal, B, H, S, S, device=d)

    def randn(*shape: int, **kw: Any) -> Any:
        # With CUDA graphs (reduce-overhead) in some thread, no other thread may draw from the device's
        # CUDA generator while a graph is recorded: its capture state is device-wide (docs/hazards.md, H7).
        if target_mode == "default":
            return torch.randn(*shape, device=d, **kw)
        return torch.randn(*shape, **kw).to(d)
    target = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).to(d)
    target_c = torch.compile(target, mode=None if target_mode == "default" else target_mode)

    def drafter(i: int) -> None:
        w = randn(D, D, dtype=torch.bfloat16).requires_grad_()
        for _ in range(steps):
            try:
                q, k, v = (randn(B, H, S, D, dtype=torch.bfloat16) @ w for _ in range(3))
                flex(q, k, v, block_mask=bm).float().sum().backward()
                done["drafter_steps"] += 1
            except Exception as e:
                errs[type(e).__name__ + ": " + str(e)[:70]] += 1

    def tgt(i: int) -> None:
        for _ in range(steps * 4):
            try:
                with torch.no_grad():
                    target_c(randn(64, 1024))
                done["target_steps"] += 1
            except Exception as e:
                errs[type(e).__name__ + ": " + str(e)[:70]] += 1

    ts = [threading.Thread(target=drafter, args=(i,)) for i in range(drafters)]
    ts += [threading.Thread(target=tgt, args=(i,)) for i in range(targets)]
    t0 = time.time()
    _start_join(ts)
    return {
        "done": dict(done),
        "errors": sum(errs.values()),
        "kinds": list(errs)[:3],
        "graphs": int(du.counters["stats"]["unique_graphs"]),
        "uncompiled_frames": _uncompiled_frames(),
        "wall_s": round(time.time() - t0, 1),
    }


@scenario
def backward_lock_wait(worker: int = 1, hold_s: float = 5.0, threads_first: int = 1) -> dict[str, Any]:
    """H4's two halves on a CPU: a compiled graph whose backward compiler takes ``compile_lock`` (as inductor's
    does from torch 2.6); another thread holds that lock (as a thread tracing flex_attention's backward does
    while it waits for the autograd engine). Does this thread's backward finish within ``hold_s``?

    ``worker=1`` makes the package treat the CPU as a device whose backward runs on an autograd worker thread
    (as CUDA's does), so that ``lazy_backward`` acts as it would on a GPU; unpatched it changes nothing.
    ``threads_first=1``: the program has started a thread of its own before the compile (the lock holder
    below starts after it), as a multi-threaded program has; 0: the compile runs in a single-threaded
    program."""
    import torch
    import torch._dynamo
    import torch._dynamo.convert_frame as cf
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    import torch_threadsafe_compile as ttc

    if worker and ttc.is_patched("lazy_backward"):
        from torch_threadsafe_compile.patches import lazy_backward

        lazy_backward.BACKWARD_IN_CALLING_THREAD = frozenset()
    events: list[str] = []

    def fw(gm: Any, ex: Any) -> Any:
        events.append("fw")
        return make_boxed_func(gm.forward)

    # Inductor's backward compiler takes compile_lock from torch 2.6 on; before, it does not (and H4 cannot occur).
    takes_lock = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 6)

    def bw(gm: Any, ex: Any) -> Any:
        with cf.compile_lock if takes_lock else contextlib.nullcontext():
            events.append("bw")
            return make_boxed_func(gm.forward)

    f = torch.compile(lambda x: (x * 3).sin().sum(), backend=aot_autograd(fw_compiler=fw, bw_compiler=bw))
    x = torch.randn(8, requires_grad=True)
    idle = threading.Event()
    if threads_first:
        threading.Thread(target=idle.wait, args=(120,), daemon=True).start()
    y = f(x)
    idle.set()
    compiled_with_forward = "bw" in events
    held, release, done = threading.Event(), threading.Event(), threading.Event()

    def holder() -> None:
        with cf.compile_lock:
            held.set()
            release.wait(60)

    threading.Thread(target=holder, daemon=True).start()
    held.wait(30)
    t0 = time.monotonic()
    threading.Thread(target=lambda: (y.backward(), done.set()), daemon=True).start()
    finished = done.wait(hold_s)
    release.set()
    done.wait(60)
    # The package changes no config value for this (main thread, and a new thread).
    cfg = torch._functorch.config
    option: list[Any] = []
    reader = threading.Thread(target=lambda: option.append(getattr(cfg, "force_non_lazy_backward_lowering", None)))
    reader.start()
    reader.join()
    return {"backward_compiled_with_forward": compiled_with_forward, "backward_blocked": not finished,
            "backward_s": round(time.monotonic() - t0, 2),
            "grad_ok": bool(x.grad is not None and torch.allclose(x.grad, 3 * torch.cos(3 * x))),
            "option_main": getattr(cfg, "force_non_lazy_backward_lowering", None), "option_thread": option[0]}

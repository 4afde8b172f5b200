"""H7 on a GPU: CUDA graph trees (``torch.compile(mode="reduce-overhead")``) from many threads.

Every scenario runs in a fresh interpreter with an empty inductor/Triton cache (cold compiles), once with
``TTC_DISABLE=1`` and once with the package active, and prints one JSON line; the parent writes all rows
to ``--out`` and a Markdown table to stdout.

* ``layout_cold``: one compiled module shared by ``--threads`` threads, first called by all of them at once;
  ``layout_warm``: the same, warmed (recorded and replayed) in the main thread first;
  ``layout_per_thread``: one module and one ``torch.compile`` wrapper per thread. Inference (no_grad);
  every output is compared with the eager module on the same input, before the thread's next call.
* ``training``: 4 threads, each with its own model copy, a compiled model (forward and backward CUDA graphs)
  and a compiled ``SGD(momentum)`` step, both ``reduce-overhead``; per-step losses and final parameters
  are compared with an eager run of the same steps. The main thread runs the same loop first, as the
  single-thread baseline (what upstream supports).
* ``memory``: the bytes of every thread's graph pool (the snapshot's segments of the pool id of that
  thread's tree manager) while the threads are alive, after they ended, and after ``torch._dynamo.reset()``.
* ``h4``: ``ttc_testing.scenarios.drafter_flex`` (drafter threads training compiled flex_attention, target
  threads running a compiled MLP) with ``target_mode=reduce-overhead``, ``--h4-runs`` times, each under a
  timeout with a stack-dumping watchdog (a run that does not finish is a hang).

How replays are counted. A reduce-overhead call runs one of three things: a warm-up (the model itself, with
allocations routed to the tree's pool: ``CUDAGraphTreeManager.run_eager``), a recording
(``record_function``: a capture, then one launch) or a replay of a recorded graph (``execute_node``: a graph
launch, nothing else). Anything else (re-record limit, mutated inputs) runs the model directly, unseen by
those three: a *fallback*. The child wraps the three methods (bench-side only) and counts calls per tree
owner and per mode (FORWARD, BACKWARD, INFERENCE), the owner being the container dict that the tree
lookup resolves in the calling context — the thread itself, or, for a backward on an autograd worker, the
thread whose graph task it runs. ``counters["inductor"]["cudagraph_skips"]`` counts decisions not to use
CUDA graphs at all and is reported too. For one-graph inference calls, fallbacks = calls - warm-ups -
recordings - replays.

    python bench/cudagraph_threads.py --out DIR                  # everything (~4-5 min on one H200, cold caches)
    python bench/cudagraph_threads.py --only layouts,training    # what tests/test_cudagraph_threads.py runs
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import time
from typing import Any, Callable

from _harness import (
    ACTIVE,
    UNPATCHED,
    cell,
    child_call,
    error_kind,
    md_table,
    mode_label,
    print_result,
    report_pool,
    run_cold,
    run_pool,
    run_row,
)

PATCH_ID = "cudagraph_trees_per_thread"
DEVICE = "cuda"  # the child's; "cpu" only for a dry run of the bench's own plumbing (no CUDA graphs there)
LAYOUTS = ("layout_cold", "layout_warm", "layout_per_thread")
GROUPS = ("layouts", "training", "memory", "h4")

# =====================================================================================================
# Child side: runs in a fresh interpreter.
# =====================================================================================================


def _patch_state(disabled: bool) -> dict[str, Any]:
    """The patch as this process has it. Active but not registered (yet): applied by hand, as a test would."""
    if disabled:
        return {"state": "disabled"}
    out: dict[str, Any] = {}
    try:
        import torch_threadsafe_compile as ttc

        rows = {p["id"]: p for p in ttc.status()["patches"]}
        if PATCH_ID in rows:
            row = rows[PATCH_ID]
            return {"state": row["state"], "reason": row.get("reason", ""), "by": "registry"}
        out["registry"] = "not registered"
    except Exception as e:  # the bench reports it and applies by hand
        out["registry"] = f"status() failed: {type(e).__name__}: {e}"
    import importlib

    from torch_threadsafe_compile._journal import Changes

    mod = importlib.import_module(f"torch_threadsafe_compile.patches.{PATCH_ID}")
    problem = mod.check()
    if problem:
        return {**out, "state": "skipped", "reason": problem, "by": "hand"}
    mod.apply(Changes(PATCH_ID))
    mod.verify()
    return {**out, "state": "applied", "by": "hand"}


class Counts:
    """Warm-ups, recordings and replays per tree owner and mode (see the module docstring)."""

    def __init__(self, cgt: Any) -> None:
        self.cgt = cgt
        self.lock = threading.Lock()
        self.by_owner: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.by_thread: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        mgr = cgt.CUDAGraphTreeManager

        def mode_of(manager: Any, fid: Callable[[tuple[Any, ...]], Any], args: tuple[Any, ...]) -> str:
            try:
                return manager.id_to_mode[fid(args)].name
            except Exception:  # keyword call, or trees without modes
                return "?"

        def wrap(name: str, kind: str, fid: Callable[[tuple[Any, ...]], Any]) -> None:
            original = mgr.__dict__[name]

            def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
                self_counts.add(kind, mode_of(self, fid, args))
                return original(self, *args, **kwargs)

            counted.__wrapped__ = original  # type: ignore[attr-defined]
            setattr(mgr, name, counted)

        self_counts = self
        wrap("run_eager", "warmup", lambda a: a[1])  # (new_inputs, function_id)
        wrap("record_function", "record", lambda a: a[1])  # (new_inputs, function_id)
        wrap("execute_node", "replay", lambda a: a[0].wrapped_function.id)  # (node, new_inputs)

    def owner(self) -> int:
        try:
            return id(self.cgt.get_obj(self.cgt.local, "tree_manager_containers"))
        except Exception:  # upstream asserts in threads without containers
            return -1

    def add(self, kind: str, mode: str) -> None:
        key, ident = self.owner(), threading.get_ident()
        with self.lock:
            self.by_owner[key][f"{kind}:{mode}"] += 1
            self.by_thread[ident][f"{kind}:{mode}"] += 1

    def of(self, owner: int) -> dict[str, int]:
        with self.lock:
            return dict(self.by_owner.get(owner, {}))

    def in_thread(self, ident: int) -> dict[str, int]:
        """What ran in that thread, whichever tree it belongs to (unpatched threads can run the main thread's)."""
        with self.lock:
            return dict(self.by_thread.get(ident, {}))


def _total(c: dict[str, int], kind: str, mode: str | None = None) -> int:
    return sum(v for k, v in c.items() if k.startswith(kind + ":") and (mode is None or k.endswith(":" + mode)))


def _setup(disabled: bool) -> tuple[Any, Any, Counts, dict[str, Any]]:
    import torch
    import torch._dynamo
    import torch._dynamo.eval_frame  # the patch's second module
    import torch._inductor.cudagraph_trees as cgt  # in the main thread: upstream's containers are main's

    state = _patch_state(disabled)
    return torch, cgt, Counts(cgt), state


def _common(torch: Any, t0: float) -> dict[str, Any]:
    import torch._dynamo.utils as du

    frames = du.counters["frames"]
    return {
        "graphs": int(du.counters["stats"]["unique_graphs"]),
        "uncompiled_frames": int(frames["total"] - frames["ok"]),
        "cudagraph_skips": int(sum(du.counters["inductor"].get(k, 0) for k in du.counters["inductor"] if "cudagraph_skip" in k)),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
        "wall_s": round(time.time() - t0, 1),
    }


def _patch_report(state: dict[str, Any]) -> dict[str, Any]:
    if state.get("state") != "applied":
        return {}
    try:
        import importlib

        return importlib.import_module(f"torch_threadsafe_compile.patches.{PATCH_ID}").report()
    except Exception as e:
        return {"report_error": str(e)}


def _mlp(torch: Any, width: int, hidden: int) -> Any:
    return torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, width))


def child_layout(which: str, disabled: bool, threads: int = 16, calls: int = 8, width: int = 256) -> dict[str, Any]:
    torch, _cgt, counts, state = _setup(disabled)
    t0 = time.time()
    dev = DEVICE
    torch.manual_seed(0)
    models = [_mlp(torch, width, 2 * width).to(dev).eval() for _ in range(threads if which == "layout_per_thread" else 1)]
    shared = torch.compile(models[0], mode="reduce-overhead") if which != "layout_per_thread" else None

    def run_calls(model: Any, fn: Any, row: dict[str, Any]) -> None:
        for _ in range(calls):
            # Inputs from the CPU generator: while a thread records a CUDA graph, the device's CUDA
            # generator is in capture mode for every thread (a documented limit, docs/hazards.md H7).
            x = torch.randn(64, width).to(dev)
            try:
                with torch.no_grad():
                    out = fn(x)
                    ref = model(x)
                    err = float((out - ref).abs().max())
                row["calls"] += 1
                row["max_err"] = max(row["max_err"], err)
                if not torch.allclose(out, ref, rtol=1e-3, atol=1e-3):
                    row["mismatches"] += 1
            except Exception as e:  # counted per kind
                row["errors"] += 1
                row["kinds"][error_kind(e)] += 1

    def new_row(name: str) -> dict[str, Any]:
        return {"name": name, "calls": 0, "errors": 0, "mismatches": 0, "max_err": 0.0, "kinds": collections.Counter()}

    main_row = None
    if which == "layout_warm":
        main_row = new_row("main")
        run_calls(models[0], shared, main_row)
        main_row["owner"], main_row["ident"] = counts.owner(), threading.get_ident()
    rows = [new_row(f"t{i}") for i in range(threads)]
    barrier = threading.Barrier(threads)

    def worker(i: int) -> None:
        row = rows[i]
        model = models[i] if which == "layout_per_thread" else models[0]
        fn = torch.compile(model, mode="reduce-overhead") if which == "layout_per_thread" else shared
        try:
            barrier.wait(timeout=120)
        except threading.BrokenBarrierError:
            row["kinds"]["BrokenBarrierError"] += 1
        run_calls(model, fn, row)
        row["owner"], row["ident"] = counts.owner(), threading.get_ident()

    ts = [threading.Thread(target=worker, args=(i,), name=f"t{i}") for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    main_owner = main_row["owner"] if main_row else counts.owner()
    out_rows = []
    for row in ([main_row] if main_row else []) + rows:
        # Inference graphs run in the calling thread: count what ran there, and say whose tree it was.
        c = counts.in_thread(row.pop("ident", 0))
        owner = row.pop("owner", -1)
        done = _total(c, "warmup") + _total(c, "record") + _total(c, "replay")
        row.update(own_tree=owner != -1 and (owner != main_owner or row["name"] == "main"),
                   warmups=_total(c, "warmup"), recordings=_total(c, "record"), replays=_total(c, "replay"),
                   fallbacks=max(0, row["calls"] - done), kinds=dict(row["kinds"].most_common(3)), max_err=round(row["max_err"], 7))
        out_rows.append(row)
    workers = [r for r in out_rows if r["name"] != "main"]
    kinds: collections.Counter[str] = collections.Counter()
    for r in out_rows:
        kinds.update(r["kinds"])
    res = {
        "threads": threads, "calls_per_thread": calls,
        "ok_calls": sum(r["calls"] for r in out_rows), "errors": sum(r["errors"] for r in out_rows),
        "mismatches": sum(r["mismatches"] for r in out_rows), "max_err": max(r["max_err"] for r in out_rows),
        "threads_with_replays": sum(1 for r in workers if r["replays"] > 0),
        "threads_with_own_tree": sum(1 for r in workers if r["own_tree"]),
        "min_replays": min(r["replays"] for r in workers), "fallbacks": sum(r["fallbacks"] for r in out_rows),
        "kinds": dict(kinds.most_common(3)), "rows": out_rows, "patch": state, "patch_report": _patch_report(state),
    }
    res["ok"] = (res["errors"] == 0 and res["mismatches"] == 0 and res["threads_with_replays"] == threads
                 and res["threads_with_own_tree"] == threads and res["fallbacks"] == 0)
    res.update(_common(torch, t0))
    return res


def _opt_step(opt: Any) -> None:
    opt.step()


def child_training(disabled: bool, threads: int = 4, steps: int = 8, width: int = 64) -> dict[str, Any]:
    import copy

    torch, _cgt, counts, state = _setup(disabled)
    t0 = time.time()
    dev = DEVICE
    F = torch.nn.functional  # noqa: N806 - torch's own short name
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.ReLU(), torch.nn.Linear(4 * width, width)).to(dev)

    def batch(i: int, s: int) -> tuple[Any, Any]:
        g = torch.Generator().manual_seed(1000 * i + s)
        return torch.randn(32, width, generator=g).to(dev), torch.randn(32, width, generator=g).to(dev)

    def new_opt(m: Any) -> Any:
        # No optimizer state: state tensors created inside a CUDA-graphed step are graph outputs that the
        # next recording overwrites (upstream raises "overwritten by a subsequent run" in the main thread too).
        return torch.optim.SGD(m.parameters(), lr=0.05)

    # Eager reference trajectories, in the main thread before anything is compiled.
    refs = []
    for i in range(threads + 1):
        m = copy.deepcopy(base)
        opt = new_opt(m)
        losses = []
        for s in range(steps):
            x, y = batch(i, s)
            loss = F.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
        refs.append((losses, [p.detach().clone() for p in m.parameters()]))

    # One compiled step function for five optimizers (main + threads), each a guard set of its own: the
    # limit is raised above dynamo's default of 8 entries per code object.
    import torch._dynamo.config as dynamo_config

    setattr(dynamo_config, "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit", 64)
    opt_step = torch.compile(_opt_step, mode="reduce-overhead")

    def train(i: int, row: dict[str, Any]) -> None:
        m = copy.deepcopy(base)
        model = torch.compile(m, mode="reduce-overhead")
        opt = new_opt(m)
        losses = []
        try:
            for s in range(steps):
                torch.compiler.cudagraph_mark_step_begin()  # a new iteration: earlier outputs may be overwritten
                x, y = batch(i, s)
                loss = F.mse_loss(model(x), y)
                loss.backward()
                losses.append(float(loss))
                opt_step(opt)
                opt.zero_grad(set_to_none=True)
        except Exception as e:  # counted
            row["errors"] += 1
            row["kinds"][error_kind(e)] += 1
        ref_losses, ref_params = refs[i]
        row["steps"] = len(losses)
        row["loss_err"] = max((abs(a - b) / max(abs(b), 1e-6) for a, b in zip(losses, ref_losses)), default=None)
        if len(losses) == steps:
            row["param_err"] = max(float((p.detach() - q).abs().max()) for p, q in zip(m.parameters(), ref_params))
            row["matches_eager"] = row["loss_err"] <= 1e-3 and row["param_err"] <= 1e-3
        else:
            row["param_err"], row["matches_eager"] = None, False
        row["owner"] = counts.owner()

    def new_row(name: str) -> dict[str, Any]:
        return {"name": name, "errors": 0, "kinds": collections.Counter()}

    baseline = new_row("main")
    train(threads, baseline)  # data index `threads`: the baseline's own reference
    rows = [new_row(f"t{i}") for i in range(threads)]
    barrier = threading.Barrier(threads)

    def worker(i: int) -> None:
        try:
            barrier.wait(timeout=120)
        except threading.BrokenBarrierError:
            rows[i]["kinds"]["BrokenBarrierError"] += 1
        train(i, rows[i])

    ts = [threading.Thread(target=worker, args=(i,), name=f"t{i}") for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    for row in [baseline, *rows]:
        owner = row.pop("owner", -1)
        c = counts.of(owner) if owner != -1 else {}
        row["replays"] = {mode: _total(c, "replay", mode) for mode in ("FORWARD", "BACKWARD", "INFERENCE")}
        row["recordings"] = _total(c, "record")
        row["warmups"] = _total(c, "warmup")
        row["kinds"] = dict(row["kinds"].most_common(3))
    kinds: collections.Counter[str] = collections.Counter()
    for r in [baseline, *rows]:
        kinds.update(r["kinds"])
    ok_threads = [r for r in rows
                  if r["errors"] == 0 and r["matches_eager"] and r["replays"]["FORWARD"] > 0 and r["replays"]["BACKWARD"] > 0]
    res = {
        "threads": threads, "steps": steps, "baseline": baseline, "rows": rows,
        "errors": sum(r["errors"] for r in rows), "baseline_errors": baseline["errors"],
        "threads_matching_eager": sum(1 for r in rows if r["matches_eager"]),
        "threads_with_fwd_bwd_replays": sum(1 for r in rows if r["replays"]["FORWARD"] > 0 and r["replays"]["BACKWARD"] > 0),
        "threads_with_opt_replays": sum(1 for r in rows if r["replays"]["INFERENCE"] > 0),
        "kinds": dict(kinds.most_common(3)), "patch": state, "patch_report": _patch_report(state),
    }
    res["ok"] = len(ok_threads) == threads
    res.update(_common(torch, t0))
    return res


def _pool_bytes(torch: Any) -> dict[tuple[int, int], int]:
    out: dict[tuple[int, int], int] = collections.defaultdict(int)
    for seg in torch.cuda.memory_snapshot():
        pool = seg.get("segment_pool_id")
        if pool is not None:
            out[tuple(pool)] += int(seg.get("total_size", 0))
    return out


def child_memory(disabled: bool, threads: int = 4, calls: int = 6, width: int = 1024, batch: int = 256) -> dict[str, Any]:
    import gc

    if DEVICE != "cuda":
        return {"ok": False, "skipped": "needs CUDA (memory snapshots)"}
    torch, cgt, _counts, state = _setup(disabled)
    t0 = time.time()
    dev = DEVICE
    mib = 1024 * 1024
    torch.manual_seed(0)
    model = _mlp(torch, width, 4 * width).to(dev).eval()
    fn = torch.compile(model, mode="reduce-overhead")

    def settle(empty: bool) -> None:
        gc.collect()
        torch.cuda.synchronize()
        if empty:
            torch.cuda.empty_cache()

    def my_pool() -> tuple[int, int] | None:
        try:
            mgr = cgt.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
            return tuple(mgr.cuda_graphs_thread_pool) if mgr is not None else None
        except Exception:  # upstream asserts in threads without containers
            return None

    def run(row: dict[str, Any]) -> None:
        for _ in range(calls):
            try:
                with torch.no_grad():
                    x = torch.randn(batch, width).to(dev)  # CPU generator: see run_calls
                    out = fn(x)
                    if not torch.allclose(out, model(x), rtol=1e-3, atol=1e-3):
                        row["mismatches"] += 1
                row["calls"] += 1
            except Exception as e:
                row["errors"] += 1
                row["kinds"][error_kind(e)] += 1
        row["pool"] = my_pool()

    settle(True)
    reserved = {"start": torch.cuda.memory_reserved() / mib}
    main_row: dict[str, Any] = {"calls": 0, "errors": 0, "mismatches": 0, "kinds": collections.Counter()}
    run(main_row)
    rows = [{"calls": 0, "errors": 0, "mismatches": 0, "kinds": collections.Counter()} for _ in range(threads)]
    done = threading.Barrier(threads + 1)
    release = threading.Event()

    def worker(i: int) -> None:
        run(rows[i])
        try:
            done.wait(timeout=120)
        except threading.BrokenBarrierError:
            pass
        release.wait(timeout=120)  # alive while the main thread measures

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    try:
        done.wait(timeout=180)
    except threading.BrokenBarrierError:
        pass
    settle(False)
    alive = _pool_bytes(torch)
    reserved["threads_alive"] = torch.cuda.memory_reserved() / mib
    release.set()
    for t in ts:
        t.join()
    settle(True)
    ended = _pool_bytes(torch)
    reserved["threads_ended"] = torch.cuda.memory_reserved() / mib
    torch._dynamo.reset()
    settle(True)
    after_reset = _pool_bytes(torch)
    reserved["after_reset"] = torch.cuda.memory_reserved() / mib

    def size(pools: dict[tuple[int, int], int], pool: Any) -> float | None:
        return None if pool is None else round(pools.get(tuple(pool), 0) / mib, 1)

    thread_pools = [r["pool"] for r in rows]
    per_thread = [size(alive, p) for p in thread_pools]
    known = [v for v in per_thread if v is not None]
    kinds: collections.Counter[str] = collections.Counter()
    for r in [main_row, *rows]:
        kinds.update(r["kinds"])
    res = {
        "threads": threads, "calls_per_thread": calls,
        "errors": sum(r["errors"] for r in [main_row, *rows]), "mismatches": sum(r["mismatches"] for r in [main_row, *rows]),
        "kinds": dict(kinds.most_common(3)),
        "distinct_thread_pools": len({p for p in thread_pools if p is not None}),
        "main_pool_mib": size(alive, main_row["pool"]),
        "thread_pool_mib": per_thread,
        "thread_pool_mib_mean": round(sum(known) / len(known), 1) if known else None,
        "thread_pools_left_after_end_mib": round(sum(ended.get(tuple(p), 0) for p in thread_pools if p is not None) / mib, 1),
        "main_pool_after_end_mib": size(ended, main_row["pool"]),
        "main_pool_after_reset_mib": size(after_reset, main_row["pool"]),
        "thread_pools_left_after_reset_mib": round(sum(after_reset.get(tuple(p), 0) for p in thread_pools if p is not None) / mib, 1),
        "reserved_mib": {k: round(v, 1) for k, v in reserved.items()},
        "patch": state, "patch_report": _patch_report(state),
    }
    # A pool that the snapshot does not show (0 MiB while alive) would make "freed" vacuous.
    res["freed_at_thread_end"] = bool(known) and min(known) > 0 and res["thread_pools_left_after_end_mib"] == 0
    res["main_freed_on_reset"] = res["main_pool_after_reset_mib"] == 0
    res["ok"] = res["errors"] == 0 and res["mismatches"] == 0 and len(known) == threads and res["freed_at_thread_end"]
    res.update(_common(torch, t0))
    return res


def child_h4(disabled: bool) -> dict[str, Any]:
    torch, _cgt, counts, state = _setup(disabled)
    t0 = time.time()
    from ttc_testing.scenarios import drafter_flex  # the repository root is on sys.path (_harness)

    res = drafter_flex(target_mode="reduce-overhead")
    with counts.lock:
        owners = {k: dict(v) for k, v in counts.by_owner.items()}
    res["target_replays"] = sum(_total(c, "replay", "INFERENCE") for c in owners.values())
    res["owners_with_replays"] = sum(1 for c in owners.values() if _total(c, "replay") > 0)
    res["patch"] = state
    res["ok"] = res.get("errors") == 0 and res["owners_with_replays"] >= 2
    res.update({k: v for k, v in _common(torch, t0).items() if k not in res})
    return res


CHILDREN: dict[str, Callable[..., dict[str, Any]]] = {
    "layout_cold": lambda disabled, **kw: child_layout("layout_cold", disabled, **kw),
    "layout_warm": lambda disabled, **kw: child_layout("layout_warm", disabled, **kw),
    "layout_per_thread": lambda disabled, **kw: child_layout("layout_per_thread", disabled, **kw),
    "training": child_training,
    "memory": child_memory,
    "h4": child_h4,
}


def child_main(name: str, kwargs: dict[str, Any], watchdog: float, device: str) -> None:
    global DEVICE
    DEVICE = device
    print_result(child_call(lambda disabled: CHILDREN[name](disabled, **kwargs), watchdog))


# =====================================================================================================
# Parent side.
# =====================================================================================================


def run_job(job: dict[str, Any], out_dir: str | None) -> dict[str, Any]:
    disabled = job["disabled"]
    timeout = job["timeout"]
    watchdog = max(10, int(timeout // 3)) if job["name"] == "h4" and not disabled else None
    cmd = [sys.executable, "-X", "faulthandler", os.path.abspath(__file__), "--child", job["name"],
           "--child-args", json.dumps(job["kwargs"]), "--child-watchdog", str(timeout), "--child-device", job["device"]]
    pr = run_cold(cmd, disabled, timeout + 30, watchdog_s=watchdog)
    row = run_row(pr, job=job["tag"], scenario=job["name"], package=mode_label(disabled))
    rc, err = row["rc"], pr["stderr"]
    if row["completed"] and rc not in (0, None):  # the result is in; the process died afterwards (exit)
        row["exit_problem"] = err.strip().splitlines()[-1][:200] if err.strip() else f"rc={rc}"
    elif not row["completed"] and out_dir:
        with open(os.path.join(out_dir, f"stderr-{job['tag']}.txt"), "w") as fh:
            fh.write(err[-400000:])
    return row


def plan(a: argparse.Namespace) -> list[dict[str, Any]]:
    groups = set(a.only.split(",")) if a.only else set(GROUPS)
    unknown = groups - set(GROUPS)
    if unknown:
        raise SystemExit(f"--only: unknown {sorted(unknown)}; choose from {GROUPS}")
    jobs: list[dict[str, Any]] = []

    def add(name: str, disabled: bool, timeout: float, tag: str, **kwargs: Any) -> None:
        jobs.append({"name": name, "disabled": disabled, "timeout": timeout, "tag": tag, "kwargs": kwargs, "device": a.device})

    # Longest first, so that two slots finish together.
    if "training" in groups:
        for disabled in (True, False):
            add("training", disabled, a.timeout * 1.5, f"training-{'off' if disabled else 'on'}", threads=a.train_threads)
    if "layouts" in groups:
        for name in LAYOUTS:
            for disabled in (True, False):
                add(name, disabled, a.timeout, f"{name}-{'off' if disabled else 'on'}", threads=a.threads, calls=a.calls)
    if "memory" in groups:
        for disabled in (True, False):
            add("memory", disabled, a.timeout, f"memory-{'off' if disabled else 'on'}", threads=a.memory_threads)
    if "h4" in groups:
        for i in range(a.h4_unpatched_runs):
            add("h4", True, min(a.h4_timeout, 60.0), f"h4-off-{i}")
        for i in range(a.h4_runs):
            add("h4", False, a.h4_timeout, f"h4-on-{i}")
    return jobs


def _why(r: dict[str, Any]) -> Any:
    """What went wrong in a run, for the last column."""
    if r.get("skipped"):
        return f"not run: {r['skipped']}"
    if r.get("hung"):
        return "hung (stacks in --out)"
    if not r.get("completed", True):
        return f"no result (rc={r.get('rc')})"
    return r.get("kinds") or r.get("exception") or r.get("exit_problem")


def _wall(r: dict[str, Any]) -> Any:
    return r.get("wall_s", r.get("job_wall_s"))


def tables(rows: list[dict[str, Any]]) -> str:
    out = []
    lay = [r for r in rows if r["scenario"] in LAYOUTS]
    if lay:
        out += [md_table(["layout", "package", "threads", "ok", "calls", "errors", "mismatches", "threads with replays",
                          "threads with own tree", "min replays/thread", "fallbacks", "graphs", "wall s", "errors seen"],
                         [[r["scenario"][7:], r["package"], r.get("threads"), r.get("ok"), r.get("ok_calls"), r.get("errors"),
                           r.get("mismatches"), r.get("threads_with_replays"), r.get("threads_with_own_tree"), r.get("min_replays"),
                           r.get("fallbacks"), r.get("graphs"), _wall(r), _why(r)] for r in lay]), ""]
    tr = [r for r in rows if r["scenario"] == "training"]
    if tr:
        body = []
        for r in tr:
            b = r.get("baseline") or {}
            base = f"errors {b.get('errors')}, eager match {cell(b.get('matches_eager'))}, replays {cell(b.get('replays'))}" if b else None
            body.append(["step", r["package"], r.get("threads"), r.get("ok"), r.get("errors"), r.get("threads_matching_eager"),
                         r.get("threads_with_fwd_bwd_replays"), r.get("threads_with_opt_replays"), base, _wall(r), _why(r)])
        out += [md_table(["training", "package", "threads", "ok", "errors", "matching eager", "fwd+bwd replays in", "opt replays in",
                          "main thread (baseline)", "wall s", "errors seen"], body), ""]
    mem = [r for r in rows if r["scenario"] == "memory"]
    if mem:
        body = []
        for r in mem:
            rv = r.get("reserved_mib") or {}
            res_s = " / ".join(cell(rv.get(k)) for k in ("start", "threads_alive", "threads_ended", "after_reset")) if rv else None
            body.append(["pools", r["package"], r.get("threads"), r.get("ok"), r.get("main_pool_mib"), r.get("thread_pool_mib_mean"),
                         r.get("thread_pools_left_after_end_mib"), r.get("main_pool_after_reset_mib"), res_s, _why(r)])
        out += [md_table(["memory", "package", "threads", "ok", "main pool MiB", "thread pools MiB (mean)",
                          "left after threads ended MiB", "main pool after `torch._dynamo.reset()` MiB",
                          "reserved MiB start / alive / ended / reset", "errors seen"], body), ""]
    h4 = [r for r in rows if r["scenario"] == "h4"]
    if h4:
        body = []
        for pkg in (UNPATCHED, ACTIVE):
            sel = [r for r in h4 if r["package"] == pkg]
            if not sel:
                continue
            walls = [r.get("wall_s") for r in sel if r.get("completed") and r.get("wall_s") is not None]
            reps = [r.get("target_replays") for r in sel if r.get("completed")]
            body.append([pkg, len(sel), sum(bool(r.get("completed")) for r in sel), sum(bool(r.get("hung")) for r in sel),
                         sum(1 for r in sel if r.get("completed") and r.get("errors")), sum(1 for r in sel if r.get("skipped")),
                         min(reps) if reps else None, f"{min(walls):g}–{max(walls):g}" if walls else None])
        out += [md_table(["H4 + reduce-overhead targets", "runs", "completed", "hung", "with errors", "not run",
                          "target replays (min)", "wall s (min–max)"], body), ""]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for cudagraph_threads.json and the stderr of failed runs")
    ap.add_argument("--only", default="", help=f"comma-separated subset of {','.join(GROUPS)}")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--train-threads", type=int, default=4)
    ap.add_argument("--memory-threads", type=int, default=4)
    ap.add_argument("--h4-runs", type=int, default=5)
    ap.add_argument("--h4-unpatched-runs", type=int, default=1)
    ap.add_argument("--h4-timeout", type=float, default=90)
    ap.add_argument("--timeout", type=float, default=180, help="per run (training: 1.5x)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (they share the GPU)")
    ap.add_argument("--budget", type=float, default=330, help="start no run after this many seconds")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the bench's plumbing on a machine without a GPU")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--child-args", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--child-watchdog", type=float, default=170, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child_main(a.child, json.loads(a.child_args), a.child_watchdog, a.child_device)
        return
    if a.out:
        os.makedirs(a.out, exist_ok=True)
    jobs = plan(a)
    t0 = time.time()
    print(json.dumps({"bench": "cudagraph_threads", "jobs": len(jobs), "parallel": a.jobs, "python": sys.version.split()[0]}), flush=True)
    rows = run_pool(jobs, lambda job: run_job(job, a.out), a.jobs, a.budget, hide=("rows", "traceback", "tail"))
    report_pool(rows, a.out and os.path.join(a.out, "cudagraph_threads.json"), tables(rows), t0)


if __name__ == "__main__":
    main()

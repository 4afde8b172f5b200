"""H7 on a GPU: random numbers drawn in other threads while one thread records a CUDA graph (patch
``cudagraph_rng``, with ``cudagraph_trees_per_thread`` on torch < 2.13).

Every scenario runs in a fresh interpreter with an empty inductor/Triton cache, once with ``TTC_DISABLE=1``
and once with the package active, and prints one JSON line; the parent writes all rows to
``--out/cudagraph_rng.json`` and a Markdown table to stdout. Groups (``--only``):

* ``issue``: pytorch#123177's reproduction as stored in the issue thread: ``foo(x, y) = sin(x) + cos(y)``
  compiled with ``mode="max-autotune"``, 32 threads, each drawing ``torch.rand(2, 3, device="cuda")`` twice
  and calling it once; outputs checked against eager.
* ``layouts``: 16 threads x 20 calls of one ``reduce-overhead`` MLP with a fresh
  ``torch.rand(..., device="cuda")`` input per call, in three layouts (``cold``: one compiled module first
  called by all threads at once; ``warm``: the same, recorded and replayed in the main thread first;
  ``per_thread``: a module and ``torch.compile`` per thread). Every output is compared with eager on the
  same input; every input's first 16 numbers are kept, and *repeats* counts inputs drawn twice (the
  generator set back under another thread).
* ``dropout``: one thread trains an MLP with dropout (compiled ``reduce-overhead`` forward and backward,
  SGD) and calls a compiled dropout mask and ``x + rand_like(x)`` function, while 4 threads draw
  ``torch.rand`` on the GPU without pause. Checks: no errors anywhere, masks differ between steps, no
  random tensor (replayed outputs and the other threads' draws) occurs twice, losses finite.
* ``server``: a thread pool (``--workers``) serving ``--requests`` HF ``generate`` requests of a randomly
  initialised small Llama (``transformers``; static KV cache per worker; ``model.forward`` compiled with
  ``reduce-overhead``), 3 in 4 sampled (``do_sample=True``), 1 in 4 greedy; greedy outputs compared with
  eager ``generate`` of the same model; tokens/s with ``--workers`` workers and with 1.
* ``upstream``: ``bench/upstream_tests.py`` on ``inductor/test_cudagraph_trees.py`` under
  ``bench/pytorch_tests/test`` when that file is there (not committed yet: see docs/results), both modes.

    python bench/cudagraph_rng.py --out DIR                  # everything (budget --budget s)
    python bench/cudagraph_rng.py --only issue,layouts,dropout
    bash bench/gpu_rng_batch.sh                              # the whole GPU batch, results under $OUT

Without a CUDA device it says so in one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from _harness import (
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
    unpatched_side,
)
from _repo import ROOT

HERE = os.path.dirname(os.path.abspath(__file__))
GROUPS = ("issue", "layouts", "dropout", "server", "upstream", "window")
LAYOUTS = ("cold", "warm", "per_thread")
PATCHES = ("cudagraph_trees_per_thread", "cudagraph_rng")
UPSTREAM_FILE = os.path.join(HERE, "pytorch_tests", "test", "inductor", "test_cudagraph_trees.py")

# =====================================================================================================
# Child side (fresh interpreter).
# =====================================================================================================


def _patches(disabled: bool) -> dict[str, Any]:
    if disabled:
        return {"state": "disabled"}
    import torch_threadsafe_compile as ttc

    rows = {p["id"]: p for p in ttc.status()["patches"]}
    return {pid: {k: rows.get(pid, {}).get(k) for k in ("state", "reason", "report")} for pid in PATCHES}


def _setup() -> Any:
    import torch
    import torch._dynamo.config as dc
    import torch._inductor.cudagraph_trees

    setattr(dc, "recompile_limit" if hasattr(dc, "recompile_limit") else "cache_size_limit", 64)
    return torch


class Draws:
    """Fingerprints (first 16 values) of random tensors, to count any drawn twice."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: collections.Counter[tuple[float, ...]] = collections.Counter()

    def add(self, t: Any) -> tuple[float, ...]:
        key = tuple(float(v) for v in t.flatten()[:16].tolist())
        with self.lock:
            self.seen[key] += 1
        return key

    def repeats(self) -> int:
        with self.lock:
            return sum(n - 1 for n in self.seen.values() if n > 1)


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    kinds: collections.Counter[str] = collections.Counter()
    for r in rows:
        kinds.update(r["kinds"])
    res = {"calls": sum(r["calls"] for r in rows), "errors": sum(r["errors"] for r in rows),
           "mismatches": sum(r["mismatches"] for r in rows), "threads_failing": sum(1 for r in rows if r["errors"]),
           "kinds": dict(kinds.most_common(3))}
    draws = sum(r["draws"] for r in rows)
    if draws:  # random draws attempted outside compiled code, and those that failed (the capture window)
        res.update(draws=draws, draw_errors=sum(r["draw_errors"] for r in rows),
                   draw_errors_per_1000=round(1000 * sum(r["draw_errors"] for r in rows) / draws, 3))
    return res


def _new_row() -> dict[str, Any]:
    return {"calls": 0, "errors": 0, "mismatches": 0, "draws": 0, "draw_errors": 0, "kinds": collections.Counter()}


def _run_threads(n: int, target: Callable[[int], None]) -> None:
    ts = [threading.Thread(target=target, args=(i,), name=f"w{i}") for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def child_issue(disabled: bool, threads: int = 32) -> dict[str, Any]:
    torch = _setup()

    def foo(x: Any, y: Any) -> Any:
        a = torch.sin(x)
        b = torch.cos(y)
        return a + b

    opt_foo = torch.compile(foo, mode="max-autotune")
    rows = [_new_row() for _ in range(threads)]

    def worker(i: int) -> None:
        try:
            rows[i]["draws"] += 2
            try:
                x = torch.rand(2, 3, device="cuda")
                y = torch.rand(2, 3, device="cuda")
            except Exception:
                rows[i]["draw_errors"] += 1
                raise
            out = opt_foo(x, y)
            rows[i]["calls"] += 1
            rows[i]["mismatches"] += int(not torch.allclose(out, foo(x, y), atol=1e-5))
        except Exception as e:
            rows[i]["errors"] += 1
            rows[i]["kinds"][error_kind(e)] += 1

    _run_threads(threads, worker)
    res = {"threads": threads, **_summary(rows)}
    res["ok"] = res["errors"] == 0 and res["mismatches"] == 0
    return res


def _mismatch(torch: Any, i: int, n: int, row: dict[str, Any], model: Any, fn: Any, x: Any, key: tuple[float, ...],
              out: Any, ref: Any, prev: tuple[Any, Any] | None, counts: Any) -> dict[str, Any]:
    """What a wrong output looked like, read before anything else runs in this thread: how much of it is
    wrong, whether the input changed after it was drawn, whether the output is the previous call's answer
    (a stale or overwritten graph output), whether eager and the compiled call agree when called again."""
    with torch.no_grad():
        close = torch.isclose(out, ref, rtol=1e-3, atol=1e-3)
        d: dict[str, Any] = {
            "thread": i, "call": n, "max_err": float((out - ref).abs().max()), "frac_wrong": round(1 - float(close.float().mean()), 4),
            "nan": bool(torch.isnan(out).any()), "errors_before": row["errors"],
            "input_changed": tuple(float(v) for v in x.flatten()[:16].tolist()) != key,
            "equals_prev_ref": bool(prev is not None and torch.allclose(out, prev[1], rtol=1e-3, atol=1e-3)),
            "out_data_ptr_is_input": out.data_ptr() == x.data_ptr(),
            "counts_in_thread": dict(counts.in_thread(threading.get_ident())),
            "main_thread": threading.current_thread() is threading.main_thread(),
        }
        d["ref_again_ok"] = bool(torch.allclose(ref, model(x), rtol=1e-3, atol=1e-3))
        d["again_ok"] = bool(torch.allclose(fn(x), model(x), rtol=1e-3, atol=1e-3))
    return d


def child_layout(disabled: bool, layout: str, threads: int = 16, calls: int = 20, width: int = 256) -> dict[str, Any]:
    torch = _setup()
    import torch._inductor.cudagraph_trees as cgt
    from cudagraph_threads import Counts, _mlp, _total

    counts = Counts(cgt)
    torch.manual_seed(0)
    models = [_mlp(torch, width, 2 * width).cuda().eval() for _ in range(threads if layout == "per_thread" else 1)]
    shared = None if layout == "per_thread" else torch.compile(models[0], mode="reduce-overhead")
    draws = Draws()
    rows = [_new_row() for _ in range(threads + 1)]

    def calls_in(i: int, model: Any, fn: Any) -> None:
        row = rows[i]
        prev: tuple[Any, Any] | None = None  # the previous call's input and eager output (is a wrong output stale?)
        for n in range(calls):
            row["draws"] += 1
            try:
                x = torch.rand(64, width, device="cuda")
            except Exception as e:
                row["errors"] += 1
                row["draw_errors"] += 1
                row["kinds"][error_kind(e)] += 1
                continue
            try:
                key = draws.add(x)
                with torch.no_grad():
                    out = fn(x)
                    ref = model(x)
                row["calls"] += 1
                if not torch.allclose(out, ref, rtol=1e-3, atol=1e-3):
                    row["mismatches"] += 1
                    row.setdefault("mismatch_detail", []).append(_mismatch(torch, i, n, row, model, fn, x, key, out, ref, prev, counts))
                prev = (x, ref)
            except Exception as e:
                row["errors"] += 1
                row["kinds"][error_kind(e)] += 1
        row["replays"] = _total(counts.in_thread(threading.get_ident()), "replay")

    if layout == "warm":
        calls_in(threads, models[0], shared)
    barrier = threading.Barrier(threads)

    def worker(i: int) -> None:
        model = models[i] if layout == "per_thread" else models[0]
        fn = torch.compile(model, mode="reduce-overhead") if layout == "per_thread" else shared
        barrier.wait(timeout=120)
        calls_in(i, model, fn)

    _run_threads(threads, worker)
    workers = rows[:threads]
    res = {"layout": layout, "threads": threads, "calls_per_thread": calls, **_summary(rows),
           "repeats": draws.repeats(), "threads_with_replays": sum(1 for r in workers if r.get("replays", 0) > 0),
           "mismatch_detail": [d for r in rows for d in r.get("mismatch_detail", [])][:8]}
    res["ok"] = res["errors"] == 0 and res["mismatches"] == 0 and res["repeats"] == 0 and res["threads_with_replays"] == threads
    return res


def child_dropout(disabled: bool, drawers: int = 4, steps: int = 12, width: int = 128) -> dict[str, Any]:
    torch = _setup()
    fnn = torch.nn.functional
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                torch.nn.Linear(4 * width, width)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cmodel = torch.compile(model, mode="reduce-overhead")
    mask_fn = torch.compile(lambda x: fnn.dropout(x, 0.5, training=True), mode="reduce-overhead")
    noise_fn = torch.compile(lambda x: x + torch.rand_like(x), mode="reduce-overhead")
    draws, stop = Draws(), threading.Event()
    rows = [_new_row() for _ in range(drawers + 1)]
    masks: list[Any] = []
    losses: list[float] = []

    def trainer() -> None:
        row = rows[drawers]
        ones, zeros = torch.ones(4096, device="cuda"), torch.zeros(4096, device="cuda")
        for _ in range(steps):
            try:
                torch.compiler.cudagraph_mark_step_begin()
                x, y = torch.randn(32, width, device="cuda"), torch.randn(32, width, device="cuda")
                loss = fnn.mse_loss(cmodel(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(float(loss))
                m = mask_fn(ones).clone()
                masks.append(m)
                draws.add(noise_fn(zeros).clone())
                row["calls"] += 1
            except Exception as e:
                row["errors"] += 1
                row["kinds"][error_kind(e)] += 1
        stop.set()

    def drawer(i: int) -> None:
        row = rows[i]
        while not stop.is_set():
            row["draws"] += 1
            try:
                draws.add(torch.rand(4096, device="cuda"))
                row["calls"] += 1
            except Exception as e:
                row["errors"] += 1
                row["draw_errors"] += 1
                row["kinds"][error_kind(e)] += 1
                time.sleep(0.001)

    ts = [threading.Thread(target=drawer, args=(i,)) for i in range(drawers)] + [threading.Thread(target=trainer)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(600)
    stop.set()
    same_masks = sum(1 for i in range(len(masks)) for j in range(i) if torch.equal(masks[i], masks[j]))
    res = {"steps": steps, "drawers": drawers, **_summary(rows), "repeats": draws.repeats(), "masks": len(masks),
           "equal_mask_pairs": same_masks, "losses_finite": all(v == v and abs(v) < 1e6 for v in losses),
           "last_loss": losses[-1] if losses else None}
    res["ok"] = (res["errors"] == 0 and res["repeats"] == 0 and len(masks) == steps and same_masks == 0 and res["losses_finite"])
    return res


WINDOW_VARIANTS = ("none", "1e-4", "1e-5")


def child_window(disabled: bool, drawers: int = 8, rounds: int = 20, per_round: int = 40, variants: str = ",".join(WINDOW_VARIANTS),
                 numel: int = 4096) -> dict[str, Any]:
    """The capture window alone: ``drawers`` threads draw ``torch.rand(numel, device="cuda")`` without pause
    while one more thread captures small CUDA graphs (no random op in them) one after another, through
    ``CUDAGraph.capture_begin``/``capture_end`` (``thread_local`` capture mode, a side stream). Each
    variant of ``cudagraph_rng``'s switch (``begin_switch_interval``: none, or a GIL switch interval in
    seconds set for the duration of ``capture_begin``) captures ``per_round`` graphs per round, the variants
    interleaved round by round. Per variant: draws, failed draws (the window), failed draws per 1,000 draws
    and per capture, and the wall time of ``capture_begin`` seen by the capturing thread. With
    ``TTC_DISABLE=1`` only "none" runs (upstream: the live state is in capture mode for the whole capture)."""
    torch = _setup()
    names = ["none"] if disabled else [v for v in variants.split(",") if v]
    rt = None
    if not disabled:
        from torch_threadsafe_compile.patches import cudagraph_rng as cr

        rt = cr._RUNTIME
        if rt is None or not hasattr(rt, "begin_switch_interval"):
            names = ["none"]
    current = [0]
    stop = threading.Event()
    stats = [[collections.Counter() for _ in names] for _ in range(drawers)]
    kinds: collections.Counter[str] = collections.Counter()
    begin_us: list[list[float]] = [[] for _ in names]
    captures = [0 for _ in names]
    window_us = [0.0 for _ in names]  # the patch's own measure: default generator pointed at the private state
    capture_errors: collections.Counter[str] = collections.Counter()

    def drawer(i: int) -> None:
        mine = stats[i]
        while not stop.is_set():
            v = current[0]
            try:
                t = torch.rand(numel, device="cuda")
                t.add_(1.0)
                mine[v]["draws"] += 1
            except Exception as e:
                mine[v]["draws"] += 1
                mine[v]["errors"] += 1
                kinds[error_kind(e)] += 1

    def capturer() -> None:
        x = torch.ones(1024, device="cuda")
        side = torch.cuda.Stream()
        torch.cuda.synchronize()
        for _ in range(rounds):
            for v, name in enumerate(names):
                current[0] = v
                if rt is not None:
                    rt.begin_switch_interval = None if name == "none" else float(name)
                    w0 = rt.stats.get("window_us_total", 0.0)
                for _ in range(per_round):
                    g = torch.cuda.CUDAGraph()
                    try:
                        with torch.cuda.stream(side):
                            t0 = time.perf_counter()
                            g.capture_begin(capture_error_mode="thread_local")
                            begin_us[v].append((time.perf_counter() - t0) * 1e6)
                            try:
                                y = x * 2 + 1
                            finally:
                                g.capture_end()
                        g.replay()
                        captures[v] += 1
                        del y
                    except Exception as e:
                        capture_errors[error_kind(e)] += 1
                    del g
                    time.sleep(0.002)
                if rt is not None:
                    window_us[v] += rt.stats.get("window_us_total", 0.0) - w0
        if rt is not None:
            rt.begin_switch_interval = None
        stop.set()

    ts = [threading.Thread(target=drawer, args=(i,), name=f"d{i}") for i in range(drawers)]
    for t in ts:
        t.start()
    time.sleep(0.5)
    cap = threading.Thread(target=capturer, name="capturer")
    cap.start()
    cap.join(600)
    stop.set()
    for t in ts:
        t.join(60)
    torch.cuda.synchronize()

    def pct(vals: list[float], q: float) -> float | None:
        return round(sorted(vals)[min(len(vals) - 1, int(q * len(vals)))], 1) if vals else None

    per = {}
    for v, name in enumerate(names):
        d = sum(stats[i][v]["draws"] for i in range(drawers))
        e = sum(stats[i][v]["errors"] for i in range(drawers))
        per[name] = {"captures": captures[v], "draws": d, "draw_errors": e,
                     "errors_per_1000_draws": round(1000 * e / d, 3) if d else None,
                     "errors_per_100_captures": round(100 * e / captures[v], 2) if captures[v] else None,
                     "capture_begin_us_p50": pct(begin_us[v], 0.5), "capture_begin_us_p90": pct(begin_us[v], 0.9),
                     "capture_begin_us_max": pct(begin_us[v], 1.0),
                     "window_us_mean": round(window_us[v] / captures[v], 1) if captures[v] and rt is not None else None}
    report = {}
    if rt is not None:
        report = {k: v for k, v in rt.stats.items() if "window" in k or k in ("private_captures", "upstream_captures")}
    res = {"drawers": drawers, "variants": per, "kinds": dict(kinds.most_common(3)), "capture_errors": dict(capture_errors),
           "report": report}
    res["ok"] = not capture_errors and all(p["captures"] for p in per.values())
    return res


def _llama(torch: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).cuda().eval()


def _serve(torch: Any, model: Any, workers: int, requests: int, prompts: Any, new_tokens: int, greedy_every: int) -> dict[str, Any]:
    from transformers import StaticCache

    local = threading.local()
    rows = [_new_row() for _ in range(requests)]
    greedy: dict[int, list[int]] = {}

    def handle(i: int) -> None:
        row = rows[i]
        try:
            cache = getattr(local, "cache", None)
            if cache is None:  # one static cache per worker, reused (a shared one would mix requests)
                cache = local.cache = StaticCache(config=model.config, max_cache_len=prompts.shape[1] + new_tokens + 8)
            cache.reset()
            sample = i % greedy_every != 0
            with torch.no_grad():
                out = model.generate(prompts[i % len(prompts)][None], past_key_values=cache, max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, do_sample=sample, top_k=50 if sample else None,
                                     eos_token_id=None, pad_token_id=0, disable_compile=True)
            row["calls"] += 1
            if not sample:
                greedy[i] = out[0, prompts.shape[1]:].tolist()
        except Exception as e:
            row["errors"] += 1
            row["kinds"][error_kind(e)] += 1

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(handle, range(requests)))
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ok_calls = sum(r["calls"] for r in rows)
    return {"workers": workers, "requests": requests, **_summary(rows), "tokens_per_s": round(ok_calls * new_tokens / wall, 1),
            "wall_s": round(wall, 2), "greedy": greedy}


def child_server(disabled: bool, workers: int = 8, requests: int = 200, new_tokens: int = 24) -> dict[str, Any]:
    torch = _setup()
    try:
        import transformers
    except ImportError as e:
        return {"skipped": f"transformers not importable: {e}", "ok": False}
    model = _llama(torch)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 1024, (16, 16), generator=g).cuda()
    eager_greedy = {}
    with torch.no_grad():
        for i in range(0, len(prompts)):
            out = model.generate(prompts[i][None], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, disable_compile=True)
            eager_greedy[i] = out[0, prompts.shape[1]:].tolist()
    model.forward = torch.compile(model.forward, mode="reduce-overhead")
    one = _serve(torch, model, 1, max(24, requests // 8), prompts, new_tokens, 4)  # also warms the main path
    many = _serve(torch, model, workers, requests, prompts, new_tokens, 4)
    greedy_equal = sum(1 for i, toks in many["greedy"].items() if toks == eager_greedy[i % len(prompts)])
    res = {"transformers": transformers.__version__, "workers": workers, "requests": requests, "new_tokens": new_tokens,
           "errors": many["errors"] + one["errors"], "kinds": {**one["kinds"], **many["kinds"]},
           "greedy_requests": len(many["greedy"]), "greedy_equal_eager": greedy_equal,
           "tokens_per_s_1": one["tokens_per_s"], "tokens_per_s_n": many["tokens_per_s"],
           "speedup": round(many["tokens_per_s"] / one["tokens_per_s"], 2) if one["tokens_per_s"] else None}
    res["ok"] = res["errors"] == 0 and greedy_equal == len(many["greedy"]) and many["calls"] == requests
    return res


def child_server_main(disabled: bool, requests: int = 8, new_tokens: int = 24) -> dict[str, Any]:
    """Control for ``server``: the same compiled ``generate`` with a static cache, in the main thread only
    (no thread started): what upstream does with this model, transformers and torch, threads aside."""
    torch = _setup()
    try:
        from transformers import StaticCache
    except ImportError as e:
        return {"skipped": f"transformers not importable: {e}", "ok": False}
    model = _llama(torch)
    prompts = torch.randint(3, 1024, (4, 16), generator=torch.Generator().manual_seed(1)).cuda()
    model.forward = torch.compile(model.forward, mode="reduce-overhead")
    row = _new_row()
    cache = StaticCache(config=model.config, max_cache_len=prompts.shape[1] + new_tokens + 8)
    for i in range(requests):
        try:
            cache.reset()
            with torch.no_grad():
                model.generate(prompts[i % len(prompts)][None], past_key_values=cache, max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=bool(i % 2), top_k=50 if i % 2 else None,
                               eos_token_id=None, pad_token_id=0, disable_compile=True)
            row["calls"] += 1
        except Exception as e:
            row["errors"] += 1
            row["kinds"][error_kind(e)] += 1
    res = {"requests": requests, **_summary([row])}
    res["ok"] = res["errors"] == 0
    return res


CHILDREN: dict[str, Callable[..., dict[str, Any]]] = {
    "issue": child_issue,
    **{f"layout_{name}": (lambda disabled, name=name, **kw: child_layout(disabled, name, **kw)) for name in LAYOUTS},
    "dropout": child_dropout,
    "window": child_window,
    "server": child_server,
    "server_main": child_server_main,
}


def child_main(name: str, kwargs: dict[str, Any], watchdog: float) -> None:
    t0 = time.time()
    res = child_call(lambda disabled: CHILDREN[name](disabled, **kwargs), watchdog)
    try:
        import torch

        res.update(torch=torch.__version__, device=torch.cuda.get_device_name(), patches=_patches(unpatched_side()))
    except Exception as e:
        res["env_error"] = error_kind(e)
    res["wall_s"] = round(time.time() - t0, 1)
    print_result(res)


# =====================================================================================================
# Parent side.
# =====================================================================================================


def run_child(job: dict[str, Any], out_dir: str | None) -> dict[str, Any]:
    cmd = [sys.executable, "-X", "faulthandler", os.path.abspath(__file__), "--child", job["name"],
           "--child-args", json.dumps(job["kwargs"]), "--child-watchdog", str(job["timeout"])]
    pr = run_cold(cmd, job["disabled"], job["timeout"] + 30)
    row = run_row(pr, job=job["tag"], scenario=job["name"], package=mode_label(job["disabled"]))
    if out_dir and not row.get("ok"):
        with open(os.path.join(out_dir, f"stderr-{job['tag']}.txt"), "w") as fh:
            fh.write(pr["stderr"][-400000:])
    return row


def run_upstream(job: dict[str, Any], out_dir: str | None) -> dict[str, Any]:
    row: dict[str, Any] = {"job": job["tag"], "scenario": "upstream", "package": "both"}
    if not os.path.exists(UPSTREAM_FILE):
        return {**row, "skipped": f"{os.path.relpath(UPSTREAM_FILE, ROOT)} is not in the tree", "ok": False}
    js = os.path.join(out_dir or tempfile.mkdtemp(), "upstream_cudagraph_trees.json")
    cmd = [sys.executable, os.path.join(HERE, "upstream_tests.py"), "--no-shared", "--files", "inductor/test_cudagraph_trees.py",
           "--json", js, "--rerun", "2", "--timeout", str(job["timeout"])]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=2 * job["timeout"] + 120, cwd=ROOT)
    row.update(rc=p.returncode, job_wall_s=round(time.time() - t0, 1), tail=p.stdout[-2500:], completed=True)
    row["ok"] = p.returncode == 0  # 0: no test fails only with the package active
    return row


def plan(a: argparse.Namespace) -> list[dict[str, Any]]:
    groups = set(a.only.split(",")) if a.only else set(GROUPS)
    if groups - set(GROUPS):
        raise SystemExit(f"--only: unknown {sorted(groups - set(GROUPS))}; choose from {','.join(GROUPS)}")
    jobs: list[dict[str, Any]] = []

    modes = {"both": (True, False), "active": (False,), "off": (True,)}[a.modes]

    def add(name: str, timeout: float, run: int = 0, **kwargs: Any) -> None:
        for disabled in modes:
            jobs.append({"name": name, "disabled": disabled, "timeout": timeout, "kwargs": kwargs,
                         "tag": f"{name}-{'off' if disabled else 'on'}" + (f"-r{run}" if run else "")})

    if "server" in groups:  # longest first
        add("server", a.timeout * 2, workers=a.workers, requests=a.requests)
        add("server_main", a.timeout)  # the control: the same generate in the main thread, no threads
    if "dropout" in groups:
        add("dropout", a.timeout)
    if "layouts" in groups:
        for r in range(a.repeat):  # round by round, so that a budget cut leaves whole rounds
            for name in ("warm", "cold", "per_thread"):
                add(f"layout_{name}", a.timeout, run=r + 1 if a.repeat > 1 else 0, threads=a.threads, calls=a.calls)
    if "issue" in groups:
        add("issue", a.timeout)
    if "window" in groups:
        add("window", a.timeout, drawers=a.window_drawers, variants=a.window_variants)
    if "upstream" in groups:
        jobs.append({"name": "upstream", "disabled": False, "timeout": a.upstream_timeout, "kwargs": {}, "tag": "upstream"})
    return jobs


def cuda_problem() -> str | None:
    """Why this machine cannot run the bench (asked in a subprocess: torch's import noise stays out)."""
    p = subprocess.run([sys.executable, "-c", "import torch; print(int(torch.cuda.is_available()))"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "TTC_DISABLE": "1"})
    if p.returncode != 0:
        return f"torch does not import ({(p.stderr.strip().splitlines() or ['?'])[-1][:120]})"
    return None if p.stdout.strip().endswith("1") else "torch.cuda.is_available() is False"


def _fmt(v: Any) -> str:
    return str(v) if isinstance(v, float) else cell(v)  # floats in full (tokens/s)


def table(rows: list[dict[str, Any]]) -> str:
    cols = ("job", "ok", "calls", "errors", "threads_failing", "mismatches", "repeats", "threads_with_replays", "equal_mask_pairs",
            "greedy_equal_eager", "tokens_per_s_1", "tokens_per_s_n", "draws", "draw_errors", "draw_errors_per_1000", "wall_s")
    why = [r.get("skipped") or r.get("kinds") or r.get("exception") or ("hung" if r.get("hung") else None) for r in rows]
    return md_table([*cols, "errors seen"], [[*(_fmt(r.get(c)) for c in cols), _fmt(w)] for r, w in zip(rows, why)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="Groups: " + ", ".join(GROUPS))
    ap.add_argument("--out", default=None, help="directory for cudagraph_rng.json and the stderr of failed runs")
    ap.add_argument("--only", default="", help=f"comma-separated subset of {','.join(GROUPS)}")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--workers", type=int, default=8, help="server: thread-pool size")
    ap.add_argument("--requests", type=int, default=200, help="server: requests with --workers workers")
    ap.add_argument("--timeout", type=float, default=150, help="per run (server: 2x)")
    ap.add_argument("--upstream-timeout", type=float, default=240, help="upstream: per file and mode")
    ap.add_argument("--modes", choices=("both", "active", "off"), default="both",
                    help="run each scenario with TTC_DISABLE=1 and active (both), or one of them")
    ap.add_argument("--repeat", type=int, default=1, help="layouts: runs of each layout and mode")
    ap.add_argument("--window-drawers", type=int, default=8, help="window: drawing threads")
    ap.add_argument("--window-variants", default=",".join(WINDOW_VARIANTS),
                    help="window: cudagraph_rng.begin_switch_interval values to compare (none, or seconds)")
    ap.add_argument("--jobs", type=int, default=3, help="runs at a time (they share the GPU)")
    ap.add_argument("--budget", type=float, default=420, help="start no run after this many seconds")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-args", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--child-watchdog", type=float, default=150, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child_main(a.child, json.loads(a.child_args), a.child_watchdog)
        return 0
    jobs = plan(a)
    problem = cuda_problem()
    if problem:
        print(f"bench/cudagraph_rng.py: needs a CUDA device ({problem}); nothing run")
        return 2
    if a.out:
        os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    print(json.dumps({"bench": "cudagraph_rng", "jobs": len(jobs), "parallel": a.jobs}), flush=True)
    rows = run_pool(jobs, lambda job: run_upstream(job, a.out) if job["name"] == "upstream" else run_child(job, a.out),
                    a.jobs, a.budget, hide=("traceback", "tail", "greedy"))
    report_pool(rows, a.out and os.path.join(a.out, "cudagraph_rng.json"), table(rows), t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

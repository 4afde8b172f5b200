#!/usr/bin/env python
"""How much faster than the sequential layout can *any* threaded layout be on one GPU? The GPU's own answer.

The threaded layout wins on one GPU only by running target forwards and drafter steps at the same time on
different streams. This probe takes threads out of the question: it builds a preset's models exactly as the
trainer does (``examples/specdec``: same modules, compiled functions and ``--step-graphs`` CUDA graphs), captures

* T target graphs (mask + forward, one per target "thread", each with its own stream, the preset's priority),
* D drafter replicas' graphs (forward + backward, and the optimizer update),

and then replays them from this one thread, where issuing a replay costs microseconds, so the GPU always has
every stream's next graph queued. Per batch it times

* ``sequential``: on the first drafter stream, D × (target, drafter forward + backward) and one update, as the
  sequential layout does per step (the sum of the parts' GPU time, nothing overlapped);
* ``parts alone``: the target graph alone and the drafter's (forward + backward + update) alone, on all SMs;
* ``side by side``: T target streams and D drafter streams at once, each working through its share of ``--batches``
  batches, with no dependencies between them (the threaded layout's hand-offs only ever delay a stream). A
  drafter stream also runs its update after each batch, as every drafter thread does per step.

``sequential / side by side`` ("ceiling") is the most the threaded layout can gain on this GPU for this preset (the gradient
average, hand-off copies and host time only take away from it); ``(target + drafter) / max(target, drafter)``
is the bound if the parts' kernels never competed for SMs or memory bandwidth.

    python bench/overlap_ceiling.py --preset multi-gpu --threads 1+1,3+2,5+3
    python bench/overlap_ceiling.py --preset cuda-small --threads 3+2,4+4

Needs one CUDA GPU. Graph outputs are not read and gradients are never applied meaningfully (the replays only
measure time).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch
from _repo import ROOT  # noqa: F401  (makes examples.specdec importable)

from examples.specdec import build, cli, masks, models, steps
from examples.specdec.runtime import Lane, sm_limit_problem


def elapsed_ms(work: Sequence[Callable[[], None]], streams: Sequence[torch.cuda.Stream]) -> float:
    """Issue ``work[i]`` on ``streams[i]`` (all starting together) and return the GPU time until all are done."""
    return interleaved([lambda i, fn=fn: fn() for fn in work], streams, [1] * len(work))


def interleaved(work: Sequence[Callable[[int], None]], streams: Sequence[torch.cuda.Stream], counts: Sequence[int]
                ) -> float:
    """Call ``work[i](j)`` on ``streams[i]`` for j < ``counts[i]`` (all streams starting together), round robin
    across the streams (one call per stream in turn, so no stream's queue is filled long before another's), and
    return the GPU time until all are done."""
    base = torch.cuda.current_stream()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(base)
    for s in streams:
        s.wait_event(start)
    for i in range(max(counts)):
        for fn, s, n in zip(work, streams, counts):
            if i < n:
                with torch.cuda.stream(s):
                    fn(i)
    for s in streams:
        base.wait_stream(s)
    end.record(base)
    end.synchronize()
    return start.elapsed_time(end)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="multi-gpu", choices=["cuda-small", "multi-gpu"])
    p.add_argument("--threads", default=None,
                   help="T+D target and drafter streams, or several, comma-separated (default: the preset's)")
    p.add_argument("--batches", type=int, default=120, help="batches per timed pass (a multiple of T and D is best)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes of each kind (the median is reported)")
    p.add_argument("--priority", choices=["preset", "none"], default="preset",
                   help="stream priorities: the preset's (--stream-priority) or all equal")
    p.add_argument("--target-sms", type=int, default=None, metavar="N",
                   help="target streams on a partition of N SMs, as the trainer's --target-sms")
    p.add_argument("--json", help="also write the results here")
    opts = p.parse_args(argv)
    args = cli.parse(["--preset", opts.preset, "--devices", "cuda:0"])
    try:
        configs = [(int(t), int(d)) for t, d in (c.split("+") for c in opts.threads.split(","))] \
            if opts.threads else [(args.target_threads, args.drafter_threads)]
    except ValueError:
        print(f"overlap_ceiling.py: --threads {opts.threads!r} is not T+D[,T+D...]", file=sys.stderr)
        return 2
    if any(t < 1 or d < 1 for t, d in configs):
        print("overlap_ceiling.py: every T and D must be at least 1", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("overlap_ceiling.py: needs a CUDA GPU", file=sys.stderr)
        return 1
    if opts.target_sms is not None:
        problem = sm_limit_problem(torch.device("cuda:0"), opts.target_sms)
        if problem:
            print(f"overlap_ceiling.py: {problem}", file=sys.stderr)
            return 2
    # Graphs for the largest counts; each configuration replays the first T and D of them.
    T, D = max(t for t, _ in configs), max(d for _, d in configs)  # noqa: N806 - the docs' names for the two counts
    dev = torch.device("cuda:0")
    torch.set_float32_matmul_precision("high")
    masks.BUILDER = args.mask_builder
    data = build.build_data(args, pin=True)
    target = build.build_target(args, data, dev, torch.bfloat16 if args.target_dtype == "bfloat16" else torch.float32)
    out_dtype = torch.bfloat16 if args.target_dtype == "bfloat16" else None
    dcfg = build.drafter_config(args, target)
    topk = args.target_topk if 0 < args.target_topk < dcfg.vocab_size else 0

    def fwd(tokens, pos, mask):
        return models.target_features(target, tokens, pos, mask, topk, out_dtype)

    target_fn = build.maybe_compile(args, fwd, args.target_compile_mode)
    prio = opts.priority == "preset"
    t_lanes = [Lane(dev, True, prio and args.stream_priority == "target", opts.target_sms) for _ in range(T)]
    d_lanes = [Lane(dev, True, prio and args.stream_priority == "drafter") for _ in range(D)]
    calls = [steps.TargetCall(args, target_fn, lane) for lane in t_lanes]
    # The sequential pass runs the target on the drafter's stream, as the sequential layout does: a graph of its
    # own (a graph captured on a --target-sms stream keeps that partition wherever it is replayed).
    calls.append(steps.TargetCall(args, target_fn, d_lanes[0]))
    t_lanes = t_lanes + [d_lanes[0]]
    proto = build.drafter_prototype(args, target, dcfg)
    loss_fn = build.maybe_compile(args, models.ttt_loss, args.drafter_compile_mode)
    reps = [build.make_replica(args, proto, lane, loss_fn) for lane in d_lanes]
    torch.cuda.synchronize()

    packed = [steps.upload(data.batch(i), t_lanes[0], True) for i in range(len(calls))]
    torch.cuda.synchronize()
    feats = None
    for _ in range(3):  # two eager warm-up calls of every StepGraph, then every capture
        for j, (call, lane) in enumerate(zip(calls, t_lanes)):
            with lane.context():
                out = call(packed[j])
                lane.synchronize()
                feats = (*out, packed[j])
        for rep in reps:
            with rep.lane.context():
                rep.fb_graph(*feats)  # type: ignore[misc]
                rep.update_graph()  # type: ignore[misc]
                rep.lane.synchronize()
    assert all(c.graph is not None and c.graph.captured for c in calls)
    assert all(r.fb_graph.captured and r.update_graph.captured for r in reps)  # type: ignore[union-attr]
    tg = [c.graph.graph for c in calls[:T]]  # type: ignore[union-attr]
    seq_target = calls[T].graph.graph  # type: ignore[union-attr]
    fb = [r.fb_graph.graph for r in reps]  # type: ignore[union-attr]
    up = [r.update_graph.graph for r in reps]  # type: ignore[union-attr]
    n = opts.batches
    t_streams = [lane.stream for lane in t_lanes[:T]]
    d_streams = [r.lane.stream for r in reps]

    def sequential(d: int) -> float:
        """The sequential layout with ``d`` batches per step: per batch target then drafter, one update per step."""
        def work() -> None:
            for b in range(n):
                seq_target.replay()
                fb[0].replay()
                if b % d == d - 1:
                    up[0].replay()
        return elapsed_ms([work], [d_streams[0]]) / n

    def target_alone() -> float:  # on all SMs, whatever --target-sms says (the part's own GPU time)
        return elapsed_ms([lambda: [seq_target.replay() for _ in range(n)]], [d_streams[0]]) / n

    def drafter_alone() -> float:
        def work() -> None:
            for _ in range(n):
                fb[0].replay()
                up[0].replay()
        return elapsed_ms([work], [d_streams[0]]) / n

    def side_by_side(t: int, d: int) -> float:
        t_work = [lambda i, g=g: g.replay() for g in tg[:t]]
        d_work = [lambda i, f=f, u=u: (f.replay(), u.replay()) for f, u in zip(fb[:d], up[:d])]
        counts = [len(range(j, n, t)) for j in range(t)] + [len(range(j, n, d)) for j in range(d)]
        return interleaved(t_work + d_work, t_streams[:t] + d_streams[:d], counts) / n

    def median(fn: Callable[[], float]) -> float:
        fn()  # one untimed pass
        times = sorted(fn() for _ in range(opts.repeats))
        return times[len(times) // 2]

    t_ms, d_ms = median(target_alone), median(drafter_alone)
    bound = (t_ms + d_ms) / max(t_ms, d_ms)
    sms = f"; target streams on {opts.target_sms} SMs" if opts.target_sms else ""
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(dev)}; preset {opts.preset}; priorities: "
          f"{args.stream_priority if prio else 'equal'}{sms}; {n} batches per pass, median of {opts.repeats}")
    print(f"alone, GPU ms per batch: target {t_ms:.3f}, drafter forward + backward + update {d_ms:.3f}; bound "
          f"without competition (target + drafter) / max: {bound:.2f}×")
    print("| T + D | sequential ms per batch (D batches per update) | side by side ms per batch | ceiling |")
    print("|---|---|---|---|")
    rows = []
    for t, d in configs:
        seq_ms = median(lambda d=d: sequential(d))
        sbs_ms = median(lambda t=t, d=d: side_by_side(t, d))
        rows.append({"threads": f"{t}+{d}", "sequential_ms": seq_ms, "side_by_side_ms": sbs_ms,
                     "ceiling": seq_ms / sbs_ms})
        print(f"| {t} + {d} | {seq_ms:.3f} | {sbs_ms:.3f} | {seq_ms / sbs_ms:.2f}× |", flush=True)
    if opts.json:
        Path(opts.json).write_text(json.dumps({
            "preset": opts.preset, "batches": n, "repeats": opts.repeats,
            "priority": args.stream_priority if prio else "equal", "target_sms": opts.target_sms, "target_ms": t_ms, "drafter_ms": d_ms,
            "bound": bound, "rows": rows, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(dev)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

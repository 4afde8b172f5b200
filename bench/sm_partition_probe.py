#!/usr/bin/env python
"""Do the trainer's SM-partitioned streams (``--target-sms``) confine work to their SMs?

For each SM count, a stream from ``examples/specdec/runtime.partition_stream`` (a CUDA green context) runs the
same chain of bf16 matmuls three ways: eager kernels, a ``torch.compile``d function (Triton and cuBLAS kernels
launched by inductor) and a CUDA graph of it captured on that stream. Prints the time per call against a plain
stream on all SMs: if the partition holds, compute-bound work slows down as SMs are taken away, in every way of
launching it. Then two streams at once: a 1/3 partition and a plain stream, to show what running side by side
gains over running one after the other. Needs one CUDA GPU and torch built with green contexts (CUDA >= 12.8).

    python bench/sm_partition_probe.py
"""
from __future__ import annotations

import sys
from typing import Callable, Optional

import torch
from _repo import ROOT  # noqa: F401  (makes examples.specdec importable)

from examples.specdec.runtime import partition_stream, sm_limit_problem


def chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for _ in range(16):
        x = torch.nn.functional.silu(x @ w)
    return x


def per_call_ms(fn: Callable[[], object], stream: "torch.cuda.Stream", reps: int = 30) -> float:
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(reps):
            fn()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / reps


def graphed(fn: Callable[[], torch.Tensor], stream: "torch.cuda.Stream") -> Callable[[], object]:
    with torch.cuda.stream(stream):
        fn()
        fn()
        stream.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream, capture_error_mode="thread_local"):
            fn()
    return g.replay


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    dev = torch.device("cuda:0")
    total = torch.cuda.get_device_properties(dev).multi_processor_count
    problem = sm_limit_problem(dev, total // 2)
    if problem:
        print(problem)
        return 1
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(dev)}, {total} SMs")
    x = torch.randn(8192, 512, device=dev, dtype=torch.bfloat16)
    w = torch.randn(512, 512, device=dev, dtype=torch.bfloat16) * 0.04
    compiled = torch.compile(chain)
    base: Optional[list] = None
    print("SMs | eager ms | compiled ms | CUDA graph ms | slowdown vs all SMs (eager / compiled / graph)")
    for n in (None, total * 3 // 4, total // 2, total // 3, total // 4):
        stream = partition_stream(dev, n, 0) if n else torch.cuda.Stream(device=dev)
        times = [per_call_ms(lambda: chain(x, w), stream), per_call_ms(lambda: compiled(x, w), stream),
                 per_call_ms(graphed(lambda: compiled(x, w), stream), stream)]
        base = base or times
        print(f"{n or total} | " + " | ".join(f"{t:.3f}" for t in times) + " | "
              + " / ".join(f"{t / b:.2f}×" for t, b in zip(times, base)))
    # Side by side: the same graph on a third of the SMs and on a plain stream, at once vs one after the other.
    small, full = partition_stream(dev, total // 3, -1), torch.cuda.Stream(device=dev)
    g_small, g_full = graphed(lambda: compiled(x, w), small), graphed(lambda: compiled(x.clone(), w), full)
    alone = per_call_ms(g_small, small) + per_call_ms(g_full, full)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    small.wait_event(start)
    full.wait_event(start)
    for _ in range(30):
        with torch.cuda.stream(small):
            g_small()
        with torch.cuda.stream(full):
            g_full()
    done = torch.cuda.Event()
    done.record(small)
    torch.cuda.current_stream().wait_event(done)
    torch.cuda.current_stream().wait_stream(full)
    end.record()
    end.synchronize()
    print(f"1/3 partition + all SMs: one after the other {alone:.3f} ms, side by side "
          f"{start.elapsed_time(end) / 30:.3f} ms per pair")
    return 0


if __name__ == "__main__":
    sys.exit(main())

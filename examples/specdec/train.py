#!/usr/bin/env python
"""Reference EAGLE-3 style speculative-decoding trainer: one process per node, one thread per device.

Target threads run a frozen target LM (compiled forward under no_grad) and push fused low/mid/high hidden states
plus the target's top-k next-token logits into bounded per-drafter queues. Drafter threads each hold an identical
drafter replica, train it with training-time-test (TTT) unrolling through a compiled loss (compiled flex_attention
on CUDA, compiled SDPA with the same mask evaluated densely on CPU), and average gradients across threads every
step (plus an all-reduce across processes under torchrun). See docs/trainer.md.

    python examples/specdec/train.py --preset cpu-tiny --out runs/tiny
"""
from __future__ import annotations

import argparse
import os
import sys


def _reexec_without_ttc() -> None:
    """``--no-ttc``: torch_threadsafe_compile activates at interpreter start (a .pth file), so turning it off means
    starting a fresh interpreter with ``TTC_DISABLE=1``. ``os.execv`` keeps the pid (torchrun, signals still work)."""
    if os.environ.get("TTC_DISABLE") == "1":
        return
    os.environ["TTC_DISABLE"] = "1"
    sys.stdout.flush(), sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


if __name__ == "__main__" and "--no-ttc" in sys.argv[1:]:
    _reexec_without_ttc()  # before torch is imported

import copy  # noqa: E402
import datetime  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import queue  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Dict, List, Optional, Tuple  # noqa: E402

if __package__ in (None, ""):  # run as a script: make the ``specdec`` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from specdec import checkpoint, data as data_mod, masks, metrics, models  # noqa: E402
else:
    from . import checkpoint, data as data_mod, masks, metrics, models  # noqa: E402

import torch  # noqa: E402

# --------------------------------------------------------------------------------------------------- options
PRESETS: Dict[str, Dict[str, Any]] = {
    # 2 target + 2 drafter threads on CPU; a few minutes on a 2-core machine.
    "cpu-tiny": dict(devices="cpu", target_threads=2, drafter_threads=2, steps=300, batch_size=4, seq_len=128,
                     vocab_size=256, target_dim=128, target_layers=4, target_heads=4, target_ffn=256,
                     ttt_steps=3, lr=3e-3, eval_every=50, log_every=25),
    # several threads sharing one GPU.
    "cuda-small": dict(devices="cuda:0", target_threads=3, drafter_threads=2, steps=1000, batch_size=8,
                       seq_len=512, vocab_size=2048, target_dim=256, target_layers=6, target_heads=4,
                       target_ffn=704, ttt_steps=4, lr=3e-3, prior_strength=1.0, eval_every=100, log_every=50),
    # 5 target + 3 drafter threads spread round robin over every visible GPU.
    "multi-gpu": dict(devices="cuda", target_threads=5, drafter_threads=3, steps=2000, batch_size=8,
                      seq_len=1024, vocab_size=4096, target_dim=512, target_layers=8, target_heads=8,
                      target_ffn=1408, ttt_steps=5, lr=2e-3, prior_strength=1.0, eval_every=200, log_every=50),
}

DEFAULTS: Dict[str, Any] = dict(
    devices="auto", target_threads=1, drafter_threads=1, steps=200, batch_size=4, seq_len=128, vocab_size=256,
    target_dim=128, target_layers=4, target_heads=4, target_ffn=256, ttt_steps=3, lr=3e-3, prior_strength=0.5,
    eval_every=50,
    log_every=25,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("threads and devices")
    g.add_argument("--preset", choices=sorted(PRESETS), help="defaults for everything below; explicit flags win")
    g.add_argument("--devices", help="'cpu', 'cuda' (all visible GPUs), 'auto', or a list 'cuda:0,cuda:1'; "
                                     "threads (targets first, then drafters) take devices round robin")
    g.add_argument("--target-threads", type=int, help="threads running the frozen target")
    g.add_argument("--drafter-threads", type=int, help="threads training a drafter replica each")
    g.add_argument("--queue-size", type=int, default=4, help="bound of each drafter's input queue (back-pressure)")
    g.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads (default 1 when a device is the CPU: the worker threads are the "
                        "parallelism)")
    g = p.add_argument_group("models")
    g.add_argument("--target-hf", metavar="PATH", help="local Hugging Face causal-LM checkpoint (needs transformers)")
    g.add_argument("--vocab-size", type=int, help="vocabulary of the built-in target / synthetic data")
    g.add_argument("--target-dim", type=int)
    g.add_argument("--target-layers", type=int)
    g.add_argument("--target-heads", type=int)
    g.add_argument("--target-ffn", type=int)
    g.add_argument("--prior-strength", type=float,
                   help="weight of the synthetic chain's bigram prior in the built-in target's logits (0: off; "
                        "larger vocabularies need more to keep the greedy target learnable in few steps)")
    g.add_argument("--target-topk", type=int, default=0,
                   help="target logits sent to drafters: top-k (0 = full vocabulary)")
    g.add_argument("--ttt-steps", type=int, help="k: training-time-test unroll depth = tokens drafted per round")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("data")
    g.add_argument("--data", metavar="PATH", help=".txt (blank-line separated docs) or .jsonl (field 'text'); "
                                                  "default: embedded synthetic Markov-chain language")
    g.add_argument("--tokenizer", metavar="PATH", help="local HF tokenizer (default: --target-hf's, else bytes)")
    g.add_argument("--batch-size", type=int)
    g.add_argument("--seq-len", type=int)
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, help="drafter optimizer steps")
    g.add_argument("--lr", type=float)
    g.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--compile-backend", default="inductor", help="torch.compile backend (aot_eager compiles fast)")
    g.add_argument("--no-compile", action="store_true", help="run eagerly (debugging; CUDA flex would be unfused)")
    g = p.add_argument_group("evaluation and output")
    g.add_argument("--eval-every", type=int, help="measure τ every N steps (0: only at start and end)")
    g.add_argument("--eval-prompts", type=int, default=16)
    g.add_argument("--eval-prompt-len", type=int, default=16)
    g.add_argument("--eval-gen-len", type=int, default=48, help="greedy target tokens after each eval prompt")
    g.add_argument("--log-every", type=int, help="plain progress line every N steps (when tqdm is not used)")
    g.add_argument("--out", metavar="DIR", help="metrics.jsonl, summary.json, metrics.png, checkpoints")
    g.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (and at the end)")
    g.add_argument("--resume", metavar="DIR", help="a checkpoint dir, or an --out dir (latest checkpoint)")
    g = p.add_argument_group("robustness")
    g.add_argument("--no-ttc", action="store_true",
                   help="run without torch_threadsafe_compile (re-executes with TTC_DISABLE=1) to show hazards")
    g.add_argument("--error-policy", choices=["raise", "count"],
                   help="errors from compiled calls: stop the run (default) or count and retry (default with "
                        "--no-ttc)")
    g.add_argument("--retry-timeout", type=float, default=600.0,
                   help="'count' mode: give up on a call after failing this long (s)")
    g.add_argument("--hang-timeout", type=float, default=900.0,
                   help="no drafter step for this long (s) = hang: dump all thread stacks, exit 3")
    g.add_argument("--dist-timeout", type=float, default=1800.0, help="torch.distributed timeout (s)")
    g.add_argument("--inject-fault", metavar="KIND:THREAD:STEP",
                   help="testing aid: 'error' or 'hang' in thread kind 'target'/'drafter' (index 0) at STEP")
    g.add_argument("--dry-run", action="store_true", help="print the resolved configuration and exit")
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    preset = PRESETS.get(args.preset or "", {})
    for key, default in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, preset.get(key, default))
    if args.error_policy is None:
        args.error_policy = "count" if os.environ.get("TTC_DISABLE") == "1" else "raise"
    return args


def parse_devices(spec: str) -> List[torch.device]:
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda":
        n = torch.cuda.device_count()
        if n == 0:
            raise SystemExit("--devices cuda: no GPU visible")
        return [torch.device(f"cuda:{i}") for i in range(n)]
    return [torch.device(d.strip()) for d in spec.split(",") if d.strip()]


# ------------------------------------------------------------------------------------------- shared runtime
class Stopped(Exception):
    """Raised inside a worker when the shared stop event is set (not an error)."""


class ThreadAllReduce:
    """Average a flat tensor across the drafter threads of this process, then across processes.

    Each thread parks its tensor (copied to the reduce device); after a barrier the leader sums them in thread
    order (deterministic), divides, all-reduces across ranks and post-processes (gradient clipping); after a
    second barrier every thread copies the result back to its own device. ``abort`` releases all waiters.
    """

    def __init__(self, n: int, device: torch.device, world: int, post: Callable[[torch.Tensor], None]) -> None:
        self.n, self.device, self.world, self.post = n, device, world, post
        self.barrier = threading.Barrier(n)
        self.slots: List[Optional[torch.Tensor]] = [None] * n
        self.result: Optional[torch.Tensor] = None

    def __call__(self, idx: int, flat: torch.Tensor) -> torch.Tensor:
        self.slots[idx] = flat.to(self.device)
        self.barrier.wait()
        if idx == 0:
            total = self.slots[0].clone()
            for t in self.slots[1:]:
                total += t
            total /= self.n
            if self.world > 1:
                import torch.distributed as dist

                on_cpu = dist.get_backend() == "gloo" and total.device.type != "cpu"
                buf = total.cpu() if on_cpu else total
                dist.all_reduce(buf)
                total = (buf.to(self.device) if on_cpu else buf) / self.world
            self.post(total)
            self.result = total
        self.barrier.wait()
        return self.result.to(flat.device)

    def abort(self) -> None:
        self.barrier.abort()


@dataclass
class Run:
    """State shared by all threads of one process."""

    args: argparse.Namespace
    rank: int = 0
    world: int = 1
    stop: threading.Event = field(default_factory=threading.Event)
    errors: metrics.ErrorLog = field(default_factory=metrics.ErrorLog)
    throughput: metrics.Throughput = field(default_factory=metrics.Throughput)
    last_progress: float = field(default_factory=time.monotonic)
    steps_done: int = 0
    reducer: Optional[ThreadAllReduce] = None

    def call(self, where: str, fn: Callable[[], Any]) -> Any:
        """Run one compiled call under the error policy: 'raise' propagates; 'count' counts the error and retries
        with a growing pause (1 ms .. 100 ms: the usual cause, another thread's compile, takes seconds), giving up
        after ``--retry-timeout`` seconds of consecutive failures."""
        first_failure: Optional[float] = None
        pause = 0.001
        while True:
            if self.stop.is_set():
                raise Stopped
            try:
                return fn()
            except Exception as e:
                now = time.monotonic()
                first_failure = first_failure if first_failure is not None else now
                if self.args.error_policy == "raise" or now - first_failure > self.args.retry_timeout:
                    raise
                self.errors.count(where, e)
                time.sleep(pause)
                pause = min(0.1, pause * 2)

    def halt(self) -> None:
        self.stop.set()
        if self.reducer is not None:
            self.reducer.abort()

    def put(self, q: "queue.Queue", item: Any) -> None:
        while True:
            try:
                return q.put(item, timeout=0.2)
            except queue.Full:
                if self.stop.is_set():
                    raise Stopped

    def get(self, q: "queue.Queue") -> Any:
        while True:
            try:
                return q.get(timeout=0.2)
            except queue.Empty:
                if self.stop.is_set():
                    raise Stopped


def worker(run: Run, name: str, fn: Callable[[], None]) -> threading.Thread:
    """A thread whose first real error stops everyone (the stop event + barrier abort unblock all waits)."""

    def body() -> None:
        try:
            fn()
        except (Stopped, threading.BrokenBarrierError):
            if not run.stop.is_set():
                run.errors.fatal(name, RuntimeError("barrier broken without a stop request"))
                run.halt()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            run.errors.fatal(name, e)
            run.halt()

    return threading.Thread(target=body, name=name, daemon=True)


# ------------------------------------------------------------------------------------------------- set-up
def build_data(args: argparse.Namespace):
    if args.data:
        tok = data_mod.load_tokenizer(args.tokenizer or (args.target_hf if data_mod.has_tokenizer(args.target_hf) else None))
        return data_mod.TextData(args.data, tok, args.batch_size, args.seq_len, seed=args.seed)
    return data_mod.MarkovData(args.vocab_size, args.batch_size, args.seq_len, seed=args.seed)


def build_target(args: argparse.Namespace, data) -> torch.nn.Module:
    if args.target_hf:
        return models.HFTarget(args.target_hf)
    prior = data.transition_logprobs() if isinstance(data, data_mod.MarkovData) else None
    vocab = args.vocab_size if prior is not None else max(args.vocab_size, data.vocab_size)
    cfg = models.TargetConfig(vocab_size=vocab, dim=args.target_dim, layers=args.target_layers,
                              heads=args.target_heads, ffn=args.target_ffn, seed=args.seed,
                              prior_strength=args.prior_strength if prior is not None else 0.0)
    return models.TargetLM(cfg, prior)


def drafter_config(args: argparse.Namespace, target: torch.nn.Module) -> models.DrafterConfig:
    emb = target.input_embedding()
    heads = target.heads if isinstance(target, models.HFTarget) else args.target_heads
    ffn = target.ffn if isinstance(target, models.HFTarget) else args.target_ffn
    return models.DrafterConfig(vocab_size=target.output_embedding().shape[0], dim=emb.shape[1], heads=heads,
                                ffn=ffn, ttt_steps=args.ttt_steps)


def maybe_compile(args: argparse.Namespace, fn: Callable) -> Callable:
    return fn if args.no_compile else torch.compile(fn, backend=args.compile_backend, dynamic=False)


@dataclass
class EvalSet:
    """Held-out prompts plus the target's greedy continuation, with the target features, on one device."""

    tokens: torch.Tensor
    pos: torch.Tensor
    fused: torch.Tensor
    masks: List[torch.Tensor]
    first: int
    last: int

    @classmethod
    @torch.no_grad()
    def build(cls, args: argparse.Namespace, data, target: torch.nn.Module, device: torch.device) -> "EvalSet":
        """Eager and dense-masked on purpose: built once, before any worker thread starts."""
        k = args.ttt_steps
        toks = data.prompts(args.eval_prompts, args.eval_prompt_len, seed=args.seed + 1).to(device)
        for _ in range(args.eval_gen_len + k + 1):
            b, s = toks.shape
            pos = torch.arange(s, device=device).expand(b, s)
            mask = masks.dense_mask(masks.document_causal_mod(torch.zeros_like(toks)), b, s, s, device)
            logits, _ = target(toks, pos, mask)
            toks = torch.cat([toks, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        b, s = toks.shape
        doc = torch.zeros_like(toks)
        pos = torch.arange(s, device=device).expand(b, s).contiguous()
        mask = masks.dense_mask(masks.document_causal_mod(doc), b, s, s, device)
        fused, _, _ = models.target_features(target, toks, pos, mask, 1)
        ttt = [masks.dense_mask(masks.ttt_mod(doc, s), b, s, s * (i + 1), device) for i in range(k)]
        return cls(toks, pos, fused, ttt, first=args.eval_prompt_len - 1, last=s - k - 2)

    def evaluate(self, drafter: models.Drafter) -> Dict[str, object]:
        proposals = models.draft_greedy(drafter, self.fused, self.tokens, self.pos, self.masks)
        return metrics.acceptance(proposals, self.tokens, self.first, self.last)


def lr_at(args: argparse.Namespace, step: int) -> float:
    """Linear warm-up then cosine decay to 10 %; a pure function of the step, so resume needs no scheduler state."""
    import math

    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def inject_fault(args: argparse.Namespace, thread: str, step: int) -> None:
    """``--inject-fault``: fail or hang on purpose, to exercise shutdown and the hang watchdog."""
    if not args.inject_fault:
        return
    kind, where, at = args.inject_fault.split(":")
    if where == thread and int(at) == step:
        if kind == "error":
            raise RuntimeError(f"injected fault in {thread} thread at step {step}")
        while True:  # a hang that ignores the stop event, like a real deadlock would
            time.sleep(1.0)


# ------------------------------------------------------------------------------------------------ training
def train(args: argparse.Namespace) -> int:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    devices = parse_devices(args.devices)
    if any(d.type == "cpu" for d in devices) or args.torch_threads:
        torch.set_num_threads(args.torch_threads or 1)
    if any(d.type == "cuda" for d in devices):
        torch.set_float32_matmul_precision("high")  # TF32 matmuls for the float32 models
    T, D = args.target_threads, args.drafter_threads
    t_dev = [devices[j % len(devices)] for j in range(T)]
    d_dev = [devices[(T + d) % len(devices)] for d in range(D)]
    if world > 1:
        import torch.distributed as dist

        backend = "nccl" if all(d.type == "cuda" for d in devices) else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(d_dev[0])
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.dist_timeout))
    out = Path(args.out) if args.out and rank == 0 else None
    log = metrics.MetricsLog(out / "metrics.jsonl" if out else None)

    data = build_data(args)
    target_cpu = build_target(args, data).eval()
    dcfg = drafter_config(args, target_cpu)
    topk = args.target_topk or dcfg.vocab_size

    # One frozen target (and one compiled forward) per device, shared by the target threads on that device.
    placed: Dict[torch.device, torch.nn.Module] = {}

    def target_on(dev: torch.device) -> torch.nn.Module:
        if dev not in placed:
            placed[dev] = target_cpu if dev.type == "cpu" else copy.deepcopy(target_cpu).to(dev)
        return placed[dev]

    target_fns: Dict[torch.device, Callable] = {}
    for dev in dict.fromkeys(t_dev):
        def fwd(tokens, pos, mask, tgt=target_on(dev)):
            return models.target_features(tgt, tokens, pos, mask, topk)

        target_fns[dev] = maybe_compile(args, fwd)

    # Identical drafter replicas: one seeded init on the CPU, copied to each thread's device.
    torch.manual_seed(args.seed + 1)
    proto = models.Drafter(dcfg, target_cpu.input_embedding(), target_cpu.output_embedding())
    drafters = [models.Drafter(dcfg, target_cpu.input_embedding(), target_cpu.output_embedding()) for _ in range(D)]
    for m, dev in zip(drafters, d_dev):
        m.load_state_dict(proto.state_dict())
        m.to(dev)
    opts = [torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=args.weight_decay) for m in drafters]
    start_step = 0
    if args.resume:
        ckpt = checkpoint.find(Path(args.resume))
        for m, o in zip(drafters, opts):
            start_step = checkpoint.load(ckpt, m, o)
        print(f"resumed from {ckpt} at step {start_step}", flush=True)
    loss_fn = maybe_compile(args, models.ttt_loss)
    evalset = EvalSet.build(args, data, target_on(d_dev[0]), d_dev[0]) if rank == 0 else None

    run = Run(args=args, rank=rank, world=world)
    n_grad = sum(p.numel() for p in drafters[0].parameters())
    k = args.ttt_steps

    def clip(total: torch.Tensor) -> None:
        g = total[:n_grad]
        norm = g.norm()
        total[-1] = norm
        if args.grad_clip > 0:
            g.mul_(torch.clamp(args.grad_clip / (norm + 1e-6), max=1.0))

    run.reducer = ThreadAllReduce(D, d_dev[0], world, clip)
    queues = [queue.Queue(maxsize=args.queue_size) for _ in range(D)]
    tokens_per_batch = args.batch_size * args.seq_len
    summary: Dict[str, Any] = {"tau_initial": None, "tau_final": None}

    if evalset is not None:
        ev = evalset.evaluate(drafters[0])
        summary["tau_initial"] = ev["tau"]
        log.write({"kind": "eval", "step": start_step, **ev})
        print(f"τ of the drafter at step {start_step} (before training): {ev['tau']:.3f}  accept={ev['accept']}",
              flush=True)

    def target_loop(j: int) -> None:
        dev, fn = t_dev[j], target_fns[t_dev[j]]
        n = start_step * D + (j - start_step * D) % T  # local batch numbers n ≡ j (mod T), in increasing order
        while n < args.steps * D:
            s, d = divmod(n, D)
            if j == 0:
                inject_fault(args, "target", s)
            batch = data.batch((s * world + rank) * D + d).to(dev)  # global batch index: pure function of step
            mask = masks.target_mask(batch.doc, dense=isinstance(target_cpu, models.HFTarget))

            def forward():
                with torch.no_grad():
                    return fn(batch.tokens, batch.pos, mask)

            fused, vals, idx = run.call("target", forward)
            run.put(queues[d], (n, (fused, vals, idx, batch.tokens, batch.pos, batch.doc)))
            run.throughput.add("target", tokens_per_batch)
            n += T

    progress = metrics.Progress(args.steps, start_step, args.log_every) if rank == 0 else None

    def after_step(step: int, avg: torch.Tensor) -> None:
        """Leader drafter only: log, evaluate, checkpoint (all replicas are identical after the step)."""
        loss, acc, gnorm = float(avg[n_grad]), avg[n_grad + 1:n_grad + 1 + k].tolist(), float(avg[-1])
        summary.setdefault("loss_first", loss)
        summary["loss_last"] = loss
        rec = {"kind": "train", "step": step, "loss": round(loss, 6), "acc": [round(a, 4) for a in acc],
               "grad_norm": round(gnorm, 4), "lr": lr_at(args, step - 1),
               "elapsed_s": round(time.monotonic() - run.throughput.start, 2)}
        info = {"loss": f"{loss:.3f}", "acc0": f"{acc[0]:.2f}"}
        if evalset is not None and ((args.eval_every and step % args.eval_every == 0) or step == args.steps):
            ev = evalset.evaluate(drafters[0])
            summary["tau_final"] = ev["tau"]
            log.write({"kind": "eval", "step": step, **ev})
            info["tau"] = f"{ev['tau']:.2f}"
        log.write(rec)
        if progress is not None:
            progress.update(step, args.steps, info)
        if out is not None and args.save_every and (step % args.save_every == 0 or step == args.steps):
            checkpoint.save(out / f"ckpt-{step:06d}", drafters[0], opts[0], step,
                            {"data_position": step * D * world, "config": vars(args)})

    def drafter_loop(d: int) -> None:
        model, opt, dev = drafters[d], opts[d], d_dev[d]
        params = list(model.parameters())
        pending: Dict[int, Tuple] = {}
        for s in range(start_step, args.steps):
            n = s * D + d
            if d == 0:
                inject_fault(args, "drafter", s)
            while n not in pending:
                got_n, item = run.get(queues[d])
                pending[got_n] = item
            fused, vals, idx, tokens, pos, doc = (t.to(dev, non_blocking=True) for t in pending.pop(n))
            step_masks = masks.ttt_masks(doc, k)

            def fwd_bwd():
                opt.zero_grad(set_to_none=False)
                loss, acc = loss_fn(model, fused, tokens, pos, doc, vals, idx, step_masks)
                loss.backward()
                return loss.detach(), acc.detach()

            loss, acc = run.call("drafter", fwd_bwd)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads] + [loss.view(1).float(), acc.float(),
                                                                loss.new_zeros(1)])
            avg = run.reducer(d, flat)
            offset = 0
            for p in params:
                p.grad = avg[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            for group in opt.param_groups:
                group["lr"] = lr_at(args, s)
            opt.step()
            run.throughput.add("drafter", tokens_per_batch)
            if d == 0:
                if rank == 0:
                    after_step(s + 1, avg)
                run.steps_done = s + 1
                run.last_progress = time.monotonic()

    threads = [worker(run, f"target-{j}@{t_dev[j]}", lambda j=j: target_loop(j)) for j in range(T)]
    threads += [worker(run, f"drafter-{d}@{d_dev[d]}", lambda d=d: drafter_loop(d)) for d in range(D)]
    status = supervise(run, threads)
    if progress is not None:
        progress.close()

    # ------------------------------------------------------------------------------------------- summary
    checksum = float(sum(p.detach().double().sum().cpu() for p in drafters[0].parameters()))
    print(f"PARAM_CHECKSUM rank={rank} {checksum:.10e}", flush=True)
    peak = None
    if any(d.type == "cuda" for d in devices):
        peak = sum(torch.cuda.max_memory_allocated(d) for d in dict.fromkeys(devices) if d.type == "cuda")
    summary.update({
        "status": status, "steps_done": run.steps_done, "start_step": start_step, "steps": args.steps,
        "rank": rank, "world_size": world, "threads": {"target": T, "drafter": D},
        "devices": {"target": [str(x) for x in t_dev], "drafter": [str(x) for x in d_dev]},
        "throughput": run.throughput.summary(), "compile": metrics.compile_counts(),
        "errors": {"total": run.errors.total(), "counted": dict(run.errors.counts), "first": run.errors.first},
        "hung": status == "hung", "peak_gpu_mem_bytes": peak, "param_checksum": checksum,
        "ttc_disable_env": os.environ.get("TTC_DISABLE"), "ttc": metrics.ttc_status(),
        "torch": torch.__version__, "wall_s": round(time.monotonic() - run.throughput.start, 2),
        "config": {k_: v for k_, v in vars(args).items()},
    })
    if out is not None:
        note = metrics.plot(log.records, out / "metrics.png")
        if note:
            print(note, flush=True)
            summary["plot"] = note
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    log.close()
    if rank == 0:
        print("SUMMARY " + json.dumps(summary, default=str), flush=True)
    if status == "error":
        print(f"\nFATAL: a worker thread failed; first error:\n{run.errors.first}", file=sys.stderr, flush=True)
    if world > 1 and status == "ok":
        import torch.distributed as dist

        dist.destroy_process_group()
    return {"ok": 0, "error": 1, "interrupted": 130}[status]


def supervise(run: Run, threads: List[threading.Thread]) -> str:
    """Main thread: start workers, watch for hangs, handle Ctrl-C. Returns 'ok', 'error' or 'interrupted'
    (a hang exits the process from here: hung threads cannot be joined)."""
    timeout = run.args.hang_timeout
    run.last_progress = time.monotonic()
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            # Backstop if this thread itself stops running: faulthandler's own thread dumps stacks and exits.
            faulthandler.dump_traceback_later(timeout * 1.5 + 60, exit=True)
            for t in threads:
                t.join(timeout=0.2)
            idle = time.monotonic() - run.last_progress
            if idle > timeout and not run.stop.is_set():
                hang_exit(run, idle)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping worker threads ...", file=sys.stderr, flush=True)
        run.halt()
        deadline = time.monotonic() + 60
        for t in threads:
            t.join(timeout=max(0.1, deadline - time.monotonic()))
        faulthandler.cancel_dump_traceback_later()
        return "interrupted"
    faulthandler.cancel_dump_traceback_later()
    return "error" if run.errors.first is not None else "ok"


def hang_exit(run: Run, idle: float) -> None:
    print(f"\nHANG DETECTED: no drafter step completed in {idle:.0f} s (--hang-timeout {run.args.hang_timeout:g}); "
          f"last completed step {run.steps_done}. Stacks of all threads follow.", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    summary = {"status": "hung", "hung": True, "steps_done": run.steps_done, "idle_s": round(idle, 1),
               "errors": {"total": run.errors.total(), "counted": dict(run.errors.counts)},
               "ttc_disable_env": os.environ.get("TTC_DISABLE")}
    if run.args.out and run.rank == 0:
        Path(run.args.out, "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print("SUMMARY " + json.dumps(summary, default=str), flush=True)
    sys.stderr.flush()
    os._exit(3)


def main(argv: Optional[List[str]] = None) -> int:
    args = resolve(build_parser().parse_args(argv))
    if args.dry_run:
        cfg = {k: v for k, v in vars(args).items()}
        print(json.dumps({"config": cfg, "ttc_disable_env": os.environ.get("TTC_DISABLE"),
                          "ttc": metrics.ttc_status(), "torch": torch.__version__}, default=str))
        return 0
    return train(args)


if __name__ == "__main__":
    sys.exit(main())

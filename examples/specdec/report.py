"""The end of a run: the summary (summary.json, the one-line ``SUMMARY`` on stdout, ``PARAM_CHECKSUM``), the
checkpoint kept after a failure, the exit code. (The hang report is the watchdog's: ``loops.hang_exit``.)

It reads what the leader kept (its ``summary`` and the last checkpoint it wrote) as plain values: the leader sits
beside this module, not under it.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from . import checkpoint_files, flops, graphs, masks, metrics, models, package_state
from .config import Config
from .metrics import emit_line
from .steps import Replica, Setup, save_checkpoint


def flop_counts(setup: Setup) -> tuple[dict[str, float], float]:
    """Model FLOPs per token of the target forward and of the drafter step, and the keys a query attends on
    average (measured on the first ``Config.flop_batches`` batches), for the MFU of the summary."""
    keys = masks.mean_attended_keys([setup.data.batch(i).doc for i in range(setup.cfg.flop_batches)])
    dcfg = setup.dcfg
    counts = {"target": flops.target_flops_per_token(models.target_shape(setup.target), keys),
              "drafter": flops.drafter_flops_per_token(
                  flops.Shape(dcfg.vocab_size, dcfg.dim, dcfg.heads, dcfg.kv_heads or dcfg.heads, dcfg.ffn),
                  setup.cfg.ttt_steps, keys)}
    return counts, keys


def settle(setup: Setup, util: metrics.GpuUtil | None) -> str | None:
    """After the threads ended: wait for the devices, then close the steady window and the GPU sampler. Returns
    the device's error in one line (a sticky CUDA error from a dead thread), or None."""
    sync_error = None
    if setup.cuda:
        try:
            graphs.synchronize(setup.devices)
        except Exception as e:
            sync_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    setup.run.throughput.close()
    if util is not None:
        util.close()
    return sync_error


def finish(setup: Setup, status: str, summary: dict[str, Any], saved_step: int | None, sync_error: str | None,
           util: metrics.GpuUtil | None, counts: dict[str, float], keys: float) -> int:
    """After ``settle`` and the leader's last statistics (``status``: 'ok', 'error' or 'interrupted'; ``summary``
    and ``saved_step``: the leader's): the checkpoint kept after an error, the checksum, summary.json and the
    ``SUMMARY`` line; returns the exit code."""
    cfg, run, rank, out = setup.cfg, setup.run, setup.rank, setup.out
    kept: tuple[str, int] | None = None
    if status == "error" and out is not None and not cfg.no_checkpoint:
        if sync_error is None:
            kept = emergency_checkpoint(out, setup.replicas, saved_step, setup.start_step, cfg,
                                        setup.batches_per_step)
        elif saved_step is not None:
            kept = (str(checkpoint_files.step_dir(out, saved_step)), saved_step)
    params = setup.replicas[0].model.parameters()  # the leader's replica
    checksum = float(sum(p.detach().double().sum().cpu() for p in params)) if sync_error is None else float("nan")
    emit_line(f"PARAM_CHECKSUM rank={rank} {checksum:.10e}")
    summary.update(summary_fields(setup, status, util, counts, keys, sync_error))
    summary.update({"checkpoint_kept": kept[0] if kept else None, "hung": False})
    summary.update(summary_tail(setup, checksum))
    if out is not None:
        note = metrics.plot(setup.log.records, out / "metrics.png")
        if note:
            print(note, flush=True)
            summary["plot"] = note
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    setup.log.close()
    if rank == 0:
        emit_line("SUMMARY " + json.dumps(short_summary(summary, out), default=str))
    if status == "error":
        print(f"\nFATAL: a worker thread failed; first error:\n{run.errors.first}", file=sys.stderr, flush=True)
        where = f"checkpoint of step {kept[1]} kept: {kept[0]}" if kept else "no checkpoint written"
        print(f"train.py: error: {summary['errors']['first_line']} (last completed step {run.steps_done}; {where})",
              file=sys.stderr, flush=True)
    if setup.world > 1 and status == "ok":
        import torch.distributed as dist

        dist.destroy_process_group()
    return {"ok": 0, "error": 1, "interrupted": 130}[status]


def summary_fields(setup: Setup, status: str, util: metrics.GpuUtil | None, counts: dict[str, float], keys: float,
                   sync_error: str | None) -> dict[str, Any]:
    """summary.json from ``status`` to ``errors``: what ran where, throughput, MFU, GPU time per phase, compiles."""
    cfg, run = setup.cfg, setup.run
    tp = run.throughput.summary()
    mfu = mfu_report(setup, tp, counts, keys, sync_error)
    gpu_util = util.mean(run.throughput.window()) if util is not None else None
    first = run.errors.first_exc
    return {
        "status": status, "layout": cfg.layout, "steps_done": run.steps_done, "start_step": setup.start_step,
        "steps": cfg.steps, "rank": setup.rank, "world_size": setup.world,
        "threads": ({"target": cfg.target_threads, "drafter": cfg.drafter_threads} if cfg.layout == "threaded"
                    else {"sequential": len(setup.replicas)}),
        "devices": {"target": [str(x) for x in setup.t_dev], "drafter": [str(x) for x in setup.d_dev]},
        "throughput": tp, "mfu": mfu, "gpu_util_pct": gpu_util,
        "gpu_util_source": (util.source or util.reason) if util is not None else None,
        "compile": metrics.compile_counts(),
        "errors": {"total": run.errors.total(), "counted": dict(run.errors.counts), "first": run.errors.first,
                   "first_line": one_line(first) if first is not None else None},
    }


def summary_tail(setup: Setup, checksum: float) -> dict[str, Any]:
    """summary.json from ``peak_gpu_mem_bytes`` on: memory, checksum, the package and torch, wall time, config."""
    peak = peak_reserved = None
    if setup.cuda:  # allocated: tensors alive; reserved: what the caching allocator holds from the driver
        peak = sum(torch.cuda.max_memory_allocated(d) for d in dict.fromkeys(setup.devices))
        peak_reserved = sum(torch.cuda.max_memory_reserved(d) for d in dict.fromkeys(setup.devices))
    return {
        "peak_gpu_mem_bytes": peak, "peak_gpu_reserved_bytes": peak_reserved, "param_checksum": checksum,
        "ttc": package_state.state(),
        "torch": torch.__version__, "wall_s": round(time.monotonic() - setup.run.throughput.start, 2),
        "config": setup.cfg.as_dict(),
    }


def mfu_report(setup: Setup, tp: dict[str, dict[str, float | None]], counts: dict[str, float], keys: float,
               sync_error: str | None) -> dict[str, Any]:
    """MFU of target and drafter over the steady window, and per phase from its GPU time (CUDA)."""
    cfg, devices = setup.cfg, setup.devices
    gpus = len({d for d in list(setup.t_dev) + list(setup.d_dev) if d.type == "cuda"})
    peak_t = {kind: (cfg.peak_tflops or (flops.peak_tflops(torch.cuda.get_device_name(devices[0]), bf16)
                                         if setup.cuda else None))
              for kind, bf16 in (("target", cfg.target_dtype == "bfloat16"), ("drafter", cfg.autocast == "bf16"))}
    mfu: dict[str, Any] = {
        kind: flops.mfu(counts[kind], (tp.get(kind) or {}).get("steady_tokens_per_s"), peak_t[kind], gpus)
        for kind in ("target", "drafter")}
    phases: dict[str, dict[str, float]] = (
        setup.timer.summary(setup.mark_after) if setup.cuda and sync_error is None else {})
    for kind, ph in phases.items():  # every interval covers one batch (see the loops)
        peak = peak_t.get(kind)
        if peak:
            ph["mfu_in_interval"] = round(counts[kind] * setup.tokens_per_batch / (ph["mean_ms"] / 1e3) / 1e12 / peak, 4)
    mfu["peak_tflops_per_gpu"] = peak_t
    mfu["gpus"] = gpus
    mfu["mean_attended_keys"] = round(keys, 1)
    mfu["phases"] = phases
    return mfu


def emergency_checkpoint(out: Path, replicas: list[Replica], saved_step: int | None, start_step: int,
                         cfg: Config, batches_per_step: int) -> tuple[str, int] | None:
    """After a thread died: the state of the last step the replicas completed (replicas are identical after a
    completed step; one caught inside its optimizer update is skipped), unless that step is already saved.
    Returns (path, step) of the checkpoint that holds the last completed step, or None."""
    usable = [r for r in replicas if not r.updating]
    if not usable:
        return None
    rep = max(usable, key=lambda r: r.completed)
    if saved_step is not None and saved_step >= rep.completed:
        return str(checkpoint_files.step_dir(out, saved_step)), saved_step
    if rep.completed <= start_step:
        return None
    try:
        return save_checkpoint(out, rep, rep.completed, cfg, batches_per_step), rep.completed
    except Exception as e:  # the device may be unusable after the failure
        print(f"checkpoint of step {rep.completed} not written: {one_line(e)}", file=sys.stderr, flush=True)
        return None


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def short_summary(s: dict[str, Any], out: Path | None) -> dict[str, Any]:
    """The one-line ``SUMMARY`` (stdout); everything else, the full TTC status included, is in summary.json."""
    tp = {kind: {"tokens": v.get("tokens"), "steady_tokens_per_s": v.get("steady_tokens_per_s"),
                 "time_to_first_step_s": v.get("time_to_first_step_s")}
          for kind, v in s["throughput"].items() if kind in ("target", "drafter")}
    ttc = s.get("ttc") or {}
    return {
        "status": s["status"], "layout": s["layout"], "steps_done": s["steps_done"], "start_step": s["start_step"],
        "world_size": s["world_size"], "threads": s["threads"], "tau_initial": s.get("tau_initial"),
        "tau_final": s.get("tau_final"), "loss_first": s.get("loss_first"), "loss_last": s.get("loss_last"),
        "throughput": tp, "mfu": {k: (s["mfu"].get(k) or {}).get("mfu") for k in ("target", "drafter")},
        "gpu_util_pct": s.get("gpu_util_pct"),
        "peak_gpu_mem_mib": round(s["peak_gpu_mem_bytes"] / 2**20) if s.get("peak_gpu_mem_bytes") else None,
        "compile": {k: s["compile"].get(k) for k in ("unique_graphs", "recompiles")},
        "errors": {"total": s["errors"]["total"], "first": s["errors"]["first_line"]},
        "ttc": ttc.get("label"),
        "summary_json": str(out / "summary.json") if out is not None else None,
    }



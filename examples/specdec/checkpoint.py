"""Checkpoints in safetensors: drafter weights, optimizer state, step, data position and RNG state.

Layout: ``DIR/ckpt-NNNNNN/checkpoint.safetensors`` (tensors: ``model.*``, ``optim.<param>.<name>``,
``rng.torch``) with string metadata (step, optimizer param groups, data position), plus a readable ``meta.json``.
Data batches are a pure function of the step (see data.py) and the learning rate a pure function of the step, so
(weights, optimizer state, step) is everything a bit-exact resume needs; the RNG state is stored for code that
adds randomness (dropout, sampling).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from . import checkpoint_files
from .checkpoint_files import CheckpointError

# safetensors is imported where a checkpoint is written or read, not at import: a run with --no-checkpoint
# does not need it (free-threaded CPython 3.13t has no safetensors wheel: its abi3 wheels do not apply there).


def save(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, extra: dict[str, Any]) -> None:
    """Write atomically (temporary directory, then rename) so a crash never leaves a half checkpoint."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {f"model.{k}": v.detach().cpu().contiguous()
                                        for k, v in model.state_dict().items()}
    sd = opt.state_dict()
    for pid, state in sd["state"].items():
        for name, value in state.items():
            tensors[f"optim.{pid}.{name}"] = torch.as_tensor(value).detach().cpu().contiguous()
    tensors["rng.torch"] = torch.get_rng_state()
    # A learning rate may be a device tensor (--step-graphs: a captured update reads it); stored as a number.
    groups = json.dumps(sd["param_groups"], default=lambda v: v.item() if isinstance(v, torch.Tensor) else str(v))
    meta = {"step": str(step), "param_groups": groups,
            "extra": json.dumps(extra, default=str)}
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "checkpoint.safetensors"), metadata=meta)
    (tmp / "meta.json").write_text(json.dumps({"step": step, **extra}, indent=2, default=str))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def find(path: Path) -> Path:
    """A checkpoint directory itself, or the newest ``ckpt-NNNNNN`` inside an output directory."""
    found = checkpoint_files.locate(path)
    if found is None:
        raise CheckpointError(f"no checkpoint under {path}")
    return found


def load(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Restore weights, optimizer state and RNG in place; returns the step to continue from. The files are checked
    first (``checkpoint_files.read``), then their tensors against ``model`` and ``opt``: a checkpoint that does not
    fit raises ``CheckpointError`` naming what differs, before anything is changed."""
    from safetensors.torch import load_file

    info = checkpoint_files.read(path)
    groups = json.loads(info.metadata["param_groups"])
    check_fits(info, model, opt, groups)
    try:
        tensors = load_file(str(path / checkpoint_files.WEIGHTS))
    except Exception as e:  # the file changed since it was checked, or safetensors disagrees with the check
        raise CheckpointError(f"{path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    dev = next(model.parameters()).device
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")}, strict=True)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, pid, name = key.split(".", 2)
            state.setdefault(int(pid), {})[name] = value if name == "step" else value.to(dev)
    opt.load_state_dict({"state": state, "param_groups": groups})
    torch.set_rng_state(tensors["rng.torch"])
    return info.step


def check_fits(info: checkpoint_files.CheckpointInfo, model: torch.nn.Module, opt: torch.optim.Optimizer,
               groups: Any) -> None:
    """The checkpoint's tensors are exactly the model's parameters with their shapes, optimizer state for existing
    parameters, the RNG state; its parameter groups as many as the optimizer's, with as many parameters each."""
    where = f"{info.dir.name}/{checkpoint_files.WEIGHTS}"
    want = {f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items()}
    have = {k: e.shape for k, e in info.tensors.items() if k.startswith("model.")}
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        raise CheckpointError(f"{where} does not hold this model's weights: missing {_few(missing)}, "
                              f"unexpected {_few(extra)}")
    wrong = [f"{k} {list(have[k])} there, {list(want[k])} here" for k in want if have[k] != want[k]]
    if wrong:
        raise CheckpointError(f"{where} holds weights of other shapes than this model's: {_few(wrong)}")
    sizes = [len(g["params"]) for g in opt.state_dict()["param_groups"]]
    saved = [len(g.get("params", [])) if isinstance(g, dict) else -1 for g in groups]
    if sizes != saved:
        raise CheckpointError(f"{where}: optimizer parameter groups of {saved} parameters, this optimizer has {sizes}")
    params = [p for g in opt.param_groups for p in g["params"]]
    for key, entry in info.tensors.items():
        if not key.startswith("optim."):
            continue
        parts = key.split(".", 2)
        pid = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else -1
        if not 0 <= pid < len(params):
            raise CheckpointError(f"{where}: optimizer state {key!r} for a parameter this optimizer does not have")
        if parts[2] != "step" and entry.shape != tuple(params[pid].shape):
            raise CheckpointError(f"{where}: optimizer state {key} {list(entry.shape)} does not fit its parameter "
                                  f"{list(params[pid].shape)}")
    if "rng.torch" not in info.tensors:
        raise CheckpointError(f"{where}: no RNG state ('rng.torch')")


def _few(names: list[str], n: int = 3) -> str:
    return "none" if not names else ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")

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
    """A checkpoint directory itself, or the newest ``ckpt-*`` inside an output directory."""
    if (path / "checkpoint.safetensors").exists():
        return path
    found = sorted(p for p in path.glob("ckpt-*") if (p / "checkpoint.safetensors").exists())
    if not found:
        raise FileNotFoundError(f"no checkpoint under {path}")
    return found[-1]


def load(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Restore weights, optimizer state and RNG in place; returns the step to continue from."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    file = str(path / "checkpoint.safetensors")
    with safe_open(file, framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(file)
    dev = next(model.parameters()).device
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")}, strict=True)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, pid, name = key.split(".", 2)
            state.setdefault(int(pid), {})[name] = value if name == "step" else value.to(dev)
    opt.load_state_dict({"state": state, "param_groups": json.loads(meta["param_groups"])})
    torch.set_rng_state(tensors["rng.torch"])
    return int(meta["step"])

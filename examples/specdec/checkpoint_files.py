"""A checkpoint's files, read and checked without torch: where ``--resume`` finds the checkpoint, whether its
``checkpoint.safetensors`` is whole (header, tensor table, every byte accounted for), what its metadata and
``meta.json`` say, and which of the run's settings differ from the ones it was made with.

The command line is checked before torch is imported (``cli.validate``), so a garbage or truncated file, a garbage
``meta.json`` or a checkpoint of another model is answered with one line and exit code 2 here, before anything is
built. ``checkpoint.load`` then checks the tensors against the model it loads them into.
"""
from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WEIGHTS = "checkpoint.safetensors"
META = "meta.json"
CKPT_DIR = re.compile(r"ckpt-(\d+)")  # ckpt-NNNNNN; not ckpt-NNNNNN.tmp, a save that never finished
# safetensors refuses larger headers itself; a garbage file's first 8 bytes read as a length are usually far larger.
MAX_HEADER = 100 * 2**20
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
               "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}
# The settings that define what a checkpoint's drafter was trained for: the target (its source, shapes, weights'
# seed, the synthetic prior) and the token stream (vocabulary, data, tokenizer). Resuming with another value trains
# the drafter for another model: --resume refuses unless --allow-config-change. Everything else (steps, learning
# rate, threads, devices, batch size, TTT depth, ...) may change between a run and its resumption.
MODEL_FIELDS = ("target_hf", "vocab_size", "target_dim", "target_layers", "target_heads", "target_kv_heads",
                "target_ffn", "rope_theta", "prior_strength", "seed", "data", "tokenizer")


def step_dir(out: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lies in an output directory (``CKPT_DIR``)."""
    return out / f"ckpt-{step:06d}"


class CheckpointError(Exception):
    """A checkpoint that cannot be used, said in one line (the trainer prints it as ``train.py: error: ...``)."""


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint's files say, once they were found whole."""

    dir: Path
    step: int
    config: dict[str, Any] | None  # the run's configuration when it was saved (None: not recorded)
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def locate(path: Path) -> Path | None:
    """The checkpoint ``--resume PATH`` means: PATH itself when it holds one, else the newest ``ckpt-NNNNNN`` in it
    (by step number; unfinished ``.tmp`` directories are not checkpoints), else None."""
    if (path / WEIGHTS).exists():
        return path
    found = [(int(m.group(1)), p) for p in path.glob("ckpt-*")
             if (m := CKPT_DIR.fullmatch(p.name)) and (p / WEIGHTS).exists()]
    return max(found)[1] if found else None


def read(ckpt: Path) -> CheckpointInfo:
    """Read and check ``ckpt``'s files; raises ``CheckpointError`` naming the first problem."""
    tensors, metadata = read_header(ckpt / WEIGHTS)
    where = _shown(ckpt / WEIGHTS)
    for key in ("step", "param_groups"):
        if key not in metadata:
            raise CheckpointError(f"{where}: no {key!r} in its metadata: not a checkpoint of this trainer")
    step = _int(metadata["step"], f"{where}: metadata 'step'")
    if not isinstance(_json(metadata["param_groups"], f"{where}: metadata 'param_groups'"), list):
        raise CheckpointError(f"{where}: metadata 'param_groups' is not a list")
    extra = _json(metadata.get("extra", "{}"), f"{where}: metadata 'extra'")
    config = extra.get("config") if isinstance(extra, dict) else None
    if config is not None and not isinstance(config, dict):
        raise CheckpointError(f"{where}: metadata 'extra' has a 'config' that is not a mapping")
    meta_step = read_meta(ckpt / META)
    if meta_step != step:
        raise CheckpointError(f"{_shown(ckpt / META)} says step {meta_step}, {WEIGHTS} says step {step}: files of "
                              f"two different checkpoints")
    if not any(name.startswith("model.") for name in tensors):
        raise CheckpointError(f"{where}: no model.* tensors: not a checkpoint of this trainer")
    return CheckpointInfo(ckpt, step, config, tensors, metadata)


def _shown(file: Path) -> str:
    """A checkpoint file as an error names it: its directory and name (the line starts with ``--resume PATH``)."""
    return f"{file.parent.name}/{file.name}"


def read_header(file: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """The tensor table and string metadata of a safetensors file, after checking that the table describes the
    file exactly: every tensor's bytes inside the file, no gap, no overlap, nothing missing at the end."""
    shown = _shown(file)
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{shown}: {size} bytes, too short for a safetensors file (truncated?)")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER, size - 8):
                raise CheckpointError(f"{shown}: not a safetensors file, or truncated: its header claims {n} bytes "
                                      f"of a {size}-byte file")
            raw = fh.read(n)
    except OSError as e:
        raise CheckpointError(f"{shown}: cannot read it ({e.strerror or type(e).__name__})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise CheckpointError(f"{shown}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{shown}: not a safetensors file (its header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{shown}: its metadata is not a mapping of strings")
    tensors, spans = _tensor_table(shown, header)
    _check_coverage(shown, spans, size - 8 - n)
    return tensors, metadata


def _tensor_table(shown: str, header: dict[str, Any]) -> tuple[dict[str, TensorEntry], list[tuple[int, int, str]]]:
    tensors: dict[str, TensorEntry] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        entry = entry if isinstance(entry, dict) else {}
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (entry.get("dtype") in DTYPE_BYTES and isinstance(shape, list) and isinstance(offsets, list)
                and all(isinstance(d, int) and d >= 0 for d in shape)
                and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise CheckpointError(f"{shown}: tensor {name!r} has a malformed entry in the header")
        begin, end = offsets
        if not 0 <= begin <= end or end - begin != math.prod(shape) * DTYPE_BYTES[entry["dtype"]]:
            raise CheckpointError(f"{shown}: tensor {name!r}: its byte range does not match its shape and dtype")
        tensors[name] = TensorEntry(entry["dtype"], tuple(shape))
        spans.append((begin, end, name))
    return tensors, spans


def _check_coverage(shown: str, spans: list[tuple[int, int, str]], data_bytes: int) -> None:
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise CheckpointError(f"{shown}: tensor {name!r} starts at byte {begin} of the data, expected {at} "
                                  f"(overlapping or missing data)")
        at = end
    if at != data_bytes:
        what = "truncated" if at > data_bytes else "has trailing bytes"
        raise CheckpointError(f"{shown}: {what}: its tensors need {at} bytes of data, the file holds {data_bytes}")


def read_meta(file: Path) -> int:
    """The step that ``meta.json`` records (every checkpoint of this trainer has one, written with it)."""
    shown = _shown(file)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"{shown}: missing (written with every checkpoint: an incomplete copy?)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{shown}: cannot read it ({getattr(e, 'strerror', None) or type(e).__name__})") from None
    meta = _json(text, shown)
    if not isinstance(meta, dict) or "step" not in meta:
        raise CheckpointError(f"{shown}: not a checkpoint's meta.json (no 'step')")
    return _int(meta["step"], f"{shown}: 'step'")


def config_differences(saved: dict[str, Any] | None, now: dict[str, Any]) -> list[str]:
    """The settings of ``MODEL_FIELDS`` whose values differ, as ``--flag SAVED -> NOW``."""
    if saved is None:
        return ["the checkpoint records no configuration"]
    return [f"--{name.replace('_', '-')} {saved.get(name)} -> {now.get(name)}" for name in MODEL_FIELDS
            if saved.get(name) != now.get(name)]


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"{what}: not valid JSON ({e})") from None


def _int(value: Any, what: str) -> int:
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise CheckpointError(f"{what} is {value!r}, not a step number") from None

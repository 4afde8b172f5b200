"""Bad invocations of the reference trainer: each gets one line on stderr and a non-zero exit within seconds (the
command line is checked before torch is imported or anything is built), never a traceback or a hang. CPU only;
every run has a timeout well under a minute."""
from __future__ import annotations

import json
import math
import os
import random
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "specdec" / "train.py"


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def bad_run(args: List[str], timeout: float = 55) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TTC_DISABLE", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(TRAIN), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert time.monotonic() - start < 60
    return proc


def assert_one_line(proc: subprocess.CompletedProcess, *needles: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("train.py: error: "), proc.stderr
    assert "Traceback" not in proc.stderr and "SUMMARY" not in proc.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("args, needle", [
    (["--target-threads", "0"], "--target-threads must be at least 1 (got 0)"),
    (["--drafter-threads", "0"], "--drafter-threads must be at least 1 (got 0)"),
    (["--drafter-threads", "-2"], "--drafter-threads must be at least 1"),
    (["--steps", "-5"], "--steps must be at least 1 (got -5)"),
    (["--steps", "0"], "--steps must be at least 1 (got 0)"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--seq-len", "-1"], "--seq-len must be at least 1"),
    (["--vocab-size", "0"], "--vocab-size must be at least 1"),
    (["--target-dim", "-8"], "--target-dim must be at least 1"),
    (["--target-layers", "0"], "--target-layers must be at least 1"),
    (["--target-heads", "0"], "--target-heads must be at least 1"),
    (["--ttt-steps", "0"], "--ttt-steps must be at least 1"),
    (["--queue-size", "0"], "--queue-size must be at least 1"),
    (["--lr", "0"], "--lr must be positive"),
    (["--target-dim", "100", "--target-heads", "3"], "not a multiple of --target-heads"),
    (["--seq-len", "4", "--ttt-steps", "3"], "too short for --ttt-steps"),
    (["--steps", "abc"], "invalid int value"),
    (["--devices", "gpu"], "--devices 'gpu'"),
    (["--devices", "cpu,cuda:0"], "mixes CPU and CUDA"),
    (["--devices", "auto,cpu"], "--devices 'auto,cpu'"),
    (["--inject-fault", "boom"], "--inject-fault"),
    (["--target-compile-scope", "layer", "--target-compile-mode", "reduce-overhead"], "needs --target-compile-scope model"),
    (["--resume", "/nonexistent/run"], "--resume /nonexistent/run: no such file or directory"),
    (["--step-graphs"], "--step-graphs needs CUDA devices"),
    (["--step-graphs", "--devices", "cuda:0", "--no-streams"], "--step-graphs needs --streams"),
    (["--step-graphs", "--devices", "cuda:0", "--drafter-compile-mode", "reduce-overhead"],
     "--drafter-compile-mode reduce-overhead would nest them"),
    (["--target-sms", "0"], "--target-sms must be at least 1 (got 0)"),
    (["--target-sms", "16", "--layout", "sequential"], "--target-sms needs the threaded layout"),
    (["--target-sms", "16", "--devices", "cuda:0", "--no-streams"], "--target-sms needs the threaded layout"),
    (["--target-sms", "16"], "--target-sms needs CUDA devices"),
])
def test_bad_argument(args: List[str], needle: str) -> None:
    assert_one_line(bad_run(["--preset", "cpu-tiny", *args]), needle)


def test_out_cannot_be_created(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert_one_line(bad_run(["--preset", "cpu-tiny", "--out", str(blocker / "run")]), "--out", "cannot create")


def test_resume_without_checkpoint(tmp_path: Path) -> None:
    assert_one_line(bad_run(["--preset", "cpu-tiny", "--resume", str(tmp_path)]), "no checkpoint there")


def cpu_tiny_config(**changes: object) -> Dict[str, object]:
    from examples.specdec.config import resolve  # the repository root is on pytest's path (pyproject.toml)

    return {**resolve({"preset": "cpu-tiny"}).as_dict(), **changes}


def write_checkpoint(ckpt: Path, step: int, config: Optional[Dict[str, object]],
                     tensors: Optional[Dict[str, List[int]]] = None, meta_step: Optional[int] = None) -> Path:
    """A checkpoint in the trainer's layout, written with the standard library (safetensors' format: a little-endian
    header length, the JSON header with string metadata, then each tensor's bytes): F32 zeros of the given shapes."""
    tensors = tensors if tensors is not None else {"model.fuse.weight": [128, 384], "rng.torch": [16]}
    extra = {"data_position": step * 2, **({"config": config} if config is not None else {})}
    header: Dict[str, object] = {"__metadata__": {"step": str(step), "param_groups": "[]", "extra": json.dumps(extra)}}
    at = 0
    for name, shape in tensors.items():
        n = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    ckpt.mkdir(parents=True)
    (ckpt / "checkpoint.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(at))
    (ckpt / "meta.json").write_text(json.dumps({"step": step if meta_step is None else meta_step, **extra}))
    return ckpt


def test_resume_at_or_past_the_last_step(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "ckpt-000050", 50, cpu_tiny_config())
    assert_one_line(bad_run(["--preset", "cpu-tiny", "--steps", "50", "--resume", str(tmp_path)]),
                    "is at step 50", "nothing to train")


def test_resume_of_a_garbage_checkpoint_is_one_line(tmp_path: Path) -> None:
    """Before: ~20 lines of traceback ending in ``SafetensorError: Error while deserializing header: header too
    large``, exit 1."""
    ckpt = write_checkpoint(tmp_path / "ckpt-000010", 10, cpu_tiny_config())
    (ckpt / "checkpoint.safetensors").write_bytes(random.Random(0).randbytes(5000))
    assert_one_line(bad_run(["--preset", "cpu-tiny", "--resume", str(tmp_path)]),
                    f"--resume {tmp_path}: ckpt-000010/checkpoint.safetensors: not a safetensors file")


def test_resume_of_a_truncated_checkpoint_is_one_line(tmp_path: Path) -> None:
    """Before: a traceback ending in ``incomplete metadata, file not fully covered``, exit 1."""
    ckpt = write_checkpoint(tmp_path / "ckpt-000010", 10, cpu_tiny_config())
    weights = ckpt / "checkpoint.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    assert_one_line(bad_run(["--preset", "cpu-tiny", "--resume", str(tmp_path)]), "truncated", "the file holds")


@pytest.mark.parametrize("meta, needle", [("garbage{", "meta.json: not valid JSON"),
                                          ('{"step": 9}', "says step 9, checkpoint.safetensors says step 10"),
                                          (None, "meta.json: missing")])
def test_resume_with_a_bad_meta_json_is_one_line(tmp_path: Path, meta: Optional[str], needle: str) -> None:
    """Before: a garbage ``meta.json`` was ignored silently (and the run resumed)."""
    ckpt = write_checkpoint(tmp_path / "ckpt-000010", 10, cpu_tiny_config())
    if meta is None:
        (ckpt / "meta.json").unlink()
    else:
        (ckpt / "meta.json").write_text(meta)
    assert_one_line(bad_run(["--preset", "cpu-tiny", "--resume", str(tmp_path)]), needle)


@pytest.mark.parametrize("flags, needle", [(["--vocab-size", "300"], "--vocab-size 256 -> 300"),
                                           (["--target-dim", "64"], "--target-dim 128 -> 64"),
                                           (["--seed", "3"], "--seed 0 -> 3")])
def test_resume_for_another_model_is_refused_naming_what_differs(tmp_path: Path, flags: List[str], needle: str) -> None:
    """Before: ``--resume runs/tiny --vocab-size 300`` (a checkpoint of 256) resumed silently, and τ fell from 1.571
    to 0.009."""
    write_checkpoint(tmp_path / "ckpt-000010", 10, cpu_tiny_config())
    assert_one_line(bad_run(["--preset", "cpu-tiny", "--resume", str(tmp_path), *flags]),
                    "was made for another model or data", needle, "--allow-config-change")


def test_resume_for_another_model_with_allow_config_change(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "ckpt-000010", 10, cpu_tiny_config())
    proc = bad_run(["--preset", "cpu-tiny", "--resume", str(tmp_path), "--vocab-size", "300", "--allow-config-change",
                    "--dry-run"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["config"]["allow_config_change"] is True


def test_resume_of_weights_that_do_not_fit_the_model_is_one_line(tmp_path: Path) -> None:
    """Checked once the model is built, before anything is loaded: a checkpoint whose tensors are not the model's
    (here forced past the configuration check) gets one line and exit 2, not ``load_state_dict``'s traceback."""
    write_checkpoint(tmp_path / "ckpt-000010", 10, cpu_tiny_config(target_dim=64),
                     tensors={"model.fuse.weight": [64, 192], "rng.torch": [16]})
    proc = bad_run(["--preset", "cpu-tiny", "--resume", str(tmp_path), "--allow-config-change"])
    assert_one_line(proc, f"--resume {tmp_path}: ckpt-000010/checkpoint.safetensors",
                    "does not hold this model's weights: missing model.attn")


@pytest.mark.skipif(cuda_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("args", [["--preset", "cuda-small"], ["--preset", "multi-gpu"], ["--preset", "cuda-8b"],
                                  ["--preset", "cpu-tiny", "--devices", "cuda:0"],
                                  ["--preset", "cpu-tiny", "--devices", "cuda"]])
def test_cuda_requested_without_cuda(args: List[str]) -> None:
    assert_one_line(bad_run(args), "needs CUDA", "use --devices cpu")


@pytest.mark.skipif(cuda_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("flag", [["--step-graphs"], ["--target-sms", "16"]])
def test_cuda_only_flag_with_auto_devices_without_cuda(flag: List[str]) -> None:
    assert_one_line(bad_run(["--preset", "cpu-tiny", "--devices", "auto", *flag]), f"{flag[0]} needs CUDA")


def test_no_ttc_bad_argument_still_one_line() -> None:
    """--no-ttc re-executes the interpreter; arguments are checked before that, once."""
    assert_one_line(bad_run(["--preset", "cpu-tiny", "--no-ttc", "--steps", "-5"]), "--steps must be at least 1")

#!/usr/bin/env python
"""Thread-pool inference server: one compiled model, called from uvicorn's request threads (see README.md here).

    python examples/serve/server.py --model mlp --port 8000
    python examples/serve/load.py --port 8000            # in another shell: a bounded burst, checked against eager

It listens on 127.0.0.1 only. Whether torch-threadsafe-compile protects it is the package's business (it
activates at interpreter start; ``TTC_DISABLE=1`` turns it off): the server reports what ``status()`` says.
``--lock`` puts one global lock around the model and ``--workers N`` runs N processes with one model each, the two
things programs do today instead.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if not __package__:
    # Run as a script (the documented command), or imported as __mp_main__ by a worker process that
    # multiprocessing spawned: this file's package is ``examples.serve`` of the repository root (PEP 366).
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    __package__ = "examples.serve"

from .config import CONFIG_ENV, ServeConfig

HOST = "127.0.0.1"


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {value})")
    return value


def parse(argv: list[str] | None = None) -> tuple[ServeConfig, int, int, bool]:
    d = ServeConfig()
    p = argparse.ArgumentParser(prog="server.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["mlp", "block"], default=d.model)
    p.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (default 8000)")
    p.add_argument("--device", default=d.device, help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--backend", default=d.backend, help="torch.compile backend (default inductor)")
    p.add_argument("--mode", default=None, help="torch.compile mode (default: reduce-overhead on CUDA, none on CPU)")
    p.add_argument("--lock", action="store_true", help="one global lock around the model (the usual workaround)")
    p.add_argument("--workers", type=positive, default=1, help="worker processes, one model each (default 1)")
    p.add_argument("--threads", type=positive, default=d.threads, help=f"request threads per process (default {d.threads})")
    p.add_argument("--max-batch", type=positive, default=d.max_batch)
    p.add_argument("--max-seq", type=positive, default=d.max_seq)
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the model's weights")
    p.add_argument("--stats-dir", default=None, help="each process writes its final /v1/stats to DIR/stats-<pid>.json")
    p.add_argument("--access-log", action="store_true", help="log every request (off: it costs CPU under load)")
    a = p.parse_args(argv)
    if not 0 < a.port < 65536:
        p.error(f"--port must be in 1..65535 (got {a.port})")
    if a.device != "cpu" and not a.device.startswith("cuda"):
        p.error(f"--device must be cpu, cuda or cuda:N (got {a.device!r})")
    if a.stats_dir and not Path(a.stats_dir).is_dir():
        p.error(f"--stats-dir {a.stats_dir} is not a directory")
    cfg = ServeConfig(model=a.model, device=a.device, backend=a.backend, mode=a.mode, lock=a.lock, threads=a.threads,
                      max_batch=a.max_batch, max_seq=a.max_seq, seed=a.seed, stats_dir=a.stats_dir)
    return cfg, a.port, a.workers, a.access_log


def main(argv: list[str] | None = None) -> int:
    cfg, port, workers, access_log = parse(argv)
    import uvicorn

    # uvicorn's worker processes are fresh interpreters: they read the configuration from the environment.
    os.environ[CONFIG_ENV] = cfg.to_json()
    uvicorn.run("examples.serve.app:app_from_env", factory=True, host=HOST, port=port, workers=workers,
                access_log=access_log, timeout_graceful_shutdown=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())

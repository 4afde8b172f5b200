"""The server's configuration: no torch and no web framework here, so that server.py answers a bad command line
at once and hands the configuration to uvicorn's worker processes before anything heavy is imported."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

CONFIG_ENV = "SERVE_EXAMPLE_CONFIG"  # how server.py hands its configuration to uvicorn's worker processes


@dataclass(frozen=True)
class ServeConfig:
    model: str = "mlp"
    device: str = "cpu"
    backend: str = "inductor"
    mode: str | None = None  # None: inductor's default on the CPU, "reduce-overhead" (CUDA graphs) on CUDA
    lock: bool = False  # one global lock around the model: what programs do today without the package
    threads: int = 40  # the request thread pool's size (anyio's default)
    max_batch: int = 32
    max_seq: int = 64
    seed: int = 0
    stats_dir: str | None = None  # where each process writes its /v1/stats as stats-<pid>.json at shutdown

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: str) -> ServeConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in json.loads(raw).items() if k in fields})

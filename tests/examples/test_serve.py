"""The serving example end to end: examples/serve/server.py started cold on 127.0.0.1 with the package active, a
bounded burst of concurrent requests of every batch size from 1 to 8 (each answer equal to the model run eagerly
here), bad requests answered with a 4xx while the server goes on serving, then Ctrl-C. CPU only; the MLP's cold
compiles take most of the time (about 10-30 s on two cores), and every wait has a deadline."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from examples.serve import load, models

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "examples" / "serve" / "server.py"
MAX_BATCH = 8

pytestmark = pytest.mark.timeout(120)


@dataclass
class Server:
    proc: subprocess.Popen[str]
    port: int
    stats_dir: Path
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "stats").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTC_")}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "inductor")  # cold, whatever ran before
    env["PYTHONUNBUFFERED"] = "1"
    port = free_port()
    log = tmp / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(SERVER), "--model", "mlp", "--port", str(port), "--max-batch",
                                 str(MAX_BATCH), "--stats-dir", str(tmp / "stats")], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, text=True)
    srv = Server(proc, port, tmp / "stats", log)
    try:
        deadline = time.monotonic() + 45
        while "Application startup complete." not in log.read_text():
            assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"server not ready in 45 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield srv
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def test_concurrent_burst_of_varying_shapes_equals_eager(server: Server) -> None:
    """48 requests, 24 in flight, every batch size 1..8: no failure, every answer equal to eager and given by a
    compiled graph, and each graph compiled once (not once per thread)."""
    jobs = load.make_jobs("mlp", load.batch_sizes(48, MAX_BATCH, seed=7), seed=7)

    async def burst() -> list[load.Outcome]:
        async with load.new_client(server.port, 24, timeout=40) as client:
            return await load.closed_loop(client, jobs, 24, deadline=time.perf_counter() + 45)

    outcomes = asyncio.run(burst())
    summary = load.summarize(outcomes)
    assert summary["failed"] == 0, (summary["errors"], server.log.read_text()[-3000:])
    assert summary["wrong"] == 0, summary
    assert summary["uncompiled"] == 0, summary
    stats = httpx.get(f"{server.url}/v1/stats", timeout=10).json()
    assert stats["ttc"]["active"] is True, stats["ttc"]
    assert stats["model_calls"] == 48 and stats["failed_calls"] == 0 and stats["uncompiled_calls"] == 0, stats
    assert stats["compiles"] >= 1 and stats["duplicate_compiles"] == 0, stats["graph_signatures"]
    assert stats["compiles"] == stats["distinct_graphs"] == stats["dynamo_unique_graphs"], stats


def _body(batch: int, seq: int = models.SEQ, features: int = models.FEATURES) -> dict[str, object]:
    return {"inputs": [[[0.5] * features] * seq] * batch}


BAD = [
    pytest.param(b'{"inputs": [[[1, 2', 400, "malformed JSON", id="malformed-json"),
    pytest.param(json.dumps(_body(2, features=15)).encode(), 422, "expected [batch, seq, 16]", id="wrong-features"),
    pytest.param(json.dumps({"inputs": [[1.0] * 16]}).encode(), 422, "expected [batch, seq, 16]", id="wrong-rank"),
    pytest.param(json.dumps({"inputs": [[[1.0] * 16], [[1.0] * 15]]}).encode(), 422, "rectangular", id="ragged"),
    pytest.param(json.dumps({**_body(1), "dtype": "float64"}).encode(), 422, "dtype 'float64' is not served",
                 id="wrong-dtype"),
    pytest.param(json.dumps({"inputs": [[["a"] * 16]]}).encode(), 422, "numbers", id="strings"),
    pytest.param(b'{"inputs": [[[NaN' + b", 1" * 15 + b"]]]}", 422, "NaN", id="nan"),
    pytest.param(json.dumps(_body(MAX_BATCH + 1)).encode(), 413, f"--max-batch {MAX_BATCH}", id="oversized-batch"),
    pytest.param(json.dumps(_body(1, seq=65)).encode(), 413, "--max-seq 64", id="oversized-seq"),
    pytest.param(json.dumps({"inputs": []}).encode(), 422, "empty", id="empty"),
    pytest.param(b'{"x": 1}', 422, "inputs", id="missing-inputs"),
]


@pytest.mark.parametrize("body, status, detail", BAD)
def test_bad_request_gets_4xx_and_server_keeps_serving(server: Server, body: bytes, status: int, detail: str) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = client.post("/v1/predict", content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        assert detail in r.json()["detail"], r.json()
        job = load.make_jobs("mlp", [3], seed=11)[0]
        ok = client.post("/v1/predict", content=job.body, headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text
    assert load.is_correct(load.Outcome(job, 200, 0, 0, ok.json()["compiled"], ok.json()["outputs"], None))


def test_ctrl_c_stops_the_server_and_writes_its_stats(server: Server) -> None:
    """Runs after the others in this module (pytest keeps file order): the server stops cleanly and its final
    counters say that no model call failed, whatever the bad requests before it were."""
    calls = httpx.get(f"{server.url}/v1/stats", timeout=10).json()["model_calls"]
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(20) == 0, server.log.read_text()[-3000:]
    (stats_file,) = server.stats_dir.glob("stats-*.json")
    stats = json.loads(stats_file.read_text())
    assert stats["failed_calls"] == 0 and stats["uncompiled_calls"] == 0, stats
    assert stats["model_calls"] == calls, stats
    assert stats["duplicate_compiles"] == 0, stats["graph_signatures"]


def test_bad_command_line_is_one_line_and_exit_2() -> None:
    """Answered before torch or the web framework is imported."""
    start = time.monotonic()
    p = subprocess.run([sys.executable, str(SERVER), "--workers", "0"], cwd=ROOT, capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == 2, p.stderr
    assert "--workers: must be at least 1 (got 0)" in p.stderr and "Traceback" not in p.stderr
    assert time.monotonic() - start < 10

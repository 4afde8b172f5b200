"""The HTTP application: FastAPI with *sync* endpoints, which Starlette runs in its thread pool (anyio's, 40
threads unless ``threads`` says otherwise), so that concurrent requests call the one compiled model from many
threads at once: the case torch-threadsafe-compile exists for.

    POST /v1/predict   {"inputs": [[[...16 numbers...], ...seq...], ...batch...], "dtype": "float32"}
                       -> {"outputs": [[...8 logits...], ...], "compiled": true}
    GET  /v1/stats     counters: model calls, failures, compiles, uncompiled calls, the package's state, peak RSS
    GET  /healthz      {"status": "ok"} once the model is built (it is compiled by the first requests)

Bad requests get a 4xx with a one-line ``detail`` and the server goes on serving: 400 malformed JSON, 413 a batch
or sequence over the limits, 422 anything else (shape, dtype, non-numbers, NaN). A model call that raises gets a
500 and is counted.
"""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from .config import CONFIG_ENV, ServeConfig
from .engine import BadInput, Engine, Limits, to_tensor


class PredictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inputs: list[Any]  # [batch][seq][FEATURES] numbers; checked by engine.to_tensor
    dtype: str = "float32"


def create_app(cfg: ServeConfig) -> FastAPI:
    """The application for ``cfg``; the model is built at start-up (in each worker process) and compiled by the
    first requests, as a server started cold is."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        import anyio.to_thread

        anyio.to_thread.current_default_thread_limiter().total_tokens = cfg.threads
        engine = Engine(cfg.model, device=cfg.device, backend=cfg.backend, mode=cfg.mode, lock=cfg.lock,
                        limits=Limits(cfg.max_batch, cfg.max_seq), seed=cfg.seed)
        app.state.engine = engine
        ttc = engine.stats()["ttc"]
        protection = f"active ({ttc['activation']})" if ttc["active"] else f"off ({ttc['reason']})"
        lock = "one global lock around the model" if cfg.lock else "no lock"
        print(f"serve: model {cfg.model} on {cfg.device}, backend {cfg.backend}, {cfg.threads} request threads, {lock}; "
              f"torch-threadsafe-compile {protection}", flush=True)
        if not ttc["active"] and not cfg.lock and cfg.threads > 1:
            print("serve: warning: the request threads will compile the model unprotected (duplicate compiles, then "
                  "uncompiled answers past dynamo's recompile limit); activate torch-threadsafe-compile or pass --lock",
                  flush=True)
        yield
        if cfg.stats_dir:
            path = Path(cfg.stats_dir) / f"stats-{os.getpid()}.json"
            path.write_text(json.dumps(engine.stats(), indent=1))

    app = FastAPI(title="torch-threadsafe-compile serving example", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            ctx = errors[0].get("ctx") or {}
            return JSONResponse({"detail": f"malformed JSON body: {ctx.get('error', 'cannot be parsed')}"}, 400)
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
        return JSONResponse({"detail": f"{where}: {first.get('msg', 'invalid request')}"}, 422)

    @app.exception_handler(BadInput)
    async def bad_input(request: Request, exc: BadInput) -> JSONResponse:
        return JSONResponse({"detail": exc.message}, exc.status)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/stats")
    def stats(request: Request) -> dict[str, Any]:
        engine: Engine = request.app.state.engine
        return engine.stats()

    @app.post("/v1/predict")
    def predict(body: PredictRequest, request: Request) -> JSONResponse:
        engine: Engine = request.app.state.engine
        x = to_tensor(body.inputs, body.dtype, engine.limits)
        try:
            pred = engine.predict(x)
        except Exception as e:  # counted by the engine; the server goes on serving
            return JSONResponse({"detail": f"model call failed: {type(e).__name__}: {str(e)[:300]}"}, 500)
        return JSONResponse({"outputs": pred.outputs.tolist(), "compiled": pred.compiled})

    return app


def app_from_env() -> FastAPI:
    """The factory uvicorn's worker processes call (``--workers N``): the configuration comes from server.py."""
    raw = os.environ.get(CONFIG_ENV)
    if not raw:
        raise RuntimeError(f"{CONFIG_ENV} is not set: start the server with examples/serve/server.py")
    return create_app(ServeConfig.from_json(raw))

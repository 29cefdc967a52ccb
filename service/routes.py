"""HTTP routes. Worker and validation errors become HTTP errors in `install_error_handlers`, nowhere else."""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import generate_latest

from ppo_logprobs.workers.errors import (
    CheckpointNotFound,
    IncompatibleWeights,
    InvalidCheckpoint,
    UpdateFailed,
    WeightsChanged,
    WeightsUnavailable,
    cause,
)
from ppo_logprobs.workers.pool.log_prob_worker import validate_request

from .batcher import Overloaded
from .schemas import LogProbsRequest, LogProbsResponse, ModelInfo, ModelList, ReloadRequest, SequenceResult, Usage

router = APIRouter()


class TooLarge(ValueError):
    """A sequence or request over the configured length limits (HTTP 413)."""


## NB: Serve pickles the FastAPI app apart from the ingress class, so the replica's Gateway cannot be put on
# app.state from its constructor; each replica process holds exactly one, registered here when it starts.
_gateway = None


def set_gateway(gw) -> None:
    global _gateway
    _gateway = gw


def gateway():
    if _gateway is None:
        raise HTTPException(503, "the gateway is starting", headers={"Retry-After": "5"})
    return _gateway


def require_key(authorization: Annotated[str | None, Header()] = None) -> None:
    key = gateway().settings.api_key
    if key is None:
        return
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key.encode()):
        raise HTTPException(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")


GatewayDep = Annotated[object, Depends(gateway)]
Authorized = [Depends(require_key)]


def served(gw, name: str | None):
    name = name or next(iter(gw.models))
    if name not in gw.models:
        raise HTTPException(404, f"model {name!r} is not served; served: {', '.join(gw.models)}")
    return name, gw.models[name]


@router.post("/logprobs", response_model=LogProbsResponse, response_model_exclude_none=True, dependencies=Authorized)
async def logprobs(body: LogProbsRequest, gw: GatewayDep) -> LogProbsResponse:
    name, model = served(gw, body.model)
    settings = gw.settings
    tokens = 0
    for i, seq in enumerate(body.input_ids):
        if len(seq) > settings.max_tokens_per_batch:
            limit = settings.max_tokens_per_batch
            raise TooLarge(f"input_ids[{i}] has {len(seq)} tokens; this model takes at most {limit}")
        if len(seq) < 2:
            raise ValueError(f"input_ids[{i}] has {len(seq)} tokens; scoring needs at least 2")
        tokens += len(seq)
    if tokens > settings.max_request_tokens:
        raise TooLarge(f"the request has {tokens} tokens; the limit is {settings.max_request_tokens} per request")
    starts, temps = validate_request(
        body.input_ids, body.score_from, body.temperature,
        vocab_size=model.vocab_size, max_tokens=settings.max_tokens_per_batch,
    )
    start = time.perf_counter()
    scores = await model.batcher.submit(body.input_ids, starts, temps, body.return_entropy)  # one weights version
    gw.metrics.observe(name, tokens, time.perf_counter() - start)
    results = [
        SequenceResult(
            log_probs=s.log_probs.tolist(), entropy=s.entropy.tolist() if body.return_entropy else None
        )
        for s in scores
    ]
    scored = sum(len(r.log_probs) for r in results)
    return LogProbsResponse(
        model=name,
        weights_version=scores[0].weights_version,
        results=results,
        usage=Usage(sequences=len(results), tokens=tokens, scored_tokens=scored),
    )


def model_info(gw, name: str, version: int) -> ModelInfo:
    return ModelInfo(
        name=name, vocab_size=gw.models[name].vocab_size, max_length=gw.settings.max_tokens_per_batch,
        max_request_tokens=gw.settings.max_request_tokens, weights_version=version,
    )


@router.get("/v1/models", response_model=ModelList, dependencies=Authorized)
async def list_models(gw: GatewayDep) -> ModelList:
    states = await asyncio.gather(*(m.pool.owner.state.remote() for m in gw.models.values()))
    return ModelList(models=[model_info(gw, name, s["version"]) for name, s in zip(gw.models, states, strict=True)])


@router.post("/v1/models/{name}/reload", response_model=ModelInfo, dependencies=Authorized)
async def reload(name: str, body: ReloadRequest, gw: GatewayDep) -> ModelInfo:
    """Every worker reads the checkpoint; it lands on all of them or on none (404: no such directory, 422: not a
    usable checkpoint, 409: it does not fit the served model). Requests in flight keep the version they started
    with; concurrent reloads (and trainers' updates) are applied one after another, each with its own version."""
    name, model = served(gw, name)
    version = await asyncio.to_thread(model.pool.update_weights, body.path)
    return model_info(gw, name, version)


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(gw: GatewayDep) -> JSONResponse:
    health = await asyncio.to_thread(gw.health)
    ready = all(w["alive"] for workers in health.values() for w in workers)
    return JSONResponse({"ready": ready, "models": health}, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(gw: GatewayDep) -> PlainTextResponse:
    gw.metrics.sample(gw.models)
    return PlainTextResponse(generate_latest(gw.metrics.registry).decode(), media_type="text/plain; version=0.0.4")


def install_error_handlers(app: FastAPI) -> None:
    def record(request: Request, status: int) -> None:
        if _gateway is not None:
            _gateway.metrics.requests.labels(status=str(status)).inc()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors()[:5]:
            if err["type"] == "json_invalid":
                parts.append(f"the body is not valid JSON ({err.get('ctx', {}).get('error', 'decode error')})")
                continue
            loc = ".".join(str(x) for x in err["loc"] if x != "body")
            value = f" (got {err['input']!r:.60})" if "input" in err and err["type"] != "missing" else ""
            parts.append(f"{loc or 'body'}: {err['msg']}{value}")
        record(request, 422)
        return JSONResponse({"detail": "; ".join(parts)}, status_code=422)

    @app.exception_handler(TooLarge)
    async def too_large(request: Request, exc: TooLarge) -> JSONResponse:
        record(request, 413)
        return JSONResponse({"detail": str(exc)}, status_code=413)

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, exc: ValueError) -> JSONResponse:
        record(request, 422)
        return JSONResponse({"detail": str(exc)}, status_code=422)

    weight_statuses = {CheckpointNotFound: 404, InvalidCheckpoint: 422, IncompatibleWeights: 409}

    @app.exception_handler(CheckpointNotFound)
    @app.exception_handler(InvalidCheckpoint)
    @app.exception_handler(IncompatibleWeights)
    async def bad_weights(request: Request, exc: ValueError) -> JSONResponse:
        status = next(code for kind, code in weight_statuses.items() if isinstance(exc, kind))
        record(request, status)
        return JSONResponse({"detail": str(cause(exc))}, status_code=status)

    @app.exception_handler(UpdateFailed)
    @app.exception_handler(WeightsUnavailable)
    @app.exception_handler(WeightsChanged)
    async def weights_in_flux(request: Request, exc: RuntimeError) -> JSONResponse:
        record(request, 503)
        return JSONResponse({"detail": f"{cause(exc)}; retry"}, status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(Overloaded)
    async def overloaded(request: Request, exc: Overloaded) -> JSONResponse:
        record(request, 429)
        return JSONResponse({"detail": str(exc)}, status_code=429, headers={"Retry-After": f"{exc.retry_after:.0f}"})

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        record(request, exc.status_code)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def worker_failure(request: Request, exc: Exception) -> JSONResponse:
        record(request, 503)
        return JSONResponse(
            {"detail": f"the workers failed this request ({type(exc).__name__}: {str(exc)[:300]}); retry"},
            status_code=503, headers={"Retry-After": "1"},
        )

"""HTTP routes. A /logprobs body is size-checked before it is read, parsed and validated once into a ScoreRequest
off the event loop, scored through the model's Batcher, and written as JSON or BINARY (see wire.py). Every
failure becomes an answer in `errors.to_response`."""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Annotated

from fastapi import APIRouter, Depends, Header, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import generate_latest

from ppo_logprobs.workers.errors import TooLarge
from ppo_logprobs.workers.request import ScoreRequest

from .errors import NonFiniteResults, one_line, to_response
from .schemas import LogProbsRequest, LogProbsResponse, ModelInfo, ModelList, ReloadRequest
from .wire import BINARY, encode_binary, encode_json

router = APIRouter()

## NB: Serve pickles the FastAPI app apart from the ingress class, so the replica's Gateway cannot be put on
# app.state from its constructor; each replica process holds exactly one, registered here when it starts.
_gateway = None


def set_gateway(gw) -> None:
    global _gateway
    _gateway = gw


def current_gateway():
    return _gateway


def gateway():
    if _gateway is None:
        raise HTTPException(503, "the gateway is starting", headers={"Retry-After": "5"})
    return _gateway


def key_matches(authorization: str | None) -> bool:
    """No key is set, or the request carries it ('Authorization: Bearer <key>')."""
    key = gateway().settings.api_key
    if key is None:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), key.get_secret_value().encode())


def require_key(authorization: Annotated[str | None, Header()] = None) -> None:
    if not key_matches(authorization):
        raise HTTPException(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")


GatewayDep = Annotated[object, Depends(gateway)]
Authorized = [Depends(require_key)]


def served(gw, name: str | None):
    name = name or next(iter(gw.models))
    if name not in gw.models:
        raise HTTPException(404, f"model {one_line(repr(name), 200)} is not served; served: {', '.join(gw.models)}")
    return name, gw.models[name]


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to be over `limit` bytes (before parsing it)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"the request body has {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"the request body is over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": LogProbsRequest.model_json_schema()}}}}


@router.post("/logprobs", dependencies=Authorized, openapi_extra=_BODY, response_model=LogProbsResponse,
             responses={200: {"content": {BINARY: {}}, "description": "JSON, or BINARY when the Accept header asks"}})
async def logprobs(request: Request, gw: GatewayDep) -> Response:
    try:
        settings = gw.settings
        body = await read_body(request, settings.max_body_bytes)
        parsed = await asyncio.to_thread(LogProbsRequest.model_validate_json, body)
        name, model = served(gw, parsed.model)
        scores = await asyncio.to_thread(
            ScoreRequest.build, parsed.input_ids, parsed.score_from, parsed.temperature, parsed.return_entropy,
            vocab_size=model.vocab_size, max_length=settings.max_tokens_per_batch,
            max_tokens=settings.max_request_tokens,
        )
        start = time.perf_counter()
        result, waited = await model.batcher.submit(scores)
        if not result.all_finite():
            raise NonFiniteResults(f"model {name} produced non-finite log-probs (weights version "
                                   f"{result.weights_version})")
        tokens = int(scores.offsets[-1])
        gw.metrics.observe(name, tokens, time.perf_counter() - start)
        header = {"model": name, "weights_version": result.weights_version,
                  "usage": {"sequences": len(scores), "tokens": tokens, "scored_tokens": int(result.offsets[-1])}}
        binary = BINARY in request.headers.get("accept", "")
        encode = encode_binary if binary else encode_json
        entropy = result.entropy if parsed.return_entropy else None
        content = await asyncio.to_thread(encode, header, result.log_probs, entropy, result.offsets)
        return Response(content, media_type=BINARY if binary else "application/json",
                        headers={"X-Calls-Waited": str(waited)})
    except Exception as e:
        return to_response(e)


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
async def reload(name: str, body: ReloadRequest, gw: GatewayDep) -> ModelInfo | JSONResponse:
    """Every worker reads the checkpoint; it lands on all of them or on none (404: no such directory, 422: not a
    usable checkpoint, 409: it does not fit the served model). Requests in flight keep the version they started
    with; concurrent reloads (and trainers' updates) are applied one after another, each with its own version."""
    try:
        name, model = served(gw, name)
        version = await asyncio.to_thread(model.pool.update_weights, body.path)
        return model_info(gw, name, version)
    except Exception as e:
        return to_response(e)


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(gw: GatewayDep, authorization: Annotated[str | None, Header()] = None) -> JSONResponse:
    """Ready when every worker answers; the workers' details only with the API key (or when none is set)."""
    health = await asyncio.to_thread(gw.health)
    ready = all(w["alive"] and w.get("weights_version") is not None for ws in health.values() for w in ws)
    body = {"ready": ready, **({"models": health} if key_matches(authorization) else {})}
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(gw: GatewayDep) -> PlainTextResponse:
    gw.metrics.sample(gw.models)
    return PlainTextResponse(generate_latest(gw.metrics.registry).decode(), media_type="text/plain; version=0.0.4")

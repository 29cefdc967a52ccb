"""HTTP routes. A /logprobs body is size-checked before it is read, parsed and validated once into a ScoreRequest
off the event loop, handed to the model's workers (handover.py), and written as JSON or BINARY (see wire.py). Every
failure becomes an answer in `errors.to_response`."""

from __future__ import annotations

import asyncio
import importlib.metadata
import time
from dataclasses import dataclass
from typing import Annotated, Any, Generic, TypeVar

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import generate_latest

from ppo_logprobs.workers.errors import TooLarge
from ppo_logprobs.workers.request import ScoreRequest, mismatch, rollout_values
from ppo_logprobs.workers.wire import BINARY, encode_binary, encode_json

from .completions import CompletionRequest, Refused, answer, prompts_of, scoring_inputs
from .errors import NonFiniteResults, as_http_exception, one_line, to_response
from .schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    LogProbsRequest,
    LogProbsResponse,
    ModelInfo,
    ModelList,
    ReloadRequest,
    TokenizeRequest,
    TokenizeResponse,
)

router = APIRouter()
VERSION = importlib.metadata.version("ppo-logprobs")


def gateway_of(app):
    """The replica's Gateway, which its app holds (`app.state.gateway`, put there by service/app.py's edge at the
    replica's first request); None before."""
    return getattr(app.state, "gateway", None)


async def gateway(request: Request):
    gw = gateway_of(request.app)
    if gw is None:
        raise HTTPException(503, "the gateway is starting", headers={"Retry-After": "5"})
    return gw


GatewayDep = Annotated[object, Depends(gateway)]


def served(gw, name: str | None):
    name = name or next(iter(gw.models))
    if name not in gw.models:
        raise HTTPException(404, f"model {one_line(repr(name), 200)} is not served; served: {', '.join(gw.models)}")
    return name, gw.models[name]


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, refused with 413 as soon as it is known to be over `limit` bytes (before parsing it), and with 408
    when it has not all arrived within `timeout_s` (a slow sender holds no scoring up for longer)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"the request body has {declared} bytes; the limit is {limit}")
    chunks: list[bytes] = []

    async def receive() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise TooLarge(f"the request body is over {limit} bytes")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(receive(), timeout_s)
    except TimeoutError:
        raise HTTPException(408, f"the request body did not arrive within {timeout_s:g} s "
                            f"({sum(map(len, chunks))} bytes came)", headers={"Connection": "close"}) from None
    return b"".join(chunks)


def media_type(value: str) -> str:
    return value.partition(";")[0].strip().lower()


def wants_binary(accept: str) -> bool:
    """Whether the Accept header ranks BINARY above JSON: media ranges parsed with their q, an exact type match."""
    ranked = {}
    for item in accept.split(","):
        kind, *params = (p.strip() for p in item.split(";"))
        q = 1.0
        for p in params:
            name, _, value = p.partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        ranked[kind.lower()] = max(q, ranked.get(kind.lower(), 0.0))
    return ranked.get(BINARY, 0.0) > 0 and ranked.get(BINARY, 0.0) >= ranked.get("application/json", 0.0)


## NB: a body this small is parsed, checked and encoded on the event loop: a thread hop costs more than the work.
_INLINE_BYTES = 1 << 16


async def off_loop(inline: bool, fn, *args, **kwargs):
    return fn(*args, **kwargs) if inline else await asyncio.to_thread(fn, *args, **kwargs)


Schema = TypeVar("Schema", LogProbsRequest, CompletionRequest)


@dataclass(frozen=True)
class Scoring(Generic[Schema]):
    """A scoring route's request once opened: its body parsed, and the served model it names."""

    gw: Any  # the replica's Gateway (service/app.py)
    body: Schema
    name: str
    model: Any  # the ServedModel of `name` (service/app.py)
    inline: bool  # small enough to be parsed, checked and encoded on the event loop


def opening(schema: type[Schema]):
    """The dependency that opens a scoring route's request: a JSON content type (415), the body within its size and
    time limits (413, 408), parsed as `schema` (422), and a served model (404). What it raises is answered as the
    route's own errors are (errors.to_response)."""

    async def open_request(request: Request, gw: GatewayDep) -> Scoring:
        try:
            if media_type(request.headers.get("content-type", "")) != "application/json":
                # a web page can send text/plain, form or multipart bodies to a loopback service without asking first
                raise HTTPException(415, "send the body as JSON with 'Content-Type: application/json'")
            body = await read_body(request, gw.settings.max_body_bytes, gw.settings.body_timeout_s)
            inline = len(body) <= _INLINE_BYTES
            parsed = await off_loop(inline, schema.model_validate_json, body)
            name, model = served(gw, parsed.model)
        except Exception as e:
            raise as_http_exception(e) from None
        return Scoring(gw, parsed, name, model, inline)

    return open_request


LogProbsCall = Annotated[Scoring[LogProbsRequest], Depends(opening(LogProbsRequest))]
CompletionCall = Annotated[Scoring[CompletionRequest], Depends(opening(CompletionRequest))]


_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": LogProbsRequest.model_json_schema()}}}}


@router.post("/logprobs", openapi_extra=_BODY, response_model=LogProbsResponse,
             responses={200: {"content": {BINARY: {}}, "description": "JSON, or BINARY when the Accept header asks"}})
async def logprobs(request: Request, call: LogProbsCall) -> Response:
    gw, parsed, name, model, inline = call.gw, call.body, call.name, call.model, call.inline
    try:
        settings = gw.settings
        scores = await off_loop(
            inline, ScoreRequest.build, parsed.input_ids, parsed.score_from, parsed.temperature,
            parsed.return_entropy, vocab_size=model.vocab_size, max_length=settings.max_tokens_per_batch,
            max_tokens=settings.max_request_tokens, top_k=parsed.top_k, token_ids=parsed.token_ids,
            max_top_k=settings.max_top_k, max_token_ids=settings.max_token_ids,
        )
        rollout = None
        if parsed.rollout_log_probs is not None:
            rollout = await off_loop(inline, rollout_values, parsed.rollout_log_probs, scores)
        start = time.perf_counter()
        result, waited = await model.handover.submit(scores)
        if not result.all_finite():
            raise NonFiniteResults(f"model {name} produced non-finite log-probs (weights version "
                                   f"{result.weights_version})")
        tokens, computed = int(scores.offsets[-1]), result.computed_tokens(scores.lengths)
        gw.metrics.observe(name, tokens, time.perf_counter() - start, shared=tokens - computed)
        header = {"model": name, "weights_version": result.weights_version,
                  "usage": {"sequences": len(scores), "tokens": tokens, "scored_tokens": int(result.offsets[-1]),
                            "computed_tokens": computed}}
        if rollout is not None:
            stats = mismatch(result.log_probs, rollout, result.offsets, tuple(settings.ratio_bounds))
            gw.metrics.observe_mismatch(name, stats)
            header["mismatch"] = {key: values.tolist() for key, values in stats.items()}
        binary = wants_binary(request.headers.get("accept", ""))
        encode = encode_binary if binary else encode_json
        entropy = result.entropy if parsed.return_entropy else None
        content = await off_loop(inline, encode, header, result.log_probs, entropy, result.offsets, result.extras,
                                 scores.candidate_counts())
        return Response(content, media_type=BINARY if binary else "application/json",
                        headers={"X-Calls-Waited": str(waited)})
    except Exception as e:
        return to_response(e)


_open_logprobs = opening(LogProbsRequest)


async def logprobs_direct(gw, request: Request) -> Response:
    """POST /logprobs as the route above answers it, called by the app's edge without FastAPI's routing and
    dependency machinery: on small requests an ingress replica's CPU is the limit, and that machinery was an eighth of
    it. The route stays, for the OpenAPI schema."""
    try:
        call = await _open_logprobs(request, gw)
    except HTTPException as e:
        return to_response(e)
    return await logprobs(request, call)


@router.post("/v1/completions")
async def completions(call: CompletionCall) -> Response:
    """Scoring in the shape of OpenAI's and vLLM's completions (service/completions.py): prompts as token ids (or
    text, with --tokenizer), echo with logprobs: k, prompt_logprobs: k, max_tokens 0 or 1 (the most likely next
    token); anything else it cannot do is a 400 that says so."""
    gw, parsed, name, model = call.gw, call.body, call.name, call.model
    try:
        settings = gw.settings
        prompts = await asyncio.to_thread(prompts_of, parsed, gw.tokenizer())
        seqs, temperature, k = scoring_inputs(prompts, parsed, vocab_size=model.vocab_size,
                                              max_length=settings.max_tokens_per_batch, max_top_k=settings.max_top_k)
        scores = await asyncio.to_thread(
            ScoreRequest.build, seqs, 1, temperature, False, vocab_size=model.vocab_size,
            max_length=settings.max_tokens_per_batch, max_tokens=settings.max_request_tokens, top_k=k,
            max_top_k=settings.max_top_k)
        start = time.perf_counter()
        result, _ = await model.handover.submit(scores)
        tokens = int(scores.offsets[-1])
        gw.metrics.observe(name, tokens, time.perf_counter() - start,
                           shared=tokens - result.computed_tokens(scores.lengths))
        return JSONResponse(await asyncio.to_thread(answer, name, prompts, parsed, result, gw.tokenizer()))
    except Exception as e:
        return to_response(e)


def model_info(gw, name: str, version: int) -> ModelInfo:
    return ModelInfo(
        id=name, name=name, created=gw.started, vocab_size=gw.models[name].vocab_size,
        max_length=gw.settings.max_tokens_per_batch, max_request_tokens=gw.settings.max_request_tokens,
        weights_version=version,
    )


@router.get("/v1/models", response_model=ModelList)
async def list_models(gw: GatewayDep) -> ModelList:
    """The served models, in OpenAI's list shape (`data[].id`), each with its vocabulary, limits and version."""
    states = await asyncio.gather(*(m.pool.owner.state.remote() for m in gw.models.values()))
    return ModelList(data=[model_info(gw, name, s["version"]) for name, s in zip(gw.models, states, strict=True)])


@router.get("/v1/models/{name}", response_model=ModelInfo)
async def retrieve_model(name: str, gw: GatewayDep) -> ModelInfo | JSONResponse:
    try:
        name, model = served(gw, name)
        return model_info(gw, name, (await model.pool.owner.state.remote())["version"])
    except Exception as e:
        return to_response(e)


@router.post("/v1/models/{name}/reload", response_model=ModelInfo)
async def reload(name: str, body: ReloadRequest, gw: GatewayDep) -> ModelInfo | JSONResponse:
    """Every worker reads the checkpoint; it lands on all of them or on none (404: no such directory, 422: not a
    usable checkpoint, 409: it does not fit the served model, or holds NaN or infinite values unless
    allow_non_finite). Requests in flight keep the version they started
    with; concurrent reloads (and trainers' updates) are applied one after another, each with its own version."""
    try:
        name, model = served(gw, name)
    except Exception as e:
        return to_response(e)
    start = time.perf_counter()
    try:
        version = await asyncio.to_thread(model.pool.update_weights, body.path, allow_non_finite=body.allow_non_finite)
    except Exception as e:
        gw.metrics.observe_reload(name, time.perf_counter() - start, ok=False)
        return to_response(e)
    gw.metrics.observe_reload(name, time.perf_counter() - start, ok=True)
    return model_info(gw, name, version)


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/health")
async def health_plain() -> Response:
    """vLLM's and SGLang's liveness route: 200 with an empty body (as /healthz)."""
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict:
    return {"version": VERSION}


def _tokenizer_of(gw):
    tokenizer = gw.tokenizer()
    if tokenizer is None:
        raise Refused("this service has no tokenizer (start it with --tokenizer DIR); send token ids instead")
    return tokenizer


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, gw: GatewayDep) -> TokenizeResponse | JSONResponse:
    """vLLM's shape: the prompt's token ids, their count and the longest sequence the model scores."""
    try:
        served(gw, body.model)
        tokenizer = _tokenizer_of(gw)
        ids = await asyncio.to_thread(lambda: tokenizer(body.prompt, add_special_tokens=body.add_special_tokens))
        tokens = list(ids["input_ids"])
        return TokenizeResponse(count=len(tokens), max_model_len=gw.settings.max_tokens_per_batch, tokens=tokens)
    except Exception as e:
        return to_response(e)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, gw: GatewayDep) -> DetokenizeResponse | JSONResponse:
    try:
        _, model = served(gw, body.model)
        bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < model.vocab_size), None)
        if bad is not None:
            raise HTTPException(422, f"tokens[{bad}] = {body.tokens[bad]} is not a token id of the model (its "
                                     f"vocabulary has {model.vocab_size})")
        tokenizer = _tokenizer_of(gw)
        return DetokenizeResponse(prompt=await asyncio.to_thread(tokenizer.decode, body.tokens))
    except Exception as e:
        return to_response(e)


READY_DEADLINE_S = 1.0  # /readyz answers within about this, whatever the workers do (all are asked at once)
HEALTH_DEADLINE_S = 5.0  # and /v1/health, whose details a person reads


@router.get("/readyz")
async def readyz(gw: GatewayDep) -> JSONResponse:
    """Ready when every model has a worker that can score (alive, holding weights; updates are staged beside
    scoring, so an update in progress does not make it unready); says nothing else (the workers' details are at
    /v1/health, behind the key)."""
    ready = _ready(await gw.health(READY_DEADLINE_S))
    return JSONResponse({"ready": ready}, status_code=200 if ready else 503)


@router.get("/v1/health")
async def health(gw: GatewayDep) -> JSONResponse:
    """Each worker's state (alive, weights_version, pid, node, device, row stats) and the replica that answered."""
    health = await gw.health(HEALTH_DEADLINE_S)
    ready = _ready(health)
    return JSONResponse({"ready": ready, "replica": gw.replica, "models": health}, status_code=200 if ready else 503)


def _ready(health: dict[str, list[dict]]) -> bool:
    return all(any(w["alive"] and w.get("weights_version") is not None for w in ws) for ws in health.values())


@router.get("/metrics")
async def metrics(gw: GatewayDep) -> PlainTextResponse:
    health, states = await asyncio.gather(gw.health(READY_DEADLINE_S),
                                          asyncio.gather(*(m.pool.owner.state.remote() for m in gw.models.values())))
    gw.metrics.sample(gw.models, health, {name: s["version"] for name, s in zip(gw.models, states, strict=True)})
    return PlainTextResponse(generate_latest(gw.metrics.registry).decode(), media_type="text/plain; version=0.0.4")

"""The routes' helpers, without Ray or Serve: the gateway dependency, the scoring routes' opening (content type,
body, parse, model: the same answers from /logprobs and /v1/completions), the
content type, the Accept header's ranking, reading a body from a real Starlette request (its size limit, declared
or streamed, and its time limit), the served model by name, readiness, and where off_loop runs its work."""

import asyncio
import threading

import pytest
from fastapi import HTTPException
from fastapi.testclient import TestClient
from starlette.datastructures import State
from starlette.requests import Request

from ppo_logprobs.service import Settings
from ppo_logprobs.service.app import Gateway, ServedModel, make_fastapi
from ppo_logprobs.service.routes import (
    _ready,
    gateway,
    media_type,
    off_loop,
    read_body,
    served,
    wants_binary,
)
from ppo_logprobs.workers.errors import TooLarge
from ppo_logprobs.workers.wire import BINARY


def client_with(gw, **kw) -> TestClient:
    """A client of the app whose replica's gateway is `gw` (as service/app.py's edge puts it there)."""
    app = make_fastapi()
    app.state.gateway = gw
    return TestClient(app, **kw)


def body_request(chunks: list[bytes], *, complete: bool = True, headers: dict | None = None):
    """A Starlette request whose body arrives in these chunks; unless `complete`, the sender then never sends the
    rest. Also the list of receive calls made so far."""
    received: list[int] = []

    async def receive():
        received.append(len(received))
        i = len(received) - 1
        if i < len(chunks):
            return {"type": "http.request", "body": chunks[i], "more_body": not complete or i < len(chunks) - 1}
        await asyncio.Event().wait()  # (never set)

    scope = {"type": "http", "method": "POST", "path": "/logprobs", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    return Request(scope, receive), received


def read(request, limit=1024, timeout_s=10.0) -> bytes:
    return asyncio.run(read_body(request, limit, timeout_s))


class AppOf:
    """What the gateway dependency reads of an app: its state."""

    def __init__(self, **state) -> None:
        self.state = State(state)


def request_to(app) -> Request:
    return Request({"type": "http", "method": "GET", "path": "/", "query_string": b"", "headers": [], "app": app})


def test_before_the_replica_has_its_gateway_the_routes_answer_503_with_retry_after():
    with pytest.raises(HTTPException) as starting:
        asyncio.run(gateway(request_to(AppOf())))
    assert (starting.value.status_code, starting.value.detail) == (503, "the gateway is starting")
    assert starting.value.headers == {"Retry-After": "5"}
    held = Gateway(Settings(), {})
    assert asyncio.run(gateway(request_to(AppOf(gateway=held)))) is held


class Pool:
    """A served model's pool that is never reached: each case is answered before any scoring."""

    vocab_size = 503

    async def score(self, request):
        raise AssertionError("scored")


KEY = {"Authorization": "Bearer k"}
OPENING = [  # (headers, body, status, detail): answered the same by both scoring routes, before any scoring
    ({"Content-Type": "text/plain"}, b"{}", 415, "send the body as JSON with 'Content-Type: application/json'"),
    ({}, b"x" * 2001, 413, "the request body has 2001 bytes; the limit is 2000"),
    ({}, b"{not json", 422, "the body is not valid JSON (key must be a string at line 1 column 2)"),
    ({}, {"/logprobs": b'{"model": "value", "input_ids": [[1, 2]]}',  # (each valid but for the model)
          "/v1/completions": b'{"model": "value", "prompt": [1, 2], "echo": true, "logprobs": 1}'}, 404,
     "model 'value' is not served; served: policy"),
]


@pytest.mark.parametrize("headers, body, status, detail", OPENING, ids=["415", "413", "422", "404"])
@pytest.mark.parametrize("route", ["/logprobs", "/v1/completions"])
def test_both_scoring_routes_open_a_request_alike(route, headers, body, status, detail):
    client = client_with(Gateway(Settings(api_key="k", max_body_bytes=2000), {"policy": Pool()}), headers=KEY)
    r = client.post(route, content=body[route] if isinstance(body, dict) else body,
                    headers={"Content-Type": "application/json", **headers})
    assert (r.status_code, r.json()["detail"]) == (status, detail)
    assert r.json()["error"]["code"] == status and r.headers["x-replica"] == "local"


def test_a_scoring_request_the_schema_refuses_is_a_422_naming_the_field():
    client = client_with(Gateway(Settings(api_key="k"), {"policy": Pool()}), headers=KEY)
    r = client.post("/logprobs", json={"input_ids": "no"})
    assert r.status_code == 422 and r.json()["detail"].startswith("input_ids: "), r.json()
    r = client.post("/v1/completions", json={"prompt": [1, 2], "echo": True, "logprobs": 1, "n": "two"})
    assert r.status_code == 422 and r.json()["detail"].startswith("n: "), r.json()


def test_media_type_is_the_type_alone_in_lower_case():
    assert media_type("application/json") == "application/json"
    assert media_type("Application/JSON; charset=utf-8") == "application/json"
    assert media_type("  text/plain ;boundary=x") == "text/plain"
    assert media_type("") == ""


@pytest.mark.parametrize("accept, binary", [
    (BINARY, True),
    (BINARY.upper(), True),
    (f"{BINARY}; charset=x", True),  # (parameters other than q change nothing)
    (f"application/json, {BINARY}", True),  # equal q: BINARY
    (f"application/json;q=0.5, {BINARY}", True),
    (f" {BINARY} ; Q = 0.9 , application/json;q=0.8", True),
    (f"{BINARY};q=0, {BINARY};q=0.7, application/json;q=0.6", True),  # a type listed twice: its highest q
    (f"{BINARY};q=0.5, application/json", False),
    (f"{BINARY};q=0", False),
    (f"{BINARY};q=high", False),  # a q that is not a number counts as 0
    (f"{BINARY}-v2", False),  # an exact match only
    ("application/json", False),
    ("*/*", False),
    ("", False),
])
def test_binary_is_chosen_only_when_the_accept_header_ranks_it_at_least_as_high_as_json(accept, binary):
    assert wants_binary(accept) is binary


def test_a_body_is_read_whole_from_its_chunks():
    chunks = [b'{"input_ids"', b": [[1, 2]]", b"}"]
    whole = b'{"input_ids": [[1, 2]]}'
    request, received = body_request(chunks, headers={"Content-Length": str(len(whole))})
    assert read(request, limit=len(whole)) == whole  # (a body of exactly the limit is taken)
    assert len(received) == 3
    request, _ = body_request(chunks)  # (undeclared)
    assert read(request, limit=len(whole)) == whole
    request, _ = body_request(chunks, headers={"Content-Length": "many"})  # not a number: the bytes decide
    assert read(request) == whole


def test_a_body_declared_over_the_limit_is_refused_413_before_any_of_it_is_read():
    request, received = body_request([b"x" * 2000], headers={"Content-Length": "2000"})
    with pytest.raises(TooLarge) as refused:
        read(request, limit=1024)
    assert str(refused.value) == "the request body has 2000 bytes; the limit is 1024" and refused.value.status == 413
    assert received == []


@pytest.mark.parametrize("headers", [{}, {"Content-Length": "10"}], ids=["undeclared", "declared-too-small"])
def test_a_body_streamed_past_the_limit_is_refused_413_as_soon_as_it_is(headers):
    request, received = body_request([b"x" * 400] * 5, headers=headers)
    with pytest.raises(TooLarge) as refused:
        read(request, limit=1000)
    assert str(refused.value) == "the request body is over 1000 bytes" and refused.value.status == 413
    assert len(received) == 3  # the chunk that crossed the limit was the last one read


def test_a_body_that_does_not_arrive_in_time_is_answered_408_closing_the_connection():
    request, received = body_request([b"abc"], complete=False, headers={"Content-Length": "100"})
    with pytest.raises(HTTPException) as late:
        read(request, timeout_s=0.01)
    assert late.value.status_code == 408
    assert late.value.detail == "the request body did not arrive within 0.01 s (3 bytes came)"
    assert late.value.headers == {"Connection": "close"}
    assert len(received) == 2  # the chunk that came, and the wait for the rest that was given up
    request, _ = body_request([], complete=False)
    with pytest.raises(HTTPException, match="did not arrive within 0.02 s"):
        read(request, timeout_s=0.02)


def test_a_model_is_served_by_its_name_the_first_by_default_and_an_unknown_one_is_a_404_naming_both():
    gw = Gateway(Settings(models={"policy": "tiny", "reference": "/ckpt/ref"}), {})
    gw.models = {"policy": ServedModel(None, None, 503), "reference": ServedModel(None, None, 503)}
    assert served(gw, None) == ("policy", gw.models["policy"])
    assert served(gw, "reference") == ("reference", gw.models["reference"])
    with pytest.raises(HTTPException) as unknown:
        served(gw, "value")
    assert unknown.value.status_code == 404
    assert unknown.value.detail == "model 'value' is not served; served: policy, reference"
    with pytest.raises(HTTPException) as unknown:
        served(gw, "x" * 300 + "\n\x1b[31m")
    assert unknown.value.detail == f"model '{'x' * 199}... is not served; served: policy, reference"  # (one line)


def test_ready_when_every_model_has_a_live_worker_holding_weights():
    live = {"alive": True, "weights_version": 0}
    restarted = {"alive": True, "weights_version": None}
    dead = {"alive": False, "weights_version": 3}
    assert _ready({"policy": [live], "reference": [dead, live]})
    assert not _ready({"policy": [live], "reference": [dead, restarted]})
    assert not _ready({"policy": [{"alive": True}]})  # (no version reported: no weights)
    assert not _ready({"policy": []})


def test_off_loop_runs_small_work_on_the_event_loop_and_the_rest_in_a_thread():
    def where(a, b, *, c):
        return threading.get_ident(), a + b + c

    def fails():
        raise ValueError("from the work")

    async def run():
        loop = threading.get_ident()
        inline, worked = await off_loop(True, where, 1, 2, c=3), await off_loop(False, where, 1, 2, c=4)
        for flag in (True, False):
            with pytest.raises(ValueError, match="from the work"):
                await off_loop(flag, fails)
        return loop, inline, worked

    loop, inline, worked = asyncio.run(run())
    assert inline == (loop, 6)
    assert worked[0] != loop and worked[1] == 7

"""The gateway's pure parts, without Ray or Serve: each replica's share of the per-model limits, GatewayMetrics as the
Prometheus text it exports (tokens, shared tokens, latency, rollout mismatch, the queue and calls sampled from a
real Handover in front of a LogProbWorker, the workers' fill from their health), _Edge (the edge's refusals,
answers counted by status, X-Replica), and the FastAPI app mapping the errors FastAPI raises itself."""

import asyncio

import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from ppo_logprobs.service import Settings
from ppo_logprobs.service.app import Gateway, GatewayMetrics, ServedModel, _Edge, make_fastapi, share
from ppo_logprobs.service.handover import Handover
from ppo_logprobs.workers import LogProbWorker
from ppo_logprobs.workers.errors import Overloaded

from ..helpers import TINY_VOCAB
from .test_routes import AppOf, client_with


def exported(metrics: GatewayMetrics) -> dict[str, float]:
    """The registry's Prometheus text as {series: value} ('name{labels}' as written)."""
    text = generate_latest(metrics.registry).decode()
    return {series: float(value) for series, value in (line.rsplit(" ", 1) for line in text.splitlines()
                                                       if not line.startswith("#"))}


def test_each_replica_takes_an_equal_share_of_a_limit_rounded_up_and_at_least_1():
    assert [share(256, n) for n in (1, 2, 3, 8, 255, 256, 257)] == [256, 128, 86, 32, 2, 1, 1]
    assert [share(2, n) for n in (1, 2, 3)] == [2, 1, 1]
    assert share(10, 0) == 10 and share(0, 4) == 1  # (no replicas counted: one; nothing to share: still one)


def test_scored_tokens_shared_tokens_and_latency_are_exported_per_model_and_replica():
    metrics = GatewayMetrics("replica-a")
    metrics.observe("policy", 100, 0.02, shared=30)
    metrics.observe("policy", 50, 0.3, shared=-5)  # (a negative share, as a caller may compute it, counts 0)
    metrics.observe("reference", 7, 40.0)
    got = exported(metrics)
    policy, reference = 'model="policy",replica="replica-a"', 'model="reference",replica="replica-a"'
    assert got[f"ppo_logprobs_tokens_total{{{policy}}}"] == 150
    assert got[f"ppo_logprobs_tokens_total{{{reference}}}"] == 7
    assert got[f"ppo_logprobs_shared_tokens_total{{{policy}}}"] == 30
    assert got[f"ppo_logprobs_shared_tokens_total{{{reference}}}"] == 0
    buckets = {le: got[f'ppo_logprobs_latency_seconds_bucket{{le="{le}",{policy}}}']
               for le in ("0.01", "0.025", "0.25", "0.5", "30.0", "+Inf")}
    assert buckets == {"0.01": 0, "0.025": 1, "0.25": 1, "0.5": 2, "30.0": 2, "+Inf": 2}
    assert got[f"ppo_logprobs_latency_seconds_count{{{policy}}}"] == 2
    assert got[f"ppo_logprobs_latency_seconds_sum{{{policy}}}"] == pytest.approx(0.32)
    assert got[f'ppo_logprobs_latency_seconds_bucket{{le="30.0",{reference}}}'] == 0  # (over the last bucket)
    assert got[f'ppo_logprobs_latency_seconds_bucket{{le="+Inf",{reference}}}'] == 1


def test_each_replica_has_a_registry_of_its_own():
    a, b = GatewayMetrics("a"), GatewayMetrics("b")  # (one registry for both would refuse the second's names)
    a.observe("policy", 5, 0.1)
    assert exported(a)['ppo_logprobs_tokens_total{model="policy",replica="a"}'] == 5
    assert not any(series.startswith("ppo_logprobs_tokens_total") for series in exported(b))


def test_every_series_is_there_from_the_start_with_its_type():
    """Before any request: each model's counters, histograms (the mismatch ones too) and gauges at 0, of the
    types a Prometheus scraper reads (counters as counters), the workers and the version once sampled."""
    from prometheus_client.parser import text_string_to_metric_families

    metrics = GatewayMetrics("r", ("policy", "reference"))
    metrics.sample({}, {"policy": [{"alive": True}, {"alive": False}], "reference": [{"alive": True}]},
                   {"policy": 3, "reference": 0})
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    kinds = {name: f.type for name, f in families.items()
             if name.startswith("ppo_logprobs_") and not name.endswith("_created")}  # (the client's own gauges)
    assert kinds == {
        "ppo_logprobs_requests": "counter", "ppo_logprobs_tokens": "counter", "ppo_logprobs_shared_tokens": "counter",
        "ppo_logprobs_worker_calls": "counter", "ppo_logprobs_latency_seconds": "histogram",
        "ppo_logprobs_mismatch_kl": "histogram", "ppo_logprobs_mismatch_max_abs": "histogram",
        "ppo_logprobs_mismatch_outside": "histogram", "ppo_logprobs_reload_seconds": "histogram",
        "ppo_logprobs_queue_depth": "gauge", "ppo_logprobs_queued_tokens": "gauge", "ppo_logprobs_batch_fill": "gauge",
        "ppo_logprobs_weights_version": "gauge", "ppo_logprobs_workers": "gauge"}
    got = exported(metrics)
    for model in ("policy", "reference"):
        labels = f'model="{model}",replica="r"'
        for series in ("tokens_total", "worker_calls_total", "mismatch_kl_count", "latency_seconds_count",
                       "queued_tokens"):
            assert got[f"ppo_logprobs_{series}{{{labels}}}"] == 0, series
        assert got[f'ppo_logprobs_reload_seconds_count{{model="{model}",outcome="failed",replica="r"}}'] == 0
    assert got['ppo_logprobs_workers{model="policy",replica="r",state="live"}'] == 1
    assert got['ppo_logprobs_workers{model="policy",replica="r",state="down"}'] == 1
    assert got['ppo_logprobs_weights_version{model="policy",replica="r"}'] == 3
    metrics.observe_reload("policy", 2.0, ok=True)
    got = exported(metrics)
    assert got['ppo_logprobs_reload_seconds_count{model="policy",outcome="ok",replica="r"}'] == 1
    assert got['ppo_logprobs_reload_seconds_bucket{le="1.0",model="policy",outcome="ok",replica="r"}'] == 0


def test_rollout_mismatch_is_one_observation_per_sequence_of_each_statistic():
    metrics = GatewayMetrics("r")
    stats = {"mean_abs": np.array([0.5, 0.1, 0.0]), "max_abs": np.array([2.0, 0.005, 0.0]),
             "kl_k3": np.array([0.5, 5e-6, 0.0]), "outside": np.array([0.3, 0.0, 0.0])}
    metrics.observe_mismatch("policy", stats)
    got, labels = exported(metrics), 'model="policy",replica="r"'
    for name, statistic in (("kl", "kl_k3"), ("max_abs", "max_abs"), ("outside", "outside")):
        assert got[f"ppo_logprobs_mismatch_{name}_count{{{labels}}}"] == 3
        assert got[f"ppo_logprobs_mismatch_{name}_sum{{{labels}}}"] == pytest.approx(stats[statistic].sum())
    assert [got[f'ppo_logprobs_mismatch_kl_bucket{{le="{le}",{labels}}}'] for le in ("1e-06", "1e-05", "0.1", "1.0")] \
        == [1, 2, 2, 3]
    assert [got[f'ppo_logprobs_mismatch_max_abs_bucket{{le="{le}",{labels}}}'] for le in ("0.0001", "0.01", "5.0")] \
        == [1, 2, 3]
    assert [got[f'ppo_logprobs_mismatch_outside_bucket{{le="{le}",{labels}}}'] for le in ("0.0", "0.25", "1.0")] \
        == [2, 2, 3]
    assert not any("mean_abs" in series for series in got)  # (not exported)


class Held:
    """The worker's scores, each call held until the test lets it answer; `begun`: the calls so far."""

    def __init__(self, worker: LogProbWorker) -> None:
        self.worker = worker
        self.begun = 0
        self.answer = asyncio.Event()

    async def begin(self, calls: int) -> None:
        while self.begun < calls:
            await asyncio.sleep(0)

    async def __call__(self, request):
        self.begun += 1
        await self.answer.wait()
        return self.worker.score_request(request)


def test_the_queue_and_the_calls_are_sampled_from_the_hand_over_and_the_fill_from_the_workers():
    worker = LogProbWorker("tiny", backend="torch")
    rng = np.random.default_rng(0)
    first = worker.request(rng.integers(0, TINY_VOCAB, (2, 10)).tolist(), return_entropy=False)  # 20 tokens
    second = worker.request(rng.integers(0, TINY_VOCAB, (3, 10)).tolist(), return_entropy=False)  # 30 tokens
    metrics = GatewayMetrics("r")
    labels = 'model="policy",replica="r"'

    def sampled(models, health=None) -> tuple:
        metrics.sample(models, health)
        got = exported(metrics)
        return tuple(got.get(f"ppo_logprobs_{name}{{{labels}}}") for name in ("queue_depth", "queued_tokens",
                                                                                "worker_calls_total", "batch_fill"))

    async def run():
        held = Held(worker)
        handover = Handover(held, max_queue=2)
        models = {"policy": ServedModel(None, handover, TINY_VOCAB)}
        seen = [sampled(models)]
        calls = [asyncio.ensure_future(handover.submit(first))]
        await held.begin(1)
        calls.append(asyncio.ensure_future(handover.submit(second)))
        await held.begin(2)
        seen.append(sampled(models))
        with pytest.raises(Overloaded):  # two out: this replica's share of max_queue
            await handover.submit(first)
        held.answer.set()
        results = await asyncio.gather(*calls)
        workers = [dict(alive=True, calls=3, tokens=96, step_tokens=64), dict(alive=True, calls=1, tokens=16,
                                                                               step_tokens=64), dict(alive=False)]
        seen.append(sampled(models, {"policy": workers}))
        return seen, results

    seen, results = asyncio.run(run())
    assert seen == [(0, 0, 0, None),  # nothing yet: no fill to report
                    (2, 50, 2, None),  # both handed over at once, neither answered
                    (0, 0, 2, 112 / 4 / 64)]  # the live workers' 4 steps of 112 tokens in all, out of 64 each
    assert [len(result) for result, _ in results] == [2, 3]


def http_scope(path="/healthz", gw=None) -> dict:
    """A request's scope to an app whose replica's gateway is `gw` (None: before the replica has one)."""
    app = AppOf(gateway=gw) if gw is not None else AppOf()
    return {"type": "http", "method": "GET", "path": path, "headers": [], "query_string": b"", "app": app}


async def answer_ok(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": [(b"x-inner", b"1")]})
    await send({"type": "http.response.body", "body": b""})


def test_count_counts_each_answer_by_status_and_names_the_replica():
    async def run(scope):
        sent = []

        async def send(message):
            sent.append(message)

        await _Edge(answer_ok)(scope, None, send)
        return sent

    gw = Gateway(Settings(api_key=""), {}, replica="replica-a")
    sent = asyncio.run(run(http_scope(gw=gw)))
    asyncio.run(run(http_scope(gw=gw)))
    got = exported(gw.metrics)
    assert sent == [{"type": "http.response.start", "status": 204,
                     "headers": [(b"x-inner", b"1"), (b"x-replica", b"replica-a")]},
                    {"type": "http.response.body", "body": b""}]
    assert got['ppo_logprobs_requests_total{replica="replica-a",status="204"}'] == 2


def test_count_passes_through_what_is_not_http_and_everything_before_the_replica_has_its_gateway():
    passed = []

    async def inner(scope, receive, send):
        passed.append(send)

    async def send(message):
        pass

    gw = Gateway(Settings(api_key=""), {}, replica="replica-a")
    asyncio.run(_Edge(inner)({"type": "lifespan", "app": AppOf(gateway=gw)}, None, send))
    asyncio.run(_Edge(inner)(http_scope(), None, send))  # (outside a replica: no gateway to find)
    assert passed == [send, send]  # (the server's own send: nothing counted, no header added)
    assert not any(series.startswith("ppo_logprobs_requests_total") for series in exported(gw.metrics))


def test_the_app_counts_its_answers_and_maps_the_errors_fastapi_raises_itself():
    r = TestClient(make_fastapi()).get("/readyz")  # before the replica has its gateway
    assert (r.status_code, r.json()["detail"], r.headers["retry-after"]) == (503, "the gateway is starting", "5")
    assert "x-replica" not in r.headers
    gw = Gateway(Settings(api_key="s3cret"), {}, replica="replica-a")
    client = client_with(gw)
    r = client.get("/healthz")
    assert (r.status_code, r.json(), r.headers["x-replica"]) == (200, {"status": "ok"}, "replica-a")
    r = client.get("/v1/health")
    assert r.status_code == 401 and r.json()["detail"] == (
        "missing or wrong API key: send 'Authorization: Bearer <key>'")
    assert r.json()["error"]["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == "Bearer" and r.headers["x-replica"] == "replica-a"
    r = client.post("/v1/models/policy/reload", json={"path": 5}, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 422 and r.json()["detail"] == "path: Input should be a valid string (got 5)"
    assert r.json()["error"] == {"message": r.json()["detail"], "type": "invalid_request_error", "code": 422}
    # the router's own refusals (Starlette's) in the same body: a GET of /logprobs, a path that is none
    key = {"Authorization": "Bearer s3cret"}
    r = client.get("/logprobs", headers=key)
    assert (r.status_code, r.json(), r.headers["allow"]) == (405, {"detail": "Method Not Allowed", "error": {
        "message": "Method Not Allowed", "type": "invalid_request_error", "code": 405}}, "POST")
    r = client.get("/v2/logprobs", headers=key)
    assert (r.status_code, r.json()["error"]["type"]) == (404, "not_found_error")
    got = exported(gw.metrics)
    assert {status: got[f'ppo_logprobs_requests_total{{replica="replica-a",status="{status}"}}']
            for status in ("200", "401", "422")} == {"200": 1, "401": 1, "422": 1}

"""The gateway: FastAPI under Ray Serve, as any number of ingress replicas, each handing every request of a served
model to that model's WorkerPool (handover.py), which the application's PoolKeeper owns (keeper.py); the pool's
workers form their forwards from what waits at them.

build_app(settings) -> a Serve application; `python -m ppo_logprobs.service` runs it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .config import Settings
from .edge import refusal, route_of
from .errors import AnyHTTPException, to_response
from .handover import Handover
from .keeper import PoolKeeper
from .loopback import keep_replica_grpc_on_loopback
from .routes import gateway_of, logprobs_direct, router

log = logging.getLogger(__name__)


@dataclass
class ServedModel:
    pool: object  # WorkerPool
    handover: Handover
    vocab_size: int


class GatewayMetrics:
    """Prometheus metrics of one ingress replica, in a registry of its own; every series carries the replica's
    id (`replica`), so that a cluster's totals are the sums over replicas."""

    def __init__(self, replica: str, models: tuple[str, ...] = ()) -> None:
        self.registry = CollectorRegistry()
        self.replica = replica
        model = ["model", "replica"]
        self.requests = Counter("ppo_logprobs_requests", "HTTP requests by status", ["status", "replica"],
                                registry=self.registry)
        self.tokens = Counter("ppo_logprobs_tokens", "tokens scored, by model", model, registry=self.registry)
        self.shared = Counter("ppo_logprobs_shared_tokens", "tokens not computed again: shared prefixes, by model",
                              model, registry=self.registry)
        self.latency = Histogram(
            "ppo_logprobs_latency_seconds", "time from queueing to results, by model", model,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=self.registry,
        )
        self.mismatch = {  # per sequence scored with rollout log-probs
            "kl_k3": Histogram("ppo_logprobs_mismatch_kl", "k3 estimate of KL(rollout || ours) per sequence, by model",
                               model, buckets=(1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1), registry=self.registry),
            "max_abs": Histogram("ppo_logprobs_mismatch_max_abs", "largest |ours - rollout| log-prob per sequence, by "
                                 "model", model, buckets=(1e-4, 1e-3, 1e-2, 0.1, 0.5, 1, 5), registry=self.registry),
            "outside": Histogram("ppo_logprobs_mismatch_outside", "share of a sequence's tokens whose ratio is outside "
                                 "the ratio bounds, by model", model, buckets=(0, 0.001, 0.01, 0.05, 0.1, 0.25, 1),
                                 registry=self.registry),
        }
        self.queue = Gauge("ppo_logprobs_queue_depth", "requests handed to the workers and not answered, by model",
                           model, registry=self.registry)
        self.queued_tokens = Gauge("ppo_logprobs_queued_tokens", "tokens of those requests, by model", model,
                                   registry=self.registry)
        self.calls = Counter("ppo_logprobs_worker_calls", "calls to the workers (each one request, or small ones "
                             "joined), by model", model, registry=self.registry)
        self.fill = Gauge(
            "ppo_logprobs_batch_fill", "the workers' mean tokens per step over a step's budget (of all callers' "
            "requests, read with their health), by model", model, registry=self.registry,
        )
        self.version = Gauge("ppo_logprobs_weights_version", "the model's weights version (its owner's), by model",
                             model, registry=self.registry)
        self.workers = Gauge("ppo_logprobs_workers", "the model's workers by state: live (answering) or down (not "
                             "answering within 1 s: dead, restarting or stuck)", ["model", "state", "replica"],
                             registry=self.registry)
        self.reloads = Histogram("ppo_logprobs_reload_seconds", "reloads through this replica by model and outcome "
                                 "(ok, failed): their duration", ["model", "outcome", "replica"],
                                 buckets=(0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600), registry=self.registry)
        self._calls_seen: dict[str, int] = {}
        for name in models:  # every series there from the start, at 0 (a dashboard's rate() needs the zero)
            labels = dict(model=name, replica=replica)
            for metric in (self.tokens, self.shared, self.latency, *self.mismatch.values(), self.queue,
                           self.queued_tokens, self.calls, self.version):
                metric.labels(**labels)
            for state in ("live", "down"):
                self.workers.labels(state=state, **labels)
            for outcome in ("ok", "failed"):
                self.reloads.labels(outcome=outcome, **labels)

    def observe(self, model: str, tokens: int, seconds: float, shared: int = 0) -> None:
        self.tokens.labels(model=model, replica=self.replica).inc(tokens)
        self.shared.labels(model=model, replica=self.replica).inc(max(shared, 0))
        self.latency.labels(model=model, replica=self.replica).observe(seconds)

    def observe_mismatch(self, model: str, stats: dict) -> None:
        for name, histogram in self.mismatch.items():
            series = histogram.labels(model=model, replica=self.replica)
            for value in stats[name]:
                series.observe(float(value))

    def observe_reload(self, model: str, seconds: float, ok: bool) -> None:
        self.reloads.labels(model=model, outcome="ok" if ok else "failed", replica=self.replica).observe(seconds)

    def sample(self, models: dict[str, ServedModel], health: dict[str, list[dict]] | None = None,
               versions: dict[str, int] | None = None) -> None:
        """The gauges, read now: each model's hand-over; with `health` (Gateway.health) its workers (their steps'
        fill too), with `versions` its weights version."""
        for name, m in models.items():
            labels = dict(model=name, replica=self.replica)
            self.queue.labels(**labels).set(m.handover.out)
            self.queued_tokens.labels(**labels).set(m.handover.out_tokens)
            self.calls.labels(**labels).inc(m.handover.calls - self._calls_seen.get(name, 0))
            self._calls_seen[name] = m.handover.calls
        for name, workers in (health or {}).items():
            stepping = [w for w in workers if w["alive"] and w.get("step_tokens")]
            if sum(w["calls"] for w in stepping):
                self.fill.labels(model=name, replica=self.replica).set(
                    sum(w["tokens"] for w in stepping) / sum(w["calls"] * w["step_tokens"] for w in stepping))
            live = sum(w["alive"] for w in workers)
            self.workers.labels(model=name, state="live", replica=self.replica).set(live)
            self.workers.labels(model=name, state="down", replica=self.replica).set(len(workers) - live)
        for name, version in (versions or {}).items():
            self.version.labels(model=name, replica=self.replica).set(version)


def share(total: int, replicas: int) -> int:
    """One ingress replica's part of a per-model limit: an equal share, at least 1."""
    return max(1, math.ceil(total / max(replicas, 1)))


class Gateway:
    """What the routes use: settings, the served models (the keeper's pools, each with this replica's Handover) and
    the metrics. `replicas` is how many ingress replicas share the per-model limits."""

    def __init__(self, settings: Settings, pools: dict, *, replica: str = "local", replicas: int = 1) -> None:
        self.settings = settings
        self.replica = replica
        self.started = int(time.time())  # (OpenAI's `created` of the models it lists)
        self.metrics = GatewayMetrics(replica, tuple(pools))
        self._tokenizer = None
        self.models: dict[str, ServedModel] = {}
        for name, pool in pools.items():
            handover = Handover(pool.score, max_queue=share(settings.max_queue, replicas),
                                timeout_s=settings.request_timeout_s)
            self.models[name] = ServedModel(pool, handover, pool.vocab_size)

    async def health(self, deadline_s: float) -> dict[str, list[dict]]:
        """Every model's workers' health, all asked at once; a worker silent for `deadline_s` counts as not alive."""
        asked = [asyncio.to_thread(m.pool.health, timeout=deadline_s) for m in self.models.values()]
        return dict(zip(self.models, await asyncio.gather(*asked), strict=True))

    def tokenizer(self):
        """The tokenizer of settings.tokenizer (loaded once, from local files), or None."""
        if self.settings.tokenizer is None:
            return None
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.settings.tokenizer, local_files_only=True)
        return self._tokenizer


class _Edge:
    """ASGI middleware in front of every route: the edge's refusal (Host, API key: edge.refusal), then counts
    answers by status and names the replica that gave them (X-Replica). Plain ASGI, not Starlette's
    BaseHTTPMiddleware, which costs a task and a stream per request."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        gw = held_gateway(scope["app"]) if scope["type"] == "http" else None
        if gw is None:
            return await self.app(scope, receive, send)

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                gw.metrics.requests.labels(status=str(message["status"]), replica=gw.replica).inc()
                message["headers"] = [*message.get("headers", []), (b"x-replica", gw.replica.encode())]
            await send(message)

        refused = refusal(gw.settings, scope)
        if refused is not None:
            app = to_response(HTTPException(refused[0], refused[1], refused[2]))
        elif scope["method"] == "POST" and route_of(scope) == "/logprobs":
            app = await logprobs_direct(gw, Request(scope, receive))
        else:
            app = self.app
        await app(scope, receive, counted)


def held_gateway(app) -> Gateway | None:
    """The replica's Gateway, on its app's state (where the routes read it); put there at the first request, from
    the replica's context: Serve pickles the app apart from the ingress class, whose constructor cannot reach the app
    it serves. None outside a replica, and before its constructor has ended."""
    gw = gateway_of(app)
    if gw is None:
        from ray import serve
        from ray.serve.exceptions import RayServeException

        try:
            gw = serve.get_replica_context().servable_object
        except RayServeException:  # (not in a replica)
            return None
        if not isinstance(gw, Gateway):
            return None
        app.state.gateway = gw
    return gw


def make_fastapi() -> FastAPI:
    app = FastAPI(
        title="ppo-logprobs",
        description="Per-token log-probabilities and entropies of token sequences, for PPO.",
        version="0.1.0",
    )
    app.include_router(router)

    @app.exception_handler(AnyHTTPException)
    @app.exception_handler(RequestValidationError)
    async def mapped(request: Request, exc: Exception):
        return to_response(exc)  # errors FastAPI raises itself (a dependency, a body it parses, a route not found)

    app.add_middleware(_Edge)
    return app


def build_app(settings: Settings):
    """The Serve application: the PoolKeeper (one replica, owning every model's pool) and `ingress_replicas` HTTP
    ingress replicas that score through those pools."""
    from ray import serve

    app = make_fastapi()
    # a replica told to stop looks for requests still in flight this often (Serve's 2 s made every stop of the
    # service, and each replica removed, wait about 4 s more with nothing in flight)
    drain = dict(graceful_shutdown_wait_loop_s=0.2)
    logs = {"log_level": settings.serve_log_level, "enable_access_log": settings.access_log}
    # a keeper that cannot make its pools (a model that cannot load) fails the deployment at once: Serve's count is
    # of attempts, 1 is none again (each again reloaded the model, and failed the same way, three times)
    keeper = serve.deployment(
        PoolKeeper, name="PoolKeeper", num_replicas=1, graceful_shutdown_timeout_s=120, health_check_timeout_s=60,
        max_constructor_retry_count=1, ray_actor_options={"num_cpus": 0, "resources": settings.gateway_resources},
        logging_config=logs, **drain,
    )

    import ray

    # on a cluster, spread evenly over the nodes alive now, so that each runs a proxy (Serve starts one where a
    # replica is)
    nodes = sum(1 for n in ray.nodes() if n["Alive"]) if ray.is_initialized() else 1
    spread = {"max_replicas_per_node": math.ceil(settings.ingress_replicas / nodes)} if nodes > 1 else {}

    @serve.deployment(
        num_replicas=settings.ingress_replicas, ray_actor_options={"num_cpus": 0}, **spread,
        max_ongoing_requests=max(settings.max_open_requests,
                                 share(settings.max_queue, settings.ingress_replicas) * len(settings.models) + 64),
        graceful_shutdown_timeout_s=60, logging_config=logs, **drain,
    )
    @serve.ingress(app)
    class LogProbsIngress(Gateway):
        async def __init__(self, settings: Settings, keeper) -> None:
            keep_replica_grpc_on_loopback(settings.host)
            context = serve.get_replica_context()
            pools = await keeper.pools.remote()
            super().__init__(settings, pools, replica=context.replica_id.unique_id, replicas=context.world_size)

    return LogProbsIngress.bind(settings, keeper.bind(settings))


def shut_down_serve() -> None:
    """serve.shutdown() without the line Ray printed on every stop, "(raylet) Task ServeController.graceful_shutdown
    failed. There are infinite retries remaining": Serve's shutdown waits on a task of its controller that ends only
    with the controller's death, and Ray retries the controller's tasks without end, so it reported that death as a
    failure to be retried. The same task is asked for here first, with no retry: its RayActorError is the controller
    gone, as Serve expects; serve.shutdown() then finds it gone and lets go of it."""
    import ray
    from ray import serve

    try:
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        ray.get(controller.graceful_shutdown.options(max_task_retries=0).remote(), timeout=30)
    except ray.exceptions.RayActorError:  # (the controller exits when it is done: the shutdown's end)
        pass
    except (ImportError, ValueError, ray.exceptions.GetTimeoutError):  # (a Ray that moved the name; no controller;
        pass  # one that takes longer: Serve's own shutdown, with its wait and warning)
    serve.shutdown()


def app_builder(args: dict):
    """For `serve deploy` / `serve run`: import_path ppo_logprobs.service.app:app_builder, with the Settings as
    the application's args (PPO_LOGPROBS_* environment variables fill what args leave out)."""
    return build_app(Settings(**args))

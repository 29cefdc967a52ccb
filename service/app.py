"""The gateway: one WorkerPool and one Batcher per served model, behind FastAPI under Ray Serve.

build_app(settings) -> a Serve application; `python -m ppo_logprobs.service` runs it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .batcher import Batcher
from .config import Settings
from .errors import to_response
from .routes import current_gateway, router, set_gateway

log = logging.getLogger(__name__)


@dataclass
class ServedModel:
    pool: object  # WorkerPool
    batcher: Batcher
    vocab_size: int


class GatewayMetrics:
    """Prometheus metrics of one gateway replica, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("ppo_logprobs_requests", "HTTP requests by status", ["status"], registry=self.registry)
        self.tokens = Counter("ppo_logprobs_tokens", "tokens scored, by model", ["model"], registry=self.registry)
        self.latency = Histogram(
            "ppo_logprobs_latency_seconds", "time from queueing to results, by model", ["model"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=self.registry,
        )
        self.queue = Gauge("ppo_logprobs_queue_depth", "requests waiting, by model", ["model"], registry=self.registry)
        self.calls = Gauge("ppo_logprobs_worker_calls", "worker calls started, by model", ["model"],
                           registry=self.registry)
        self.fill = Gauge(
            "ppo_logprobs_batch_fill", "mean tokens per worker call over the batch budget", ["model"],
            registry=self.registry,
        )

    def observe(self, model: str, tokens: int, seconds: float) -> None:
        self.tokens.labels(model=model).inc(tokens)
        self.latency.labels(model=model).observe(seconds)

    def sample(self, models: dict[str, ServedModel]) -> None:
        for name, m in models.items():
            self.queue.labels(model=name).set(len(m.batcher.waiting))
            self.calls.labels(model=name).set(m.batcher.calls)
            if m.batcher.calls:
                self.fill.labels(model=name).set(m.batcher.batched_tokens / m.batcher.calls / m.batcher.batch_tokens)


class Gateway:
    """What the routes use: settings, the served models and the metrics."""

    def __init__(self, settings: Settings) -> None:
        from ppo_logprobs.workers import WorkerPool

        self.settings = settings
        self.metrics = GatewayMetrics()
        self.models: dict[str, ServedModel] = {}
        load = dict(backend=settings.backend, **({"dtype": _dtype(settings.dtype)} if settings.dtype else {}))
        for name, path in settings.models.items():
            pool = WorkerPool.create(
                path, settings.workers_per_model, num_gpus_per_worker=settings.gpus_per_worker,
                max_tokens_per_batch=settings.max_tokens_per_batch, resources=settings.worker_resources,
                name=f"{settings.pool_name}:{name}" if settings.pool_name else None,
                max_restarts=settings.max_restarts, **load,
            )
            batcher = Batcher(
                pool.score, batch_tokens=settings.batch_tokens, wait_s=settings.batch_wait_ms / 1000,
                max_queue=settings.max_queue, max_in_flight=settings.max_batches_in_flight,
                timeout_s=settings.request_timeout_s,
            )
            self.models[name] = ServedModel(pool, batcher, pool.vocab_size)
            log.info("serving %s from %s on %d workers", name, path, settings.workers_per_model)

    def health(self) -> dict[str, list[dict]]:
        return {name: m.pool.health(timeout=10) for name, m in self.models.items()}

    def __del__(self) -> None:
        # Serve calls this when the replica shuts down: named pools are detached and would outlive it
        for m in getattr(self, "models", {}).values():
            if m.pool.name:
                m.pool.shutdown()


def _dtype(name: str):
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype")
    return dtype


def make_fastapi() -> FastAPI:
    app = FastAPI(
        title="ppo-logprobs",
        description="Per-token log-probabilities and entropies of token sequences, for PPO.",
        version="0.1.0",
    )
    app.include_router(router)

    @app.exception_handler(HTTPException)
    @app.exception_handler(RequestValidationError)
    async def mapped(request: Request, exc: Exception):
        return to_response(exc)  # errors FastAPI raises itself (a dependency, a body it parses)

    @app.middleware("http")
    async def count(request: Request, call_next):
        response = await call_next(request)
        if (gw := current_gateway()) is not None:
            gw.metrics.requests.labels(status=str(response.status_code)).inc()
        return response

    return app


def build_app(settings: Settings):
    """The Serve application: one ingress replica holding every model's pool."""
    from ray import serve

    app = make_fastapi()

    @serve.deployment(
        ray_actor_options={"num_cpus": 0, "resources": settings.gateway_resources},
        max_ongoing_requests=settings.max_queue * len(settings.models) + 64,
        graceful_shutdown_timeout_s=60,
    )
    @serve.ingress(app)
    class LogProbsIngress(Gateway):
        def __init__(self, settings: Settings) -> None:
            super().__init__(settings)
            set_gateway(self)

    return LogProbsIngress.bind(settings)


def app_builder(args: dict):
    """For `serve deploy` / `serve run`: import_path ppo_logprobs.service.app:app_builder, with the Settings as
    the application's args (PPO_LOGPROBS_* environment variables fill what args leave out)."""
    return build_app(Settings(**args))

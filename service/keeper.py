"""PoolKeeper: the one Serve replica of an application that owns its pools, apart from the ingress replicas.

Each served model's WorkerPool (its workers and their WeightOwner) is made once for the application by the keeper
and handed to every ingress replica (`pools()`), which then calls the workers directly. So ingress replicas come
and go, on any node and in any number, without touching a worker. Named pools (the default) are detached actors:
a keeper that Serve replaces (it died, or a new version of the application was deployed) attaches to the running
pools by name instead of starting others, as long as they were made with the same settings; the pools are shut
down once, when the application itself is deleted (or Serve shut down).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from ppo_logprobs.workers.pool import kv

from .config import Settings
from .loopback import keep_replica_grpc_on_loopback

log = logging.getLogger(__name__)


def pool_spec(settings: Settings, path: str) -> dict:
    """What a pool is made from: a running pool with another spec is replaced, not attached to."""
    return dict(path=path, workers=settings.workers_per_model, gpus_per_worker=settings.gpus_per_worker,
                max_tokens_per_batch=settings.max_tokens_per_batch, resources=settings.worker_resources,
                max_restarts=settings.max_restarts, dtype=settings.dtype, backend=settings.backend,
                min_shared_prefix=settings.min_shared_prefix, cuda_graphs=settings.cuda_graphs)


def _load_options(settings: Settings) -> dict:
    """What the pool's workers load their model with (a dtype by its name, as Settings checked it and load_model
    reads it)."""
    options: dict = dict(backend=settings.backend, min_shared_prefix=settings.min_shared_prefix,
                         cuda_graphs=settings.cuda_graphs)
    if settings.dtype:
        options["dtype"] = settings.dtype
    return options


def create_or_attach(settings: Settings, model: str, path: str):
    """The running pool of that name made with the same spec, else a new one (an old one of another spec is shut
    down first)."""
    from ppo_logprobs.workers import WorkerPool

    name = f"{settings.pool_name}:{model}" if settings.pool_name else None
    spec = pool_spec(settings, path)
    key = f"spec:{name}"
    if name is not None:
        try:
            pool = WorkerPool.connect(name)
        except ValueError:
            pool = None
        if pool is not None:
            saved = kv.get(key)
            if saved is not None and json.loads(saved) == spec:
                log.info("attached to the running pool %s (version %d)", name, pool.weights_version)
                return pool
            log.info("the running pool %s was made with other settings: replacing it", name)
            pool.shutdown()
    pool = WorkerPool.create(
        path, settings.workers_per_model, num_gpus_per_worker=settings.gpus_per_worker,
        max_tokens_per_batch=settings.max_tokens_per_batch, resources=settings.worker_resources, name=name,
        max_restarts=settings.max_restarts, **_load_options(settings),
    )
    if name is not None:
        kv.put(key, json.dumps(spec))
    log.info("serving %s from %s on %d workers", model, path, settings.workers_per_model)
    return pool


def _application_deleted() -> bool:
    """Whether this replica stops because its application is being deleted (or Serve shut down), rather than
    replaced by Serve."""
    from ray import serve

    app = serve.get_replica_context().replica_id.deployment_id.app_name
    try:
        status = serve.status().applications.get(app)
    except Exception:  # the controller is gone: Serve itself is shutting down, and the pools go with it
        log.info("Serve's controller did not answer; taking the application as deleted", exc_info=True)
        return True
    return status is None or status.status == "DELETING"


DRAIN_S = 60.0  # the longest the pools wait, once their application is deleted, for the requests at their workers


def drain(pool, timeout_s: float = DRAIN_S) -> None:
    """Returns once no live worker of `pool` has a request waiting or under way (the last requests the ingress
    replicas handed over while Serve drained them), seen twice half a second apart, or after timeout_s."""
    deadline, idle = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline and idle < 2:
        busy = [h for h in pool.health(timeout=5) if h["alive"] and (h.get("queued_requests") or h.get("scoring"))]
        idle = 0 if busy else idle + 1
        time.sleep(0.5)


class PoolKeeper:
    def __init__(self, settings: Settings) -> None:
        keep_replica_grpc_on_loopback(settings.host)
        self.settings = settings
        self.models = {model: create_or_attach(settings, model, path) for model, path in settings.models.items()}

    def pools(self) -> dict:
        """{model: WorkerPool}: handles to the workers and the owner, for the ingress replicas."""
        return self.models

    async def __del__(self) -> None:
        if not await asyncio.to_thread(_application_deleted):
            log.info("keeper replaced: the pools keep running for the next one")
            return
        for model, pool in self.models.items():
            log.info("application deleted: shutting down the pool of %s once its workers are idle", model)
            await asyncio.to_thread(drain, pool)
            await asyncio.to_thread(pool.shutdown)
            if pool.name:
                kv.delete(f"spec:{pool.name}")

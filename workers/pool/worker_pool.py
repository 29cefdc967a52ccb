"""WorkerPool: LogProbWorker Ray actors, one per GPU, behind one trainer-facing API.

Work is split across the actors balanced by tokens, results come back in request order, each carrying the
weights_version it was computed with. An actor that dies is restarted by Ray and its share of the call is sent
again (to it, or to another actor); an actor that comes back with stale weights gets the current ones first.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .log_prob_worker import LogProbWorker, SequenceScores, validate_request

log = logging.getLogger(__name__)

NAMESPACE = "ppo_logprobs"
_ATTEMPTS = 4  # dispatches of one share before a call gives up


def _actor_name(pool: str, index: int) -> str:
    return f"{pool}:worker:{index}"


class _PooledWorker(LogProbWorker):
    """The actor class: a LogProbWorker that also keeps its pool's placement group, so a pool attached by name
    (from a job whose namespace cannot see the group's name) can still free it."""

    def __init__(self, *args, placement=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.placement = placement

    def placement_group(self):
        return self.placement


def balance_by_tokens(lengths: Sequence[int], num_shares: int) -> list[list[int]]:
    """Sequence indices split into num_shares lists of about equal token counts (longest first, to the
    lightest share)."""
    shares: list[list[int]] = [[] for _ in range(num_shares)]
    load = [0] * num_shares
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        k = load.index(min(load))
        shares[k].append(i)
        load[k] += lengths[i]
    return shares


def _score_on_pool(workers, version, weights, input_ids, starts, temps, return_entropy) -> list[SequenceScores]:
    """Dispatches shares to the actors and gathers them in order; redispatches what a dead actor held.

    weights: [the current weights: an ObjectRef to a state dict, or a checkpoint path] or [] (a list, so that
    Ray does not fetch the weights into this function when it runs as a task).
    """
    results: list[SequenceScores | None] = [None] * len(input_ids)
    pending = {}

    def submit(share, worker, attempt):
        ref = workers[worker].score.remote(
            [input_ids[i] for i in share], [starts[i] for i in share], [temps[i] for i in share], return_entropy
        )
        pending[ref] = (share, worker, attempt)

    for w, share in enumerate(balance_by_tokens([len(s) for s in input_ids], len(workers))):
        if share:
            submit(share, w, 1)
    while pending:
        (ref,), _ = ray.wait(list(pending), num_returns=1)
        share, w, attempt = pending.pop(ref)
        try:
            scores = ray.get(ref)
        except RayActorError as e:
            if attempt >= _ATTEMPTS:
                raise RuntimeError(f"worker {w} died {attempt} times holding {len(share)} sequences: {e}") from e
            log.warning("worker %d died (%s); sending its %d sequences again", w, type(e).__name__, len(share))
            submit(share, (w + 1) % len(workers), attempt + 1)
            continue
        if any(s.weights_version < version for s in scores):  # (newer: an update landed mid-call; keep it)
            # a restarted actor reloads its initial weights: give it the current ones and redo its share
            if not weights:
                raise RuntimeError(
                    f"worker {w} answered with weights_version {scores[0].weights_version}, expected {version}, "
                    "and this pool holds no copy of those weights to restore (call update_weights again)"
                )
            if attempt >= _ATTEMPTS:
                raise RuntimeError(f"worker {w} still answers with stale weights after {attempt} attempts")
            ray.get(workers[w].update_weights.remote(weights[0], version))
            submit(share, w, attempt + 1)
            continue
        for i, s in zip(share, scores, strict=True):
            results[i] = s
    return results  # type: ignore[return-value]


class WorkerPool:
    """Ray actors holding one patched model each. Build with `create`, or attach to a named pool with `connect`."""

    def __init__(self, workers: list, info: dict, *, name: str | None = None, placement=None) -> None:
        self.workers = workers
        self.name = name
        self.vocab_size = info["vocab_size"]
        self.max_tokens_per_batch = info["max_tokens_per_batch"]
        self.weights_version = info["weights_version"]
        self._placement = placement
        self._weights: list = []  # [the last weights sent: ObjectRef or path], to restore restarted actors

    @classmethod
    def create(
        cls,
        model: str,
        num_workers: int,
        *,
        num_gpus_per_worker: float | None = None,
        name: str | None = None,
        max_tokens_per_batch: int = 16384,
        max_restarts: int = 3,
        ready_timeout_s: float = 300.0,
        resources: dict[str, float] | None = None,
        **load_options,
    ) -> WorkerPool:
        """Starts num_workers actors in one placement group. num_gpus_per_worker defaults to 1 when the cluster
        has GPUs and 0 (CPU actors) when it has none; `resources` adds custom Ray resources per worker (to pin the
        workers to node types that have them). With a name, actors and placement group are named and
        detached: they outlive this driver until `shutdown()`, and other jobs can `connect(name)`."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        if num_gpus_per_worker is None:
            num_gpus_per_worker = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
        bundle = {"CPU": 1, **({"GPU": num_gpus_per_worker} if num_gpus_per_worker else {}), **(resources or {})}
        placement = placement_group([bundle] * num_workers, strategy="PACK", lifetime="detached" if name else None)
        try:
            ray.get(placement.ready(), timeout=ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(placement)
            raise RuntimeError(
                f"could not place {num_workers} workers of {bundle} within {ready_timeout_s:.0f} s; "
                f"the cluster has {ray.available_resources()} free"
            ) from None
        actor = ray.remote(_PooledWorker)
        workers = []
        for i in range(num_workers):
            named = dict(name=_actor_name(name, i), namespace=NAMESPACE, lifetime="detached") if name else {}
            workers.append(
                actor.options(
                    num_cpus=1,
                    num_gpus=num_gpus_per_worker,
                    resources=resources or {},
                    max_restarts=max_restarts,
                    max_task_retries=max_restarts,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=i),
                    **named,
                ).remote(model, max_tokens_per_batch=max_tokens_per_batch, placement=placement, **load_options)
            )
        infos = ray.get([w.info.remote() for w in workers])
        return cls(workers, infos[0], name=name, placement=placement)

    @classmethod
    def connect(cls, name: str) -> WorkerPool:
        """Attaches to the actors of a pool created with this name (by any job on the same Ray cluster)."""
        workers = []
        while True:
            try:
                workers.append(ray.get_actor(_actor_name(name, len(workers)), namespace=NAMESPACE))
            except ValueError:
                break
        if not workers:
            raise ValueError(f"no worker pool named {name!r} in namespace {NAMESPACE!r}")
        infos = ray.get([w.info.remote() for w in workers])
        pool = cls(workers, infos[0], name=name, placement=ray.get(workers[0].placement_group.remote()))
        pool.weights_version = max(i["weights_version"] for i in infos)
        return pool

    def _request(self, input_ids, score_from, temperature):
        starts, temps = validate_request(
            input_ids, score_from, temperature, vocab_size=self.vocab_size, max_tokens=self.max_tokens_per_batch
        )
        return list(input_ids), starts, temps  # checked above; each worker turns its share into tensors

    def compute_log_probs(
        self,
        input_ids: Sequence[Sequence[int]],
        score_from: int | Sequence[int] = 1,
        temperature: float | Sequence[float] = 1.0,
        return_entropy: bool = True,
    ) -> list[SequenceScores]:
        """One SequenceScores per sequence, in order: entry k of log_probs is log p(seq[s + k] | seq[:s + k])
        for s = score_from (one int, or one per sequence; the prompt length for PPO)."""
        ids, starts, temps = self._request(input_ids, score_from, temperature)
        return _score_on_pool(self.workers, self.weights_version, self._weights, ids, starts, temps, return_entropy)

    def compute_log_probs_async(
        self,
        input_ids: Sequence[Sequence[int]],
        score_from: int | Sequence[int] = 1,
        temperature: float | Sequence[float] = 1.0,
        return_entropy: bool = True,
    ) -> ray.ObjectRef:
        """Like compute_log_probs, without waiting: an ObjectRef to the same list (validation still runs now)."""
        ids, starts, temps = self._request(input_ids, score_from, temperature)
        task = ray.remote(num_cpus=0)(_score_on_pool)
        return task.remote(self.workers, self.weights_version, self._weights, ids, starts, temps, return_entropy)

    def update_weights(self, state_dict_or_ref) -> int:
        """Loads new weights into every actor and returns the new version: a state dict, an ObjectRef to one, or
        the path of a checkpoint directory that every actor can read."""
        ref = state_dict_or_ref
        if not isinstance(ref, (ray.ObjectRef, str)):
            ref = ray.put(ref)
        version = self.weights_version + 1
        ray.get([w.update_weights.remote(ref, version) for w in self.workers])
        self._weights, self.weights_version = [ref], version
        return version

    def health(self, timeout: float = 30.0) -> list[dict]:
        """Each actor's info (device, weights_version, pid, row stats), or alive=False with the error."""
        out = []
        for i, w in enumerate(self.workers):
            try:
                out.append(dict(index=i, alive=True, **ray.get(w.health.remote(), timeout=timeout)))
            except Exception as e:  # a dead or hung actor is reported, not raised
                out.append(dict(index=i, alive=False, error=f"{type(e).__name__}: {e}"))
        return out

    def shutdown(self) -> None:
        """Kills the actors (no restart) and frees their placement group."""
        for w in self.workers:
            ray.kill(w, no_restart=True)
        if self._placement is not None:
            remove_placement_group(self._placement)
        self.workers = []

"""WorkerPool: LogProbWorker Ray actors, one per GPU, behind one trainer-facing API.

Work is split across the actors balanced by tokens, results come back in request order, each carrying the
weights_version it was computed with, and never results of two versions in one call. Weights change only through
the pool's WeightOwner (see owner.py), shared by every handle of the pool. An actor that dies is restarted by Ray
and its share of the call is sent again (to it, or to another actor); a restarted actor gets the current weights
back before it scores.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Unpack

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..errors import WeightsUnavailable, WorkerLost, cause, get
from ..prefixes import forest
from ..request import (
    MAX_TOKENS_PER_BATCH,
    RATIO_BOUNDS,
    Parts,
    ScoreRequest,
    ScoreResult,
    ScoringOptions,
    SequenceScores,
    mismatch,
    rollout_values,
    with_mismatch,
)
from ..sharding import check_shardable
from .owner import HEALTH, NAMESPACE, WeightOwner, actors

if TYPE_CHECKING:
    import torch

    from .weight_sender import WeightSender

log = logging.getLogger(__name__)
# Ray warns at each worker's creation that a restartable detached actor in a placement group dies with the group: a
# named pool's group lives exactly as long as its workers (shutdown() removes both), as intended
logging.getLogger("ray.actor").addFilter(
    lambda record: not record.getMessage().startswith("Scheduling a restartable detached actor with a placement"))

_ATTEMPTS = 4  # dispatches of one share before a call gives up
PLACEMENT_SAID_S = 10.0  # a pool not placed after this long logs what it waits for


def _start_error(error: RayActorError | RayTaskError) -> BaseException | None:
    """What a worker's constructor raised: as its info's error (its arguments refused: PoolWorker.refused), or as the
    cause of its death (Ray passes the creation task's error as the argument); None for a worker lost otherwise
    (killed, its node gone)."""
    failed = error.args[0] if isinstance(error, RayActorError) and error.args else error
    return cause(failed) if isinstance(failed, RayTaskError) else None


def _started(workers: list) -> list[dict]:
    """Each worker's info once it has started. The first ask is not retried: a worker whose constructor failed is
    dead for good, and Ray logged its traceback once more for every retry it said was left. A worker lost otherwise
    while it started is restarted by Ray, and asked again with retries."""
    try:
        return ray.get([w.info.options(max_task_retries=0).remote() for w in workers])
    except RayActorError as e:
        if _start_error(e) is not None:
            raise
        return ray.get([w.info.remote() for w in workers])


def _actor_name(pool: str, index: int) -> str:
    return f"{pool}:worker:{index}"


def _rank_name(pool: str, index: int, rank: int) -> str:
    """A tensor-parallel worker's other rank (rank_group.py)."""
    return f"{_actor_name(pool, index)}:rank:{rank}"


def balance_by_tokens(lengths: np.ndarray, num_shares: int) -> list[np.ndarray]:
    """Sequence indices split into num_shares arrays of about equal token counts: longest first to the lightest
    share; for many sequences, consecutive runs of the longest-first order of about equal tokens."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if num_shares == 1:
        return [np.arange(len(lengths))]
    order = np.argsort(-lengths, kind="stable")
    if len(lengths) > 4096:
        cuts = np.searchsorted(np.cumsum(lengths[order]), lengths.sum() * np.arange(1, num_shares) / num_shares)
        return [np.sort(part) for part in np.split(order, cuts)]
    shares: list[list[int]] = [[] for _ in range(num_shares)]
    heap = [(0, k) for k in range(num_shares)]
    for i in order.tolist():
        load, k = heapq.heappop(heap)
        shares[k].append(i)
        heapq.heappush(heap, (load + int(lengths[i]), k))
    return [np.array(sorted(share), dtype=np.int64) for share in shares]


def shares_of(request: ScoreRequest, num_shares: int, min_shared_prefix: int | None) -> list[np.ndarray]:
    """balance_by_tokens, keeping sequences that share a prefix (the workers' min_shared_prefix) in one share, by
    the tokens they compute."""
    if num_shares == 1 or min_shared_prefix is None:
        return balance_by_tokens(request.lengths, num_shares)
    trees = forest(request, np.arange(len(request)), min_shared_prefix)
    if not trees.shared:
        return balance_by_tokens(request.lengths, num_shares)
    units = trees.roots()
    shares = balance_by_tokens(np.array([cost for _, cost in units], dtype=np.int64), num_shares)
    return [np.sort(np.concatenate([units[u][0] for u in share] or [np.zeros(0, np.int64)])) for share in shares]


async def score_on_pool(owner, workers: list, request: ScoreRequest, min_shared_prefix: int | None = None,
                        load: list[int] | None = None) -> ScoreResult:
    """Dispatches shares to the actors and awaits them (from any event loop), all of one weights version: a dead
    actor's share goes to the next, a restarted actor without weights is restored by the owner first, and shares
    answered with an older version than the newest seen (an update landing mid-call) are asked again (request.Parts,
    the one policy of every caller made of parts). Sequences that share a prefix (at least `min_shared_prefix`
    tokens, the workers') go to one actor. `load`: the tokens this caller has in flight at each actor, kept up to date
    here; the largest share goes to the least loaded (a request smaller than a share of each goes whole to one)."""
    pending: dict[asyncio.Future, tuple[np.ndarray, int, int]] = {}
    load = load if load is not None and len(load) == len(workers) else [0] * len(workers)

    def submit(share: np.ndarray, worker: int, attempt: int) -> None:
        ref = workers[worker].score_request.remote(request.select(share))
        pending[asyncio.wrap_future(ref.future())] = (share, worker, attempt)
        load[worker] += int(request.lengths[share].sum())

    shares = sorted(shares_of(request, len(workers), min_shared_prefix), key=lambda s: -int(request.lengths[s].sum()))
    for w, share in zip(sorted(range(len(workers)), key=load.__getitem__), shares, strict=True):
        if share.size:
            submit(share, w, 1)
    try:
        parts: Parts[ScoreResult] = Parts(len(request))
        answered: dict[int, tuple[int, int]] = {}  # a share, by its first sequence: its worker, its attempt
        while pending:
            finished, _ = await asyncio.wait(list(pending), return_when=asyncio.FIRST_COMPLETED)
            for future in finished:
                share, w, attempt = pending.pop(future)
                load[w] -= int(request.lengths[share].sum())
                try:
                    result = future.result()
                except RayActorError as e:
                    if attempt >= _ATTEMPTS:
                        raise WorkerLost(f"a worker died {attempt} times holding {len(share)} sequences") from e
                    log.warning("worker %d died (%s); sending its %d sequences again", w, type(e).__name__, len(share))
                    submit(share, (w + 1) % len(workers), attempt + 1)
                    continue
                except WeightsUnavailable:  # restarted without its weights: restore it, then ask it again
                    if attempt >= _ATTEMPTS:
                        raise
                    try:
                        await owner.restore.remote(w)
                    except Exception as e:
                        raise cause(e) from None
                    submit(share, w, attempt + 1)
                    continue
                except Exception as e:
                    raise cause(e) from None
                parts.add(share, result)
                answered[int(share[0])] = (w, attempt)
            if not pending:
                for share in parts.again():  # commits land on workers one by one: ask the late ones again
                    w, attempt = answered[int(share[0])]
                    await asyncio.sleep(0.01 * attempt)
                    submit(share, w, attempt + 1)
        return parts.merge(request.return_entropy)
    finally:  # (a call that failed leaves no load behind)
        for share, w, _ in pending.values():
            load[w] -= int(request.lengths[share].sum())


def _run(coroutine):
    """Runs a coroutine to its end from synchronous code, also when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _score_task(owner, workers: list, request: ScoreRequest, min_shared_prefix: int | None) -> list[SequenceScores]:
    return _run(score_on_pool(owner, workers, request, min_shared_prefix)).sequences(request.candidate_counts())


class WorkerPool:
    """Ray actors holding one patched model each, and the owner of their weights. Build with `create`, or attach to
    a named pool with `connect`; every handle of one pool shares its owner, so versions agree between them."""

    def __init__(self, owner, workers: list, info: dict, *, name: str | None = None, placements=()) -> None:
        self.owner = owner
        self.workers = workers
        self.name = name
        self.vocab_size = info["vocab_size"]
        self.max_tokens_per_batch = info["max_tokens_per_batch"]
        self.min_shared_prefix = info.get("min_shared_prefix")
        self.device = info["device"]
        self.ranks = info.get("ranks", 1)  # per worker (tensor parallelism)
        self._placements = list(placements)
        self._ranks: list = []
        self._load = [0] * len(workers)  # tokens this handle has in flight at each worker (score_on_pool)

    @classmethod
    def create(
        cls,
        model: str,
        num_workers: int,
        *,
        num_gpus_per_worker: float | None = None,
        tensor_parallel: int | None = None,
        name: str | None = None,
        max_tokens_per_batch: int = MAX_TOKENS_PER_BATCH,
        max_restarts: int = -1,
        ready_timeout_s: float = 300.0,
        resources: dict[str, float] | None = None,
        local_copy: bool | None = None,
        **load_options,
    ) -> WorkerPool:
        """Starts num_workers actors in one placement group, and their WeightOwner. num_gpus_per_worker defaults to
        1 when the cluster has GPUs and 0 when it has none (CPU actors: they compute on the CPU, also on a node with
        GPUs, unless `device` says otherwise); a whole number N > 1 makes each worker N actors of one GPU each, on
        one node (a placement group of its own), holding the model's tensor-parallel parts (`tensor_parallel`,
        default N; on CPU clusters give it alone, e.g. 2, for gloo ranks). `resources` adds custom Ray resources per
        worker (to pin the workers to node types that have them). With a name, actors and placement groups are named
        and detached: they outlive this driver until `shutdown()`, and other jobs can `connect(name)`.

        `local_copy`: what a worker keeps on its node so that, restarted, it gets the current weights back without a
        live peer (weights/keep.py; each rank of a tensor-parallel worker keeps its parts). By default a pool of one
        worker keeps hard links to each checkpoint it loads (free; the trainer may delete the checkpoint) and
        nothing of streamed weights: restarted after a stream, it reports WeightsUnavailable until the trainer's
        next full send. True: streamed weights too, written to disk beside scoring (host memory of the model's size
        is held for it); False: nothing."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        if num_gpus_per_worker is None:
            num_gpus_per_worker = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
        size = tensor_parallel or (int(num_gpus_per_worker) if float(num_gpus_per_worker).is_integer() else 1) or 1
        if size > 1 and (config := _config_of(model)) is not None:  # (the ranks check again when they load)
            check_shardable(config, size)
            num_gpus_per_worker = 1 if num_gpus_per_worker else 0  # per rank
        bundle = {"CPU": 1, **({"GPU": num_gpus_per_worker} if num_gpus_per_worker else {}), **(resources or {})}
        detached = dict(namespace=NAMESPACE, lifetime="detached") if name else {}
        # one placement group packing the workers; with tensor parallelism one per worker, its ranks on one node
        lifetime = "detached" if name else None
        if size == 1:
            placements = [placement_group([bundle] * num_workers, strategy="PACK", lifetime=lifetime)]
        else:
            placements = [placement_group([bundle] * size, strategy="STRICT_PACK", lifetime=lifetime)
                          for _ in range(num_workers)]
        ready = [p.ready() for p in placements]
        said = min(PLACEMENT_SAID_S, ready_timeout_s)  # (a pool the cluster has no room for says so, not minutes later)
        if len(ray.wait(ready, num_returns=len(ready), timeout=said)[0]) < len(ready):
            log.warning("waiting for room for %d workers of %d x %s (the ranks of one worker on one node): the cluster "
                        "has %s free of %s; giving up after ready_timeout_s=%.0f s", num_workers, size, bundle,
                        ray.available_resources(), ray.cluster_resources(), ready_timeout_s)
        try:
            ray.get(ready, timeout=max(ready_timeout_s - said, 0))
        except ray.exceptions.GetTimeoutError:
            for p in placements:
                remove_placement_group(p)
            raise RuntimeError(
                f"could not place {num_workers} workers of {size} x {bundle} (the ranks of one worker on one node) "
                f"within {ready_timeout_s:.0f} s; "
                f"the cluster has {ray.available_resources()} free"
            ) from None
        key = f"weights:{name or uuid.uuid4().hex}"
        links = local_copy or (local_copy is None and num_workers == 1)
        keep = dict(keep_dir=f"ppo_logprobs-{key.replace(':', '-')}", keep_streams=bool(local_copy)) if links else {}
        ranks_prefix = name or f"ppo_logprobs-{key.split(':')[1]}"
        # the workers find their owner by name: a handle among a restartable actor's arguments is a reference that
        # Ray says a restart may lose (ray#53727, one error line a worker in every trainer's log)
        owner_name = f"{name}:owner" if name else f"{ranks_prefix}:weights"
        owner = ray.remote(WeightOwner).options(
            num_cpus=0, max_restarts=-1, max_task_retries=-1, name=owner_name, **(detached or dict(namespace=NAMESPACE))
        ).remote(key, model)
        from .pool_worker import actor_class  # (here: a process that only holds handles imports no torch)

        actor = actor_class()

        def start(i: int, rank: int, **extra):
            # a tensor-parallel worker's other ranks are named (in NAMESPACE) even in an unnamed pool: its leader
            # finds them by name (rank_group.py)
            if rank:
                actor_name = _rank_name(ranks_prefix, i, rank)
            else:
                actor_name = _actor_name(name, i) if name else None
            names = dict(name=actor_name, **(detached or dict(namespace=NAMESPACE))) if actor_name else {}
            placement, bundle = (placements[0], i) if size == 1 else (placements[i], rank)
            return actor.options(
                num_cpus=1,
                num_gpus=num_gpus_per_worker,
                resources=resources or {},
                max_restarts=max_restarts,
                max_task_retries=max_restarts,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=bundle),
                **names,
            ).remote(model, max_tokens_per_batch=max_tokens_per_batch, placement=placement, owner=owner_name, rank=rank,
                     size=size, **extra, **load_options)

        workers, ranks = [], []
        for i in range(num_workers):
            ranks += [start(i, rank, **keep) for rank in range(1, size)]
            followers = [_rank_name(ranks_prefix, i, rank) for rank in range(1, size)]
            workers.append(start(i, 0, followers=followers, **keep))
        try:
            infos = _started(workers)
        except (RayActorError, RayTaskError) as e:
            # a worker that could not start: no part of the pool left behind (a named pool's are detached), and
            # where it refused its arguments (no checkpoint at the path, a bad dtype, a truncated shard) that error
            for a in [*workers, *ranks, owner]:
                ray.kill(a, no_restart=True)
            for p in placements:
                remove_placement_group(p)
            refused = _start_error(e)
            if isinstance(refused, ValueError):
                raise refused from None
            raise
        names = [_actor_name(name, i) for i in range(num_workers)] if name else None
        ray.get(owner.set_workers.remote(workers, ray.get(workers[0].config.remote()), names))
        pool = cls(owner, workers, infos[0], name=name, placements=placements)
        pool._ranks = ranks  # holds the other ranks of an unnamed pool alive (Ray frees actors nobody holds)
        return pool

    @classmethod
    def connect(cls, name: str) -> WorkerPool:
        """Attaches to a pool created with this name (by any job on the same Ray cluster)."""
        try:
            owner = ray.get_actor(f"{name}:owner", namespace=NAMESPACE)
        except ValueError:
            pools = sorted(a["name"].removesuffix(":owner") for a in ray.util.list_named_actors(all_namespaces=True)
                           if a["namespace"] == NAMESPACE and a["name"].endswith(":owner"))
            raise ValueError(f"no worker pool named {name!r} in namespace {NAMESPACE!r} on this Ray cluster "
                             f"(its pools: {', '.join(map(repr, pools)) or 'none'})") from None
        workers = ray.get(owner.state.remote())["workers"]
        info = ray.get(workers[0].info.remote())
        placements = {p.id: p for p in ray.get([w.placement_group.remote() for w in workers])}
        return cls(owner, workers, info, name=name, placements=placements.values())

    @property
    def weights_version(self) -> int:
        """The version every worker serves once the last update has landed (asked of the owner)."""
        return ray.get(self.owner.state.remote())["version"]

    def request(self, input_ids: Sequence[Sequence[int]], score_from: int | Sequence[int] = 1,
                **options: Unpack[ScoringOptions]) -> ScoreRequest:
        """Plain lists as a validated ScoreRequest (RequestError naming the sequence, before any work is sent)."""
        return ScoreRequest.build(input_ids, score_from, **options, vocab_size=self.vocab_size,
                                  max_length=self.max_tokens_per_batch)

    async def score(self, request: ScoreRequest) -> ScoreResult:
        """Scores a validated request from an event loop (the gateway's path: two Ray hops, no task between)."""
        return await score_on_pool(self.owner, self.workers, request, self.min_shared_prefix, self._load)

    def compute_log_probs(
        self,
        input_ids: Sequence[Sequence[int]],
        score_from: int | Sequence[int] = 1,
        *,
        rollout_log_probs: Sequence[Sequence[float]] | None = None,
        ratio_bounds: tuple[float, float] = RATIO_BOUNDS,
        **options: Unpack[ScoringOptions],
    ) -> list[SequenceScores]:
        """One SequenceScores per sequence, in order, all of one weights_version: entry k of log_probs is
        log p(seq[s + k] | seq[:s + k]) for s = score_from (one int, or one per sequence; the prompt length).
        `options`: temperature, return_entropy, top_k, token_ids (request.ScoringOptions: the k most likely tokens
        of each entry with the tail's mass; candidates' log-probs). `rollout_log_probs`: the rollout engine's
        log-probs of the same entries (one list per sequence); each result's `mismatch` then says how far they are
        from ours (request.mismatch: mean and max |delta|, the k3 estimate of KL(rollout || ours), the share of
        ratios outside `ratio_bounds`)."""
        request = self.request(input_ids, score_from, **options)
        rollout = None if rollout_log_probs is None else rollout_values(rollout_log_probs, request)
        result = _run(score_on_pool(self.owner, self.workers, request, self.min_shared_prefix, self._load))
        sequences = result.sequences(request.candidate_counts())
        if rollout is None:
            return sequences
        return with_mismatch(sequences, mismatch(result.log_probs, rollout, result.offsets, ratio_bounds))

    def compute_log_probs_async(self, input_ids: Sequence[Sequence[int]], score_from: int | Sequence[int] = 1,
                                **options: Unpack[ScoringOptions]) -> ray.ObjectRef:
        """Like compute_log_probs, without waiting: an ObjectRef to the same list (validation still runs now)."""
        request = self.request(input_ids, score_from, **options)
        return ray.remote(num_cpus=0)(_score_task).remote(self.owner, self.workers, request, self.min_shared_prefix)

    def update_weights(self, weights: str | Mapping[str, torch.Tensor] | ray.ObjectRef, *,
                       allow_non_finite: bool = False) -> int:
        """New weights on every worker, or on none (then the error says why); returns the new version.

        `weights`: the path of a checkpoint directory every worker can read (each reads its shards straight into
        device memory), or a dict of tensors, full or partial (only the parameters it names change), streamed from
        this process: to CUDA workers over NCCL from this process's GPU (host tensors are copied to it through
        pinned buffers, a bucket at a time) or by CUDA IPC where the workers share that GPU; over gloo where this
        process or the workers have no GPU. An ObjectRef to such a dict is fetched here first. For repeated updates
        from a trainer, keep one `weight_sender()` open instead. Every staged tensor is checked finite on the
        workers' devices before any commits: a NaN or an infinity refuses the update (NonFiniteWeights, naming the
        tensor) unless `allow_non_finite`."""
        if isinstance(weights, ray.ObjectRef):
            weights = ray.get(weights)
        if isinstance(weights, str):
            return get(self.owner.update_from_path.remote(weights, allow_non_finite))
        device = next((t.device for t in weights.values() if t.is_cuda), None)  # else this process's GPU, if any
        with self.weight_sender(device=device, allow_non_finite=allow_non_finite) as sender:
            return sender.send(weights)

    def weight_sender(self, *, device: str | torch.device | None = None, bucket_bytes: int | None = None,
                      timeout_s: float = 300.0, allow_non_finite: bool = False) -> WeightSender:
        """Opens a process group between this process (the sender) and every worker; `send(named_tensors)` then
        streams an update through it. NCCL when this process has CUDA (`device`, default the current one) and the
        workers are on CUDA, gloo otherwise. Close it (or use `with`) when done. `allow_non_finite`: as in
        update_weights."""
        import torch

        from .weight_sender import WeightSender

        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return WeightSender(self.owner, len(self.workers) * self.ranks, device, self.device.startswith("cuda"),
                            bucket_bytes=bucket_bytes, timeout_s=timeout_s, allow_non_finite=allow_non_finite)

    def health(self, timeout: float = 30.0) -> list[dict]:
        """Each actor's info (device, weights_version, pid, row stats), or alive=False with the error; all are asked
        at once (in a thread of their own, beside scoring and updates), and one that has not answered within
        `timeout` seconds is reported as not alive."""
        asked = [w.health.options(concurrency_group=HEALTH).remote() for w in self.workers]
        ray.wait(asked, num_returns=len(asked), timeout=timeout)
        out = []
        for i, ref in enumerate(asked):
            try:
                out.append(dict(index=i, alive=True, **ray.get(ref, timeout=0)))
            except GetTimeoutError:
                ray.cancel(ref)
                out.append(dict(index=i, alive=False, error=f"no answer within {timeout:g} s"))
            except Exception as e:  # a dead actor is reported, not raised
                out.append(dict(index=i, alive=False, error=f"{type(e).__name__}: {e}"))
        return out

    def shutdown(self) -> None:
        """Kills the actors and the owner (no restart), frees their placement groups and local copies."""
        ray.wait([w.remove_local_copy.remote() for w in self.workers], num_returns=len(self.workers), timeout=30)
        ranks = list(self.workers)
        for w in self.workers:
            try:
                ranks += actors(ray.get(w.followers_of.remote(), timeout=30))
            except Exception:  # a dead leader: its ranks go with their placement group's removal below
                log.info("a worker did not name its ranks; they go with the placement group", exc_info=True)
        for w in ranks:
            ray.kill(w, no_restart=True)
        try:
            ray.get(self.owner.forget.remote(), timeout=30)
        finally:
            ray.kill(self.owner, no_restart=True)
        for placement in self._placements:
            remove_placement_group(placement)
        self.workers = []


def _config_of(model: str):
    """The config of `model` ("tiny" or a local directory), to check a tensor-parallel size before any actor
    starts; None where this process cannot read it (a head node without the checkpoints)."""
    from transformers import AutoConfig, Qwen2Config

    from ..models.load_model import TINY_CONFIG

    if model == "tiny":
        return Qwen2Config(**TINY_CONFIG)
    try:
        return AutoConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError):
        return None


"""PoolWorker: the Ray actor class of a WorkerPool (its model, its weights, and for tensor parallelism its ranks).

A process that receives an actor's handle loads its class, so this module imports torch only when an actor is
made: a process holding only a pool's handles (a gateway's ingress replica) then imports none."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable

import ray

from ..request import ScoreRequest, ScoreResult
from .calls import WEIGHT_CALLS
from .owner import HEALTH, NAMESPACE, SCORING, SCORING_CALLS, STAGING
from .scheduler import Scheduler

log = logging.getLogger(__name__)

KEPT_WAIT_S = 600.0  # how long rank 0 of a tensor-parallel worker waits for the other ranks' local copies
LINE_TOKENS = 1 << 22  # tokens of requests not yet begun that a worker's line holds before it refuses more


class PoolWorker:
    """The pool's actor: a LogProbWorker (`worker`: the model, its forward, and its weights holder), and for one rank of
    a tensor-parallel worker (`size` > 1) the RankGroup that runs each call on every rank (`ranks`). It keeps its
    pool's placement group (so a pool attached by name, from a job whose namespace cannot see the group's name, can
    still free it) and, when Ray restarts it, takes its weights from where its pool's owner says they are now.

    Its remote methods hand each call to the part that answers it: the RankGroup where there is one, else the
    LogProbWorker (scoring) or its WeightsHolder (updates). The weight calls are made below, one for each of
    calls.py's WeightCalls (its names and signatures, stated once). The staging calls return the name of a staged
    tensor that is not finite when asked to check (see WeightsHolder).

    Scoring calls from every caller wait in this worker's line (`scheduler`), which forms each step from what is
    waiting; a commit runs between two steps. A tensor-parallel worker's other ranks take rank 0's steps as they
    come (their calls come from rank 0 alone)."""

    scorer = None  # the class of `worker`: LogProbWorker, unless a test's (which may fail on purpose)

    def __init__(self, model: str, *, placement=None, owner=None, rank: int = 0, size: int = 1, followers=None,
                 group_timeout_s: float | None = None, keep_dir: str | None = None, **options) -> None:
        from ..weights.keep import rank_copy
        from .log_prob_worker import LogProbWorker
        from .rank_group import GROUP_TIMEOUT_S, RankGroup

        if not ray.get_gpu_ids():  # an actor given no GPU computes on the CPU (Ray hides no GPU from it)
            options.setdefault("device", "cpu")
        restore = None
        with warnings.catch_warnings():  # (Ray's check reads a property Ray deprecated: 3 lines in every worker's log)
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.owner = owner and ray.get_actor(owner, namespace=NAMESPACE)  # (its pool's WeightOwner, by name)
        if restarted:
            restore = ray.get(self.owner.restore_spec.remote())
        if size > 1:  # one rank of a tensor-parallel worker: its parts, and its own local copy (weights/keep.py)
            options["shard"] = (rank, size)
            keep_dir = keep_dir and f"{keep_dir}/rank{rank}"
            if restore and restore.get("keep"):
                restore["keep"] = rank_copy(restore["keep"], rank)
        self.placement, self.rank, self.size = placement, rank, size
        self.refused = None
        try:
            self.worker = (self.scorer or LogProbWorker)(model, restore=restore, keep_dir=keep_dir, on_kept=self._kept,
                                                         **options)
        except ValueError as e:  # its arguments (no checkpoint, a truncated shard, another shape): info says so
            if restarted or size > 1:
                raise
            self.refused = e  # (the pool's create kills this worker; raised here, Ray logged the traceback twice)
            return
        self.ranks = RankGroup(self.worker, rank, size, followers, options.get("backend", "auto"),
                               group_timeout_s or GROUP_TIMEOUT_S) if size > 1 else None
        self._scoring = self.ranks or self.worker  # who answers scoring calls
        self._weights = self.ranks or self.worker.weights  # and weight calls
        pipelined = self.ranks is None and self.worker.cuda  # (a step launched while the one before is collected)
        self.scheduler = Scheduler(self._scoring.score_request, start=self.worker.start if pipelined else None,
                                   step_tokens=self.worker.max_tokens_per_batch, max_tokens=LINE_TOKENS,
                                   min_shared_prefix=self.worker.min_shared_prefix) if rank == 0 else None

    @ray.method(concurrency_group=SCORING)
    async def score_request(self, request: ScoreRequest) -> ScoreResult:
        ## NB: the callers' calls wait on one event loop, not on a thread each. The scheduler's thread launches a
        # forward as hundreds of torch calls, each letting go of the GIL: with hundreds of caller threads waking to
        # answer, each call waited for the GIL behind them, and a step's launch took many times its own CPU time.
        if self.scheduler is None:  # (another rank's part of rank 0's step)
            return await asyncio.to_thread(self._scoring.score_request, request)
        result, result.steps_waited = await self.scheduler.answer(request)
        return result

    def info(self) -> dict:
        if self.refused is not None:
            raise self.refused
        info = self._scoring.info()
        if self.scheduler is not None:  # its line: what waits, and the steps run
            line = self.scheduler.line
            info.update(queued_requests=len(line), queued_tokens=self.scheduler.queued_tokens(), steps=line.steps,
                        requests=line.added, step_tokens=line.step_tokens, idle_s=self.scheduler.idle_s)
        return info

    health = info

    def devices(self) -> list[str]:
        return self._scoring.devices()

    def config(self) -> dict:
        return self.worker.config()

    def placement_group(self):
        return self.placement

    def commit(self, version: int) -> int:
        if self.scheduler is None:
            return self._weights.commit(version)
        return self.scheduler.between(lambda: self._weights.commit(version))

    def join_ranks(self, spec, rank: int) -> int:
        return self.ranks.join_ranks(spec, rank)

    def followers_of(self) -> list[str]:
        """A tensor-parallel worker's other ranks' actor names (in the pool's namespace)."""
        return self.ranks.follower_names if self.ranks else []

    def _kept(self, version: int, path: str) -> None:
        """The owner hears of a copy once every rank's is whole (found beside rank 0's: keep.rank_copy)."""
        from ..weights.keep import rank_copy

        if self.rank != 0:
            return
        others = [rank_copy(path, r) for r in range(1, self.size)]

        def tell() -> None:
            deadline = time.monotonic() + KEPT_WAIT_S
            while not all(os.path.isdir(p) for p in others):
                if time.monotonic() > deadline:
                    log.warning("the ranks' local copies of version %d are not all there; not using them", version)
                    return
                time.sleep(0.5)
            self.owner.kept.remote(version, path)

        if others:
            threading.Thread(target=tell, daemon=True).start()
        else:
            tell()


def _handed_over(name: str, call: Callable) -> Callable:
    """PoolWorker's remote method for a weight call (calls.py): its name and signature, answered by the worker's
    WeightsHolder or, for a tensor-parallel worker, its RankGroup (on every rank)."""

    @functools.wraps(call)
    def method(self, *args, **kwargs):
        return getattr(self._weights, name)(*args, **kwargs)

    return method


for _name, _call in WEIGHT_CALLS.items():
    setattr(PoolWorker, _name, _handed_over(_name, _call))


def actor_class(cls: type = PoolWorker):
    """The Ray actor class of `cls` (PoolWorker, or a test's subclass): updates stage, and health checks answer,
    beside scoring (each group on a thread of its own); the callers' scoring calls wait in the worker's line."""
    return ray.remote(concurrency_groups={STAGING: 1, HEALTH: 1, SCORING: SCORING_CALLS})(cls)

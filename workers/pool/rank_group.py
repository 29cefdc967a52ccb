"""A tensor-parallel worker: N Ray actors (ranks) that hold one model's parts (models/tensor_parallel.py) and score
together. Rank 0, the leader, is the worker its pool sees: every call it gets (scoring, staging, committing) it
also sends to the other ranks, then runs its own part; the collectives inside the forward keep them in step. Each
rank's actor (pool_worker.PoolWorker) holds a `RankGroup`, which coordinates its LogProbWorker with the others.

The ranks' process group (NCCL on CUDA, gloo on the CPU; its store served by the leader) is formed by the leader
when it first scores, and formed again when a call finds it broken: a rank that died is restarted by Ray, reads its part
of the current checkpoint, and joins the new group; the call is then run again. A rank restarted while the weights
came from a stream has none: the worker then reports none, and its pool's owner restores every rank (from a peer
worker, rank r's part to rank r, or from the current checkpoint).

Out of memory: every rank splits the same forwards, or none does. Before each forward the ranks agree that each has
room for it (_agree_room); a rank that still runs out inside one leaves the others in its collectives, so the
group is formed again and the call run again, that size now split up front.
"""

from __future__ import annotations

import logging
import os
import uuid
from contextlib import contextmanager
from pathlib import Path

import ray
import torch

from ..distributed import sum_over
from ..errors import (
    OutOfMemoryInForward,
    RequestError,
    TooLarge,
    UpdateFailed,
    WeightsUnavailable,
    WorkerLost,
    get,
)
from ..models import patch_model
from ..models.tensor_parallel import connect
from ..request import ScoreRequest, ScoreResult
from ..weights.keep import rank_copy
from ..weights.transfer import GroupSpec, open_group, serve_store
from .calls import in_staging
from .log_prob_worker import LogProbWorker
from .owner import actors, staging

log = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 60.0  # a collective waiting longer for a rank counts it lost
_ATTEMPTS = 3  # runs of one call after failures, the group formed again between them
_OOM_RUNS = 8  # runs of one call after forwards that ran out of memory (each time smaller ones)


class RankGroup:
    """One rank's side of a tensor-parallel worker: `worker` holds this rank's part. `rank` and `size` give its
    place; `follower_names` (the leader only) the other ranks' actor names, in rank order. The calls below run on
    every rank (the leader's go to the others first), in the same order everywhere."""

    def __init__(self, worker: LogProbWorker, rank: int, size: int, follower_names: list[str] | None, backend: str,
                 timeout_s: float = GROUP_TIMEOUT_S) -> None:
        self.worker, self.weights = worker, worker.weights
        worker.room = self._room
        self.rank, self.size, self._timeout_s = rank, size, timeout_s
        ## NB: the leader finds its other ranks by name each time it forms their group. Handles passed in its
        # constructor arguments go stale once it is restarted: Ray 2.60 never ran the calls made through them
        # (from the new process, or from anyone it handed them to) on a rank that had itself been restarted.
        self.follower_names = list(follower_names or [])
        self.followers: list = []
        self._head_backend = backend
        self._group = None  # formed by the leader when it first scores, and again after a failure
        self._store = None  # the leader: the store of the group it is forming
        self._behind = False  # the leader: a rank lacks the current weights (restarted since)
        self._members: list[int] = []  # the leader: its group's other ranks, by process id
        self._too_big = float("inf")  # tokens of the smallest forward that ran out of memory here
        self._largest = (0, 0)  # (tokens, bytes it took) of the largest forward that ran here (CUDA)

    def _form_group(self) -> None:
        """The leader: a new store and group that every rank joins within GROUP_TIMEOUT_S. A rank still busy in a
        broken collective is free once that collective gives up (as long again), in time for the call's next
        attempt."""
        cuda = str(self.worker.device).startswith("cuda")
        address = ray.util.get_node_ip_address()
        store = serve_store(address, self._timeout_s)
        spec = GroupSpec(f"ranks-{uuid.uuid4().hex[:12]}", address, store.port, self.size, "nccl" if cuda else "gloo",
                         self._timeout_s)
        self._group = None
        self.followers = actors(self.follower_names)
        joined = [f.join_ranks.remote(spec, r) for r, f in enumerate(self.followers, start=1)]
        self._store = store
        self.join_ranks(spec, 0)
        self._members = get(joined)

    def _check_ranks(self) -> None:
        """The leader, before a call: a rank restarted since the group was formed gets a new group (rather than a
        collective waiting GROUP_TIMEOUT_S on its old process), and a rank without this one's weights makes the
        worker report none (its owner then restores every rank)."""
        if not self.followers:
            self.followers = actors(self.follower_names)
        infos = get([f.info.remote() for f in self.followers], timeout=self._timeout_s)
        if any(i["weights_version"] != self.weights.version for i in infos):
            self._behind, self._group = True, None
            raise WeightsUnavailable("a rank of this worker was restarted and has not got its weights back yet")
        if [i["pid"] for i in infos] != self._members:
            self._group = None

    def join_ranks(self, spec, rank: int) -> int:
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"  # a broken collective raises; the process lives on
        store, self._store = (self._store, None) if rank == 0 else (None, None)
        self._group = open_group(spec, rank, store)
        model = self.worker.model
        connect(model, self._group)
        patch_model(model, backend=self._head_backend, process_group=self._group)
        if str(self.worker.device).startswith("cuda"):
            self.worker.warm_up()  # every rank at once: the warm-up's collectives match
        return os.getpid()

    def _on_ranks(self, method: str, args_of, wait_s: float | None = None) -> list:
        """`method` on every rank, rank r with the arguments args_of(r): the others' started first, then this
        one's; the results in rank order. The others get `wait_s` more to finish (None: as long as they live)."""
        if self.follower_names and not self.followers:
            self.followers = actors(self.follower_names)
        # (the other ranks run it in their staging thread where the leader does: calls.py)
        call = (lambda f: staging(f, method)) if in_staging(method) else (lambda f: getattr(f, method))
        refs = [call(f).remote(*args_of(r)) for r, f in enumerate(self.followers, start=1)]
        errors = []
        try:
            # (a rank's own part: its WeightsHolder's where that has the method, else its LogProbWorker's)
            mine = getattr(self.weights if hasattr(self.weights, method) else self.worker, method)(*args_of(0))
        except Exception as e:
            errors.append(e)
        done = ray.wait(refs, num_returns=len(refs), timeout=wait_s)[0] if refs else []
        for ref in done:
            try:
                get(ref)
            except Exception as e:
                errors.append(e)
        if errors:  # the cause first: a rank out of memory, else another rank's error before this one's (which may
            # only be the collective that rank left waiting)
            raise next((e for e in errors if isinstance(e, OutOfMemoryInForward)), errors[-1])
        if len(done) != len(refs):
            raise WorkerLost(f"a rank did not finish {method} within {wait_s:.0f} s of this one")
        return [mine, *get(refs)]

    def _everywhere(self, method: str, *args, wait_s: float | None = None):
        """`method` with the same arguments on every rank; this one's result."""
        return self._on_ranks(method, lambda r: args, wait_s)[0]

    def info(self) -> dict:
        info = self.worker.info()
        if self._behind:  # a rank was restarted without weights: the worker as a whole has none
            info["weights_version"] = None
        return dict(info, ranks=self.size)

    def devices(self) -> list[str]:
        return [gpu for mine in self._on_ranks("devices", lambda r: ()) for gpu in mine]

    @torch.no_grad()
    def score_request(self, request: ScoreRequest) -> ScoreResult:
        if not self.follower_names:
            return self.worker.score_request(request)
        if self._behind or self.weights.version is None:
            raise WeightsUnavailable("a rank of this worker was restarted and has not got its weights back yet")
        failures = ooms = 0
        while True:
            try:
                self._check_ranks()
                if self._group is None:
                    self._form_group()
                return self._everywhere("score_request", request, wait_s=self._timeout_s)  # (in step with this one)
            except (RequestError, WeightsUnavailable, TooLarge):
                raise
            except Exception as e:  # a rank died, ran out of memory or a collective broke: a new group, run again
                oom = isinstance(e, OutOfMemoryInForward)
                ooms, failures = ooms + oom, failures + (not oom)
                if failures == _ATTEMPTS or ooms == _OOM_RUNS:
                    raise WorkerLost(f"a tensor-parallel worker failed {failures + ooms} times: {e}") from e
                log.warning("a rank of this worker failed (%s: %s); forming its group again", type(e).__name__, e,
                            exc_info=not oom)
                self._group = None

    @contextmanager
    def _room(self, tokens: int):
        """Around each forward of this rank's LogProbWorker: once every rank agreed it has room for it, so that a
        forward one rank cannot fit is split by all (LogProbWorker.score_request) and the ranks stay in step."""
        self._agree_room(tokens)
        device = torch.device(self.worker.device)
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        try:
            yield
        except torch.OutOfMemoryError:
            self._too_big = min(self._too_big, tokens)
            raise OutOfMemoryInForward(f"rank {self.rank} ran out of memory in a forward of {tokens} tokens") from None
        if cuda and tokens >= self._largest[0]:
            self._largest = (tokens, torch.cuda.max_memory_allocated(device) - base)

    def _agree_room(self, tokens: int) -> None:
        """Raises torch.OutOfMemoryError on every rank when any rank has no room for a forward of `tokens`: one
        as large ran out of memory there, or (CUDA) the memory it would take, extrapolated from the largest forward
        yet, cannot be allocated now (then the caching allocator holds it for the forward)."""
        short = tokens >= self._too_big
        seen, took = self._largest
        device = torch.device(self.worker.device)
        if not short and device.type == "cuda" and seen and tokens > seen:
            free = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            try:
                torch.empty(max(0, took * tokens // seen - free), dtype=torch.uint8, device=device)
            except torch.OutOfMemoryError:
                short = True
        votes = torch.tensor([float(short)], device=device)
        sum_over(votes, self._group)
        if votes.item():
            raise torch.OutOfMemoryError(f"a rank of this worker has no room for a forward of {tokens} tokens")

    # Weight updates reach every rank through this one, so that each rank sees the calls in the same order.
    # A stream sends whole tensors; each rank keeps its parts (WeightsHolder.stage_stream).

    def stage_checkpoint(self, path: str, version: int, check: bool = False) -> str | None:
        """A checkpoint every rank reads its parts of, or this rank's local copy: each rank then reads its own."""
        own = bool(self.follower_names) and Path(path).parent == self.weights.keep_root
        return _first(self._on_ranks("stage_checkpoint", lambda r: (rank_copy(path, r) if own else path, version,
                                                                     check)))

    def remove_local_copy(self) -> None:
        self._everywhere("remove_local_copy")

    def commit(self, version: int) -> int:
        self._everywhere("commit", version)
        self._behind = False
        self._too_big = float("inf")  # (memory changed: the staging buffer is gone; sizes are tried afresh)
        return version

    def abort(self, version: int) -> None:
        self._everywhere("abort", version)

    def layout_for(self, shapes: dict, full: bool = False, group: str | None = None, lay_out: bool = True):
        # (each rank checks that it is in the sender's group)
        return self._everywhere("layout_for", shapes, full, group, lay_out)

    def join_group(self, spec, rank: int) -> None:
        """A trainer's group (one spec): rank r of this worker joins it as `rank` + r. A restore from a peer (a
        list of specs, one per rank, from its open_sender): rank r joins spec[r] as `rank`."""
        if isinstance(spec, list):
            self._on_ranks("join_group", lambda r: (spec[r], rank))
        else:
            self._on_ranks("join_group", lambda r: (spec, rank + r))

    def leave_group(self, name: str) -> None:
        self._everywhere("leave_group", name)

    def stage_stream(self, group: str, layout, version: int, bucket_bytes: int, check: bool = False) -> str | None:
        return _first(self._on_ranks("stage_stream", lambda r: (group, layout, version, bucket_bytes, check)))

    def open_sender(self, name: str, world_size: int, backend: str, timeout_s: float) -> list:
        """A group of two per rank, in which it sends its part to the same rank of a restarted worker."""
        return self._on_ranks("open_sender", lambda r: (name, world_size, backend, timeout_s))

    def send_weights(self, spec: list, layout=None) -> None:
        """`spec`: open_sender's answer, one group per rank (rank r sends its part in spec[r])."""
        self._on_ranks("send_weights", lambda r: (spec[r], layout))

    def stage_shared(self, key: str, shared: list | None, layout, version: int, check: bool = False) -> str | None:
        # (its ranks hold one GPU each; a sender on one of them is refused before this)
        raise UpdateFailed("tensor-parallel workers take weights over NCCL or gloo, not CUDA IPC")

    def release_shared(self, key: str | None = None) -> None:
        pass  # (nothing is ever shared with it)


def _first(names: list[str | None]) -> str | None:
    """The first rank's report of a non-finite tensor, if any."""
    return next((name for name in names if name), None)

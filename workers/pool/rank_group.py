"""A tensor-parallel worker: N Ray actors (ranks) that hold one model's parts (models/tensor_parallel.py) and score
together. Rank 0, the leader, is the worker its pool sees: every call it gets (scoring, staging, committing) it
also sends to the other ranks, then runs its own part; the collectives inside the forward keep them in step.

The ranks' process group (NCCL on CUDA, gloo on the CPU; its store served by the leader) is formed by the leader
when it first scores, and formed again when a call finds it broken: a rank that died is restarted by Ray, reads its part
of the current checkpoint, and joins the new group; the call is then run again. Weight streams (from a trainer or a
peer) are not taken by tensor-parallel workers yet: they update from checkpoints.
"""

from __future__ import annotations

import logging
import uuid

import ray
import torch

from ..errors import RequestError, UpdateFailed, WeightsUnavailable, WorkerLost, get
from ..models import patch_model
from ..models.tensor_parallel import connect
from ..request import ScoreRequest, ScoreResult
from ..weights.transfer import GroupSpec, open_group, serve_store
from .owner import actors

log = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 60.0  # a collective waiting longer for a rank counts it lost
_ATTEMPTS = 3  # runs of one call, the group formed again between them


class RankGroup:
    """Mixed into the pool's actor class before LogProbWorker. `rank` and `size` give this actor's place;
    `follower_names` (the leader only) the other ranks' actor names, in rank order."""

    def _init_ranks(self, rank: int, size: int, follower_names: list[str] | None, backend: str) -> None:
        self.rank, self.size = rank, size
        ## NB: the leader finds its other ranks by name each time it forms their group. Handles passed in its
        # constructor arguments go stale once it is restarted: Ray 2.60 never ran the calls made through them
        # (from the new process, or from anyone it handed them to) on a rank that had itself been restarted.
        self._follower_names = list(follower_names or [])
        self.followers: list = []
        self._head_backend = backend
        self._group = None  # formed by the leader when it first scores, and again after a failure

    def _form_group(self) -> None:
        """The leader: a new store and group that every rank joins within GROUP_TIMEOUT_S. A rank still busy in a
        broken collective is free once that collective gives up (as long again), in time for the call's next
        attempt."""
        cuda = str(self.device).startswith("cuda")
        store = serve_store(GROUP_TIMEOUT_S)
        spec = GroupSpec(f"ranks-{uuid.uuid4().hex[:12]}", ray.util.get_node_ip_address(), store.port, self.size,
                         "nccl" if cuda else "gloo", GROUP_TIMEOUT_S)
        self._stores[spec.name] = store
        self._group = None
        self.followers = actors(self._follower_names)
        joined = [f.join_ranks.remote(spec, r) for r, f in enumerate(self.followers, start=1)]
        self.join_ranks(spec, 0)
        get(joined)

    def join_ranks(self, spec, rank: int) -> None:
        store = self._stores.pop(spec.name, None) if rank == 0 else None
        self._group = open_group(spec, rank, store)
        connect(self.model, self._group)
        patch_model(self.model, backend=self._head_backend, process_group=self._group)
        if str(self.device).startswith("cuda"):
            self._warm_up()  # every rank at once: the warm-up's collectives match

    def followers_of(self) -> list[str]:
        """The other ranks' actor names (in the pool's namespace)."""
        return self._follower_names

    def _everywhere(self, method: str, *args, wait_s: float | None = None):
        """`method` on the other ranks (started first) and on this one; this one's result. The others get
        `wait_s` more to finish (None: as long as they live)."""
        if self._follower_names and not self.followers:
            self.followers = actors(self._follower_names)
        refs = [getattr(f, method).remote(*args) for f in self.followers]
        try:
            mine = getattr(super(), method)(*args)
        finally:
            outcomes = ray.wait(refs, num_returns=len(refs), timeout=wait_s)[0] if refs else []
        get(outcomes)
        if len(outcomes) != len(refs):
            raise WorkerLost(f"a rank did not finish {method} within {wait_s:.0f} s of this one")
        return mine

    @torch.no_grad()
    def score_request(self, request: ScoreRequest) -> ScoreResult:
        if not self._follower_names:
            return super().score_request(request)
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                if self._group is None:
                    self._form_group()
                return self._everywhere("score_request", request, wait_s=GROUP_TIMEOUT_S)  # (in step with this one)
            except (RequestError, WeightsUnavailable):
                raise
            except Exception as e:  # a rank died or a collective broke: form the group again, run again
                if attempt == _ATTEMPTS:
                    raise WorkerLost(f"a tensor-parallel worker failed {attempt} times: {type(e).__name__}") from e
                log.warning("a rank of this worker failed (%s: %s); forming its group again", type(e).__name__, e)
                self._group = None
        raise AssertionError("unreachable")

    def stage_checkpoint(self, path: str, version: int) -> None:
        self._everywhere("stage_checkpoint", path, version)

    def commit(self, version: int) -> int:
        return self._everywhere("commit", version)

    def abort(self, version: int) -> None:
        self._everywhere("abort", version)

    def _no_streams(self) -> None:
        if self.size > 1:
            raise UpdateFailed("tensor-parallel workers take weight updates from checkpoints only (a path), not "
                               "streamed tensors yet")

    def layout_for(self, *args, **kwargs):
        self._no_streams()
        return super().layout_for(*args, **kwargs)

    def full_layout(self):
        self._no_streams()
        return super().full_layout()

    def stage_tensors(self, tensors, version: int) -> None:
        self._no_streams()
        super().stage_tensors(tensors, version)

"""The calls a pool's worker actor answers for its weights, stated once (torch-free, so that a process holding only
handles imports none). Each is WeightsHolder's method of that name, or for a tensor-parallel worker its RankGroup's,
which runs it on every rank; PoolWorker's remote method of that name and signature hands the call to whichever the
worker has. `staging` marks a call that runs in the actor's staging thread, beside scoring: the pool's owner calls
it there (owner.staging), and a tensor-parallel worker's leader calls its other ranks there too.
tests/workers/pool/test_calls.py holds WeightsHolder and RankGroup to these signatures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


def staging(method: Callable) -> Callable:
    method.staging = True
    return method


class WeightCalls(Protocol):
    def layout_for(self, shapes: dict, full: bool = False, group: str | None = None, lay_out: bool = True): ...

    @staging
    def stage_checkpoint(self, path: str, version: int, check: bool = False) -> str | None: ...

    @staging
    def stage_stream(self, group: str, layout, version: int, bucket_bytes: int, check: bool = False) -> str | None:
        ...

    @staging
    def stage_shared(self, key: str, shared: list | None, layout, version: int, check: bool = False) -> str | None:
        ...

    def release_shared(self, key: str | None = None) -> None: ...

    def abort(self, version: int) -> None: ...

    @staging
    def join_group(self, spec, rank: int) -> None: ...

    def leave_group(self, name: str) -> None: ...

    @staging
    def open_sender(self, name: str, world_size: int, backend: str, timeout_s: float): ...

    @staging
    def send_weights(self, spec, layout=None) -> None: ...

    def remove_local_copy(self) -> None: ...


WEIGHT_CALLS: dict[str, Callable] = {name: f for name, f in vars(WeightCalls).items()
                                     if callable(f) and not name.startswith("_")}


def in_staging(name: str) -> bool:
    """Whether the call `name` runs in the staging thread."""
    return getattr(WEIGHT_CALLS.get(name), "staging", False)

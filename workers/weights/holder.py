"""The weight side of a worker: updates are staged (from a checkpoint, or a stream from a trainer or a peer), then
committed or aborted on the pool owner's word; a worker can also stream its own weights to a restarted peer."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from ..errors import IncompatibleWeights, NotShared, UpdateFailed, WeightsUnavailable, non_finite
from ..sharding import held_shard, part_shape, take
from .checkpoint import read_checkpoint
from .keep import LocalCopy
from .staging import Layout, StagedWeights, match_model, rank_parts
from .transfer import (
    GroupSpec,
    broadcast_tensors,
    open_group,
    receive_parts,
    receive_shared,
    receive_tensors,
    serve_store,
)

log = logging.getLogger(__name__)


class WeightsHolder:
    """The weights of `model` and their `version` (None: none yet, a restarted worker's initial values). The staging
    calls (stage_*) return the name of the first staged tensor that holds a NaN or an infinity when asked to
    `check`, else None. `keep_dir`: keep a local copy there (weights/keep.py), of checkpoints (hard links) and, with
    `keep_streams`, of streamed weights; `on_kept(version, path)` hears of each copy once it is whole."""

    def __init__(self, model: nn.Module, version: int | None, *, keep_dir: str | None = None,
                 keep_streams: bool = False, on_kept: Callable[[int, str], None] | None = None) -> None:
        self.model = model
        self.version = version
        self._staged: tuple[int, StagedWeights, str | None] | None = None  # (version, weights, checkpoint path)
        self._groups: dict = {}  # group name -> (GroupSpec, process group), this worker a receiver
        self._stores: dict = {}  # group name -> the store this worker serves as a sender
        self._shared: tuple[str, StagedWeights] | None = None  # (key, tensors) a sender on this GPU shared
        self._copy = LocalCopy(keep_dir, on_kept or (lambda version, path: None), keep_streams) if keep_dir else None

    @property
    def keep_root(self) -> Path | None:
        """Where the local copies are kept, if anywhere."""
        return self._copy.root if self._copy else None

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def layout_for(self, shapes: dict[str, tuple[int, ...]], full: bool = False, group: str | None = None,
                   lay_out: bool = True) -> Layout | None:
        """Checks an update's names and shapes against the model (IncompatibleWeights) and, for a stream, that
        this worker is in the sender's group; returns the layout the sender sends (whole tensors, this model's
        dtypes). `lay_out=False`: only what depends on this worker (its group; a restarted worker's rule), for
        the pool's other workers, which hold the same model as the one that lays the update out."""
        if group is not None and group not in self._groups:
            raise UpdateFailed(f"a worker is not in the sender's group {group!r} (restarted since it was opened)")
        if lay_out or (self.version is None and not full):
            layout = self._plan(shapes, full)[0]
            return layout if lay_out else None
        return None

    def _plan(self, shapes: dict[str, tuple[int, ...]], full: bool) -> tuple[Layout, Layout, dict]:
        """An update's sent layout, its staging layout, and what each staged tensor is cut from (rank_parts): the
        two layouts are one unless this model is a tensor-parallel rank's part."""
        parts = rank_parts(self.model, shapes)
        mine = {name: part_shape(shapes[source], part) for name, (source, part) in parts.items()}
        if self.version is None and not full:  # restarted, holding initial values: all of them, or none
            try:
                match_model(self.model, mine, full=True, what="the update")
            except IncompatibleWeights as e:
                raise WeightsUnavailable(f"a worker was restarted and has no weights, so a partial update cannot "
                                         f"give it them ({e}); send every parameter, or score once first (the pool "
                                         "then restores it)") from None
        staging = match_model(self.model, mine, full=full, what="the update")
        if held_shard(self.model) is None:
            return staging, staging, parts
        dtypes = {name: p.dtype for name, p in self.model.named_parameters(remove_duplicate=False)}
        return Layout.of((name, tuple(shape), dtypes[name]) for name, shape in shapes.items()), staging, parts

    def full_layout(self) -> Layout:
        """The layout of all the model's parameters (a restore from a peer)."""
        shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
        return match_model(self.model, shapes, full=True, what="the update")

    def _stage(self, version: int, staged: StagedWeights, path: str | None, check: bool) -> str | None:
        self._staged = (version, staged, path)
        return staged.first_non_finite() if check else None

    def stage_checkpoint(self, path: str, version: int, check: bool = False) -> str | None:
        return self._stage(version, read_checkpoint(self.model, path), path, check)

    def stage_tensors(self, tensors: dict[str, torch.Tensor], version: int, check: bool = False) -> str | None:
        """An in-process update (a plain worker, tests): the given tensors, checked, copied to staging."""
        if not isinstance(tensors, dict):
            raise IncompatibleWeights(f"an update is a checkpoint path or a dict of tensors, not "
                                      f"{type(tensors).__name__}")
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
                raise IncompatibleWeights(f"{name!r} is {what} in the update; the model's parameters are floating "
                                          "point")
        _, layout, parts = self._plan({n: tuple(t.shape) for n, t in tensors.items()}, full=False)
        staged = StagedWeights(layout, self._device)
        for entry in layout.entries:
            source, part = parts[entry.name]
            staged.tensor(entry).copy_(take(tensors[source], part))
        return self._stage(version, staged, None, check)

    def join_group(self, spec: GroupSpec, rank: int) -> None:
        self._groups[spec.name] = (spec, open_group(spec, rank))

    def leave_group(self, name: str) -> None:
        self._groups.pop(name, None)
        self._stores.pop(name, None)

    def stage_stream(self, group: str, layout: Layout | None, version: int, bucket_bytes: int,
                     check: bool = False) -> str | None:
        """Receives `layout` (from layout_for; a tensor-parallel rank keeps its parts of the whole tensors) or, with
        None, all of this worker's parameters as they are (from a peer that holds the same part: a restore)."""
        spec, pg = self._groups[group]
        device = self._device if spec.backend == "nccl" else torch.device("cpu")
        parts = None
        if layout is None:
            layout = self.full_layout()
        elif held_shard(self.model) is not None:
            _, mine, parts = self._plan({e.name: e.shape for e in layout.entries}, full=False)
        staged = StagedWeights(layout if parts is None else mine, device)
        try:
            if parts is None:
                receive_tensors(pg, staged, bucket_bytes)
            else:
                receive_parts(pg, layout, staged, parts, device, bucket_bytes)
        except Exception as e:  # the update is refused (nothing changes); the log keeps what broke
            log.warning("the weight stream of group %s broke off", group, exc_info=True)
            self._groups.pop(group, None)  # a broken group is not used again
            raise UpdateFailed(f"the weight stream broke off ({type(e).__name__}: {str(e)[:200]})") from None
        return self._stage(version, staged, None, check)

    def stage_shared(self, key: str, shared: list | None, layout: Layout | None, version: int,
                     check: bool = False) -> str | None:
        """Weights from a sender on this worker's own GPU, staged where they are: no copy until the commit, no staging
        memory. `shared` (see transfer.share_handles) maps the sender's tensors, under `key`, and is checked against
        the model (the sender plans once for many updates; this worker may have been restarted since); they stay
        mapped until the sender shares others or lets them go (release_shared), so its next updates send only the
        key (shared=None), and this worker reads the same tensors again: NotShared if it does not hold them."""
        if shared is not None:
            if layout is None or self._plan({e.name: e.shape for e in layout.entries}, full=False)[1] != layout:
                raise UpdateFailed("the sender's layout is not this worker's (another model?)")
            self._shared = (key, StagedWeights.in_place(layout, receive_shared(shared)))  # (the last ones unmapped)
        elif self._shared is None or self._shared[0] != key:
            raise NotShared("a worker does not hold the sender's shared tensors (restarted since they were shared)")
        return self._stage(version, self._shared[1], None, check)

    def release_shared(self, key: str | None = None) -> None:
        """Unmaps the tensors a sender shared (under `key`; None: any)."""
        if self._shared is not None and key in (None, self._shared[0]):
            self._shared = None
            if self._staged is not None and not self._staged[1].owns_memory:
                self._staged = None

    def commit(self, version: int) -> int:
        if self._staged is None or self._staged[0] != version:
            raise UpdateFailed(f"no staged weights of version {version} to commit")
        _, staged, path = self._staged
        with self._copy.lock if self._copy else nullcontext():  # the last local copy has left device memory
            staged.commit(self.model)
        self._staged = None
        self.version = version
        if staged.device.type == "cuda" and staged.owns_memory:
            torch.cuda.empty_cache()  # the staging buffer
        if self._copy is not None:
            self._copy.keep(version, self.model, path)
        return version

    def remove_local_copy(self) -> None:
        if self._copy is not None:
            self._copy.remove()

    def abort(self, version: int) -> None:
        if self._staged is not None and self._staged[0] == version:
            self._staged = None

    def update_weights(self, weights: dict | str | os.PathLike, version: int, *, allow_non_finite: bool = False) -> int:
        """Stages and commits at once (a plain worker used in one process): a checkpoint path or a dict of tensors,
        full or partial; IncompatibleWeights (NonFiniteWeights for NaN or inf, unless allowed) or InvalidCheckpoint
        before anything changes."""
        if isinstance(weights, os.PathLike):
            weights = os.fspath(weights)
        stage = self.stage_checkpoint if isinstance(weights, str) else self.stage_tensors
        if (name := stage(weights, version, check=not allow_non_finite)) is not None:
            self.abort(version)
            raise non_finite(name)
        return self.commit(version)

    def open_sender(self, name: str, world_size: int, backend: str, timeout_s: float) -> GroupSpec:
        """Serves a store for a group in which this worker sends its weights (to restore a restarted peer)."""
        import ray

        address = ray.util.get_node_ip_address()
        store = serve_store(address, timeout_s)
        self._stores[name] = store
        return GroupSpec(name, address, store.port, world_size, backend, timeout_s)  # type: ignore[arg-type]

    def send_weights(self, spec: GroupSpec, layout: Layout | None = None) -> None:
        """Broadcasts `layout` of this worker's parameters (None: all of them) to the group of `spec`."""
        layout = layout or self.full_layout()
        try:
            pg = open_group(spec, 0, self._stores[spec.name])
            params = dict(self.model.named_parameters(remove_duplicate=False))
            device = self._device if spec.backend == "nccl" else torch.device("cpu")
            broadcast_tensors(pg, params, layout, device)
        finally:
            self._stores.pop(spec.name, None)

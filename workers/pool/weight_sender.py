"""WeightSender: a trainer's side of a weight update streamed to every worker of a pool.

    with pool.weight_sender() as sender:          # this process joins the workers in one process group
        version = sender.send(model.named_parameters())   # every step: one broadcast for all workers

The tensors may be a full or partial set, in any dtype (they are converted to the workers' dtypes bucket by bucket),
on the GPU or in host memory (with CUDA workers, host tensors reach the sender's GPU through pinned buffers, then
go GPU to GPU over NCCL; gloo only where the sender or the workers have no GPU), or FSDP2 DTensor shards (each
gathered whole as its bucket is sent; the trainer's other ranks must iterate the same parameters calling
`full_tensor()` alongside). A trainer
colocated with the workers on its own GPU (NCCL cannot join two processes of one GPU) shares its tensors by CUDA
IPC instead: the workers map them once, check and copy them device to device at each update, and keep them mapped
until the sender closes (a tensor not already contiguous in the workers' dtype is converted into a buffer the sender
keeps, at its size, between updates).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping

import ray
import torch

from ..errors import NotShared, UpdateFailed, get
from ..weights.transfer import (
    BUCKET_BYTES,
    GroupSpec,
    broadcast_tensors,
    open_group,
    serve_store,
    share_handles,
    share_sources,
)
from .log_prob_worker import gpu_uuid


class WeightSender:
    """See the module's docstring: `send(named_tensors)` -> the new weights_version; `close()` (or `with`). The way
    the tensors travel is its `transport`, chosen here: a `Stream` (NCCL from this process's GPU to CUDA workers,
    gloo where this process or the workers have no GPU) or `SharedIPC` (this process on the workers' own GPU).
    (A checkpoint path needs no sender: the workers read it themselves, through the pool's owner.)"""

    def __init__(self, owner, num_receivers: int, device: torch.device, workers_on_cuda: bool, *,
                 bucket_bytes: int | None = None, timeout_s: float = 300.0, allow_non_finite: bool = False) -> None:
        self.closed = False
        if device.type != "cuda" or not workers_on_cuda:
            self.transport: Stream | SharedIPC = Stream(owner, num_receivers, "gloo", torch.device("cpu"),
                                                        bucket_bytes, timeout_s, allow_non_finite)
            return
        mine, theirs = gpu_uuid(device), get(owner.devices.remote())
        if mine not in theirs:
            self.transport = Stream(owner, num_receivers, "nccl", device, bucket_bytes, timeout_s, allow_non_finite)
        elif any(gpu != mine for gpu in theirs):
            raise ValueError(f"some of the pool's workers share this sender's GPU ({device}) and others do not; send "
                             "from a GPU that no worker uses, or update from a checkpoint path")
        else:
            self.transport = SharedIPC(owner, device, allow_non_finite)

    @property
    def backend(self) -> str:
        """"nccl", "gloo" or "ipc"."""
        return self.transport.backend

    def send(self, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
        """Streams these tensors into every worker and returns the new weights_version once all have them; raises
        IncompatibleWeights (nothing sent), NonFiniteWeights (a NaN or infinity in a tensor, unless the sender
        allows them: nothing changed) or UpdateFailed (nothing changed) otherwise."""
        if self.closed:
            raise UpdateFailed("this weight sender is closed")
        tensors = named if isinstance(named, Mapping) else dict(named)
        return self.transport.send(tensors, {name: tuple(t.shape) for name, t in tensors.items()})

    def close(self) -> None:
        self.closed = True
        self.transport.close()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Stream:
    """A process group of this process (rank 0) and every receiver (a worker, or each rank of one), its store served
    here; each update is broadcast bucket by bucket, in the workers' dtypes, and lands once all have staged it."""

    def __init__(self, owner, num_receivers: int, backend: str, device: torch.device, bucket_bytes: int | None,
                 timeout_s: float, allow_non_finite: bool) -> None:
        self.owner, self.num_receivers, self.backend, self.device = owner, num_receivers, backend, device
        self.bucket_bytes, self.timeout_s = bucket_bytes or BUCKET_BYTES, timeout_s
        self.allow_non_finite = allow_non_finite
        self.group = None
        self._open()

    def _open(self) -> None:
        address = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        store = serve_store(address, self.timeout_s)
        self.spec = GroupSpec(f"weights-{uuid.uuid4().hex[:12]}", address, store.port, self.num_receivers + 1,
                              self.backend, self.timeout_s)  # type: ignore[arg-type]
        joined = self.owner.open_group.remote(self.spec)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.group = open_group(self.spec, 0, store)
        self._store = store
        get(joined)

    def send(self, tensors: Mapping[str, torch.Tensor], shapes: dict) -> int:
        if self.group is None:
            self._open()
        try:
            version, layout = self._begin(shapes)
        except UpdateFailed:  # a worker restarted since the group was opened: open a new one, once
            self.close()
            self._open()
            version, layout = self._begin(shapes)
        try:
            broadcast_tensors(self.group, tensors, layout, self.device, self.bucket_bytes)
        except Exception:
            self.close()  # the receivers' broadcasts fail with the group, and the owner aborts the update
            get(self.owner.finish_stream.remote(version))
            raise
        return get(self.owner.finish_stream.remote(version))

    def _begin(self, shapes: dict) -> tuple:
        return get(self.owner.begin_stream.remote(self.spec.name, shapes, self.bucket_bytes, False,
                                                  self.allow_non_finite))

    def close(self) -> None:
        if self.group is not None:
            self.group = None
            self._store = None
            get(self.owner.close_group.remote(self.spec.name))


class SharedIPC:
    """By CUDA IPC, for a sender on the workers' own GPU (NCCL cannot join two processes of one GPU): the tensors as
    they lie (or converted into buffers kept here), shared with the workers once and read again by them at each
    update while they stay where they are; shared anew when they move, when the update's names or shapes change, or
    when a worker lost them (restarted)."""

    backend = "ipc"

    def __init__(self, owner, device: torch.device, allow_non_finite: bool) -> None:
        self.owner, self.device, self.allow_non_finite = owner, device, allow_non_finite
        self._planned: tuple[dict, object] | None = None  # (shapes, layout) of the last update
        self._packs: dict[str, torch.Tensor] = {}  # conversions of the tensors, kept in place between updates
        self._shared: tuple[str, list[int]] | None = None  # (key, addresses) of the tensors the workers hold

    def send(self, tensors: Mapping[str, torch.Tensor], shapes: dict) -> int:
        if self._planned is None or self._planned[0] != shapes:  # (each worker checks the layout as it stages)
            self._planned = (shapes, get(self.owner.plan.remote(shapes)))
            self._packs = {}
        layout = self._planned[1]
        sources = share_sources(tensors, layout, self.device, self._packs)
        addresses = [src.data_ptr() for src in sources]
        for again in (False, True):
            shared = None
            if again or self._shared is None or self._shared[1] != addresses:
                self._shared, shared = (uuid.uuid4().hex, addresses), share_handles(sources, layout)
            torch.cuda.synchronize(self.device)  # (the workers read what this process wrote)
            try:
                version = get(self.owner.update_shared.remote(self._shared[0], shared, shared and layout,
                                                              self.allow_non_finite))
            except NotShared:
                if again:
                    raise
                continue
            if shared is not None:
                torch.cuda.ipc_collect()  # what the workers held of earlier shares goes back to this process
            return version
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._shared is not None:  # the workers unmap this process's tensors
            key, self._shared, self._packs = self._shared[0], None, {}
            get(self.owner.release_shared.remote(key))
            torch.cuda.ipc_collect()

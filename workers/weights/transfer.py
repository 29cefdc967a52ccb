"""Weights streamed to workers over one torch.distributed process group: the sender (a trainer, or a live worker
restoring a restarted one) is rank 0 and broadcasts, every receiving worker fills its staging buffer in place.

The group is its own: a TCPStore opened by the sender and a ProcessGroupNCCL / ProcessGroupGloo made from it,
never the default process group, so a trainer's own torch.distributed set-up (FSDP, DDP) is left alone. NCCL
moves CUDA tensors GPU to GPU (NVLink within a node); gloo moves host memory (CPU workers, CI, CPU tensors).
Tensors travel in buckets of consecutive entries of the staging layout: a bucket holding one tensor that is
already contiguous and in the workers' dtype is broadcast straight from it, the others are packed first.
"""

from __future__ import annotations

import inspect
import os
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from ..sharding import take
from .pinned import CHUNK_BYTES, READ_THREADS, copy_through_pinned, pinned_slots
from .staging import Entry, Layout, StagedWeights

BUCKET_BYTES = 512 << 20


@dataclass(frozen=True)
class GroupSpec:
    """How a receiver joins a sender's group: the sender's store address, its name, size and backend."""

    name: str
    address: str
    port: int
    world_size: int
    backend: Literal["nccl", "gloo"]
    timeout_s: float = 300.0


def open_group(spec: GroupSpec, rank: int, store: dist.Store | None = None) -> dist.ProcessGroup:
    """This process's member of the group (rank 0 passes the store it serves). Blocks until every rank joined
    (gloo); NCCL connects at the first broadcast."""
    timeout = timedelta(seconds=spec.timeout_s)
    if store is None:
        store = dist.TCPStore(spec.address, spec.port, is_master=False, timeout=timeout)
    store = dist.PrefixStore(spec.name, store)
    if spec.backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, spec.world_size, timeout)
    if rank != 0:
        ## NB: in a worker, a timed-out broadcast (a sender that died) aborts the communicator and raises, instead
        # of the default of tearing the whole process down; the pool then keeps the old weights. A trainer's own
        # setting is left as it is.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    group = dist.ProcessGroupNCCL(store, rank, spec.world_size, dist.ProcessGroupNCCL.Options())
    group.set_timeout(timeout)  # (every collective's; NCCL connects at the first, so none ran with the default)
    return group


def serve_store(address: str, timeout_s: float) -> dist.TCPStore:
    """The sender's store on a free port (the port is `.port`) of `address`, the one the group's members are told
    (the node's address in the cluster; loopback for a service on one machine), not every interface: TCPStore
    itself listens on all of them, so it is handed a socket bound here."""
    family, kind, proto, _, where = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.bind(where)
    listener.listen()
    port = listener.getsockname()[1]
    return dist.TCPStore(address, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
                         master_listen_fd=listener.detach())  # (the store owns the socket from here)


def buckets(layout: Layout, bucket_bytes: int = BUCKET_BYTES) -> list[tuple[Entry, ...]]:
    """Consecutive entries grouped up to bucket_bytes; an entry larger than that goes alone."""
    out: list[tuple[Entry, ...]] = []
    current: list[Entry] = []
    for entry in layout.entries:
        if current and entry.offset + entry.nbytes - current[0].offset > bucket_bytes:
            out.append(tuple(current))
            current = []
        current.append(entry)
    if current:
        out.append(tuple(current))
    return out


def _span(bucket: tuple[Entry, ...]) -> tuple[int, int]:
    return bucket[0].offset, bucket[-1].offset + bucket[-1].nbytes


def _root0() -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts


def _as_full(tensor: Tensor) -> Tensor:
    """A DTensor (FSDP2 shard) gathered whole; any other tensor as it is."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


def _bucket_bytes(bucket: tuple[Entry, ...], tensors: dict[str, Tensor], device: torch.device,
                  buffer: Callable[[int], Tensor]) -> tuple[Tensor, bool]:
    """The bucket as bytes on `device`, and whether it was packed: a one-tensor bucket already contiguous, in the
    workers' dtype and on `device` as it is; otherwise its tensors converted into buffer(its bytes). Each tensor is
    gathered (FSDP2) once."""
    lo, hi = _span(bucket)
    first = _as_full(tensors[bucket[0].name])
    if len(bucket) == 1 and first.dtype == bucket[0].dtype and first.device == device and first.is_contiguous():
        return first.detach().view(-1).view(torch.uint8), False
    data = buffer(hi - lo)
    from_host, local = [], []
    for entry in bucket:
        src = first if entry is bucket[0] else _as_full(tensors[entry.name])
        view = data[entry.offset - lo : entry.offset - lo + entry.nbytes].view(entry.dtype).view(entry.shape)
        (from_host if src.device.type == "cpu" and device.type == "cuda" else local).append((view, src.detach()))
    if local:  # one multi-tensor copy, not a kernel per tensor
        torch._foreach_copy_([view for view, _ in local], [src for _, src in local], non_blocking=True)
    if from_host:
        copy_from_host(from_host)
    return data, True


_copiers: ThreadPoolExecutor | None = None


def copy_from_host(pairs: list[tuple[Tensor, Tensor]]) -> None:
    """dst = src for each (dst: CUDA, contiguous; src: host memory, any dtype) pair, in chunks through the pinned
    buffers that checkpoint reads use too (pinned.py), several chunks (of any of the tensors) at once: each converted
    into a pinned buffer by a thread, then copied to the device on that buffer's stream. The current stream waits for
    the copies."""
    global _copiers
    if _copiers is None:
        _copiers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="host-to-device")
    device = pairs[0][0].device
    slots = pinned_slots(device)
    jobs = []  # (flat destination, flat source, first element, elements)
    for dst, src in pairs:
        flat, src = dst.view(-1), src.reshape(-1)
        step = CHUNK_BYTES // max(dst.element_size(), src.element_size())
        jobs += [(flat, src, lo, min(step, flat.numel() - lo)) for lo in range(0, flat.numel(), step)]

    def run(job) -> torch.cuda.Event:
        flat, src, lo, n = job
        return copy_through_pinned(slots, n * flat.element_size(),
                                   lambda buf: buf.view(flat.dtype).copy_(src[lo : lo + n]),
                                   lambda buf: flat[lo : lo + n].copy_(buf.view(flat.dtype), non_blocking=True))

    current = torch.cuda.current_stream(device)
    for event in _copiers.map(run, jobs):
        current.wait_event(event)


@torch.no_grad()
def broadcast_tensors(group: dist.ProcessGroup, tensors: dict[str, Tensor], layout: Layout, device: torch.device,
                      bucket_bytes: int = BUCKET_BYTES) -> None:
    """Rank 0's side: every entry of `layout` from `tensors[name]`, converted to the entry's dtype on `device`.
    Packed buckets alternate between two buffers, so one is filled while the other is on the wire."""
    packs: list[Tensor | None] = [None, None]
    works: list = [None, None]  # the broadcast last sent from each pack buffer

    for i, bucket in enumerate(buckets(layout, bucket_bytes)):
        k = i % 2

        def free_pack(nbytes: int, k: int = k) -> Tensor:
            if works[k] is not None:
                works[k].wait()  # the pack buffer is free again
            if packs[k] is None or packs[k].numel() < nbytes:
                packs[k] = torch.empty(nbytes, dtype=torch.uint8, device=device)
            return packs[k][:nbytes]

        data, packed = _bucket_bytes(bucket, tensors, device, free_pack)
        work = group.broadcast([data], _root0())
        if packed:
            works[k] = work
        else:
            work.wait()
    for work in works:
        if work is not None:
            work.wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def receive_tensors(group: dist.ProcessGroup, staged: StagedWeights, bucket_bytes: int = BUCKET_BYTES) -> None:
    """A receiver's side: every bucket straight into the staging buffer."""
    for bucket in buckets(staged.layout, bucket_bytes):
        lo, hi = _span(bucket)
        group.broadcast([staged.buffer[lo:hi]], _root0()).wait()
    if staged.device.type == "cuda":
        torch.cuda.synchronize(staged.device)


@torch.no_grad()
def receive_parts(group: dist.ProcessGroup, layout: Layout, staged: StagedWeights, parts: dict,
                  device: torch.device, bucket_bytes: int = BUCKET_BYTES) -> None:
    """A tensor-parallel rank's side: each bucket of whole tensors (`layout`) into a scratch buffer, then this
    rank's part of each into its staging buffer (`parts`: staged name -> (whole tensor's name, part or None), see
    staging.rank_parts). The scratch holds one bucket (or the largest tensor), on the group's `device`."""
    entries = {e.name: e for e in staged.layout.entries}
    cuts: dict[str, list] = {}
    for name, (source, part) in parts.items():
        if name in entries:
            cuts.setdefault(source, []).append((entries[name], part))
    plan = buckets(layout, bucket_bytes)
    scratch = torch.empty(max((hi - lo for lo, hi in map(_span, plan)), default=0), dtype=torch.uint8, device=device)
    for bucket in plan:
        lo, hi = _span(bucket)
        group.broadcast([scratch[: hi - lo]], _root0()).wait()
        for entry in bucket:
            whole = scratch[entry.offset - lo : entry.offset - lo + entry.nbytes].view(entry.dtype).view(entry.shape)
            for target, part in cuts.get(entry.name, ()):
                staged.tensor(target).copy_(take(whole, part))
    if device.type == "cuda" or staged.device.type == "cuda":
        torch.cuda.synchronize()


def share_sources(tensors: dict[str, Tensor], layout: Layout, device: torch.device,
                  packs: dict[str, Tensor]) -> list[Tensor]:
    """The sender's side when its workers share its GPU (no NCCL between two processes of one GPU): for each entry
    of `layout`, a tensor on `device` holding it in the workers' dtype, to be shared by CUDA IPC. The caller's own
    tensor where it already is one (contiguous, on `device`, in that dtype: a bf16 trainer's parameters), read where
    it lies; else its conversion into `packs[name]`, a buffer the caller keeps from one update to the next so that
    its address, and the workers' mapping of it, stay."""
    sources, pending = [], []
    for entry in layout.entries:
        src = tensors[entry.name]
        plain = not hasattr(src, "full_tensor")  # (an FSDP2 shard is gathered into its buffer)
        if plain and src.dtype == entry.dtype and src.device == device and src.is_contiguous():
            sources.append(src.detach())
            continue
        pack = packs.get(entry.name)
        if pack is None:
            pack = packs[entry.name] = torch.empty(entry.shape, dtype=entry.dtype, device=device)
        src = _as_full(src).detach()
        pending.append((pack, src))
        sources.append(pack)
    local = [(dst, src) for dst, src in pending if src.device.type != "cpu"]
    if local:  # one multi-tensor copy, not a kernel per tensor
        torch._foreach_copy_([dst for dst, _ in local], [src for _, src in local], non_blocking=True)
    if len(local) < len(pending):
        copy_from_host([(dst, src) for dst, src in pending if src.device.type == "cpu"])
    return sources


def share_handles(sources: list[Tensor], layout: Layout) -> list[tuple[int, tuple]]:
    """Each source's bytes as (its offset into the layout, a CUDA IPC handle); every call makes new handles (each
    carries a reference the receiver gives back)."""
    from torch.multiprocessing.reductions import reduce_tensor

    return [(entry.offset, reduce_tensor(src.view(-1).view(torch.uint8))[1])
            for entry, src in zip(layout.entries, sources, strict=True)]


def receive_shared(shared: list[tuple[int, tuple]]) -> list[tuple[int, Tensor]]:
    """A receiver's side of share_handles: each shared tensor's bytes on this process's device (the same GPU), read
    where they are (StagedWeights.in_place), as (offset into the layout, bytes). They stay mapped while referenced."""
    device = torch.cuda.current_device()
    return [(lo, rebuild_on(handle, device)) for lo, handle in shared]


## NB: a CUDA IPC handle (reduce_tensor's) names the storage's device by the sender's CUDA index, and the same GPU may
# have another index in the receiver (each process numbers the GPUs its CUDA_VISIBLE_DEVICES lists). torch has no
# public call that rebuilds a handle on another index, so the handle, the arguments of rebuild_cuda_tensor in order,
# is bound to that function's parameters and `storage_device` replaced by name; what this relies on is checked.
def rebuild_on(handle: tuple, device: int) -> Tensor:
    """The tensor of a CUDA IPC handle (reduce_tensor(t)[1]) mapped on this process's CUDA device `device`."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        args = inspect.signature(rebuild_cuda_tensor).bind(*handle).arguments
    except TypeError as e:
        raise RuntimeError(f"torch {torch.__version__}: a CUDA IPC handle of {len(handle)} fields does not fit "
                           f"rebuild_cuda_tensor ({e}); receive_shared needs mending for this torch") from None
    if not isinstance(args.get("storage_device"), int):
        raise RuntimeError(f"torch {torch.__version__}: rebuild_cuda_tensor's storage_device is not a device index "
                           f"in a CUDA IPC handle (got {args.get('storage_device')!r}); receive_shared needs mending "
                           "for this torch")
    args["storage_device"] = device  # the storage's device, as this process numbers it
    return rebuild_cuda_tensor(**args)

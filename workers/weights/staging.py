"""Staged weight updates: new tensors land in a staging buffer first and are copied into the parameters only when
every worker of the pool has them (commit), or dropped (abort). So an update lands everywhere or nowhere.

A `Layout` places named tensors in one flat byte buffer; checkpoint reads and broadcasts fill it by byte ranges.
"""

from __future__ import annotations

import bisect
import logging
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..errors import IncompatibleWeights
from ..sharding import Part, held_shard, part_of

log = logging.getLogger(__name__)

_ALIGN = 256  # bytes; every tensor starts at a multiple, so dtype views of the buffer are aligned
_LAYER = re.compile(r"\.layers\.(\d+)\.")
HEADROOM_BYTES = 2 << 30  # device memory left free for scoring when staging on the device
FILE_DTYPES = {  # safetensors' names of the dtypes it stores
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
FINITE_CHUNK = 1 << 28  # elements of a tensor a finiteness check reduces as one piece


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes into the staging buffer
    nbytes: int


@dataclass(frozen=True)
class Layout:
    entries: tuple[Entry, ...]
    nbytes: int

    @classmethod
    def of(cls, items: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> Layout:
        entries, offset = [], 0
        for name, shape, dtype in items:
            nbytes = math.prod(shape) * dtype.itemsize
            entries.append(Entry(name, tuple(shape), dtype, offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        return cls(tuple(entries), offset)


def _layers(names: Iterable[str]) -> int:
    return 1 + max((int(m.group(1)) for n in names if (m := _LAYER.search(n))), default=-1)


def match_model(model: nn.Module, shapes: dict[str, tuple[int, ...]], *, full: bool, what: str) -> Layout:
    """The layout of an update of `model` with tensors of these names and shapes, in the model's own dtypes.

    Raises IncompatibleWeights naming the first difference: a name the model lacks, a shape that differs, or
    (full=True) a parameter the update lacks. Tied parameters are one parameter under several names.
    """
    if not shapes:
        raise IncompatibleWeights(f"{what} holds no tensors")
    params = dict(model.named_parameters(remove_duplicate=False))
    unknown = [n for n in shapes if n not in params]
    if unknown:
        mine, theirs = _layers(params), _layers(shapes)
        # (a partial update may well hold fewer layers than the model: no hint then)
        layers = f"; {what} has {theirs} layers, the model {mine}" if theirs > mine or full and theirs != mine else ""
        raise IncompatibleWeights(
            f"{what} has {len(unknown)} tensors the model does not, e.g. {unknown[0]!r}{layers}"
        )
    items, seen = [], set()
    for name, shape in shapes.items():
        p = params[name]
        if tuple(shape) != tuple(p.shape):
            raise IncompatibleWeights(
                f"{name!r} has shape {list(shape)} in {what} and {list(p.shape)} in the model"
            )
        if id(p) not in seen:  # a tied parameter is written once
            seen.add(id(p))
            items.append((name, tuple(shape), p.dtype))
    if full:
        missing = [n for n, p in model.named_parameters() if id(p) not in seen]
        if missing:
            raise IncompatibleWeights(f"{what} lacks {len(missing)} of the model's parameters, e.g. {missing[0]!r}")
    return Layout.of(items)


def rank_parts(model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, Part | None]]:
    """What an update of whole tensors (`shapes`, by name) gives each parameter it reaches: (the whole tensor's
    name, where this rank's part of it lies, None for all of it). A plain model takes each tensor whole. A
    tensor-parallel rank (sharding.held_shard) takes its part; a head that was tied
    before the cut takes its part of the embedding when the update has no head of its own. IncompatibleWeights
    names a tensor that is not the whole model's."""
    shard = held_shard(model)
    if shard is None:
        return {name: (name, None) for name in shapes}
    sources = {name: name for name in shapes}
    if shard.tied:
        params = dict(model.named_parameters())
        embed = next(n for n, p in params.items() if p is model.get_input_embeddings().weight)
        head = next(n for n, p in params.items() if p is model.get_output_embeddings().weight)
        if head not in shapes and embed in shapes:
            sources[head] = embed
    try:
        return {name: (source, part_of(name, tuple(shapes[source]), shard.rank, shard.size, model.config))
                for name, source in sources.items()}
    except ValueError as e:
        raise IncompatibleWeights(str(e)) from None


class StagedWeights:
    """A staging buffer for one update: on the model's device when it fits beside `HEADROOM_BYTES`, else in host
    memory (pinned when the model is on CUDA). Or (`in_place`) the sender's own tensors, shared by CUDA IPC, read
    where they are: nothing is allocated or copied until the commit, and the same staged weights serve the sender's
    next updates while its tensors stay where they are."""

    def __init__(self, layout: Layout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        if device.type == "cuda" and (free := self._free(device)) < layout.nbytes + HEADROOM_BYTES:
            log.warning("staging %.1f GiB of weights in host memory (%.1f GiB free on %s): this update is slower",
                        layout.nbytes / 2**30, free / 2**30, device)
            self.device = torch.device("cpu")
        pin = device.type == "cuda" and self.device.type == "cpu"
        self.buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device, pin_memory=pin)
        self.owns_memory = True  # (in_place: the sender's)
        self._segments = [(0, self.buffer)]  # (offset into the layout, its bytes), by offset
        self._pieces: dict | None = None  # what first_non_finite reduces, by dtype: (names, pieces)
        self._copies: tuple | None = None  # (model, its parameters, the staged tensors) of commit

    @classmethod
    def in_place(cls, layout: Layout, segments: list[tuple[int, Tensor]]) -> StagedWeights:
        """Staged weights read from `segments`, (offset into the layout, bytes) covering every entry, which the
        caller keeps unchanged until the commit or abort."""
        staged = cls.__new__(cls)
        staged.layout, staged._segments = layout, sorted(segments, key=lambda s: s[0])
        staged.owns_memory = False
        staged.device = staged._segments[0][1].device
        staged._pieces = staged._copies = None
        return staged

    @staticmethod
    def _free(device: torch.device) -> int:
        """Free device memory, counting what this process holds cached and unused (scoring's last activations):
        the allocator gives that back to the device when an allocation needs it."""
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached

    def bytes_of(self, entry: Entry) -> Tensor:
        lo, data = self._segments[bisect.bisect_right(self._segments, entry.offset, key=lambda s: s[0]) - 1]
        return data[entry.offset - lo : entry.offset - lo + entry.nbytes]

    def tensor(self, entry: Entry) -> Tensor:
        return self.bytes_of(entry).view(entry.dtype).view(entry.shape)

    @torch.no_grad()
    def first_non_finite(self) -> str | None:
        """The name of the first staged tensor holding a NaN or an infinity, else None: the largest magnitude of each
        piece of at most FINITE_CHUNK elements, by one multi-tensor reduction per dtype (a NaN or an infinity makes
        it non-finite), read back with one synchronisation. The pieces are cut once (staged weights that stay in
        place are checked again at each update)."""
        if self._pieces is None:
            self._pieces = {}
            for entry in self.layout.entries:
                if entry.dtype.is_floating_point and entry.nbytes:  # (an empty tensor has no largest magnitude)
                    for piece in self.tensor(entry).view(-1).split(FINITE_CHUNK):
                        self._pieces.setdefault(entry.dtype, ([], []))
                        self._pieces[entry.dtype][0].append(entry.name)
                        self._pieces[entry.dtype][1].append(piece)
        if not self._pieces:
            return None
        names = [name for group, _ in self._pieces.values() for name in group]
        finite = torch.cat([torch.stack(torch._foreach_norm(pieces, math.inf)).isfinite()
                            for _, pieces in self._pieces.values()]).cpu()
        bad = {name for name, ok in zip(names, finite.tolist(), strict=True) if not ok}
        return next((entry.name for entry in self.layout.entries if entry.name in bad), None)

    @torch.no_grad()
    def commit(self, model: nn.Module) -> None:
        """Copies every staged tensor into the model's parameter of that name."""
        if self._copies is None or self._copies[0] is not model:  # (built once for staged weights kept in place)
            params = dict(model.named_parameters(remove_duplicate=False))
            self._copies = (model, [params[e.name].data for e in self.layout.entries],
                            [self.tensor(e) for e in self.layout.entries])
        _, targets, sources = self._copies
        torch._foreach_copy_(targets, sources, non_blocking=True)
        if self.device.type == "cuda" or next(model.parameters()).is_cuda:
            torch.cuda.synchronize()

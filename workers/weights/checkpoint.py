"""Safetensors checkpoints read straight into a staging buffer: headers checked first (names, shapes, dtypes, file
sizes, so a truncated shard is refused before anything is read), then byte ranges read by several threads, through
pinned host buffers when the destination is on CUDA, with no CPU copy of the whole model built on the way.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import stat
import struct
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ..errors import CheckpointNotFound, IncompatibleWeights, InvalidCheckpoint, clip
from ..sharding import Part, expert_size, held_shard, part_of, part_shape
from .keep import PARTS_FILE
from .pinned import CHUNK_BYTES, READ_THREADS, copy_through_pinned, pinned_slots
from .staging import FILE_DTYPES, Layout, StagedWeights, match_model, rank_parts

log = logging.getLogger(__name__)
_MAX_HEADER = 100 << 20
_OLD_BUFFERS = re.compile(r"(rotary_emb\.inv_freq|(^|\.)position_ids)$")  # (buffers older transformers saved)
_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}


@dataclass(frozen=True)
class TensorSpec:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def _open_regular(file: str | Path) -> int:
    """A descriptor of `file` for reading, opened without blocking (a FIFO's open would wait for a writer) and
    refused unless it is a regular file (a FIFO, device or socket named like a shard could hold the reader forever)."""
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise InvalidCheckpoint(f"{Path(file).name} is not a regular file ({_KINDS.get(stat.S_IFMT(mode), 'special')})")
    os.set_blocking(fd, True)
    return fd


def _read_header(file: Path) -> dict[str, TensorSpec]:
    with open(_open_regular(file), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise InvalidCheckpoint(f"{file.name} is truncated: {size} bytes, not even a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise InvalidCheckpoint(f"{file.name} is not a safetensors file or is truncated (header of {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # (nested deeper than Python's stack)
            raise InvalidCheckpoint(f"{file.name} has a malformed safetensors header") from None
    if not isinstance(header, dict):
        raise InvalidCheckpoint(f"{file.name} has a malformed safetensors header")
    specs, data = {}, 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if isinstance(info, dict) and isinstance(info.get("dtype"), str) and info["dtype"] not in FILE_DTYPES:
            raise InvalidCheckpoint(f"{file.name}: tensor {name!r} is stored as {clip(info['dtype'], 20)}, which is "
                                    f"not read here (only {', '.join(FILE_DTYPES)}: no quantized checkpoints)")
        try:
            dtype = FILE_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise InvalidCheckpoint(f"{file.name}: tensor {name!r} has a malformed or unsupported entry") from None
        if end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
            raise InvalidCheckpoint(f"{file.name}: tensor {name!r} has {end - begin} bytes for shape {list(shape)}")
        if data + end > size:
            raise InvalidCheckpoint(
                f"{file.name} is truncated: tensor {name!r} ends at byte {data + end}, the file has {size}"
            )
        specs[name] = TensorSpec(str(file), dtype, shape, data + begin, data + end)
    return specs


def checkpoint_dir(path: str) -> Path:
    """The directory at `path`; CheckpointNotFound when there is none (or it cannot be read)."""
    try:
        if "\x00" not in path and Path(path).is_dir():
            return Path(path)
    except OSError as e:
        raise CheckpointNotFound(f"cannot read the checkpoint directory {clip(path, 200)!r}: {e.strerror}") from None
    raise CheckpointNotFound(f"no checkpoint directory at {clip(path, 200)!r}")


def read_index(path: str) -> dict[str, TensorSpec]:
    """Every tensor of the checkpoint directory at `path`, from its shards' headers (no tensor data is read).

    Raises CheckpointNotFound (no such directory) or InvalidCheckpoint (no shards, bad header, truncated shard).
    """
    root = checkpoint_dir(path)
    try:
        files = sorted(root.glob("*.safetensors"))
    except OSError as e:
        raise CheckpointNotFound(f"cannot read the checkpoint directory {clip(path, 200)!r}: {e.strerror}") from None
    if not files:
        raise InvalidCheckpoint(f"{clip(path, 200)!r} has no *.safetensors weights")
    index: dict[str, TensorSpec] = {}
    for file in files:
        try:
            specs = _read_header(file)
        except OSError as e:
            raise InvalidCheckpoint(f"cannot read {file.name}: {e.strerror}") from None
        for name in specs.keys() & index.keys():
            raise InvalidCheckpoint(f"tensor {name!r} is in two shards")
        index.update(specs)
    return index


def check_shards(path: str) -> None:
    """The checkpoint directory at `path` checked as read_index checks it (InvalidCheckpoint naming the shard) where
    it has safetensors shards; a directory of pytorch_model*.bin files passes unread."""
    if any(checkpoint_dir(path).glob("*.safetensors")):
        read_index(path)


# HF's saved form of a mixture's experts, one tensor per expert and projection (transformers 5 fuses them when it
# loads: a layer's `experts.gate_up_proj` [E, 2I, H], gate rows first, and `experts.down_proj` [E, H, I]); Mixtral's
# block is `block_sparse_moe` on disk (w1: gate, w3: up, w2: down)
_ROLE = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}
_EXPERT = re.compile(rf"^(.+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.({'|'.join(_ROLE)})\.weight$")
_MIXTRAL_ROUTER = re.compile(r"^(.+)\.block_sparse_moe\.gate\.weight$")

# a fused parameter -> (a checkpoint tensor, its element offset in the parameter, the part of it read: a
# tensor-parallel rank's rows of a gate or up projection, its columns of a down projection)
Pieces = dict[str, list[tuple[str, int, Part | None]]]


def _fused_experts(model: nn.Module, index: dict[str, TensorSpec]) -> tuple[dict[str, TensorSpec], Pieces]:
    """The checkpoint's tensors as the model names them: per-expert tensors gathered into the model's fused
    expert parameters (`pieces`: where each lands), Mixtral's router renamed. IncompatibleWeights names an
    expert tensor that does not fit or a fused parameter some expert is missing from."""
    params = dict(model.named_parameters())
    shard = held_shard(model)
    renamed, pieces, found, whole = {}, {}, {}, {}
    for name, spec in index.items():
        m = _EXPERT.match(name)
        router = _MIXTRAL_ROUTER.match(name)
        if router and f"{router[1]}.mlp.gate.weight" in params:
            renamed[f"{router[1]}.mlp.gate.weight"] = spec
            continue
        fused = m and f"{m[1]}.mlp.experts.{'down_proj' if _ROLE[m[3]] == 2 else 'gate_up_proj'}"
        if not fused or fused not in params:
            renamed[name] = spec
            continue
        experts, rows, cols = params[fused].shape  # (this rank's part of the whole parameter)
        expert, role, size = int(m[2]), _ROLE[m[3]], expert_size(model.config)
        want = (size, cols) if role < 2 else (rows, size)
        whole[fused] = (experts, 2 * size, cols) if role < 2 else (experts, rows, size)
        if expert >= experts or tuple(spec.shape) != want:
            raise IncompatibleWeights(f"{name!r} has shape {list(spec.shape)}; the model's {fused!r} "
                                      f"{list(whole[fused])} takes [{want[0]}, {want[1]}] for each of "
                                      f"{experts} experts")
        part = None
        if shard is not None and shard.size > 1:  # the rank's slice of the expert's intermediate dimension
            cut = part_of(fused, whole[fused], shard.rank, shard.size, model.config)
            part = Part(0 if role < 2 else 1, cut.start, cut.length)
        offset = expert * rows * cols + (role == 1) * (rows // 2) * cols
        pieces.setdefault(fused, []).append((name, offset, part))
        found.setdefault(fused, set()).add((expert, role))
    for fused, have in found.items():
        experts = params[fused].shape[0]
        want = {(e, r) for e in range(experts) for r in ((2,) if fused.endswith("down_proj") else (0, 1))}
        if have != want:
            e, r = min(want - have)
            raise IncompatibleWeights(f"the checkpoint lacks expert {e}'s {('gate', 'up', 'down')[r]} projection of "
                                      f"{fused!r}")
        first = index[pieces[fused][0][0]]
        renamed[fused] = TensorSpec(first.file, first.dtype, whole[fused], first.start, first.end)
    return renamed, pieces


def check_checkpoint(model: nn.Module, path: str) -> tuple[dict[str, TensorSpec], Layout, dict, Pieces]:
    """The checkpoint's tensors, their staging layout, what each staged tensor is read from (see rank_parts: a
    tensor-parallel rank reads its part of each), and the pieces of fused expert parameters (read from one
    tensor per expert); every refusal raised before any data is read."""
    raw = read_index(path)
    index, pieces = _fused_experts(model, raw)
    unused = unused_tensors(model, index)
    if len(unused) == len(index):  # (none of the model's: match_model says so)
        unused = set()
    index = {name: spec for name, spec in index.items() if name not in unused}
    if _holds_parts(model, path):  # a tensor-parallel rank's local copy of its own parts
        parts = {name: (name, None) for name in index}
    else:
        parts = rank_parts(model, {n: s.shape for n, s in index.items()})
    shapes = {n: part_shape(index[source].shape, part) for n, (source, part) in parts.items()}
    layout = match_model(model, shapes, full=True, what="the checkpoint")
    for entry in layout.entries:
        dtype = index[parts[entry.name][0]].dtype
        if not dtype.is_floating_point:
            raise IncompatibleWeights(f"{entry.name!r} is {dtype} in the checkpoint; the model's is {entry.dtype}")
    if unused:
        say_unused(path, unused)
    return {**raw, **index}, layout, parts, pieces  # (the experts' own tensors too: read_checkpoint reads them)


def unused_tensors(model: nn.Module, names: Iterable[str]) -> set[str]:
    """The checkpoint tensors among `names` that the model has no place for and that say nothing against it, left
    unread as HF's loader leaves them: tensors under no module of the model (a value head saved beside the policy),
    buffers older transformers saved (each layer's rotary frequencies), and those the model's class tells HF to
    ignore. A tensor under a module the model has (a norm or a bias it lacks: another architecture, or a layer past
    its last) is not among them: match_model refuses it."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    modules = dict(model.named_modules(remove_duplicate=False))
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]

    def outside(name: str) -> bool:
        path = name.split(".")[:-1]
        return not any(".".join(path[:i]) in modules for i in range(1, len(path) + 1))

    return {name for name in names if name not in params and (
        name in buffers or _OLD_BUFFERS.search(name) or any(p.search(name) for p in ignored) or outside(name))}


def say_unused(path: str, names: Iterable[str]) -> None:
    """One warning line naming the tensors of the checkpoint at `path` that were left unread."""
    names = sorted(names)
    log.warning("%r has %d tensors the model does not use, left unread: %s", clip(str(path), 200), len(names),
                clip(", ".join(map(repr, names)), 300))


def _holds_parts(model: nn.Module, path: str) -> bool:
    """Whether the checkpoint at `path` holds this tensor-parallel rank's parts (weights/keep.py); another rank's,
    or any for a model that is not such a rank, is refused."""
    marker = Path(path) / PARTS_FILE
    if not marker.is_file():
        return False
    held = json.loads(marker.read_text())
    mine = held_shard(model)
    if mine is None or (held["rank"], held["size"]) != (mine.rank, mine.size):
        theirs = f"rank {mine.rank} of {mine.size}" if mine else "a whole model"
        raise IncompatibleWeights(f"{clip(path, 200)!r} holds the parts of tensor-parallel rank {held['rank']} of "
                                  f"{held['size']}; this model is {theirs}")
    return True


def _read_range(fd: int, offset: int, out: memoryview) -> None:
    while out:
        got = os.preadv(fd, [out], offset)
        if got == 0:
            raise InvalidCheckpoint(f"a shard ended early at byte {offset} (changed while being read?)")
        out, offset = out[got:], offset + got


def read_checkpoint(model: nn.Module, path: str) -> StagedWeights:
    """Reads the whole checkpoint at `path` into a new staging buffer for `model` (commit() applies it)."""
    index, layout, parts, pieces = check_checkpoint(model, path)
    device = next(model.parameters()).device
    staged = StagedWeights(layout, device)
    files = {index[parts[e.name][0]].file for e in layout.entries}
    files |= {index[name].file for p in pieces.values() for name, _, _ in p}
    fds = {file: _open_regular(file) for file in files}
    try:
        # (fd, file offset, bytes, source dtype, destination, columns): the destination is a flat slice of the
        # staged tensor, or rows of it when `columns` (the source's row length, the part's first column) is given
        jobs = []

        def flat(spec: TensorSpec, start: int, dst: Tensor) -> None:
            size = spec.dtype.itemsize
            step = max(1, CHUNK_BYTES // size)
            for lo in range(0, dst.numel(), step):
                n = min(step, dst.numel() - lo)
                jobs.append((fds[spec.file], start + lo * size, n * size, spec.dtype, dst[lo : lo + n], None))

        def read(spec: TensorSpec, part: Part | None, dst: Tensor) -> None:
            """Jobs reading `part` of the tensor `spec` into `dst` (contiguous, the part's shape)."""
            size, shape = spec.dtype.itemsize, spec.shape
            if part is not None and 0 < part.dim == len(shape) - 1:  # columns: whole rows read, the part's kept
                cols, rows = shape[-1], math.prod(shape[:-1])
                dst = dst.view(rows, part.length)
                step = max(1, CHUNK_BYTES // (cols * size))
                for lo in range(0, rows, step):
                    n = min(step, rows - lo)
                    jobs.append((fds[spec.file], spec.start + lo * cols * size, n * cols * size, spec.dtype,
                                 dst[lo : lo + n], (cols, part.start)))
                return
            if part is None:
                flat(spec, spec.start, dst.view(-1))
                return
            # runs of whole rows: for each index before `dim` and each block, the part's `length` rows of `dim`
            inner, each = math.prod(shape[part.dim + 1 :]), shape[part.dim] // part.blocks
            run = part.length * inner
            for i in range(math.prod(shape[: part.dim]) * part.blocks):
                flat(spec, spec.start + (i * each + part.start) * inner * size, dst.view(-1)[i * run : (i + 1) * run])

        for entry in layout.entries:
            if entry.name in pieces:  # one tensor per expert, each a block of the fused parameter
                dst = staged.tensor(entry).view(-1)
                for name, offset, part in pieces[entry.name]:
                    spec = index[name]
                    read(spec, part, dst[offset : offset + math.prod(part_shape(spec.shape, part))])
                continue
            source, part = parts[entry.name]
            read(index[source], part, staged.tensor(entry))
        cuda = staged.device.type == "cuda"
        slots = pinned_slots(staged.device) if cuda else None

        def source(raw: Tensor, dtype: torch.dtype, columns: tuple[int, int] | None, dst: Tensor) -> Tensor:
            src = raw.view(dtype)
            if columns is None:
                return src
            return src.view(-1, columns[0])[:, columns[1] : columns[1] + dst.shape[1]]

        def run(job) -> None:
            fd, offset, nbytes, dtype, dst, columns = job
            if cuda:
                copy_through_pinned(slots, nbytes, lambda buf: _read_range(fd, offset, memoryview(buf.numpy())),
                                    lambda buf: dst.copy_(source(buf, dtype, columns, dst), non_blocking=True))
            elif dtype == dst.dtype and columns is None:
                _read_range(fd, offset, memoryview(dst.view(torch.uint8).numpy()))
            else:
                tmp = torch.empty(nbytes, dtype=torch.uint8)
                _read_range(fd, offset, memoryview(tmp.numpy()))
                dst.copy_(source(tmp, dtype, columns, dst))

        with ThreadPoolExecutor(READ_THREADS) as pool:
            list(pool.map(run, jobs))
        if cuda:
            torch.cuda.synchronize(staged.device)
    finally:
        for fd in fds.values():
            os.close(fd)
    return staged

"""A local copy of the weights a worker serves, so that a pool of one worker (no live peer to stream them from) can
bring a restarted worker back with the current weights after the trainer deleted the checkpoint, or, when asked,
when the weights came from a stream.

What it costs: for a checkpoint, hard links to its shards (free, when the copy's folder is on the checkpoint's file
system; else nothing is kept unless streamed weights are kept too, then one copy as for those). For streamed
weights (only with `streams`, the pool's local_copy=True): one safetensors file of the model's size on the
worker's node, written by a thread of its own that always writes the newest version (updates that land while it
writes are skipped, not queued). The parameters are copied out of device memory on a stream of their own into a
pinned host buffer of the model's size, kept for the next copy (~0.3 s for 15 GB, holding off only a commit that
comes meanwhile); the file is then written from that buffer with the GIL released, beside scoring.

A tensor-parallel rank keeps its own copy in a folder of its own (`rank{r}`): of a checkpoint, the same links to the
whole tensors (it reads its parts again); of streamed weights, its parts, marked as such (PARTS_FILE).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import tempfile
import threading
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from ..sharding import held_shard
from .staging import FILE_DTYPES, Layout

log = logging.getLogger(__name__)

PARTS_FILE = "tensor_parallel_part.json"  # {"rank": r, "size": n}: the copy holds that rank's parts, not whole tensors
_FILE_NAMES = {dtype: name for name, dtype in FILE_DTYPES.items()}
_WRITE_BYTES = 64 << 20  # per write call


def rank_copy(path: str, rank: int) -> str:
    """Where tensor-parallel rank `rank` keeps the version whose copy is at `path` (another rank's folder)."""
    copy = Path(path)
    return str(copy.parent.parent / f"rank{rank}" / copy.name)


def write_safetensors(file: Path, layout: Layout, data: torch.Tensor) -> None:
    """The entries of `layout`, whose bytes are in the host buffer `data`, as one safetensors file."""
    header, at = {}, 0
    for e in layout.entries:
        header[e.name] = {"dtype": _FILE_NAMES[e.dtype], "shape": list(e.shape), "data_offsets": [at, at + e.nbytes]}
        at += e.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    raw = memoryview(data.numpy())
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for e in layout.entries:
            for lo in range(e.offset, e.offset + e.nbytes, _WRITE_BYTES):
                f.write(raw[lo : min(lo + _WRITE_BYTES, e.offset + e.nbytes)])


class LocalCopy:
    def __init__(self, root: str, on_kept: Callable[[int, str], None], streams: bool = False) -> None:
        self.root = Path(tempfile.gettempdir()) / root  # a relative root: under this node's temporary folder
        self.on_kept = on_kept
        self.streams = streams  # also keep weights that came from a stream (or a checkpoint that cannot be linked)
        self.lock = threading.Lock()  # held while parameters are copied out; commits take it too
        self._newest: tuple[int, nn.Module] | None = None  # the version the writer is to write next
        self._wake = threading.Condition()
        self.writer: threading.Thread | None = None  # started at the first copy to write
        self._host: torch.Tensor | None = None  # the parameters' bytes, copied out of the model

    def keep(self, version: int, model: nn.Module, checkpoint: str | None) -> None:
        """Keeps `version` (now in `model`, read from `checkpoint` if not None); tells on_kept once it is whole."""
        target = self.root / f"v{version}"
        if checkpoint is not None:
            try:
                self._link(Path(checkpoint), target)
                return self._done(version, target)
            except OSError as e:
                log.info("cannot link %s into %s (%s)%s", checkpoint, target, e,
                         "; writing a copy" if self.streams else "; no local copy of this version")
        if not self.streams:
            return
        with self._wake:
            self._newest = (version, model)
            self._wake.notify()
        if self.writer is None:
            self.writer = threading.Thread(target=self._write_newest, daemon=True, name="local-copy")
            self.writer.start()

    @staticmethod
    def _partial(target: Path) -> Path:
        """An empty folder beside `target`, renamed to it once whole (a copy is never seen half-written)."""
        partial = target.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        return partial

    def _link(self, checkpoint: Path, target: Path) -> None:
        partial = self._partial(target)
        for shard in checkpoint.glob("*.safetensors"):
            os.link(shard, partial / shard.name)
        partial.rename(target)

    def _write_newest(self) -> None:
        while True:
            with self._wake:
                while self._newest is None:
                    self._wake.wait()
                (version, model), self._newest = self._newest, None
            try:
                self._write(version, model, self.root / f"v{version}")
            except Exception:  # the copy is a fallback; the worker goes on serving without it
                log.exception("could not keep a local copy of weights version %d", version)

    @torch.no_grad()
    def _write(self, version: int, model: nn.Module, target: Path) -> None:
        params = list(model.named_parameters())
        layout = Layout.of((name, tuple(p.shape), p.dtype) for name, p in params)
        device = params[0][1].device
        cuda = device.type == "cuda"
        if self._host is None or self._host.numel() < layout.nbytes:
            self._host = None
            self._host = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=cuda)
        stream = torch.cuda.Stream(device) if cuda else None
        with self.lock:  # a consistent snapshot: no commit changes the parameters meanwhile
            with torch.cuda.stream(stream) if cuda else nullcontext():
                if cuda:
                    stream.wait_stream(torch.cuda.default_stream(device))  # (the last commit's copies)
                for entry, (_, p) in zip(layout.entries, params, strict=True):
                    self._host[entry.offset : entry.offset + entry.nbytes].view(p.dtype).view(p.shape).copy_(
                        p, non_blocking=True)
            if cuda:
                stream.synchronize()
        partial = self._partial(target)
        write_safetensors(partial / "model.safetensors", layout, self._host)
        if (shard := held_shard(model)) is not None:
            (partial / PARTS_FILE).write_text(json.dumps(dict(rank=shard.rank, size=shard.size)))
        partial.rename(target)
        self._done(version, target)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def _done(self, version: int, target: Path) -> None:
        for old in self.root.glob("v*"):
            if old != target and old.suffix != ".partial" and int(old.name[1:]) < version:
                shutil.rmtree(old, ignore_errors=True)
        self.on_kept(version, str(target))

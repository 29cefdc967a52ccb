"""A local copy of the weights a worker serves, so that a pool of one worker (no live peer to stream them from) can
bring a restarted worker back with the current weights after the trainer deleted the checkpoint, or when the
weights came from a stream.

What it costs: for a checkpoint, hard links to its shards (free, when the copy's folder is on the checkpoint's file
system; else one copy of the files). For streamed weights, one safetensors file of the model's size on the worker's
node, written by a background thread after each update: the copy out of device memory (~1 s for 15 GB) holds off
only the next commit, and host memory of the model's size is used while the file is written.

A tensor-parallel rank keeps its own copy in a folder of its own (`rank{r}`): of a checkpoint, the same links to the
whole tensors (it reads its parts again); of streamed weights, its parts, marked as such (PARTS_FILE).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import save_file
from torch import nn

log = logging.getLogger(__name__)

PARTS_FILE = "tensor_parallel_part.json"  # {"rank": r, "size": n}: the copy holds that rank's parts, not whole tensors


def rank_copy(path: str, rank: int) -> str:
    """Where tensor-parallel rank `rank` keeps the version whose copy is at `path` (another rank's folder)."""
    copy = Path(path)
    return str(copy.parent.parent / f"rank{rank}" / copy.name)


class LocalCopy:
    def __init__(self, root: str, on_kept: Callable[[int, str], None]) -> None:
        self.root = Path(tempfile.gettempdir()) / root  # a relative root: under this node's temporary folder
        self.on_kept = on_kept
        self.lock = threading.Lock()  # held while parameters are copied out; commits take it too

    def keep(self, version: int, model: nn.Module, checkpoint: str | None) -> None:
        """Keeps `version` (now in `model`, read from `checkpoint` if not None); tells on_kept once it is whole."""
        target = self.root / f"v{version}"
        if checkpoint is not None:
            try:
                self._link(Path(checkpoint), target)
                return self._done(version, target)
            except OSError as e:
                log.info("cannot link %s into %s (%s); writing a copy", checkpoint, target, e)
        threading.Thread(target=self._write, args=(version, model, target), daemon=True).start()

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

    def _write(self, version: int, model: nn.Module, target: Path) -> None:
        try:
            with self.lock:  # a consistent snapshot: no commit changes the parameters meanwhile
                tensors = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
            partial = self._partial(target)
            save_file(tensors, str(partial / "model.safetensors"))
            shard = getattr(model, "tp_shard", None)
            if shard is not None:
                (partial / PARTS_FILE).write_text(json.dumps(dict(rank=shard[0], size=shard[1])))
            partial.rename(target)
            self._done(version, target)
        except Exception:  # the copy is a fallback; the worker goes on serving without it
            log.exception("could not keep a local copy of weights version %d", version)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def _done(self, version: int, target: Path) -> None:
        for old in self.root.glob("v*"):
            if old != target and old.suffix != ".partial" and int(old.name[1:]) < version:
                shutil.rmtree(old, ignore_errors=True)
        self.on_kept(version, str(target))

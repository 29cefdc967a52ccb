"""LogProbWorker: one patched model on one device, scoring batches of token sequences.

A plain class (tests build it without Ray); `WorkerPool` turns it into Ray actors. A request is packed into
rows of at most `max_tokens_per_batch` tokens (several sequences per row, position_ids restarting at 0, no
padding), each row is one forward, and results come back in request order. On CUDA out-of-memory a row is
split in half and retried.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import WeightsUnavailable
from ..models import load_model
from ..weights.checkpoint import read_checkpoint
from ..weights.holder import WeightsHolder

log = logging.getLogger(__name__)


@dataclass
class SequenceScores:
    """One sequence's result: entry k is for token seq[score_from + k] given seq[:score_from + k]."""

    log_probs: np.ndarray  # float32, [len(seq) - score_from]
    entropy: np.ndarray | None  # float32, same length; None when not asked for
    weights_version: int


def validate_request(
    input_ids: Sequence[Sequence[int]],
    score_from: int | Sequence[int],
    temperature: float | Sequence[float],
    *,
    vocab_size: int,
    max_tokens: int,
) -> tuple[list[int], list[float]]:
    """Checks a request before any device work; returns score_from and temperature as one value per sequence.

    Raises ValueError naming the field, the sequence index and the value.
    """
    n = len(input_ids)
    starts = list(score_from) if isinstance(score_from, Sequence) else [score_from] * n
    temps = list(temperature) if isinstance(temperature, Sequence) else [temperature] * n
    if len(starts) != n:
        raise ValueError(f"score_from has {len(starts)} entries for {n} sequences")
    if len(temps) != n:
        raise ValueError(f"temperature has {len(temps)} entries for {n} sequences")
    for i, seq in enumerate(input_ids):
        length = len(seq)
        if length == 0:
            raise ValueError(f"input_ids[{i}] is empty")
        if length > max_tokens:
            raise ValueError(f"input_ids[{i}] has {length} tokens, over max_tokens_per_batch = {max_tokens}")
        ids = np.asarray(seq)
        if ids.dtype.kind not in "iu":
            raise ValueError(f"input_ids[{i}] must hold integer token ids, got dtype {ids.dtype}")
        bad = (ids < 0) | (ids >= vocab_size)
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(f"input_ids[{i}][{k}] = {int(ids[k])} is outside the vocabulary [0, {vocab_size})")
        s = starts[i]
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 1 <= s <= length:
            raise ValueError(f"score_from[{i}] = {s!r} must be an integer in [1, {length}] (len(input_ids[{i}]))")
        t = temps[i]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
            raise ValueError(f"temperature[{i}] = {t!r} must be a positive finite number")
    return [int(s) for s in starts], [float(t) for t in temps]


def pack_sequences(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Rows of sequence indices, each row at most max_tokens tokens (first fit, longest first)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(max_tokens - lengths[i])
    return rows


def bucket_length(tokens: int, limit: int) -> int:
    """The least of 256 * 2^k and 384 * 2^k that holds `tokens` (at most 1.5x it), capped at `limit`."""
    size = 256
    while size < tokens:
        size = size * 3 // 2 if (size & (size - 1)) == 0 else size * 4 // 3
    return min(size, max(limit, tokens))


def restored(restore: dict, **load_options) -> tuple[torch.nn.Module, int | None]:
    """A restarted worker's model and weights version: from its pool's current checkpoint while that exists; else
    built from the model's config and read from the local copy; else without weights (version None) until its
    owner streams them from a live peer."""
    path, keep, version = restore.get("path"), restore.get("keep"), restore["version"]
    if path == "tiny" or (path and os.path.isdir(path)):
        try:
            return load_model(path, **load_options), version
        except OSError:  # deleted meanwhile
            log.warning("checkpoint %s is gone", path)
    model = load_model("", config=restore["config"], **load_options)
    if keep and os.path.isdir(keep):
        read_checkpoint(model, keep).commit(model)
        return model, version
    return model, None


class LogProbWorker(WeightsHolder):
    """Holds a patched causal LM (see `load_model`) and scores token sequences with it.

    `restore`: for an actor that Ray restarted, where its pool's current weights are instead of `model` (see
    WeightOwner.restore_spec and `restored`). `keep_dir`: keep a local copy of the weights served there (see
    weights/keep.py).
    """

    def __init__(
        self, model: str = "tiny", *, max_tokens_per_batch: int = 16384, row_buckets: bool | None = None,
        restore: dict | None = None, keep_dir: str | None = None, **load_options,
    ) -> None:
        if max_tokens_per_batch < 1:
            raise ValueError(f"max_tokens_per_batch must be positive, got {max_tokens_per_batch}")
        self.device = load_options.pop("device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
        self.weights_version: int | None = 0
        if restore is None:
            self.model = load_model(model, device=self.device, **load_options)
        else:
            self.model, self.weights_version = restored(restore, device=self.device, **load_options)
        self._init_weights(keep_dir)
        self.max_tokens_per_batch = max_tokens_per_batch
        # On CUDA, packed rows run compiled flex_attention, compiled once per row length: rows are padded up
        # to a few bucket lengths so that the kernels compile a handful of times, not once per request.
        self.row_buckets = str(self.device).startswith("cuda") if row_buckets is None else row_buckets
        self.stats = dict(rows=0, max_row_tokens=0, oom_splits=0)

    def info(self) -> dict:
        node = None
        try:
            import ray

            if ray.is_initialized():
                node = ray.get_runtime_context().get_node_id()
        except ImportError:
            pass
        return dict(
            node_id=node,
            vocab_size=self.model.config.vocab_size,
            device=str(self.device),
            weights_version=self.weights_version,
            max_tokens_per_batch=self.max_tokens_per_batch,
            pid=os.getpid(),
            **self.stats,
        )

    health = info

    def config(self) -> dict:
        return self.model.config.to_dict()

    @torch.no_grad()
    def score(
        self,
        input_ids: Sequence[Sequence[int]],
        score_from: int | Sequence[int] = 1,
        temperature: float | Sequence[float] = 1.0,
        return_entropy: bool = True,
    ) -> list[SequenceScores]:
        """Scores every sequence; results in the order given."""
        if self.weights_version is None:
            raise WeightsUnavailable("this worker was restarted and has not got its weights back yet")
        starts, temps = validate_request(
            input_ids, score_from, temperature,
            vocab_size=self.model.config.vocab_size, max_tokens=self.max_tokens_per_batch,
        )
        seqs = [torch.as_tensor(np.asarray(s), dtype=torch.long) for s in input_ids]
        lengths = [len(s) for s in seqs]
        results: list[SequenceScores | None] = [None] * len(seqs)
        limit = self.max_tokens_per_batch
        queue = [(row, limit) for row in pack_sequences(lengths, limit)]  # a row and the most it may be padded to
        while queue:
            row, limit = queue.pop()
            sizes = [lengths[i] for i in row]
            size = bucket_length(sum(sizes), limit) if self.row_buckets else sum(sizes)
            try:
                self._score_row(row, size, seqs, starts, temps, return_entropy, results)
            except torch.OutOfMemoryError:
                if size == max(sizes):  # one sequence, unpadded: nothing left to split
                    raise
                torch.cuda.empty_cache()
                self.stats["oom_splits"] += 1
                half = max(max(sizes), size // 2)  # less than size, so this ends
                log.warning("out of memory on a row of %d tokens; retrying in rows of at most %d", size, half)
                queue.extend(([row[j] for j in part], half) for part in pack_sequences(sizes, half))
        return results  # type: ignore[return-value]

    def _score_row(self, row, size, seqs, starts, temps, return_entropy, results) -> None:
        pad = size - sum(len(seqs[i]) for i in row)
        # padding is a trailing sequence of its own (positions from 0), unscored and unseen by the real tokens
        ids = torch.cat([seqs[i] for i in row] + [torch.zeros(pad, dtype=torch.long)])[None]  # [1, T]
        positions = torch.cat([torch.arange(len(seqs[i])) for i in row] + [torch.arange(pad)])[None]
        temperature = torch.cat([torch.full((len(seqs[i]),), temps[i]) for i in row] + [torch.ones(pad)])[None]
        out = self._forward(ids.to(self.device), positions.to(self.device), temperature.to(self.device))
        log_probs = out.log_probs[0].cpu().numpy()
        entropy = out.entropy[0].cpu().numpy() if return_entropy else None
        self.stats["rows"] += 1
        self.stats["max_row_tokens"] = max(self.stats["max_row_tokens"], ids.shape[1])
        offset = 0
        for i in row:
            # entry k scores token offset + s + k, predicted at position offset + s + k - 1
            span = slice(offset + starts[i] - 1, offset + len(seqs[i]) - 1)
            results[i] = SequenceScores(
                log_probs=log_probs[span].copy(),
                entropy=entropy[span].copy() if entropy is not None else None,
                weights_version=self.weights_version,
            )
            offset += len(seqs[i])

    def _forward(self, input_ids, position_ids, temperature):
        return self.model(input_ids=input_ids, position_ids=position_ids, temperature=temperature)

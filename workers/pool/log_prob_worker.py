"""LogProbWorker: one patched model on one device, scoring batches of token sequences.

A plain class (tests build it without Ray); `WorkerPool` turns it into Ray actors. A request (a ScoreRequest) is
packed into rows of at most `max_tokens_per_batch` tokens (several sequences per row, position_ids restarting at
0, no padding), each row is one forward, and results come back in request order. On CUDA out-of-memory a row is
split in half and retried. Per-sequence work is vectorised, so many short sequences cost about what their tokens do.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import TooLarge, WeightsUnavailable
from ..models import load_model
from ..request import ScoreRequest, ScoreResult, SequenceScores, ragged_index
from ..weights.checkpoint import read_checkpoint
from ..weights.holder import WeightsHolder

log = logging.getLogger(__name__)

__all__ = ["LogProbWorker", "SequenceScores", "bucket_length", "pack_rows"]


def pack_rows(lengths: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Rows of sequence indices, each row at most max_tokens tokens: first fit, longest first. Sequences of one
    length are placed together, so the work grows with the number of distinct lengths, not of sequences."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    runs = np.split(order, np.flatnonzero(np.diff(lengths[order])) + 1)
    rows: list[list[np.ndarray]] = []
    room: list[int] = []
    for run in runs:
        if not run.size:
            continue
        length, i = int(lengths[run[0]]), 0
        for r in range(len(rows)):
            k = min(room[r] // length, run.size - i)
            if k > 0:
                rows[r].append(run[i : i + k])
                room[r] -= k * length
                i += k
            if i == run.size:
                break
        while i < run.size:
            k = min(max(max_tokens // length, 1), run.size - i)
            rows.append([run[i : i + k]])
            room.append(max_tokens - k * length)
            i += k
    return [np.concatenate(parts) for parts in rows]


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

    def score(
        self,
        input_ids: Sequence[Sequence[int]],
        score_from: int | Sequence[int] = 1,
        temperature: float | Sequence[float] = 1.0,
        return_entropy: bool = True,
    ) -> list[SequenceScores]:
        """Scores plain lists (validated here, RequestError naming the sequence); results in the order given."""
        request = ScoreRequest.build(input_ids, score_from, temperature, return_entropy,
                                     vocab_size=self.model.config.vocab_size, max_length=self.max_tokens_per_batch)
        return self.score_request(request).sequences()

    @torch.no_grad()
    def score_request(self, request: ScoreRequest) -> ScoreResult:
        """Scores a validated request (the pool's and the gateway's path)."""
        if self.weights_version is None:
            raise WeightsUnavailable("this worker was restarted and has not got its weights back yet")
        lengths, scored = request.lengths, request.scored
        offsets = np.zeros(len(request) + 1, dtype=np.int64)
        np.cumsum(scored, out=offsets[1:])
        log_probs = np.empty(offsets[-1], dtype=np.float32)
        entropy = np.empty(offsets[-1], dtype=np.float32) if request.return_entropy else None
        limit = self.max_tokens_per_batch
        queue = [(row, limit) for row in pack_rows(lengths, limit)]  # a row and the most it may be padded to
        while queue:
            row, limit = queue.pop()
            sizes = lengths[row]
            size = bucket_length(int(sizes.sum()), limit) if self.row_buckets else int(sizes.sum())
            try:
                self._score_row(request, row, size, offsets, log_probs, entropy)
            except torch.OutOfMemoryError:
                if size == sizes.max():  # one sequence, unpadded: nothing left to split
                    raise TooLarge(
                        f"a sequence of {size} tokens does not fit in a worker's memory; send shorter sequences"
                    ) from None
                torch.cuda.empty_cache()
                self.stats["oom_splits"] += 1
                half = max(int(sizes.max()), size // 2)  # less than size, so this ends
                log.warning("out of memory on a row of %d tokens; retrying in rows of at most %d", size, half)
                queue.extend((row[part], half) for part in pack_rows(sizes, half))
        return ScoreResult(log_probs, entropy, offsets, self.weights_version)

    def _score_row(self, request: ScoreRequest, row: np.ndarray, size: int, offsets: np.ndarray,
                   log_probs: np.ndarray, entropy: np.ndarray | None) -> None:
        lengths, starts = request.lengths[row], request.score_from[row]
        real = int(lengths.sum())  # padding up to size is a trailing sequence of its own, unscored and unseen
        begin = np.cumsum(lengths) - lengths  # where each sequence starts in the row
        ids = np.zeros(size, dtype=np.int64)
        ids[:real] = request.tokens[ragged_index(request.offsets[row], lengths)]
        positions = np.arange(size, dtype=np.int64)
        positions[:real] -= np.repeat(begin, lengths)
        positions[real:] -= real
        temperature = np.ones(size, dtype=np.float32)
        temperature[:real] = np.repeat(request.temperature[row], lengths)
        out = self._forward(*(torch.from_numpy(a)[None].to(self.device) for a in (ids, positions, temperature)))
        # entry k of sequence i scores token begin + s + k, predicted at position begin + s + k - 1
        src = ragged_index(begin + starts - 1, lengths - starts)
        dst = ragged_index(offsets[:-1][row], lengths - starts)
        log_probs[dst] = out.log_probs[0].cpu().numpy()[src]
        if entropy is not None:
            entropy[dst] = out.entropy[0].cpu().numpy()[src]
        self.stats["rows"] += 1
        self.stats["max_row_tokens"] = max(self.stats["max_row_tokens"], size)

    def _forward(self, input_ids, position_ids, temperature):
        return self.model(input_ids=input_ids, position_ids=position_ids, temperature=temperature)

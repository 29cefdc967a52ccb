"""LogProbWorker: one patched model on one device, scoring batches of token sequences.

A plain class (tests build it without Ray); `WorkerPool` turns it into Ray actors. A request (a ScoreRequest) is
cut into forwards of at most `max_tokens_per_batch` tokens, laid out one of two ways:
- "packed" (CUDA's default): several sequences per row, position_ids restarting at 0, no padding; rows attend
  through varlen attention (flex_attention where it does not apply), so a row costs what its sequences cost alone.
- "padded" (the CPU's default): a batch of sequences of similar lengths (within 1.5x), right-padded. Without a
  kernel that skips masked blocks, attention over a packed row costs (row length)^2, however short its sequences.
Results come back in request order. On CUDA out-of-memory a forward is split in half and retried. Per-sequence
work is vectorised, so many short sequences cost about what their tokens do.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Literal, Unpack

import numpy as np
import torch

from ..errors import CheckpointNotFound, InvalidCheckpoint, TooLarge, WeightsUnavailable
from ..models import load_model, varlen_attention
from ..models.graphs import use_graphs
from ..models.patch_model import packed_attention_of
from ..models.varlen_attention import Keys, Pieces
from ..outputs import asked
from ..prefixes import MIN_SHARED_PREFIX, Forest, forest, row_plan
from ..request import (
    MAX_TOKENS_PER_BATCH,
    ScoreRequest,
    ScoreResult,
    ScoringOptions,
    SequenceScores,
    ragged_index,
)
from ..sharding import held_shard
from ..weights.checkpoint import read_checkpoint
from ..weights.holder import WeightsHolder

log = logging.getLogger(__name__)

__all__ = ["LogProbWorker", "SequenceScores", "bucket_length", "pack_rows", "pad_batches"]
Layout = Literal["packed", "padded"]


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


def pad_batches(lengths: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Batches of sequence indices of similar lengths, each at most max_tokens tokens counting its padding (count x
    longest). A sequence goes with the others whose length rounds up to the same one of 2^k and 1.5 * 2^k."""
    lengths = np.asarray(lengths, dtype=np.int64)
    power = 2 ** np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64)
    key = np.where(lengths == power, power, np.where(2 * lengths <= 3 * power, 3 * power // 2, 2 * power))
    order = np.lexsort((lengths, key))
    batches = []
    for k in np.unique(key):
        members = order[key[order] == k]
        per = max(1, max_tokens // int(k))
        batches.extend(members[i : i + per] for i in range(0, members.size, per))
    return batches


def bucket_length(tokens: int, limit: int) -> int:
    """The least of 256 * 2^k and 384 * 2^k that holds `tokens` (at most 1.5x it), capped at `limit`."""
    size = 256
    while size < tokens:
        size = size * 3 // 2 if (size & (size - 1)) == 0 else size * 4 // 3
    return min(size, max(limit, tokens))


def gpu_uuid(device) -> str | None:
    """The GPU's UUID (the same in every process, however CUDA_VISIBLE_DEVICES numbers it); None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device.index or 0).uuid)


def restored(restore: dict, **load_options) -> tuple[torch.nn.Module, int | None]:
    """A restarted worker's model and weights version: from its pool's current checkpoint while that exists; else
    built from the model's config and read from the local copy; else without weights (version None) until its
    owner streams them from a live peer."""
    path, keep, version = restore.get("path"), restore.get("keep"), restore["version"]
    if path == "tiny" or (path and os.path.isdir(path)):
        try:
            return load_model(path, **load_options), version
        except (OSError, CheckpointNotFound, InvalidCheckpoint):  # deleted meanwhile
            log.warning("checkpoint %s is gone", path)
    model = load_model("", config=restore["config"], **load_options)
    if keep and os.path.isdir(keep):
        read_checkpoint(model, keep).commit(model)
        return model, version
    return model, None


class LogProbWorker:
    """Holds a patched causal LM (see `load_model`; or a model already patched, given as `model`) and scores token
    sequences with it; its weights and their version are `weights` (a WeightsHolder: updates, local copies).

    `restore`: for an actor that Ray restarted, where its pool's current weights are instead of `model` (see
    WeightOwner.restore_spec and `restored`). `keep_dir`, `keep_streams`, `on_kept`: the holder's local copy.
    `room`: wraps each forward, given its cost in tokens (a tensor-parallel worker's ranks agree on memory there).
    `cuda_graphs`: the body of a forward replayed from CUDA graphs where it can be (models/graphs.py; a forward of a
    few thousand tokens launches in ~5 ms instead of ~30), captured at start-up.
    """

    def __init__(
        self, model: str | torch.nn.Module = "tiny", *, max_tokens_per_batch: int = MAX_TOKENS_PER_BATCH,
        layout: Layout | None = None, row_buckets: bool | None = None, restore: dict | None = None,
        keep_dir: str | None = None, keep_streams: bool = False, on_kept: Callable[[int, str], None] | None = None,
        min_shared_prefix: int | None = MIN_SHARED_PREFIX, cuda_graphs: bool = True, **load_options,
    ) -> None:
        if max_tokens_per_batch < 1:
            raise ValueError(f"max_tokens_per_batch must be positive, got {max_tokens_per_batch}")
        if min_shared_prefix is not None and min_shared_prefix < 1:
            raise ValueError(f"min_shared_prefix must be positive (or None: no sharing), got {min_shared_prefix}")
        # a model given as a module runs where it is; one to load, on the GPU where there is one
        here = str(next(model.parameters()).device) if isinstance(model, torch.nn.Module) else None
        self.device = load_options.pop("device", None) or here or ("cuda" if torch.cuda.is_available() else "cpu")
        version: int | None = 0
        if isinstance(model, torch.nn.Module):
            self.model = model
        elif restore is None:
            self.model = load_model(model, device=self.device, **load_options)
        else:
            self.model, version = restored(restore, device=self.device, **load_options)
        self.weights = WeightsHolder(self.model, version, keep_dir=keep_dir, keep_streams=keep_streams,
                                     on_kept=on_kept)
        self.room: Callable[[int], AbstractContextManager] = lambda tokens: nullcontext()
        self.max_tokens_per_batch = max_tokens_per_batch
        self.cuda = cuda = str(self.device).startswith("cuda")
        self.layout: Layout = layout or ("packed" if cuda else "padded")
        # Where packed rows run compiled flex_attention (CUDA without varlen attention), it compiles once per row
        # length: rows are padded up to a few bucket lengths so that it compiles a handful of times, not per request.
        flex = packed_attention_of(self.model, torch.device(self.device)) == "flex"
        self.row_buckets = flex if row_buckets is None else row_buckets
        # sequences sharing a prefix of at least this many tokens compute it once (prefixes.py): packed rows
        # attending through varlen attention (or the CPU's reference of it), where the model's attention allows it
        # and every packed row goes as pieces (its sequences' bounds and labels from here, so that a forward waits
        # for nothing on the device and the next can be launched while it runs)
        self.pieces = self.layout == "packed" and not flex and varlen_attention.model_allows(self.model) is None
        self.min_shared_prefix = min_shared_prefix if self.pieces else None
        # rows in pieces without shared keys replay the body as CUDA graphs (models/graphs.py), where it can be
        self.graphs = use_graphs(self.model, max_tokens_per_batch) if cuda and self.pieces and cuda_graphs else None
        self.stats = dict(calls=0, tokens=0, computed_tokens=0, rows=0, max_row_tokens=0, oom_splits=0)
        self.scoring = 0
        if cuda and held_shard(self.model) is None:  # (a rank warms up once in its group)
            self.warm_up()

    @property
    def weights_version(self) -> int | None:
        return self.weights.version

    def update_weights(self, weights: dict | str | os.PathLike, version: int, *,
                       allow_non_finite: bool = False) -> int:
        """See WeightsHolder.update_weights."""
        return self.weights.update_weights(weights, version, allow_non_finite=allow_non_finite)

    @torch.no_grad()
    def warm_up(self) -> None:
        """Compiles the Triton kernels (head, norms, rotary, MLP, attention) at start-up, not in the first requests'
        time: a packed row of two short sequences, then (with weights) requests as they come, with and without
        entropy, whose token and scored counts are and are not multiples of 16 (Triton compiles for each) and one
        scored entry, beside a group sharing a prompt; then the body's CUDA graphs, one per bucket of row length."""
        ids = torch.zeros(1, 64, dtype=torch.long, device=self.device)
        positions = torch.arange(32, device=self.device).repeat(2)[None]
        for entropy in (True, False):
            self._forward(input_ids=ids, position_ids=positions, temperature=torch.ones(1, 64, device=self.device),
                          scored=torch.arange(8, device=self.device), compute_entropy=entropy)
        if self.weights_version is None:
            return
        asks = [[[2] * 129], [[2] * 144], [[2] * 2], [[2] * 40, [3] * 41]]
        if self.min_shared_prefix:
            asks.append([[1] * self.min_shared_prefix + [4], [1] * self.min_shared_prefix + [5, 6]])
        for seqs in (s for s in asks if max(map(len, s)) <= self.max_tokens_per_batch):
            for entropy in (True, False):
                self.score_request(self.request(seqs, return_entropy=entropy))
        if self.graphs is not None:
            self.graphs.capture_all()
        self.stats.update(calls=0, tokens=0, computed_tokens=0, rows=0, max_row_tokens=0)

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
            gpu=gpu_uuid(self.device),
            weights_version=self.weights_version,
            max_tokens_per_batch=self.max_tokens_per_batch,
            min_shared_prefix=self.min_shared_prefix,
            pid=os.getpid(),
            scoring=self.scoring,
            cuda_graphs=len(self.graphs.graphs) if self.graphs else 0,  # (captured: models/graphs.py)
            graph_replays=self.graphs.replays if self.graphs else 0,
            **self.stats,
        )

    health = info

    def devices(self) -> list[str]:
        """Where this worker computes: its GPU's UUID, or its device off CUDA (tensor parallelism: each rank's)."""
        return [gpu_uuid(self.device) or str(self.device)]

    def config(self) -> dict:
        """The model's config, as its pool saves it to rebuild a restarted worker (a tensor-parallel rank's: that of
        the whole model, whose head may have been tied before the cut)."""
        config = self.model.config.to_dict()
        if (shard := held_shard(self.model)) is not None and shard.tied:
            config["tie_word_embeddings"] = True
        return config

    def score(self, input_ids: Sequence[Sequence[int]], score_from: int | Sequence[int] = 1,
              **options: Unpack[ScoringOptions]) -> list[SequenceScores]:
        """Scores plain lists (validated here, RequestError naming the sequence); results in the order given. Entry k
        of a result is log p(seq[s + k] | seq[:s + k]) for s = score_from (one int, or one per sequence); `options`:
        temperature, return_entropy, top_k, token_ids (request.ScoringOptions)."""
        request = self.request(input_ids, score_from, **options)
        return self.score_request(request).sequences(request.candidate_counts())

    def request(self, input_ids: Sequence[Sequence[int]], score_from: int | Sequence[int] = 1,
                **options: Unpack[ScoringOptions]) -> ScoreRequest:
        """Plain lists as a validated ScoreRequest for this model (RequestError naming the sequence)."""
        return ScoreRequest.build(input_ids, score_from, **options, vocab_size=self.model.config.vocab_size,
                                  max_length=self.max_tokens_per_batch)

    def score_request(self, request: ScoreRequest) -> ScoreResult:
        """Scores a validated request (the pool's and the gateway's path)."""
        return self.start(request)()

    def start(self, request: ScoreRequest) -> Callable[[], ScoreResult]:
        """Launches a validated request's forwards and returns what waits for them and gives its result: on CUDA the
        caller may prepare and launch more meanwhile (the worker's scheduler launches its next step before it
        collects this one), since nothing here waits for the device until then. `scoring` counts the requests
        started and not yet collected (info() reports it; a test kills a worker once it is)."""
        self.scoring += 1
        try:
            collect = self._start(request)
        except BaseException:
            self.scoring -= 1
            raise

        def finish() -> ScoreResult:
            try:
                return collect()
            finally:
                self.scoring -= 1

        return finish

    @torch.no_grad()
    def _start(self, request: ScoreRequest) -> Callable[[], ScoreResult]:
        if self.weights_version is None:
            raise WeightsUnavailable("this worker was restarted and has not got its weights back yet")
        version, lengths = self.weights_version, request.lengths
        self.stats["calls"] += 1
        self.stats["tokens"] += int(request.offsets[-1])
        offsets = request.result_offsets()
        outputs = dict(log_probs=np.empty(offsets[-1], dtype=np.float32))  # by the name of the forward's output
        if request.return_entropy:
            outputs["entropy"] = np.empty(offsets[-1], dtype=np.float32)
        candidates = 0 if request.token_ids is None else request.token_ids.shape[1]
        for output, width in asked(request.top_k, candidates).items():  # (the per-token outputs' table)
            outputs[output.name] = output.empty(int(offsets[-1]), width)
        computed = lengths.astype(np.float64)  # (shared rows say less)
        limit = self.max_tokens_per_batch
        # (sequences, the most their forward may cost, whether they may share a prefix)
        queue = [(group, limit, shares) for group, shares in self._split(request, np.arange(len(request)), limit)]
        launched = []
        while queue:
            group, limit, shares = queue.pop()
            sizes = lengths[group]
            try:
                launched.append(self._launch_group(request, group, limit, offsets, outputs, shares))
            except torch.OutOfMemoryError:
                cost = self._row_cost(request, group, limit)
                if len(group) == 1 and cost == sizes.max():  # one sequence, unpadded: nothing left to split
                    raise TooLarge(
                        f"a sequence of {cost} tokens does not fit in a worker's memory; send shorter sequences"
                    ) from None
                torch.cuda.empty_cache()
                self.stats["oom_splits"] += 1
                half = max(int(sizes.max()), cost // 2)  # less than cost, so this ends
                log.warning("out of memory on a forward of %d tokens; retrying with at most %d", cost, half)
                queue.extend((part, half, shares) for part, shares in self._split(request, group, half))

        def collect() -> ScoreResult:
            for (dst, take, shares), results, done in launched:
                if done is not None:
                    done.synchronize()
                for name, values in outputs.items():
                    values[dst] = results[name].numpy()[take]
                if shares is not None:
                    computed[list(shares)] = list(shares.values())
            results = dict(outputs)
            return ScoreResult(results.pop("log_probs"), results.pop("entropy", None), offsets, version, computed,
                               results)

        return collect

    def _shares(self, request: ScoreRequest) -> bool:
        """Whether sequences sharing a prefix compute it once here: sharing is on, and every sequence asks for the
        same candidates, if any (a shared position is scored once for all its sequences)."""
        ids = request.token_ids
        return self.min_shared_prefix is not None and (ids is None or bool((ids == ids[:1]).all()))

    def _split(self, request: ScoreRequest, group: np.ndarray, limit: int) -> list[tuple[np.ndarray, bool]]:
        """These sequences (request indices) in forwards of at most `limit` tokens computed, each with whether its
        sequences may share a prefix (where none of these does, no part of them can: its forest is not built
        again); sequences that share a prefix go together (a group too large for one splits in two, each still
        sharing)."""
        lengths = request.lengths[group]
        if self.layout == "padded":
            return [(group[b], False) for b in pad_batches(lengths, limit)]
        trees = forest(request, group, self.min_shared_prefix) if self._shares(request) else None
        if trees is None or not trees.shared:
            return [(group[r], False) for r in pack_rows(lengths, limit)]
        units, todo = [], [trees]
        while todo:
            trees = todo.pop()
            for members, cost in trees.roots():
                if cost > limit and len(members) > 1:  # in two halves, in their order (sorted): each still shares
                    half = len(members) // 2
                    todo += [forest(request, part, self.min_shared_prefix) for part in (members[:half], members[half:])]
                else:
                    units.append((members, cost))
        rows = pack_rows(np.array([cost for _, cost in units], dtype=np.int64), limit)
        return [(np.concatenate([units[u][0] for u in row]), True) for row in rows]

    def _row_cost(self, request: ScoreRequest, group: np.ndarray, limit: int) -> int:
        """Tokens one forward of these sequences computes, shared prefixes once, padding included."""
        if self._shares(request) and (trees := forest(request, group, self.min_shared_prefix)).shared:
            return trees.tokens
        return self.cost(request.lengths[group], limit)

    def cost(self, lengths: np.ndarray, limit: int) -> int:
        """Tokens one forward of these sequences computes, padding included."""
        if self.layout == "padded":
            return len(lengths) * int(lengths.max())
        return bucket_length(int(lengths.sum()), limit) if self.row_buckets else int(lengths.sum())

    def _launch_group(self, request: ScoreRequest, group: np.ndarray, limit: int, offsets: np.ndarray,
                      outputs: dict[str, np.ndarray],
                      shares: bool) -> tuple[tuple, dict[str, torch.Tensor], torch.cuda.Event | None]:
        """Launches one forward of these sequences: where its entries go (see _group_inputs), its outputs (those
        named in `outputs`) on their way to the host, and the event after which they are there (None off CUDA)."""
        inputs, where, cost = self._group_inputs(request, group, limit, offsets, shares)
        with self.room(cost):
            out = self._forward(**inputs, compute_entropy="entropy" in outputs, top_k=request.top_k)
        results = {name: getattr(out, name).to("cpu", non_blocking=self.cuda) for name in outputs}
        done = None
        if self.cuda:
            done = torch.cuda.Event()
            done.record()
        self.stats["rows"] += 1
        self.stats["computed_tokens"] += cost
        self.stats["max_row_tokens"] = max(self.stats["max_row_tokens"], cost)
        return where, results, done

    def log_probs_with_grad(
        self,
        input_ids: Sequence[Sequence[int]],
        score_from: int | Sequence[int] = 1,
        temperature: float | Sequence[float] = 1.0,
        return_entropy: bool = False,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """A trainer's side of score(): per sequence, its log-probs (and entropies) as tensors that carry gradients
        to the model's parameters, from the forwards score() runs (same layout, kernels and row limit). In the
        invariant mode they are the bits a worker serving the same weights returns for these sequences, however
        the worker's call was made up (on a GPU; on the CPU only when it scored exactly this batch: docs/trainers.md,
        "Using it from a PPO trainer")."""
        request = self.request(input_ids, score_from, temperature=temperature, return_entropy=return_entropy)
        offsets = request.result_offsets()
        log_probs, entropy, where = [], [], []
        for group, shares in self._split(request, np.arange(len(request)), self.max_tokens_per_batch):
            inputs, (dst, take, _), _ = self._group_inputs(request, group, self.max_tokens_per_batch, offsets, shares)
            out = self._forward(**inputs, compute_entropy=return_entropy)
            take = torch.from_numpy(take).to(self.device)
            log_probs.append(out.log_probs[take])
            entropy.append(None if out.entropy is None else out.entropy[take])
            where.append(dst)
        order = torch.from_numpy(np.argsort(np.concatenate(where))).to(self.device)  # back to request order

        def per_sequence(parts: list[torch.Tensor]) -> list[torch.Tensor]:
            return list(torch.cat(parts)[order].split(request.scored.tolist()))

        return per_sequence(log_probs), per_sequence(entropy) if return_entropy else None

    def _group_inputs(self, request: ScoreRequest, group: np.ndarray, limit: int, offsets: np.ndarray,
                      shares: bool) -> tuple[dict, tuple, int]:
        """One forward's inputs for these sequences (on the device), where its results
        go in the request's flat results (whose sequence starts are `offsets`): entry dst[i] takes the forward's
        result take[i]; each sequence's part of the tokens computed, where prefixes are shared (else None); and its
        cost in tokens. Sequences sharing a prefix are laid out in pieces (prefixes.py), where `shares` (_split's)
        says they may."""
        if shares:
            trees = forest(request, group, self.min_shared_prefix)
            if trees.shared:
                return self._pieces_inputs(request, trees, offsets)
        lengths, starts = request.lengths[group], request.score_from[group]
        cost = self.cost(lengths, limit)
        width = int(lengths.max()) if self.layout == "padded" else cost
        at = np.arange(len(group)) * width if self.layout == "padded" else np.cumsum(lengths) - lengths
        real = ragged_index(at, lengths)  # where each token goes in the flattened [rows, width] input
        ids = np.zeros(cost, dtype=np.int64)
        ids[real] = request.tokens[ragged_index(request.offsets[group], lengths)]
        temperature = np.ones(cost, dtype=np.float32)
        temperature[real] = np.repeat(request.temperature[group], lengths)
        inputs = dict(input_ids=ids, temperature=temperature)
        if self.layout == "padded":
            mask = np.zeros(cost, dtype=np.int64)
            mask[real] = 1
            inputs["attention_mask"] = mask
        else:  # padding is a trailing sequence of its own (positions from 0), unscored and unseen by real tokens
            positions = np.arange(cost, dtype=np.int64)
            positions[real] -= np.repeat(at, lengths)
            positions[real.size :] -= real.size
            inputs["position_ids"] = positions
        # entry k of sequence i scores token at + s + k, predicted at position at + s + k - 1: only those positions
        # reach the head (a prompt's positions cost no head GEMM)
        src = ragged_index(at + starts - 1, lengths - starts)
        dst = ragged_index(offsets[:-1][group], lengths - starts)
        made = {k: self._to_device(v).view(-1, width) for k, v in inputs.items()}
        made["scored"] = self._to_device(src)
        if self.pieces:  # (what the model would find on the device from positions and ids)
            cu = np.concatenate([at, [cost]]).astype(np.int32)
            made.update(pieces=Pieces(self._to_device(cu), int(lengths.max()), None),
                        scored_labels=self._to_device(ids[src + 1]),
                        scored_temperature=self._to_device(temperature[src]))
            del made["temperature"]
        if request.token_ids is not None:  # each scored position its sequence's candidates
            made["token_ids"] = self._to_device(np.repeat(request.token_ids[group], lengths - starts, axis=0))
        return made, (dst, np.arange(dst.size), None), cost

    def _to_device(self, x: np.ndarray) -> torch.Tensor:
        """x on the worker's device; on CUDA through pinned memory, so that the copy waits for nothing queued (taken
        from torch's pool of it: `pin_memory()` first asks CUDA about the pointer, ~0.3 ms a call on an H200)."""
        tensor = torch.from_numpy(x)
        if not self.cuda:
            return tensor.to(self.device)
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor).to(self.device,
                                                                                              non_blocking=True)

    def _pieces_inputs(self, request: ScoreRequest, trees: Forest, offsets: np.ndarray) -> tuple[dict, tuple, int]:
        """_group_inputs for a row of shared prefixes: its pieces, and each distinct (position, label, temperature)
        scored once."""
        plan = row_plan(request, trees, offsets)
        device = self._to_device
        lengths_k = np.diff(plan.cu_k)
        pieces = Pieces(device(plan.cu_q), int(np.diff(plan.cu_q).max()),
                        Keys(device(plan.kv_index), device(plan.cu_k), int(lengths_k.max())))
        inputs = dict(input_ids=device(plan.ids)[None], position_ids=device(plan.positions)[None],
                      scored=device(plan.scored), scored_labels=device(plan.labels),
                      scored_temperature=device(plan.temperature), pieces=pieces)
        if request.token_ids is not None:  # (one set for every sequence: see _shares)
            inputs["token_ids"] = device(request.token_ids[0])
        return inputs, (plan.dst, plan.take, trees.shares()), trees.tokens

    def _forward(self, **inputs):
        # (the request was validated where it came in)
        return self.model(**inputs, checked_inputs=True, body_graphs=self.graphs)

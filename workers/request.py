"""The one request type from the edge to the GPU, and its result: ragged batches held as flat numpy arrays.

A ScoreRequest is built and validated once (by the gateway's route, or by WorkerPool / LogProbWorker for a caller
with plain lists) and then travels unchanged: cut into worker calls, joined with other requests, shared between
workers. Nothing on the way costs Python work per token; per-sequence work is vectorised.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import TYPE_CHECKING, Generic, TypedDict, TypeVar

import numpy as np

from .errors import RequestError, TooLarge, WeightsChanged, clip
from .outputs import OUTPUTS

# Temperatures outside this range are refused: far below it the scaled logits overflow fp32 (NaN), far above it
# every distribution is uniform to fp32 precision.
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 1e2
MAX_TOP_K = 256  # the widest top-k (the fused head's; services may set less)
MAX_TOKEN_IDS = 1024  # candidate ids in one list
# A worker's forward by default, and so the longest sequence: 132 x 128 tokens. A full row is then 132 of the body's
# 128-row tiles (workers/models/hopper_gated.py), so each of its GEMMs is whole waves on the 132 SMs of an H100 or
# H200 (rows of 16,384 leave the last wave of down and o 58% full; BENCHMARKS.md, 2026-12-07)
MAX_TOKENS_PER_BATCH = 16896


def _value(x) -> str:
    return clip(repr(x), 60)


_INT64 = (-(2**63), 2**63)


def _per_sequence(name: str, value, n: int, kind: type) -> np.ndarray:
    """One value per sequence from a scalar or a sequence of n; RequestError naming the entry that is not `kind`
    (or, for int, an integer beyond int64, named as given rather than wrapped)."""
    dtype = np.int64 if kind is int else np.float64
    ok = "iu" if kind is int else "iuf"
    scalar = isinstance(value, str) or not isinstance(value, (Sequence, np.ndarray)) or np.ndim(value) == 0
    if not scalar and len(value) != n:
        raise RequestError(f"{name} has {len(value)} entries for {n} sequences")
    values = np.asarray(value)
    if (values.dtype.kind not in ok or values.ndim != (0 if scalar else 1) or (kind is int and values.dtype.kind == "u")
            or _has_bools(value)):
        for i, v in enumerate([value] if scalar else value):
            where = name if scalar else f"{name}[{i}]"
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer, *(() if kind is int else
                                                                                         (float, np.floating)))):
                raise RequestError(f"{where} = {_value(v)} must be {'an integer' if kind is int else 'a number'}")
            if kind is int and not _INT64[0] <= int(v) < _INT64[1]:
                raise RequestError(f"{where} = {_value(v)} is out of range")
            if kind is float and isinstance(v, int) and not abs(v) < 2**1024:  # (beyond float64)
                raise RequestError(f"{where} = {_value(v)} is out of range")
    return np.full(n, values, dtype=dtype) if scalar else values.astype(dtype)


def _has_bools(values) -> bool:
    """Whether a list holds a bool (which numpy would take as 0 or 1 beside integers); one pass over its types."""
    return isinstance(values, list) and not set(map(type, values)).isdisjoint((bool, np.bool_))


def _lengths_and_tokens(input_ids) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(input_ids, (Sequence, np.ndarray)) or isinstance(input_ids, str) or len(input_ids) == 0:
        raise RequestError("input_ids must be a non-empty list of token lists")
    for i, seq in enumerate(input_ids):
        if (not isinstance(seq, (Sequence, np.ndarray)) or isinstance(seq, str)
                or isinstance(seq, np.ndarray) and seq.ndim != 1):
            raise RequestError(f"input_ids[{i}] = {_value(seq)} is not a list of token ids")
    lengths = np.fromiter((len(s) for s in input_ids), dtype=np.int64, count=len(input_ids))
    if all(isinstance(s, np.ndarray) for s in input_ids):
        tokens = np.concatenate([s.reshape(-1) for s in input_ids])
    else:
        flat = list(chain.from_iterable(input_ids))
        try:
            tokens = np.zeros((0, 0)) if _has_bools(flat) else np.asarray(flat)
        except (TypeError, ValueError):  # not a list of lists of scalars
            tokens = np.zeros((0, 0))
    if tokens.size and tokens.dtype.kind not in "iu" or tokens.ndim != 1 or (
            tokens.dtype.kind == "u" and tokens.size and tokens.max() >= _INT64[1]):
        for i, seq in enumerate(input_ids):
            for k, x in enumerate(seq):
                if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
                    raise RequestError(f"input_ids[{i}][{k}] = {_value(x)} is not a token id (an integer)")
                if not _INT64[0] <= int(x) < _INT64[1]:
                    raise RequestError(f"input_ids[{i}][{k}] = {_value(x)} is outside the vocabulary")
        raise RequestError("input_ids must be a list of lists of token ids")
    return lengths, tokens.astype(np.int64, copy=False)


class ScoringOptions(TypedDict, total=False):
    """What a scoring call may ask beside its sequences and where each is scored from: the keyword arguments of
    LogProbWorker.score, WorkerPool.compute_log_probs(_async) and both clients' score. ScoreRequest.build holds the
    defaults and checks every value (the field, the sequence and the value named in its error)."""

    temperature: float | Sequence[float]  # the logits are divided by it: one value, or one per sequence (1.0)
    return_entropy: bool  # each entry's entropy too (True)
    top_k: int  # each entry's k most likely tokens too, with the tail's mass (0: none)
    token_ids: Sequence[int] | Sequence[Sequence[int]] | None  # candidates whose log-probs each entry gives: one
    # list for every sequence, or one per sequence (None)


@dataclass(frozen=True)
class ScoreRequest:
    """Sequences to score, as one flat array of token ids with offsets."""

    tokens: np.ndarray  # int32 [total]: sequence i is tokens[offsets[i] : offsets[i + 1]]
    offsets: np.ndarray  # int64 [n + 1]
    score_from: np.ndarray  # int64 [n]: entry k of result i scores token score_from[i] + k
    temperature: np.ndarray  # float64 [n]
    return_entropy: bool = True
    top_k: int = 0  # each scored position's k most likely tokens too (and the tail's mass)
    token_ids: np.ndarray | None = None  # int64 [n, C]: candidates whose log-probs each position gives (-1: none)

    @classmethod
    def build(
        cls,
        input_ids: Sequence[Sequence[int]],
        score_from: int | Sequence[int] = 1,
        temperature: float | Sequence[float] = 1.0,
        return_entropy: bool = True,
        *,
        vocab_size: int,
        max_length: int,
        max_tokens: int | None = None,
        top_k: int = 0,
        token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        max_top_k: int = MAX_TOP_K,
        max_token_ids: int = MAX_TOKEN_IDS,
    ) -> ScoreRequest:
        """Checks everything once, before any device work. RequestError (or TooLarge, over max_length tokens in a
        sequence or max_tokens in the request) names the field, the sequence and the value. `token_ids`: candidate
        ids, one list for every sequence or one per sequence."""
        lengths, tokens = _lengths_and_tokens(input_ids)
        n = len(lengths)
        if (short := np.flatnonzero(lengths < 2)).size:
            i = int(short[0])
            k = int(lengths[i])
            raise RequestError(f"input_ids[{i}] has {k} token{'s' * (k != 1)}; scoring needs at least 2")
        if (long := np.flatnonzero(lengths > max_length)).size:
            i = int(long[0])
            raise TooLarge(f"input_ids[{i}] has {lengths[i]} tokens; this model takes at most {max_length}")
        if max_tokens is not None and tokens.size > max_tokens:
            raise TooLarge(f"the request has {tokens.size} tokens; the limit is {max_tokens} per request")
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if (bad := np.flatnonzero((tokens < 0) | (tokens >= vocab_size))).size:
            k = int(bad[0])
            i = int(np.searchsorted(offsets, k, side="right") - 1)
            raise RequestError(
                f"input_ids[{i}][{k - offsets[i]}] = {tokens[k]} is outside the vocabulary [0, {vocab_size})"
            )
        starts = _per_sequence("score_from", score_from, n, int)
        if (bad := np.flatnonzero((starts < 1) | (starts > lengths))).size:
            i = int(bad[0])
            raise RequestError(f"score_from[{i}] = {starts[i]} must be in [1, {lengths[i]}] (len(input_ids[{i}]))")
        temps = _per_sequence("temperature", temperature, n, float)
        ok = np.isfinite(temps) & (temps >= MIN_TEMPERATURE) & (temps <= MAX_TEMPERATURE)
        if (bad := np.flatnonzero(~ok)).size:
            i = int(bad[0])
            raise RequestError(
                f"temperature[{i}] = {temps[i].item()!r} must be a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]"
            )
        if not isinstance(return_entropy, (bool, np.bool_)):
            raise RequestError(f"return_entropy = {_value(return_entropy)} must be true or false")
        most = min(max_top_k, vocab_size)
        if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, (int, np.integer)) or not 0 <= top_k <= most:
            raise RequestError(f"top_k = {_value(top_k)} must be an integer in [0, {most}]")
        candidates = None if token_ids is None else _candidates(token_ids, n, vocab_size, max_token_ids)
        return cls(tokens.astype(np.int32), offsets, starts, temps, bool(return_entropy), int(top_k), candidates)

    def __len__(self) -> int:
        return len(self.score_from)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def scored(self) -> np.ndarray:
        """Entries each sequence's result has."""
        return self.lengths - self.score_from

    def candidate_counts(self) -> np.ndarray | None:
        """How many candidates each sequence asked for ([n]; its row of token_ids is padded with -1 past them)."""
        return None if self.token_ids is None else (self.token_ids >= 0).sum(axis=1)

    def result_offsets(self) -> np.ndarray:
        """Where each sequence's entries start in the flat result ([n + 1], int64; the last is their count)."""
        offsets = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(self.scored, out=offsets[1:])
        return offsets

    def span(self, lo: int, hi: int) -> ScoreRequest:
        """Sequences lo .. hi - 1 (views, no copy)."""
        a, b = self.offsets[lo], self.offsets[hi]
        return ScoreRequest(self.tokens[a:b], self.offsets[lo : hi + 1] - a, self.score_from[lo:hi],
                            self.temperature[lo:hi], self.return_entropy, self.top_k,
                            None if self.token_ids is None else self.token_ids[lo:hi])

    def select(self, index: np.ndarray) -> ScoreRequest:
        """These sequences, in this order (a share)."""
        index = np.asarray(index, dtype=np.int64)
        lengths = self.lengths[index]
        offsets = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return ScoreRequest(self.tokens[ragged_index(self.offsets[index], lengths)], offsets,
                            self.score_from[index], self.temperature[index], self.return_entropy, self.top_k,
                            None if self.token_ids is None else self.token_ids[index])

    @staticmethod
    def concat(parts: Sequence[ScoreRequest]) -> ScoreRequest:
        """The sequences of every part, one after another; entropy when any part asks for it; candidates padded
        to the widest part's (-1). Parts must ask for one top_k (a tail's mass depends on its k)."""
        if len({p.top_k for p in parts}) > 1:
            raise ValueError(f"requests asking for top_k {sorted({p.top_k for p in parts})} cannot be joined")
        sizes = np.array([p.offsets[-1] for p in parts])
        shift = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        offsets = np.concatenate([[0]] + [p.offsets[1:] + s for p, s in zip(parts, shift, strict=True)])
        token_ids = None
        if any(p.token_ids is not None for p in parts):
            width = max(p.token_ids.shape[1] for p in parts if p.token_ids is not None)
            token_ids = np.full((sum(len(p) for p in parts), width), -1, dtype=np.int64)
            at = 0
            for p in parts:
                if p.token_ids is not None:
                    token_ids[at : at + len(p), : p.token_ids.shape[1]] = p.token_ids
                at += len(p)
        return ScoreRequest(np.concatenate([p.tokens for p in parts]), offsets.astype(np.int64),
                            np.concatenate([p.score_from for p in parts]),
                            np.concatenate([p.temperature for p in parts]), any(p.return_entropy for p in parts),
                            parts[0].top_k, token_ids)


def _candidates(token_ids, n: int, vocab_size: int, most: int) -> np.ndarray:
    """Candidate ids, one list for all n sequences or one per sequence, as int64 [n, C] padded with -1."""
    if not isinstance(token_ids, (Sequence, np.ndarray)) or isinstance(token_ids, str) or len(token_ids) == 0:
        raise RequestError("token_ids must be a non-empty list of token ids, or one such list per sequence")
    shared = not isinstance(token_ids[0], (Sequence, np.ndarray)) or isinstance(token_ids[0], str)
    if not shared and len(token_ids) != n:
        raise RequestError(f"token_ids has {len(token_ids)} lists for {n} sequences (or give one list for all)")
    lists = [token_ids] if shared else token_ids
    width = 0
    for i, ids in enumerate(lists):
        where = "token_ids" if shared else f"token_ids[{i}]"
        if not isinstance(ids, (Sequence, np.ndarray)) or isinstance(ids, str) or len(ids) == 0:
            raise RequestError(f"{where} = {_value(ids)} must be a non-empty list of token ids")
        if len(ids) > most:
            raise RequestError(f"{where} has {len(ids)} ids; the limit is {most}")
        for j, x in enumerate(ids):
            if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
                raise RequestError(f"{where}[{j}] = {_value(x)} is not a token id (an integer)")
            if not 0 <= x < vocab_size:
                raise RequestError(f"{where}[{j}] = {_value(x)} is outside the vocabulary [0, {vocab_size})")
        width = max(width, len(ids))
    out = np.full((n, width), -1, dtype=np.int64)
    for i, ids in enumerate(lists):
        out[slice(None) if shared else i, : len(ids)] = ids
    return out


def ragged_index(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The concatenation of arange(starts[i], starts[i] + counts[i]) over i, without a Python loop."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - counts), counts)


RATIO_BOUNDS = (0.8, 1.25)  # a token's ratio exp(ours - rollout) outside these counts as a mismatch


def with_mismatch(sequences: list[SequenceScores], stats: dict[str, np.ndarray]) -> list[SequenceScores]:
    """Each sequence's result with its mismatch statistics (from `mismatch`) attached."""
    for i, seq in enumerate(sequences):
        seq.mismatch = {name: float(values[i]) for name, values in stats.items()}
    return sequences


def rollout_values(rollout_log_probs, request: ScoreRequest) -> np.ndarray:
    """A rollout engine's log-probs of the scored tokens (one list per sequence, its entries' positions) as one
    flat float64 array aligned with the results; RequestError naming the sequence, and the entry, that is not one
    finite log-probability (a number <= 0) or a list that does not have the sequence's entries."""
    n, scored = len(request), request.scored
    if not isinstance(rollout_log_probs, (Sequence, np.ndarray)) or isinstance(rollout_log_probs, str):
        raise RequestError("rollout_log_probs must be one list of log-probs per sequence")
    if len(rollout_log_probs) != n:
        raise RequestError(f"rollout_log_probs has {len(rollout_log_probs)} lists for {n} sequences")
    parts = []
    for i, values in enumerate(rollout_log_probs):
        listed = isinstance(values, (Sequence, np.ndarray)) and not isinstance(values, str)
        if not listed or len(values) != scored[i]:
            got = f"{len(values)} entries" if listed else _value(values)
            raise RequestError(f"rollout_log_probs[{i}] has {got}; sequence {i} has {scored[i]} scored tokens "
                               f"(len(input_ids[{i}]) - score_from[{i}])")
        if _has_bools(list(values)) or any(not isinstance(x, (int, float, np.integer, np.floating)) for x in values):
            j = next(j for j, x in enumerate(values) if isinstance(x, (bool, np.bool_))
                     or not isinstance(x, (int, float, np.integer, np.floating)))
            raise RequestError(f"rollout_log_probs[{i}][{j}] = {_value(values[j])} must be a number")
        try:
            array = np.asarray(values, dtype=np.float64)
        except OverflowError:  # an integer beyond float64
            j = next(j for j, x in enumerate(values) if isinstance(x, int) and not abs(x) < 2**1024)
            raise RequestError(f"rollout_log_probs[{i}][{j}] = {_value(values[j])} is out of range") from None
        if (bad := np.flatnonzero(~np.isfinite(array) | (array > 0))).size:
            j = int(bad[0])
            raise RequestError(f"rollout_log_probs[{i}][{j}] = {array[j].item()!r} must be a finite log-probability "
                               "(<= 0)")
        parts.append(array)
    return np.concatenate(parts) if parts else np.zeros(0)


def mismatch(ours: np.ndarray, rollout: np.ndarray, offsets: np.ndarray,
             bounds: tuple[float, float] = RATIO_BOUNDS) -> dict[str, np.ndarray]:
    """Per sequence (entries [offsets[i], offsets[i + 1])), how far the rollout engine's log-probs are from ours:
    mean and max |ours - rollout|, the k3 estimate of KL(rollout || ours) (the mean of exp(d) - 1 - d, d = ours -
    rollout, over tokens the rollout sampled), and the share of tokens whose ratio exp(d) lies outside `bounds`.
    A sequence without entries gets zeros. Each float64 [n]."""
    d = ours.astype(np.float64) - rollout
    counts = np.diff(offsets)
    some = counts > 0

    def mean(x: np.ndarray) -> np.ndarray:
        sums = np.zeros(len(counts))
        sums[some] = np.add.reduceat(x, offsets[:-1][some])  # (each run ends where the next non-empty one starts)
        return sums / np.maximum(counts, 1)

    largest = np.zeros(len(counts))
    if some.any():
        largest[some] = np.maximum.reduceat(np.abs(d), offsets[:-1][some])
    ratio = np.exp(d)
    return {"mean_abs": mean(np.abs(d)), "max_abs": largest, "kl_k3": mean(np.expm1(d) - d),
            "outside": mean(((ratio < bounds[0]) | (ratio > bounds[1])) * 1.0)}


VERSION_ATTEMPTS = 3  # how often a call made of parts asks again those answered with older weights than the newest


def stale_parts(versions: Sequence[int]) -> list[int]:
    """The parts (by index) answered with older weights than the newest part: an update landed between them, so
    they are asked again, never merged with the newer ones (see Parts)."""
    newest = max(versions)
    return [i for i, v in enumerate(versions) if v != newest]


R = TypeVar("R")
Positions = np.ndarray | range  # where a part's sequences stand in the call: an index array, or a run of them


def _weights_version(result) -> int:
    return result.weights_version


class Parts(Generic[R]):
    """One call's answer assembled from parts by weights version, the one policy of the pool, the workers' lines
    (scheduler.py) and the HTTP clients: when every part is in, those answered with older weights than the newest
    part are taken out to be asked again (`again`), in the caller's own way, VERSION_ATTEMPTS times at most (then
    WeightsChanged); once all are of one version, `merge` (ScoreResult parts) or `in_order` (runs) joins them.
    `version` reads a part's weights version (`weights_version`, the attribute, by default)."""

    def __init__(self, size: int, version: Callable[[R], int] = _weights_version) -> None:
        self.size = size  # sequences in the call
        self.version = version
        self.parts: list[tuple[Positions, R]] = []
        self.asked_again = 0  # times some parts were taken out to be asked again

    def add(self, positions: Positions, result: R) -> None:
        self.parts.append((positions, result))

    @property
    def complete(self) -> bool:
        """Every sequence of the call has its answer (none is out, or being asked again)."""
        return sum(len(positions) for positions, _ in self.parts) == self.size

    def again(self) -> list[Positions]:
        """The positions of the parts answered with older weights than the newest part, in the order they were added,
        taken out to be asked again; [] when every part is of one version. WeightsChanged instead when parts were
        asked again VERSION_ATTEMPTS times already (the weights changed under each attempt)."""
        late = stale_parts([self.version(r) for _, r in self.parts]) if self.parts else []
        if not late:
            return []
        if self.asked_again >= VERSION_ATTEMPTS:
            versions = sorted({self.version(r) for _, r in self.parts})
            raise WeightsChanged(f"the weights changed while the parts of this call were scored (versions {versions}),"
                                 f" {VERSION_ATTEMPTS} times; retry")
        self.asked_again += 1
        taken = set(late)
        again = [self.parts[i][0] for i in late]
        self.parts = [part for i, part in enumerate(self.parts) if i not in taken]
        return again

    def merge(self, entropy: bool, *, copy: bool = True) -> ScoreResult:
        """The call's ScoreResult from its parts (ScoreResult.merge). `copy=False`: a call answered in one part, all
        of it in order (range(size)), is that part itself (views of it; its entropy dropped when not asked for), as a
        worker's line answers a request whole in one step."""
        if not copy and len(self.parts) == 1:
            positions, part = self.parts[0]
            if isinstance(positions, range) and positions == range(self.size):
                return replace(part, entropy=None) if part.entropy is not None and not entropy else part
        return ScoreResult.merge([(np.asarray(positions), r) for positions, r in self.parts], self.size, entropy)

    def in_order(self) -> list[R]:
        """The parts' results in the call's order, for parts that are runs of consecutive sequences (ranges)."""
        return [r for _, r in sorted(self.parts, key=lambda part: part[0].start)]


class _Outputs:
    """The per-token outputs of the table (outputs.OUTPUTS) read as attributes from `extras`: result.top_ids, say,
    is result.extras.get("top_ids") (None where not asked for)."""

    if TYPE_CHECKING:  # (the table's rows today, for readers and type checkers)
        top_log_probs: np.ndarray | None  # float32 [entries, k], most likely first (top_k asked)
        top_ids: np.ndarray | None  # int32 [entries, k]
        tail_log_prob: np.ndarray | None  # float32 [entries]: every token outside the top k
        candidate_log_probs: np.ndarray | None  # float32 [entries, C] (token_ids asked)

    def __getattr__(self, name: str):
        if name in OUTPUTS:
            return self.__dict__.get("extras", {}).get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


@dataclass
class SequenceScores(_Outputs):
    """One sequence's result: entry k is for token seq[score_from + k] given seq[:score_from + k]."""

    log_probs: np.ndarray  # float32, [len(seq) - score_from]
    entropy: np.ndarray | None  # float32, same length; None when not asked for
    weights_version: int
    # how far a rollout engine's log-probs of these tokens are from these (given rollout_log_probs): mean_abs,
    # max_abs, kl_k3, outside (see `mismatch`)
    mismatch: dict[str, float] | None = None
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # the per-token outputs asked for, by name


@dataclass
class ScoreResult(_Outputs):
    """Every sequence's entries, one flat float32 array with offsets, computed with one weights version."""

    log_probs: np.ndarray  # float32 [scored]: sequence i's are log_probs[offsets[i] : offsets[i + 1]]
    entropy: np.ndarray | None  # float32 [scored], or None
    offsets: np.ndarray  # int64 [n + 1]
    weights_version: int
    # float64 [n]: the tokens computed for each sequence, a piece shared by k sequences counting 1/k to each
    # (workers/prefixes.py); None: not told (then each sequence's own length)
    computed: np.ndarray | None = None
    # the per-token outputs asked for (outputs.OUTPUTS), by name: rows of [scored, ...] as log_probs
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    # the steps a worker's line began between this request's coming and its first part (the most over its workers)
    steps_waited: int = 0

    def computed_tokens(self, lengths: np.ndarray) -> int:
        """The tokens computed for these sequences (whose lengths are `lengths`)."""
        return int(lengths.sum()) if self.computed is None else int(round(float(self.computed.sum())))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sequences(self, candidates: np.ndarray | None = None) -> list[SequenceScores]:
        """Each sequence's entries; `candidates`: how many candidates each asked for (ScoreRequest.candidate_counts),
        to cut its candidate_log_probs to them."""
        cuts = self.offsets[1:-1]
        lp = np.split(self.log_probs, cuts)
        ent = np.split(self.entropy, cuts) if self.entropy is not None else [None] * len(lp)
        extras = {name: np.split(value, cuts) for name, value in self.extras.items()}
        if candidates is not None:  # (the wide outputs of token_ids, each sequence's cut to its own list)
            for name in extras:
                if OUTPUTS[name].per_candidate:
                    extras[name] = [c[:, :k] for c, k in zip(extras[name], candidates, strict=True)]
        return [SequenceScores(a, b, self.weights_version, extras={name: parts[i] for name, parts in extras.items()})
                for i, (a, b) in enumerate(zip(lp, ent, strict=True))]

    def span(self, lo: int, hi: int) -> ScoreResult:
        """Sequences lo .. hi - 1 (views, no copy)."""
        a, b = self.offsets[lo], self.offsets[hi]
        entropy = self.entropy[a:b] if self.entropy is not None else None
        computed = None if self.computed is None else self.computed[lo:hi]
        return ScoreResult(self.log_probs[a:b], entropy, self.offsets[lo : hi + 1] - a, self.weights_version, computed,
                           {name: value[a:b] for name, value in self.extras.items()})

    @staticmethod
    def merge(parts: Sequence[tuple[np.ndarray, ScoreResult]], n: int, entropy: bool) -> ScoreResult:
        """One result of n sequences from parts (index of their sequences in the whole, their result), all of one
        weights version."""
        counts = np.zeros(n, dtype=np.int64)
        for index, part in parts:
            counts[index] = np.diff(part.offsets)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        log_probs = np.empty(offsets[-1], dtype=np.float32)
        ent = np.empty(offsets[-1], dtype=np.float32) if entropy else None
        extras = {name: np.empty((offsets[-1], *value.shape[1:]), dtype=value.dtype)
                  for name, value in parts[0][1].extras.items()} if parts else {}
        for index, part in parts:
            where = ragged_index(offsets[:-1][index], counts[index])
            log_probs[where] = part.log_probs
            if ent is not None:
                ent[where] = part.entropy
            for name, value in extras.items():
                value[where] = part.extras[name]
        versions = {part.weights_version for _, part in parts}
        if len(versions) > 1:
            raise ValueError(f"parts of versions {sorted(versions)} cannot be merged")
        computed = None
        if all(part.computed is not None for _, part in parts):
            computed = np.zeros(n)
            for index, part in parts:
                computed[index] = part.computed
        waited = max((part.steps_waited for _, part in parts), default=0)
        return ScoreResult(log_probs, ent, offsets, versions.pop() if versions else -1, computed, extras,
                           steps_waited=waited)

    def fit(self, request: ScoreRequest) -> ScoreResult:
        """This result (of a call `request` was joined into) as `request` asked for it: candidates cut to the width
        of its own lists, or none."""
        if not any(OUTPUTS[name].asked_by == "token_ids" for name in self.extras):
            return self
        width = 0 if request.token_ids is None else request.token_ids.shape[1]
        extras = {}
        for name, value in self.extras.items():  # (those of token_ids: none unless it asked, the wide ones cut)
            output = OUTPUTS[name]
            if output.asked_by != "token_ids":
                extras[name] = value
            elif width:
                extras[name] = value[:, :width] if output.wide else value
        return replace(self, extras=extras)

    def all_finite(self) -> bool:
        return bool(np.isfinite(self.log_probs).all() and (self.entropy is None or np.isfinite(self.entropy).all()))

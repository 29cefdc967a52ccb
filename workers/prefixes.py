"""Shared prefixes: sequences of one call that begin with the same tokens (a GRPO group's prompt, a system prompt)
are laid out as one forest of pieces, each token computed once.

A piece is a run of tokens [start, end) that all its members hold at the same positions. Its members' next tokens
come from its children; a sequence's tokens are the pieces on its path, root to its last piece (a sequence that ends
where its group's shared tokens end has none of its own). A piece attends to the keys of its ancestors, then to its
own (varlen attention with more keys than queries, causal from the bottom right), which are the keys each token
meets in its whole sequence, in the same order. A node's last position predicts a different token for each child:
the head is given each scored position's label (and temperature) explicitly.

Numpy only: the worker plans here, the model runs the plan (models/patch_model.py, varlen_attention.attend).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .request import ScoreRequest, ragged_index

MIN_SHARED_PREFIX = 128  # first tokens sequences of one call must share to compute them once (the default everywhere)


@dataclass(frozen=True)
class Forest:
    """Pieces in depth-first order (a node just before its first child), each as the sequence it is read from
    (request index), its token range, and its parent piece (-1 for a root)."""

    seq: np.ndarray
    start: np.ndarray
    end: np.ndarray
    parent: np.ndarray
    leaf: dict[int, int]  # sequence (request index) -> its last piece (several may end in one)

    @property
    def shared(self) -> bool:
        """Whether any piece belongs to more than one sequence."""
        return bool((self.parent >= 0).any()) or len(set(self.leaf.values())) < len(self.leaf)

    @property
    def tokens(self) -> int:
        """Tokens a forward of this forest computes."""
        return int((self.end - self.start).sum())

    def path(self, seq: int) -> list[int]:
        """The pieces of a sequence, root first."""
        out, piece = [], self.leaf[seq]
        while piece >= 0:
            out.append(piece)
            piece = int(self.parent[piece])
        return out[::-1]

    def shares(self) -> dict[int, float]:
        """Each sequence's part of the tokens computed: a piece shared by k sequences counts 1/k to each."""
        lengths = (self.end - self.start).astype(np.float64)
        members = np.zeros(len(self.seq))
        paths = {s: self.path(s) for s in self.leaf}
        for path in paths.values():
            members[path] += 1
        return {s: float((lengths[path] / members[path]).sum()) for s, path in paths.items()}

    def roots(self) -> list[tuple[np.ndarray, int]]:
        """Each tree's member sequences, in its depth-first order (that of their tokens: halves of it still share),
        and the tokens it computes."""
        root = np.arange(len(self.seq))
        for i, p in enumerate(self.parent):  # (a parent comes before its children)
            if p >= 0:
                root[i] = root[p]
        members: dict[int, list[int]] = {}
        for seq, piece in self.leaf.items():  # (in depth-first order)
            members.setdefault(int(root[piece]), []).append(seq)
        cost = np.bincount(root, weights=self.end - self.start, minlength=len(root))
        return [(np.array(m, dtype=np.int64), int(cost[r])) for r, m in sorted(members.items())]


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def forest(request: ScoreRequest, seqs: np.ndarray, min_shared: int) -> Forest:
    """The pieces of these sequences (request indices): members share a node's piece when it holds at least
    `min_shared` tokens (>= 1); groups nest (a system prompt shared by all, a task prompt by some). Linear in the
    tokens but for sorting the sequences."""
    tokens = [request.tokens[request.offsets[i] : request.offsets[i + 1]] for i in seqs]
    order = sorted(range(len(seqs)), key=lambda k: tokens[k].astype(">i8").tobytes())  # (ids >= 0: byte order)
    ordered = [tokens[k] for k in order]
    lcp = np.array([_common(a, b) for a, b in zip(ordered, ordered[1:], strict=False)], dtype=np.int64)
    seq, start, end, parent, leaf = [], [], [], [], {}

    def runs(i: int, j: int, first: int, up: int):
        """The runs of [i, j) that share at least min_shared tokens from `first` on, in order."""
        if i >= j:  # (every member of a node ended in it)
            return iter(())
        cuts = [i, *(k + 1 for k in range(i, j - 1) if lcp[k] < first + min_shared), j]
        return iter([(a, b, first, up) for a, b in zip(cuts, cuts[1:], strict=False)])

    stack = [runs(0, len(order), 0, -1)]  # depth first, without recursion (nesting can be deep)
    while stack:
        run = next(stack[-1], None)
        if run is None:
            stack.pop()
            continue
        a, b, first, up = run
        seq.append(int(seqs[order[a]])), start.append(first), parent.append(up)
        if b - a == 1:  # a leaf: the rest of its sequence
            end.append(ordered[a].size)
            leaf[int(seqs[order[a]])] = len(seq) - 1
        else:  # a node: the tokens its members share, then its children (those that go on)
            shared = int(lcp[a : b - 1].min())
            end.append(shared)
            while a < b and ordered[a].size == shared:  # ends here (a prefix sorts before what extends it)
                leaf[int(seqs[order[a]])] = len(seq) - 1
                a += 1
            stack.append(runs(a, b, shared, len(seq) - 1))
    as_array = lambda x: np.array(x, dtype=np.int64)  # noqa: E731
    return Forest(as_array(seq), as_array(start), as_array(end), as_array(parent), leaf)


@dataclass(frozen=True)
class RowPlan:
    """One packed row of a forest: its tokens and positions, each piece's queries (cu_q) and the keys they attend
    (kv_index into the row, cu_k), and the head's work: each distinct (position, label, temperature) scored once
    (`scored`, `labels`, `temperature`), and where each result entry takes its value from (`take`, into those;
    `dst`, into the request's flat results)."""

    ids: np.ndarray
    positions: np.ndarray
    cu_q: np.ndarray
    kv_index: np.ndarray
    cu_k: np.ndarray
    scored: np.ndarray
    labels: np.ndarray
    temperature: np.ndarray
    take: np.ndarray
    dst: np.ndarray


def row_plan(request: ScoreRequest, trees: Forest, result_offsets: np.ndarray) -> RowPlan:
    lengths = trees.end - trees.start
    at = np.cumsum(lengths) - lengths  # each piece's place in the row
    ids = request.tokens[ragged_index(request.offsets[trees.seq] + trees.start, lengths)]
    chains: list[list[int]] = []  # each piece's ancestors and itself, root first
    for i, up in enumerate(trees.parent):
        chains.append([*(chains[up] if up >= 0 else ()), i])
    keys = np.concatenate([np.array(c, dtype=np.int64) for c in chains])
    per_piece = np.array([len(c) for c in chains])
    kv_index = ragged_index(at[keys], lengths[keys])
    key_counts = np.add.reduceat(lengths[keys], np.cumsum(per_piece) - per_piece)
    # a sequence's entry k scores its token score_from + k, predicted at position score_from + k - 1
    src, dst, label, temp = [], [], [], []
    for s in trees.leaf:
        first, last = int(request.score_from[s]) - 1, int(request.lengths[s]) - 1  # positions predicting a token
        for piece in trees.path(s):
            lo, hi = max(first, int(trees.start[piece])), min(last, int(trees.end[piece]))
            if lo < hi:
                src.append(np.arange(lo, hi) - trees.start[piece] + at[piece])
                dst.append(np.arange(lo, hi) - first + result_offsets[s])
                label.append(request.tokens[request.offsets[s] + lo + 1 : request.offsets[s] + hi + 1])
                temp.append(np.full(hi - lo, request.temperature[s]))
    src, dst, label, temp = (np.concatenate(x) if x else np.zeros(0) for x in (src, dst, label, temp))
    triples, take = np.unique(np.column_stack([src, label, temp]), axis=0, return_inverse=True)
    cumulative = lambda n: np.concatenate([[0], np.cumsum(n)]).astype(np.int32)  # noqa: E731
    return RowPlan(ids, ragged_index(trees.start, lengths), cumulative(lengths), kv_index, cumulative(key_counts),
                   triples[:, 0].astype(np.int64), triples[:, 1].astype(np.int64), triples[:, 2].astype(np.float32),
                   take.reshape(-1), dst.astype(np.int64))


def computed_offsets(request: ScoreRequest, groups: np.ndarray) -> np.ndarray:
    """Cumulative tokens [n + 1] a forward computes for the request's sequences in order, the prompt a run of
    neighbours shares (`groups`: neighbour_groups) counted once: a sequence past its run's first costs what it
    holds beyond the tokens it shares with that first one."""
    costs = request.lengths.astype(np.int64)
    seq = lambda i: request.tokens[request.offsets[i] : request.offsets[i + 1]]  # noqa: E731
    for i in np.flatnonzero(groups != np.arange(len(groups))):
        costs[i] -= _common(seq(i), seq(int(groups[i])))
    return np.concatenate([[0], np.cumsum(costs)])


def neighbour_groups(request: ScoreRequest, min_shared: int | None) -> np.ndarray:
    """For each sequence, where the run of neighbours it belongs to begins: sequences next to each other that share
    their first `min_shared` tokens (a GRPO group, as requests hold them); each sequence alone without a minimum. A
    cut between calls moves to a run's start rather than falling inside it."""
    n = len(request)
    if min_shared is None or n < 2:
        return np.arange(n)
    long = np.flatnonzero(request.lengths >= min_shared)
    heads = request.tokens[ragged_index(request.offsets[long], np.full(long.size, min_shared))].reshape(-1, min_shared)
    joined = np.zeros(n, dtype=bool)  # continues the run of the sequence before it
    joined[long[1:][(heads[1:] == heads[:-1]).all(axis=1) & (np.diff(long) == 1)]] = True
    return np.maximum.accumulate(np.where(joined, 0, np.arange(n)))

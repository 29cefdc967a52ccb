"""workers/prefixes.py: which sequences share which pieces, and the row a forest is laid out in."""

import numpy as np
import pytest

from ppo_logprobs.workers.prefixes import computed_offsets, forest, neighbour_groups, row_plan
from ppo_logprobs.workers.request import ScoreRequest

SYSTEM = list(range(100, 137))  # 37 tokens every sequence but one starts with
TASK = [7] * 11


def build(seqs, score_from=1, temperature=1.0):
    return ScoreRequest.build(seqs, score_from, temperature, True, vocab_size=503, max_length=1000)


def tokens_of(request, i):
    return request.tokens[request.offsets[i] : request.offsets[i + 1]].tolist()


def test_nested_partial_and_identical_sequences_form_one_tree_each_token_once():
    seqs = [SYSTEM + TASK + [1, 2, 3], SYSTEM + TASK + [1, 4], SYSTEM + [9, 9, 9, 9], [5] * 20,
            SYSTEM + TASK + [1, 2, 3], SYSTEM[:4]]
    request = build(seqs)
    trees = forest(request, np.arange(len(seqs)), 3)
    paths = {s: trees.path(s) for s in range(len(seqs))}
    for s, path in paths.items():  # a path is the sequence, piece by piece
        got = [t for p in path for t in tokens_of(request, int(trees.seq[p]))[trees.start[p] : trees.end[p]]]
        assert got == seqs[s], s
        assert trees.start[path[0]] == 0
        assert all(trees.start[b] == trees.end[a] for a, b in zip(path, path[1:], strict=False))
    assert paths[0][:-1] == paths[4][:-1] == paths[1][:-1]  # the task prompt, within the system prompt
    assert paths[2][:2] == paths[0][:2] and len(paths[2]) == 3
    assert paths[3] == [trees.leaf[3]] and trees.parent[trees.leaf[3]] == -1  # shares nothing
    assert paths[5] == paths[0][:1] and trees.end[paths[5][0]] == 4  # another's prefix: no piece of its own
    for p, up in enumerate(trees.parent):  # depth first: a node just before its first child
        if up >= 0 and p == min(q for q, u in enumerate(trees.parent) if u == up):
            assert p == up + 1
    # SYSTEM[:4], SYSTEM[4:], TASK + [1], three ends ([2, 3] twice: shorter than the minimum), [9] * 4 after
    # SYSTEM, and the sequence that shares nothing
    shared_once = 4 + 33 + 12 + (2 + 2 + 1) + 4 + 20
    assert trees.tokens == shared_once < sum(map(len, seqs))
    roots = {tuple(sorted(members.tolist())): cost for members, cost in trees.roots()}
    assert roots == {(0, 1, 2, 4, 5): trees.tokens - 20, (3,): 20}


@pytest.mark.parametrize("min_shared", [1, 37, 38, 200])
def test_a_prefix_shorter_than_the_minimum_is_not_shared(min_shared):
    seqs = [SYSTEM + [1, 2], SYSTEM + [3, 4, 5]]
    trees = forest(build(seqs), np.arange(2), min_shared)
    assert trees.shared == (min_shared <= 37)
    assert trees.tokens == (37 + 2 + 3 if trees.shared else 39 + 40)


def test_identical_sequences_are_computed_once():
    trees = forest(build([SYSTEM, SYSTEM, SYSTEM + [1]]), np.arange(3), 8)
    assert trees.tokens == 38 and trees.leaf[0] == trees.leaf[1] == trees.path(2)[0]


def test_a_run_of_neighbours_sharing_a_prompt_counts_it_once_in_the_tokens_computed():
    """A GRPO group (neighbours sharing SYSTEM + TASK), a sequence sharing only 4 tokens (under the minimum), the
    same group again after it (a run of its own, with one more copy of its last): each run's prompt once, as its
    forest computes it (the estimate compares a sequence with its run's first alone: the copy costs its last token)."""
    group = [SYSTEM + TASK + [1, 2, 3], SYSTEM + TASK + [4], SYSTEM + TASK + [5]]
    seqs = [*group, SYSTEM[:4] + [9] * 6, *group, SYSTEM + TASK + [5]]
    request = build(seqs)
    groups = neighbour_groups(request, 16)
    assert groups.tolist() == [0, 0, 0, 3, 4, 4, 4, 4]
    costs = np.diff(computed_offsets(request, groups))
    assert costs.tolist() == [51, 1, 1, 10, 51, 1, 1, 1]
    assert costs[:3].sum() == forest(request, np.arange(3), 16).tokens


def test_the_row_plan_gives_each_sequence_its_keys_positions_and_entries():
    seqs = [SYSTEM + TASK + [1, 2, 3], SYSTEM + TASK + [1, 4], SYSTEM + [9, 9, 9, 9], [5] * 20, SYSTEM[:4]]
    starts, temps = [1, 40, 2, 5, 4], [1.0, 0.5, 1.0, 2.0, 1.0]
    request = build(seqs, starts, temps)
    trees = forest(request, np.arange(len(seqs)), 3)
    offsets = request.result_offsets()
    plan = row_plan(request, trees, offsets)
    assert plan.ids.size == plan.positions.size == trees.tokens == plan.cu_q[-1]
    for s, seq in enumerate(seqs):
        leaf = trees.leaf[s]
        keys = plan.kv_index[plan.cu_k[leaf] : plan.cu_k[leaf + 1]]
        assert plan.ids[keys].tolist() == seq and plan.positions[keys].tolist() == list(range(len(seq)))
        for e in range(offsets[s + 1] - offsets[s]):  # entry e scores token starts[s] + e, predicted before it
            (i,) = np.flatnonzero(plan.dst == offsets[s] + e)
            row = plan.scored[plan.take[i]]
            assert plan.positions[row] == starts[s] + e - 1 and plan.temperature[plan.take[i]] == temps[s]
            assert plan.labels[plan.take[i]] == seq[starts[s] + e]
    # a position scored by several sequences against one token at one temperature is scored once
    assert plan.scored.size < plan.dst.size == offsets[-1]
    triples = zip(plan.scored.tolist(), plan.labels.tolist(), plan.temperature.tolist(), strict=True)
    assert len(set(triples)) == plan.scored.size

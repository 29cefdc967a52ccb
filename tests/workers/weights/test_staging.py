"""Staging (workers/weights/staging.py) on its own: the buffer's layout, matching an update to a model, a
tensor-parallel rank's parts, and a staged update that reaches the model only on commit. Reading checkpoints into
staging is test_checkpoint.py's."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from ppo_logprobs.workers import load_model
from ppo_logprobs.workers.errors import IncompatibleWeights
from ppo_logprobs.workers.models.load_model import TINY_CONFIG
from ppo_logprobs.workers.models.tensor_parallel import cut_model
from ppo_logprobs.workers.sharding import Part, part_shape, take
from ppo_logprobs.workers.weights import staging
from ppo_logprobs.workers.weights.staging import Layout, StagedWeights, match_model, rank_parts


def shapes_of(model) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def tied_tiny():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**{**TINY_CONFIG, "tie_word_embeddings": True}))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor, so that -0.0, NaN payloads and subnormals compare exactly."""
    return t.detach().reshape(-1).view(torch.uint8)


def test_a_layout_starts_every_tensor_on_a_256_byte_boundary():
    items = [
        ("a", (3,), torch.float32),  # 12 bytes
        ("b", (17,), torch.bfloat16),  # 34
        ("c", (64,), torch.float32),  # 256: exactly one block
        ("d", (257,), torch.uint8),  # 257: one byte into a second block
        ("e", (), torch.float64),  # 8: a scalar
        ("f", (2, 3), torch.int64),  # 48
        ("g", (5,), torch.bool),  # 5
    ]
    layout = Layout.of(items)
    assert [(e.name, e.shape, e.dtype) for e in layout.entries] == items
    assert [e.offset for e in layout.entries] == [0, 256, 512, 768, 1280, 1536, 1792]
    assert [e.nbytes for e in layout.entries] == [12, 34, 256, 257, 8, 48, 5]
    assert layout.nbytes == 2048


def test_an_update_is_laid_out_in_the_models_own_dtypes_and_its_own_order():
    model = load_model("tiny", backend="torch")
    model.model.norm.to(torch.float64)
    model.lm_head.to(torch.bfloat16)
    shapes = dict(reversed(shapes_of(model).items()))
    layout = match_model(model, shapes, full=True, what="the update")
    assert [e.name for e in layout.entries] == list(shapes)
    dtypes = {e.name: e.dtype for e in layout.entries}
    assert dtypes["model.norm.weight"] == torch.float64 and dtypes["lm_head.weight"] == torch.bfloat16
    assert {d for n, d in dtypes.items() if n not in ("model.norm.weight", "lm_head.weight")} == {torch.float32}
    assert all(e.shape == shapes[e.name] for e in layout.entries)


def test_a_partial_update_is_refused_only_when_it_must_be_full():
    model = load_model("tiny", backend="torch")
    shapes = shapes_of(model)
    del shapes["model.layers.1.mlp.up_proj.weight"], shapes["model.norm.weight"]
    assert len(match_model(model, shapes, full=False, what="the update").entries) == len(shapes)
    lacks = "the update lacks 2 of the model's parameters, e.g. 'model.layers.1.mlp.up_proj.weight'"
    with pytest.raises(IncompatibleWeights) as e:
        match_model(model, shapes, full=True, what="the update")
    assert str(e.value) == lacks


def renamed(shapes, old, new):
    return {new if n == old else n: s for n, s in shapes.items()}


def test_refusals_name_the_first_difference():
    model = load_model("tiny", backend="torch")
    whole = shapes_of(model)
    q0 = "model.layers.0.self_attn.q_proj.weight"
    cases = [
        # two names the model lacks: the first in the update's order is named; same layer count: no layer hint
        (
            renamed(renamed(whole, q0, "model.layers.0.attn.q.weight"), "model.norm.weight", "model.final_norm.w"),
            "the update has 2 tensors the model does not, e.g. 'model.layers.0.attn.q.weight'",
        ),
        # a third layer: the hint counts both
        (
            {**whole, "model.layers.2.mlp.up_proj.weight": (128, 64)},
            "the update has 1 tensors the model does not, e.g. 'model.layers.2.mlp.up_proj.weight'; the update has 3 "
            "layers, the model 2",
        ),
        # two shapes differ: the first is named, with both shapes
        (
            {**whole, q0: (64, 32), "lm_head.weight": (600, 64)},
            "'model.layers.0.self_attn.q_proj.weight' has shape [64, 32] in the update and [64, 64] in the model",
        ),
    ]
    for shapes, message in cases:
        with pytest.raises(IncompatibleWeights) as e:
            match_model(model, shapes, full=False, what="the update")
        assert str(e.value) == message


def test_a_tied_parameter_is_written_once_under_either_name():
    model = tied_tiny()
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    both = {head: (503, 64), **shapes_of(model)}  # the head first, then the embedding by its own name
    layout = match_model(model, both, full=True, what="the update")
    names = [e.name for e in layout.entries]
    assert head in names and embed not in names
    assert len(names) == len(shapes_of(model))  # named_parameters lists a tied parameter once
    only_head = renamed(shapes_of(model), embed, head)
    assert [e.name for e in match_model(model, only_head, full=True, what="the update").entries] == list(only_head)


def test_a_plain_model_takes_each_tensor_whole():
    model = load_model("tiny", backend="torch")
    shapes = shapes_of(model)
    assert rank_parts(model, shapes) == {name: (name, None) for name in shapes}
    assert part_shape((64, 128), None) == (64, 128)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_rank_takes_the_parts_it_was_cut_to(rank):
    """rank_parts of a rank cut from the tiny model (4 query heads, 2 key-value heads of 16, MLP 128, vocabulary
    503): each part is where that rank's parameter lies in the whole tensor, and part_shape its shape."""
    whole = dict(load_model("tiny", backend="torch").named_parameters())
    model = load_model("tiny", backend="torch", shard=(rank, 2))
    parts = rank_parts(model, {name: tuple(p.shape) for name, p in whole.items()})
    assert set(parts) == set(whole)
    for name, param in model.named_parameters():
        source, part = parts[name]
        assert source == name
        assert part_shape(tuple(whole[name].shape), part) == tuple(param.shape), name
        assert torch.equal(take(whole[name], part), param), name
    layer = "model.layers.1."
    assert parts[layer + "self_attn.q_proj.weight"][1] == Part(0, 32 * rank, 32)  # 2 of 4 heads of 16
    assert parts[layer + "self_attn.k_proj.bias"][1] == Part(0, 16 * rank, 16)  # 1 of 2 heads
    assert parts[layer + "self_attn.o_proj.weight"][1] == Part(1, 32 * rank, 32)  # its heads' input columns
    assert parts[layer + "mlp.down_proj.weight"][1] == Part(1, 64 * rank, 64)
    assert parts["lm_head.weight"][1] == (Part(0, 0, 252) if rank == 0 else Part(0, 252, 251))  # tensor_split's
    assert parts["model.norm.weight"][1] is None and parts["model.embed_tokens.weight"][1] is None


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_of_a_tied_model_cuts_its_head_from_the_embedding_when_the_update_has_no_head(rank):
    model = cut_model(tied_tiny(), rank, 2)
    shapes = shapes_of(tied_tiny())  # lists the tied parameter once, as the embedding
    assert "lm_head.weight" not in shapes
    head = Part(0, 0, 252) if rank == 0 else Part(0, 252, 251)
    assert rank_parts(model, shapes)["lm_head.weight"] == ("model.embed_tokens.weight", head)
    own = {**shapes, "lm_head.weight": (503, 64)}  # an update with a head of its own: that one is cut
    assert rank_parts(model, own)["lm_head.weight"] == ("lm_head.weight", head)


def test_a_rank_refuses_tensors_that_are_already_cut():
    model = load_model("tiny", backend="torch", shard=(1, 2))
    with pytest.raises(IncompatibleWeights, match=r"q_proj.weight has shape \[32, 64\], not 64 entries along dim 0"):
        rank_parts(model, shapes_of(model))  # the rank's own shapes, not the whole model's


def test_a_staged_update_lands_bitwise_and_only_on_commit():
    """Values the model does not hold (-0.0, subnormals, a NaN payload) in fp32, bf16 and fp64 parameters, written
    through each entry's view of the one buffer: no view overlaps another, nothing reaches the model before commit,
    and commit leaves the model exactly those bytes. A partial update leaves the other parameters alone."""
    model = load_model("tiny", backend="torch")
    model.model.norm.to(torch.float64)
    model.lm_head.to(torch.bfloat16)
    before = {n: p.clone() for n, p in model.named_parameters()}
    shapes = shapes_of(model)
    del shapes["model.layers.0.mlp.gate_proj.weight"]
    layout = match_model(model, shapes, full=False, what="the update")
    staged = StagedWeights(layout, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    written = {}
    for entry in layout.entries:
        values = torch.randn(entry.shape, generator=g, dtype=torch.float64).to(entry.dtype)
        odd = [-0.0, torch.finfo(entry.dtype).smallest_normal / 4, 1.0]
        values.view(-1)[:3] = torch.tensor(odd, dtype=torch.float64)
        staged.tensor(entry).copy_(values)
        written[entry.name] = values
    nan = torch.tensor([0x7FC0_0123], dtype=torch.int32).view(torch.float32)  # a NaN with a payload
    staged.tensor(layout.entries[1]).view(-1)[3] = nan[0]
    written[layout.entries[1].name].view(-1)[3] = nan[0]
    for entry in layout.entries:  # each view still holds what was written to it
        assert torch.equal(bits(staged.tensor(entry)), bits(written[entry.name])), entry.name
    for name, p in model.named_parameters():
        assert torch.equal(bits(p), bits(before[name])), name
    staged.commit(model)
    for name, p in model.named_parameters():
        assert torch.equal(bits(p), bits(written.get(name, before[name]))), name


def test_commit_writes_a_tied_parameter_under_the_name_staged():
    model = tied_tiny()
    layout = match_model(
        model, renamed(shapes_of(model), "model.embed_tokens.weight", "lm_head.weight"), full=True, what="the update"
    )
    staged = StagedWeights(layout, torch.device("cpu"))
    head = next(e for e in layout.entries if e.name == "lm_head.weight")
    staged.buffer.zero_()
    staged.tensor(head).copy_(torch.arange(503 * 64, dtype=torch.float32).view(503, 64))
    staged.commit(model)
    assert torch.equal(model.model.embed_tokens.weight, staged.tensor(head))
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_is_found_in_every_chunk_of_a_tensor(monkeypatch, bad):
    """Chunks of 5 elements over a tensor of 17 (chunks of 5, 5, 5 and 2), after a tensor of 7: the value is found
    at every position, the first element of a chunk and the last included, and named as the first bad tensor even
    when a later one is bad too."""
    monkeypatch.setattr(staging, "FINITE_CHUNK", 5)
    layout = Layout.of([("a", (7,), torch.float32), ("b", (17,), torch.bfloat16), ("c", (3, 3), torch.float16)])
    staged = StagedWeights(layout, torch.device("cpu"))
    a, b, c = (staged.tensor(e) for e in layout.entries)
    for i in range(17):
        staged.buffer.zero_()
        assert staged.first_non_finite() is None
        b[i] = bad
        assert staged.first_non_finite() == "b", i
        c[2, 2] = bad
        assert staged.first_non_finite() == "b", i
    a[6] = bad
    assert staged.first_non_finite() == "a"


def test_integer_tensors_are_never_non_finite(monkeypatch):
    """Integer and bool tensors holding the bytes of a float NaN or infinity are not checked; a float tensor after
    them still is."""
    monkeypatch.setattr(staging, "FINITE_CHUNK", 4)
    layout = Layout.of(
        [("i32", (9,), torch.int32), ("i16", (5,), torch.int16), ("u8", (6,), torch.uint8), ("flag", (3,), torch.bool)]
    )
    staged = StagedWeights(layout, torch.device("cpu"))
    staged.tensor(layout.entries[0]).fill_(0x7FC0_0000)  # float32 NaN
    staged.tensor(layout.entries[1]).fill_(0x7C00)  # float16 infinity
    staged.tensor(layout.entries[2]).fill_(0xFF)
    staged.tensor(layout.entries[3]).fill_(True)
    assert staged.first_non_finite() is None
    with_float = Layout.of([*((e.name, e.shape, e.dtype) for e in layout.entries), ("w", (6,), torch.float32)])
    staged = StagedWeights(with_float, torch.device("cpu"))
    staged.buffer.fill_(0xFF)  # every float32 of w is a NaN
    assert staged.first_non_finite() == "w"


def test_weights_staged_in_place_are_read_anew_at_each_check_and_commit():
    """A colocated sender's tensors stay where they are between updates and the same StagedWeights serve each
    one: every check and every commit reads their current values (the pieces and copy lists it keeps are views)."""
    model = load_model("tiny", backend="torch")
    params = dict(model.named_parameters())
    layout = match_model(model, shapes_of(model), full=True, what="the update")
    sender = {e.name: params[e.name].detach().clone() for e in layout.entries}
    staged = StagedWeights.in_place(layout, [(e.offset, bits(sender[e.name])) for e in layout.entries])
    name = "model.layers.1.mlp.down_proj.weight"
    for step in range(3):
        for t in sender.values():
            t.add_(0.5)
        assert staged.first_non_finite() is None
        staged.commit(model)
        for n, t in sender.items():
            assert torch.equal(params[n].detach(), t), (step, n)
    sender[name][2, 3] = float("nan")
    assert staged.first_non_finite() == name
    sender[name][2, 3] = 0.0
    assert staged.first_non_finite() is None


def test_a_worker_that_lost_a_senders_shared_tensors_says_so():
    """An update naming tensors shared before (shared=None) reaches a worker that does not hold them (restarted, or
    let go): NotShared, which makes the sender share them again; nothing is staged."""
    from ppo_logprobs.workers.errors import NotShared, UpdateFailed
    from ppo_logprobs.workers.weights.holder import WeightsHolder

    holder = WeightsHolder(load_model("tiny", backend="torch"), 0)
    with pytest.raises(NotShared, match="does not hold the sender's shared tensors"):
        holder.stage_shared("key", None, None, 1)
    assert issubclass(NotShared, UpdateFailed)  # (a transient failure: nothing changed)
    holder.release_shared("key")  # (nothing held: nothing to do)
    with pytest.raises(UpdateFailed, match="no staged weights of version 1"):
        holder.commit(1)
    assert holder.version == 0

"""How tensors split across tensor-parallel ranks (workers/sharding.py), on tiny real HF models: the parts of all
ranks tile each whole tensor (heads whole, rows, columns and vocabulary like torch.tensor_split), a tensor already
cut is refused, check_shardable names what it refuses, and the Shard a cut model holds."""

import pytest
import torch
import transformers

from ppo_logprobs.workers.models.tensor_parallel import cut_model
from ppo_logprobs.workers.sharding import FAMILIES, Part, Shard, check_shardable, head_dim, held_shard, part_of, take

# odd sizes: 37 rows of MLP and 97 of vocabulary leave remainders; 6 query heads of 4 over 2 or 3 key-value heads
QWEN2 = dict(vocab_size=97, hidden_size=24, intermediate_size=37, num_attention_heads=6, num_key_value_heads=2,
             num_hidden_layers=1)
WHOLE = ("embed_tokens.weight", "layernorm.weight", "model.norm.weight", "o_proj.bias", "down_proj.bias")


def tiny(family: str, **config) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**QWEN2, **config}))
    # llama with every bias: o_proj's and down_proj's stay whole (added once, after the sum over ranks)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**QWEN2, "num_key_value_heads": 3, "attention_bias": True, "mlp_bias": True, **config}))


@pytest.mark.parametrize("family, size", [("qwen2", 2), ("llama", 3), ("llama", 1)])
def test_the_parts_of_all_ranks_tile_each_whole_tensor(family, size):
    model = tiny(family)
    config = model.config
    for name, whole in model.named_parameters():
        parts = [part_of(name, tuple(whole.shape), rank, size, config) for rank in range(size)]
        if size == 1 or name.endswith(WHOLE):
            assert parts == [None] * size, name
            continue
        assert None not in parts, name
        dim = parts[0][0]
        assert [p[0] for p in parts] == [dim] * size, name
        cut = [take(whole, p) for p in parts]
        assert torch.equal(torch.cat(cut, dim), whole), name
        for got, want in zip(cut, torch.tensor_split(whole, size, dim), strict=True):
            assert torch.equal(got, want), name
        if "self_attn" in name:  # whole heads on every rank
            assert all(p.start % head_dim(config) == 0 and p.length % head_dim(config) == 0 for p in parts)


def test_each_kind_of_split_takes_its_own_slice():
    config = tiny("qwen2").config
    layer = "model.layers.0."
    want = {  # name: (rank 0's, rank 1's) part, as (dim, start, length)
        "self_attn.q_proj.weight": ((0, 0, 12), (0, 12, 12)),  # 3 of 6 query heads of 4
        "self_attn.q_proj.bias": ((0, 0, 12), (0, 12, 12)),
        "self_attn.k_proj.weight": ((0, 0, 4), (0, 4, 4)),  # 1 of 2 key-value heads
        "self_attn.v_proj.bias": ((0, 0, 4), (0, 4, 4)),
        "self_attn.o_proj.weight": ((1, 0, 12), (1, 12, 12)),  # the columns of the rank's query heads
        "mlp.gate_proj.weight": ((0, 0, 19), (0, 19, 18)),  # 37 rows: the first rank takes the extra one
        "mlp.up_proj.weight": ((0, 0, 19), (0, 19, 18)),
        "mlp.down_proj.weight": ((1, 0, 19), (1, 19, 18)),
        "input_layernorm.weight": (None, None),
    }
    model = tiny("qwen2")
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for name, parts in want.items():
        got = tuple(part_of(layer + name, shapes[layer + name], r, 2, config) for r in (0, 1))
        assert got == tuple(p and Part(*p) for p in parts), name
    assert [part_of("lm_head.weight", (97, 24), r, 2, config) for r in (0, 1)] == [Part(0, 0, 49), Part(0, 49, 48)]
    assert [part_of("lm_head.weight", (97, 24), r, 3, config) for r in (0, 1, 2)] == [
        Part(0, 0, 33), Part(0, 33, 32), Part(0, 65, 32)]
    assert part_of("model.embed_tokens.weight", (97, 24), 1, 2, config) is None


@pytest.mark.parametrize("size", [2, 3])
def test_a_mixtures_experts_split_by_their_intermediate_dimension(size):
    """Qwen2-MoE (routed experts of 13, a shared expert of 11: remainders): every rank holds every expert's slice
    of gate and up rows (from both halves of the fused gate_up) and the matching down columns; the router and the
    shared expert's gate stay whole; the shared expert splits like a dense MLP."""
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(**{**QWEN2, "num_key_value_heads": 3}, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=13, shared_expert_intermediate_size=11)
    model = transformers.Qwen2MoeForCausalLM(config)
    mlp = "model.layers.0.mlp."
    params = dict(model.named_parameters())
    parts = {n: [part_of(mlp + n, tuple(params[mlp + n].shape), r, size, config) for r in range(size)]
             for n in ("experts.gate_up_proj", "experts.down_proj", "shared_expert.gate_proj.weight",
                       "shared_expert.down_proj.weight", "gate.weight", "shared_expert_gate.weight")}
    lengths = [13 // size + (r < 13 % size) for r in range(size)]
    assert [p.length for p in parts["experts.gate_up_proj"]] == lengths
    gate_up = params[mlp + "experts.gate_up_proj"]
    cut = [take(gate_up, p) for p in parts["experts.gate_up_proj"]]
    assert [tuple(c.shape) for c in cut] == [(4, 2 * n, 24) for n in lengths]
    halves = [(c[:, :n], c[:, n:]) for c, n in zip(cut, lengths, strict=True)]
    assert torch.equal(torch.cat([gate for gate, _ in halves], 1), gate_up[:, :13])  # gate rows
    assert torch.equal(torch.cat([up for _, up in halves], 1), gate_up[:, 13:])  # up rows
    for name, dim in (("experts.down_proj", 2), ("shared_expert.gate_proj.weight", 0),
                      ("shared_expert.down_proj.weight", 1)):
        whole = params[mlp + name]
        assert torch.equal(torch.cat([take(whole, p) for p in parts[name]], dim), whole), name
    assert parts["gate.weight"] == parts["shared_expert_gate.weight"] == [None] * size


@pytest.mark.parametrize(
    "name, shape, message",
    [
        ("model.layers.0.self_attn.q_proj.weight", (12, 24), "[12, 24], not 24 entries along dim 0"),
        ("model.layers.0.self_attn.k_proj.bias", (4,), "[4], not 8 entries along dim 0"),
        ("model.layers.0.self_attn.o_proj.weight", (24, 12), "[24, 12], not 24 entries along dim 1"),
        ("model.layers.0.mlp.down_proj.weight", (24, 19), "[24, 19], not 37 entries along dim 1"),
        ("model.layers.0.mlp.down_proj.weight", (37,), "[37], not 37 entries along dim 1"),
        ("lm_head.weight", (98, 24), "[98, 24], not 97 entries along dim 0"),
    ],
)
def test_a_tensor_that_is_not_the_whole_models_is_refused(name, shape, message):
    config = tiny("qwen2").config
    with pytest.raises(ValueError) as refused:
        part_of(name, shape, 0, 2, config)
    assert str(refused.value) == (f"{name} has shape {message} as the whole model's (already cut, or another "
                                  "model's tensor)")


def test_what_cannot_be_sharded_is_named():
    config = tiny("qwen2").config
    for size in (1, 2):
        check_shardable(config, size)
    with pytest.raises(ValueError) as refused:
        check_shardable(config, 3)  # 6 query heads divide among 3 ranks, 2 key-value heads do not
    assert str(refused.value) == "num_key_value_heads = 2 does not divide among 3 ranks"
    with pytest.raises(ValueError) as refused:
        check_shardable(config, 4)
    assert str(refused.value) == "num_attention_heads = 6 does not divide among 4 ranks"
    assert FAMILIES == ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "qwen3_moe", "qwen2_moe", "mixtral")
    with pytest.raises(ValueError) as refused:
        check_shardable(transformers.Phi3Config(vocab_size=97, hidden_size=24, num_attention_heads=6), 2)
    assert str(refused.value) == ("tensor parallelism supports llama, mistral, qwen2, qwen3, gemma3_text, "
                                  "qwen3_moe, qwen2_moe, mixtral, not model_type 'phi3'")


def test_heads_of_their_own_size_split_by_the_configs_head_dim():
    config = transformers.Qwen3Config(**{**QWEN2, "num_attention_heads": 4, "head_dim": 10})
    assert head_dim(config) == 10 and head_dim(tiny("qwen2").config) == 4  # Qwen2: hidden_size // heads
    parts = [part_of("model.layers.0.self_attn.q_proj.weight", (40, 24), r, 2, config) for r in (0, 1)]
    assert parts == [Part(0, 0, 20), Part(0, 20, 20)]
    assert part_of("model.layers.0.self_attn.o_proj.weight", (24, 40), 1, 2, config) == Part(1, 20, 20)


@pytest.mark.parametrize("tied, rank", [(True, 1), (False, 0)])
def test_a_cut_model_holds_its_shard(tied, rank):
    model = tiny("qwen2", tie_word_embeddings=tied)
    assert held_shard(model) is None
    assert held_shard(cut_model(tiny("qwen2", tie_word_embeddings=tied), 0, 1)) is None  # one rank: the whole
    cut_model(model, rank, 2)
    assert held_shard(model) == Shard(rank, 2, tied)
    assert model.lm_head.weight.shape[0] == (49, 48)[rank] and model.model.embed_tokens.weight.shape[0] == 97

"""Checkpoints read into staging: refusals before any data is read, exact bytes, dtype conversion, shards, ties."""

import json
import os
import struct

import pytest
import torch

from ppo_logprobs.workers import load_model
from ppo_logprobs.workers.errors import CheckpointNotFound, IncompatibleWeights, InvalidCheckpoint
from ppo_logprobs.workers.models.load_model import TINY_CONFIG
from ppo_logprobs.workers.weights import checkpoint
from ppo_logprobs.workers.weights.checkpoint import read_checkpoint, read_index

from ...helpers import perturbed, save, with_tensors


def params(model):
    return dict(model.named_parameters())


def test_a_checkpoint_lands_bitwise_and_only_on_commit(tmp_path):
    source = perturbed(1)
    path = save(source, tmp_path / "ckpt")
    model = load_model("tiny", backend="torch")
    before = {n: p.clone() for n, p in params(model).items()}
    staged = read_checkpoint(model, path)
    assert all(torch.equal(p, before[n]) for n, p in params(model).items())  # staging changes nothing
    staged.commit(model)
    for name, p in params(source).items():
        assert torch.equal(params(model)[name], p), name


def test_shards_ties_conversion_and_chunks(tmp_path, monkeypatch):
    source = perturbed(2, tie_word_embeddings=True)
    path = save(source, tmp_path / "tied", max_shard_size="100KB")
    assert len(list((tmp_path / "tied").glob("*.safetensors"))) > 2
    assert "lm_head.weight" not in read_index(path)  # tied: saved once
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(**{**TINY_CONFIG, "tie_word_embeddings": True})).to(torch.bfloat16)
    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", 4096)  # tensors read in many element ranges
    read_checkpoint(model, path).commit(model)
    for name, p in params(source).items():
        assert torch.equal(params(model)[name], p.to(torch.bfloat16)), name
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("config, message", [
    (dict(vocab_size=600), r"'lm_head.weight' has shape \[600, 64\] in the checkpoint and \[503, 64\] in the model"),
    (dict(num_hidden_layers=3), r"the checkpoint has 3 layers, the model 2"),
    (dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1), r"has shape \[.*32.*\] in the checkpoint"),
])
def test_a_checkpoint_of_another_shape_is_refused(tmp_path, config, message):
    path = save(perturbed(3, **config), tmp_path / "other")
    with pytest.raises(IncompatibleWeights, match=message):
        read_checkpoint(load_model("tiny"), path)


def test_tensors_the_model_has_no_place_for_are_left_unread_as_hf_leaves_them(tmp_path, caplog):
    """A value head beside the policy and an old rotary buffer: a reload (and a tensor-parallel rank's read) takes
    the checkpoint as HF's loader does, bitwise, naming them in one line; it refused them before."""
    source = perturbed(4)
    path = with_tensors(save(source, tmp_path / "critic"), **{
        "v_head.summary.weight": torch.ones(1, 64), "model.layers.1.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    model = load_model("tiny", backend="torch")
    with caplog.at_level("WARNING", logger="ppo_logprobs"):
        read_checkpoint(model, path).commit(model)
    for name, p in params(source).items():
        assert torch.equal(params(model)[name], p), name
    assert [r.getMessage() for r in caplog.records if r.name.startswith("ppo_logprobs")] == [
        f"{path!r} has 2 tensors the model does not use, left unread: "
        "'model.layers.1.self_attn.rotary_emb.inv_freq', 'v_head.summary.weight'"]


@pytest.mark.parametrize("extra, message", [
    ({"model.layers.0.mlp.down_proj.bias": torch.ones(64)},  # a module of the model, a parameter it lacks
     r"the checkpoint has 1 tensors the model does not, e.g. 'model.layers.0.mlp.down_proj.bias'"),
    ({"model.layers.1.self_attn.q_norm.weight": torch.ones(16)},  # Qwen3's q norm: a module it lacks under its own
     r"the checkpoint has 1 tensors the model does not, e.g. 'model.layers.1.self_attn.q_norm.weight'"),
    ({"model.layers.2.v_head.weight": torch.ones(1, 64)},  # a layer past the model's last
     r"the checkpoint has 1 tensors the model does not, e.g. 'model.layers.2.v_head.weight'; the checkpoint has 3 "
     "layers, the model 2"),
])
def test_tensors_that_say_the_checkpoint_is_another_models_are_still_refused(tmp_path, caplog, extra, message):
    path = with_tensors(save(perturbed(4), tmp_path / "other"), **extra, **{"v_head.weight": torch.ones(1, 64)})
    with pytest.raises(IncompatibleWeights, match=message):
        read_checkpoint(load_model("tiny", backend="torch"), path)
    assert not [r for r in caplog.records if r.name.startswith("ppo_logprobs")]  # (nothing said left unread)


def test_a_checkpoint_missing_parameters_is_refused(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "part").mkdir()
    save_file({"lm_head.weight": torch.zeros(503, 64)}, str(tmp_path / "part" / "model.safetensors"))
    lacks = r"the checkpoint lacks 26 of the model's parameters, e.g. 'model.embed_tokens.weight'"
    with pytest.raises(IncompatibleWeights, match=lacks):
        read_checkpoint(load_model("tiny"), str(tmp_path / "part"))


def write(path, data: bytes):
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return str(path.parent)


def special(path, make):
    """A checkpoint directory whose shard is not a regular file (made by `make`, e.g. os.mkfifo): reading it must
    not block, and must be refused."""
    path.parent.mkdir()
    make(path)
    return str(path.parent)


def test_unreadable_checkpoints_are_refused_naming_the_problem(tmp_path):
    good = save(perturbed(4), tmp_path / "good")
    shard = next((tmp_path / "good").glob("*.safetensors"))
    data = shard.read_bytes()
    cases = [
        (str(tmp_path / "missing"), CheckpointNotFound, "no checkpoint directory at"),
        ("/etc/passwd", CheckpointNotFound, "no checkpoint directory at '/etc/passwd'"),
        ("a/b\x00c", CheckpointNotFound, "no checkpoint directory"),
        (str(tmp_path), InvalidCheckpoint, "has no \\*.safetensors weights"),
        (write(tmp_path / "trunc" / shard.name, data[: len(data) - 100]), InvalidCheckpoint,
         r"is truncated: tensor '.*' ends at byte \d+, the file has \d+"),
        (write(tmp_path / "short" / "a.safetensors", b"\x01\x02"), InvalidCheckpoint, "not even a safetensors header"),
        (write(tmp_path / "garbage" / "a.safetensors", b"\x10" + bytes(7) + b"not json at all!"), InvalidCheckpoint,
         "malformed safetensors header"),
        (write(tmp_path / "huge" / "a.safetensors", struct.pack("<Q", 1 << 40) + b"{}"), InvalidCheckpoint,
         "not a safetensors file or is truncated"),
        (write(tmp_path / "odd" / "a.safetensors", _header("F32", [3], 8)), InvalidCheckpoint,
         r"tensor 'x' has 8 bytes for shape \[3\]"),
        (write(tmp_path / "dtype" / "a.safetensors", _header("C64", [], 8)), InvalidCheckpoint,
         "tensor 'x' is stored as C64, which is not read here \\(only F64, F32, F16, BF16, .*: no quantized"),
        (write(tmp_path / "fp8" / "a.safetensors", _header("F8_E4M3", [8], 8)), InvalidCheckpoint,
         "tensor 'x' is stored as F8_E4M3, which is not read here"),
        (write(tmp_path / "entry" / "a.safetensors", _header("F32", ["a"], 12)), InvalidCheckpoint,
         "tensor 'x' has a malformed or unsupported entry"),
        (write(tmp_path / "deep" / "a.safetensors", struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000),
         InvalidCheckpoint, "malformed safetensors header"),
        (special(tmp_path / "fifo" / shard.name, os.mkfifo), InvalidCheckpoint,
         f"{shard.name} is not a regular file \\(a FIFO\\)"),
        (special(tmp_path / "dir" / shard.name, os.mkdir), InvalidCheckpoint,
         "is not a regular file \\(a directory\\)"),
    ]
    model = load_model("tiny")
    before = {n: p.clone() for n, p in params(model).items()}
    for path, error, message in cases:
        with pytest.raises(error, match=message):
            read_checkpoint(model, path)
    assert all(torch.equal(p, before[n]) for n, p in params(model).items())
    read_checkpoint(model, good)  # the reader is still usable


def _header(dtype, shape, nbytes) -> bytes:
    """A one-tensor safetensors file "x" whose header says this dtype, shape and byte count."""
    text = json.dumps({"x": {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}}).encode()
    return struct.pack("<Q", len(text)) + text + bytes(nbytes)


@pytest.mark.parametrize("tied", [False, True])
def test_a_tensor_parallel_rank_reads_its_parts(tmp_path, monkeypatch, tied):
    """A model cut for rank r of 2 (heads, MLP rows and columns, vocabulary rows: models/tensor_parallel.py) reads
    exactly shard_of(the whole tensor) of each checkpoint tensor; column parts in several row blocks; a tied
    model's head its rows of the checkpoint's embedding (an untied model refuses a checkpoint without a head)."""
    from ppo_logprobs.workers.models.tensor_parallel import cut_model, shard_of

    source = perturbed(4, tie_word_embeddings=tied)
    path = save(source, tmp_path / "whole")
    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", 1000)  # column parts read a few rows at a time
    whole = params(source)
    if tied:
        with pytest.raises(IncompatibleWeights, match="the checkpoint lacks 1 of the model's parameters, e.g. 'lm_he"):
            read_checkpoint(cut_model(load_model("tiny", backend="torch"), 0, 2), path)
    for rank in (0, 1):
        model = cut_model(perturbed(0, tie_word_embeddings=tied), rank, 2)
        read_checkpoint(model, path).commit(model)
        for name, p in params(model).items():
            want = shard_of(name, whole.get(name, whole["model.embed_tokens.weight"]), rank, 2, model.config)
            assert torch.equal(p, want), name
        assert model.lm_head.weight.shape[0] == (252 if rank == 0 else 251)


def test_a_tensor_parallel_rank_refuses_another_models_tensors(tmp_path):
    from ppo_logprobs.workers.models.tensor_parallel import cut_model

    path = save(perturbed(5, intermediate_size=96), tmp_path / "other")
    with pytest.raises(IncompatibleWeights, match=r"mlp.down_proj.weight has shape \[64, 96\], not 128 entries"):
        read_checkpoint(cut_model(load_model("tiny", backend="torch"), 0, 2), path)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
def test_the_first_non_finite_staged_tensor_is_named(monkeypatch, bad, device):
    """Pieces of 5 elements: the bad value sits in the last piece of the second tensor, past the first piece."""
    from ppo_logprobs.workers.weights import staging

    monkeypatch.setattr(staging, "FINITE_CHUNK", 5)
    layout = staging.Layout.of([("a", (3, 4), torch.float32), ("b", (17,), torch.bfloat16), ("c", (2,), torch.float16),
                                ("d", (0, 4), torch.float32)])
    staged = staging.StagedWeights(layout, torch.device(device))
    for entry in layout.entries:
        staged.tensor(entry).copy_(torch.randn(entry.shape))
    if bad is not None:
        staged.tensor(layout.entries[1])[16] = bad
    assert staged.first_non_finite() == (None if bad is None else "b")


MOE = {  # family: (config, model, extra config) of a tiny mixture of experts
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, moe_intermediate_size=24)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts=4, moe_intermediate_size=24,
                                                               shared_expert_intermediate_size=40)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, intermediate_size=24)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, intermediate_size=24)),
}


def tiny_moe(family: str, seed: int):
    import transformers

    config_name, model_name, extra = MOE[family]
    config = getattr(transformers, config_name)(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=256, num_experts_per_tok=2, **extra)
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).eval()


@pytest.mark.parametrize("family", list(MOE))
def test_a_mixtures_checkpoint_as_hf_saves_it_updates_the_fused_experts(family, tmp_path):
    """save_pretrained writes one tensor per expert and projection (Mixtral's under block_sparse_moe, w1/w3/w2);
    transformers fuses them into [E, 2I, H] and [E, H, I] when it loads. An update from such a checkpoint lands
    in the fused parameters bit for bit, as HF's own loading puts them."""
    new = tiny_moe(family, 1)
    new.save_pretrained(tmp_path)
    model = tiny_moe(family, 0)
    staged = read_checkpoint(model, str(tmp_path))
    staged.commit(model)
    want = params(new)
    assert params(model).keys() == want.keys()
    for name, p in params(model).items():
        assert torch.equal(p, want[name]), name


def test_a_mixtures_checkpoint_missing_an_expert_or_with_a_wrong_one_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_moe("qwen3_moe", 1).save_pretrained(tmp_path / "whole")
    tensors = load_file(tmp_path / "whole" / "model.safetensors")
    model = tiny_moe("qwen3_moe", 0)
    for case, change in (("missing", lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight")),
                         ("wrong", lambda t: t.update({"model.layers.0.mlp.experts.2.down_proj.weight":
                                                       torch.zeros(32, 23)}))):
        broken = dict(tensors)
        change(broken)
        (tmp_path / case).mkdir()
        save_file(broken, tmp_path / case / "model.safetensors")
        message = ("lacks expert 3's up projection of 'model.layers.1.mlp.experts.gate_up_proj'" if case == "missing"
                   else r"'model.layers.0.mlp.experts.2.down_proj.weight' has shape \[32, 23\]")
        with pytest.raises(IncompatibleWeights, match=message):
            read_checkpoint(model, str(tmp_path / case))

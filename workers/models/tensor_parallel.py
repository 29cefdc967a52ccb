"""Tensor parallelism for the supported decoder families: shard one HF model instance across the ranks of a
process group (Megatron's layout).

Attention: q/k/v projections split by heads (rank r keeps a contiguous block of num_heads / N query heads and
num_kv_heads / N key-value heads, with their biases), o_proj by the matching input columns. MLP: gate/up split by
rows (`tensor_split` of the intermediate size), down_proj by the matching columns. o_proj and down_proj then sum
their partial outputs over the group (all_reduce; their bias is added once, after it). Scoring only: the sharded
body refuses to run with gradients. The LM
head keeps the rows `tensor_split(arange(V), N)[r]` and scores through the vocab-parallel fused head (patch_model's
`process_group`). Embeddings and norms stay whole on every rank.

Which tensors split how is data (`_SPLITS`, by parameter name); `shard_of(name, full, rank, size, config)` gives a
rank its part of a full tensor, so checkpoints and weight streams can be cut the same way.
"""

from __future__ import annotations

import types
from functools import partial
from typing import Literal

import torch
from torch import Tensor, nn

from ..head.vocab_parallel import sum_over
from .varlen_attention import head_dim

Split = Literal["q_heads", "kv_heads", "in_q_heads", "rows", "columns", "vocab"]

# parameter name suffix -> how it splits (names not listed stay whole on every rank)
_SPLITS: dict[str, Split] = {
    "self_attn.q_proj.weight": "q_heads", "self_attn.q_proj.bias": "q_heads",
    "self_attn.k_proj.weight": "kv_heads", "self_attn.k_proj.bias": "kv_heads",
    "self_attn.v_proj.weight": "kv_heads", "self_attn.v_proj.bias": "kv_heads",
    "self_attn.o_proj.weight": "in_q_heads",
    "mlp.gate_proj.weight": "rows", "mlp.gate_proj.bias": "rows",
    "mlp.up_proj.weight": "rows", "mlp.up_proj.bias": "rows",
    "mlp.down_proj.weight": "columns",
    "lm_head.weight": "vocab",
}
_REDUCED = ("self_attn.o_proj", "mlp.down_proj")  # modules whose outputs are summed over the group
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


def check_shardable(config, size: int) -> None:
    """ValueError naming what keeps this model from `size` ranks."""
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        raise ValueError(f"tensor parallelism supports {', '.join(FAMILIES)}, not model_type {family!r}")
    for field in ("num_attention_heads", "num_key_value_heads"):
        if getattr(config, field) % size:
            raise ValueError(f"{field} = {getattr(config, field)} does not divide among {size} ranks")


def part_of(name: str, shape: tuple[int, ...], rank: int, size: int, config) -> tuple[int, int, int] | None:
    """Where this rank's part of the whole tensor `name` of `shape` lies, (dim, start, length), or None when it
    stays whole. ValueError when `shape` is not the whole model's."""
    how = next((s for suffix, s in _SPLITS.items() if name.endswith(suffix)), None)
    if how is None or size == 1:
        return None
    heads = config.num_key_value_heads if how == "kv_heads" else config.num_attention_heads
    dim = 1 if how in ("in_q_heads", "columns") else 0
    whole = {"rows": config.intermediate_size, "columns": config.intermediate_size, "vocab": config.vocab_size}
    expected = whole.get(how, heads * head_dim(config))
    if len(shape) <= dim or shape[dim] != expected:
        raise ValueError(f"{name} has shape {list(shape)}, not {expected} entries along dim {dim} as the whole "
                         "model's (already cut, or another model's tensor)")
    if how in ("q_heads", "kv_heads", "in_q_heads"):
        per = expected // size
        return dim, rank * per, per
    lengths = [expected // size + (i < expected % size) for i in range(size)]  # torch.tensor_split's
    return dim, sum(lengths[:rank]), lengths[rank]


def shard_of(name: str, full: Tensor, rank: int, size: int, config) -> Tensor:
    """This rank's part of the full tensor `name` (a view; the tensor itself when it stays whole)."""
    where = part_of(name, tuple(full.shape), rank, size, config)
    return full if where is None else full.narrow(*where)


def _reduced_forward(self: nn.Linear, x: Tensor, *, group) -> Tensor:
    # x: [..., in / N] -> this rank's partial [..., out], summed over the group, then the bias once
    y = nn.functional.linear(x, self.weight)
    if y.requires_grad:
        raise RuntimeError("a tensor-parallel model scores under torch.no_grad(): its layers carry no gradients "
                           "across ranks (the fused head does)")
    sum_over(y, group)
    return y if self.bias is None else y + self.bias


def cut_model(model: nn.Module, rank: int, size: int) -> nn.Module:
    """Replaces this model instance's parameters by this rank's parts (in place; on any device, meta included)."""
    config = model.config
    check_shardable(config, size)
    if size == 1:
        return model
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        part = shard_of(name, param.data, rank, size, config)
        if part is param.data:
            continue
        owner, attr = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        setattr(owner, attr, nn.Parameter(part.clone(), requires_grad=param.requires_grad))
    if tied:  # the head now has rows of its own; keep the config honest for save_pretrained
        config.tie_word_embeddings = False
    model.tp_shard = (rank, size)  # read by the loaders (weights/staging.py rank_parts)
    model.tp_tied = tied  # the head's part is then cut from a checkpoint's or stream's embedding
    return model


def connect(model: nn.Module, group) -> nn.Module:
    """Makes a cut model's o_proj and down_proj sum their outputs over `group`."""
    if group.size() > 1:
        for name, module in model.named_modules():
            if name.endswith(_REDUCED):
                module.forward = types.MethodType(partial(_reduced_forward, group=group), module)
    return model


def shard_model(model: nn.Module, group) -> nn.Module:
    """Cuts this model instance to this rank's parts and connects it to `group`. Score it with
    `patch_model(model, process_group=group)`."""
    return connect(cut_model(model, group.rank(), group.size()), group)


def build_sharded(config, rank: int, size: int, *, device, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """This rank's part of a model of `config` with random weights (HF's initialisation), built without the whole
    model ever existing anywhere: for models whose checkpoint does not fit (benchmarks) and for weights that an
    update fills. Tensors that stay whole get the same values on every rank."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    cut_model(model, rank, size)
    model.to_empty(device=device)
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(seed)  # the embeddings are drawn first, alike on every rank; then the rank's own parts
        model.initialize_weights()
    return model.eval()

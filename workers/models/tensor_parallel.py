"""Tensor parallelism for the supported decoder families: shard one HF model instance across the ranks of a
process group (Megatron's layout).

Attention: q/k/v projections split by heads (rank r keeps a contiguous block of num_heads / N query heads and
num_kv_heads / N key-value heads, with their biases), o_proj by the matching input columns. MLP: gate/up split by
rows (`tensor_split` of the intermediate size), down_proj by the matching columns. o_proj and down_proj then sum
their partial outputs over the group (all_reduce; their bias is added once, after it). A mixture's experts split
the same way, every expert by its intermediate dimension (gate_up_proj [E, 2I, H] by the rows of both halves,
down_proj [E, H, I] by columns); the router stays whole, so every rank routes every token alike, and the experts'
combined partial output is summed over the group (a shared expert splits like a dense MLP). Expert parallelism
(whole experts per rank) would move tokens between ranks by their routing instead: more traffic and a batch-dependent
layout, for no gain at the sizes one node holds. Scoring only: the sharded body refuses to run with gradients. The LM
head keeps the rows `tensor_split(arange(V), N)[r]` and scores through the vocab-parallel fused head (patch_model's
`process_group`). Embeddings and norms stay whole on every rank.

Which tensors split how is data (workers/sharding.py, by parameter name); `shard_of(name, full, rank, size, config)`
gives a rank its part of a full tensor, so checkpoints and weight streams are cut the same way.
"""

from __future__ import annotations

import types
from functools import partial

import torch
from torch import Tensor, nn

from ..distributed import sum_over
from ..sharding import Shard, check_shardable, part_of, take

_REDUCED = ("self_attn.o_proj", "mlp.down_proj", "mlp.shared_expert.down_proj")  # outputs summed over the group


def shard_of(name: str, full: Tensor, rank: int, size: int, config) -> Tensor:
    """This rank's part of the full tensor `name` (a view, but for a fused gate/up; the tensor itself when it stays
    whole)."""
    return take(full, part_of(name, tuple(full.shape), rank, size, config))


def _reduced_forward(self: nn.Linear, x: Tensor, *, group) -> Tensor:
    # x: [..., in / N] -> this rank's partial [..., out], summed over the group, then the bias once
    y = nn.functional.linear(x, self.weight)
    if y.requires_grad:
        raise RuntimeError("a tensor-parallel model scores under torch.no_grad(): its layers carry no gradients "
                           "across ranks (the fused head does)")
    sum_over(y, group)
    return y if self.bias is None else y + self.bias


def _reduced_experts(module: nn.Module, args, y: Tensor, *, group) -> Tensor:
    # a mixture's experts, after the combine: this rank's slice of every expert's intermediate dimension gave a
    # partial [T, H], summed over the group (a forward hook: fuse_body replaces the experts' forward)
    if y.requires_grad:
        raise RuntimeError("a tensor-parallel model scores under torch.no_grad(): its layers carry no gradients "
                           "across ranks (the fused head does)")
    return sum_over(y, group)


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
    model.ppo_shard = Shard(rank, size, tied)  # read through sharding.held_shard (the loaders, the worker)
    return model


def connect(model: nn.Module, group) -> nn.Module:
    """Makes a cut model's o_proj and down_proj (and a mixture's experts) sum their outputs over `group`."""
    if group.size() > 1:
        for name, module in model.named_modules():
            if name.endswith(_REDUCED):
                module.forward = types.MethodType(partial(_reduced_forward, group=group), module)
            elif name.endswith("mlp.experts") and not any(  # (once: connect may run again on a model)
                    getattr(hook, "func", None) is _reduced_experts for hook in module._forward_hooks.values()):
                module.register_forward_hook(partial(_reduced_experts, group=group))
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

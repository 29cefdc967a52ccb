"""How a decoder's tensors split across the ranks of a tensor-parallel worker: data (by parameter name) and config
arithmetic only, below both the models (which cut themselves by it) and the weights (which cut checkpoints and
streams by it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .families import FAMILIES as ALL_FAMILIES


@dataclass(frozen=True)
class Shard:
    """What part of a model a tensor-parallel rank holds: rank `rank` of `size`, and whether its head was tied to
    the embedding before the cut (its part is then cut from an update's embedding when the update has no head)."""

    rank: int
    size: int
    tied: bool = False


def held_shard(model) -> Shard | None:
    """The part of the whole model this one holds (models/tensor_parallel.cut_model marks it), None for a whole
    model."""
    return getattr(model, "ppo_shard", None)


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


Split = Literal["q_heads", "kv_heads", "in_q_heads", "rows", "columns", "vocab"]

# parameter name suffix -> how it splits (names not listed stay whole on every rank)
SPLITS: dict[str, Split] = {
    "self_attn.q_proj.weight": "q_heads", "self_attn.q_proj.bias": "q_heads",
    "self_attn.k_proj.weight": "kv_heads", "self_attn.k_proj.bias": "kv_heads",
    "self_attn.v_proj.weight": "kv_heads", "self_attn.v_proj.bias": "kv_heads",
    "self_attn.o_proj.weight": "in_q_heads",
    "mlp.gate_proj.weight": "rows", "mlp.gate_proj.bias": "rows",
    "mlp.up_proj.weight": "rows", "mlp.up_proj.bias": "rows",
    "mlp.down_proj.weight": "columns",
    "lm_head.weight": "vocab",
}
FAMILIES = tuple(name for name, family in ALL_FAMILIES.items() if family.tensor_parallel)


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
    how = next((s for suffix, s in SPLITS.items() if name.endswith(suffix)), None)
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

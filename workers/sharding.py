"""How a decoder's tensors split across the ranks of a tensor-parallel worker: data (by parameter name) and config
arithmetic only, below both the models (which cut themselves by it) and the weights (which cut checkpoints and
streams by it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

if TYPE_CHECKING:  # (the pool's handles import this module in processes that never load torch)
    from torch import Tensor

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


class Part(NamedTuple):
    """Where a rank's part of a whole tensor lies: `length` entries from `start` along `dim`; with `blocks` > 1,
    that dim is `blocks` equal blocks (a fused gate/up: gate rows, then up rows) and the part is the same slice of
    each, in order."""

    dim: int
    start: int
    length: int
    blocks: int = 1


def take(whole: Tensor, part: Part | None) -> Tensor:
    """The part of a whole tensor (a view of it, except for a part of several blocks)."""
    if part is None:
        return whole
    if part.blocks == 1:
        return whole.narrow(part.dim, part.start, part.length)
    blocks = whole.unflatten(part.dim, (part.blocks, -1))
    return blocks.narrow(part.dim + 1, part.start, part.length).flatten(part.dim, part.dim + 1)


def part_shape(shape: tuple[int, ...], part: Part | None) -> tuple[int, ...]:
    if part is None:
        return tuple(shape)
    return tuple(shape[: part.dim]) + (part.length * part.blocks,) + tuple(shape[part.dim + 1 :])


Split = Literal["q_heads", "kv_heads", "in_q_heads", "rows", "columns", "vocab", "expert_rows", "expert_columns",
                "shared_rows", "shared_columns"]

# parameter name suffix -> how it splits (names not listed stay whole on every rank). Experts split like the dense
# MLP, by their intermediate dimension: every rank holds every expert's slice, routes every token alike (the
# router stays whole) and sums its partial outputs over the group after the combine.
SPLITS: dict[str, Split] = {
    "self_attn.q_proj.weight": "q_heads", "self_attn.q_proj.bias": "q_heads",
    "self_attn.k_proj.weight": "kv_heads", "self_attn.k_proj.bias": "kv_heads",
    "self_attn.v_proj.weight": "kv_heads", "self_attn.v_proj.bias": "kv_heads",
    "self_attn.o_proj.weight": "in_q_heads",
    "mlp.gate_proj.weight": "rows", "mlp.gate_proj.bias": "rows",
    "mlp.up_proj.weight": "rows", "mlp.up_proj.bias": "rows",
    "mlp.down_proj.weight": "columns",
    "mlp.experts.gate_up_proj": "expert_rows", "mlp.experts.down_proj": "expert_columns",  # [E, 2I, H], [E, H, I]
    "mlp.shared_expert.gate_proj.weight": "shared_rows", "mlp.shared_expert.up_proj.weight": "shared_rows",
    "mlp.shared_expert.down_proj.weight": "shared_columns",
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


def expert_size(config) -> int:
    """The intermediate size of each routed expert (Qwen's MoE configs name it apart from the dense MLP's)."""
    return getattr(config, "moe_intermediate_size", None) or config.intermediate_size


def part_of(name: str, shape: tuple[int, ...], rank: int, size: int, config) -> Part | None:
    """Where this rank's part of the whole tensor `name` of `shape` lies, or None when it stays whole. ValueError
    when `shape` is not the whole model's."""
    how = next((s for suffix, s in SPLITS.items() if name.endswith(suffix)), None)
    if how is None or size == 1:
        return None
    heads = config.num_key_value_heads if how == "kv_heads" else config.num_attention_heads
    dim = {"in_q_heads": 1, "columns": 1, "shared_columns": 1, "expert_rows": 1, "expert_columns": 2}.get(how, 0)
    blocks = 2 if how == "expert_rows" else 1
    whole = {"rows": config.intermediate_size, "columns": config.intermediate_size, "vocab": config.vocab_size,
             "expert_rows": expert_size(config), "expert_columns": expert_size(config),
             "shared_rows": getattr(config, "shared_expert_intermediate_size", None),
             "shared_columns": getattr(config, "shared_expert_intermediate_size", None)}
    each = whole.get(how, heads * head_dim(config))
    if len(shape) <= dim or shape[dim] != each * blocks:
        raise ValueError(f"{name} has shape {list(shape)}, not {each * blocks} entries along dim {dim} as the whole "
                         "model's (already cut, or another model's tensor)")
    if how in ("q_heads", "kv_heads", "in_q_heads"):
        per = each // size
        return Part(dim, rank * per, per)
    lengths = [each // size + (i < each % size) for i in range(size)]  # torch.tensor_split's
    return Part(dim, sum(lengths[:rank]), lengths[rank], blocks)

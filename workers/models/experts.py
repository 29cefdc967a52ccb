"""Mixture-of-experts layers for scoring: the experts of HF's MoE blocks (`<prefix>Experts`: 3D `gate_up_proj`
[E, 2I, H] and `down_proj` [E, H, I], called with each token's routed experts and their weights), run over the
token-expert assignments sorted by expert: one grouped product for gate/up with the SiLU-gated middle (fused on
the Triton backend), one for down, and each token's outputs combined back in a fixed order (its experts by their
rank in the router's top k) in fp32, rounded once. The router stays HF's (softmax or sigmoid, norm_topk_prob: the
family's), a plain linear layer whose rows are as invariant as every other GEMM's.

A token's output does not depend on which other tokens share the call where the grouped product's rows do not
depend on how many rows each expert got: on the Triton backend (CUDA by default) the products are one grouped
kernel with a fixed tiling (grouped_gemm.py); the torch formula (the CPU) multiplies expert by expert.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .grouped_gemm import grouped_gate_up, grouped_gemm, grouped_linear


def sort_by_expert(top_k_index: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """(order, counts): the assignments (token t's rank-r expert is assignment t * k + r) sorted by expert, then by
    assignment (a stable sort), and how many each expert got ([num_experts + 1]: the last counts assignments to
    `num_experts`, HF's mark of none, which stay last and are not computed)."""
    flat = top_k_index.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts + 1)


def experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, *,
                    backend: str = "auto") -> Tensor:
    """HF's `<prefix>Experts.forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`, sorted by
    expert and combined in rank order (see the module's docstring)."""
    from ..head import resolve_backend

    t, k = top_k_index.shape
    order, counts = sort_by_expert(top_k_index, self.num_experts)
    sizes = counts.tolist()
    triton_ = resolve_backend(backend, hidden_states.device) == "triton"
    linear = grouped_gemm if triton_ else grouped_linear
    x = hidden_states[order // k]  # [T * k, H], by expert
    if triton_ and type(self.act_fn).__name__ in ("SiLUActivation", "SiLU"):
        middle = grouped_gate_up(x, self.gate_up_proj, sizes)  # (gate, up and the middle in one kernel)
    else:
        gate, up = linear(x, self.gate_up_proj, sizes).chunk(2, dim=-1)
        middle = self.act_fn(gate) * up
    out = linear(middle, self.down_proj, sizes)  # [T * k, H], by expert
    per_rank = torch.empty_like(out)
    per_rank[order] = out
    per_rank = per_rank.view(t, k, -1)
    weights = top_k_weights.float()
    combined = per_rank[:, 0].float() * weights[:, :1]
    for r in range(1, k):  # (rank order, one rounding at the end)
        combined += per_rank[:, r].float() * weights[:, r : r + 1]
    return combined.to(hidden_states.dtype)

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

from .grouped_gemm import combine, grouped_gate_up, grouped_gemm, grouped_linear


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
    if resolve_backend(backend, hidden_states.device) == "triton":  # (nothing read back to the host)
        if type(self.act_fn).__name__ in ("SiLUActivation", "SiLU"):  # gate, up and the middle in one kernel
            middle = grouped_gate_up(hidden_states, self.gate_up_proj, counts, source=order // k)
        else:
            gate, up = grouped_gemm(hidden_states[order // k], self.gate_up_proj, counts).chunk(2, dim=-1)
            middle = self.act_fn(gate) * up
        out = grouped_gemm(middle, self.down_proj, counts)  # [T * k, H], by expert
        position = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))
        return combine(out, position.view(t, k), top_k_weights)
    sizes = counts.tolist()
    gate, up = grouped_linear(hidden_states[order // k], self.gate_up_proj, sizes).chunk(2, dim=-1)
    out = grouped_linear(self.act_fn(gate) * up, self.down_proj, sizes)
    per_rank = torch.empty_like(out)
    per_rank[order] = out
    per_rank = per_rank.view(t, k, -1)
    weights = top_k_weights.float()
    combined = per_rank[:, 0].float() * weights[:, :1]
    for r in range(1, k):  # (rank order, one rounding at the end)
        combined += per_rank[:, r].float() * weights[:, r : r + 1]
    return combined.to(hidden_states.dtype)

"""Mixture-of-experts layers for scoring: the experts of HF's MoE blocks (`<prefix>Experts`: 3D `gate_up_proj`
[E, 2I, H] and `down_proj` [E, H, I], called with each token's routed experts and their weights), run over the
token-expert assignments sorted by expert: one grouped product for gate/up with the SiLU-gated middle (fused on
the Triton backend), one for down, and each token's outputs combined back in a fixed order (its experts by their
rank in the router's top k) in fp32, rounded once. The router's linear layer is a plain GEMM whose rows are as
invariant as every other's; its softmax top-k runs in one kernel (router.py).

A token's output does not depend on which other tokens share the call where the grouped product's rows do not
depend on how many rows each expert got: on the Triton backend (CUDA by default) the products are one grouped
kernel with a fixed tiling (grouped_gemm.py); the torch formula (the CPU) multiplies expert by expert.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from .grouped_gemm import combine, grouped_gate_up, grouped_gemm, grouped_linear, groups


class Sorted(NamedTuple):
    """Assignments (token t's rank-r expert is assignment t * k + r) sorted by expert, then by assignment."""
    order: Tensor  # [T * k]: the assignment at each place
    source: Tensor  # [T * k]: its token (order // k)
    position: Tensor  # [T * k]: each assignment's place (order's inverse)
    counts: Tensor  # [experts + 1]: how many each expert got; the last, HF's mark of none (stays last)


_CHUNK = 1024  # assignments a program sorts (any size gives the same places: the sort is stable and exact)


@triton.jit
def _chunk_counts_kernel(ids_ptr, hist_ptr, A, CHUNK: tl.constexpr, BINS: tl.constexpr):
    at = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + at, mask=at < A, other=BINS - 1).to(tl.int32)  # (past the end: the last bin)
    tl.store(hist_ptr + tl.program_id(0) * BINS + tl.arange(0, BINS), tl.histogram(ids, BINS))


@triton.jit
def _place_kernel(ids_ptr, hist_ptr, start_ptr, order_ptr, source_ptr, position_ptr, counts_ptr, A, K, chunks,
                  GROUPS: tl.constexpr, CHUNK: tl.constexpr, BINS: tl.constexpr):
    """One chunk's assignments to their places: its experts' places start after all assignments to lower experts
    and this expert's assignments in earlier chunks; within the chunk, a sort of (expert, index)."""
    c = tl.program_id(0)
    bins = tl.arange(0, BINS)
    total = tl.zeros([BINS], dtype=tl.int32)
    before = tl.zeros([BINS], dtype=tl.int32)
    for i in range(chunks):
        h = tl.load(hist_ptr + i * BINS + bins)
        total += h
        before += h * (i < c).to(tl.int32)
    total = tl.where(bins < GROUPS, total, 0)
    mine = tl.load(hist_ptr + c * BINS + bins)
    start = tl.cumsum(total, 0) - total + before - (tl.cumsum(mine, 0) - mine)  # minus the chunk's own lower experts
    tl.store(start_ptr + c * BINS + bins, start)
    if c == 0:
        tl.store(counts_ptr + bins, total.to(tl.int64), mask=bins < GROUPS)
    tl.debug_barrier()
    j = tl.arange(0, CHUNK)
    at = c * CHUNK + j
    ids = tl.load(ids_ptr + at, mask=at < A, other=BINS - 1).to(tl.int32)
    keys = tl.sort(ids * CHUNK + j)
    a = c * CHUNK + keys % CHUNK  # the assignment at the chunk's sorted place j
    place = tl.load(start_ptr + c * BINS + keys // CHUNK) + j
    ok = a < A
    tl.store(order_ptr + place, a.to(tl.int64), mask=ok)
    tl.store(source_ptr + place, (a // K).to(tl.int64), mask=ok)
    tl.store(position_ptr + a, place.to(tl.int64), mask=ok)


def sort_by_expert(top_k_index: Tensor, num_experts: int, backend: str = "torch") -> Sorted:
    """The assignments sorted by expert (see Sorted): on the Triton backend a counting sort in two kernels, reading
    nothing back to the host; else torch's stable argsort. Both give the same places."""
    from ..head import resolve_backend

    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    if resolve_backend(backend, flat.device) == "triton" and len(flat):
        bins = triton.next_power_of_2(num_experts + 2)  # (and one bin for the ends of chunks)
        chunks = triton.cdiv(len(flat), _CHUNK)
        hist = torch.empty(chunks, bins, dtype=torch.int32, device=flat.device)
        start = torch.empty_like(hist)
        order, source, position = torch.empty(3, len(flat), dtype=torch.int64, device=flat.device)
        counts = torch.empty(num_experts + 1, dtype=torch.int64, device=flat.device)
        flat = flat.contiguous()
        _chunk_counts_kernel[(chunks,)](flat, hist, len(flat), CHUNK=_CHUNK, BINS=bins, enable_fp_fusion=True)
        _place_kernel[(chunks,)](flat, hist, start, order, source, position, counts, len(flat), k, chunks,
                                 GROUPS=num_experts + 1, CHUNK=_CHUNK, BINS=bins, num_warps=8, enable_fp_fusion=True)
        return Sorted(order, source, position, counts)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    position = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))
    return Sorted(order, order // k, position, counts.index_add_(0, flat, torch.ones_like(flat)))


def experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                    residual: Tensor | None = None, *, backend: str = "auto") -> Tensor:
    """HF's `<prefix>Experts.forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`, sorted by
    expert and combined in rank order (see the module's docstring); plus `residual` [T, H] if given, as HF's layer
    adds it (on the Triton backend in the combine kernel)."""
    from ..head import resolve_backend

    t, k = top_k_index.shape
    _, source, position, counts = sort_by_expert(top_k_index, self.num_experts, backend)
    if resolve_backend(backend, hidden_states.device) == "triton":  # (nothing read back to the host)
        rows = groups(counts, len(source), hidden_states.dtype)  # (one schedule for both products)
        if type(self.act_fn).__name__ in ("SiLUActivation", "SiLU"):  # gate, up and the middle in one kernel
            middle = grouped_gate_up(hidden_states, self.gate_up_proj, rows, source=source)
        else:
            gate, up = grouped_gemm(hidden_states[source], self.gate_up_proj, rows).chunk(2, dim=-1)
            middle = self.act_fn(gate) * up
        out = grouped_gemm(middle, self.down_proj, rows)  # [T * k, H], by expert
        return combine(out, position.view(t, k), top_k_weights, residual)
    sizes = counts.tolist()
    gate, up = grouped_linear(hidden_states[source], self.gate_up_proj, sizes).chunk(2, dim=-1)
    out = grouped_linear(self.act_fn(gate) * up, self.down_proj, sizes)
    per_rank = out[position].view(t, k, -1)
    weights = top_k_weights.float()
    combined = per_rank[:, 0].float() * weights[:, :1]
    for r in range(1, k):  # (rank order, one rounding at the end)
        combined += per_rank[:, r].float() * weights[:, r : r + 1]
    combined = combined.to(hidden_states.dtype)
    return combined if residual is None else residual + combined

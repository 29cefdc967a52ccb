"""A mixture's softmax top-k router after its linear layer, in one Triton pass: HF's `<prefix>TopKRouter` runs it as
softmax, topk, sum, divide and cast (five kernels, torch.topk alone costing more than the router's GEMM).

Per token, as HF computes it: probabilities = softmax(logits) in fp32; the k largest, in descending order (ties to the
lower expert id); divided by their sum where the router renormalises (norm_topk_prob); cast to the weights' dtype.
Row by row with a fixed layout, so a token's routing never depends on its neighbours. The backward differentiates
the torch formula (through the chosen experts' probabilities).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, index_ptr, T, E, K: tl.constexpr, RENORM: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    ranks = tl.arange(0, BLOCK_K)
    inside = tokens < T
    x = tl.load(logits_ptr + tokens.to(tl.int64)[:, None] * E + experts[None, :],
                mask=inside[:, None] & (experts < E)[None, :], other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    top = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for r in tl.static_range(K):
        best = tl.max(p, axis=1)
        pick = tl.min(tl.where(p == best[:, None], experts[None, :], BLOCK_E), axis=1)  # (ties: the lower id)
        top = tl.where(ranks[None, :] == r, best[:, None], top)
        ids = tl.where(ranks[None, :] == r, pick[:, None], ids)
        p = tl.where(experts[None, :] == pick[:, None], -1.0, p)
    if RENORM:
        top = top / tl.sum(top, axis=1)[:, None]  # (ranks past K hold 0)
    at = tokens.to(tl.int64)[:, None] * K + ranks[None, :]
    ok = inside[:, None] & (ranks < K)[None, :]
    tl.store(weights_ptr + at, top.to(weights_ptr.dtype.element_ty), mask=ok)
    tl.store(index_ptr + at, ids.to(tl.int64), mask=ok)


def _weights(probabilities: Tensor, index: Tensor, renormalize: bool, dtype: torch.dtype) -> Tensor:
    """The chosen experts' weights from the routing probabilities (fp32 [T, E]), as HF's formula gives them."""
    top = probabilities.gather(-1, index)
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(dtype)


def route_reference(logits: Tensor, k: int, renormalize: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """HF's formula in torch (differentiable in logits): (weights [T, k] of `dtype`, expert ids [T, k])."""
    probabilities = torch.softmax(logits, dim=-1, dtype=torch.float32)
    index = torch.topk(probabilities, k, dim=-1).indices
    return _weights(probabilities, index, renormalize, dtype), index


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, k: int, renormalize: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        t, e = logits.shape
        logits = logits.contiguous()
        weights = torch.empty(t, k, dtype=dtype, device=logits.device)
        index = torch.empty(t, k, dtype=torch.int64, device=logits.device)
        block_e = triton.next_power_of_2(e)
        block_t = max(1, min(64, 8192 // block_e))  # (fixed by the number of experts alone)
        _route_kernel[(triton.cdiv(t, block_t),)](logits, weights, index, t, e, K=k, RENORM=renormalize,
                                                  BLOCK_T=block_t, BLOCK_E=block_e,
                                                  BLOCK_K=triton.next_power_of_2(k), num_warps=4, enable_fp_fusion=True)
        ctx.save_for_backward(logits, index)
        ctx.renormalize, ctx.dtype = renormalize, dtype
        ctx.mark_non_differentiable(index)
        return weights, index

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_index: Tensor):
        logits, index = ctx.saved_tensors
        with torch.enable_grad():
            x = logits.detach().requires_grad_()
            weights = _weights(torch.softmax(x, dim=-1, dtype=torch.float32), index, ctx.renormalize, ctx.dtype)
            (d_logits,) = torch.autograd.grad(weights, x, grad)
        return d_logits, None, None, None


def route(logits: Tensor, k: int, renormalize: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Each token's k experts from its router logits [T, E]: (weights [T, k] of `dtype`, expert ids [T, k], int64),
    as route_reference computes them. Differentiable in logits."""
    if logits.dim() != 2 or not 0 < k <= logits.shape[1]:
        raise ValueError(f"logits must be [tokens, experts] with at least k = {k} experts, got {tuple(logits.shape)}")
    return _Route.apply(logits, k, renormalize, dtype)

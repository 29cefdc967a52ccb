"""A grouped GEMM for mixture-of-experts layers: rows grouped by expert (counts[e] consecutive rows for expert e),
each group times its expert's weight [out, in] transposed, in one launch, with one fixed tiling per dtype and no
split of the sum over `in`. Every output element is summed over the same K tiles in the same order whatever the
group sizes, so a row's bits do not depend on how many rows its expert got (cuBLAS picks kernels by each group's
rows; a per-expert loop of torch matmuls is not batch invariant on CUDA).

The schedule (which expert and rows each program takes) is built on the device from the counts. The backward
differentiates the torch formula (grouped_linear, expert by expert): gradients need not be bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..head.triton_log_probs_forward import _dot, dot_precision, interpreting


def _tiles(dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): one tiling per dtype, never per call."""
    if interpreting():
        return 16, 16, 16
    return (64, 64, 32) if dtype == torch.float32 else (64, 128, 64)


@triton.jit
def _tile(tile_expert_ptr, tile_row_ptr, tile_end_ptr, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's expert, rows and columns (and which are in range), from the schedule."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    rows = tl.load(tile_row_ptr + tile).to(tl.int64) + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, rows, cols, rows < tl.load(tile_end_ptr + tile).to(tl.int64), cols < N


@triton.jit
def _grouped_gemm_kernel(x_ptr, w_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, tile_end_ptr, N, K,
                         stride_we, stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    expert, rows, cols, row_ok, col_ok = _tile(tile_expert_ptr, tile_row_ptr, tile_end_ptr, N, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k + k0 < K
        x = tl.load(x_ptr + rows[:, None] * K + (k0 + offs_k)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + (k0 + offs_k)[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc = _dot(x, w, acc, DOT_PRECISION)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _grouped_gate_up_kernel(x_ptr, w_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, tile_end_ptr, N, K,
                            stride_we, stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """silu(x @ gate.T) * (x @ up.T) for an expert's gate_up weight [2N, K] (gate rows first): both products of a
    tile at once, the middle in the epilogue, rounded as silu_mul.py rounds (silu in fp32, rounded to the dtype,
    times up in fp32, rounded again)."""
    expert, rows, cols, row_ok, col_ok = _tile(tile_expert_ptr, tile_row_ptr, tile_end_ptr, N, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k + k0 < K
        x = tl.load(x_ptr + rows[:, None] * K + (k0 + offs_k)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        at = w_ptr + expert * stride_we + (k0 + offs_k)[:, None]
        mask = col_ok[None, :] & k_ok[:, None]
        wg = tl.load(at + cols[None, :].to(tl.int64) * stride_wn, mask=mask, other=0.0)
        wu = tl.load(at + (cols + N)[None, :].to(tl.int64) * stride_wn, mask=mask, other=0.0)
        gate = _dot(x, wg, gate, DOT_PRECISION)
        up = _dot(x, wu, up, DOT_PRECISION)
    dtype = out_ptr.dtype.element_ty
    g = gate.to(dtype).to(tl.float32)  # (the product as its own GEMM would round it)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype)
    middle = silu.to(tl.float32) * up.to(dtype).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], middle.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


def _schedule(counts: Tensor, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per program: its expert, its first row and the end of its expert's rows (built on the device, from the
    experts' row counts [experts])."""
    tiles = (counts + block_m - 1) // block_m
    expert = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), tiles)
    ends = torch.cumsum(counts, 0)
    starts, first = ends - counts, torch.cumsum(tiles, 0) - tiles
    within = torch.arange(len(expert), device=counts.device) - first[expert]
    return expert, starts[expert] + within * block_m, ends[expert]


def _launch(x: Tensor, weight: Tensor, counts: list[int], gated: bool = False) -> Tensor:
    rows, k = x.shape
    num_experts, n, _ = weight.shape
    n = n // 2 if gated else n
    out = x.new_zeros(rows, n)  # (rows of no expert stay 0)
    block_m, block_n, block_k = _tiles(x.dtype)
    expert, row, end = _schedule(torch.tensor(counts[:num_experts], device=x.device), block_m)
    if expert.numel():
        x, weight = x.contiguous(), weight.contiguous()
        kernel = _grouped_gate_up_kernel if gated else _grouped_gemm_kernel
        kernel[(expert.numel(), triton.cdiv(n, block_n))](
            x, weight, out, expert, row, end, n, k, weight.stride(0), weight.stride(1),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=dot_precision(x.dtype),
            num_warps=4, num_stages=3,
        )
    return out


def grouped_linear(x: Tensor, weight: Tensor, counts: list[int]) -> Tensor:
    """grouped_gemm's torch formula, expert by expert: rows of x grouped by expert (counts[e] rows for expert e, in
    order) times that expert's weight [out, in], transposed: [rows, out]. Rows past the experts' groups (no
    expert) give zeros."""
    out = x.new_zeros(x.shape[0], weight.shape[1])
    lo = 0
    for e, n in enumerate(counts[: weight.shape[0]]):
        if n:
            out[lo : lo + n] = x[lo : lo + n] @ weight[e].T
        lo += n
    return out


class _GroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, counts: list[int]) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.counts = counts
        return _launch(x, weight, counts)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        d_w = torch.zeros_like(weight)
        lo = 0
        for e, n in enumerate(ctx.counts[: weight.shape[0]]):
            if n:
                d_w[e] = grad[lo : lo + n].T @ x[lo : lo + n]
            lo += n
        return grouped_linear(grad, weight.transpose(1, 2), ctx.counts), d_w, None


class _GroupedGateUp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, counts: list[int]) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.counts = counts
        return _launch(x, weight, counts, gated=True)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xg, wg = x.detach().requires_grad_(), weight.detach().requires_grad_()
            gate, up = _GroupedGemm.apply(xg, wg, ctx.counts).chunk(2, dim=-1)
            return (*torch.autograd.grad(torch.nn.functional.silu(gate) * up, (xg, wg), grad), None)


def grouped_gate_up(x: Tensor, gate_up: Tensor, counts: list[int]) -> Tensor:
    """silu(gate) * up of a mixture's experts in one grouped kernel: gate_up [experts, 2I, in] (gate rows first, as
    HF stores them), x as grouped_gemm takes it; [rows, I]. Differentiable in x and gate_up."""
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must hold gate and up rows alike, got {gate_up.shape[1]} rows")
    _check(x, gate_up, counts, "gate_up", "2I")
    return _GroupedGateUp.apply(x, gate_up, counts)


def grouped_gemm(x: Tensor, weight: Tensor, counts: list[int]) -> Tensor:
    """x [rows, in] grouped by expert (counts[e] rows for expert e, in order; rows past them: no expert, zeros) times
    weight [experts, out, in] transposed: [rows, out]. Differentiable in x and weight."""
    _check(x, weight, counts, "weight", "out")
    return _GroupedGemm.apply(x, weight, counts)


def _check(x: Tensor, weight: Tensor, counts: list[int], name: str, out: str) -> None:
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2] or x.dtype != weight.dtype:
        raise ValueError(f"x must be [rows, in] and {name} [experts, {out}, in] of its dtype, got {tuple(x.shape)} "
                         f"{x.dtype} and {tuple(weight.shape)} {weight.dtype}")
    if sum(counts) != x.shape[0]:
        raise ValueError(f"counts sum to {sum(counts)}, x has {x.shape[0]} rows")

"""A grouped GEMM for mixture-of-experts layers: rows grouped by expert (counts[e] consecutive rows for expert e),
each group times its expert's weight [out, in] transposed, in one launch, with one fixed tiling per dtype and no
split of the sum over `in`. Every output element is summed over the same K tiles in the same order whatever the
group sizes, so a row's bits do not depend on how many rows its expert got (cuBLAS picks kernels by each group's
rows; a per-expert loop of torch matmuls is not batch invariant on CUDA).

The schedule (which expert and rows each program takes) is built on the device from the counts. On Hopper with
16-bit experts the same products over the same schedule run as a persistent GEMM on Hopper's instructions
(hopper_grouped.py, with the same promise; `_hopper` says where). The backward differentiates the torch formula
(grouped_linear, expert by expert): gradients need not be bitwise.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from ..head.triton_log_probs_forward import _dot, dot_precision, group_schedule, interpreting
from .causal_attention import hopper_kernels


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def _tiles(dtype: torch.dtype, gated: bool = False) -> Tiles:
    """One tiling per dtype and product, never per call (BLOCK_K fixes a row's order of summation; the rest only the
    speed). BLOCK_M is the schedule's: the same for gate/up and down."""
    if interpreting():
        return Tiles(16, 16, 16, 4, 1)
    if dtype == torch.float32:  ## NB: 3 stages miscompile on triton 3.6 (H200, pointer reads): rows of garbage
        return Tiles(64, 64, 32, 4, 2)
    # bf16 on an H200 (bench_moe.py --sweep, 30B-A3B's layer): 128x128x64, 8 warps, 4 stages for gate/up, 3 for down
    return Tiles(128, 128, 64, 8, 4 if gated else 3)


@triton.jit
def _grouped_gemm_kernel(x, source_ptr, w, out_ptr, tile_expert_ptr, tile_row_ptr, tile_end_ptr, N, K, E, W_ROWS,
                         GATED: tl.constexpr, GATHER: tl.constexpr, X_TMA: tl.constexpr, W_TMA: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """out[rows] = x[rows] @ w[expert].T for one tile of an expert's rows; x's row r is x[source[r]] with GATHER.
    w is [E * W_ROWS, K] (the experts' weights stacked), x [rows, K]: tensor descriptors (the copy engine) with
    W_TMA and X_TMA, else pointers. Rows or columns read past a tile's own (another expert's) are never stored.

    GATED: silu(x @ gate.T) * (x @ up.T) for an expert's weight [2N, K] (gate rows first): both products of a tile
    at once, the middle in the epilogue, rounded as silu_mul.py rounds (silu in fp32, rounded to the dtype, times
    up in fp32, rounded again). Tiles of expert E (rows routed to no expert) store zeros."""
    col_blocks = tl.cdiv(N, BLOCK_N)
    tile = tl.program_id(0) // col_blocks  # (a tile's column blocks run side by side: its rows are read once)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)  # -1: no tile, the grid's spare
    row0 = tl.load(tile_row_ptr + tile).to(tl.int64)
    col0 = tl.program_id(0) % col_blocks * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    row_ok = rows < tl.load(tile_end_ptr + tile).to(tl.int64)
    col_ok = cols < N
    k_end = K * ((expert >= 0) & (expert < E)).to(tl.int32)  # (no expert: no products, zeros out)
    x_rows = tl.load(source_ptr + rows, mask=row_ok, other=0).to(tl.int64) if GATHER else rows
    w_row = expert * W_ROWS + col0  # (the gate's rows; up's are N further)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        k_ok = offs_k + k0 < K
        if X_TMA:
            a = x.load([row0.to(tl.int32), k0])
        else:
            a = tl.load(x + x_rows[:, None] * K + (k0 + offs_k)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
        if W_TMA:
            acc = _dot(a, w.load([w_row.to(tl.int32), k0]).T, acc, DOT_PRECISION)
            if GATED:
                up = _dot(a, w.load([(w_row + N).to(tl.int32), k0]).T, up, DOT_PRECISION)
        else:
            at = w + (k0 + offs_k)[:, None]
            mask = col_ok[None, :] & k_ok[:, None]
            acc = _dot(a, tl.load(at + (w_row + tl.arange(0, BLOCK_N))[None, :] * K, mask=mask, other=0.0), acc,
                       DOT_PRECISION)
            if GATED:
                up = _dot(a, tl.load(at + (w_row + N + tl.arange(0, BLOCK_N))[None, :] * K, mask=mask, other=0.0),
                          up, DOT_PRECISION)
    if GATED:
        dtype = out_ptr.dtype.element_ty
        g = acc.to(dtype).to(tl.float32)  # (the product as its own GEMM would round it)
        silu = (g / (1.0 + tl.exp(-g))).to(dtype)
        acc = silu.to(tl.float32) * up.to(dtype).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(dtype),
             mask=row_ok[:, None] & col_ok[None, :])


class Groups(NamedTuple):
    """Rows sorted by expert and the grouped kernel's schedule over them (groups()): built once, used by each product
    over the same rows (an expert layer's gate/up and down)."""
    counts: Tensor  # [experts + 1], int64, on the device
    expert: Tensor  # per program: its expert (-1: a spare), first row, end of its expert's rows
    row: Tensor
    end: Tensor


def groups(counts: Tensor, rows: int, dtype: torch.dtype) -> Groups:
    """The schedule of the grouped kernels for `rows` rows of `dtype` grouped by `counts` (a device tensor: nothing
    is read back to the host)."""
    return Groups(counts, *group_schedule(counts, rows, _tiles(dtype).block_m))


def _operand(t: Tensor, block: list[int]) -> tuple[object, bool]:
    """A tensor descriptor of 2D `t` for the copy engine (Hopper and later, rows of whole 16 bytes), else `t`.
    The choice depends on the device, dtype and row size only: never on a call's rows."""
    hopper = interpreting() or (t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9)
    if not (hopper and t.shape[1] * t.element_size() % 16 == 0):
        return t, False
    return TensorDescriptor.from_tensor(t if t.data_ptr() % 16 == 0 else t.clone(), block), True


GLUON = True  # hopper_grouped's kernel where it runs (benchmarks set False for the Triton kernel, the path before)


def _hopper(x: Tensor, weight: Tensor, gather: bool = False):
    """hopper_grouped, where Triton has Gluon's Hopper operations and its kernel runs x and weight (`gather`: rows
    read in place), or None."""
    if not GLUON or interpreting() or hopper_kernels() is None:
        return None
    from . import hopper_grouped

    usable = hopper_grouped.gather_usable if gather else hopper_grouped.usable
    return hopper_grouped if usable(x, weight, _tiles(x.dtype).block_m) else None


def _launch(x: Tensor, weight: Tensor, rows: Groups, source: Tensor | None, gated: bool) -> Tensor:
    k = x.shape[1]
    num_experts, w_rows, _ = weight.shape
    n = w_rows // 2 if gated else w_rows
    out = x.new_empty(x.shape[0] if source is None else source.shape[0], n)
    tiles = _tiles(x.dtype, gated)
    x, weight = x.contiguous(), weight.contiguous()
    hopper = _hopper(x, weight, source is not None)
    if hopper is not None and len(out):
        hopper.launch(x, weight, rows.expert, rows.row, rows.end, source, gated, out)
        return out
    x_arg, x_tma = (x, False) if source is not None else _operand(x, [tiles.block_m, tiles.block_k])
    w_arg, w_tma = _operand(weight.view(-1, k), [tiles.block_n, tiles.block_k])
    _grouped_gemm_kernel[(rows.expert.numel() * triton.cdiv(n, tiles.block_n),)](
        x_arg, source if source is not None else rows.expert, w_arg, out, rows.expert, rows.row, rows.end, n, k,
        num_experts, w_rows, GATED=gated, GATHER=source is not None, X_TMA=x_tma, W_TMA=w_tma,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, DOT_PRECISION=dot_precision(x.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        enable_fp_fusion=True,
    )
    return out


def grouped_linear(x: Tensor, weight: Tensor, counts: list[int] | Tensor) -> Tensor:
    """grouped_gemm's torch formula, expert by expert: rows of x grouped by expert (counts[e] rows for expert e, in
    order) times that expert's weight [out, in], transposed: [rows, out]. Rows past the experts' groups (no
    expert) give zeros."""
    out = x.new_zeros(x.shape[0], weight.shape[1])
    lo = 0
    sizes = counts.tolist() if isinstance(counts, Tensor) else counts
    for e, n in enumerate(sizes[: weight.shape[0]]):
        if n:
            out[lo : lo + n] = x[lo : lo + n] @ weight[e].T
        lo += n
    return out


class _GroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, rows: Groups, source: Tensor | None, gated: bool) -> Tensor:
        ctx.save_for_backward(x, weight, rows.counts, source)
        ctx.gated = gated
        return _launch(x, weight, rows, source, gated)

    @staticmethod
    def backward(ctx, grad: Tensor):
        """The torch formula's gradients (expert by expert), through the gathered rows where there are some."""
        x, weight, counts, source = ctx.saved_tensors
        rows = x if source is None else x[source]
        with torch.enable_grad():
            xg, wg = rows.detach().requires_grad_(), weight.detach().requires_grad_()
            out = grouped_linear(xg, wg, counts)
            if ctx.gated:
                gate, up = out.chunk(2, dim=-1)
                out = torch.nn.functional.silu(gate) * up
            d_rows, d_w = torch.autograd.grad(out, (xg, wg), grad)
        d_x = d_rows if source is None else torch.zeros_like(x).index_add_(0, source, d_rows)
        return d_x, d_w, None, None, None


def grouped_gate_up(x: Tensor, gate_up: Tensor, counts: list[int] | Tensor | Groups,
                    source: Tensor | None = None) -> Tensor:
    """silu(gate) * up of a mixture's experts in one grouped kernel: gate_up [experts, 2I, in] (gate rows first, as
    HF stores them), x as grouped_gemm takes it, or with `source` [rows] (int64) the rows x[source] in that order,
    read in place (no gathered copy); [rows, I]. Differentiable in x and gate_up."""
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must hold gate and up rows alike, got {gate_up.shape[1]} rows")
    rows = _check(x, gate_up, counts, "gate_up", "2I", len(x) if source is None else len(source))
    return _GroupedGemm.apply(x, gate_up, rows, source, True)


def grouped_gemm(x: Tensor, weight: Tensor, counts: list[int] | Tensor | Groups) -> Tensor:
    """x [rows, in] grouped by expert (counts[e] rows for expert e, in order; the last count: rows of no expert,
    zeros) times weight [experts, out, in] transposed: [rows, out]. Differentiable in x and weight. `counts` as a
    device tensor, or as Groups (groups(): the schedule too, built once for several products), reads nothing back
    to the host (on the kernels' path)."""
    rows = _check(x, weight, counts, "weight", "out", len(x))
    return _GroupedGemm.apply(x, weight, rows, None, False)


def _check(x: Tensor, weight: Tensor, counts: list[int] | Tensor | Groups, name: str, out: str, rows: int) -> Groups:
    """The counts with their schedule, after checking shapes (and, for a list, the rows it counts)."""
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2] or x.dtype != weight.dtype:
        raise ValueError(f"x must be [rows, in] and {name} [experts, {out}, in] of its dtype, got {tuple(x.shape)} "
                         f"{x.dtype} and {tuple(weight.shape)} {weight.dtype}")
    if isinstance(counts, Groups):
        counts, schedule = counts.counts, counts
    else:
        schedule = None
    if len(counts) != weight.shape[0] + 1:
        raise ValueError(f"counts must have one entry per expert and one for rows of none ({weight.shape[0] + 1}), "
                         f"got {len(counts)}")
    if not isinstance(counts, Tensor):
        if sum(counts) != rows:
            raise ValueError(f"counts sum to {sum(counts)}, the product has {rows} rows")
        counts = torch.tensor(counts, dtype=torch.int64)
    return schedule or groups(counts.to(x.device, torch.int64), rows, x.dtype)


@triton.jit
def _combine_kernel(out_ptr, position_ptr, weights_ptr, residual_ptr, combined_ptr, T, H, K: tl.constexpr,
                    RESIDUAL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = (tokens < T)[:, None] & (cols < H)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for r in tl.static_range(K):  # (rank order)
        at = tokens.to(tl.int64) * K + r
        row = tl.load(position_ptr + at, mask=tokens < T, other=0)
        w = tl.load(weights_ptr + at, mask=tokens < T, other=0.0).to(tl.float32)
        acc += tl.load(out_ptr + row[:, None] * H + cols[None, :], mask=ok, other=0.0).to(tl.float32) * w[:, None]
    at = tokens.to(tl.int64)[:, None] * H + cols[None, :]
    y = acc.to(combined_ptr.dtype.element_ty)
    if RESIDUAL:  # (the sum rounded, then the residual added and rounded: HF's `residual + block(x)`)
        y = (y.to(tl.float32) + tl.load(residual_ptr + at, mask=ok, other=0.0).to(tl.float32)).to(y.dtype)
    tl.store(combined_ptr + at, y, mask=ok)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: Tensor, position: Tensor, weights: Tensor, residual: Tensor | None) -> Tensor:
        t, k = position.shape
        h = out.shape[1]
        combined = out.new_empty(t, h)
        out, position, weights = out.contiguous(), position.contiguous(), weights.contiguous()
        residual = None if residual is None else residual.contiguous()
        block_t, block_h = (16, 16) if interpreting() else (32, 128)
        _combine_kernel[(triton.cdiv(t, block_t), triton.cdiv(h, block_h))](
            out, position, weights, combined if residual is None else residual, combined, t, h, K=k,
            RESIDUAL=residual is not None, BLOCK_T=block_t, BLOCK_H=block_h, enable_fp_fusion=True)
        ctx.save_for_backward(out, position, weights)
        return combined

    @staticmethod
    def backward(ctx, grad: Tensor):
        out, position, weights = ctx.saved_tensors
        g = grad.float()
        per_rank = out[position].float()  # [T, k, H]
        d_out = torch.zeros_like(out).index_copy_(0, position.reshape(-1),
                                                 (g[:, None] * weights.float()[..., None]).flatten(0, 1).to(out.dtype))
        d_w = (per_rank * g[:, None]).sum(-1).to(weights.dtype)
        return d_out, None, d_w, grad if ctx.needs_input_grad[3] else None


def combine(out: Tensor, position: Tensor, weights: Tensor, residual: Tensor | None = None) -> Tensor:
    """Each token's experts' outputs weighted and summed: token t's rank-r output is out[position[t, r]] (out
    [rows, H] in expert order), weights [T, k]; the sum in fp32 in rank order, rounded once to out's dtype, then
    plus `residual` [T, H] of that dtype if given (added in fp32 and rounded: `residual + combine(...)`'s bits). One
    kernel: no copy of the outputs in token order, no pass for the add. Differentiable in out, weights and
    residual."""
    if residual is not None and (residual.shape != (position.shape[0], out.shape[1]) or residual.dtype != out.dtype):
        raise ValueError(f"residual must be [{position.shape[0]}, {out.shape[1]}] of {out.dtype}, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    return _Combine.apply(out, position, weights, residual)

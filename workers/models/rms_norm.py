"""RMSNorm in one Triton pass: each program normalises whole rows, in a fixed order that depends on the row size
only, so a token's result never depends on how many rows share the call or where its row sits.

Two families of the formula (HF's, as data in patch_model's table), x read as fp32, r = rsqrt(mean(x^2) + eps):
- "llama" (Llama, Qwen2/3, Mistral, Phi-3): y = weight * (x * r).to(x.dtype)
- "gemma" (Gemma 2/3):                      y = ((x * r) * (1 + weight.float())).to(x.dtype)
torch's own reduction picks its thread layout from the number of rows (and splits long rows across blocks), so a
row's bits change with the batch; this kernel's do not. The backward differentiates `rms_norm_reference`.
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl
from torch import Tensor

Style = Literal["llama", "gemma"]


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, H, eps, GEMMA: tl.constexpr, BLOCK_H: tl.constexpr,
                     ROWS: tl.constexpr):
    """ROWS whole rows a program, as one [ROWS, BLOCK_H] tile: every row sits in the same threads' registers, so
    each row's sum runs in the same order wherever the row sits."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    inside = (rows < n_rows)[:, None] & (cols < H)[None, :]
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
    at = rows[:, None] * H + cols[None, :]
    x = tl.load(x_ptr + at, mask=inside, other=0.0)
    xf = x.to(tl.float32)
    r = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / H + eps)[:, None]
    if GEMMA:
        y = xf * r * (1.0 + w)
    else:  # round to the input's dtype first, then scale in the weight's (as HF does)
        y = (xf * r).to(x.dtype).to(tl.float32) * w
    tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=inside)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float, style: Style) -> Tensor:
    """The HF formula in torch (differentiable): the statement of the math and the backward."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if style == "gemma":
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def _launch(x: Tensor, weight: Tensor, eps: float, style: Style) -> Tensor:
    # x: [..., H]; out: [..., H] in the dtype HF's formula gives
    h = x.shape[-1]
    rows = x.reshape(-1, h).contiguous()
    dtype = x.dtype if style == "gemma" else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(rows.shape, dtype=dtype, device=x.device)
    block = triton.next_power_of_2(h)
    per_program = max(1, 4096 // block)  # (fixed by H alone, as is the layout)
    grid = (triton.cdiv(rows.shape[0], per_program),)
    _rms_norm_kernel[grid](rows, weight.contiguous(), out, rows.shape[0], h, eps, GEMMA=style == "gemma",
                           BLOCK_H=block, ROWS=per_program, num_warps=8 if block >= 4096 else 4, enable_fp_fusion=True)
    return out.view(*x.shape[:-1], h)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, style: Style) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.style = eps, style
        return _launch(x, weight, eps, style)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x_, w_ = x.detach().requires_grad_(ctx.needs_input_grad[0]), weight.detach().requires_grad_(
                ctx.needs_input_grad[1])
            y = rms_norm_reference(x_, w_, ctx.eps, ctx.style)
            wanted = [t for t in (x_, w_) if t.requires_grad]
            grads = iter(torch.autograd.grad(y, wanted, grad))
        return (next(grads) if ctx.needs_input_grad[0] else None,
                next(grads) if ctx.needs_input_grad[1] else None, None, None)


def rms_norm(x: Tensor, weight: Tensor, eps: float, style: Style = "llama") -> Tensor:
    """HF's RMSNorm of `style` over the last dim of x ([..., H]); weight [H]. Differentiable in x and weight."""
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1]}] for x of shape {tuple(x.shape)}, got {tuple(weight.shape)}")
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps, style)
    return _launch(x, weight, eps, style)  # (no autograd node: a scorer's forward launches less)

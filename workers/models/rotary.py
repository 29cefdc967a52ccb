"""Rotary position embedding in one Triton pass (HF runs five: a product, a negation, a concatenation, a second
product and a sum).

HF's formula for x [T, H, D], cos and sin [T, D]: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] for the
halves x1, x2 of D; each of the three steps rounded to x's dtype, as here, so the result is HF's to the bit (bf16,
fp32). Elementwise per token: nothing depends on the neighbours. The backward differentiates the torch formula.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_ROWS = 16  # (token, head) rows per program


@triton.jit
def _round(x, BF16: tl.constexpr):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32; done on the bits, so that no compiler pass can
    fold a cast pair away. Identity for fp32."""
    if BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, H, HALF, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                   BF16: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # rows of [T * H, D]
    cols = tl.arange(0, BLOCK_D)
    inside = (rows < n_rows)[:, None] & (cols < HALF)[None, :]
    x_at = x_ptr + rows[:, None] * 2 * HALF + cols[None, :]
    t_at = (rows // H)[:, None] * 2 * HALF + cols[None, :]
    x1 = tl.load(x_at, mask=inside, other=0.0)
    x2 = tl.load(x_at + HALF, mask=inside, other=0.0)
    c1 = tl.load(cos_ptr + t_at, mask=inside, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t_at + HALF, mask=inside, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t_at, mask=inside, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t_at + HALF, mask=inside, other=0.0).to(tl.float32)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    # each step rounded as HF rounds it; fp_fusion is off at launch, so no product is fused into a sum
    o1 = _round(_round(f1 * c1, BF16) + _round(-f2 * s1, BF16), BF16)
    o2 = _round(_round(f2 * c2, BF16) + _round(f1 * s2, BF16), BF16)
    out_at = out_ptr + rows[:, None] * 2 * HALF + cols[None, :]
    tl.store(out_at, o1.to(x1.dtype), mask=inside)  # exact: o1 is a value of that dtype
    tl.store(out_at + HALF, o2.to(x1.dtype), mask=inside)


def rotary_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's formula in torch (differentiable): x [T, H, D], cos and sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        x = x.contiguous()
        out = torch.empty_like(x)
        t, h, d = x.shape
        _rotary_kernel[(triton.cdiv(t * h, _ROWS),)](x, cos.contiguous(), sin.contiguous(), out, t * h, h, d // 2,
                                                     BLOCK_D=triton.next_power_of_2(d // 2), ROWS=_ROWS,
                                                     BF16=x.dtype == torch.bfloat16, num_warps=4,
                                                     enable_fp_fusion=False)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        with torch.enable_grad():
            x = torch.zeros_like(grad).requires_grad_()  # the formula is linear in x: its gradient needs no x
            (dx,) = torch.autograd.grad(rotary_reference(x, cos, sin), x, grad)
        return dx, None, None


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, D] rotated by cos, sin [T, D] (HF's apply_rotary_pos_emb for one tensor). Differentiable in x.
    bf16 and fp32 run the kernel; other dtypes the torch formula."""
    if x.dtype not in (torch.bfloat16, torch.float32) or cos.dtype != x.dtype:
        return rotary_reference(x, cos, sin)
    if x.dim() != 3 or cos.shape != (x.shape[0], x.shape[2]) or sin.shape != cos.shape or x.shape[2] % 2:
        raise ValueError(f"rotary needs x [T, H, D] with D even and cos, sin [T, D]; got x {tuple(x.shape)}, "
                         f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    return _Rotary.apply(x, cos, sin)

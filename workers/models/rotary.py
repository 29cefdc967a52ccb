"""Rotary position embedding in one Triton pass (HF runs five: a product, a negation, a concatenation, a second
product and a sum), optionally after the head's RMSNorm (q_norm, k_norm) in the same pass.

HF's formula for x [T, H, D], cos and sin [T, D]: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] for the
halves x1, x2 of D; each of the three steps rounded to x's dtype, as here, so the result is HF's to the bit (bf16,
fp32). Elementwise per token: nothing depends on the neighbours. The backward differentiates the torch formula.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .rms_norm import rms_norm_reference

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
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, w_ptr, out_ptr, n_rows, H, HALF, eps, BLOCK_D: tl.constexpr,
                   ROWS: tl.constexpr, BF16: tl.constexpr, NORM: tl.constexpr, GEMMA: tl.constexpr):
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
    if NORM:  # the head's RMSNorm first (rms_norm.py's two formulas), rounded as it rounds
        r = tl.math.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + cols, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
        if GEMMA:
            f1, f2 = _round(f1 * r * (1.0 + w1), BF16), _round(f2 * r * (1.0 + w2), BF16)
        else:
            f1, f2 = _round(_round(f1 * r, BF16) * w1, BF16), _round(_round(f2 * r, BF16) * w2, BF16)
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


Norm = tuple[Tensor, float, str]  # a head RMSNorm to apply first: (weight [D], eps, style: "llama" or "gemma")


def _reference(x: Tensor, cos: Tensor, sin: Tensor, norm: Norm | None) -> Tensor:
    return rotary_reference(x if norm is None else rms_norm_reference(x, *norm), cos, sin)


def rotary_gradients(grad: Tensor, cos: Tensor, sin: Tensor, x: Tensor | None = None, norm: Norm | None = None
                     ) -> tuple[Tensor, Tensor | None]:
    """The gradients of x and of the norm's weight (None without a norm) from the gradient of rotary(x, cos, sin,
    norm), by the torch formula; x is needed only with a norm (without, the formula is linear in x)."""
    with torch.enable_grad():
        if norm is None:
            x = torch.zeros_like(grad).requires_grad_()
            return torch.autograd.grad(rotary_reference(x, cos, sin), x, grad)[0], None
        x, w = x.detach().requires_grad_(), norm[0].detach().requires_grad_()
        return torch.autograd.grad(_reference(x, cos, sin, (w, *norm[1:])), (x, w), grad)


def _launch(x: Tensor, cos: Tensor, sin: Tensor, weight: Tensor | None, eps: float, style: str) -> Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    t, h, d = x.shape
    _rotary_kernel[(triton.cdiv(t * h, _ROWS),)](
        x, cos.contiguous(), sin.contiguous(), x if weight is None else weight.contiguous(), out, t * h, h,
        d // 2, eps, BLOCK_D=triton.next_power_of_2(d // 2), ROWS=_ROWS, BF16=x.dtype == torch.bfloat16,
        NORM=weight is not None, GEMMA=style == "gemma", num_warps=4, enable_fp_fusion=False)
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, weight: Tensor | None, eps: float, style: str) -> Tensor:
        ctx.save_for_backward(x if weight is not None else None, cos, sin, weight)
        ctx.eps, ctx.style = eps, style
        return _launch(x, cos, sin, weight, eps, style)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, cos, sin, weight = ctx.saved_tensors
        dx, dw = rotary_gradients(grad, cos, sin, x, None if weight is None else (weight, ctx.eps, ctx.style))
        return dx, None, None, dw, None, None


def rotary(x: Tensor, cos: Tensor, sin: Tensor, norm: Norm | None = None) -> Tensor:
    """x [T, H, D] rotated by cos, sin [T, D] (HF's apply_rotary_pos_emb for one tensor); with `norm`, each head
    RMS-normalised first (Qwen3's and Gemma 3's q_norm and k_norm) in the same pass, as rms_norm.py rounds it.
    Differentiable in x (and the norm's weight). bf16 and fp32 run the kernel; other dtypes the torch formula."""
    if norm is not None and norm[0].shape != (x.shape[-1],):
        raise ValueError(f"the norm's weight must be [{x.shape[-1]}] for x of shape {tuple(x.shape)}, got "
                         f"{tuple(norm[0].shape)}")
    if x.dtype not in (torch.bfloat16, torch.float32) or cos.dtype != x.dtype or (
            norm is not None and norm[0].dtype != x.dtype):
        return _reference(x, cos, sin, norm)
    if x.dim() != 3 or cos.shape != (x.shape[0], x.shape[2]) or sin.shape != cos.shape or x.shape[2] % 2:
        raise ValueError(f"rotary needs x [T, H, D] with D even and cos, sin [T, D]; got x {tuple(x.shape)}, "
                         f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    weight, eps, style = norm if norm is not None else (None, 0.0, "llama")
    if torch.is_grad_enabled() and (x.requires_grad or weight is not None and weight.requires_grad):
        return _Rotary.apply(x, cos, sin, weight, eps, style)
    return _launch(x, cos, sin, weight, eps, style)  # (no autograd node: a scorer's forward launches less)

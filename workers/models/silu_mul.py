"""The gated MLP's middle, silu(gate) * up, in one Triton pass (HF runs it as two, writing silu(gate) out between).

Rounded as HF rounds: silu(gate) is computed in fp32 and rounded to gate's dtype, then multiplied by up in fp32
and rounded again; elementwise, so a token's bits never depend on its neighbours. The backward differentiates
the torch formula.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.nn import functional as F

_BLOCK = 4096


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    g = tl.load(gate_ptr + offsets, mask=inside, other=0.0)
    u = tl.load(up_ptr + offsets, mask=inside, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + offsets, (silu.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=inside)


def _launch(gate: Tensor, up: Tensor) -> Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    _silu_mul_kernel[(triton.cdiv(gate.numel(), _BLOCK),)](gate, up, out, gate.numel(), BLOCK=_BLOCK, num_warps=8,
                                                            enable_fp_fusion=True)
    return out


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return _launch(gate, up)

    @staticmethod
    def backward(ctx, grad: Tensor):
        gate, up = ctx.saved_tensors
        with torch.enable_grad():
            g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
            return torch.autograd.grad(F.silu(g) * u, (g, u), grad)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up for two tensors of one shape and dtype. Differentiable."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate and up must match, got {tuple(gate.shape)} {gate.dtype} and "
                         f"{tuple(up.shape)} {up.dtype}")
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SiluMul.apply(gate, up)
    return _launch(gate, up)  # (no autograd node: a scorer's forward launches less)

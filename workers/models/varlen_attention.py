"""Variable-length attention for packed rows: each sequence of a row attends only to itself, through torch's
FlashAttention varlen kernel (`torch.nn.attention.varlen.varlen_attn`, CUDA) given the row's cumulative sequence
offsets. No mask is built and nothing is compiled per row length, so rows need no padding to a few lengths; a
sequence's output does not depend on where in a row it sits.

Registered with transformers as the attention implementation `NAME`; transformers then builds no mask for it, and
the patched forward passes the offsets (`cu_seq_lens`, `max_length`) through the model to every attention layer.
Off CUDA the same function runs each sequence through sdpa (the reference the kernel is tested against).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import AttentionInterface

NAME = "ppo_varlen"


def _kernel_exists() -> bool:
    try:
        import torch.nn.attention.varlen  # noqa: F401  (a submodule: not an attribute until imported)
    except ImportError:
        return False
    return True


def supported(model: nn.Module, device: torch.device) -> bool:
    """The kernel runs here, for this model's attention (16-bit, no attention-logit softcap, a head size it takes)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return (
        device.type == "cuda"
        and next(model.parameters()).dtype in (torch.float16, torch.bfloat16)
        and _kernel_exists()
        and getattr(config, "attn_logit_softcapping", None) is None
        and head_dim % 8 == 0
        and head_dim <= 256
    )


def cu_seq_lens(position_ids: Tensor) -> tuple[Tensor, int]:
    """Cumulative sequence offsets [S + 1] (int32) of a packed row [1, T] whose positions restart at 0, and the
    longest sequence."""
    starts = torch.nonzero(position_ids[0] == 0)[:, 0]
    total = torch.tensor([position_ids.shape[1]], device=position_ids.device)
    cu = torch.cat([starts, total]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def varlen_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    *,
    cu_seq_lens: Tensor,
    max_length: int,
    **kwargs,
) -> tuple[Tensor, None]:
    # query: [1, H, T, D]; key, value: [1, Hkv, T, D] -> output [1, T, H, D]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H or Hkv, D]
    if k.shape[1] != q.shape[1]:  # GQA: the kernel in torch 2.11 takes no grouped heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if q.is_cuda:
        from torch.nn.attention.varlen import varlen_attn

        window = (sliding_window - 1, 0) if sliding_window else (-1, 0)  # causal, within the window
        out = varlen_attn(q, k, v, cu_seq_lens, cu_seq_lens, max_length, max_length, scale=scaling,
                          window_size=window)
        return out[None], None
    out = torch.empty_like(q)
    for a, b in zip(cu_seq_lens[:-1].tolist(), cu_seq_lens[1:].tolist(), strict=True):
        n = b - a
        allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        if sliding_window:
            allowed &= torch.ones_like(allowed).triu(-(sliding_window - 1))
        out[a:b] = nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), attn_mask=allowed, scale=scaling
        ).transpose(0, 1)
    return out[None], None


AttentionInterface.register(NAME, varlen_attention)

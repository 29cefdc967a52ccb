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


def model_allows(model: nn.Module) -> str | None:
    """Why this model's attention cannot run here (an attention-logit softcap, a head size the kernel rejects),
    or None."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "its attention caps logits (attn_logit_softcapping)"
    if head_dim % 8 or head_dim > 256:
        return f"its head size {head_dim} is not a multiple of 8 up to 256"
    return None


def supported(model: nn.Module, device: torch.device) -> bool:
    """The kernel runs here (CUDA, a 16-bit model) for this model's attention."""
    return (
        device.type == "cuda"
        and next(model.parameters()).dtype in (torch.float16, torch.bfloat16)
        and _kernel_exists()
        and model_allows(model) is None
    )


def cu_seq_lens(starts: Tensor) -> tuple[Tensor, int]:
    """Cumulative sequence offsets [S + 1] (int32) of a packed row whose sequences begin where `starts` ([T] bool,
    True at 0) is True, and the longest sequence."""
    begins = torch.nonzero(starts)[:, 0]
    total = torch.tensor([starts.shape[0]], device=starts.device)
    cu = torch.cat([begins, total]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def one_row(input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None
            ) -> tuple[Tensor | None, Tensor, Tensor]:
    """How a [B, T] call becomes one packed row of its real tokens: (which of the B * T positions are real, or
    None for all; their positions [R]; where each sequence begins [R] bool).

    A sequence begins at each row's first real token and wherever position_ids restart at 0. Without
    position_ids, positions count each row's real tokens from 0 (so left padding shifts nothing).
    """
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if position_ids is None:
        position_ids = real.cumsum(-1) - 1
    position_ids = position_ids.expand(input_ids.shape)
    begins = (position_ids == 0) | (real & (real.cumsum(-1) == 1))
    keep = None if attention_mask is None else real.reshape(-1)
    if keep is None:
        return None, position_ids.reshape(-1), begins.reshape(-1)
    return keep, position_ids.reshape(-1)[keep], begins.reshape(-1)[keep]


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

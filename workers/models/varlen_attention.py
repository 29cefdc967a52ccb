"""Variable-length attention for packed rows: each sequence of a row attends only to itself, through our Triton
kernel (causal_attention.py, heads of up to 128 elements; FlashAttention's backward) or torch's FlashAttention varlen
kernel (aten's `_flash_attention_forward` given cumulative sequence offsets, as `torch.nn.attention.varlen.varlen_attn`
calls it; called directly, it reads grouped K/V heads in place, which the wrapper in torch 2.11 refuses). No mask is
built and nothing is compiled per row length, so rows need no padding to a few lengths; a sequence's output does not
depend on where in a row it sits.

Registered with transformers as the attention implementation `NAME`; transformers then builds no mask for it, and
the patched forward passes the offsets (`cu_seq_lens`, `max_length`) through the model to every attention layer.
Off CUDA the same function runs each sequence through sdpa (the reference the kernel is tested against).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import AttentionInterface

from ..sharding import head_dim
from . import causal_attention

NAME = "ppo_varlen"


def model_allows(model: nn.Module) -> str | None:
    """Why this model's attention cannot run here (an attention-logit softcap, a head size the kernel rejects),
    or None."""
    config = model.config
    size = head_dim(config)
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "its attention caps logits (attn_logit_softcapping)"
    if getattr(config, "use_bidirectional_attention", False):
        return "its attention is bidirectional"
    if size % 8 or size > 256:
        return f"its head size {size} is not a multiple of 8 up to 256"
    return None


def supported(model: nn.Module, device: torch.device) -> bool:
    """The kernel runs here (CUDA, a 16-bit model) for this model's attention."""
    return (
        device.type == "cuda"
        and next(model.parameters()).dtype in (torch.float16, torch.bfloat16)
        and torch.backends.cuda.is_flash_attention_available()
        and model_allows(model) is None
    )


def cu_seq_lens(starts: Tensor) -> tuple[Tensor, int]:
    """Cumulative sequence offsets [S + 1] (int32) of a packed row whose sequences begin where `starts` ([T] bool,
    True at 0) is True, and the longest sequence."""
    begins = torch.nonzero(starts)[:, 0]
    total = begins.new_full((1,), starts.shape[0])  # (filled on the device: a copy from the host would wait on it)
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


@dataclass(frozen=True)
class Keys:
    """Keys other than each sequence's own (shared prefixes, prefixes.py): query segment i (cu_seq_lens) attends to
    the keys at rows kv_index[cu_k[i] : cu_k[i + 1]] of the row, the last of them its own queries' (causal from the
    bottom right)."""

    kv_index: Tensor
    cu_k: Tensor
    max_k: int


@dataclass(frozen=True)
class Pieces:
    """A packed row laid out by a prefix plan (prefixes.py): its query segments (cu_q, the longest max_q) and the keys
    each attends."""

    cu_q: Tensor
    max_q: int
    keys: Keys | None  # (None: each segment attends to itself)

    def with_filler(self, real: int, total: int) -> Pieces:
        """The same with a trailing segment of filler rows real..total-1 that attends to itself."""
        if total == real:
            return self
        n, device = total - real, self.cu_q.device
        tail = torch.tensor([total], dtype=torch.int32, device=device)
        keys = self.keys and Keys(torch.cat([self.keys.kv_index, torch.arange(real, total, device=device)]),
                                  torch.cat([self.keys.cu_k, self.keys.cu_k[-1:] + n]), max(self.keys.max_k, n))
        return Pieces(torch.cat([self.cu_q, tail]), max(self.max_q, n), keys)


def attend(q: Tensor, k: Tensor, v: Tensor, cu_seq_lens: Tensor, max_length: int, scale: float | None = None,
           sliding_window: int | None = None, keys: Keys | None = None,
           plan: causal_attention.Schedule | None = None) -> Tensor:
    """Causal attention of each sequence of a packed row to itself (or to `keys`): q [T, H, D], k and v [T, Hkv, D]
    (H a multiple of Hkv) -> [T, H, D]. On CUDA one call of our kernel (causal_attention.py) for heads of up to
    MAX_HEAD elements, else of FlashAttention's varlen kernel (both read grouped heads in place, both
    differentiable); elsewhere sdpa per sequence, the reference. `plan`: our kernel's tiles as a schedule on the
    device (causal_attention.schedule; a CUDA graph's forward)."""
    cu_k, max_k = cu_seq_lens, max_length
    if keys is not None:
        k, v, cu_k, max_k = k[keys.kv_index], v[keys.kv_index], keys.cu_k, keys.max_k
    if q.is_cuda and q.shape[-1] <= causal_attention.MAX_HEAD:
        return causal_attention.causal_attention(q, k, v, cu_seq_lens, cu_k, max_length, max_k, scale, sliding_window,
                                                 plan)
    if q.is_cuda:
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seq_lens, cu_k, max_length, max_k, 0.0, True, False, scale=scale,
            window_size_left=sliding_window - 1 if sliding_window else -1, window_size_right=0,
        )[0]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = torch.empty_like(q)
    spans = zip(cu_seq_lens.tolist(), cu_seq_lens[1:].tolist(), cu_k.tolist(), cu_k[1:].tolist(), strict=False)
    for a, b, c, d in spans:
        i, j = torch.arange(b - a, device=q.device)[:, None], torch.arange(d - c, device=q.device)[None]
        behind = i + (d - c) - (b - a) - j  # how far key j lies before query i, in the whole sequence
        allowed = (behind >= 0) & (behind < sliding_window if sliding_window else True)
        out[a:b] = nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1), attn_mask=allowed, scale=scale
        ).transpose(0, 1)
    return out


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
    shared_keys: Keys | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention interface over `attend`: query [1, H, T, D]; key, value [1, Hkv, T, D] -> output
    [1, T, H, D]."""
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H or Hkv, D]
    return attend(q, k, v, cu_seq_lens, max_length, scaling, sliding_window, shared_keys)[None], None


AttentionInterface.register(NAME, varlen_attention)

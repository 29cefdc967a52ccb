"""Patch one HuggingFace causal LM instance so that it returns per-token log_probs and entropy.

After `patch_model(model)`, `model(input_ids, attention_mask=..., position_ids=..., temperature=1.0)` runs the
decoder body only and scores its last hidden states with the fused head against the next tokens:
log_probs[b, t] = log p(input_ids[b, t + 1] | input_ids[b, : t + 1]), and entropy[b, t] that distribution's
entropy; both [B, T], fp32, and 0 where there is no next token (the last position, padding on either side).
`scored` ([N] indices into the flattened [B * T] positions) sends only those positions through the head and
returns [N] results; `compute_entropy=False` skips the entropy (None).
Rows may pack several sequences: position_ids restarting at 0 mark where each begins; no token attends to, or
takes its label from, another sequence. On CUDA packed rows run varlen attention (varlen_attention.py) where the
model's attention allows it, else flex_attention for rows of 1024 tokens or more (it skips masked blocks);
other calls keep the model's own attention. No [B, T, V]
logits are made. Only the instance is patched (`types.MethodType`); its class is untouched.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
from torch import Tensor, nn
from transformers.masking_utils import find_packed_sequence_indices
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..head import Backend, fused_log_probs
from . import varlen_attention

_IGNORE = -100

# model_type -> how its head differs from `hidden @ lm_head.weight.T`, as data: the config field holding a
# final-logit softcap that the fused head applies (Gemma 2 and 3). A family not listed is refused, never scored
# approximately (e.g. Cohere's logit_scale, Granite's logits_scaling).
_HEADS: dict[str, dict[str, str]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "phi3": {},
    "gemma2": {"softcap": "final_logit_softcapping"},
    "gemma3_text": {"softcap": "final_logit_softcapping"},
}


@dataclass
class CausalLMOutputForPPO(CausalLMOutputWithPast):
    """A causal LM's output with per-token `log_probs` and `entropy` ([B, T], fp32) instead of logits."""

    log_probs: torch.FloatTensor | None = None
    entropy: torch.FloatTensor | None = None


def head_softcap(model: nn.Module) -> float | None:
    """The final-logit softcap the fused head must apply for this model; ValueError naming the reason when the
    fused head cannot score it exactly."""
    config = model.config
    family = getattr(config, "model_type", None)
    name = type(model).__name__
    if family not in _HEADS:
        raise ValueError(
            f"cannot patch {name} (model_type {family!r}): its LM head is not known to be a plain linear layer "
            f"or one of the variants the fused head applies (supported: {', '.join(_HEADS)})"
        )
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"cannot patch {name}: its output embedding is {type(head).__name__}, not nn.Linear")
    if head.bias is not None:
        raise ValueError(f"cannot patch {name}: its LM head has a bias, which the fused head does not add")
    field = _HEADS[family].get("softcap")
    softcap = getattr(config, field, None) if field else None
    return None if softcap is None else float(softcap)


def packed_segments(position_ids: Tensor | None) -> Tensor | None:
    """Sequence ids [B, T] when rows pack several sequences (position_ids do not step by 1), else None.

    The same rule transformers uses to build packed attention masks, so labels and attention agree.
    """
    if position_ids is None:
        return None
    return find_packed_sequence_indices(position_ids)


def next_token_labels(input_ids: Tensor, attention_mask: Tensor | None, segments: Tensor | None = None) -> Tensor:
    """labels[b, t] = input_ids[b, t + 1], or -100 where there is no next token of the same sequence: at
    t = T - 1, where position t or t + 1 is padding, and where t + 1 starts the next packed sequence."""
    labels = torch.roll(input_ids, shifts=-1, dims=-1)
    keep = torch.ones_like(input_ids, dtype=torch.bool)
    keep[..., -1] = False
    if attention_mask is not None:
        real = attention_mask.bool()
        keep &= real & torch.roll(real, shifts=-1, dims=-1)
    if segments is not None:
        keep &= segments == torch.roll(segments, shifts=-1, dims=-1)
    return labels.masked_fill(~keep, _IGNORE)


# Without varlen attention, shorter packed rows keep sdpa's dense mask (cheap there). Below 128 queries torch
# compiles flex_attention as its decoding kernel, which has no valid configuration for some shapes (fp32,
# head_dim 16: seen on the H200).
_FLEX_MIN_TOKENS = 1024
PackedAttention = Literal["auto", "varlen", "flex", "model"]


def packed_attention_of(model: nn.Module, device: torch.device, choice: PackedAttention = "auto") -> str:
    """How packed rows attend: "varlen" (one varlen kernel per row: CUDA, when the model's attention allows),
    "flex" (flex_attention's block mask for rows of 1024 tokens or more, on CUDA), or "model" (the model's own
    attention with a dense packed mask). "auto" picks the first that applies."""
    if choice != "auto":
        return choice
    if varlen_attention.supported(model, device):
        return "varlen"
    return "flex" if device.type == "cuda" else "model"


def _forward_for_ppo(
    self: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    temperature: float | Tensor = 1.0,
    scored: Tensor | None = None,
    compute_entropy: bool = True,
    *,
    backend: Backend,
    softcap: float | None,
    packed_attention: PackedAttention,
    **kwargs,
) -> CausalLMOutputForPPO:
    kwargs["use_cache"] = False  # scoring never decodes further
    segments = packed_segments(position_ids)
    labels = next_token_labels(input_ids, attention_mask, segments)  # [B, T]
    attn = self.config._attn_implementation
    if segments is not None:
        ## NB: transformers builds packed masks (flex BlockMask, sdpa, eager; sliding windows too) from
        # position_ids only when there is no 2D mask and no cache. Padding has no label (above) and, being causal,
        # is never attended to by an earlier real token; a sequence after it starts at position 0.
        if attention_mask is not None:
            real = attention_mask.bool()
            late = real[..., 1:] & ~real[..., :-1]  # a real token right after padding
            if bool(late.any()):
                row = int(late.nonzero()[0, 0])
                raise ValueError(
                    f"attention_mask row {row}: in packed rows (position_ids restarting) padding may only come "
                    "after the last real token; give each sequence its own positions from 0 instead"
                )
        attention_mask = None
        how = packed_attention_of(self, input_ids.device, packed_attention)
        if how == "varlen" and input_ids.shape[0] == 1:
            self.config._attn_implementation = varlen_attention.NAME
            kwargs["cu_seq_lens"], kwargs["max_length"] = varlen_attention.cu_seq_lens(position_ids)
        elif how == "flex" and attn in ("sdpa", "eager") and input_ids.shape[1] >= _FLEX_MIN_TOKENS:
            # a dense [T, T] mask makes sdpa slower than padding; flex_attention skips the masked blocks
            self.config._attn_implementation = "flex_attention"
    try:
        body = self.base_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        )
    finally:
        self.config._attn_implementation = attn
    hidden = body.last_hidden_state  # [B, T, H]
    weight = self.get_output_embeddings().weight  # [V, H]
    if scored is not None:  # only these positions reach the head (CCE's compaction): [N] flat indices into [B * T]
        hidden = hidden.reshape(-1, hidden.shape[-1])[scored]  # [N, H]
        labels = labels.reshape(-1)[scored]
        if isinstance(temperature, Tensor):
            temperature = temperature.reshape(-1)[scored]
    log_probs, entropy = fused_log_probs(
        hidden, weight, labels, temperature, ignore_index=_IGNORE, backend=backend, softcap=softcap,
        compute_entropy=compute_entropy,
    )
    return CausalLMOutputForPPO(
        log_probs=log_probs, entropy=entropy, hidden_states=body.hidden_states, attentions=body.attentions
    )


def patch_model(model: nn.Module, backend: Backend = "auto", packed_attention: PackedAttention = "auto") -> nn.Module:
    """Makes this model instance return CausalLMOutputForPPO (log_probs, entropy) from its forward.
    `packed_attention`: how packed rows attend (see packed_attention_of)."""
    softcap = head_softcap(model)
    forward = partial(_forward_for_ppo, backend=backend, softcap=softcap, packed_attention=packed_attention)
    model.forward = types.MethodType(forward, model)
    return model

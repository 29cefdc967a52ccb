"""Patch one HuggingFace causal LM instance so that it returns per-token log_probs and entropy.

After `patch_model(model)`, `model(input_ids, attention_mask=..., position_ids=..., temperature=1.0)` runs the
decoder body only and scores its last hidden states with the fused head against the next tokens:
log_probs[b, t] = log p(input_ids[b, t + 1] | input_ids[b, : t + 1]), and entropy[b, t] that distribution's
entropy; both [B, T], fp32, and 0 where there is no next token (the last position, padding on either side).
`scored` ([N] indices into the flattened [B * T] positions) sends only those positions through the head and
returns [N] results; `compute_entropy=False` skips the entropy (None).
Rows may pack several sequences: position_ids restarting at 0 mark where each begins; no token attends to, or
takes its label from, another sequence. Where varlen attention runs (varlen_attention.py: CUDA, 16-bit, an
attention it takes) every call becomes one row of its real tokens, whatever its layout; elsewhere packed rows of
1024 tokens or more run flex_attention on CUDA (it skips masked blocks) and other calls the model's own attention.
A row may instead be laid out in `pieces` (shared prefixes, workers/prefixes.py): one row of tokens at their own
positions, each piece attending to the keys its plan gives it, with `scored`, `scored_labels` and
`scored_temperature` ([N] each) saying what the head scores. `body_graphs` (graphs.py, a worker's): such a row without
shared keys replays its body from a CUDA graph, with the same results.
The body's norms, MLPs and attention blocks get fused forwards (fuse_body.py). No [B, T, V] logits are made. Only
the instance and its modules are patched (`types.MethodType`); no class is touched.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
from torch import Tensor, nn
from transformers.masking_utils import find_packed_sequence_indices
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..families import FAMILIES
from ..head import Backend, fused_log_probs
from ..head.fused_log_probs import check_ids
from ..sharding import held_shard
from . import varlen_attention
from .fuse_body import fuse_body
from .graphs import BodyGraphs

_IGNORE = -100

# (How a family's head differs from `hidden @ lm_head.weight.T` is in families.py, one table; a family not listed
# there is refused, never scored approximately.)


@dataclass
class CausalLMOutputForPPO(CausalLMOutputWithPast):
    """A causal LM's output with per-token `log_probs` and `entropy` ([B, T], fp32) instead of logits; asked for
    (`top_k`, `token_ids`), each position's most likely tokens' log-probs and ids ([B, T, k]), the log-probability of
    all the others (`tail_log_prob`, [B, T]) and the candidates' log-probs ([B, T, C]). With `scored`, each is per
    scored position instead ([N] or [N, ...])."""

    log_probs: torch.FloatTensor | None = None
    entropy: torch.FloatTensor | None = None
    top_log_probs: torch.FloatTensor | None = None
    top_ids: torch.LongTensor | None = None
    tail_log_prob: torch.FloatTensor | None = None
    candidate_log_probs: torch.FloatTensor | None = None


def head_softcap(model: nn.Module) -> float | None:
    """The final-logit softcap the fused head must apply for this model; ValueError naming the reason when the
    fused head cannot score it exactly."""
    config = model.config
    family = getattr(config, "model_type", None)
    name = type(model).__name__
    if family not in FAMILIES:
        raise ValueError(
            f"cannot patch {name} (model_type {family!r}): its LM head is not known to be a plain linear layer "
            f"or one of the variants the fused head applies (supported: {', '.join(FAMILIES)})"
        )
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"cannot patch {name}: its output embedding is {type(head).__name__}, not nn.Linear")
    if head.bias is not None:
        raise ValueError(f"cannot patch {name}: its LM head has a bias, which the fused head does not add")
    field = FAMILIES[family].softcap
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
# Invariant mode: the fewest rows a GEMM sees. Below it cuBLAS runs other kernels, which sum in another order
# (measured on the H200: benchmarks/bench_invariance.py, BENCHMARKS.md).
MIN_TOKENS = 128


def allow_split_k(allowed: bool) -> None:
    """Whether cuBLAS may split a GEMM's sum over K in parts, process-wide, for bf16 and fp16. It does for few rows,
    so a row's bits would change with the number of rows. Not allowed, GEMMs go through cuBLASLt, where that holds;
    allowed, back to cuBLAS's defaults. A no-op without CUDA."""
    if not torch.cuda.is_available():
        return
    matmul = torch.backends.cuda.matmul
    matmul.allow_bf16_reduced_precision_reduction = (allowed, allowed)
    matmul.allow_fp16_reduced_precision_reduction = (allowed, allowed)
    torch.backends.cuda.preferred_blas_library("cublas" if allowed else "cublaslt")


def packed_attention_of(model: nn.Module, device: torch.device, choice: PackedAttention = "auto") -> str:
    """How packed rows attend: "varlen" (one varlen kernel per row: CUDA, when the model's attention allows),
    "flex" (flex_attention's block mask for rows of 1024 tokens or more, on CUDA), or "model" (the model's own
    attention with a dense packed mask). "auto" picks the first that applies."""
    if choice == "varlen" and (why := varlen_attention.model_allows(model)):
        raise ValueError(f"packed_attention='varlen' cannot run {type(model).__name__}: {why}")
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
    checked_inputs: bool = False,
    pieces: varlen_attention.Pieces | None = None,
    scored_labels: Tensor | None = None,
    scored_temperature: Tensor | None = None,
    top_k: int = 0,
    token_ids: Tensor | None = None,
    body_graphs: BodyGraphs | None = None,
    *,
    backend: Backend,
    softcap: float | None,
    packed_attention: PackedAttention,
    min_tokens: int,
    process_group,
    **kwargs,
) -> CausalLMOutputForPPO:
    kwargs["use_cache"] = False  # scoring never decodes further
    if process_group is None and (shard := held_shard(self)) is not None:
        raise RuntimeError(f"this model holds rank {shard.rank} of {shard.size}'s part: it scores once "
                           "patched with its group (patch_model(model, process_group=...), tensor_parallel.connect)")
    if pieces is not None and (input_ids.shape[0] != 1 or attention_mask is not None or scored_labels is None):
        raise ValueError("a row laid out in pieces (shared prefixes) is one row, with position_ids, scored and "
                         "scored_labels (a node's last position predicts a token for each child)")
    # the head checks values again (one more wait on the device, in the middle of the call) only where some are not
    # checked here: the labels are input_ids' or scored_labels, but a rank's part of the vocabulary, a head with fewer
    # rows than the embedding, and temperature and candidate tensors are the head's to check
    head_checks = False
    if not checked_inputs:  # (before any kernel: an id the embedding does not have is named here, not an
        # IndexError or a device-side assert in its lookup)
        rows = self.get_input_embeddings().weight.shape[0]
        vocab = self.get_output_embeddings().weight.shape[0]
        check_ids(input_ids, rows, "input_ids", where=None if attention_mask is None else attention_mask.bool())
        if scored_labels is not None and process_group is None:  # (a rank's head holds part of the vocabulary:
            check_ids(scored_labels, vocab, "scored_labels", _IGNORE)  # the head checks them against the whole)
        head_checks = (process_group is not None or rows > vocab or token_ids is not None
                       or isinstance(temperature, Tensor) or scored_temperature is not None)
    segments = None if pieces is not None else packed_segments(position_ids)
    labels = next_token_labels(input_ids, attention_mask, segments)  # [B, T]
    if segments is not None and attention_mask is not None:
        real = attention_mask.bool()
        late = real[..., 1:] & ~real[..., :-1]  # a real token right after padding
        if bool(late.any()):
            row = int(late.nonzero()[0, 0])
            raise ValueError(
                f"attention_mask row {row}: in packed rows (position_ids restarting) padding may only come "
                "after the last real token; give each sequence its own positions from 0 instead"
            )
    how = packed_attention_of(self, input_ids.device, packed_attention)
    if pieces is not None and how == "flex":
        raise ValueError("rows laid out in pieces (shared prefixes) need varlen attention (or the CPU), not flex")
    if how == "varlen" or pieces is not None:
        hidden, row_of = _one_row_body(self, input_ids, attention_mask, position_ids, min_tokens, kwargs, pieces,
                                       body_graphs)
        body = None
    else:
        body = _model_body(self, input_ids, attention_mask, position_ids, segments, how, kwargs)
        hidden, row_of = body.last_hidden_state.reshape(-1, body.last_hidden_state.shape[-1]), None
    # hidden: [R, H], the rows of the B * T positions that ran (row_of[i]: position i's row; None: all, in order)
    wanted = scored
    if wanted is None and row_of is not None:
        wanted = torch.nonzero(attention_mask.reshape(-1))[:, 0]
    labels = labels.reshape(-1)
    if wanted is not None:  # only these positions reach the head (CCE's compaction): [N] flat indices into [B * T]
        hidden = hidden[wanted if row_of is None else row_of[wanted].clamp(min=0)]  # [N, H]
        labels = labels[wanted]
        if row_of is not None:
            labels = labels.masked_fill(row_of[wanted] < 0, _IGNORE)
        if scored_labels is not None:  # ([N], given: pieces)
            labels = scored_labels
        if scored_temperature is not None:
            temperature = scored_temperature
        elif isinstance(temperature, Tensor):
            temperature = temperature.expand(input_ids.shape).reshape(-1)[wanted]
    elif isinstance(temperature, Tensor):
        temperature = temperature.expand(input_ids.shape).reshape(-1)
    if token_ids is not None and token_ids.dim() == 3:  # [B, T, C], one set per position: those that reach the head
        token_ids = token_ids.reshape(-1, token_ids.shape[-1])
        token_ids = token_ids if wanted is None else token_ids[wanted]
    out = fused_log_probs(
        hidden, self.get_output_embeddings().weight, labels, temperature, ignore_index=_IGNORE, backend=backend,
        softcap=softcap, compute_entropy=compute_entropy, process_group=process_group, check_values=head_checks,
        top_k=top_k, token_ids=token_ids,
    )
    fields = dict(zip(("log_probs", "entropy"), out, strict=False))
    if top_k or token_ids is not None:
        fields.update(out.extras)
    if scored is None:  # back to [B, T] (and [B, T, ...]), 0 where nothing was scored
        fields = {name: None if x is None else _spread(x, wanted, input_ids.shape) for name, x in fields.items()}
    known = {name: fields.pop(name) for name in list(fields) if name in CausalLMOutputForPPO.__dataclass_fields__}
    output = CausalLMOutputForPPO(**known, hidden_states=body and body.hidden_states,
                                  attentions=body and body.attentions)
    for name, values in fields.items():  # (a per-token output added since: a key and an attribute, as the others)
        output[name] = values
    return output


def _spread(values: Tensor, wanted: Tensor | None, shape: torch.Size) -> Tensor:
    shape = (*shape, *values.shape[1:])
    if wanted is None:
        return values.view(shape)
    return values.new_zeros((math.prod(shape[:2]), *values.shape[1:])).index_put((wanted,), values).view(shape)


def _model_body(self, input_ids, attention_mask, position_ids, segments, how, kwargs):
    """The model's own body over [B, T] (its attention, or flex_attention for long packed rows)."""
    attn = self.config._attn_implementation
    if segments is not None:
        ## NB: transformers builds packed masks (flex BlockMask, sdpa, eager; sliding windows too) from
        # position_ids only when there is no 2D mask and no cache. Padding has no label and, being causal, is
        # never attended to by an earlier real token; a sequence after it starts at position 0.
        attention_mask = None
        if how == "flex" and attn in ("sdpa", "eager") and input_ids.shape[1] >= _FLEX_MIN_TOKENS:
            # a dense [T, T] mask makes sdpa slower than padding; flex_attention skips the masked blocks
            self.config._attn_implementation = "flex_attention"
    try:
        return self.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               **kwargs)
    finally:
        self.config._attn_implementation = attn


def _one_row_body(self, input_ids, attention_mask, position_ids, min_tokens, kwargs,
                  pieces: varlen_attention.Pieces | None = None,
                  graphs: BodyGraphs | None = None) -> tuple[Tensor, Tensor | None]:
    """The body over one packed row of the call's real tokens, attending through varlen attention: whatever the
    layout (padded, packed, one sequence, pieces of shared prefixes), a sequence meets the same kernels. Rows below
    `min_tokens` get a trailing sequence of filler so that every GEMM sees at least that many rows. Returns (hidden
    [R, H] of the real tokens, each of the B * T positions' row or -1 for padding; None when all are real)."""
    if pieces is not None:
        keep, positions = None, position_ids.reshape(-1)
        begins = torch.zeros_like(positions, dtype=torch.bool)  # (unused: the pieces say where segments begin)
    else:
        keep, positions, begins = varlen_attention.one_row(input_ids, attention_mask, position_ids)
    ids = input_ids.reshape(-1) if keep is None else input_ids.reshape(-1)[keep]  # [R]
    real, least = ids.shape[0], max(min_tokens, 1)  # (a call of padding only still runs one row)
    # a row in pieces without shared keys and without a gradient replays its bucket's graph (graphs.py)
    if (graphs is not None and pieces is not None and pieces.keys is None and real >= 1 and set(kwargs) <= {"use_cache"}
            and not torch.is_grad_enabled()):
        hidden = graphs.body(ids, positions, pieces.cu_q)
        if hidden is not None:
            return hidden, None
    if real < least:
        filler = torch.arange(least - real, device=ids.device)
        ids, positions = torch.cat([ids, torch.zeros_like(filler)]), torch.cat([positions, filler])
        begins = torch.cat([begins, filler == 0])
    if pieces is None:
        cu, longest = varlen_attention.cu_seq_lens(begins)
    else:
        pieces = pieces.with_filler(real, ids.shape[0])
        cu, longest = pieces.cu_q, pieces.max_q
        kwargs = dict(kwargs, shared_keys=pieces.keys)
    attn = self.config._attn_implementation
    self.config._attn_implementation = varlen_attention.NAME
    try:
        body = self.base_model(input_ids=ids[None], position_ids=positions[None], cu_seq_lens=cu,
                               max_length=longest, **kwargs)
    finally:
        self.config._attn_implementation = attn
    hidden = body.last_hidden_state[0, :real]
    return hidden, None if keep is None else torch.where(keep, keep.cumsum(0) - 1, -1)


def patch_model(model: nn.Module, backend: Backend = "auto", packed_attention: PackedAttention = "auto",
                invariant: bool = True, process_group=None) -> nn.Module:
    """Makes this model instance return CausalLMOutputForPPO (log_probs, entropy) from its forward, and runs its
    body's norms and MLP middles through fused kernels (fuse_body).
    `packed_attention`: how packed rows attend (see packed_attention_of). `invariant`: a sequence's results are the
    same bits however it is batched (see docs/exactness.md): GEMMs never split their sums (allow_split_k, a
    process-wide setting that invariant=False leaves as it is) and see at least MIN_TOKENS rows. `process_group`:
    the model is sharded over it (tensor_parallel.shard_model) and its head scores the vocabulary split."""
    softcap = head_softcap(model)
    packed_attention_of(model, torch.device("cpu"), packed_attention)  # refuses a choice that cannot run it
    if invariant:
        allow_split_k(False)
    forward = partial(_forward_for_ppo, backend=backend, softcap=softcap, packed_attention=packed_attention,
                      min_tokens=MIN_TOKENS if invariant else 0, process_group=process_group)
    fuse_body(model, backend)
    model.forward = types.MethodType(forward, model)
    return model

"""The fused LM head: per-token log-probabilities and entropies without materialising [tokens, vocab] logits.

One public entry point (`fused_log_probs`) and one autograd Function; the options and the backends are in
backends.py, the vocabulary split across ranks in vocab_parallel.py (both below this module).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..outputs import asked
from ..request import MAX_TOP_K  # (the widest top-k the Triton kernels keep: a vocabulary tile holds a top list)
from .backends import Backend, HeadOptions, backend_backward, backend_forward, resolve_backend
from .torch_log_probs import Extras
from .vocab_parallel import vocab_parallel_log_probs, vocab_split

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _position(flat_index: int, shape: torch.Size) -> str:
    idx = []
    for size in reversed(shape):
        idx.append(flat_index % size)
        flat_index //= size
    return "[" + ", ".join(map(str, reversed(idx))) + "]"


def _check_inputs(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, backend: str,
                  vocab: int | None = None, check_values: bool = True) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, H], got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [..., H] with H = weight.shape[1] = {weight.shape[1]}, "
            f"got shape {tuple(hidden.shape)}"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels must have shape {tuple(hidden.shape[:-1])} (hidden without H), got {tuple(labels.shape)}"
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must share a dtype, got {hidden.dtype} and {weight.dtype}")
    allowed = _FLOAT_DTYPES + ((torch.float64,) if backend == "torch" else ())
    if hidden.dtype not in allowed:
        raise ValueError(f"dtype {hidden.dtype} is not supported by backend {backend!r}; use one of {allowed}")
    if not (hidden.device == weight.device == labels.device):
        raise ValueError(
            f"hidden, weight and labels must be on one device, got {hidden.device}, {weight.device}, {labels.device}"
        )
    if check_values:
        check_ids(labels, vocab or weight.shape[0], "labels", ignore_index)


def check_ids(ids: Tensor, vocab: int, name: str, ignore_index: int | None = None, where: Tensor | None = None
              ) -> None:
    """Raises a ValueError naming the first of `ids` (where `where` is True, if given) outside [0, vocab) and not
    `ignore_index`: its field, position and value. One wait on the device."""
    bad = (ids < 0) | (ids >= vocab)
    if ignore_index is not None:
        bad &= ids != ignore_index
    if where is not None:
        bad &= where
    if bool(bad.any()):
        first = int(bad.flatten().nonzero()[0])
        value = int(ids.flatten()[first])
        ignored = "" if ignore_index is None else f" and is not ignore_index ({ignore_index})"
        raise ValueError(f"{name}{_position(first, ids.shape)} = {value} is outside the vocabulary [0, {vocab})"
                         + ignored)


def _inverse_temperature(temperature: float | Tensor, labels: Tensor, check_values: bool = True) -> Tensor:
    """1 / temperature as an fp32 tensor shaped like labels (flattened)."""
    if isinstance(temperature, Tensor) and temperature.dim() > 0:
        if temperature.shape != labels.shape:
            raise ValueError(
                f"a temperature tensor must have the shape of labels {tuple(labels.shape)}, "
                f"got {tuple(temperature.shape)}"
            )
        t = temperature.to(device=labels.device, dtype=torch.float32)
        bad = ~(torch.isfinite(t) & (t > 0)) if check_values else None
        if bad is not None and bool(bad.any()):
            first = int(bad.flatten().nonzero()[0])
            raise ValueError(
                f"temperature{_position(first, labels.shape)} = {float(t.flatten()[first])} "
                "must be a positive finite number"
            )
        return (1.0 / t).flatten().contiguous()
    value = float(temperature)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"temperature must be a positive finite number, got {value}")
    return torch.full((labels.numel(),), 1.0 / value, dtype=torch.float32, device=labels.device)


class HeadOutput(NamedTuple):
    """fused_log_probs' answer when asked for more than log-probs and entropies (see there): `extras`, the per-token
    outputs asked for by the name of their row (workers/outputs.py), read as attributes too: top_log_probs
    [..., k] (most likely first), top_ids [..., k] (int64), tail_log_prob [...] (the log of the probability of
    every token outside the top k), candidate_log_probs [..., C]; None where not asked for. Per position, they are
    log-probabilities under the same logits, not differentiable."""

    log_probs: Tensor
    entropy: Tensor | None
    extras: Extras

    def __getattr__(self, name: str) -> Tensor | None:
        return getattr(self.extras, name)


class _FusedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, opts: HeadOptions,
                candidates: Tensor | None):
        ctx.set_materialize_grads(False)
        log_probs, entropy, lse, extras = backend_forward(hidden, weight, labels, inv_temp, opts,
                                                          ignore_index=opts.ignore_index, candidates=candidates)
        ctx.save_for_backward(hidden, weight, labels, inv_temp, lse, entropy)
        ctx.opts = opts
        more = extras.values_in_order()  # (an autograd Function answers tensors: the table's, None if not asked)
        ctx.mark_non_differentiable(*(t for t in more if t is not None))
        return log_probs, entropy, *more

    @staticmethod
    def backward(ctx, grad_log_probs: Tensor | None, grad_entropy: Tensor | None, *_):
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        if (grad_log_probs is None and grad_entropy is None) or not (need_hidden or need_weight):
            return None, None, None, None, None, None
        d_hidden, d_weight = backend_backward(ctx.saved_tensors, grad_log_probs, grad_entropy, ctx.opts,
                                              ignore_index=ctx.opts.ignore_index, need_hidden=need_hidden,
                                              need_weight=need_weight)
        return d_hidden, d_weight, None, None, None, None


def _candidates(token_ids: Tensor, labels: Tensor, vocab: int, check_values: bool) -> Tensor:
    """token_ids ([C] for every position, or labels' shape + [C]) as [N, C] int64, checked."""
    if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool or token_ids.is_complex():
        raise ValueError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
    if token_ids.dim() == 1:
        flat = token_ids.to(labels.device, torch.int64)[None, :].expand(labels.numel(), -1)
    elif token_ids.shape[:-1] == labels.shape:
        flat = token_ids.to(labels.device, torch.int64).reshape(labels.numel(), token_ids.shape[-1])
    else:
        raise ValueError(f"token_ids must be [C] or [{', '.join(map(str, labels.shape))}, C] (labels' shape and the "
                         f"candidates), got shape {tuple(token_ids.shape)}")
    if token_ids.shape[-1] == 0:
        raise ValueError("token_ids must hold at least one candidate id")
    if check_values:
        bad = (token_ids < 0) | (token_ids >= vocab)
        if bool(bad.any()):
            first = int(bad.flatten().nonzero()[0])
            raise ValueError(f"token_ids{_position(first, token_ids.shape)} = {int(token_ids.flatten()[first])} is "
                             f"outside the vocabulary [0, {vocab})")
    return flat.contiguous()


def fused_log_probs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: float | Tensor = 1.0,
    *,
    ignore_index: int = -100,
    compute_entropy: bool = True,
    backend: Backend = "auto",
    chunk_size: int = 512,
    softcap: float | None = None,
    process_group=None,
    check_values: bool = True,
    top_k: int = 0,
    token_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor | None] | HeadOutput:
    """log p(labels | hidden) and the entropy of the same distribution, per token, from the LM head weight.

    hidden: [..., H]; weight: [V, H]; labels: [...] (integers in [0, V) or `ignore_index`);
    temperature: a positive float or a tensor shaped like labels (divides the logits).
    softcap: final-logit softcapping (Gemma 2 and 3): logits = softcap * tanh(hidden @ weight.T / softcap),
    applied before the temperature.
    Returns (log_probs, entropy), fp32 and shaped like labels; entropy is None when compute_entropy=False.
    Ignored tokens give 0 and no gradient. Differentiable in hidden and weight.
    process_group: the vocabulary is split across its ranks (vocab_parallel.py): weight holds this rank's rows,
    `torch.tensor_split(torch.arange(V), N)[rank]`; hidden, labels (global ids) and temperature are the same on
    every rank, and so are the results. d_hidden comes back whole (summed over the group), d_weight for these rows.
    check_values=False: the labels and temperatures were checked where they came in (a worker's request), so only
    shapes and dtypes are checked here, with no device-to-host synchronisation.
    top_k (0 < k <= V; at most MAX_TOP_K with Triton) and token_ids (candidate ids: [C] for every position, or
    labels' shape + [C]) ask for more from the same pass, and the answer is then a HeadOutput: the k most likely
    tokens' log-probs and ids per position (ties to the lower id) with the log-probability of all the others (the
    tail), and the log-probs of the candidates. These are 0 (ids -1) at ignored positions and carry no gradient.
    """
    opts = HeadOptions(
        backend=resolve_backend(backend, hidden.device),
        ignore_index=ignore_index,
        compute_entropy=compute_entropy,
        chunk_size=chunk_size,
        softcap=None if softcap is None else float(softcap),
        top_k=top_k,
    )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    if opts.softcap is not None and not (math.isfinite(opts.softcap) and opts.softcap > 0):
        raise ValueError(f"softcap must be None or a positive finite number, got {softcap}")
    if process_group is not None:

        start, vocab = vocab_split(weight, process_group)
    else:
        vocab = None
    _check_inputs(hidden, weight, labels, ignore_index, opts.backend, vocab, check_values)
    vocab = vocab or weight.shape[0]
    most = vocab if opts.backend == "torch" else min(vocab, MAX_TOP_K)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= most:
        raise ValueError(f"top_k must be an integer in [0, {most}] ({'V' if most == vocab else 'MAX_TOP_K'} with "
                         f"backend {opts.backend!r}), got {top_k!r}")
    candidates = None if token_ids is None else _candidates(token_ids, labels, vocab, check_values)
    more = bool(top_k) or candidates is not None
    inv_temp = _inverse_temperature(temperature, labels, check_values)
    shape = labels.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    if flat_hidden.stride(-1) != 1:
        flat_hidden = flat_hidden.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    flat_labels = labels.reshape(-1).to(torch.int64)
    if flat_labels.numel() == 0:  # no kernel for no tokens; the empty result still carries hidden's graph
        empty = hidden.sum(-1, dtype=torch.float32)
        out = empty, (empty.clone() if compute_entropy else None)
        if not more:
            return out
        wanted = asked(top_k, 0 if candidates is None else candidates.shape[1])
        return HeadOutput(*out, Extras({o.name: torch.zeros(*shape, *((w,) if w else ()), device=hidden.device,
                                                            dtype=torch.int64 if o.dtype[1] in "iu" else torch.float32)
                                        for o, w in wanted.items()}))
    if process_group is not None:
        log_probs, entropy, *extras = vocab_parallel_log_probs(flat_hidden, weight, flat_labels, inv_temp, opts,
                                                               process_group, start, candidates)
    else:
        log_probs, entropy, *extras = _FusedLogProbs.apply(flat_hidden, weight, flat_labels, inv_temp, opts,
                                                           candidates)
    log_probs, entropy = log_probs.view(shape), (entropy.view(shape) if entropy is not None else None)
    if not more:
        return log_probs, entropy
    extras = Extras.in_order(extras)
    return HeadOutput(log_probs, entropy, Extras({name: t.view(*shape, *t.shape[1:]) for name, t in extras.items()}))


class FusedLinearForPPO(nn.Module):
    """The LM head as a module: forward(hidden_states, vocab_weights, input_ids) -> (log_probs, entropy).

    `input_ids` are the labels each position is scored on (already shifted by one).
    """

    def __init__(self, chunk_size: int = 512, backend: Backend = "auto") -> None:
        super().__init__()
        self.chunk_size = chunk_size
        self.backend = backend

    def forward(
        self, hidden_states: Tensor, vocab_weights: Tensor, input_ids: Tensor, temperature: float | Tensor = 1.0
    ) -> tuple[Tensor, Tensor | None]:
        return fused_log_probs(
            hidden_states, vocab_weights, input_ids, temperature, backend=self.backend, chunk_size=self.chunk_size
        )

    def extra_repr(self) -> str:
        return f"chunk_size={self.chunk_size}, backend={self.backend!r}"

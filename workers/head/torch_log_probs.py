"""The torch backend of the fused head: chunked over tokens, fp32 math; also the readable statement of the math.

Both functions take flattened inputs: hidden [N, H], weight [V, H], labels [N] (int64), inv_temp [N] (fp32).
Logits are z = cap(hidden @ weight.T) * inv_temp, where cap(x) = softcap * tanh(x / softcap) when a final-logit
softcap is given (Gemma 2 and 3) and x otherwise. For each token: lse = logsumexp(z),
log_prob = z[label] - lse, entropy = lse - sum(softmax(z) * z). Asked for (`Extras`): the k largest z and their ids
(ties to the lower id), the logsumexp of the other z (the tail), and z at given candidate ids.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..outputs import OUTPUTS, asked


class Extras(dict):
    """What a forward gives beside log-probs and entropies, per token, by the name of its row in the per-token
    outputs' table (workers/outputs.py), read and set as attributes too (None where not asked for): log-probabilities
    under the same logits (fp32; 0, and ids -1, at ignored tokens): the top_k most likely tokens' `top_log_probs`
    [N, k], in order, ties to the lower id, and their ids `top_ids` [N, k] (int64); `tail_log_prob` [N], the log of
    the probability of all the other tokens (-inf when k is V); `candidate_log_probs` [N, C], those of the candidate
    ids (0 where a candidate is negative: not this device's rows, under vocab parallelism); and a row's that brings
    its own computation (Output.torch), here."""

    def __getattr__(self, name: str) -> Tensor | None:
        if name in OUTPUTS:
            return self.get(name)
        raise AttributeError(f"'Extras' object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Tensor | None) -> None:
        self[name] = value

    def values_in_order(self) -> tuple:
        """Its tensors in the table's order, None where not asked for (an autograd Function's outputs)."""
        return tuple(self.get(name) for name in OUTPUTS)

    @staticmethod
    def in_order(values) -> Extras:
        return Extras({name: v for name, v in zip(OUTPUTS, values, strict=True) if v is not None})


def order_keys(z: Tensor, ids: Tensor) -> Tensor:
    """int64 keys that sort fp32 logits `z` by value, then by the lower id (`ids`, non-negative, < 2**32): a
    larger key is a larger logit, or the same logit at a lower id. -0.0 sorts below 0.0."""
    bits = z.float().view(torch.int32).to(torch.int64)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered << 32) | (0xFFFFFFFF - ids)


def _top_k(logits: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """(the k largest logits per row in order, their ids, the logsumexp of the others) of [C, V] logits."""
    ids = torch.arange(logits.shape[-1], device=logits.device)
    if logits.dtype == torch.float32:  # unique keys: an exact selection whatever torch.topk does with ties
        keys, _ = torch.topk(order_keys(logits, ids), k, dim=-1)
        top_ids = 0xFFFFFFFF - (keys & 0xFFFFFFFF)
    else:  # (float64, the reference precision): a stable sort keeps the lower id first among equals
        top_ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]
    top_z = logits.gather(-1, top_ids)
    rest = logits.scatter(-1, top_ids, float("-inf"))
    return top_z, top_ids, torch.logsumexp(rest, dim=-1)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def mm_fp32(a: Tensor, b: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """a @ b accumulated in fp32 (fp64 for fp64 inputs), rounded once to out_dtype (default: fp32/fp64).

    16-bit CUDA inputs stay on the tensor cores (cuBLAS with an fp32 output); elsewhere the inputs are widened.
    """
    acc = _compute_dtype(a.dtype)
    out_dtype = out_dtype or acc
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and a.dtype == b.dtype:
        return torch.mm(a, b) if out_dtype == a.dtype else torch.mm(a, b, out_dtype=out_dtype)
    return (a.to(acc) @ b.to(acc)).to(out_dtype)


def _pad_rows(t: Tensor, size: int, value: float) -> Tensor:
    return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, size - t.shape[0]), value=value)


def _chunk_logits(
    hidden: Tensor, weight: Tensor, inv_temp: Tensor, start: int, chunk_size: int, softcap: float | None
) -> tuple[Tensor, Tensor]:
    """Logits z of rows [start, start + chunk_size) and dz / d(hidden @ weight.T), fp32 (fp64 for fp64 inputs),
    each [chunk_size, V] (the second may be [chunk_size, 1]).

    ## NB: the last chunk is zero-padded to chunk_size rows, and callers reduce over the whole padded chunk, so
    every matmul and softmax launch has one shape: cuBLAS, CPU BLAS and the CUDA reductions pick their kernels
    by shape, and a token's result must not depend on how many other tokens share the call.
    """
    h = _pad_rows(hidden[start : start + chunk_size], chunk_size, 0.0)  # [C, H]
    raw = mm_fp32(h, weight.T)  # [C, V]
    t = _pad_rows(inv_temp[start : start + chunk_size], chunk_size, 1.0)[:, None].to(raw.dtype)  # [C, 1]
    if softcap is None:
        return raw * t, t
    th = torch.tanh(raw / softcap)
    return th * (softcap * t), (1 - th * th) * t


def torch_log_probs_forward(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    inv_temp: Tensor,
    *,
    ignore_index: int,
    compute_entropy: bool,
    chunk_size: int,
    softcap: float | None = None,
    top_k: int = 0,
    candidates: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor, Extras]:
    """Returns (log_probs [N], entropy [N] or None, lse [N]), all fp32, ignored tokens giving 0, and the Extras asked
    for: `top_k` > 0, `candidates` [N, C] (int64 ids; negative: none here)."""
    n = hidden.shape[0]
    weight_c = weight if weight.is_cuda else weight.to(_compute_dtype(weight.dtype))  # [V, H], widened once
    out_dtype = torch.float32
    log_probs = torch.zeros(n, dtype=out_dtype, device=hidden.device)
    entropy = torch.zeros_like(log_probs) if compute_entropy else None
    lse = torch.zeros_like(log_probs)
    extras = Extras()
    if top_k:
        extras.top_log_probs = torch.zeros(n, top_k, dtype=out_dtype, device=hidden.device)
        extras.top_ids = torch.full((n, top_k), -1, dtype=torch.int64, device=hidden.device)
        extras.tail_log_prob = torch.zeros_like(log_probs)
    if candidates is not None:
        extras.candidate_log_probs = torch.zeros(candidates.shape, dtype=out_dtype, device=hidden.device)
    own = [(o, w) for o, w in asked(top_k, 0 if candidates is None else candidates.shape[1]).items() if o.torch]
    for output, width in own:
        extras[output.name] = torch.zeros((n, width) if width else (n,), dtype=_torch_dtype(output.dtype),
                                          device=hidden.device)
    for start in range(0, n, chunk_size):
        rows = min(chunk_size, n - start)
        logits, _ = _chunk_logits(hidden, weight_c, inv_temp, start, chunk_size, softcap)  # [C, V]
        lab = _pad_rows(labels[start : start + rows], chunk_size, ignore_index)  # [C]
        ignored = lab == ignore_index
        chunk_lse = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(-1, torch.where(ignored | (lab < 0), 0, lab)[:, None])[:, 0]  # (< 0: not here)
        log_probs[start : start + rows] = torch.where(ignored, 0.0, picked - chunk_lse)[:rows].to(out_dtype)
        lse[start : start + rows] = chunk_lse[:rows].to(out_dtype)
        if entropy is not None:
            probs = torch.softmax(logits, dim=-1)
            ent = chunk_lse - (probs * logits).sum(-1)
            entropy[start : start + rows] = torch.where(ignored, 0.0, ent)[:rows].to(out_dtype)
        kept = ~ignored[:rows, None]
        if top_k:
            top_z, top_ids, tail = _top_k(logits[:rows], top_k)
            sl, row_lse = slice(start, start + rows), chunk_lse[:rows, None]
            extras.top_log_probs[sl] = torch.where(kept, top_z - row_lse, 0.0).to(out_dtype)
            extras.top_ids[sl] = torch.where(kept, top_ids, -1)
            extras.tail_log_prob[sl] = torch.where(kept[:, 0], tail - row_lse[:, 0], 0.0).to(out_dtype)
        if candidates is not None:
            ids = candidates[start : start + rows]
            picked = logits[:rows].gather(-1, ids.clamp(min=0)) - chunk_lse[:rows, None]
            extras.candidate_log_probs[start : start + rows] = torch.where(kept & (ids >= 0), picked, 0.0).to(out_dtype)
        for output, width in own:  # (0 at ignored tokens, as the others)
            values = output.torch(logits[:rows], chunk_lse[:rows])
            extras[output.name][start : start + rows] = torch.where(kept if width else kept[:, 0], values, 0)
    return log_probs, entropy, lse, extras


def _torch_dtype(dtype: str) -> torch.dtype:
    """A row's values on the device: fp32, or int64 for ids (results hold them as the row's dtype)."""
    return torch.int64 if dtype[1] in "iu" else torch.float32


def torch_log_probs_backward(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    inv_temp: Tensor,
    lse: Tensor,
    entropy: Tensor | None,
    grad_log_probs: Tensor | None,
    grad_entropy: Tensor | None,
    *,
    ignore_index: int,
    chunk_size: int,
    need_hidden: bool = True,
    need_weight: bool = True,
    softcap: float | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """Gradients of sum(grad_log_probs * log_probs + grad_entropy * entropy) in hidden and weight.

    d z_j = g_lp * (onehot_j - p_j) - g_ent * p_j * (log p_j + entropy), and d(hidden @ weight.T) = d z * dz/dx
    with dz/dx = inv_temp (times 1 - tanh^2 under a softcap).
    Gradients are accumulated in fp32 (fp64 for fp64 inputs) and rounded once to the input dtype.
    """
    n = hidden.shape[0]
    acc = _compute_dtype(weight.dtype)
    weight_c = weight.to(acc)
    d_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_hidden else None
    d_weight = torch.zeros_like(weight_c) if need_weight else None
    for start in range(0, n, chunk_size):
        rows = min(chunk_size, n - start)
        sl = slice(start, start + rows)
        logits, dz_dx = _chunk_logits(hidden, weight_c, inv_temp, start, chunk_size, softcap)
        logits, dz_dx = logits[:rows], dz_dx[:rows]  # [rows, V], [rows, V or 1]
        log_p = logits - lse[sl, None].to(acc)
        probs = log_p.exp()
        keep = (labels[sl] != ignore_index).to(acc)[:, None]  # [rows, 1]
        d_logits = torch.zeros_like(logits)
        if grad_log_probs is not None:
            g = grad_log_probs[sl, None].to(acc) * keep
            d_logits -= g * probs
            hit = ((labels[sl] >= 0) & (labels[sl] < weight.shape[0]))[:, None]  # a label not ignored nor elsewhere
            d_logits.scatter_add_(-1, torch.where(hit, labels[sl, None], 0), g * hit)
        if grad_entropy is not None:
            g = grad_entropy[sl, None].to(acc) * keep
            d_logits -= g * probs * (log_p + entropy[sl, None].to(acc))
        d_logits *= dz_dx
        if d_hidden is not None:
            d_hidden[sl] = d_logits @ weight_c
        if d_weight is not None:
            d_weight += d_logits.T @ hidden[sl].to(acc)
    return (
        d_hidden.to(hidden.dtype) if d_hidden is not None else None,
        d_weight.to(weight.dtype) if d_weight is not None else None,
    )

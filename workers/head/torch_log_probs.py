"""The torch backend of the fused head: chunked over tokens, fp32 math; also the readable statement of the math.

Both functions take flattened inputs: hidden [N, H], weight [V, H], labels [N] (int64), inv_temp [N] (fp32).
Logits are z = cap(hidden @ weight.T) * inv_temp, where cap(x) = softcap * tanh(x / softcap) when a final-logit
softcap is given (Gemma 2 and 3) and x otherwise. For each token: lse = logsumexp(z),
log_prob = z[label] - lse, entropy = lse - sum(softmax(z) * z).
"""

from __future__ import annotations

import torch
from torch import Tensor


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
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Returns (log_probs [N], entropy [N] or None, lse [N]), all fp32; ignored tokens give 0."""
    n = hidden.shape[0]
    weight_c = weight if weight.is_cuda else weight.to(_compute_dtype(weight.dtype))  # [V, H], widened once
    log_probs = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    entropy = torch.zeros_like(log_probs) if compute_entropy else None
    lse = torch.zeros_like(log_probs)
    for start in range(0, n, chunk_size):
        rows = min(chunk_size, n - start)
        logits, _ = _chunk_logits(hidden, weight_c, inv_temp, start, chunk_size, softcap)  # [C, V]
        lab = _pad_rows(labels[start : start + rows], chunk_size, ignore_index)  # [C]
        ignored = lab == ignore_index
        chunk_lse = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(-1, torch.where(ignored | (lab < 0), 0, lab)[:, None])[:, 0]  # (< 0: not here)
        log_probs[start : start + rows] = torch.where(ignored, 0.0, picked - chunk_lse)[:rows].float()
        lse[start : start + rows] = chunk_lse[:rows].float()
        if entropy is not None:
            probs = torch.softmax(logits, dim=-1)
            ent = chunk_lse - (probs * logits).sum(-1)
            entropy[start : start + rows] = torch.where(ignored, 0.0, ent)[:rows].float()
    return log_probs, entropy, lse


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

"""Triton backward of the fused head: recompute logit tiles, write d_logits one vocabulary chunk at a time,
and let cuBLAS turn each chunk into d_hidden (accumulated in fp32) and d_weight (written once).

d z_j = g_lp * (onehot_j - p_j) - g_ent * p_j * (z_j - lse + entropy), p_j = exp(z_j - lse); d logits = d z * inv_temp
(times 1 - tanh^2 under a final-logit softcap).
Memory: one [N, chunk] d_logits buffer (about `chunk_bytes`), d_hidden in fp32, d_weight in the weight dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .torch_log_probs import mm_fp32
from .triton_log_probs_forward import (
    LOG2E,
    TileConfig,
    _grouped_tile,
    _logits_tile,
    _tanh,
    dot_precision,
    tile_config,
    tile_operands,
)


@triton.jit
def _triton_grad_logits_kernel(
    hidden, weight, labels_ptr, inv_temp_ptr, lse_ptr, entropy_ptr, g_lp_ptr, g_ent_ptr, d_logits_ptr,
    N, V, H, v_start, v_count, stride_hn, stride_wv, stride_dn, softcap,
    SOFTCAP: tl.constexpr, HAS_G_LP: tl.constexpr, HAS_G_ENT: tl.constexpr, EVEN_H: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    GROUP_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rb, cb = _grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(v_count, BLOCK_V), GROUP_R)
    rows = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    local_cols = cb * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = v_start + local_cols
    rows_in = rows % N
    acc = _logits_tile(hidden, weight, rb * BLOCK_N, v_start + cb * BLOCK_V, rows_in, cols % V, H, stride_hn,
                       stride_wv, BLOCK_N, BLOCK_V, BLOCK_H, EVEN_H, DOT_PRECISION, USE_TMA)
    inv_t = tl.load(inv_temp_ptr + rows_in)
    lse = tl.load(lse_ptr + rows_in)
    if SOFTCAP:
        th = _tanh(acc / softcap)
        acc = softcap * th
    z = acc * inv_t[:, None]  # [BLOCK_N, BLOCK_V]
    p = tl.exp2((z - lse[:, None]) * LOG2E)
    grad = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    if HAS_G_LP:
        g = tl.load(g_lp_ptr + rows_in)  # zero for ignored tokens
        labels = tl.load(labels_ptr + rows_in)
        grad += g[:, None] * (tl.where(cols[None, :] == labels[:, None], 1.0, 0.0) - p)
    if HAS_G_ENT:
        g = tl.load(g_ent_ptr + rows_in)
        ent = tl.load(entropy_ptr + rows_in)
        grad -= g[:, None] * p * (z - lse[:, None] + ent[:, None])
    grad *= inv_t[:, None]
    if SOFTCAP:
        grad *= 1.0 - th * th
    out = d_logits_ptr + rows.to(tl.int64)[:, None] * stride_dn + local_cols[None, :]
    ok = (rows < N)[:, None] & (local_cols < v_count)[None, :]
    tl.store(out, grad.to(d_logits_ptr.dtype.element_ty), mask=ok)


def triton_log_probs_backward(
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
    need_hidden: bool = True,
    need_weight: bool = True,
    softcap: float | None = None,
    chunk_bytes: int = 2 << 30,
    config: TileConfig | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """Gradients of sum(grad_log_probs * log_probs + grad_entropy * entropy) in hidden and weight."""
    n, h = hidden.shape
    v = weight.shape[0]
    cfg = config or tile_config(hidden.dtype)
    keep = labels != ignore_index
    g_lp = torch.where(keep, grad_log_probs.float(), 0.0) if grad_log_probs is not None else None
    g_ent = torch.where(keep, grad_entropy.float(), 0.0) if grad_entropy is not None else None
    num_chunks = triton.cdiv(n * v * hidden.element_size(), chunk_bytes)  # chunks of about equal width
    chunk = triton.cdiv(triton.cdiv(v, num_chunks), cfg.block_v) * cfg.block_v
    d_logits = torch.empty(n, chunk, dtype=hidden.dtype, device=hidden.device)
    d_hidden = torch.zeros(n, h, dtype=torch.float32, device=hidden.device) if need_hidden else None
    d_weight = torch.empty_like(weight) if need_weight else None
    h_arg, w_arg, use_tma = tile_operands(hidden, weight, cfg)
    for v0 in range(0, v, chunk):
        vc = min(chunk, v - v0)
        grid = (triton.cdiv(n, cfg.block_n) * triton.cdiv(vc, cfg.block_v),)
        _triton_grad_logits_kernel[grid](
            h_arg, w_arg, labels, inv_temp, lse, entropy if entropy is not None else lse,
            g_lp if g_lp is not None else lse, g_ent if g_ent is not None else lse, d_logits,
            n, v, h, v0, vc, hidden.stride(0), weight.stride(0), d_logits.stride(0), softcap or 1.0,
            SOFTCAP=softcap is not None, HAS_G_LP=g_lp is not None, HAS_G_ENT=g_ent is not None,
            EVEN_H=h % cfg.block_h == 0,
            DOT_PRECISION=dot_precision(hidden.dtype), USE_TMA=use_tma, GROUP_R=cfg.group_r,
            BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            enable_fp_fusion=True,
        )
        d_chunk = d_logits[:, :vc]  # [N, vc]
        if d_hidden is not None:
            d_hidden += mm_fp32(d_chunk, weight[v0 : v0 + vc], torch.float32)
        if d_weight is not None:
            d_weight[v0 : v0 + vc] = mm_fp32(d_chunk.T, hidden, weight.dtype)
    return (d_hidden.to(hidden.dtype) if d_hidden is not None else None), d_weight

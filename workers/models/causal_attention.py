"""Causal attention of packed sequences in one Triton kernel (the forward; the backward is FlashAttention's).

Query segment i (rows cu_q[i]:cu_q[i + 1] of q) attends causally, from the bottom right, to key segment i (rows
cu_k[i]:cu_k[i + 1] of k and v): its last query sees every key, a shared prefix's keys come first. Grouped key-value
heads are read in place. Each program takes BLOCK_M queries of one segment and head and walks their keys in blocks
of BLOCK_N counted from the segment's first key, always in increasing order, with the softmax kept online in base 2.
Inside a CUDA graph (graphs.py) the grid cannot follow the row: a fixed number of programs then walks the same tiles
from a schedule computed on the device (`schedule`), each tile computed as the plain grid computes it. On Hopper,
at heads of 128, the plain grid's tiles of rows of GLUON_TOKENS or more run in hopper_attention.py's Gluon kernel
instead (Tiles.gluon): the same blocks and arithmetic on wgmma and TMA, with the same bits.

A query's output depends only on its own segment: the key blocks it sums are aligned to the segment, not to the
row, and do not change with the other segments or where the segment sits. Whether a block is masked changes no
bits of an allowed key's terms (a block's max is taken over its allowed keys, each term is computed as in a whole
block: in the fused tiling one FMA, with the mask applied after exp2; a key masked out adds exact zeros, and a
query's running max starts finite, so a block it sees nothing of changes nothing), so a suffix scored after a
shared prefix gets the bits it gets alone. torch's FlashAttention kernel is invariant too but slower on Hopper
(bench_attention.py); its backward takes our output and log-sum-exp, in its layout ([H, total_q], natural log).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from ..head.triton_log_probs_forward import _dot, dot_precision, interpreting, persistent_programs
from .key_blocks import tile_span

MAX_HEAD = 128  # larger heads keep FlashAttention's kernel (varlen_attention.attend)


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    fused: bool = False  # scale and max subtracted in one FMA, the mask applied after exp2 (see _key_block)
    tma: bool = False  # keys and values read by the copy engine (Hopper and later; see _launch)
    # one of hopper_attention.FORMS: its Gluon kernel where it runs (Hopper, heads of 128, no schedule), the rest by
    # this tiling, which gives the same bits (128 x 128, fused; key_blocks.tile_span: the same blocks)
    gluon: str = ""


# 16-bit heads over 64, fastest first (bench_attention.py --sweep on an H100, 8 x 4096 tokens, 32 query and 4 key-value
# heads of 128: 445, 405 TFLOP/s; with TMA the first ran 447; on Hopper, hopper_attention.py's persistent form 546 with
# the same bits): the first whose pipeline fits the device's shared memory (224 KiB: Hopper and later; 128 KiB:
# the A100; 80 KiB: GPUs of 100 KiB such as the L40S)
_WIDE = (Tiles(128, 128, 8, 3, fused=True, gluon="persistent"), Tiles(128, 64, 8, 3), Tiles(64, 64, 4, 2))


# rows of fewer query tokens run the default tiling's Triton kernel, with the same bits: a Gluon launch costs the host
# ~100 us (its TMA descriptors, the tile counter) against the Triton kernel's ~40, and below this the Triton kernel
# takes about that on the device (H100, 28 / 4 heads: 103 us at 2,048 tokens; BENCHMARKS.md)
GLUON_TOKENS = 2048


def _tiles(head: int, dtype: torch.dtype, device: torch.device | None = None) -> Tiles:
    """One tiling per head size, dtype and kind of GPU (BLOCK_N fixes a query's order of summation; the rest only
    the speed)."""
    if interpreting():
        return Tiles(16, 16, 4, 1)
    room = _shared_memory(torch.device(device or "cuda")) if torch.cuda.is_available() else None
    return tiles_for(head, dtype, room)


def tiles_for(head: int, dtype: torch.dtype, room: int | None) -> Tiles:
    """The tiling of heads of `head` elements of `dtype` on a GPU whose programs may use `room` bytes of shared memory
    (None: as much as Hopper's)."""
    if dtype == torch.float32:
        return Tiles(64, 32, 4, 2)
    if head <= 64:
        return Tiles(128, 64, 4, 3)
    d = triton.next_power_of_2(head)  # (its stages of keys and values, and the queries)
    return next((t for t in _WIDE if room is None or (2 * t.num_stages * t.block_n + t.block_m) * d * 2 <= room),
                _WIDE[-1])


@functools.cache
def hopper_kernels():
    """hopper_attention (Tiles.gluon's kernels), or None before Triton 3.6 (built and checked on 3.6 and 3.9; earlier
    Gluons name its operations otherwise or lack them)."""
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 6):
        return None
    from . import hopper_attention

    return hopper_attention


@functools.cache
def _shared_memory(device: torch.device) -> int:
    """Bytes of shared memory a program may use on this device."""
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


@triton.jit
def _key_block(acc, l_i, m_i, q, k_at, v_at, n, pos, n_k, scale, window, stride_k, stride_v, row, col,
               D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
               WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, FUSED: tl.constexpr, TMA: tl.constexpr):
    """The online softmax over keys n .. n + BLOCK_N - 1 of the segment; masked: causal (pos: the queries' positions
    among the keys), the segment's end and the window. With TMA, k_at and v_at are descriptors of the [keys, heads x
    D] matrices and the segment's keys start at their row `row`, its head's elements at column `col`: rows past the
    segment (the next one's) are read too and masked like any other key, columns past D are multiplied by zeros."""
    keys = n + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    inside = (d < D)[None, :]
    if MASKED:
        inside = inside & (keys < n_k)[:, None]
    if TMA:
        k = k_at.load([row + n, col])
    else:
        k = tl.load(k_at + keys[:, None].to(tl.int64) * stride_k + d[None, :], mask=inside, other=0.0)
    s = _dot(q, k.T, tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32), DOT_PRECISION)
    if MASKED:
        allowed = (keys[None, :] <= pos[:, None]) & (keys < n_k)[None, :]
        if WINDOW:
            allowed = allowed & (pos[:, None] - keys[None, :] < window)
    if FUSED:  # an allowed key's terms are those of a whole block: max(s) * scale, then exp2(fma(s, scale, -max))
        if MASKED:
            m_new = tl.maximum(m_i, tl.max(tl.where(allowed, s, float("-inf")), 1) * scale)
            p = tl.where(allowed, tl.math.exp2(s * scale - m_new[:, None]), 0.0)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
            p = tl.math.exp2(s * scale - m_new[:, None])
    else:
        s = s * scale
        if MASKED:
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if TMA:
        v = v_at.load([row + n, col])
    else:
        v = tl.load(v_at + keys[:, None].to(tl.int64) * stride_v + d[None, :], mask=inside, other=0.0)
    acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attend_tile(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_q, cu_k, segment, block, head, scale, window, group,
                 total_q, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                 D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, FUSED: tl.constexpr, TMA: tl.constexpr):
    """Queries block * BLOCK_M .. + BLOCK_M - 1 of a segment, one head (nothing where the segment is shorter)."""
    q0, n_q, k0, n_k, m0, start, whole, end = tile_span(cu_q, cu_k, segment, block, window, BLOCK_M, BLOCK_N, WINDOW)
    if m0 < n_q:
        rows = m0 + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        row_ok = rows < n_q
        at = (q0 + rows).to(tl.int64)
        q = tl.load(q_ptr + at[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=row_ok[:, None] & (d < D)[None, :], other=0.0)
        if TMA:
            k_at, v_at = k_ptr, v_ptr
        else:
            k_at = k_ptr + k0.to(tl.int64) * stride_kt + (head // group) * stride_kh
            v_at = v_ptr + k0.to(tl.int64) * stride_vt + (head // group) * stride_vh
        pos = n_k - n_q + rows
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], -1.0e38, dtype=tl.float32)  # (finite: a block a query sees nothing of changes nothing)
        for n in range(start, whole, BLOCK_N):
            acc, l_i, m_i = _key_block(acc, l_i, m_i, q, k_at, v_at, n, pos, n_k, scale, window, stride_kt,
                                       stride_vt, k0, (head // group) * D, D, BLOCK_N, BLOCK_D, False, WINDOW,
                                       DOT_PRECISION, FUSED, TMA)
        for n in range(whole, end, BLOCK_N):
            acc, l_i, m_i = _key_block(acc, l_i, m_i, q, k_at, v_at, n, pos, n_k, scale, window, stride_kt,
                                       stride_vt, k0, (head // group) * D, D, BLOCK_N, BLOCK_D, True, WINDOW,
                                       DOT_PRECISION, FUSED, TMA)
        out = acc / l_i[:, None]
        tl.store(out_ptr + at[:, None] * stride_ot + head * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (d < D)[None, :])
        tl.store(lse_ptr + head.to(tl.int64) * total_q + at, (m_i + tl.math.log2(l_i)) * 0.6931471805599453,
                 mask=row_ok)


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_q, cu_k, scale, window, group, q_blocks, total_q,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                      D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, FUSED: tl.constexpr, TMA: tl.constexpr):
    segment = tl.program_id(0) // q_blocks  # (one grid axis: more segments than the 65535 of a second)
    block = q_blocks - 1 - tl.program_id(0) % q_blocks  # (the last blocks, the most keys, start first)
    _attend_tile(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_q, cu_k, segment, block, tl.program_id(1), scale, window,
                 group, total_q, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                 stride_oh, D, BLOCK_M, BLOCK_N, BLOCK_D, WINDOW, DOT_PRECISION, FUSED, TMA)


@triton.jit
def _scheduled_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_q, cu_k, tile_segment, tile_block,
                                tile_count, scale, window, group, heads, total_q, stride_qt, stride_qh, stride_kt,
                                stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, D: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                                WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, FUSED: tl.constexpr,
                                TMA: tl.constexpr):
    """The same tiles from a schedule on the device (see Schedule), each program taking every num_programs-th
    (tile, head): a grid that does not depend on the row's segments, as a CUDA graph needs."""
    for t in range(tl.program_id(0), tl.load(tile_count) * heads, tl.num_programs(0)):
        tile = t // heads
        _attend_tile(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_q, cu_k, tl.load(tile_segment + tile),
                     tl.load(tile_block + tile), t % heads, scale, window, group, total_q, stride_qt, stride_qh,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, D, BLOCK_M, BLOCK_N, BLOCK_D,
                     WINDOW, DOT_PRECISION, FUSED, TMA)


class Schedule(NamedTuple):
    """The kernel's (segment, block) tiles of a packed row, on the device: tile i is block[i] of segment[i], for
    i < count[0] (entries past it are unused); each segment's last block first, as the plain grid runs them."""

    segment: Tensor
    block: Tensor
    count: Tensor


def block_m(head: int, dtype: torch.dtype, device: torch.device | None = None) -> int:
    """The queries one tile takes, for heads of this size and dtype on this device."""
    return _tiles(head, dtype, device).block_m


def schedule(cu_q: Tensor, block: int, capacity: int) -> Schedule:
    """The tiles of the segments cu_q ([S + 1] int32; empty segments allowed) in `capacity` entries (at least
    their number: sum of ceil(length / block)), by torch operations on cu_q's device alone (capturable)."""
    blocks = (cu_q[1:] - cu_q[:-1] + block - 1) // block  # [S]
    ends = torch.cumsum(blocks, 0)
    at = torch.arange(capacity, device=cu_q.device)
    segment = torch.searchsorted(ends, at, right=True).clamp_(max=blocks.shape[0] - 1)
    first = ends[segment] - blocks[segment]
    return Schedule(segment.to(torch.int32), (blocks[segment] - 1 - (at - first)).to(torch.int32),
                    ends[-1:].to(torch.int32))


def _launch(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, scale: float,
            window: int | None, tiles: Tiles | None = None, plan: Schedule | None = None) -> tuple[Tensor, Tensor]:
    t, heads, d = q.shape
    short = tiles is None and t < GLUON_TOKENS  # (tiles given: the caller's choice, whatever the row)
    tiles = tiles or _tiles(d, q.dtype, q.device)
    if tiles.gluon and plan is None and not short and (hopper := hopper_kernels()) and hopper.usable(q, k, v):
        return hopper.attention(q, k, v, cu_q, cu_k, max_q, scale, window, tiles.gluon)
    out = torch.empty_like(q)
    lse = torch.empty(heads, t, dtype=torch.float32, device=q.device)
    common = (scale * math.log2(math.e), window or 0, heads // k.shape[1])
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
               out.stride(1))
    # (BLOCK_D: dots take 16 or more; FMAs only where written so that masked blocks round as whole ones: `fused`)
    sizes = dict(D=d, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=max(16, triton.next_power_of_2(d)),
                 WINDOW=bool(window), DOT_PRECISION=dot_precision(q.dtype), FUSED=tiles.fused,
                 TMA=tiles.tma and all(x.stride(1) == d and x.stride(0) * x.element_size() % 16 == 0
                                       and x.data_ptr() % 16 == 0 for x in (k, v)),
                 num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    keys, values = k, v
    if sizes["TMA"]:  # [keys, heads x D] each, read BLOCK_N x BLOCK_D at a time
        keys, values = (TensorDescriptor.from_tensor(x.view(x.shape[0], -1), [tiles.block_n, sizes["BLOCK_D"]])
                        for x in (k, v))
    if plan is None:
        q_blocks = triton.cdiv(max(max_q, 1), tiles.block_m)
        _attention_kernel[(q_blocks * (cu_q.shape[0] - 1), heads)](
            q, keys, values, out, lse, cu_q, cu_k, *common, q_blocks, t, *strides, **sizes,
            enable_fp_fusion=tiles.fused)
    else:
        programs = min(persistent_programs(q.device), plan.segment.shape[0] * heads)
        _scheduled_attention_kernel[(programs,)](
            q, keys, values, out, lse, cu_q, cu_k, *plan, *common, heads, t, *strides, **sizes,
            enable_fp_fusion=tiles.fused)
    return out, lse


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, window):
        out, lse = _launch(q, k, v, cu_q, cu_k, max_q, scale, window)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.sizes = max_q, max_k, scale, window
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, scale, window = ctx.sizes
        no_dropout = torch.empty(2, dtype=torch.uint64, device=q.device), torch.empty((), dtype=torch.uint64,
                                                                                        device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, True, *no_dropout, scale=scale,
            window_size_left=window - 1 if window else -1, window_size_right=0)
        return dq, dk, dv, None, None, None, None, None, None


def causal_attention(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                     scale: float | None = None, window: int | None = None, plan: Schedule | None = None) -> Tensor:
    """q [Tq, H, D], k and v [Tk, Hkv, D] (H a multiple of Hkv, D at most 256), segments by cu_q and cu_k (int32
    [S + 1]; each key segment at least as long as its query segment) -> [Tq, H, D]; `window`: a query sees the keys
    less than `window` behind it; `plan`: the tiles as a schedule on the device (see schedule(): the grid no longer
    depends on cu_q, max_q is unused; the same bits). Differentiable on CUDA (FlashAttention's backward)."""
    if q.shape[-1] > 256 or q.shape[1] % k.shape[1] or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: heads of at most 256 elements, "
                         "query heads a multiple of key heads, each head contiguous")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return _Attention.apply(q, k, v, cu_q, cu_k, max_q, max_k, scale, window)
    return _launch(q, k, v, cu_q, cu_k, max_q, scale, window, plan=plan)[0]

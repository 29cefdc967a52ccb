"""Triton forward of the fused head: one pass over vocabulary tiles, never writing [N, V] to memory.

Each program owns BLOCK_N tokens and one vocabulary split (a fixed run of BLOCK_V tiles). For every tile it
computes the logits with tensor-core dots (capped by softcap * tanh(x / softcap) when a final-logit softcap is
given) and folds them into fp32 online statistics per token:
  m = running max, s = sum exp(z - m), w = sum exp(z - m) * (z - m), and z[label] when the label is here.
A small combine kernel merges the splits in a fixed order and gives log_prob, entropy and lse.
The number of splits depends on V only, so a token's result never depends on how many tokens share the call.

A top-k takes a second, small pass instead of sorting every tile. The first pass also stores, per (token, tile),
the tile's largest logit with its id, its second largest, and the mass of the logits below the largest. A token's top k
lie in the k tiles of largest maxima (ties as keys order them): any other tile's best is below k logits of those.
Each of those tiles gives its largest; only a tile whose second largest reaches the k-th tile maximum can hold
more of the top k, so the second pass recomputes only such tiles (for random logits about k^2 / (2 * num_tiles)
of a token's k: 3.4 of 64 at 594 tiles), grouped by tile so that each weight tile is read once for all the tokens
that need it, and keeps each one's logits at or above the k-th tile maximum. The combine merges the lists; the tail
is a sum of positive masses (the other tiles', the rest of the chosen tiles'), never 1 minus the top mass.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from .torch_log_probs import Extras

LOG2E = tl.constexpr(1.4426950408889634)
# Logit given to the columns past V in the last tile: exp() of it is 0 and 0 * it is 0 (no inf * 0 = NaN).
_PAD_LOGIT = tl.constexpr(-1.0e30)
_TAKEN = tl.constexpr(-(2**31))  # an _ordered value no logit has (a NaN's): a column already listed
# _order_keys's key of _PAD_LOGIT past every id (0xFFFFFFFF): below every key, an empty list's entry
_NO_KEY = tl.constexpr((int.from_bytes(struct.pack("<f", _PAD_LOGIT.value), "little", signed=True) ^ 0x7FFFFFFF) << 32)
TOP_K_WORKSPACE = 1 << 30  # bytes a top-k call may hold for its per-tile statistics and chosen tiles' lists


@dataclass(frozen=True)
class TileConfig:
    block_n: int  # tokens per program
    block_v: int  # vocabulary entries per tile
    block_h: int  # hidden entries per dot step
    num_splits: int  # vocabulary splits (forward); fixed per V so results are batch invariant
    group_r: int  # row blocks scheduled side by side, for L2 reuse
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = True  # read tiles with the copy engine (Hopper and later) when H allows


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter: TRITON_INTERPRET as Triton reads it (1, true, on, yes)."""
    knobs = getattr(triton, "knobs", None)
    return bool(knobs.runtime.interpret) if knobs is not None else os.environ.get("TRITON_INTERPRET") == "1"


def tile_config(dtype: torch.dtype) -> TileConfig:
    """The one fixed tiling for a dtype. Never tuned per call: that would break batch invariance."""
    if interpreting():  # small tiles so that small test shapes still cross tiles, splits and groups
        return TileConfig(block_n=16, block_v=32, block_h=16, num_splits=3, group_r=2)
    if dtype == torch.float32:
        return TileConfig(block_n=64, block_v=128, block_h=32, num_splits=8, group_r=16, num_warps=8, num_stages=3)
    # 16-bit: chosen by `benchmarks/bench_head.py --sweep` on an H200 and an H100 (BENCHMARKS.md). 66 splits: runs
    # of 9 tiles at V = 151,936, so 128-token row blocks x splits make whole waves on 132 SMs (8 splits left the last
    # wave half empty: 3% of the forward at 32,768 tokens)
    return TileConfig(block_n=128, block_v=256, block_h=64, num_splits=66, group_r=16, num_warps=8, num_stages=3)


def dot_precision(dtype: torch.dtype) -> str:
    """How _logits_tile multiplies: "ieee" for fp32 inputs (no tf32 rounding); "tf32" is ignored for 16-bit.

    ## NB: the Triton interpreter multiplies bf16 tiles as their raw uint16 bits (checked with triton 3.6 and
    3.9), so under TRITON_INTERPRET bf16 tiles are widened to fp32 first: "ieee-widen". bf16 products are exact
    in fp32, so this is the same arithmetic as the tensor cores' bf16 x bf16 -> fp32.
    """
    if dtype == torch.bfloat16 and interpreting():
        return "ieee-widen"
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _grouped_tile(pid, num_row_blocks, num_cols, GROUP_R: tl.constexpr):
    """Maps a program id to (row block, column index) so that GROUP_R row blocks share each column run."""
    per_group = GROUP_R * num_cols
    first_r = (pid // per_group) * GROUP_R
    group_size = tl.minimum(num_row_blocks - first_r, GROUP_R)
    local = pid % per_group
    return first_r + local % group_size, local // group_size


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)  # exact limits: exp2 -> inf gives 1, -> 0 gives -1


@triton.jit
def _top_two(a, a_second, b, b_second):
    """Combines the (largest, second largest) of two disjoint sets (a tie makes the second the largest)."""
    return tl.maximum(a, b), tl.maximum(tl.minimum(a, b), tl.maximum(a_second, b_second))


@triton.jit
def _ordered(z):
    """int32 values ordering fp32 logits as the floats order them (-0.0 below +0.0): the high half of a key."""
    bits = z.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _order_keys(z, ids):
    """int64 keys ordering fp32 logits by value, then by the lower id (as torch_log_probs.order_keys)."""
    return _ordered_keys(_ordered(z), ids)


@triton.jit
def _ordered_keys(ordered, ids):
    return (ordered.to(tl.int64) << 32) | (0xFFFFFFFF - ids.to(tl.int64))


@triton.jit
def _key_logit(keys):
    """The fp32 logit a key was made from."""
    ordered = (keys >> 32).to(tl.int32)
    return tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _dot(h, w, acc, DOT_PRECISION: tl.constexpr):
    if DOT_PRECISION == "ieee-widen":
        return tl.dot(h.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(h, w, acc, input_precision=DOT_PRECISION)


@triton.jit
def _logits_tile(
    hidden, weight, row0, col0, rows, cols, H, stride_hn, stride_wv,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    EVEN_H: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
):
    """hidden[row0:][:BLOCK_N] @ weight[col0:][:BLOCK_V].T in fp32: [BLOCK_N, BLOCK_V].

    With USE_TMA, hidden and weight are tensor descriptors (the copy engine zero-fills past the edges);
    otherwise pointers, read at rows and cols, which must be in range.
    """
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    if USE_TMA:
        for k in range(0, tl.cdiv(H, BLOCK_H)):
            h = hidden.load([row0, k * BLOCK_H])  # [BLOCK_N, BLOCK_H]
            w = weight.load([col0, k * BLOCK_H])  # [BLOCK_V, BLOCK_H]
            acc = _dot(h, w.T, acc, DOT_PRECISION)
    else:
        offs_h = tl.arange(0, BLOCK_H)
        h_ptrs = hidden + rows.to(tl.int64)[:, None] * stride_hn + offs_h[None, :]  # [BLOCK_N, BLOCK_H]
        w_ptrs = weight + cols.to(tl.int64)[None, :] * stride_wv + offs_h[:, None]  # [BLOCK_H, BLOCK_V]
        for k in range(0, tl.cdiv(H, BLOCK_H)):
            if EVEN_H:
                h = tl.load(h_ptrs)
                w = tl.load(w_ptrs)
            else:
                k_ok = offs_h < H - k * BLOCK_H
                h = tl.load(h_ptrs, mask=k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            acc = _dot(h, w, acc, DOT_PRECISION)
            h_ptrs += BLOCK_H
            w_ptrs += BLOCK_H
    return acc


def tile_operands(hidden: Tensor, weight: Tensor, cfg: TileConfig) -> tuple[object, object, bool]:
    """What _logits_tile reads: tensor descriptors for the copy engine where the chip and H allow, else pointers.

    The choice depends on the device, dtype and H only, never on N, so it cannot change a token's bits.
    """
    row_bytes = hidden.shape[1] * hidden.element_size()
    hopper = interpreting() or (hidden.is_cuda and torch.cuda.get_device_capability(hidden.device)[0] >= 9)
    if not (cfg.tma and hopper and row_bytes % 16 == 0):
        return hidden, weight, False
    # the copy engine needs 16-byte aligned rows; an odd view is copied (same values, same bits out)
    hidden, weight = (t if t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 else t.clone()
                      for t in (hidden, weight))
    return (
        TensorDescriptor.from_tensor(hidden, [cfg.block_n, cfg.block_h]),
        TensorDescriptor.from_tensor(weight, [cfg.block_v, cfg.block_h]),
        True,
    )


@triton.jit
def _triton_log_probs_forward_kernel(
    hidden, weight, labels_ptr, inv_temp_ptr,
    part_max_ptr, part_sum_ptr, part_wsum_ptr, label_logit_ptr,
    tile_key_ptr, tile_max_ptr, tile_sum_ptr, tile_rest_ptr, tile_second_ptr, candidates_ptr, candidate_logit_ptr, C,
    N, V, H, stride_hn, stride_wv, tiles_per_split, num_splits, softcap,
    SOFTCAP: tl.constexpr, COMPUTE_ENTROPY: tl.constexpr, EVEN_H: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, TILE_STATS: tl.constexpr, CANDIDATES: tl.constexpr,
    GROUP_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rb, split = _grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), num_splits, GROUP_R)
    rows = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows_in = rows % N  # rows past N recompute a real row; their results are never stored
    labels = tl.load(labels_ptr + rows_in)
    inv_t = tl.load(inv_temp_ptr + rows_in)

    m = tl.full([BLOCK_N], _PAD_LOGIT, dtype=tl.float32)
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    w = tl.zeros([BLOCK_N], dtype=tl.float32)
    z_label = tl.zeros([BLOCK_N], dtype=tl.float32)
    num_tiles = tl.cdiv(V, BLOCK_V)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    for t in range(tile_lo, tile_hi):
        cols = t * BLOCK_V + tl.arange(0, BLOCK_V)
        acc = _logits_tile(hidden, weight, rb * BLOCK_N, t * BLOCK_V, rows_in, cols % V, H, stride_hn, stride_wv,
                           BLOCK_N, BLOCK_V, BLOCK_H, EVEN_H, DOT_PRECISION, USE_TMA)
        if SOFTCAP:
            acc = softcap * _tanh(acc / softcap)
        z = tl.where((cols < V)[None, :], acc * inv_t[:, None], _PAD_LOGIT)  # [BLOCK_N, BLOCK_V]
        if TILE_STATS:  # for a top-k: the tile's largest logit and its second largest
            z_max, second = tl.reduce((z, tl.full(z.shape, _PAD_LOGIT, tl.float32)), 1, _top_two)
        else:
            z_max = tl.max(z, axis=1)
        m_new = tl.maximum(m, z_max)
        d = z - m_new[:, None]
        p = tl.exp2(d * LOG2E)
        alpha = tl.exp2((m - m_new) * LOG2E)
        if COMPUTE_ENTROPY:
            ## NB: w is kept relative to the running max, so it stays small when logits are in the thousands.
            w = alpha * (w + (m - m_new) * s) + tl.sum(p * d, axis=1)
        p_sum = tl.sum(p, axis=1)
        s = alpha * s + p_sum
        if TILE_STATS:  # the largest keyed by its (lowest) id, the second largest's order bits, and the mass
            # exp(z - m_new) of all and of those below the largest (a tile whose largest is tied is always computed
            # again if chosen: its second reaches any floor its largest does)
            at_max = tl.min(tl.where(z == z_max[:, None], tl.arange(0, BLOCK_V)[None, :], BLOCK_V), axis=1)
            at = rows.to(tl.int64) + t * N  # (t * N < 2**31: the workspace bounds it)
            tl.store(tile_key_ptr + at, _order_keys(z_max, t * BLOCK_V + at_max), mask=row_ok)
            tl.store(tile_max_ptr + at, m_new, mask=row_ok)
            tl.store(tile_sum_ptr + at, p_sum, mask=row_ok)
            tl.store(tile_rest_ptr + at, tl.sum(tl.where(z < z_max[:, None], p, 0.0), axis=1), mask=row_ok)
            tl.store(tile_second_ptr + at, _ordered(second), mask=row_ok)
        m = m_new
        here = (labels >= t * BLOCK_V) & (labels < t * BLOCK_V + BLOCK_V)
        if tl.max(here.to(tl.int32), axis=0) > 0:
            z_label += tl.sum(tl.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
        if CANDIDATES:  # each candidate's logit, stored by the one tile that holds it
            for c in range(C):
                ids = tl.load(candidates_ptr + rows_in.to(tl.int64) * C + c)
                found = (ids >= t * BLOCK_V) & (ids < t * BLOCK_V + BLOCK_V)
                if tl.max(found.to(tl.int32), axis=0) > 0:
                    z_c = tl.sum(tl.where(cols[None, :] == ids[:, None], z, 0.0), axis=1)
                    tl.store(candidate_logit_ptr + rows.to(tl.int64) * C + c, z_c, mask=row_ok & found)

    part = split.to(tl.int64) * N + rows
    tl.store(part_max_ptr + part, m, mask=row_ok)
    tl.store(part_sum_ptr + part, s, mask=row_ok)
    if COMPUTE_ENTROPY:
        tl.store(part_wsum_ptr + part, w, mask=row_ok)
    mine = row_ok & (labels >= tile_lo * BLOCK_V) & (labels < tile_hi * BLOCK_V)
    tl.store(label_logit_ptr + rows, z_label, mask=mine)


@triton.jit
def _triton_top_tiles_kernel(
    hidden, weight, inv_temp_ptr, pair_ptr, tile_ptr, start_ptr, end_ptr, programs, top_tiles_ptr,
    pair_keys_ptr, pair_rest_ptr, pair_count_ptr, V, H, stride_hn, stride_wv, k_tiles, softcap,
    SOFTCAP: tl.constexpr, EVEN_H: tl.constexpr, DOT_PRECISION: tl.constexpr, TOP_K: tl.constexpr,
    EVERY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """The second pass of a top-k: per scheduled program (in turn over a grid of a few per SM), one vocabulary tile
    for BLOCK_N (token, tile) pairs that need it again.

    Per pair: the tile's logits at or above the token's k-th tile maximum, at most TOP_K of them, as keys in
    descending order (at least the tile's largest), and how many; and the mass exp(z - row max) of the tile's other
    logits. The logits are computed as the first pass computed them."""
    for prog in range(tl.program_id(0), programs, tl.num_programs(0)):
        tile = tl.load(tile_ptr + prog).to(tl.int64)
        if tile >= 0:  # (else a spare of a schedule sized for the worst case)
            at = tl.load(start_ptr + prog) + tl.arange(0, BLOCK_N)
            ok = at < tl.load(end_ptr + prog)
            pair = tl.load(pair_ptr + at, mask=ok, other=0)
            rows = pair // k_tiles
            cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
            acc = _logits_tile(hidden, weight, 0, 0, rows, cols % V, H, stride_hn, stride_wv,
                               BLOCK_N, BLOCK_V, BLOCK_H, EVEN_H, DOT_PRECISION, False)
            if SOFTCAP:
                acc = softcap * _tanh(acc / softcap)
            inv_t = tl.load(inv_temp_ptr + rows)
            z = tl.where((cols < V)[None, :], acc * inv_t[:, None], _PAD_LOGIT)
            ordered = _ordered(z)  # (keys' high halves: the key of a column is this and its id)
            first = rows.to(tl.int64) * k_tiles
            low = (tl.load(top_tiles_ptr + first + k_tiles - 1) >> 32).to(tl.int32)  # the k-th tile max's value
            if EVERY:  # fewer tiles than k: every tile is chosen and keeps its TOP_K largest
                low = tl.full([BLOCK_N], -(2**31), tl.int32)
            take = tl.minimum(tl.maximum(tl.sum((ordered >= low[:, None]).to(tl.int32), axis=1), 1), TOP_K)
            here = tl.arange(0, BLOCK_V)
            list_at = pair_keys_ptr + pair.to(tl.int64) * TOP_K
            for i in range(0, tl.max(tl.where(ok, take, 0), axis=0)):  # the largest key left, then the next, ...
                now = ok & (i < take)
                top = tl.max(ordered, axis=1)
                at_top = tl.min(tl.where(ordered == top[:, None], here[None, :], BLOCK_V), axis=1)  # (ties: lower id)
                tl.store(list_at + i, _ordered_keys(top, tile * BLOCK_V + at_top), mask=now)
                ordered = tl.where((here[None, :] == at_top[:, None]) & now[:, None], _TAKEN, ordered)
            m = _key_logit(tl.load(top_tiles_ptr + first))  # the row's largest logit
            rest = tl.sum(tl.where(ordered != _TAKEN, tl.exp2((z - m[:, None]) * LOG2E), 0.0), axis=1)
            tl.store(pair_rest_ptr + pair, rest, mask=ok)
            tl.store(pair_count_ptr + pair, take, mask=ok)


## NB: one build for every N. Triton builds a kernel again for an integer argument divisible by 16 (and for 1), and
# the other build laid the top-k's sums out otherwise across threads, fusing another multiply into an add: a row's
# tail came out one ulp apart in a call cut into chunks of 128 rows (exact ties at k = 2 on an H100).
@triton.jit(do_not_specialize=["N"])
def _triton_combine_splits_kernel(
    part_max_ptr, part_sum_ptr, part_wsum_ptr, label_logit_ptr, labels_ptr,
    log_probs_ptr, entropy_ptr, lse_ptr, N, num_splits, ignore_index,
    pair_keys_ptr, pair_rest_ptr, pair_count_ptr, tile_key_ptr, tile_max_ptr, tile_sum_ptr, tile_rest_ptr,
    top_tiles_ptr,
    num_tiles, k_tiles, top_log_probs_ptr, top_ids_ptr, tail_ptr, k, candidates_ptr, candidate_logit_ptr, C,
    COMPUTE_ENTROPY: tl.constexpr, TOP_K: tl.constexpr, CANDIDATES: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK: tl.constexpr, TILES: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < N
    m = tl.full([BLOCK], _PAD_LOGIT, dtype=tl.float32)
    for i in range(num_splits):
        m = tl.maximum(m, tl.load(part_max_ptr + i * N + rows, mask=ok, other=_PAD_LOGIT))
    s = tl.zeros([BLOCK], dtype=tl.float32)
    w = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(num_splits):
        m_i = tl.load(part_max_ptr + i * N + rows, mask=ok, other=_PAD_LOGIT)
        s_i = tl.load(part_sum_ptr + i * N + rows, mask=ok, other=0.0)
        a = tl.exp2((m_i - m) * LOG2E)
        s += a * s_i
        if COMPUTE_ENTROPY:
            w += a * (tl.load(part_wsum_ptr + i * N + rows, mask=ok, other=0.0) + (m_i - m) * s_i)
    s = tl.where(ok, s, 1.0)
    log_s = tl.log(s)
    lse = m + log_s
    labels = tl.load(labels_ptr + rows, mask=ok, other=ignore_index)
    ignored = labels == ignore_index
    z_label = tl.load(label_logit_ptr + rows, mask=ok & ~ignored, other=0.0)
    tl.store(log_probs_ptr + rows, tl.where(ignored, 0.0, z_label - lse), mask=ok)
    tl.store(lse_ptr + rows, lse, mask=ok)
    if COMPUTE_ENTROPY:
        tl.store(entropy_ptr + rows, tl.where(ignored, 0.0, log_s - w / s), mask=ok)
    if TOP_K > 0:  # the k largest of the chosen tiles' lists; all the rest into the tail
        ## NB: each chosen tile gives its largest logit: top_tiles, the first pass's keys, in descending order. A tile
        # the second pass computed again (count > 0) gives its other logits at or above the k-th tile maximum too
        # (entries 1 .. count - 1 of its list), each put in its place in the descending list in turn; what falls off
        # the list's end, and what the list holds past the k-th, is below the k-th largest. A row's insertions and
        # its sums do not depend on the other rows of the block (another row's longer list inserts nothing here).
        offs_k = tl.arange(0, TOP_K)
        lists = rows.to(tl.int64)[:, None] * k_tiles + offs_k[None, :]  # [BLOCK, TOP_K] pairs
        listed = ok[:, None] & (offs_k < k_tiles)[None, :]
        firsts = tl.load(top_tiles_ptr + lists, mask=listed, other=_NO_KEY)
        counts = tl.load(pair_count_ptr + lists, mask=listed, other=0)  # (0: not computed again, its largest alone)
        best = firsts
        tail = tl.zeros([BLOCK], dtype=tl.float32)
        if tl.max(counts) > 1:
            before = tl.broadcast_to(tl.maximum(offs_k - 1, 0)[None, :], [BLOCK, TOP_K])
            for j in range(k_tiles):
                at = rows.to(tl.int64) * k_tiles + j
                n_j = tl.load(pair_count_ptr + at, mask=ok, other=0)
                for i in range(1, tl.max(n_j)):
                    key = tl.load(pair_keys_ptr + at * TOP_K + i, mask=i < n_j, other=_NO_KEY)
                    out = tl.minimum(tl.min(best, axis=1), key)  # (the list's last, or the key itself)
                    tail += tl.exp2((_key_logit(out) - m) * LOG2E)  # (an empty entry adds 0)
                    moved = tl.gather(best, before, axis=1)  # (each entry's predecessor)
                    put = (offs_k[None, :] == 0) | (moved > key[:, None])
                    best = tl.where(best > key[:, None], best, tl.where(put, key[:, None], moved))
        ## NB: every term is a positive mass; the tail is never a difference (1 - top mass cancels when the top
        # tokens hold nearly all of it).
        kth_key = tl.load(top_tiles_ptr + rows.to(tl.int64) * k_tiles + k_tiles - 1, mask=ok, other=0)
        for t in range(0, num_tiles, TILES):  # the tiles not chosen, TILES at a time
            ts = t + tl.arange(0, TILES)
            at = rows.to(tl.int64)[:, None] + ts.to(tl.int64)[None, :] * N
            out = ok[:, None] & (ts < num_tiles)[None, :]
            out &= tl.load(tile_key_ptr + at, mask=out, other=0) < kth_key[:, None]
            m_t = tl.load(tile_max_ptr + at, mask=out, other=_PAD_LOGIT)
            mass = tl.exp2((m_t - m[:, None]) * LOG2E) * tl.load(tile_sum_ptr + at, mask=out, other=0.0)
            tail += tl.sum(mass, axis=1)
        # the chosen tiles' logits past their lists (the rest of a tile not computed again is the first pass's), and
        # the list's entries past the k-th
        alone = listed & (counts == 0)
        at_t = (0xFFFFFFFF - (firsts & 0xFFFFFFFF)) // BLOCK_V * N + rows[:, None]  # (the tile of a list's first key)
        rests = tl.exp2((tl.load(tile_max_ptr + at_t, mask=alone, other=_PAD_LOGIT) - m[:, None]) * LOG2E) \
            * tl.load(tile_rest_ptr + at_t, mask=alone, other=0.0)
        rests = tl.where(alone, rests, tl.load(pair_rest_ptr + lists, mask=listed & (counts > 0), other=0.0))
        past = tl.where(offs_k[None, :] >= k, tl.exp2((_key_logit(best) - m[:, None]) * LOG2E), 0.0)
        tail += tl.sum(rests + past, axis=1)
        top = ok[:, None] & (offs_k[None, :] < k)
        at = rows[:, None].to(tl.int64) * k + offs_k[None, :]
        kept = ~ignored[:, None]
        tl.store(top_log_probs_ptr + at, tl.where(kept, _key_logit(best) - lse[:, None], 0.0), mask=top)
        tl.store(top_ids_ptr + at, tl.where(kept, 0xFFFFFFFF - (best & 0xFFFFFFFF), -1), mask=top)
        tl.store(tail_ptr + rows, tl.where(ignored, 0.0, tl.log(tail) - log_s), mask=ok)
    if CANDIDATES:
        for c in range(C):
            ids = tl.load(candidates_ptr + rows.to(tl.int64) * C + c, mask=ok, other=-1)
            z_c = tl.load(candidate_logit_ptr + rows.to(tl.int64) * C + c, mask=ok, other=0.0)
            tl.store(candidate_logit_ptr + rows.to(tl.int64) * C + c,
                     tl.where(ignored | (ids < 0), 0.0, z_c - lse), mask=ok)


@triton.jit
def _schedule_kernel(counts_ptr, group_ptr, start_ptr, end_ptr, G, programs, BLOCK_M: tl.constexpr,
                     BINS: tl.constexpr, TILES: tl.constexpr):
    """TILES programs of a grouped launch: each program's group, first row and its group's end (see group_schedule)."""
    bins = tl.arange(0, BINS)
    counts = tl.load(counts_ptr + bins, mask=bins < G, other=0).to(tl.int64)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    last = tl.cumsum(tiles, 0)  # (the groups past G: no tiles)
    ends = tl.cumsum(counts, 0)
    program = tl.program_id(0) * TILES + tl.arange(0, TILES)
    group = tl.sum((last[None, :] <= program[:, None]).to(tl.int32), axis=1)  # (the groups wholly before it)
    mine = bins[None, :] == group[:, None]
    first_tile = tl.sum(tl.where(mine, (last - tiles)[None, :], 0), axis=1)
    end = tl.sum(tl.where(mine, ends[None, :], 0), axis=1)
    start = end - tl.sum(tl.where(mine, counts[None, :], 0), axis=1) + (program - first_tile) * BLOCK_M
    spare = group >= G
    inside = program < programs
    tl.store(group_ptr + program, tl.where(spare, -1, group).to(tl.int64), mask=inside)
    tl.store(start_ptr + program, tl.where(spare, 0, start), mask=inside)
    tl.store(end_ptr + program, tl.where(spare, 0, end), mask=inside)


def group_schedule(counts: Tensor, rows: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """For a grouped launch over `rows` rows sorted by group (counts[g] rows in group g, a device tensor), per
    program: its group (-1 for the spare programs of a grid sized for the worst case, so that no count is read back
    to the host), its first row and the end of its group's rows (spares: no rows). One kernel."""
    programs = triton.cdiv(rows, block_m) + len(counts)  # (at least sum(tiles))
    group, start, end = torch.empty(3, programs, dtype=torch.int64, device=counts.device)
    bins = triton.next_power_of_2(len(counts))
    tiles = max(1, min(128, 8192 // bins))
    _schedule_kernel[(triton.cdiv(programs, tiles),)](counts, group, start, end, len(counts), programs,
                                                      BLOCK_M=block_m, BINS=bins, TILES=tiles, enable_fp_fusion=True)
    return group, start, end


def group_schedule_reference(counts: Tensor, rows: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """group_schedule in torch: the statement of what each program takes."""
    tiles = (counts + block_m - 1) // block_m
    last = torch.cumsum(tiles, 0)
    program = torch.arange(triton.cdiv(rows, block_m) + len(counts), device=counts.device)
    group = torch.searchsorted(last, program, right=True)
    spare = group == len(counts)
    known = group.clamp(max=len(counts) - 1)
    ends = torch.cumsum(counts, 0)
    start = ends[known] - counts[known] + (program - last[known] + tiles[known]) * block_m
    return (group.masked_fill(spare, -1), start.masked_fill(spare, 0), ends[known].masked_fill(spare, 0))


def combine_rows(width: int) -> int:
    """The top-k combine's rows a program for top lists of `width` (a row's result does not depend on it)."""
    return max(1, min(16, 2048 // width))


def persistent_programs(device: torch.device) -> int:
    """Programs of a grid that walks a schedule in turn: two per SM (4 in the interpreter)."""
    if device.type != "cuda":
        return 4
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def top_width(k: int) -> int:
    """The width of the kernels' top lists for a top-k of k: a power of two, at least 2."""
    return max(2, triton.next_power_of_2(k))


def triton_log_probs_forward(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    inv_temp: Tensor,
    *,
    ignore_index: int,
    compute_entropy: bool,
    softcap: float | None = None,
    config: TileConfig | None = None,
    top_k: int = 0,
    candidates: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor, Extras]:
    """Returns (log_probs [N], entropy [N] or None, lse [N]), all fp32, ignored tokens giving 0, and the Extras
    asked for (see torch_log_probs.Extras): `top_k` > 0, `candidates` [N, C] (int64 ids; negative: none here).
    A tile holds at least a top list: for a top-k wider than the dtype's tiles, the tiles widen (the log-probs may
    then differ in the last bits from a call without it). A top-k call longer than its workspace allows runs in
    row chunks (a row's result does not depend on them)."""
    n, h = hidden.shape
    v = weight.shape[0]
    cfg = config or tile_config(hidden.dtype)
    width = top_width(top_k) if top_k else 0
    if width > cfg.block_v:
        cfg = replace(cfg, block_v=width)
    num_tiles = triton.cdiv(v, cfg.block_v)
    k_tiles = min(top_k, num_tiles)
    per_row = num_tiles * 24 + k_tiles * (8 * width + 24)  # (bytes of a row's tile statistics and chosen tiles)
    chunk = max(cfg.block_n, TOP_K_WORKSPACE // per_row // cfg.block_n * cfg.block_n)
    if top_k and n > chunk:
        parts = [triton_log_probs_forward(
            hidden[i:i + chunk], weight, labels[i:i + chunk], inv_temp[i:i + chunk], ignore_index=ignore_index,
            compute_entropy=compute_entropy, softcap=softcap, config=cfg, top_k=top_k,
            candidates=None if candidates is None else candidates[i:i + chunk]) for i in range(0, n, chunk)]
        log_probs, entropy, lse = (None if parts[0][j] is None else torch.cat([part[j] for part in parts])
                                   for j in range(3))
        extras = Extras({name: torch.cat([part[3][name] for part in parts]) for name in parts[0][3]})
        return log_probs, entropy, lse, extras

    tiles_per_split = triton.cdiv(num_tiles, cfg.num_splits)
    num_splits = triton.cdiv(num_tiles, tiles_per_split)  # no empty split
    f32 = dict(dtype=torch.float32, device=hidden.device)
    i64 = dict(dtype=torch.int64, device=hidden.device)
    part_max, part_sum = torch.empty(2, num_splits, n, **f32)
    part_wsum = torch.empty(num_splits, n, **f32) if compute_entropy else part_sum
    label_logit = torch.empty(n, **f32)
    extras = Extras()
    tile_key = tile_max = tile_sum = tile_rest = tile_second = label_logit  # (placeholders where not asked for)
    if top_k:
        tile_key = torch.empty(num_tiles, n, **i64)
        tile_max, tile_sum, tile_rest = torch.empty(3, num_tiles, n, **f32)
        tile_second = torch.empty(num_tiles, n, dtype=torch.int32, device=hidden.device)
        extras.top_log_probs = torch.empty(n, top_k, **f32)
        extras.top_ids = torch.empty(n, top_k, **i64)
        extras.tail_log_prob = torch.empty(n, **f32)
    num_candidates = 0
    if candidates is not None:
        candidates = candidates.to(torch.int64).contiguous()
        num_candidates = candidates.shape[1]
        extras.candidate_log_probs = torch.zeros(n, num_candidates, **f32)  # (a logit, then its log-prob)
    cand_ids = candidates if candidates is not None else labels
    cand_out = extras.candidate_log_probs if candidates is not None else label_logit
    grid = (triton.cdiv(n, cfg.block_n) * num_splits,)
    h_arg, w_arg, use_tma = tile_operands(hidden, weight, cfg)
    _triton_log_probs_forward_kernel[grid](
        h_arg, w_arg, labels, inv_temp, part_max, part_sum, part_wsum, label_logit,
        tile_key, tile_max, tile_sum, tile_rest, tile_second, cand_ids, cand_out, num_candidates,
        n, v, h, hidden.stride(0), weight.stride(0), tiles_per_split, num_splits, softcap or 1.0,
        SOFTCAP=softcap is not None, COMPUTE_ENTROPY=compute_entropy, EVEN_H=h % cfg.block_h == 0,
        DOT_PRECISION=dot_precision(hidden.dtype), USE_TMA=use_tma, TILE_STATS=top_k > 0,
        CANDIDATES=candidates is not None, GROUP_R=cfg.group_r,
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        enable_fp_fusion=True,
    )
    top_tiles = pair_keys = pair_rest = pair_count = label_logit
    if top_k:  # each row's k_tiles tiles of largest maxima; those that may hold more of its top k again, by tile
        top_tiles, chosen = torch.topk(tile_key.T, k_tiles, dim=1)  # (keys are unique: ties go to the lower id)
        top_tiles = top_tiles.contiguous()  # pair p: row p // k_tiles
        again = tile_second.T.gather(1, chosen) >= (top_tiles[:, -1:] >> 32)  # (a second largest >= the k-th)
        chosen = torch.where(again | (k_tiles < top_k), chosen, num_tiles).flatten()  # (num_tiles: not again)
        by_tile, order = torch.sort(chosen.to(torch.int32), stable=True)
        bounds = torch.arange(num_tiles + 1, dtype=torch.int32, device=hidden.device)
        counts = torch.searchsorted(by_tile, bounds).diff()  # (pairs a tile; those not again come last)
        tile, start, end = group_schedule(counts, n * k_tiles, cfg.block_n)
        pair_keys = torch.empty(n * k_tiles, width, **i64)  # (a list's entries past its count are never written)
        pair_rest = torch.empty(n * k_tiles, **f32)
        pair_count = torch.zeros(n * k_tiles, dtype=torch.int32, device=hidden.device)  # (0: not computed again)
        _triton_top_tiles_kernel[(min(tile.numel(), persistent_programs(hidden.device)),)](
            hidden, weight, inv_temp, order, tile, start, end, tile.numel(), top_tiles, pair_keys, pair_rest,
            pair_count, v, h, hidden.stride(0), weight.stride(0), k_tiles, softcap or 1.0,
            SOFTCAP=softcap is not None, EVEN_H=h % cfg.block_h == 0, DOT_PRECISION=dot_precision(hidden.dtype),
            TOP_K=width, EVERY=k_tiles < top_k, BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            enable_fp_fusion=True,
        )
    log_probs, lse = torch.empty(2, n, **f32)
    entropy = torch.empty(n, **f32) if compute_entropy else None
    block = combine_rows(width) if top_k else 128
    _triton_combine_splits_kernel[(triton.cdiv(n, block),)](
        part_max, part_sum, part_wsum, label_logit, labels, log_probs,
        entropy if entropy is not None else lse, lse, n, num_splits, ignore_index,
        pair_keys, pair_rest, pair_count, tile_key, tile_max, tile_sum, tile_rest, top_tiles, num_tiles, k_tiles,
        extras.top_log_probs if top_k else lse, extras.top_ids if top_k else labels,
        extras.tail_log_prob if top_k else lse, top_k, cand_ids, cand_out, num_candidates,
        COMPUTE_ENTROPY=compute_entropy, TOP_K=width,
        CANDIDATES=candidates is not None, BLOCK_V=cfg.block_v, BLOCK=block, TILES=16,
        enable_fp_fusion=True,
    )
    return log_probs, entropy, lse, extras

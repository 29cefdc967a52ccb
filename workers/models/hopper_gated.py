"""The gated MLP's first half, silu(x @ gate.T) * (x @ up.T), as one GEMM on Hopper's own instructions (Gluon) with
the middle in its epilogue: the two products are never written out and read back, which silu_mul.py's pass after
cuBLAS's two GEMMs does (3 bytes a middle element each way; ~30 ms of a 7B forward of 8 x 4096 tokens on an H100).
The same kernel runs a decoder layer's o and down projections with the residual added in the epilogue (`plus`), so
the layer's two adds are no passes of their own: its tile is then 128 rows x 256 columns of the one weight. And it
runs an attention block's q, k and v as one GEMM (`qkv`): tiles of two heads of [q; k; v] (each half read from the
weight it falls in), the biases added and q's and k's heads rotated in the epilogue, so neither the three GEMMs nor
rotary.py's pass run.

A tile is 128 rows of x by 128 columns of the middle: both products of those columns, so 128 x 256 of GEMM. The
program is persistent (one per SM, tiles in grouped order, each program every grid-th tile). One warp loads x's rows
(two boxes of 64) and the two weights' rows by TMA into a ring of STAGES buffers; two warpgroups take 64 rows each
(warp_specialize; 240 and 32 registers asked for), keep one step's products in flight, release a buffer once its
products are done, and store their 64 x 128 of the middle through shared memory by TMA. Both warpgroups reach a tile's
end together, so an epilogue run there leaves the tensor cores idle (4-12% of a kernel, measured): the projections
instead round a tile's products to the dtype (their first rounding), issue the next tile's first LEAD steps, and only
then add the residual and store the tile before, while those steps' products run (o 3.5-4.8% faster, down ~2%; the
middle, tried the same way, was 1.5-4.3% slower: BENCHMARKS.md).

Rounded as silu_mul.py and HF round: each product to the dtype, silu in fp32 rounded to the dtype, times up in fp32,
rounded; a projection rounded to the dtype, then added to the residual in fp32 and rounded; q, k, v as cuBLAS's bias
epilogue (product plus bias in fp32, one rounding), then rotated as rotary.py rotates. The sum over K runs in
one order for every row, with no split: a row's bits do not depend on the rows around it or how many there are (no
MIN_TOKENS filler needed). The bits differ from cuBLAS's products (another order of the sum), so the trainer's forward
with gradients runs this kernel too (`gated`, `projected`, `rotated_qkv`; their backward recomputes the two products,
or multiplies the gradient, with torch).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor
from torch.nn import functional as F
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .hopper_attention import _DTYPES, _tma_load, _tma_store, sm90_build, sm90_desc
from .rotary import rotary_gradients

ROWS, COLUMNS, DEPTH, STAGES, GROUP = 64, 128, 64, 4, 8  # a warpgroup's rows, a tile's middle columns, K a step
LEAD = gl.constexpr(2)  # a tile's steps issued before the tile before's epilogue runs (PLUS)


def _copyable(x: Tensor, *weights: Tensor) -> bool:
    """A Hopper GPU, bf16 or fp16, weights [N, K] of x's dtype, rows whose strides the copy engine can walk (K a
    multiple of 8, 16-byte aligned bases)."""
    k = x.shape[-1]
    return (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9 and x.dtype in _DTYPES
            and all(w.dtype == x.dtype and w.shape[1] == k and w.shape[0] % 8 == 0 for w in weights)
            and k % 8 == 0 and all(t.data_ptr() % 16 == 0 for t in (x, *weights)))


def usable(x: Tensor, gate: Tensor, up: Tensor) -> bool:
    """The kernel runs these here: weights of one shape, as `_copyable` says."""
    return gate.shape == up.shape and _copyable(x, gate, up)


@gluon.jit
def _tile(t, m_tiles, n_tiles, GROUP: gl.constexpr):
    """Tile t's row block and column block: GROUP row blocks walk the columns together (their weights stay in L2)."""
    per_group = GROUP * n_tiles
    first = t // per_group * GROUP
    rows = gl.minimum(m_tiles - first, GROUP)
    return first + t % per_group % rows, t % per_group // rows


@gluon.jit
def _load_weight(w0_desc, w1_desc, w2_desc, n0, n1, c, k, bar, dst):
    """Rows c.. of the weights' concatenation [w0; w1; w2] (w0 has n0 rows, w1 n1), step k, into dst by TMA."""
    if c < n0:
        _tma_load(w0_desc, [c, k], bar, dst)
    elif c < n0 + n1:
        _tma_load(w1_desc, [c - n0, k], bar, dst)
    else:
        _tma_load(w2_desc, [c - n0 - n1, k], bar, dst)


@gluon.jit
def _loads(x_desc, w0_desc, w1_desc, w2_desc, n0, n1, x_smem, g_smem, u_smem, ready, empty, n_step, n_second, m_tiles,
           n_tiles, k_steps, GROUP: gl.constexpr):
    """The loads (one warp): step i (counted over all the program's tiles) into buffer i % STAGES once both
    warpgroups released its last use; rows n * n_step and n * n_step + n_second of the weights' concatenation
    (gated: [gate; up], so both weights at the tile's columns; a projection: the one weight's two halves of its
    2 x COLUMNS columns; q/k/v: two heads of [q; k; v])."""
    STAGES: gl.constexpr = g_smem.shape[0]
    ROWS: gl.constexpr = x_desc.block_type.shape[0]
    DEPTH: gl.constexpr = x_desc.block_type.shape[1]
    nbytes: gl.constexpr = 2 * x_desc.block_type.nbytes + 2 * w0_desc.block_type.nbytes
    i = 0
    for t in range(gl.program_id(0), m_tiles * n_tiles, gl.num_programs(0)):
        m, n = _tile(t, m_tiles, n_tiles, GROUP)
        for k in range(k_steps):
            st = i % STAGES
            mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)  # (a fresh barrier's previous phase)
            mbarrier.expect(ready.index(st), nbytes)
            _tma_load(x_desc, [m * 2 * ROWS, k * DEPTH], ready.index(st), x_smem.index(2 * st))
            _tma_load(x_desc, [m * 2 * ROWS + ROWS, k * DEPTH], ready.index(st), x_smem.index(2 * st + 1))
            _load_weight(w0_desc, w1_desc, w2_desc, n0, n1, n * n_step, k * DEPTH, ready.index(st), g_smem.index(st))
            _load_weight(w0_desc, w1_desc, w2_desc, n0, n1, n * n_step + n_second, k * DEPTH, ready.index(st),
                         u_smem.index(st))
            i += 1


@gluon.jit
def _zero(x_smem, g_smem):
    """A warpgroup's accumulator of 64 rows x COLUMNS, zero, in wgmma's layout."""
    ROWS: gl.constexpr = x_smem.shape[1]
    COLUMNS: gl.constexpr = g_smem.shape[1]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[ROWS // 16, 1],
                                                  instr_shape=[16, COLUMNS, 16])
    return gl.zeros([ROWS, COLUMNS], gl.float32, mma)


@gluon.jit
def _tile_products(t, half, x_smem, g_smem, u_smem, ready, empty, i, m_tiles, n_tiles, k_steps, zero,
                   GROUP: gl.constexpr, FENCE: gl.constexpr = False):
    """Tile t's row and column blocks, and this warpgroup's 64 rows of it: both products over K from steps i ..
    i + k_steps - 1 of the ring, one step's products in flight while the next step's are issued; each buffer
    released once its products are done. FENCE: x's rows came by cp.async (another proxy than wgmma's), so each
    step fences them before its products."""
    m, n = _tile(t, m_tiles, n_tiles, GROUP)
    g, u = _lead_steps(half, x_smem, g_smem, u_smem, ready, i, zero, 1, FENCE)
    g, u = _rest_steps(g, u, half, x_smem, g_smem, u_smem, ready, empty, i, k_steps, 1, FENCE)
    return m, n, g, u


@gluon.jit
def _lead_steps(half, x_smem, g_smem, u_smem, ready, i, zero, STEPS: gl.constexpr, FENCE: gl.constexpr = False):
    """A tile's first STEPS steps (from step i of the ring) issued, none waited for: with STEPS = LEAD, the tensor
    cores' work while the tile before's epilogue runs (`_rest_steps` goes on)."""
    STAGES: gl.constexpr = g_smem.shape[0]
    g = zero
    u = zero
    for k in gl.static_range(STEPS):
        st = (i + k) % STAGES
        mbarrier.wait(ready.index(st), ((i + k) // STAGES) & 1)
        if FENCE:
            fence_async_shared()
        a = x_smem.index(2 * st + half)
        g = warpgroup_mma(a, g_smem.index(st).permute((1, 0)), g, use_acc=k > 0, is_async=True)
        u = warpgroup_mma(a, u_smem.index(st).permute((1, 0)), u, use_acc=k > 0, is_async=True)
    return g, u


@gluon.jit
def _rest_steps(g, u, half, x_smem, g_smem, u_smem, ready, empty, i, k_steps, STEPS: gl.constexpr,
                FENCE: gl.constexpr = False):
    """The tile's steps after its first STEPS (`_lead_steps`), one step's products in flight while the next step's
    are issued; each buffer released once its products are done. Returns both products, done."""
    STAGES: gl.constexpr = g_smem.shape[0]
    g, u = warpgroup_mma_wait(2, deps=(g, u))  # (all but the last step issued are done)
    for k in gl.static_range(STEPS - 1):
        mbarrier.arrive(empty.index((i + k) % STAGES))
    for k in range(STEPS, k_steps):
        st = (i + k) % STAGES
        mbarrier.wait(ready.index(st), ((i + k) // STAGES) & 1)
        if FENCE:
            fence_async_shared()
        a = x_smem.index(2 * st + half)
        g = warpgroup_mma(a, g_smem.index(st).permute((1, 0)), g, is_async=True)
        u = warpgroup_mma(a, u_smem.index(st).permute((1, 0)), u, is_async=True)
        g, u = warpgroup_mma_wait(2, deps=(g, u))  # (the step before is done: its buffer goes back)
        mbarrier.arrive(empty.index((i + k - 1) % STAGES))
    g, u = warpgroup_mma_wait(0, deps=(g, u))
    mbarrier.arrive(empty.index((i + k_steps - 1) % STAGES))
    return g, u


@gluon.jit
def _gated_products(half, x_smem, g_smem, u_smem, ready, empty, out_smem, out_desc, m_tiles, n_tiles, k_steps,
                    GROUP: gl.constexpr):
    """One warpgroup's 64 rows of each tile: the middle of its columns, stored by TMA. (Run under the next tile's
    first steps, as the projections' epilogue is, it measured 1.5-4.3% slower: BENCHMARKS.md, 2026-12-06.)"""
    ROWS: gl.constexpr = x_smem.shape[1]
    COLUMNS: gl.constexpr = g_smem.shape[1]
    dtype: gl.constexpr = out_desc.dtype
    zero = _zero(x_smem, g_smem)
    i = 0
    for t in range(gl.program_id(0), m_tiles * n_tiles, gl.num_programs(0)):
        m, n, g, u = _tile_products(t, half, x_smem, g_smem, u_smem, ready, empty, i, m_tiles, n_tiles, k_steps,
                                    zero, GROUP)
        i += k_steps
        _store(_middle(g, u, dtype), out_smem, out_desc, m * 2 * ROWS + half * ROWS, n * COLUMNS)
    tma.store_wait(0)


@gluon.jit
def _middle(g, u, dtype: gl.constexpr):
    """silu(gate) * up from the two products (fp32), rounded as silu_mul.py rounds: each product to the dtype, silu
    in fp32 rounded to the dtype, times up in fp32 (the store rounds the result). (exp by `ex2.approx.ftz`, 3
    instructions an element fewer and the same bits, measured 0.6-1.7% slower: stop 68, H100.)"""
    gate = g.to(dtype).to(gl.float32)
    return (gate / (1.0 + gl.exp(-gate))).to(dtype).to(gl.float32) * u.to(dtype).to(gl.float32)


@gluon.jit
def _plus_products(half, x_smem, g_smem, u_smem, ready, empty, out_smem, out_desc, res_desc, res_bar, m_tiles,
                   n_tiles, k_steps, GROUP: gl.constexpr):
    """One warpgroup's 64 rows of each tile: its 2 x COLUMNS columns of the product plus the residual's, stored by
    TMA one half after the other (`_plus_store`). A tile's products are rounded to the dtype and kept, and its
    epilogue runs once the next tile's first LEAD steps are issued, while their products run; the residual's first
    half comes by TMA into the output buffer during the tile's own products."""
    dtype: gl.constexpr = out_desc.dtype
    zero = _zero(x_smem, g_smem)
    first, second = zero.to(dtype), zero.to(dtype)
    tiles = m_tiles * n_tiles
    _residual(res_desc, gl.program_id(0), half, 0, res_bar, out_smem, m_tiles, n_tiles, GROUP)
    i = 0
    for t in range(gl.program_id(0), tiles, gl.num_programs(0)):
        g, u = _lead_steps(half, x_smem, g_smem, u_smem, ready, i, zero, LEAD)
        if t != gl.program_id(0):
            _plus_store(first, second, t - gl.num_programs(0), t, half, res_desc, res_bar, out_smem, out_desc,
                        m_tiles, n_tiles, GROUP)
        g, u = _rest_steps(g, u, half, x_smem, g_smem, u_smem, ready, empty, i, k_steps, LEAD)
        i += k_steps
        first, second = g.to(dtype), u.to(dtype)
    last = gl.program_id(0) + (tiles - 1 - gl.program_id(0)) // gl.num_programs(0) * gl.num_programs(0)
    _plus_store(first, second, last, tiles, half, res_desc, res_bar, out_smem, out_desc, m_tiles, n_tiles, GROUP)
    tma.store_wait(0)


@gluon.jit
def _residual(res_desc, t, half, part, bar, out_smem, m_tiles, n_tiles, GROUP: gl.constexpr):
    """This warpgroup's rows of projection tile t's residual, its first (part 0) or second COLUMNS columns, into
    out_smem by TMA (bar counts the bytes; rows and columns past the end come as zeros)."""
    ROWS: gl.constexpr = out_smem.shape[0]
    COLUMNS: gl.constexpr = out_smem.shape[1]
    m, n = _tile(t, m_tiles, n_tiles, GROUP)
    mbarrier.expect(bar, res_desc.block_type.nbytes)
    _tma_load(res_desc, [m * 2 * ROWS + half * ROWS, (2 * n + part) * COLUMNS], bar, out_smem)


@gluon.jit
def _plus_store(first, second, t, next_t, half, res_desc, bar, out_smem, out_desc, m_tiles, n_tiles,
                GROUP: gl.constexpr):
    """This warpgroup's two halves of projection tile t (its products rounded to the dtype) plus the residual's in
    fp32, each half added in place of its residual in out_smem and stored by TMA; then tile next_t's first half of
    the residual asked for (if there is one). The residual's halves complete bar's phases 0 and 1."""
    ROWS: gl.constexpr = out_smem.shape[0]
    COLUMNS: gl.constexpr = out_smem.shape[1]
    m, n = _tile(t, m_tiles, n_tiles, GROUP)
    r0 = m * 2 * ROWS + half * ROWS
    layout: gl.constexpr = first.type.layout
    mbarrier.wait(bar, 0)
    y = first.to(gl.float32) + out_smem.load(layout).to(gl.float32)  # (a thread writes back what it read)
    out_smem.store(y.to(out_desc.dtype))
    fence_async_shared()
    _tma_store(out_desc, [r0, 2 * n * COLUMNS], out_smem)
    tma.store_wait(0)
    _residual(res_desc, t, half, 1, bar, out_smem, m_tiles, n_tiles, GROUP)
    mbarrier.wait(bar, 1)
    y = second.to(gl.float32) + out_smem.load(layout).to(gl.float32)
    out_smem.store(y.to(out_desc.dtype))
    fence_async_shared()
    _tma_store(out_desc, [r0, (2 * n + 1) * COLUMNS], out_smem)
    if next_t < m_tiles * n_tiles:
        tma.store_wait(0)
        _residual(res_desc, next_t, half, 0, bar, out_smem, m_tiles, n_tiles, GROUP)


@gluon.jit
def _block(ptr, stride, n_rows, n_cols, r0, c0, like):
    """Rows r0.. and columns c0.. of a [n_rows, n_cols] tensor of row stride `stride`, as stored, in the shape and
    layout of `like` (zeros past its end)."""
    layout: gl.constexpr = like.type.layout
    rows = r0 + gl.arange(0, like.shape[0], layout=gl.SliceLayout(1, layout))
    cols = c0 + gl.arange(0, like.shape[1], layout=gl.SliceLayout(0, layout))
    inside = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return gl.load(ptr + rows.to(gl.int64)[:, None] * stride + cols[None, :], mask=inside, other=0.0)


@gluon.jit
def _store(y, out_smem, out_desc, r0, c0):
    """y (fp32) rounded to the output's dtype at rows r0.. and columns c0.., by TMA."""
    tma.store_wait(0)  # (the last store has left the buffer)
    out_smem.store(y.to(out_desc.dtype))
    fence_async_shared()
    _tma_store(out_desc, [r0, c0], out_smem)


@gluon.jit
def _qkv_products(half, x_smem, g_smem, u_smem, ready, empty, out_smem, q_desc, k_desc, v_desc, bq_ptr, bk_ptr,
                  bv_ptr, biased, qn_ptr, kn_ptr, eps, cos_ptr, sin_ptr, stride_cs, n_rows, n_q, n_k, n_cols,
                  m_tiles, n_tiles, k_steps, GROUP: gl.constexpr):
    _qkv_tiles(half, x_smem, g_smem, u_smem, ready, empty, out_smem, q_desc, k_desc, v_desc, bq_ptr, bk_ptr, bv_ptr,
               biased, qn_ptr, kn_ptr, eps, cos_ptr, sin_ptr, stride_cs, n_rows, n_q, n_k, n_cols, m_tiles, n_tiles,
               k_steps, GROUP, False)


@gluon.jit
def _qkv_normed_products(half, x_smem, g_smem, u_smem, ready, empty, out_smem, q_desc, k_desc, v_desc, bq_ptr, bk_ptr,
                         bv_ptr, biased, qn_ptr, kn_ptr, eps, cos_ptr, sin_ptr, stride_cs, n_rows, n_q, n_k, n_cols,
                         m_tiles, n_tiles, k_steps, GROUP: gl.constexpr):
    _qkv_tiles(half, x_smem, g_smem, u_smem, ready, empty, out_smem, q_desc, k_desc, v_desc, bq_ptr, bk_ptr, bv_ptr,
               biased, qn_ptr, kn_ptr, eps, cos_ptr, sin_ptr, stride_cs, n_rows, n_q, n_k, n_cols, m_tiles, n_tiles,
               k_steps, GROUP, True)


@gluon.jit
def _qkv_tiles(half, x_smem, g_smem, u_smem, ready, empty, out_smem, q_desc, k_desc, v_desc, bq_ptr, bk_ptr, bv_ptr,
               biased, qn_ptr, kn_ptr, eps, cos_ptr, sin_ptr, stride_cs, n_rows, n_q, n_k, n_cols, m_tiles, n_tiles,
               k_steps, GROUP: gl.constexpr, NORMED: gl.constexpr):
    """One warpgroup's 64 rows of each tile: its two heads of [q; k; v], each stored by TMA (`_head_store`). The
    rows' cos and sin and the first head's bias are read before the products, so their wait is hidden behind them (a
    tile of v's heads reads no cos and sin; the second bias read ahead too spills)."""
    ROWS: gl.constexpr = x_smem.shape[1]
    COLUMNS: gl.constexpr = g_smem.shape[1]
    zero = _zero(x_smem, g_smem)
    i = 0
    for t in range(gl.program_id(0), m_tiles * n_tiles, gl.num_programs(0)):
        m, n = _tile(t, m_tiles, n_tiles, GROUP)
        r0 = m * 2 * ROWS + half * ROWS
        c0 = 2 * n * COLUMNS
        inputs = (cos_ptr, sin_ptr, stride_cs, n_rows, bq_ptr, bk_ptr, bv_ptr, biased, n_q, n_k, n_cols, r0, c0, zero)
        if not NORMED:  # (cos, sin and the bias read ahead; beside the norm's registers they would spill)
            cos, sin, bias = _head_inputs(*inputs)
        m, n, g, u = _tile_products(t, half, x_smem, g_smem, u_smem, ready, empty, i, m_tiles, n_tiles, k_steps,
                                    zero, GROUP)
        i += k_steps
        if NORMED:
            cos, sin, bias = _head_inputs(*inputs)
        _head_store(g, bias, qn_ptr, kn_ptr, eps, NORMED, cos, sin, out_smem, q_desc, k_desc, v_desc, n_q, n_k, r0,
                    c0)
        bias = _bias(bq_ptr, bk_ptr, bv_ptr, biased, n_q, n_k, n_cols, c0 + COLUMNS, zero)
        _head_store(u, bias, qn_ptr, kn_ptr, eps, NORMED, cos, sin, out_smem, q_desc, k_desc, v_desc, n_q, n_k, r0,
                    c0 + COLUMNS)
    tma.store_wait(0)


@gluon.jit
def _head_inputs(cos_ptr, sin_ptr, stride_cs, n_rows, bq_ptr, bk_ptr, bv_ptr, biased, n_q, n_k, n_cols, r0, c0, like):
    """Rows r0..'s cos and sin (zeros for a tile of v's heads, which is not rotated) and the bias of the head at
    column c0 of [q; k; v], in like's layout."""
    COLUMNS: gl.constexpr = like.shape[1]
    rotated_rows = gl.where(c0 < n_q + n_k, n_rows, 0)
    cos = _block(cos_ptr, stride_cs, rotated_rows, COLUMNS, r0, 0, like)
    sin = _block(sin_ptr, stride_cs, rotated_rows, COLUMNS, r0, 0, like)
    return cos, sin, _bias(bq_ptr, bk_ptr, bv_ptr, biased, n_q, n_k, n_cols, c0, like)


@gluon.jit
def _bias(bq_ptr, bk_ptr, bv_ptr, biased, n_q, n_k, n_cols, c, like):
    """The bias of the head at column c of [q; k; v] (zeros if not `biased`), as stored, [1, D] in like's layout."""
    cols = gl.arange(0, like.shape[1], layout=gl.SliceLayout(0, like.type.layout))
    if c < n_q:
        bias = bq_ptr + c
    elif c < n_q + n_k:
        bias = bk_ptr + (c - n_q)
    else:
        bias = bv_ptr + (c - n_q - n_k)
    return gl.load(bias + cols, mask=biased & (c + cols < n_cols), other=0.0)[None, :]


@gluon.jit
def _head_store(acc, bias, qn_ptr, kn_ptr, eps, NORMED: gl.constexpr, cos, sin, out_smem, q_desc, k_desc, v_desc, n_q,
                n_k, r0, c):
    """Rows r0.. of the head at column c of [q; k; v]: the product plus its bias, rounded to the dtype (cuBLAS's
    bias epilogue: one rounding; no bias adds zeros), then a q or k head RMS-normalised if NORMED
    (`_normed`) and rotated (`_rotated`); stored by TMA into q, k or v."""
    dtype: gl.constexpr = q_desc.dtype
    y = (acc + bias.to(gl.float32)).to(dtype).to(gl.float32)
    if c < n_q + n_k:
        if NORMED:
            if c < n_q:
                y = _normed(y, qn_ptr, eps, dtype)
            else:
                y = _normed(y, kn_ptr, eps, dtype)
        y = _rotated(y, cos, sin, dtype)
    tma.store_wait(0)  # (the last store has left the buffer)
    out_smem.store(y.to(dtype))
    fence_async_shared()
    if c < n_q:
        _tma_store(q_desc, [r0, c], out_smem)
    elif c < n_q + n_k:
        _tma_store(k_desc, [r0, c - n_q], out_smem)
    else:
        _tma_store(v_desc, [r0, c - n_q - n_k], out_smem)


@gluon.jit
def _normed(x, w_ptr, eps, dtype: gl.constexpr):
    """A head x [R, D] (values of the dtype, in fp32) through HF's RMSNorm with weight [D] at w_ptr (Qwen3's q_norm
    and k_norm): x * rsqrt(mean(x^2) + eps) rounded to the dtype, times the weight, rounded."""
    cols = gl.arange(0, x.shape[1], layout=gl.SliceLayout(0, x.type.layout))
    r = gl.rsqrt(gl.sum(x * x, axis=1) / x.shape[1] + eps)
    w = gl.load(w_ptr + cols).to(gl.float32)[None, :]
    return ((x * r[:, None]).to(dtype).to(gl.float32) * w).to(dtype).to(gl.float32)


@gluon.jit
def _halves(x):
    """x [R, D] -> its two halves along D, [R, D / 2] each (registers only: in wgmma's layout a thread holds column
    j and j + D / 2 alike)."""
    return gl.split(gl.permute(gl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), (0, 2, 1)))


@gluon.jit
def _rotated(x, cos, sin, dtype: gl.constexpr):
    """A head x [R, D] (rows: tokens; values of the dtype, in fp32) and its rows' cos and sin [R, D]: HF's x * cos +
    rotate_half(x) * sin with each product and the sum rounded to the dtype, as rotary.py computes it (the launch
    fuses no product into a sum)."""
    x1, x2 = _halves(x)
    c1, c2 = _halves(cos.to(gl.float32))
    s1, s2 = _halves(sin.to(gl.float32))
    o1 = ((x1 * c1).to(dtype).to(gl.float32) + (-x2 * s1).to(dtype).to(gl.float32)).to(dtype).to(gl.float32)
    o2 = ((x2 * c2).to(dtype).to(gl.float32) + (x1 * s2).to(dtype).to(gl.float32)).to(dtype).to(gl.float32)
    y = gl.reshape(gl.permute(gl.join(o1, o2), (0, 2, 1)), [x.shape[0], x.shape[1]])
    return gl.convert_layout(y, x.type.layout)


GATED, PLUS, QKV = 0, 1, 2  # what the kernel's epilogue makes (MODE)
# Products fused into sums, per mode: Triton 3.6's default as measured, but not where rotary's roundings must stay
# (LLVM would make x * cos + r one bf16 FMA, skipping the product's rounding)
_FUSION = {GATED: True, PLUS: True, QKV: False}


@gluon.jit
def _ring(x_desc, w_desc, out_desc, STAGES: gl.constexpr, READY: gl.constexpr):
    """A program's shared memory: the ring of STAGES steps (x's two boxes of 64 rows, two blocks of weight rows),
    each warpgroup's output buffer, and the ring's barriers (ready: READY arrivals and the TMA's bytes; empty: both
    warpgroups)."""
    ROWS: gl.constexpr = x_desc.block_type.shape[0]
    DEPTH: gl.constexpr = x_desc.block_type.shape[1]
    COLUMNS: gl.constexpr = w_desc.block_type.shape[0]
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES, ROWS, DEPTH], x_desc.layout)
    g_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, COLUMNS, DEPTH], w_desc.layout)
    u_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, COLUMNS, DEPTH], w_desc.layout)
    out_smem = gl.allocate_shared_memory(out_desc.dtype, [2, ROWS, COLUMNS], out_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=READY)
        mbarrier.init(empty.index(s), count=2)
    return x_smem, g_smem, u_smem, out_smem, ready, empty


@gluon.jit
def _body_gemm_kernel(x_desc, w0_desc, w1_desc, w2_desc, o0_desc, o1_desc, o2_desc, p0, p1, p2, biased,
                      qn_ptr, kn_ptr, eps, cos_ptr, sin_ptr, stride_cs, n_rows, n0, n1, n_cols, m_tiles,
                      n_tiles, k_steps, STAGES: gl.constexpr, GROUP: gl.constexpr, MODE: gl.constexpr,
                      NORMED: gl.constexpr, num_warps: gl.constexpr):
    """GATED: o0 = the middle of x, w0 (gate) and w1 (up). PLUS: o0 = o1 (the residual, read by TMA) + x @
    w0.T. QKV: o0, o1, o2 = q, k, v of x and w0, w1, w2 (plus the biases p0, p1, p2 if biased), q's and k's heads
    RMS-normalised by the weights at qn_ptr and kn_ptr if normed, then rotated by cos and sin (row stride
    stride_cs). n0, n1: the rows of w0 and w1 (`_load_weight`); n_cols: the output's columns (QKV: all three's)."""
    COLUMNS: gl.constexpr = w0_desc.block_type.shape[0]
    x_smem, g_smem, u_smem, out_smem, ready, empty = _ring(x_desc, w0_desc, o0_desc, STAGES, 1)
    common = (x_smem, g_smem, u_smem, ready, empty)
    sizes = (m_tiles, n_tiles, k_steps, GROUP)
    weights = (x_desc, w0_desc, w1_desc, w2_desc, n0, n1) + common
    # (constexprs reach a partition as values: each kind has partitions of its own)
    if MODE == 0:
        gl.warp_specialize([
            (_gated_products, (0,) + common + (out_smem.index(0), o0_desc) + sizes),
            (_gated_products, (1,) + common + (out_smem.index(1), o0_desc) + sizes),
            (_loads, weights + (gl.to_tensor(COLUMNS), n0) + sizes),
        ], [4, 1], [240, 32])
    elif MODE == 1:
        residual = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # (a warpgroup's each)
        for h in gl.static_range(2):
            mbarrier.init(residual.index(h), count=1)
        gl.warp_specialize([
            (_plus_products, (0,) + common + (out_smem.index(0), o0_desc, o1_desc, residual.index(0)) + sizes),
            (_plus_products, (1,) + common + (out_smem.index(1), o0_desc, o1_desc, residual.index(1)) + sizes),
            (_loads, weights + (gl.to_tensor(2 * COLUMNS), gl.to_tensor(COLUMNS)) + sizes),
        ], [4, 1], [240, 32])
    else:
        epilogue = (o0_desc, o1_desc, o2_desc, p0, p1, p2, biased, qn_ptr, kn_ptr, eps, cos_ptr, sin_ptr,
                    stride_cs, n_rows, n0, n1, n_cols)
        if NORMED:
            gl.warp_specialize([
                (_qkv_normed_products, (0,) + common + (out_smem.index(0),) + epilogue + sizes),
                (_qkv_normed_products, (1,) + common + (out_smem.index(1),) + epilogue + sizes),
                (_loads, weights + (gl.to_tensor(2 * COLUMNS), gl.to_tensor(COLUMNS)) + sizes),
            ], [4, 1], [240, 32])
        else:
            gl.warp_specialize([
                (_qkv_products, (0,) + common + (out_smem.index(0),) + epilogue + sizes),
                (_qkv_products, (1,) + common + (out_smem.index(1),) + epilogue + sizes),
                (_loads, weights + (gl.to_tensor(2 * COLUMNS), gl.to_tensor(COLUMNS)) + sizes),
            ], [4, 1], [240, 32])


def _descriptor(x: Tensor, block: list[int]) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(x, block, gl.NVMMASharedLayout.get_default_for(block, _DTYPES[x.dtype]))


def _launch(x: Tensor, mode: int, weights: tuple[Tensor, ...], outs: tuple[Tensor, ...], n_cols: int,
            vectors: tuple[Tensor, ...] = (), rope: tuple[Tensor, Tensor] | None = None,
            norms: QKNorm | None = None, stages: int = STAGES, group: int = GROUP) -> None:
    """One launch over x's rows into `outs` (see _body_gemm_kernel): GATED, weights (gate, up); PLUS, (weight,)
    with vectors (residual,); QKV, (q, k, v) with vectors () or their biases, rope (cos, sin) and the heads' norms
    or None."""
    if x.shape[0] == 0:
        return
    step = COLUMNS if mode == GATED else 2 * COLUMNS
    m_tiles, n_tiles = triton.cdiv(x.shape[0], 2 * ROWS), triton.cdiv(n_cols, step)
    programs = min(m_tiles * n_tiles, torch.cuda.get_device_properties(x.device).multi_processor_count)
    k_steps = max(triton.cdiv(x.shape[1], DEPTH), LEAD.value if mode == PLUS else 1)  # (steps past K: zeros, by TMA)
    n0, n1 = (n_cols, n_cols) if mode == GATED else (2**30, 0) if mode == PLUS else (len(weights[0]), len(weights[1]))
    w = [_descriptor(t, [COLUMNS, DEPTH]) for t in weights]
    o = [_descriptor(t, [ROWS, COLUMNS]) for t in outs + (vectors if mode == PLUS else ())]  # (PLUS: o1 reads)
    p = (vectors if mode == QKV else ()) or (outs[0],)  # (QKV's biases; unread where not QKV)
    cos, sin = rope or (outs[0], outs[0])  # (unread where not QKV)
    q_norm, k_norm, eps = norms or (outs[0], outs[0], 0.0)
    _body_gemm_kernel[(programs,)](
        _descriptor(x, [ROWS, DEPTH]), *(w + w[-1:] * 2)[:3], *(o + o[-1:] * 2)[:3], *(p + p[-1:] * 2)[:3],
        len(vectors) > 0, q_norm, k_norm, eps, cos, sin, cos.stride(0), x.shape[0],
        n0, n1, n_cols, m_tiles, n_tiles, k_steps, STAGES=stages, GROUP=group, MODE=mode, NORMED=norms is not None,
        num_warps=4, enable_fp_fusion=_FUSION[mode])


def middle(x: Tensor, gate: Tensor, up: Tensor, stages: int = STAGES, group: int = GROUP) -> Tensor:
    """silu(x @ gate.T) * (x @ up.T) for x [M, K] and weights [N, K], as `usable` says: one launch, no autograd.
    (`stages`, `group`: the ring's buffers and the row blocks that walk the columns together; benchmarks sweep them.)"""
    x = x.contiguous()
    out = torch.empty(x.shape[0], gate.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, GATED, (gate.contiguous(), up.contiguous()), (out,), gate.shape[0], stages=stages, group=group)
    return out


def plus(x: Tensor, weight: Tensor, residual: Tensor) -> Tensor:
    """residual + x @ weight.T for x [M, K], weight [N, K] and residual [M, N] of x's dtype (the product rounded to
    the dtype first, as HF's `residual + proj(x)` rounds), as `usable(x, weight, weight)` says: one launch, no
    autograd."""
    x, weight, residual = x.contiguous(), weight.contiguous(), residual.contiguous()
    if residual.data_ptr() % 16:  # (the kernel reads it by TMA)
        residual = residual.clone()
    out = torch.empty_like(residual)
    _launch(x, PLUS, (weight,), (out,), weight.shape[0], (residual,))
    return out


QKNorm = tuple[Tensor, Tensor, float]  # q's and k's heads' RMSNorm (HF's formula): q_norm's and k_norm's weights, eps


def qkv_usable(x: Tensor, weights: tuple[Tensor, ...], biases: tuple[Tensor, ...] | None, cos: Tensor,
               sin: Tensor, norms: QKNorm | None = None) -> bool:
    """`qkv` runs these here: as `usable`, for weights of whole heads of COLUMNS elements, biases of their rows or
    none, cos and sin [M, COLUMNS] of x's dtype, head norms' weights [COLUMNS] of x's dtype or none."""
    return (len(weights) == 3 and all(w.dim() == 2 and w.shape[0] % COLUMNS == 0 for w in weights)
            and _copyable(x, *weights) and cos.shape == sin.shape == (x.shape[0], COLUMNS)
            and cos.dtype == sin.dtype == x.dtype and cos.stride() == sin.stride() and cos.stride(1) == 1
            and (biases is None or all(b is not None and b.shape == w.shape[:1] and b.dtype == x.dtype
                                       for b, w in zip(biases, weights, strict=True)))
            and (norms is None or all(w.shape == (COLUMNS,) and w.dtype == x.dtype for w in norms[:2])))


def qkv(x: Tensor, weights: tuple[Tensor, Tensor, Tensor], biases: tuple[Tensor, Tensor, Tensor] | None, cos: Tensor,
        sin: Tensor, norms: QKNorm | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """An attention block's inputs for x [M, K] in one launch, no autograd: q, k, v = x @ w.T (+ b), rounded to the
    dtype as F.linear rounds, each head of q and k RMS-normalised (with `norms`) and rotated by cos and sin
    [M, COLUMNS] as rotary.py normalises and rotates it; [M, N] each, as `qkv_usable` says."""
    x, weights = x.contiguous(), tuple(w.contiguous() for w in weights)
    outs = tuple(torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device) for w in weights)
    vectors = () if biases is None else tuple(b.contiguous() for b in biases)
    norms = None if norms is None else (norms[0].contiguous(), norms[1].contiguous(), float(norms[2]))
    _launch(x, QKV, weights, outs, sum(w.shape[0] for w in weights), vectors,
            (cos, sin), norms)
    return outs


class _Gated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(x, gate, up)
        return middle(x, gate, up)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, gate, up = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) for t, need in zip((x, gate, up), ctx.needs_input_grad,
                                                                          strict=True)]
            out = F.silu(F.linear(leaves[0], leaves[1])) * F.linear(leaves[0], leaves[2])
            grads = iter(torch.autograd.grad(out, [t for t in leaves if t.requires_grad], grad))
            return tuple(next(grads) if t.requires_grad else None for t in leaves)


class _Plus(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, residual: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return plus(x, weight, residual)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        return (grad @ weight if ctx.needs_input_grad[0] else None,
                grad.T @ x if ctx.needs_input_grad[1] else None, grad)


def projected(x: Tensor, weight: Tensor, residual: Tensor) -> Tensor:
    """residual + x @ weight.T over x's last dimension (`plus`). Differentiable."""
    rows = x.reshape(-1, x.shape[-1])
    res = residual.reshape(-1, residual.shape[-1])
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, weight, residual)):
        return _Plus.apply(rows, weight, res).view(residual.shape)
    return plus(rows, weight, res).view(residual.shape)


def gated(x: Tensor, gate: Tensor, up: Tensor) -> Tensor:
    """silu(x @ gate.T) * (x @ up.T) over x's last dimension, as `usable` says. Differentiable."""
    rows = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, gate, up)):
        return _Gated.apply(rows, gate, up).view(*x.shape[:-1], gate.shape[0])
    return middle(rows, gate, up).view(*x.shape[:-1], gate.shape[0])


class _QKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, eps: float, *tensors: Tensor | None):
        weights, biases, norms = tensors[:3], tensors[3:6], tensors[6:]
        ctx.save_for_backward(x, cos, sin, *tensors)
        ctx.eps = eps
        return qkv(x, weights, None if biases[0] is None else biases, cos, sin,
                   None if norms[0] is None else (*norms, eps))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        x, cos, sin, *tensors = ctx.saved_tensors
        weights, biases, norms = tensors[:3], tensors[3:6], tensors[6:]
        grads, norm_grads = list(grads), [None, None]
        for i in range(2):  # (q's and k's gradients before their rotation, and norm, recomputed with torch)
            g = grads[i].reshape(len(x), -1, COLUMNS)
            if norms[i] is None:
                grads[i] = rotary_gradients(g, cos, sin)[0].view_as(grads[i])
            else:
                pre = F.linear(x, weights[i], biases[i]).view_as(g)
                dx, norm_grads[i] = rotary_gradients(g, cos, sin, pre, (norms[i], ctx.eps, "llama"))
                grads[i] = dx.reshape(len(x), -1)
        need = ctx.needs_input_grad
        dx = sum(g @ w for g, w in zip(grads, weights, strict=True)) if need[0] else None
        dw = [g.T @ x if need[4 + i] else None for i, g in enumerate(grads)]
        db = [g.sum(0) if need[7 + i] else None for i, g in enumerate(grads)]
        return dx, None, None, None, *dw, *db, *(d if need[10 + i] else None for i, d in enumerate(norm_grads))


def rotated_qkv(x: Tensor, weights: tuple[Tensor, Tensor, Tensor], biases: tuple[Tensor, Tensor, Tensor] | None,
                cos: Tensor, sin: Tensor, norms: QKNorm | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """`qkv` for x [M, K] (one row of tokens to each of cos and sin's rows). Differentiable in x, the weights, the
    biases and the norms' weights."""
    tensors = (*weights, *(biases or (None,) * 3), *(norms[:2] if norms else (None, None)))
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *tensors)):
        return _QKV.apply(x, cos, sin, norms[2] if norms else 0.0, *tensors)
    return qkv(x, weights, biases, cos, sin, norms)


def compile_sm90(mode: int = GATED, normed: bool = False, divisible: tuple[str, ...] = (), ones: tuple[str, ...] = ()):
    """The kernel for bf16 built for sm_90a by sm90_build, in one of its modes (GATED, PLUS, QKV)."""
    types = {n: sm90_desc([ROWS, DEPTH]) if n == "x_desc" else sm90_desc([COLUMNS, DEPTH]) if n[0] == "w"
             else sm90_desc([ROWS, COLUMNS]) if n[0] == "o"
             else "*bf16" if n in ("p0", "p1", "p2", "qn_ptr", "kn_ptr", "cos_ptr", "sin_ptr")
             else "i1" if n == "biased" else "fp32" if n == "eps" else "i32" for n in _body_gemm_kernel.arg_names}
    # (as launched for a 7B's shapes, whose sizes and pointers Triton finds multiples of 16)
    aligned = ["p0", "p1", "p2", "qn_ptr", "kn_ptr", "cos_ptr", "sin_ptr", "stride_cs", "n_cols", "n0", "n1"]
    const = dict(STAGES=STAGES, GROUP=GROUP, MODE=mode, NORMED=normed, num_warps=4)
    return sm90_build(_body_gemm_kernel, types, const,
                      aligned, _FUSION[mode], divisible, ones)

"""The gated MLP's first half, silu(x @ gate.T) * (x @ up.T), as one GEMM on Hopper's own instructions (Gluon) with
the middle in its epilogue: the two products are never written out and read back, which silu_mul.py's pass after
cuBLAS's two GEMMs does (3 bytes a middle element each way; ~30 ms of a 7B forward of 8 x 4096 tokens on an H100).
The same kernel runs a decoder layer's o and down projections with the residual added in the epilogue (`plus`), so
the layer's two adds are no passes of their own: its tile is then 128 rows x 256 columns of the one weight.

A tile is 128 rows of x by 128 columns of the middle: both products of those columns, so 128 x 256 of GEMM. The
program is persistent (one per SM, tiles in grouped order, each program every grid-th tile). One warp loads x's rows
(two boxes of 64) and the two weights' rows by TMA into a ring of STAGES buffers; two warpgroups take 64 rows each
(warp_specialize; 240 and 40 registers asked for), keep one step's products in flight, release a buffer once its
products are done, and store their 64 x 128 of the middle through shared memory by TMA while the next tile's first
blocks load.

Rounded as silu_mul.py and HF round: each product to the dtype, silu in fp32 rounded to the dtype, times up in fp32,
rounded; a projection rounded to the dtype, then added to the residual in fp32 and rounded. The sum over K runs in
one order for every row, with no split: a row's bits do not depend on the rows around it or how many there are (no
MIN_TOKENS filler needed). The bits differ from cuBLAS's products (another order
of the sum), so the trainer's forward with gradients runs this kernel too (`gated` and `projected`; their backward
recomputes the two products, or multiplies the gradient, with torch).
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

from .hopper_attention import _DTYPES, _tma_load

ROWS, COLUMNS, DEPTH, STAGES, GROUP = 64, 128, 64, 4, 8  # a warpgroup's rows, a tile's middle columns, K a step
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global  # (3.6: the second name)


def usable(x: Tensor, gate: Tensor, up: Tensor) -> bool:
    """The kernel runs these here: a Hopper GPU, bf16 or fp16, weights [N, K] of one shape, rows whose strides the
    copy engine can walk (K a multiple of 8, 16-byte aligned bases)."""
    k = x.shape[-1]
    return (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9 and x.dtype in _DTYPES
            and gate.dtype == up.dtype == x.dtype and gate.shape == up.shape and gate.shape[1] == k
            and k % 8 == 0 and gate.shape[0] % 8 == 0 and all(t.data_ptr() % 16 == 0 for t in (x, gate, up)))


@gluon.jit
def _tile(t, m_tiles, n_tiles, GROUP: gl.constexpr):
    """Tile t's row block and column block: GROUP row blocks walk the columns together (their weights stay in L2)."""
    per_group = GROUP * n_tiles
    first = t // per_group * GROUP
    rows = gl.minimum(m_tiles - first, GROUP)
    return first + t % per_group % rows, t % per_group // rows


@gluon.jit
def _loads(x_desc, g_desc, u_desc, x_smem, g_smem, u_smem, ready, empty, n_step, n_second, m_tiles, n_tiles, k_steps,
           GROUP: gl.constexpr):
    """The loads (one warp): step i (counted over all the program's tiles) into buffer i % STAGES once both
    warpgroups released its last use; the weights' rows n * n_step and n * n_step + n_second (gated: both weights at
    the tile's columns; a projection: the one weight's two halves of its 2 x COLUMNS columns)."""
    STAGES: gl.constexpr = g_smem.shape[0]
    ROWS: gl.constexpr = x_desc.block_type.shape[0]
    DEPTH: gl.constexpr = x_desc.block_type.shape[1]
    nbytes: gl.constexpr = 2 * x_desc.block_type.nbytes + 2 * g_desc.block_type.nbytes
    i = 0
    for t in range(gl.program_id(0), m_tiles * n_tiles, gl.num_programs(0)):
        m, n = _tile(t, m_tiles, n_tiles, GROUP)
        for k in range(k_steps):
            st = i % STAGES
            mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)  # (a fresh barrier's previous phase)
            mbarrier.expect(ready.index(st), nbytes)
            _tma_load(x_desc, [m * 2 * ROWS, k * DEPTH], ready.index(st), x_smem.index(2 * st))
            _tma_load(x_desc, [m * 2 * ROWS + ROWS, k * DEPTH], ready.index(st), x_smem.index(2 * st + 1))
            _tma_load(g_desc, [n * n_step, k * DEPTH], ready.index(st), g_smem.index(st))
            _tma_load(u_desc, [n * n_step + n_second, k * DEPTH], ready.index(st), u_smem.index(st))
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
                   GROUP: gl.constexpr):
    """Tile t's row and column blocks, and this warpgroup's 64 rows of it: both products over K from steps i ..
    i + k_steps - 1 of the ring, one step's products in flight while the next step's are issued; each buffer
    released once its products are done."""
    STAGES: gl.constexpr = g_smem.shape[0]
    m, n = _tile(t, m_tiles, n_tiles, GROUP)
    st = i % STAGES
    mbarrier.wait(ready.index(st), (i // STAGES) & 1)
    a = x_smem.index(2 * st + half)
    g = warpgroup_mma(a, g_smem.index(st).permute((1, 0)), zero, use_acc=False, is_async=True)
    u = warpgroup_mma(a, u_smem.index(st).permute((1, 0)), zero, use_acc=False, is_async=True)
    g, u = warpgroup_mma_wait(2, deps=(g, u))  # (waits for nothing: the products stay in flight)
    for k in range(1, k_steps):
        st = (i + k) % STAGES
        mbarrier.wait(ready.index(st), ((i + k) // STAGES) & 1)
        a = x_smem.index(2 * st + half)
        g = warpgroup_mma(a, g_smem.index(st).permute((1, 0)), g, is_async=True)
        u = warpgroup_mma(a, u_smem.index(st).permute((1, 0)), u, is_async=True)
        g, u = warpgroup_mma_wait(2, deps=(g, u))  # (the step before is done: its buffer goes back)
        mbarrier.arrive(empty.index((i + k - 1) % STAGES))
    g, u = warpgroup_mma_wait(0, deps=(g, u))
    mbarrier.arrive(empty.index((i + k_steps - 1) % STAGES))
    return m, n, g, u


@gluon.jit
def _gated_products(half, x_smem, g_smem, u_smem, ready, empty, out_smem, out_desc, m_tiles, n_tiles, k_steps,
                    GROUP: gl.constexpr):
    """One warpgroup's 64 rows of each tile: the middle of its columns, stored by TMA."""
    ROWS: gl.constexpr = x_smem.shape[1]
    COLUMNS: gl.constexpr = g_smem.shape[1]
    dtype: gl.constexpr = out_desc.dtype
    zero = _zero(x_smem, g_smem)
    i = 0
    for t in range(gl.program_id(0), m_tiles * n_tiles, gl.num_programs(0)):
        m, n, g, u = _tile_products(t, half, x_smem, g_smem, u_smem, ready, empty, i, m_tiles, n_tiles, k_steps,
                                    zero, GROUP)
        i += k_steps
        gate = g.to(dtype).to(gl.float32)
        middle = (gate / (1.0 + gl.exp(-gate))).to(dtype).to(gl.float32) * u.to(dtype).to(gl.float32)
        tma.store_wait(0)  # (this warpgroup's last tile has left its buffer)
        out_smem.store(middle.to(dtype))
        fence_async_shared()
        _tma_store(out_desc, [m * 2 * ROWS + half * ROWS, n * COLUMNS], out_smem)
    tma.store_wait(0)


@gluon.jit
def _plus_products(half, x_smem, g_smem, u_smem, ready, empty, out_smem, out_desc, res_ptr, stride_r, n_rows, n_cols,
                   m_tiles, n_tiles, k_steps, GROUP: gl.constexpr):
    """One warpgroup's 64 rows of each tile: its 2 x COLUMNS columns of the product plus the residual's, stored by
    TMA one half after the other."""
    ROWS: gl.constexpr = x_smem.shape[1]
    COLUMNS: gl.constexpr = g_smem.shape[1]
    zero = _zero(x_smem, g_smem)
    i = 0
    for t in range(gl.program_id(0), m_tiles * n_tiles, gl.num_programs(0)):
        m, n, g, u = _tile_products(t, half, x_smem, g_smem, u_smem, ready, empty, i, m_tiles, n_tiles, k_steps,
                                    zero, GROUP)
        i += k_steps
        r0 = m * 2 * ROWS + half * ROWS
        _add_store(g, out_smem, out_desc, res_ptr, stride_r, n_rows, n_cols, r0, n * 2 * COLUMNS)
        _add_store(u, out_smem, out_desc, res_ptr, stride_r, n_rows, n_cols, r0, n * 2 * COLUMNS + COLUMNS)
    tma.store_wait(0)


@gluon.jit
def _add_store(acc, out_smem, out_desc, res_ptr, stride_r, n_rows, n_cols, r0, c0):
    """Rows r0.. and columns c0.. of the output: the product rounded to the dtype plus the residual's, rounded (HF's
    `residual + x`), stored by TMA."""
    dtype: gl.constexpr = out_desc.dtype
    layout: gl.constexpr = acc.type.layout
    rows = r0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    cols = c0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    inside = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    r = gl.load(res_ptr + rows.to(gl.int64)[:, None] * stride_r + cols[None, :], mask=inside, other=0.0)
    y = (acc.to(dtype).to(gl.float32) + r.to(gl.float32)).to(dtype)
    tma.store_wait(0)  # (the last store has left the buffer)
    out_smem.store(y)
    fence_async_shared()
    _tma_store(out_desc, [r0, c0], out_smem)


@gluon.jit
def _body_gemm_kernel(x_desc, g_desc, u_desc, out_desc, res_ptr, stride_r, n_rows, n_cols, m_tiles, n_tiles, k_steps,
                      STAGES: gl.constexpr, GROUP: gl.constexpr, GATED: gl.constexpr, num_warps: gl.constexpr):
    ROWS: gl.constexpr = x_desc.block_type.shape[0]
    DEPTH: gl.constexpr = x_desc.block_type.shape[1]
    COLUMNS: gl.constexpr = g_desc.block_type.shape[0]
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES, ROWS, DEPTH], x_desc.layout)
    g_smem = gl.allocate_shared_memory(g_desc.dtype, [STAGES, COLUMNS, DEPTH], g_desc.layout)
    u_smem = gl.allocate_shared_memory(u_desc.dtype, [STAGES, COLUMNS, DEPTH], u_desc.layout)
    out_smem = gl.allocate_shared_memory(out_desc.dtype, [2, ROWS, COLUMNS], out_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    common = (x_smem, g_smem, u_smem, ready, empty)
    sizes = (m_tiles, n_tiles, k_steps, GROUP)
    # (constexprs reach a partition as values: each kind has partitions of its own)
    if GATED:
        gl.warp_specialize([
            (_gated_products, (0,) + common + (out_smem.index(0), out_desc) + sizes),
            (_gated_products, (1,) + common + (out_smem.index(1), out_desc) + sizes),
            (_loads, (x_desc, g_desc, u_desc) + common + (gl.to_tensor(COLUMNS), gl.to_tensor(0)) + sizes),
        ], [4, 1], [240, 40])
    else:
        epilogue = (out_desc, res_ptr, stride_r, n_rows, n_cols)
        gl.warp_specialize([
            (_plus_products, (0,) + common + (out_smem.index(0),) + epilogue + sizes),
            (_plus_products, (1,) + common + (out_smem.index(1),) + epilogue + sizes),
            (_loads, (x_desc, g_desc, u_desc) + common + (gl.to_tensor(2 * COLUMNS), gl.to_tensor(COLUMNS)) + sizes),
        ], [4, 1], [240, 40])


def _descriptor(x: Tensor, block: list[int]) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(x, block, gl.NVMMASharedLayout.get_default_for(block, _DTYPES[x.dtype]))


def _launch(x: Tensor, first: Tensor, second: Tensor, out: Tensor, residual: Tensor | None, stages: int,
            group: int) -> Tensor:
    """One launch over x's rows: gated (residual None; weights `first`, `second`) or the one weight `first` (=
    `second`) plus the residual, into out."""
    if x.shape[0] == 0:
        return out
    gated = residual is None
    m_tiles, n_tiles = triton.cdiv(x.shape[0], 2 * ROWS), triton.cdiv(out.shape[1], COLUMNS * (1 if gated else 2))
    programs = min(m_tiles * n_tiles, torch.cuda.get_device_properties(x.device).multi_processor_count)
    res = out if gated else residual
    w0, w1 = _descriptor(first, [COLUMNS, DEPTH]), _descriptor(second, [COLUMNS, DEPTH])
    _body_gemm_kernel[(programs,)](
        _descriptor(x, [ROWS, DEPTH]), w0, w1 if gated else w0, _descriptor(out, [ROWS, COLUMNS]), res, res.stride(0),
        *out.shape, m_tiles, n_tiles, triton.cdiv(x.shape[1], DEPTH), STAGES=stages, GROUP=group, GATED=gated,
        num_warps=4, enable_fp_fusion=True)  # (Triton 3.6's default, as measured)
    return out


def middle(x: Tensor, gate: Tensor, up: Tensor, stages: int = STAGES, group: int = GROUP) -> Tensor:
    """silu(x @ gate.T) * (x @ up.T) for x [M, K] and weights [N, K], as `usable` says: one launch, no autograd.
    (`stages`, `group`: the ring's buffers and the row blocks that walk the columns together; benchmarks sweep them.)"""
    x = x.contiguous()
    out = torch.empty(x.shape[0], gate.shape[0], dtype=x.dtype, device=x.device)
    return _launch(x, gate.contiguous(), up.contiguous(), out, None, stages, group)


def plus(x: Tensor, weight: Tensor, residual: Tensor) -> Tensor:
    """residual + x @ weight.T for x [M, K], weight [N, K] and residual [M, N] of x's dtype (the product rounded to
    the dtype first, as HF's `residual + proj(x)` rounds), as `usable(x, weight, weight)` says: one launch, no
    autograd."""
    x, weight, residual = x.contiguous(), weight.contiguous(), residual.contiguous()
    out = torch.empty_like(residual)
    return _launch(x, weight, weight, out, residual, STAGES, GROUP)


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


def compile_sm90(gated: bool = True):
    """The kernel for bf16 built for sm_90a, here, with no GPU, gated or with the residual (benchmarks/compile_sm90.py
    reports it)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(block):
        return f"tensordesc<bf16{block},{gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)}>"

    const = dict(STAGES=STAGES, GROUP=GROUP, GATED=gated, num_warps=4)
    blocks = dict(x_desc=[ROWS, DEPTH], g_desc=[COLUMNS, DEPTH], u_desc=[COLUMNS, DEPTH], out_desc=[ROWS, COLUMNS])
    sig = {n: "constexpr" if n in const else desc(blocks[n]) if n in blocks else "*bf16" if n == "res_ptr" else "i32"
           for n in _body_gemm_kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(_body_gemm_kernel.arg_names)
               if n in ("res_ptr", "stride_r")}
    return triton.compile(GluonASTSource(_body_gemm_kernel, sig, constexprs=const, attrs=aligned),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))

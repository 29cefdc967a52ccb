"""A mixture's grouped products on Hopper's own instructions (Gluon): grouped_gemm.py's two kernels (gate/up with
the SiLU middle, reading a token's row in place; down) as hopper_gated.py's persistent GEMM. One program per SM takes
every grid-th tile of the schedule (grouped_gemm.groups: each tile 128 rows of one expert, in grouped order); one
warp loads, two warpgroups take 64 rows each, as there.

The rows of a gate/up tile are tokens in expert order (x[source[r]]): the copy engine cannot gather them, so four
loading warps copy them with cp.async (a tile's row offsets read once, then 16 bytes a thread a block of 16 rows each
step), and each thread's copies arrive on the step's barrier when they land (with the weights' TMA bytes, what makes
the step ready); the warpgroups fence the rows before their products read them. Down reads its rows (the middle,
already in expert order) by TMA. A tile's rows past its expert's end (the next expert's, read with
this expert's weights) are never stored: a warpgroup whose 64 rows cross the end stores under a mask, the rest
by TMA. Tiles of rows routed to no expert store zeros.

Rounded as grouped_gemm.py's kernel rounds (a product to the dtype; the middle as silu_mul.py), with the sum over K
in one order for every row: a row's bits do not depend on its expert's other rows. They differ from the Triton
kernel's (another order of the sum), so the choice is per device and dtype, the same in the trainer's forward.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from .hopper_attention import _tma_load, sm90_build, sm90_desc
from .hopper_gated import (
    COLUMNS,
    DEPTH,
    GROUP,
    ROWS,
    STAGES,
    _copyable,
    _descriptor,
    _middle,
    _ring,
    _store,
    _tile,
    _tile_products,
    _zero,
)

_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared  # (3.6: the second)


def usable(x: Tensor, weight: Tensor, block_m: int) -> bool:
    """The kernel runs x [rows, K] against weight [experts, N, K] (gate and up: N = 2I) here, for a schedule of tiles
    of block_m rows: a Hopper GPU, bf16 or fp16, rows the copy engine can walk (hopper_gated._copyable), outputs of
    whole 16 bytes a row, the schedule's tiles of 128 rows."""
    return (weight.dim() == 3 and weight.shape[1] % 16 == 0 and block_m == 2 * ROWS
            and _copyable(x, weight.view(-1, weight.shape[2])))


def gather_usable(x: Tensor, weight: Tensor, block_m: int) -> bool:
    """As `usable`, for rows read in place (gate/up with a source): whole steps of K (no column of a step past a
    row's end), x of fewer than 2**31 elements."""
    return usable(x, weight, block_m) and x.shape[1] % DEPTH == 0 and x.numel() < 2**31


_GATHER: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # (four warps, 16 bytes a thread)


@gluon.jit
def _row_offsets(source_ptr, n_source, k_dim, r0, R: gl.constexpr):
    """Where rows r0 .. r0 + R - 1 of x[source] start in x (elements; rows past n_source read row 0's, which no
    tile stores), in the layout `_gather` copies by."""
    rows = r0 + gl.arange(0, R, layout=gl.SliceLayout(1, _GATHER))
    src = gl.load(source_ptr + rows, mask=rows < n_source, other=0).to(gl.int32)
    return gl.multiple_of(src * k_dim, 8)  # (`gather_usable`: x of fewer than 2**31 elements, rows of 16 bytes)


@gluon.jit
def _gather(x_ptr, offsets, k0, dst):
    """Columns k0 .. k0 + DEPTH - 1 of the rows starting at `offsets` (`_row_offsets`) into dst by cp.async."""
    cols = k0 + gl.arange(0, dst.shape[1], layout=gl.SliceLayout(0, _GATHER))
    _async_load(dst, x_ptr + offsets[:, None] + cols[None, :])


@gluon.jit
def _grouped_loads(x_desc, x_ptr, source_ptr, n_source, k_dim, w_desc, expert_ptr, row_ptr, n_experts, w_rows, n_step,
                   n_second, x_smem, g_smem, u_smem, ready, empty, m_tiles, n_tiles, k_steps, GROUP: gl.constexpr,
                   GATHER: gl.constexpr):
    """The loads, as hopper_gated._loads, for the schedule's tiles: an expert's weight rows expert * w_rows + n *
    n_step and n_second further; x's rows by TMA (one warp), or gathered (`_gather`, four warps): a step is then
    ready once its weights' bytes and every thread's copies are in."""
    STAGES: gl.constexpr = g_smem.shape[0]
    ROWS: gl.constexpr = x_smem.shape[1]
    DEPTH: gl.constexpr = x_smem.shape[2]
    nbytes: gl.constexpr = 2 * w_desc.block_type.nbytes + (0 if GATHER else 2 * x_desc.block_type.nbytes)
    i = 0
    for t in range(gl.program_id(0), m_tiles * n_tiles, gl.num_programs(0)):
        m, n = _tile(t, m_tiles, n_tiles, GROUP)
        expert = gl.load(expert_ptr + m).to(gl.int32)
        if (expert >= 0) & (expert < n_experts):
            row0 = gl.load(row_ptr + m).to(gl.int32)
            c = expert * w_rows + n * n_step
            if GATHER:  # (a tile's rows, read once)
                lo = _row_offsets(source_ptr, n_source, k_dim, row0, ROWS)
                hi = _row_offsets(source_ptr, n_source, k_dim, row0 + ROWS, ROWS)
            for k in range(k_steps):
                st = i % STAGES
                mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)  # (a fresh barrier's previous phase)
                mbarrier.expect(ready.index(st), nbytes)
                _tma_load(w_desc, [c, k * DEPTH], ready.index(st), g_smem.index(st))
                _tma_load(w_desc, [c + n_second, k * DEPTH], ready.index(st), u_smem.index(st))
                if GATHER:  # (each thread arrives once its copies have landed: one of the barrier's count)
                    _gather(x_ptr, lo, k * DEPTH, x_smem.index(2 * st))
                    _gather(x_ptr, hi, k * DEPTH, x_smem.index(2 * st + 1))
                    async_copy.mbarrier_arrive(ready.index(st), increment_count=False)
                else:
                    _tma_load(x_desc, [row0, k * DEPTH], ready.index(st), x_smem.index(2 * st))
                    _tma_load(x_desc, [row0 + ROWS, k * DEPTH], ready.index(st), x_smem.index(2 * st + 1))
                i += 1


@gluon.jit
def _gather_loads(x_desc, x_ptr, source_ptr, n_source, k_dim, w_desc, expert_ptr, row_ptr, n_experts, w_rows, n_step,
                  n_second, x_smem, g_smem, u_smem, ready, empty, m_tiles, n_tiles, k_steps, GROUP: gl.constexpr):
    _grouped_loads(x_desc, x_ptr, source_ptr, n_source, k_dim, w_desc, expert_ptr, row_ptr, n_experts, w_rows, n_step,
                   n_second, x_smem, g_smem, u_smem, ready, empty, m_tiles, n_tiles, k_steps, GROUP, True)


@gluon.jit
def _copy_loads(x_desc, x_ptr, source_ptr, n_source, k_dim, w_desc, expert_ptr, row_ptr, n_experts, w_rows, n_step,
                n_second, x_smem, g_smem, u_smem, ready, empty, m_tiles, n_tiles, k_steps, GROUP: gl.constexpr):
    _grouped_loads(x_desc, x_ptr, source_ptr, n_source, k_dim, w_desc, expert_ptr, row_ptr, n_experts, w_rows, n_step,
                   n_second, x_smem, g_smem, u_smem, ready, empty, m_tiles, n_tiles, k_steps, GROUP, False)


@gluon.jit
def _rows_store(y, out_smem, out_desc, out_ptr, n_cols, r0, end, c0):
    """y (fp32, 64 rows) rounded to the dtype at rows r0.. and columns c0.. of out [rows, n_cols], the rows before
    `end` only: by TMA if they all are, else under a mask."""
    if r0 + y.shape[0] <= end:
        _store(y, out_smem, out_desc, r0, c0)
    elif r0 < end:
        layout: gl.constexpr = y.type.layout
        rows = r0 + gl.arange(0, y.shape[0], layout=gl.SliceLayout(1, layout))
        cols = c0 + gl.arange(0, y.shape[1], layout=gl.SliceLayout(0, layout))
        gl.store(out_ptr + rows.to(gl.int64)[:, None] * n_cols + cols[None, :], y.to(out_desc.dtype),
                 mask=(rows < end)[:, None] & (cols < n_cols)[None, :])


@gluon.jit
def _grouped_tiles(half, x_smem, g_smem, u_smem, ready, empty, out_smem, out_desc, out_ptr, n_cols, expert_ptr,
                   row_ptr, end_ptr, n_experts, m_tiles, n_tiles, k_steps, GROUP: gl.constexpr, GATED: gl.constexpr,
                   FENCE: gl.constexpr):
    """One warpgroup's 64 rows of each tile: GATED, the middle of its COLUMNS columns; else its 2 x COLUMNS
    columns of the product, one half after the other. FENCE: x's rows were gathered (`_tile_products`)."""
    ROWS: gl.constexpr = x_smem.shape[1]
    COLUMNS: gl.constexpr = g_smem.shape[1]
    dtype: gl.constexpr = out_desc.dtype
    zero = _zero(x_smem, g_smem)
    i = 0
    for t in range(gl.program_id(0), m_tiles * n_tiles, gl.num_programs(0)):
        m, n = _tile(t, m_tiles, n_tiles, GROUP)
        expert = gl.load(expert_ptr + m).to(gl.int32)
        if expert >= 0:  # (-1: a spare of the schedule)
            r0 = gl.load(row_ptr + m).to(gl.int32) + half * ROWS
            end = gl.load(end_ptr + m).to(gl.int32)
            g = zero
            u = zero
            if expert < n_experts:  # (else rows routed to no expert: zeros)
                m, n, g, u = _tile_products(t, half, x_smem, g_smem, u_smem, ready, empty, i, m_tiles, n_tiles,
                                            k_steps, zero, GROUP, FENCE)
                i += k_steps
            if GATED:
                _rows_store(_middle(g, u, dtype), out_smem, out_desc, out_ptr, n_cols, r0, end, n * COLUMNS)
            else:
                _rows_store(g, out_smem, out_desc, out_ptr, n_cols, r0, end, n * 2 * COLUMNS)
                _rows_store(u, out_smem, out_desc, out_ptr, n_cols, r0, end, n * 2 * COLUMNS + COLUMNS)
    tma.store_wait(0)


@gluon.jit
def _gated_tiles(half, x_smem, g_smem, u_smem, ready, empty, out_smem, out_desc, out_ptr, n_cols, expert_ptr, row_ptr,
                 end_ptr, n_experts, m_tiles, n_tiles, k_steps, GROUP: gl.constexpr):
    _grouped_tiles(half, x_smem, g_smem, u_smem, ready, empty, out_smem, out_desc, out_ptr, n_cols, expert_ptr,
                   row_ptr, end_ptr, n_experts, m_tiles, n_tiles, k_steps, GROUP, True, False)


@gluon.jit
def _gathered_tiles(half, x_smem, g_smem, u_smem, ready, empty, out_smem, out_desc, out_ptr, n_cols, expert_ptr,
                    row_ptr, end_ptr, n_experts, m_tiles, n_tiles, k_steps, GROUP: gl.constexpr):
    _grouped_tiles(half, x_smem, g_smem, u_smem, ready, empty, out_smem, out_desc, out_ptr, n_cols, expert_ptr,
                   row_ptr, end_ptr, n_experts, m_tiles, n_tiles, k_steps, GROUP, True, True)


@gluon.jit
def _plain_tiles(half, x_smem, g_smem, u_smem, ready, empty, out_smem, out_desc, out_ptr, n_cols, expert_ptr, row_ptr,
                 end_ptr, n_experts, m_tiles, n_tiles, k_steps, GROUP: gl.constexpr):
    _grouped_tiles(half, x_smem, g_smem, u_smem, ready, empty, out_smem, out_desc, out_ptr, n_cols, expert_ptr,
                   row_ptr, end_ptr, n_experts, m_tiles, n_tiles, k_steps, GROUP, False, False)


@gluon.jit
def _grouped_kernel(x_desc, x_ptr, source_ptr, n_source, w_desc, out_desc, out_ptr, expert_ptr, row_ptr, end_ptr,
                    n_experts, w_rows, n_cols, m_tiles, n_tiles, k_dim, k_steps, STAGES: gl.constexpr,
                    GROUP: gl.constexpr, GATED: gl.constexpr, GATHER: gl.constexpr, num_warps: gl.constexpr):
    """out = the schedule's tiles of x (GATHER: x[source]) times their expert's rows of w [experts * w_rows, K]:
    GATED, the middle of gate (an expert's first n_cols rows) and up (the next n_cols); else the product, n_cols
    columns. GATHER: gate/up only."""
    COLUMNS: gl.constexpr = w_desc.block_type.shape[0]
    GATHER_WARPS: gl.constexpr = 4  # (`_gather`'s layout; each of their threads arrives on a step's ready barrier)
    x_smem, g_smem, u_smem, out_smem, ready, empty = _ring(x_desc, w_desc, out_desc, STAGES,
                                                           1 + 32 * GATHER_WARPS if GATHER else 1)
    common = (x_smem, g_smem, u_smem, ready, empty)
    sizes = (m_tiles, n_tiles, k_steps, GROUP)
    schedule = (expert_ptr, row_ptr, end_ptr, n_experts)
    n_step = COLUMNS if GATED else 2 * COLUMNS
    loads = (x_desc, x_ptr, source_ptr, n_source, k_dim, w_desc, expert_ptr, row_ptr, n_experts, w_rows,
             gl.to_tensor(n_step), n_cols if GATED else gl.to_tensor(COLUMNS)) + common + sizes
    first = (0,) + common + (out_smem.index(0), out_desc, out_ptr, n_cols) + schedule + sizes
    second = (1,) + common + (out_smem.index(1), out_desc, out_ptr, n_cols) + schedule + sizes
    # (constexprs reach a partition as values: each kind has partitions of its own)
    if GATHER:  # (gate/up only)
        gl.warp_specialize([(_gathered_tiles, first), (_gathered_tiles, second), (_gather_loads, loads)],
                           [4, GATHER_WARPS], [240, 32])
    elif GATED:
        gl.warp_specialize([(_gated_tiles, first), (_gated_tiles, second), (_copy_loads, loads)], [4, 1], [240, 32])
    else:
        gl.warp_specialize([(_plain_tiles, first), (_plain_tiles, second), (_copy_loads, loads)], [4, 1], [240, 32])


def launch(x: Tensor, weight: Tensor, expert: Tensor, row: Tensor, end: Tensor, source: Tensor | None, gated: bool,
           out: Tensor) -> None:
    """out [rows, N] = grouped_gemm._launch's product (gated: the middle) for the schedule (expert, row, end) of
    tiles of 128 rows, as `usable` says. x [rows, K] in expert order, or with `source` (gated only) the rows
    x[source]."""
    if source is not None and not gated:
        raise ValueError("hopper_grouped reads rows in place (source) for gate/up only")
    k = x.shape[1]
    num_experts, w_rows, _ = weight.shape
    n = out.shape[1]
    m_tiles, n_tiles = len(expert), triton.cdiv(n, COLUMNS if gated else 2 * COLUMNS)
    programs = min(m_tiles * n_tiles, torch.cuda.get_device_properties(x.device).multi_processor_count)
    rows = x if source is None else source
    _grouped_kernel[(programs,)](
        _descriptor(x, [ROWS, DEPTH]), x, rows, len(rows), _descriptor(weight.view(-1, k), [COLUMNS, DEPTH]),
        _descriptor(out, [ROWS, COLUMNS]), out, expert, row, end, num_experts, w_rows, n, m_tiles, n_tiles, k,
        triton.cdiv(k, DEPTH), STAGES=STAGES, GROUP=GROUP, GATED=gated, GATHER=source is not None, num_warps=4,
        enable_fp_fusion=True)  # (Triton 3.6's default, as measured)


def compile_sm90(gated: bool, gather: bool, divisible: tuple[str, ...] = (), ones: tuple[str, ...] = ()):
    """The kernel for bf16 built for sm_90a by sm90_build."""
    types = {n: sm90_desc([ROWS, DEPTH]) if n == "x_desc" else sm90_desc([COLUMNS, DEPTH]) if n == "w_desc"
             else sm90_desc([ROWS, COLUMNS]) if n == "out_desc" else "*bf16" if n in ("x_ptr", "out_ptr")
             else "*i64" if n.endswith("_ptr") else "i32" for n in _grouped_kernel.arg_names}
    aligned = ["x_ptr", "out_ptr", "source_ptr", "n_cols", "k_dim", "w_rows"]  # (a 30B-A3B's sizes)
    return sm90_build(_grouped_kernel, types, dict(STAGES=STAGES, GROUP=GROUP, GATED=gated, GATHER=gather, num_warps=4),
                      aligned, True, divisible, ones)

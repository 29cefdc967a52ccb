"""causal_attention.py's forward on Hopper's own instructions, written in Gluon (Triton's explicit layer), so that the
softmax of a key block runs while the tensor cores multiply probabilities by values. Triton's compiler does not do
this for causal_attention.py: in its PTX for sm_90a it waits for every wgmma at once (`wgmma.wait_group 0` before
each use), also with the query tile split in two halves whose products could overlap.

A tile is causal_attention.py's (128 queries of one segment and head) with its arithmetic in the fused form (a
block's max over its allowed keys times the scale, exp2 of one FMA, masked keys as -inf), its key blocks aligned to
the segment and walked in order, and its window, so that a query's bits do not depend on its neighbours or where its
tile starts. FA3's schedule: the tile's two halves of 64 queries sit on a warpgroup each and take turns issuing their
products (two mbarriers), so that one's softmax runs while the other's products do; within a half, each block's
step issues the next block's scores and this block's P V and waits for the scores alone. One warp of their own
(warp_specialize; 240 and 24 registers asked for) loads keys and values by TMA into a ring of STAGES buffers.

The kernel is persistent: one program per SM takes tiles from a counter, heaviest first within each head
(`_order`). Its loader warp takes each, skips those past their segment's end, and posts the others to both halves, so
that the next tile's first blocks load while this one's last run, and a half reads its next queries while its last P
V runs. Each tile is computed alone, whichever program takes it: the same bits. (One program per tile, and an 8-warp
form overlapping its own softmax with P V, ran slower: BENCHMARKS.md.) A half's output goes out through its queries'
buffer by TMA (`_store`), which the next tile's queries wait for. (An output buffer of its own, stored under the
next tile's first scores with two key buffers making the room, ran 0.5-2% slower: BENCHMARKS.md.)

Hopper only (wgmma is sm_90a's), heads of 128, bf16 or fp16; causal_attention.py's kernel runs everything else and
every tile taken from a schedule (a CUDA graph's forward). Triton 3.6 and later.
"""

from __future__ import annotations

import math

import torch
import triton
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

from .key_blocks import tile_span

BLOCK, HEAD, STAGES = 128, 128, 3
FORMS = {"persistent": 4}  # form -> num_warps (the first half's warpgroup)
_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # (3.6: the second name)
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global  # (3.6: the second name)


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The kernels run these heads here: a Hopper GPU, heads of 128, bf16 or fp16, keys and values where the copy
    engine can read them (16-byte aligned; causal_attention's kernel, with the same bits, takes the rest)."""
    return (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9 and q.shape[-1] == HEAD
            and q.dtype in _DTYPES and k.dtype == v.dtype == q.dtype
            and all(x.data_ptr() % 16 == 0 for x in (k, v)))


@gluon.jit
def _block_softmax(s, m_i, l_i, n, whole, pos, n_k, scale, window, WINDOW: gl.constexpr, layout: gl.constexpr):
    """Keys n .. n + BLOCK - 1 of the segment (scores s): probabilities, the new max and sum, and alpha (what the
    output so far is multiplied by)."""
    if n >= whole:  # (the diagonal's blocks, the segment's end and the window)
        keys = n + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, layout))
        allowed = (keys[None, :] <= pos[:, None]) & (keys < n_k)[None, :]
        if WINDOW:
            allowed = allowed & (pos[:, None] - keys[None, :] < window)
        s = gl.where(allowed, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * scale)
    p = gl.exp2(s * scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _store(out_ptr, o_desc, buffer, lse_ptr, acc, m_i, l_i, q0, n_q, r0, head, total_q, stride_ot, stride_oh,
           layout: gl.constexpr):
    """Rows r0 .. of the segment's output (acc / l_i) and their log-sum-exp (FlashAttention's layout: [heads, Tq]).
    Rows all in the segment go through `buffer` (the half's queries' shared memory) by TMA, which writes whole
    lines and leaves the warps free at once; stored from the product's layout, the same values took 8-9% of the
    kernel's time (BENCHMARKS.md). The rows of a segment's last tile, where the next segment's rows follow, are
    stored under a mask."""
    rows = r0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    at = (q0 + rows).to(gl.int64)
    out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
    if r0 + acc.shape[0] <= n_q:
        buffer.store(out)
        fence_async_shared()
        _tma_store(o_desc, [q0 + r0, head * acc.shape[1]], buffer)
    else:
        d = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
        gl.store(out_ptr + at[:, None] * stride_ot + head * stride_oh + d[None, :], out, mask=(rows < n_q)[:, None])
    gl.store(lse_ptr + head.to(gl.int64) * total_q + at, (m_i + gl.log2(l_i)) * 0.6931471805599453, mask=rows < n_q)


@gluon.jit
def _order(t, q_blocks, per_head):
    """Tile t's head, segment and query block: heads one after another (per_head tiles a head, so that the tiles in
    flight share a few heads' keys in L2), and within a head the query blocks with the most keys first, each across
    the segments (q_blocks a segment). So the tiles taken last are the lightest and the programs end together. (Each
    segment's blocks in turn left a heavy tile near the end: 7B heads at 8 x 4096, 1.4% slower on an H100.)"""
    segments = per_head // q_blocks
    return t // per_head, t % per_head % segments, q_blocks - 1 - t % per_head // segments


@gluon.jit
def _tile_of(t, cu_q, cu_k, window, group, q_blocks, per_head, BLOCK: gl.constexpr, D: gl.constexpr,
             WINDOW: gl.constexpr):
    """Tile t (`_order`): its head, key_blocks.tile_span's spans, the key blocks it reads (0: a tile past the
    segment's end) and its key-value head's first column."""
    head, segment, block = _order(t, q_blocks, per_head)
    q0, n_q, k0, n_k, m0, start, whole, end = tile_span(cu_q, cu_k, segment, block, window, BLOCK, BLOCK, WINDOW)
    count = gl.where(m0 < n_q, (end - start + BLOCK - 1) // BLOCK, 0)
    return head, q0, n_q, k0, n_k, m0, start, whole, count, (head // group) * D


@gluon.jit
def _post_tile(t, ids, id_full, id_free, it):
    """The loader posts tile t (n_tiles or more: none left) in slot it % 2, for both halves."""
    slot = it % 2
    mbarrier.wait(id_free.index(slot), ((it // 2) & 1) ^ 1)
    ids.index(slot).store(gl.full([1], t, gl.int32, gl.BlockedLayout([1], [32], [1], [0])))
    mbarrier.arrive(id_full.index(slot))


@gluon.jit
def _posted_tile(ids, id_full, id_free, it, rows: gl.constexpr):
    """A half's it-th tile, as the loader posted it."""
    slot = it % 2
    mbarrier.wait(id_full.index(slot), (it // 2) & 1)
    t = gl.max(ids.index(slot).load(gl.BlockedLayout([1], [32], [rows // 16], [0])), 0)
    mbarrier.arrive(id_free.index(slot))
    return t


@gluon.jit
def _persistent_loads(k_desc, v_desc, k_smem, v_smem, ready, empty, ids, id_full, id_free, taken, n_tiles, cu_q,
                      cu_k, window, group, q_blocks, per_head, WINDOW: gl.constexpr):
    """The persistent form's loads (one warp): it takes tiles from the counter, posts those with keys to read (a
    tile past its segment's end is skipped here, while the halves compute), and loads their blocks through one ring,
    block g (counted over all its tiles) into buffer g % STAGES once both halves released its last use."""
    BLOCK: gl.constexpr = k_desc.block_type.shape[0]
    D: gl.constexpr = k_desc.block_type.shape[1]
    STAGES: gl.constexpr = k_smem.shape[0]
    it = 0
    g = 0
    t = gl.atomic_add(taken, 1)
    while t < n_tiles:
        head, q0, n_q, k0, n_k, m0, start, whole, count, col = _tile_of(t, cu_q, cu_k, window, group, q_blocks,
                                                                        per_head, BLOCK, D, WINDOW)
        if count > 0:
            _post_tile(t, ids, id_full, id_free, it)
            it += 1
        for b in range(count):
            st = (g + b) % STAGES
            mbarrier.wait(empty.index(st), (((g + b) // STAGES) & 1) ^ 1)  # (a fresh barrier's previous phase)
            mbarrier.expect(ready.index(st), 2 * k_desc.block_type.nbytes)
            _tma_load(k_desc, [k0 + start + b * BLOCK, col], ready.index(st), k_smem.index(st))
            _tma_load(v_desc, [k0 + start + b * BLOCK, col], ready.index(st), v_smem.index(st))
        g += count
        t = gl.atomic_add(taken, 1)
    _post_tile(t, ids, id_full, id_free, it)


@gluon.jit
def _tile_queries(q_ptr, t, n_tiles, half, cu_q, q_blocks, per_head, stride_qt, stride_qh, ROWS: gl.constexpr,
                  D: gl.constexpr, layout: gl.constexpr):
    """Half `half` of tile t's queries (zeros past its segment; nothing read for t >= n_tiles)."""
    head, segment, block = _order(t, q_blocks, per_head)
    q0 = gl.load(cu_q + segment)
    n_q = gl.load(cu_q + segment + 1) - q0
    first = block * (2 * ROWS) + half * ROWS
    rows = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    at = (q0 + rows).to(gl.int64)
    return gl.load(q_ptr + at[:, None] * stride_qt + head * stride_qh + d[None, :],
                   mask=((rows < n_q) & (t < n_tiles))[:, None], other=0.0)


@gluon.jit
def _persistent_attend(half, q_ptr, q_smem, k_smem, v_smem, ready, empty, turn, ids, id_full, id_free, out_ptr,
                       o_desc, lse_ptr, n_tiles, cu_q, cu_k, scale, window, group, q_blocks, per_head, total_q,
                       stride_qt, stride_qh, stride_ot, stride_oh, WINDOW: gl.constexpr):
    """One half's tiles, as the loader posts them (each with keys to read): the loop over each tile's key blocks (the
    module's docstring), with the blocks counted over all tiles (g) and the turns too; the next tile's queries are read
    while the last P V runs."""
    ROWS: gl.constexpr = q_smem.shape[0]
    D: gl.constexpr = q_smem.shape[1]
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK: gl.constexpr = k_smem.shape[1]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[ROWS // 16, 1],
                                                  instr_shape=[16, BLOCK, 16])
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows_of: gl.constexpr = gl.SliceLayout(1, mma)
    io: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [ROWS // 16, 1], [1, 0])
    zero = gl.zeros([ROWS, BLOCK], gl.float32, mma)
    it = 0
    g = 0
    turns = 0
    t = _posted_tile(ids, id_full, id_free, it, ROWS)
    q = _tile_queries(q_ptr, t, n_tiles, half, cu_q, q_blocks, per_head, stride_qt, stride_qh, ROWS, D, io)
    while t < n_tiles:
        head, q0, n_q, k0, n_k, m0, start, whole, count, col = _tile_of(t, cu_q, cu_k, window, group, q_blocks,
                                                                        per_head, BLOCK, D, WINDOW)
        tma.store_wait(0)  # (the last tile's output has left the buffer)
        q_smem.store(q)  # (every product that read the last tile's queries has been waited for)
        fence_async_shared()
        it += 1
        r0 = m0 + half * ROWS
        pos = n_k - n_q + r0 + gl.arange(0, ROWS, layout=rows_of)
        mbarrier.wait(ready.index(g % STAGES), (g // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(g % STAGES).permute((1, 0)), zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        m_i = gl.full([ROWS], -1.0e38, gl.float32, rows_of)  # (finite: a block it sees nothing of changes nothing)
        l_i = gl.zeros([ROWS], gl.float32, rows_of)
        p, m_i, l_i, alpha = _block_softmax(s, m_i, l_i, start, whole, pos, n_k, scale, window, WINDOW, mma)
        acc = gl.zeros([ROWS, D], gl.float32, mma)
        for j in range(0, count - 1):
            nxt = g + j + 1
            mbarrier.wait(ready.index(nxt % STAGES), (nxt // STAGES) & 1)
            mbarrier.wait(turn.index(half), (turns + j) & 1)  # this half's turn on the tensor cores
            s = warpgroup_mma(q_smem, k_smem.index(nxt % STAGES).permute((1, 0)), zero, use_acc=False,
                              is_async=True)
            p_op = gl.convert_layout(p.to(q_smem.dtype), operand)
            acc = warpgroup_mma(p_op, v_smem.index((nxt - 1) % STAGES), acc, is_async=True)
            mbarrier.arrive(turn.index(1 - half))  # the other half's turn
            s = warpgroup_mma_wait(1, deps=(s,))  # (this block's scores; the values' product goes on)
            p, m_i, l_i, alpha = _block_softmax(s, m_i, l_i, start + (j + 1) * BLOCK, whole, pos, n_k, scale,
                                                window, WINDOW, mma)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
            mbarrier.arrive(empty.index((nxt - 1) % STAGES))  # (this half is done with that block)
            acc = acc * alpha[:, None]
        last = (g + count - 1) % STAGES
        p_op = gl.convert_layout(p.to(q_smem.dtype), operand)
        acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
        t = _posted_tile(ids, id_full, id_free, it, ROWS)
        q = _tile_queries(q_ptr, t, n_tiles, half, cu_q, q_blocks, per_head, stride_qt, stride_qh, ROWS, D, io)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        mbarrier.arrive(empty.index(last))
        _store(out_ptr, o_desc, q_smem, lse_ptr, acc, m_i, l_i, q0, n_q, r0, head, total_q, stride_ot, stride_oh, mma)
        g += count
        turns += count - 1
    tma.store_wait(0)


@gluon.jit
def _persistent_kernel(q_ptr, k_desc, v_desc, out_ptr, o_desc, lse_ptr, cu_q, cu_k, taken, scale, window, group,
                       q_blocks, per_head, n_tiles, total_q, stride_qt, stride_qh, stride_ot, stride_oh,
                       WINDOW: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    BLOCK: gl.constexpr = k_desc.block_type.shape[0]
    D: gl.constexpr = k_desc.block_type.shape[1]
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK, D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(k_desc.dtype, [2, BLOCK // 2, D], k_desc.layout)
    ids = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    id_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    id_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
        mbarrier.init(id_full.index(i), count=1)
        mbarrier.init(id_free.index(i), count=2)
    mbarrier.arrive(turn.index(0))  # (the first half goes first)
    common = (k_smem, v_smem, ready, empty, turn, ids, id_full, id_free, out_ptr, o_desc, lse_ptr, n_tiles, cu_q, cu_k,
              scale, window, group, q_blocks, per_head, total_q, stride_qt, stride_qh, stride_ot, stride_oh, WINDOW)
    gl.warp_specialize([
        (_persistent_attend, (0, q_ptr, q_smem.index(0)) + common),
        (_persistent_attend, (1, q_ptr, q_smem.index(1)) + common),
        (_persistent_loads, (k_desc, v_desc, k_smem, v_smem, ready, empty, ids, id_full, id_free, taken, n_tiles,
                             cu_q, cu_k, window, group, q_blocks, per_head, WINDOW)),
    ], [4, 1], [240, 24])


def _constants(form: str, window) -> dict:
    """The kernel's constants for this form, with a window or without (as launched and as compile_sm90 builds it)."""
    return dict(WINDOW=bool(window), STAGES=STAGES, num_warps=FORMS[form])


def descriptor_layout(dtype: torch.dtype):
    """The shared-memory layout a block of BLOCK keys (or values) of a head lands in (wgmma's swizzle)."""
    return gl.NVMMASharedLayout.get_default_for([BLOCK, HEAD], _DTYPES[dtype])


def descriptors(k: torch.Tensor, v: torch.Tensor) -> tuple[TensorDescriptor, TensorDescriptor]:
    """Keys and values as TMA descriptors of their [keys, heads x 128] matrices, read BLOCK keys of a head at a time."""
    layout = descriptor_layout(k.dtype)
    return tuple(TensorDescriptor.from_tensor(x.view(x.shape[0], -1), [BLOCK, HEAD], layout) for x in (k, v))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
              scale: float, window: int | None, form: str = "persistent") -> tuple[torch.Tensor, torch.Tensor]:
    """causal_attention._launch's forward (out, lse; no schedule) by one of FORMS. Heads as `usable` says."""
    t, heads, d = q.shape
    out = torch.empty(t, heads, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(heads, t, dtype=torch.float32, device=q.device)
    k_desc, v_desc = descriptors(k.contiguous(), v.contiguous())
    o_desc = TensorDescriptor.from_tensor(out.view(t, -1), [BLOCK // 2, HEAD], descriptor_layout(q.dtype))
    q_blocks = triton.cdiv(max(max_q, 1), BLOCK)
    common = (scale * math.log2(math.e), window or 0, heads // k.shape[1], q_blocks)
    strides = (t, q.stride(0), q.stride(1), out.stride(0), out.stride(1))
    per_head = q_blocks * (cu_q.shape[0] - 1)
    taken = torch.zeros(1, dtype=torch.int32, device=q.device)  # (the tiles taken so far)
    programs = min(per_head * heads, torch.cuda.get_device_properties(q.device).multi_processor_count)
    _persistent_kernel[(programs,)](q, k_desc, v_desc, out, o_desc, lse, cu_q, cu_k, taken, *common, per_head,
                                    per_head * heads, *strides, **_constants(form, window),
                                    enable_fp_fusion=True)  # (FMAs where the fused tiling has them: its bits)
    return out, lse


def sm90_desc(block: list[int], layout=None) -> str:
    """The type of a bf16 tensor descriptor of this block (by default in wgmma's swizzle for it), for sm90_build."""
    return f"tensordesc<bf16{block},{layout or gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)}>"


def sm90_build(fn, types: dict, const: dict, aligned, fusion: bool, divisible=(), ones=()):
    """A Gluon kernel built for sm_90a here, with no GPU, as Triton's launcher builds it (each Gluon module's
    compile_sm90; benchmarks/compile_sm90.py prints ptxas's registers and spills): its arguments of these types, those
    in `const` constants, those named in `aligned` multiples of 16 (as launched); `divisible` and `ones`: more integer
    arguments built as the launcher builds a multiple of 16 and the value 1 (the batch's sizes,
    tests/test_kernel_builds.py)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    const = {**const, **dict.fromkeys(ones, 1)}
    sig = {n: "constexpr" if n in const else types[n] for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in aligned or n in divisible}
    return triton.compile(GluonASTSource(fn, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=const["num_warps"], enable_fp_fusion=fusion))


def compile_sm90(form: str = "persistent", window: bool = False, divisible: tuple[str, ...] = ("total_q",),
                 ones: tuple[str, ...] = ()):
    """The kernel of this form for bf16 heads built for sm_90a by sm90_build (total_q divisible by 16, as launched)."""
    fn = _persistent_kernel
    types = {n: sm90_desc([BLOCK // 2 if n == "o_desc" else BLOCK, HEAD], descriptor_layout(torch.bfloat16))
             if n.endswith("_desc") else "fp32" if n == "scale" else "*i32" if n.startswith("cu_") or n == "taken"
             else "*fp32" if n == "lse_ptr" else "*bf16" if n.endswith("_ptr") else "i32" for n in fn.arg_names}
    aligned = [n for n in fn.arg_names if n.endswith("_ptr") or n.startswith(("cu_", "stride_"))]
    return sm90_build(fn, types, _constants(form, window), aligned, True, divisible, ones)

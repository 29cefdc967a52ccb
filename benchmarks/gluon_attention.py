"""An experiment for issue 41, not used by the service: the causal varlen attention forward written in Gluon (Triton's
explicit layer) for Hopper, so that the softmax of a key block runs while the tensor cores multiply the previous
block's probabilities by its values. Triton's compiler does not do this for causal_attention.py: it waits for every
wgmma at once (`wgmma.wait_group 0` before each use, in its PTX for sm_90a, also with the query tile split in two
halves whose products could overlap).

Per program: BLOCK_M queries of one segment and head, as causal_attention.py takes them, with its arithmetic in the
fused form (a block's max over its allowed keys times the scale, exp2 of one FMA, masked keys as -inf) and its key
blocks aligned to the segment and walked in order, so a query's bits do not depend on its neighbours or where its
tile starts. Keys and values come by TMA into a ring of STAGES buffers; each block's loop:

    S(j+1) = Q K(j+1)^T   issued
    O += P(j) V(j)        issued
    wait for S(j+1) only; softmax of block j+1 (P(j+1), the new max, alpha)   <- overlaps P(j) V(j)
    wait for O; O *= alpha; refill block j's buffers with block j + STAGES

`gluon_pingpong_kernel` (FA3's other half): the tile's two halves of 64 queries go to two warpgroups of their own,
which take turns issuing their products (two mbarriers), so that one's softmax runs while the other's products do,
and a warp of its own issues the loads (warp_specialize; registers 240 / 24 asked for).

Limits of the experiment: heads of 128 (BLOCK_N = BLOCK_M = 128), bf16, no window, no CUDA-graph schedule (keys
shared ahead of a segment are taken, as causal_attention.py takes them). `python benchmarks/bench_attention.py
--gluon` checks it against causal_attention.py (bits and the float64 oracle's tolerance) and times it;
`compile_sm90()` builds it for sm_90a without a GPU (`python benchmarks/gluon_attention.py`: its waits, 0, 0, 1, 0;
under Triton 3.6, the device's, ptxas gives 225 registers and no spills at 3 stages, 224 KiB of shared memory; 2
stages spill 12 bytes; the pingpong form 168 registers, no spills, 224 KiB). Not yet run on a GPU.
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

BLOCK, STAGES, WARPS = 128, 3, 8
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # (Triton 3.6's name; 3.9 renamed it)


@gluon.jit
def _block_softmax(s, m_i, l_i, n, whole, pos, n_k, scale, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """Keys n .. n + BLOCK_N - 1 of the segment (scores s): probabilities, the new max and sum, alpha."""
    if n >= whole:  # (the diagonal's blocks and the segment's end)
        keys = n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        allowed = (keys[None, :] <= pos[:, None]) & (keys < n_k)[None, :]
        s = gl.where(allowed, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * scale)
    p = gl.exp2(s * scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _load_block(k_desc, v_desc, bars, k_smem, v_smem, b, nb, k0, col, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Block b's keys and values into buffer b % STAGES (nothing past the last block)."""
    st = b % STAGES
    ok = b < nb
    mbarrier.expect(bars.index(st), 2 * k_desc.block_type.nbytes, pred=ok)
    _tma_load(k_desc, [k0 + b * BLOCK_N, col], bars.index(st), k_smem.index(st), pred=ok)
    _tma_load(v_desc, [k0 + b * BLOCK_N, col], bars.index(st), v_smem.index(st), pred=ok)


@gluon.jit
def gluon_attention_kernel(q_ptr, k_desc, v_desc, out_ptr, lse_ptr, cu_q, cu_k, scale, group, q_blocks, total_q,
                           stride_qt, stride_qh, stride_ot, stride_oh, D: gl.constexpr, STAGES: gl.constexpr,
                           num_warps: gl.constexpr):
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = BLOCK_N
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows_of: gl.constexpr = gl.SliceLayout(1, mma)
    io: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])

    segment = gl.program_id(0) // q_blocks
    block = q_blocks - 1 - gl.program_id(0) % q_blocks  # (the last blocks, the most keys, start first)
    head = gl.program_id(1)
    q0 = gl.load(cu_q + segment)
    n_q = gl.load(cu_q + segment + 1) - q0
    m0 = block * BLOCK_M
    if m0 < n_q:
        k0 = gl.load(cu_k + segment)
        n_k = gl.load(cu_k + segment + 1) - k0
        before = n_k - n_q
        end = gl.minimum(n_k, before + m0 + BLOCK_M)
        whole = (before + m0 + 1) // BLOCK_N * BLOCK_N  # (blocks below it: every query of the tile sees them whole)
        nb = (end + BLOCK_N - 1) // BLOCK_N
        col = (head // group) * D

        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, D], v_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        for i in gl.static_range(STAGES):
            _load_block(k_desc, v_desc, bars, k_smem, v_smem, i, nb, k0, col, BLOCK_N, STAGES)

        rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, io))
        d = gl.arange(0, D, layout=gl.SliceLayout(0, io))
        at = (q0 + rows).to(gl.int64)
        q = gl.load(q_ptr + at[:, None] * stride_qt + head * stride_qh + d[None, :], mask=(rows < n_q)[:, None],
                    other=0.0)
        q_smem = gl.allocate_shared_memory(q.dtype, [BLOCK_M, D], k_desc.layout, q)
        fence_async_shared()

        pos = before + m0 + gl.arange(0, BLOCK_M, layout=rows_of)
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
        mbarrier.wait(bars.index(0), 0)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        m_i = gl.full([BLOCK_M], -1.0e38, gl.float32, rows_of)  # (finite: a block it sees nothing of changes nothing)
        l_i = gl.zeros([BLOCK_M], gl.float32, rows_of)
        p, m_i, l_i, alpha = _block_softmax(s, m_i, l_i, 0, whole, pos, n_k, scale, BLOCK_N, mma)
        acc = gl.zeros([BLOCK_M, D], gl.float32, mma)
        for j in range(0, nb - 1):
            nxt = j + 1
            mbarrier.wait(bars.index(nxt % STAGES), (nxt // STAGES) & 1)
            s = warpgroup_mma(q_smem, k_smem.index(nxt % STAGES).permute((1, 0)), zero, use_acc=False, is_async=True)
            p_op = gl.convert_layout(p.to(q.dtype), operand)
            acc = warpgroup_mma(p_op, v_smem.index(j % STAGES), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s,))  # (this block's scores; the values' product goes on)
            p, m_i, l_i, alpha = _block_softmax(s, m_i, l_i, nxt * BLOCK_N, whole, pos, n_k, scale, BLOCK_N, mma)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
            acc = acc * alpha[:, None]
            _load_block(k_desc, v_desc, bars, k_smem, v_smem, j + STAGES, nb, k0, col, BLOCK_N, STAGES)
        p_op = gl.convert_layout(p.to(q.dtype), operand)
        acc = warpgroup_mma(p_op, v_smem.index((nb - 1) % STAGES), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        out = gl.convert_layout((acc / l_i[:, None]).to(q.dtype), io)
        gl.store(out_ptr + at[:, None] * stride_ot + head * stride_oh + d[None, :], out, mask=(rows < n_q)[:, None])
        lse_rows = m0 + gl.arange(0, BLOCK_M, layout=rows_of)
        gl.store(lse_ptr + head.to(gl.int64) * total_q + q0 + lse_rows, (m_i + gl.log2(l_i)) * 0.6931471805599453,
                 mask=lse_rows < n_q)


@gluon.jit
def _pp_producer(k_desc, v_desc, k_smem, v_smem, ready, empty, nb, k0, col):
    """The pingpong kernel's loads (one warp): block b into buffer b % STAGES once both halves released its last.
    (A partition's arguments arrive as values: sizes come from the buffers' shapes.)"""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_smem.shape[0]
    for b in range(nb):
        st = b % STAGES
        mbarrier.wait(empty.index(st), ((b // STAGES) & 1) ^ 1)  # (a fresh barrier's previous phase: passes)
        mbarrier.expect(ready.index(st), 2 * k_desc.block_type.nbytes)
        _tma_load(k_desc, [k0 + b * BLOCK_N, col], ready.index(st), k_smem.index(st))
        _tma_load(v_desc, [k0 + b * BLOCK_N, col], ready.index(st), v_smem.index(st))


@gluon.jit
def _pp_consumer(half, q_ptr, q_smem, k_smem, v_smem, ready, empty, turn, out_ptr, lse_ptr, q0, n_q, m0, n_k, nb,
                 whole, scale, head, total_q, stride_qt, stride_qh, stride_ot, stride_oh):
    """One warpgroup's half of the tile (rows m0 + half * HALF ..): the loop of gluon_attention_kernel, its products
    issued in turns with the other half's (so that one's softmax runs while the other's products do)."""
    HALF: gl.constexpr = q_smem.shape[0]
    D: gl.constexpr = q_smem.shape[1]
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows_of: gl.constexpr = gl.SliceLayout(1, mma)
    io: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    if nb > 0:
        r0 = m0 + half * HALF
        rows = r0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, io))
        d = gl.arange(0, D, layout=gl.SliceLayout(0, io))
        at = (q0 + rows).to(gl.int64)
        q = gl.load(q_ptr + at[:, None] * stride_qt + head * stride_qh + d[None, :], mask=(rows < n_q)[:, None],
                    other=0.0)
        q_smem.store(q)
        fence_async_shared()
        pos = n_k - n_q + r0 + gl.arange(0, HALF, layout=rows_of)
        zero = gl.zeros([HALF, BLOCK_N], gl.float32, mma)
        mbarrier.wait(ready.index(0), 0)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        m_i = gl.full([HALF], -1.0e38, gl.float32, rows_of)
        l_i = gl.zeros([HALF], gl.float32, rows_of)
        p, m_i, l_i, alpha = _block_softmax(s, m_i, l_i, 0, whole, pos, n_k, scale, BLOCK_N, mma)
        acc = gl.zeros([HALF, D], gl.float32, mma)
        for j in range(0, nb - 1):
            nxt = j + 1
            mbarrier.wait(ready.index(nxt % STAGES), (nxt // STAGES) & 1)
            mbarrier.wait(turn.index(half), j & 1)  # this half's turn on the tensor cores
            s = warpgroup_mma(q_smem, k_smem.index(nxt % STAGES).permute((1, 0)), zero, use_acc=False, is_async=True)
            p_op = gl.convert_layout(p.to(q.dtype), operand)
            acc = warpgroup_mma(p_op, v_smem.index(j % STAGES), acc, is_async=True)
            mbarrier.arrive(turn.index(1 - half))  # the other half's turn
            s = warpgroup_mma_wait(1, deps=(s,))
            p, m_i, l_i, alpha = _block_softmax(s, m_i, l_i, nxt * BLOCK_N, whole, pos, n_k, scale, BLOCK_N, mma)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
            mbarrier.arrive(empty.index(j % STAGES))  # (this half is done with block j)
            acc = acc * alpha[:, None]
        p_op = gl.convert_layout(p.to(q.dtype), operand)
        acc = warpgroup_mma(p_op, v_smem.index((nb - 1) % STAGES), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        mbarrier.arrive(empty.index((nb - 1) % STAGES))
        # (stored from the product's layout: a change of layout takes shared memory, which the buffers fill)
        out_rows = r0 + gl.arange(0, HALF, layout=rows_of)
        out_at = (q0 + out_rows).to(gl.int64)
        d_out = gl.arange(0, D, layout=gl.SliceLayout(0, mma))
        gl.store(out_ptr + out_at[:, None] * stride_ot + head * stride_oh + d_out[None, :],
                 (acc / l_i[:, None]).to(q.dtype), mask=(out_rows < n_q)[:, None])
        gl.store(lse_ptr + head.to(gl.int64) * total_q + out_at, (m_i + gl.log2(l_i)) * 0.6931471805599453,
                 mask=out_rows < n_q)


@gluon.jit
def gluon_pingpong_kernel(q_ptr, k_desc, v_desc, out_ptr, lse_ptr, cu_q, cu_k, scale, group, q_blocks, total_q,
                          stride_qt, stride_qh, stride_ot, stride_oh, D: gl.constexpr, STAGES: gl.constexpr,
                          num_warps: gl.constexpr):
    """gluon_attention_kernel's tile in two halves of 64 queries, one warpgroup each, taking turns on the tensor
    cores (FA3's pingpong), with a warp of their own for the loads (num_warps = 4: the first half's warpgroup)."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    HALF: gl.constexpr = BLOCK_N // 2
    segment = gl.program_id(0) // q_blocks
    block = q_blocks - 1 - gl.program_id(0) % q_blocks
    head = gl.program_id(1)
    q0 = gl.load(cu_q + segment)
    n_q = gl.load(cu_q + segment + 1) - q0
    k0 = gl.load(cu_k + segment)
    n_k = gl.load(cu_k + segment + 1) - k0
    m0 = block * BLOCK_N
    end = gl.minimum(n_k, n_k - n_q + m0 + BLOCK_N)
    whole = (n_k - n_q + m0 + 1) // BLOCK_N * BLOCK_N
    nb = (end + BLOCK_N - 1) // BLOCK_N * (m0 < n_q).to(gl.int32)  # (no blocks: a tile past the segment's end)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(k_desc.dtype, [2, HALF, D], k_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    mbarrier.arrive(turn.index(0))  # (the first half goes first)
    common = (ready, empty, turn, out_ptr, lse_ptr, q0, n_q, m0, n_k, nb, whole, scale, head, total_q, stride_qt,
              stride_qh, stride_ot, stride_oh)
    gl.warp_specialize([
        (_pp_consumer, (0, q_ptr, q_smem.index(0), k_smem, v_smem) + common),
        (_pp_consumer, (1, q_ptr, q_smem.index(1), k_smem, v_smem) + common),
        (_pp_producer, (k_desc, v_desc, k_smem, v_smem, ready, empty, nb, k0, (head // group) * D)),
    ], [4, 1], [240, 24])


def _descriptors(k, v):
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK, k.shape[-1]], gl.bfloat16)
    return (TensorDescriptor.from_tensor(x.view(x.shape[0], -1), [BLOCK, x.shape[-1]], layout) for x in (k, v))


def attention(q, k, v, cu_q, cu_k, max_q: int, scale: float | None = None, stages: int = STAGES,
              pingpong: bool = False):
    """causal_attention.causal_attention's forward (no window, no plan) by the Gluon kernel (or its pingpong form):
    (out, lse)."""
    t, heads, d = q.shape
    if d != BLOCK or q.dtype != torch.bfloat16:
        raise ValueError(f"the experiment takes bf16 heads of {BLOCK}, got {q.dtype} heads of {d}")
    scale = d**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    lse = torch.empty(heads, t, dtype=torch.float32, device=q.device)
    k_desc, v_desc = _descriptors(k.contiguous(), v.contiguous())
    q_blocks = triton.cdiv(max(max_q, 1), BLOCK)
    kernel = gluon_pingpong_kernel if pingpong else gluon_attention_kernel
    kernel[(q_blocks * (cu_q.shape[0] - 1), heads)](
        q, k_desc, v_desc, out, lse, cu_q, cu_k, scale * math.log2(math.e), heads // k.shape[1], q_blocks, t,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), D=d, STAGES=stages, num_warps=4 if pingpong else WARPS)
    return out, lse


def compile_sm90(stages: int = STAGES, pingpong: bool = False):
    """The kernel built for sm_90a here (no GPU needed): Triton's compiled kernel (asm, metadata)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    layout = gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], gl.bfloat16)
    desc = f"tensordesc<bf16[{BLOCK}, {BLOCK}],{layout}>"
    fn = gluon_pingpong_kernel if pingpong else gluon_attention_kernel
    warps = 4 if pingpong else WARPS
    const = dict(D=BLOCK, STAGES=stages, num_warps=warps)
    sig = {n: "constexpr" if n in const else desc if n.endswith("_desc") else "fp32" if n == "scale"
           else "*i32" if n.startswith("cu_") else "*fp32" if n == "lse_ptr" else "*bf16" if n.endswith("_ptr")
           else "i32" for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n.endswith("_ptr") or n.startswith(("cu_", "stride_")) or n == "total_q"}
    return triton.compile(GluonASTSource(fn, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, enable_fp_fusion=True))


if __name__ == "__main__":
    import re

    for pingpong in (False, True):
        compiled = compile_sm90(pingpong=pingpong)
        ptx = compiled.asm["ptx"]
        print("pingpong" if pingpong else "one warp group pair", "wgmma waits:",
              re.findall(r"wgmma.wait_group.sync.aligned\s+(\d+)", ptx), "wgmma:",
              len(re.findall(r"wgmma.mma_async", ptx)), "shared bytes:", compiled.metadata.shared)

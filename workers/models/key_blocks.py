"""Which key blocks a tile of causal attention reads, for both kernels that walk them (causal_attention.py's Triton
kernel and hopper_attention.py's Gluon kernels, which call this Triton function), so that they read the same blocks
and a query's bits do not depend on which of them ran. A tile is BLOCK_M queries of one segment; its keys are read
in blocks of BLOCK_N counted from the segment's first key, in increasing order."""

import triton
import triton.language as tl


@triton.jit
def tile_span(cu_q, cu_k, segment, block, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              WINDOW: tl.constexpr):
    """Where tile `block` of a segment reads: the segment's first query and query count, its first key and key count,
    the tile's first query (at or past the count: nothing to do), the first key of the blocks it reads, the first it
    masks (before it, every query of the tile sees whole blocks), and the end of its keys."""
    q0 = tl.load(cu_q + segment)
    n_q = tl.load(cu_q + segment + 1) - q0
    k0 = tl.load(cu_k + segment)
    n_k = tl.load(cu_k + segment + 1) - k0
    m0 = block * BLOCK_M
    before = n_k - n_q  # keys ahead of the first query (a shared prefix)
    end = tl.minimum(n_k, before + m0 + BLOCK_M)
    if WINDOW:  # every block masked
        start = tl.maximum(before + m0 - window + 1, 0) // BLOCK_N * BLOCK_N
        whole = start
    else:  # blocks every query of the tile sees whole, then the diagonal's
        start = 0
        whole = (before + m0 + 1) // BLOCK_N * BLOCK_N
    return q0, n_q, k0, n_k, m0, start, whole, end

"""The decoder body as CUDA graphs, one per bucket of row length, for the rows a worker lays out in pieces.

Launching a forward of the 28-layer 1.5B shape costs the host 25-40 ms (~450 kernels, ~2,600 torch operators),
as long as its kernels take for 4k tokens (BENCHMARKS.md, "A small step's host launch"); a graph replays them in one
launch. A row of R tokens runs the graph of the least bucket B >= R: its tokens, then a filler segment of B - R rows
that attends only to itself, as the filler that brings a short row to MIN_TOKENS does (a row's results do not depend
on the rows beside it: docs/exactness.md). The attention's tiles come from a schedule computed in the graph from the
row's segment offsets (causal_attention.schedule), so that its grid does not change with the row. Buckets are 1/8
apart (at most 12.5% of a forward is filler). The graphs share one memory pool and one set of input and output
buffers: a row fills them, replays and copies its hidden states out under one lock, so rows from several threads
cannot mix.

Rows it cannot take run as before: shared-prefix keys (their gathered keys vary in length), a gradient, other
outputs asked of the body, more tokens than the largest bucket. The largest bucket is also bounded by the body's
cost: past GRAPH_FLOP a row's kernels take long enough to hide its launch, and the filler costs more than a graph
saves (the 7B shape's mixed rollouts in rows of 16,384: 41.1k tokens/s with graphs of every bucket, 42.0k without).
"""

from __future__ import annotations

import logging
import threading

import torch
from torch import Tensor, nn

from ..request import MAX_TOKENS_PER_BATCH
from ..sharding import head_dim, held_shard
from . import causal_attention, varlen_attention

log = logging.getLogger(__name__)

MIN_BUCKET = 128
MAX_BUCKET = MAX_TOKENS_PER_BATCH  # (a worker's default row: 16,896 tokens)
# the largest body forward given a graph, in FLOP (2 x body parameters x tokens): ~90 ms at 500 TFLOP/s, where
# launching one by kernels costs the host 25-40 ms; rows up to ~17k tokens of the 1.5B shape, ~3.4k of the 7B
GRAPH_FLOP = 4.5e13


def buckets(limit: int) -> list[int]:
    """Row lengths with a graph, up to `limit` (at most MAX_BUCKET): from MIN_BUCKET, each 1/8 of the last power of
    two above the one before (128, 256, ..., 1024, 1152, ..., 2048, 2304, ...)."""
    sizes, size = [], MIN_BUCKET
    while size < min(limit, MAX_BUCKET):
        sizes.append(size)
        size += max(MIN_BUCKET, 1 << (size.bit_length() - 4))
    return [*sizes, min(limit, MAX_BUCKET)] if limit >= MIN_BUCKET else []


def graph_tokens(model: nn.Module) -> int:
    """The longest row worth a graph for this model's body (GRAPH_FLOP; embeddings are not computed)."""
    body = sum(p.numel() for name, p in model.base_model.named_parameters() if "embed" not in name)
    return int(GRAPH_FLOP / (2 * max(body, 1)))


def capturable(model: nn.Module) -> str | None:
    """Why this model's body cannot be captured (or None): it must attend through our varlen kernel, on CUDA, and
    sync with the host nowhere."""
    device = next(model.parameters()).device
    if not varlen_attention.supported(model, device):
        return "its attention is not our varlen kernel's"
    if head_dim(model.config) > causal_attention.MAX_HEAD:
        return f"its heads are over {causal_attention.MAX_HEAD} elements (FlashAttention's kernel, sized on the host)"
    if held_shard(model) is not None:
        return "it is a tensor-parallel rank"
    if any(getattr(model.config, name, None) for name in ("num_experts", "num_local_experts", "n_routed_experts")):
        return "its experts are sized on the host"
    return None


class BodyGraphs:
    """The body of `model` (patched) as graphs of rows up to `limit` tokens, captured as first needed (or by
    capture_all)."""

    def __init__(self, model: nn.Module, limit: int) -> None:
        self.model = model
        self.sizes = buckets(min(limit, graph_tokens(model)))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.failed: str | None = None  # why a capture failed: no graph is tried again
        self.replays = 0
        self.lock = threading.Lock()
        device = next(model.parameters()).device
        size = self.sizes[-1] if self.sizes else 0
        self.ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.cu = torch.zeros(size + 2, dtype=torch.int32, device=device)  # (at most one segment a token, filler)
        self.hidden = torch.empty(size, model.config.hidden_size, dtype=next(model.parameters()).dtype,
                                  device=device)
        self.block = causal_attention.block_m(head_dim(model.config), self.hidden.dtype, device)
        self.pool = torch.cuda.graph_pool_handle()

    def bucket(self, tokens: int) -> int | None:
        return next((b for b in self.sizes if b >= tokens), None)

    def body(self, ids: Tensor, positions: Tensor, cu_q: Tensor) -> Tensor | None:
        """The body's last hidden states [R, H] of one row (ids, positions [R]; segments cu_q [S + 1], ending at R),
        from its bucket's graph; None where there is no graph for it."""
        size = self.bucket(ids.shape[0])
        if size is None or self.failed:
            return None
        with self.lock:
            graph = self.graphs.get(size) or self._capture(size)
            if graph is None:
                return None
            self._fill(ids, positions, cu_q, size)
            graph.replay()
            self.replays += 1
            return self.hidden[: ids.shape[0]].clone()  # (the next replay writes the buffer again)

    def capture_all(self) -> None:
        """Captures every bucket's graph (largest first: the smaller reuse its memory)."""
        with self.lock:
            for size in reversed(self.sizes):
                if size not in self.graphs and self._capture(size) is None:
                    return

    def _fill(self, ids: Tensor, positions: Tensor, cu_q: Tensor, size: int) -> None:
        """The inputs of a row in the buffers: its tokens, then filler (whatever ids and positions a row left there:
        valid ones, whose results no real row sees) as one more segment, and empty segments after it."""
        real = ids.shape[0]
        self.ids[:real].copy_(ids)
        self.positions[:real].copy_(positions)
        self.cu[: size + 2].fill_(size)
        self.cu[: cu_q.shape[0]].copy_(cu_q)

    def _run(self, size: int) -> None:
        cu = self.cu[: size + 2]
        plan = causal_attention.schedule(cu, self.block, size // self.block + size + 2)
        body = self.model.base_model(input_ids=self.ids[None, :size], position_ids=self.positions[None, :size],
                                     cu_seq_lens=cu, max_length=size, attention_plan=plan, use_cache=False)
        self.hidden[:size].copy_(body.last_hidden_state[0])

    def _capture(self, size: int) -> torch.cuda.CUDAGraph | None:
        # a row of one sequence of `size` tokens to capture with (the contents are the next replay's, not baked in;
        # positions 0, valid for any model, as any a real row leaves behind for the filler)
        self.positions[:size].zero_()
        self.cu[: size + 2].fill_(size)
        self.cu[0] = 0
        attn = self.model.config._attn_implementation
        self.model.config._attn_implementation = varlen_attention.NAME
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # (compiles the kernels, warms cuBLAS outside the capture)
                self._run(size)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self._run(size)
        except RuntimeError as e:
            self.failed = str(e).splitlines()[0]
            log.warning("the body of %s runs without CUDA graphs: capturing it failed (%s)",
                        type(self.model).__name__, self.failed)
            return None
        finally:
            self.model.config._attn_implementation = attn
        self.graphs[size] = graph
        torch.cuda.empty_cache()  # (the warm-up's activations, cached for the side stream, which nothing else uses)
        return graph


def use_graphs(model: nn.Module, limit: int) -> BodyGraphs | None:
    """Graphs of this patched model's body for rows up to `limit` tokens, where it can have them (else None,
    logged): the model's forward takes them as `body_graphs`."""
    why = capturable(model)
    if why is not None:
        log.info("the body of %s runs without CUDA graphs: %s", type(model).__name__, why)
        return None
    return BodyGraphs(model, limit)

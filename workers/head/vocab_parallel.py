"""The fused head over a vocabulary split across the ranks of a process group (tensor parallelism).

Rank r holds weight rows [start_r, start_r + V_r) (`torch.tensor_split(torch.arange(V), N)[r]`, or any split in
rank order); hidden states and labels (global ids) are the same on every rank. Each rank runs the single-device
head (either backend) on its rows, labels outside them marked "elsewhere", and gets per token its own lse_r, its
own mean logit mu_r = sum_j p_j z_j over its rows (= lse_r - entropy_r) and, on the rank holding the label, z_label.
One all_gather of these three floats per token, combined on every rank in rank order (the same bits whatever the
batch, and on every rank):
  lse = logsumexp_r(lse_r),  log_prob = z_label - lse,  entropy = lse - sum_r exp(lse_r - lse) * mu_r.
No [N, V] logits and no weight move between ranks. Backward: each rank runs the single-device backward on its rows
with the global lse and entropy (which is all its d_logits need), then d_hidden is summed over the group
(`sum_over`): it comes back whole on every rank; d_weight is this rank's rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..distributed import gather_rows, sum_over
from ..outputs import OUTPUTS
from .backends import HeadOptions, backend_backward, backend_forward
from .torch_log_probs import Extras, order_keys

# label markers inside a rank's call: never a row index, never the caller's ignore_index (translated to _IGNORED)
_IGNORED, _ELSEWHERE = -2, -1


def vocab_split(weight: Tensor, group) -> tuple[int, int]:
    """(this rank's first global row, V) from every rank's row count, in rank order."""
    sizes = gather_rows(torch.tensor([weight.shape[0]], device=weight.device), group)[:, 0].tolist()
    return sum(sizes[: group.rank()]), sum(sizes)


def _local_labels(labels: Tensor, ignore_index: int, start: int, rows: int) -> Tensor:
    local = labels - start
    local = torch.where((local >= 0) & (local < rows), local, _ELSEWHERE)
    return torch.where(labels == ignore_index, _IGNORED, local)


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, opts: HeadOptions, group,
                start: int, candidates: Tensor | None):
        ctx.set_materialize_grads(False)
        local = _local_labels(labels, opts.ignore_index, start, weight.shape[0])
        mine = None
        if candidates is not None:  # (a candidate of another rank's rows: -1, none here)
            mine = torch.where((candidates >= start) & (candidates < start + weight.shape[0]), candidates - start, -1)
        lp_r, ent_r, lse_r, extras = backend_forward(hidden, weight, local, inv_temp, opts, ignore_index=_IGNORED,
                                                     candidates=mine)
        here = local >= 0
        z_label = torch.where(here, lp_r + lse_r, 0.0)  # (elsewhere, lp_r is not defined: never used)
        mu = lse_r - ent_r if ent_r is not None else torch.zeros_like(lse_r)
        every = gather_rows(torch.stack([lse_r, mu, z_label]), group)  # [world, 3, N]
        lse = torch.logsumexp(every[:, 0], dim=0)
        ignored = labels == opts.ignore_index
        log_probs = torch.where(ignored, 0.0, every[:, 2].sum(0) - lse)
        entropy = None
        if opts.compute_entropy:
            mean = (torch.exp(every[:, 0] - lse) * every[:, 1]).sum(0)  # sum_j p_j z_j over the whole vocabulary
            entropy = torch.where(ignored, 0.0, lse - mean)
        ctx.save_for_backward(hidden, weight, local, inv_temp, lse, entropy)
        ctx.opts, ctx.group = opts, group
        more = _merged_extras(extras, lse_r, lse, ignored, start, mine, group, opts.top_k)
        ctx.mark_non_differentiable(*(t for t in more if t is not None))
        return log_probs, entropy, *more

    @staticmethod
    def backward(ctx, grad_log_probs: Tensor | None, grad_entropy: Tensor | None, *_):
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        if (grad_log_probs is None and grad_entropy is None) or not (need_hidden or need_weight):
            return (None,) * 8
        ## NB: every rank computes d_hidden (its part) even when only the weight needs a gradient here, since the
        # all_reduce below must be entered by all ranks alike.
        d_hidden, d_weight = backend_backward(ctx.saved_tensors, grad_log_probs, grad_entropy, ctx.opts,
                                              ignore_index=_IGNORED, need_hidden=True, need_weight=need_weight)
        summed = sum_over(d_hidden.float(), ctx.group)
        return summed.to(d_hidden.dtype) if need_hidden else None, d_weight, None, None, None, None, None, None


def _merged_extras(extras, lse_r: Tensor, lse: Tensor, ignored: Tensor, start: int, mine: Tensor | None, group,
                   k: int) -> tuple:
    """Every rank's top lists and candidates merged alike on every rank: each rank's k most likely (logits
    rebuilt as log-prob + its lse, ids made global), the k largest of them in rank order with ties to the lower id,
    the rest and every rank's tail into the tail; a candidate's logit from the rank holding it. In the order of the
    per-token outputs' table (None where not asked for); a row that brings its own computation is refused: its
    values over part of the vocabulary would need a merge of their own."""
    own = [name for name in extras if OUTPUTS[name].torch is not None]
    if own:
        raise ValueError(f"the output {own[0]!r} is computed by the torch backend on one device, not split by "
                         "vocabulary")
    top_lp = top_ids = tail = cands = None
    if k:
        top_z = extras.top_log_probs + lse_r[:, None]
        ids = torch.where(extras.top_ids >= 0, extras.top_ids + start, 0)
        tail_lse = extras.tail_log_prob + lse_r
        every_z, every_ids = gather_rows(top_z, group), gather_rows(ids, group)  # [world, N, k]
        every_tail = gather_rows(tail_lse, group)  # [world, N]
        z = every_z.permute(1, 0, 2).reshape(lse.shape[0], -1)  # [N, world * k], rank order
        all_ids = every_ids.permute(1, 0, 2).reshape(lse.shape[0], -1)
        keys = order_keys(z, all_ids)
        _, at = torch.topk(keys, k, dim=-1)
        top_ids = all_ids.gather(-1, at)
        top_lp = z.gather(-1, at) - lse[:, None]
        rest = z.scatter(-1, at, float("-inf"))
        tail = torch.logsumexp(torch.cat([every_tail.T, rest], dim=-1), dim=-1) - lse
        top_lp = torch.where(ignored[:, None], 0.0, top_lp)
        top_ids = torch.where(ignored[:, None], -1, top_ids)
        tail = torch.where(ignored, 0.0, tail)
    if mine is not None:
        z_c = torch.where(mine >= 0, extras.candidate_log_probs + lse_r[:, None], 0.0)
        cands = torch.where(ignored[:, None], 0.0, sum_over(z_c, group) - lse[:, None])
    merged = Extras(top_log_probs=top_lp, top_ids=top_ids, tail_log_prob=tail, candidate_log_probs=cands)
    return merged.values_in_order()


def vocab_parallel_log_probs(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, opts: HeadOptions,
                             group, start: int, candidates: Tensor | None = None) -> tuple:
    """Flattened inputs as `_FusedLogProbs` takes them, this rank's weight rows starting at global row `start`:
    (log_probs, entropy, top log-probs, top ids, tail, candidates' log-probs), the last four None unless asked."""
    return _VocabParallelLogProbs.apply(hidden, weight, labels, inv_temp, opts, group, start, candidates)

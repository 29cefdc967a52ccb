"""Collectives over a process group, used by the vocab-parallel head, the tensor-parallel model and a worker's
ranks: each element's bits are the same wherever it sits in a tensor, so results stay batch invariant."""

from __future__ import annotations

import torch
from torch import Tensor


## NB: collectives go through the group object's own methods, so that a group made outside torch.distributed's
# registry (a worker's, transfer.open_group) serves as well as one from init_process_group / new_group.
def gather_rows(x: Tensor, group) -> Tensor:
    """[k, N] from every rank -> [world, k, N]."""
    parts = [torch.empty_like(x) for _ in range(group.size())]
    group.allgather([parts], [x.contiguous()]).wait()
    return torch.stack(parts)


def sum_over(x: Tensor, group) -> Tensor:
    """x summed over the group, in place, each element's bits the same wherever it sits in x. Two ranks: one
    all_reduce (one addition, a + b = b + a). More: a ring all_reduce adds an element's parts in an order that
    depends on its place in the buffer (so on the other rows of the batch); instead every rank gathers all the
    parts and adds them in rank order, in float32, rounded once (N - 1 times x's bytes received, against about
    twice for an all_reduce)."""
    if group.size() <= 2:
        group.allreduce([x]).wait()
        return x
    parts = gather_rows(x, group)
    total = parts[0].float()
    for part in parts[1:]:
        total += part
    return x.copy_(total)

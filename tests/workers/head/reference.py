"""A float64 oracle for the head: the naive full-logits computation, differentiable by autograd."""

import numpy as np
import torch
from torch import Tensor


def reference_log_probs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: float | Tensor = 1.0,
    ignore_index: int = -100,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """(log_probs, entropy) in float64, from hidden and weight upcast to float64 (gradients flow to both)."""
    h = hidden.to(torch.float64) if hidden.dtype != torch.float64 else hidden
    w = weight.to(torch.float64) if weight.dtype != torch.float64 else weight
    t = temperature.to(torch.float64)[..., None] if isinstance(temperature, Tensor) else float(temperature)
    logits = h @ w.T  # [..., V]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / t
    log_p = torch.log_softmax(logits, dim=-1)
    ignored = labels == ignore_index
    picked = log_p.gather(-1, labels.masked_fill(ignored, 0)[..., None])[..., 0]
    entropy = -(log_p.exp() * log_p).sum(-1)
    return picked.masked_fill(ignored, 0.0), entropy.masked_fill(ignored, 0.0)


INTERPRETED_ULPS = 16


def assert_same_bits(got: Tensor, want: Tensor, interpreted: bool) -> None:
    """Bitwise, where batch invariance is promised (compiled kernels, the torch backend). Under the Triton
    interpreter `tl.dot` is numpy's matmul, and OpenBLAS sums a row in another order by its place in the matrix
    (on this project's AMD EPYC machines, rows 6-11 and 18-31 of a 32-row tile in its Haswell sgemm kernels), which
    reaches a few float32 ulps of the sums' scale (8 of the values near 0 after a log-sum-exp over the vocabulary),
    so there the promise is a value within INTERPRETED_ULPS ulps of the other's magnitude, at least 1."""
    if not interpreted:
        assert torch.equal(got, want), (got - want).abs().max()
        return
    got, want = got.float().cpu(), want.float().cpu()
    ulp = torch.from_numpy(np.spacing(np.maximum(np.maximum(got.abs().numpy(), want.abs().numpy()), 1.0)))
    assert ((got - want).abs() <= INTERPRETED_ULPS * ulp).all(), (got - want).abs().max()

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


def assert_same_bits(got: Tensor, want: Tensor, interpreted: bool) -> None:
    """Bitwise, where batch invariance is promised (compiled kernels, the torch backend). Under the Triton
    interpreter `tl.dot` is numpy's matmul, and OpenBLAS's FMA kernels may sum a row in another order for another
    row count (seen on AMD EPYC), so there the promise is a value within one float32 ulp of the other."""
    if not interpreted:
        assert torch.equal(got, want), (got - want).abs().max()
        return
    ulp = torch.from_numpy(np.spacing(np.maximum(got.abs().cpu().numpy(), want.abs().cpu().numpy())))
    assert ((got - want).abs().cpu() <= ulp).all(), (got - want).abs().max()

"""The head's options and its two backends (torch: chunked matmuls; triton: the fused kernels), chosen in
`resolve_backend` alone; the single-device head and the vocab-parallel head both run them through here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..outputs import asked
from .torch_log_probs import Extras, torch_log_probs_backward, torch_log_probs_forward

Backend = Literal["auto", "torch", "triton"]


@dataclass(frozen=True)
class HeadOptions:
    backend: Literal["torch", "triton"]
    ignore_index: int = -100
    compute_entropy: bool = True
    chunk_size: int = 512  # tokens per chunk of the torch backend
    softcap: float | None = None  # final-logit softcapping: logits -> softcap * tanh(logits / softcap)
    top_k: int = 0  # the k most likely tokens of each position, with the tail's mass (Extras)


def resolve_backend(backend: str, device: torch.device) -> Literal["torch", "triton"]:
    """"auto" is Triton on CUDA and torch elsewhere. Triton on the CPU needs TRITON_INTERPRET=1."""
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "torch":
        return "torch"
    if backend == "triton":
        from .triton_log_probs_forward import interpreting

        if device.type != "cuda" and not interpreting():
            raise ValueError(
                f"backend='triton' needs CUDA tensors (got {device.type}); use backend='torch' or 'auto', "
                "or set TRITON_INTERPRET=1 before importing ppo_logprobs to run the kernel on the CPU"
            )
        return "triton"
    raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")


def backend_forward(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, opts: HeadOptions, *,
                    ignore_index: int, candidates: Tensor | None = None
                    ) -> tuple[Tensor, Tensor | None, Tensor, Extras]:
    """The chosen backend's forward on flattened inputs: (log_probs, entropy or None, lse, Extras)."""
    kwargs = dict(ignore_index=ignore_index, compute_entropy=opts.compute_entropy, softcap=opts.softcap,
                  top_k=opts.top_k, candidates=candidates)
    own = [o.name for o in asked(opts.top_k, 0 if candidates is None else candidates.shape[1]) if o.torch]
    if opts.backend == "triton" and own:
        raise ValueError(f"the output {own[0]!r} has no Triton kernel: ask for it with backend='torch'")
    if opts.backend == "triton":
        from .triton_log_probs_forward import triton_log_probs_forward

        return triton_log_probs_forward(hidden, weight, labels, inv_temp, **kwargs)
    return torch_log_probs_forward(hidden, weight, labels, inv_temp, chunk_size=opts.chunk_size, **kwargs)


def backend_backward(saved: tuple[Tensor, ...], grad_log_probs: Tensor | None, grad_entropy: Tensor | None,
                     opts: HeadOptions, *, ignore_index: int, need_hidden: bool, need_weight: bool
                     ) -> tuple[Tensor | None, Tensor | None]:
    """The chosen backend's backward; `saved` is (hidden, weight, labels, inv_temp, lse, entropy)."""
    kwargs = dict(ignore_index=ignore_index, need_hidden=need_hidden, need_weight=need_weight, softcap=opts.softcap)
    args = (*saved, grad_log_probs, grad_entropy)
    if opts.backend == "triton":
        from .triton_log_probs_backward import triton_log_probs_backward

        return triton_log_probs_backward(*args, **kwargs)
    return torch_log_probs_backward(*args, chunk_size=opts.chunk_size, **kwargs)

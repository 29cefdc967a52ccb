"""GPU-side pieces: the fused log-prob head, patched HuggingFace models, and the Ray workers that hold them."""

from .head import FusedLinearForPPO, HeadOptions, fused_log_probs, resolve_backend
from .models import CausalLMOutputForPPO, load_model, patch_model
from .pool import LogProbWorker, SequenceScores

__all__ = [
    "CausalLMOutputForPPO",
    "FusedLinearForPPO",
    "HeadOptions",
    "LogProbWorker",
    "SequenceScores",
    "WorkerPool",
    "fused_log_probs",
    "load_model",
    "patch_model",
    "resolve_backend",
]


def __getattr__(name: str):
    # WorkerPool needs Ray; importing it lazily keeps the head and the model patch usable without Ray
    if name == "WorkerPool":
        from .pool.worker_pool import WorkerPool

        return WorkerPool
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

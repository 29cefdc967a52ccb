"""GPU-side pieces: the fused log-prob head, patched HuggingFace models, and the Ray workers that hold them.

Attributes load lazily, so that `ppo_logprobs.workers.request` and `.errors` (numpy only) can be used without torch,
Ray or Triton (the command line validates its input file with them), and the head and the model patch without Ray.
"""

from importlib import import_module

_WHERE = {  # attribute -> the module that defines it
    "FusedLinearForPPO": ".head", "HeadOptions": ".head", "fused_log_probs": ".head", "resolve_backend": ".head",
    "CausalLMOutputForPPO": ".models", "load_model": ".models", "patch_model": ".models",
    "LogProbWorker": ".pool", "SequenceScores": ".request", "WorkerPool": ".pool.worker_pool",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_WHERE[name], __name__), name)

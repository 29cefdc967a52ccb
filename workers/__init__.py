"""GPU-side pieces: the fused log-prob head (and, later, patched models and Ray workers)."""

from .fused_log_probs import FusedLinearForPPO, HeadOptions, fused_log_probs, resolve_backend

__all__ = ["FusedLinearForPPO", "HeadOptions", "fused_log_probs", "resolve_backend"]

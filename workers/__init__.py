"""GPU-side pieces: the fused log-prob head (and, later, patched models and Ray workers)."""

from .fused_log_probs import FusedLinearForPPO, HeadOptions, fused_log_probs, resolve_backend
from .load_model import load_model
from .patch_model import CausalLMOutputForPPO, patch_model

__all__ = [
    "CausalLMOutputForPPO",
    "FusedLinearForPPO",
    "HeadOptions",
    "fused_log_probs",
    "load_model",
    "patch_model",
    "resolve_backend",
]

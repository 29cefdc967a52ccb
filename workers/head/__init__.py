"""The fused LM head: per-token log-probabilities and entropies straight from hidden states and the head weight."""

from .fused_log_probs import Backend, FusedLinearForPPO, HeadOptions, fused_log_probs, resolve_backend

__all__ = ["Backend", "FusedLinearForPPO", "HeadOptions", "fused_log_probs", "resolve_backend"]

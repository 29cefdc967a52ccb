"""The fused LM head: per-token log-probabilities and entropies straight from hidden states and the head weight."""

from .backends import Backend, HeadOptions, resolve_backend
from .fused_log_probs import FusedLinearForPPO, fused_log_probs

__all__ = ["Backend", "FusedLinearForPPO", "HeadOptions", "fused_log_probs", "resolve_backend"]

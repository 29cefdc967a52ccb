"""HuggingFace causal LMs patched to score with the fused head, and their loading."""

from .load_model import load_model
from .patch_model import CausalLMOutputForPPO, patch_model

__all__ = ["CausalLMOutputForPPO", "load_model", "patch_model"]

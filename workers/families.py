"""The decoder families the project patches, in one table: adding a family is one entry here (and its tests).

For each HF `model_type`: the class-name prefix of its modules (`<prefix>RMSNorm`, `<prefix>Attention`), the config
field of its final-logit softcap, how its RMSNorm scales (fused when known), where its attention's sliding window
comes from (fused when known: the module, its config, or none), whether it runs tensor parallel, and whether its
MoE blocks' experts (`<prefix>Experts`) run sorted by expert (models/experts.py) and how its router weighs them, and
whether its decoder layer is the plain pre-norm one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Family:
    prefix: str
    softcap: str | None = None  # config field of the final-logit softcap (the head applies it)
    norm: tuple[Literal["llama", "gemma"], str] | None = None  # (scaling style, epsilon attribute) of its RMSNorm
    window: Literal["none", "config", "module"] | None = None  # its attention, fused; None: HF's own forward
    tensor_parallel: bool = False
    experts: bool = False  # mixture of experts: its `<prefix>Experts` modules run models/experts.py
    # its softmax top-k router (`<prefix>TopKRouter`) in one kernel (models/router.py): (the attribute saying whether
    # it renormalises its top k, None: always; its weights' dtype: the logits' or fp32)
    router: tuple[str | None, Literal["logits", "float32"]] | None = None
    # its decoder layer is HF's plain pre-norm one (norm, attention, add; norm, MLP or mixture, add): on Hopper the
    # adds run in the o and down projections' epilogues (models/hopper_gated.py); a mixture's block of a router and
    # experts alone (`<prefix>SparseMoeBlock`) adds in its experts' combine
    plain_layer: bool = False


_LLAMA_NORM = ("llama", "variance_epsilon")
_GEMMA_NORM = ("gemma", "eps")
_QWEN_ROUTER = ("norm_topk_prob", "logits")
FAMILIES: dict[str, Family] = {
    "llama": Family("Llama", norm=_LLAMA_NORM, window="none", tensor_parallel=True, plain_layer=True),
    "mistral": Family("Mistral", norm=_LLAMA_NORM, window="config", tensor_parallel=True, plain_layer=True),
    "qwen2": Family("Qwen2", norm=_LLAMA_NORM, window="module", tensor_parallel=True, plain_layer=True),
    "qwen3": Family("Qwen3", norm=_LLAMA_NORM, window="module", tensor_parallel=True, plain_layer=True),
    "phi3": Family("Phi3", norm=_LLAMA_NORM),
    "gemma2": Family("Gemma2", softcap="final_logit_softcapping", norm=_GEMMA_NORM),
    "gemma3_text": Family("Gemma3", softcap="final_logit_softcapping", norm=_GEMMA_NORM, window="module",
                          tensor_parallel=True),
    # mixtures of experts (shared experts stay HF's modules)
    "qwen3_moe": Family("Qwen3Moe", norm=_LLAMA_NORM, window="module", tensor_parallel=True, experts=True,
                        router=_QWEN_ROUTER, plain_layer=True),
    "qwen2_moe": Family("Qwen2Moe", norm=_LLAMA_NORM, window="module", tensor_parallel=True, experts=True,
                        router=_QWEN_ROUTER, plain_layer=True),
    "mixtral": Family("Mixtral", norm=_LLAMA_NORM, window="config", tensor_parallel=True, experts=True,
                      router=(None, "float32"), plain_layer=True),
    # (q/k norms span all heads: HF's attention, no TP)
    "olmoe": Family("Olmoe", norm=_LLAMA_NORM, experts=True, router=_QWEN_ROUTER),
}

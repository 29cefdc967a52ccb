"""The decoder body's memory-bound work in our Triton kernels: RMSNorm (rms_norm.py), the SiLU-gated MLP's middle
(silu_mul.py), mixture-of-experts layers sorted by expert (experts.py) and their routers (router.py), and, for rows
of packed sequences, the attention block's rotary embedding (rotary.py) with K/V heads read in place by the varlen
kernel (varlen_attention.py) instead of HF's five rotary kernels and repeated heads. On Hopper the MLP's gate and up
are one GEMM with the middle in its epilogue; an attention block's q, k and v (heads of 128) are one GEMM with the
biases, the q/k norms (where the model has them) and the rotation in its epilogue; and in the families whose decoder
layer is the plain pre-norm one the layer's residual adds run in the o and down projections' epilogues
(hopper_gated.py; a mixture's layer: the attention block's there, the mixture's in its experts' combine).

Each module instance gets its own forward (`types.MethodType`); which classes, and where their settings live, is
data in the tables below. A family not listed keeps HF's forwards, which give the same results more slowly.
Off the Triton backend (the CPU by default) the kernels' torch formulas run instead.
"""

from __future__ import annotations

import functools
import importlib
import types
from functools import partial

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..families import FAMILIES
from ..head import Backend, resolve_backend
from . import varlen_attention
from .causal_attention import hopper_kernels
from .experts import experts_forward
from .rms_norm import rms_norm
from .rotary import Norm, rotary, rotary_reference
from .router import route
from .silu_mul import silu_mul

# RMSNorm classes -> (formula, the attribute holding eps): see rms_norm.py
_NORMS = {f"{f.prefix}RMSNorm": f.norm for f in FAMILIES.values() if f.norm}  # class name -> (style, eps)
# Attention classes (separate q/k/v/o projections, rotary on the whole head, optional q_norm/k_norm) -> where the
# sliding window they pass to the attention function comes from: the module, its config, or nowhere
_ATTENTIONS = {f"{f.prefix}Attention": f.window for f in FAMILIES.values() if f.window}
_EXPERTS = {f"{f.prefix}Experts" for f in FAMILIES.values() if f.experts}  # MoE experts: models/experts.py
_ROUTERS = {f"{f.prefix}TopKRouter": f.router for f in FAMILIES.values() if f.router}  # (see families.py)
_MLPS = {f"{f.prefix}MLP" for f in FAMILIES.values()}  # (those with gate/up/down and SiLU: silu_mul.py)
_LAYERS = {f"{f.prefix}DecoderLayer" for f in FAMILIES.values() if f.plain_layer}  # (adds in the projections)
_BLOCKS = {f"{f.prefix}SparseMoeBlock" for f in FAMILIES.values() if f.experts and f.plain_layer}  # (in the combine)


def _norm_forward(self: nn.Module, x: Tensor, *, style: str, eps: str, backend: Backend) -> Tensor:
    if resolve_backend(backend, x.device) == "triton":
        return rms_norm(x, self.weight, getattr(self, eps), style)
    return type(self).forward(self, x)


@functools.cache
def _hopper_gated():
    """hopper_gated, where Triton has Gluon's Hopper operations (as causal_attention.hopper_kernels says), or None."""
    return None if hopper_kernels() is None else importlib.import_module(".hopper_gated", __package__)


def _linear(linear: nn.Module) -> bool:
    """An nn.Linear whose forward is its class's and nothing hooks (its weight and bias are all it computes)."""
    return (type(linear) is nn.Linear and "forward" not in vars(linear) and not linear._forward_hooks
            and not linear._forward_pre_hooks)


def _plain(linear: nn.Module) -> bool:
    """A `_linear` without bias."""
    return _linear(linear) and linear.bias is None


def _ours(module: nn.Module, forward) -> bool:
    """Whether fuse_body gave this module this forward."""
    return getattr(getattr(vars(module).get("forward"), "__func__", None), "func", None) is forward


def _project(linear: nn.Module, x: Tensor, residual: Tensor | None) -> Tensor:
    """linear(x), plus the residual when given: one GEMM with the add in its epilogue where hopper_gated runs it,
    else torch's add after the projection (a projection of a tensor-parallel model is summed over its group first)."""
    if residual is None:
        return linear(x)
    hopper = _hopper_gated()
    if (hopper is not None and _plain(linear) and hopper.usable(x, linear.weight, linear.weight)
            and residual.dtype == x.dtype and residual.shape == (*x.shape[:-1], linear.weight.shape[0])):
        return hopper.projected(x, linear.weight, residual)
    return residual + linear(x)


def _mlp_forward(self: nn.Module, x: Tensor, residual: Tensor | None = None, *, backend: Backend) -> Tensor:
    if resolve_backend(backend, x.device) != "triton":
        y = type(self).forward(self, x)
        return y if residual is None else residual + y
    gate, up, hopper = self.gate_proj, self.up_proj, _hopper_gated()
    if hopper is not None and _plain(gate) and _plain(up) and hopper.usable(x, gate.weight, up.weight):
        # (chosen by the GPU and the weights, never by the rows: a row's bits do not depend on the batch)
        return _project(self.down_proj, hopper.gated(x, gate.weight, up.weight), residual)
    return _project(self.down_proj, silu_mul(gate(x), up(x)), residual)


def _layer_forward(self: nn.Module, hidden_states: Tensor, *args, backend: Backend, **kwargs) -> Tensor:
    """HF's plain pre-norm decoder layer with its two adds handed to the fused attention block and MLP or mixture as
    residuals (added in the last projections' epilogues, or the experts' combine; a block not ours adds as HF adds),
    for packed rows on Triton; any other call is HF's own."""
    if (args or kwargs.get("cu_seq_lens") is None or resolve_backend(backend, hidden_states.device) != "triton"
            or not _ours(self.self_attn, _attention_forward)):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), residual=hidden_states, **kwargs)
    if _ours(self.mlp, _mlp_forward) or _ours(self.mlp, _block_forward):
        return self.mlp(self.post_attention_layernorm(h), residual=h)
    return h + self.mlp(self.post_attention_layernorm(h))


def _block_forward(self: nn.Module, hidden_states: Tensor, residual: Tensor | None = None, *, backend: Backend
                   ) -> Tensor:
    """HF's mixture block of a router and experts alone (`<prefix>SparseMoeBlock`: no shared expert, no jitter in
    training), plus the residual if given: added in the experts' combine (grouped_gemm.combine) where the experts run
    ours and nothing hooks them (a tensor-parallel model sums their output over its group first), else as HF adds."""
    experts = self.experts
    if (residual is None or residual.dtype != hidden_states.dtype
            or set(dict(self.named_children())) != {"gate", "experts"}
            or (self.training and getattr(self, "jitter_noise", 0) > 0) or not _ours(experts, experts_forward)
            or experts._forward_hooks or experts._forward_pre_hooks
            or resolve_backend(backend, hidden_states.device) != "triton"):
        y = type(self).forward(self, hidden_states)
        return y if residual is None else residual + y
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    _, weights, index = self.gate(x)
    return experts(x, index, weights, residual=residual.reshape(x.shape)).view(hidden_states.shape)


def _router_forward(self: nn.Module, hidden_states: Tensor, *, renormalize: str | None, dtype: str, backend: Backend
                    ) -> tuple[Tensor, Tensor, Tensor]:
    if resolve_backend(backend, hidden_states.device) != "triton":
        return type(self).forward(self, hidden_states)
    logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    weights, index = route(logits, self.top_k, renormalize is None or getattr(self, renormalize),
                           logits.dtype if dtype == "logits" else torch.float32)
    return logits, weights, index


def _head_norm(module: nn.Module | None) -> Norm | None:
    """A q/k norm of a fused family as the rotary kernel applies it in its pass (weight, eps, style)."""
    if module is None:
        return None
    style, eps = _NORMS[type(module).__name__]
    return module.weight, getattr(module, eps), style


def _rotated_qkv(self: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, norms: list[nn.Module | None]
                 ) -> tuple[Tensor, Tensor, Tensor] | None:
    """An attention block's q, k (normalised by its q/k norms, if any, and rotated) and v [T, heads, D] for rows x
    [T, E] as one GEMM with the biases, norms and rotation in its epilogue, where hopper_gated runs it (heads of its
    COLUMNS elements, HF's RMSNorm formula); else None."""
    hopper, projections = _hopper_gated(), (self.q_proj, self.k_proj, self.v_proj)
    if hopper is None or self.head_dim != hopper.COLUMNS or not all(_linear(p) for p in projections):
        return None
    weights, biases = tuple(p.weight for p in projections), tuple(p.bias for p in projections)
    biases = None if biases == (None,) * 3 else biases
    head_norms = None
    if norms != [None, None]:
        styles = [_NORMS.get(type(n).__name__) for n in norms]
        if None in styles or any(style[0] != "llama" for style in styles):
            return None
        eps = [getattr(n, style[1]) for n, style in zip(norms, styles, strict=True)]
        if eps[0] != eps[1]:
            return None
        head_norms = (norms[0].weight, norms[1].weight, eps[0])
    if not hopper.qkv_usable(x, weights, biases, cos, sin, head_norms):
        return None
    return tuple(y.view(len(x), -1, self.head_dim)
                 for y in hopper.rotated_qkv(x, weights, biases, cos, sin, head_norms))


def _attention_forward(self: nn.Module, hidden_states: Tensor, *, window: str, backend: Backend,
                       residual: Tensor | None = None, **kwargs) -> tuple[Tensor, None]:
    """HF's attention block for one packed row ([1, T, E]) given cu_seq_lens, plus the residual when given; any other
    call is HF's own."""
    cu_seq_lens = kwargs.get("cu_seq_lens")
    if cu_seq_lens is None or (self.training and self.attention_dropout > 0):
        out, weights = type(self).forward(self, hidden_states=hidden_states, **kwargs)
        return (out if residual is None else residual + out), weights
    t = hidden_states.shape[1]
    cos, sin = (x.reshape(t, -1) for x in kwargs["position_embeddings"])  # [T, D]
    norms = [getattr(self, name, None) for name in ("q_norm", "k_norm")]
    triton = resolve_backend(backend, hidden_states.device) == "triton"
    fused = _rotated_qkv(self, hidden_states.reshape(t, -1), cos, sin, norms) if triton else None
    if fused is not None:
        q, k, v = fused
    else:
        q, k, v = (p(hidden_states).view(t, -1, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        if triton and all(n is None or type(n).__name__ in _NORMS for n in norms):
            q, k = (rotary(x, cos, sin, _head_norm(n)) for x, n in zip((q, k), norms, strict=True))
        else:
            if norms[0] is not None:
                q, k = norms[0](q), norms[1](k)
            q, k = rotary_reference(q, cos, sin), rotary_reference(k, cos, sin)  # [T, H or Hkv, D]
    sliding = {"module": getattr(self, "sliding_window", None), "config": getattr(self.config, "sliding_window", None),
               "none": None}[window]
    out = varlen_attention.attend(q, k, v, cu_seq_lens, kwargs["max_length"], self.scaling, sliding,
                                  kwargs.get("shared_keys"), kwargs.get("attention_plan"))
    return _project(self.o_proj, out.reshape(1, t, -1), residual), None


def _fusable(model: nn.Module):
    for module in model.modules():
        name = type(module).__name__
        if name in _NORMS:
            forward = partial(_norm_forward, style=_NORMS[name][0], eps=_NORMS[name][1])
        elif name in _ATTENTIONS:
            forward = partial(_attention_forward, window=_ATTENTIONS[name])
        elif name in _EXPERTS:
            forward = experts_forward
        elif name in _ROUTERS:
            forward = partial(_router_forward, renormalize=_ROUTERS[name][0], dtype=_ROUTERS[name][1])
        elif (name in _MLPS and all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj"))
              and type(getattr(module, "act_fn", None)).__name__ in ("SiLUActivation", "SiLU")):
            forward = _mlp_forward
        elif name in _LAYERS:
            forward = _layer_forward
        elif name in _BLOCKS:
            forward = _block_forward
        else:
            continue
        yield module, forward


def fuse_body(model: nn.Module, backend: Backend = "auto") -> None:
    """Gives the body's RMSNorms, SiLU-gated MLPs, attention blocks, mixtures and plain decoder layers (of the families
    in the tables above) the forwards that run our kernels where `backend` resolves to Triton (CUDA by default), else
    their torch formulas."""
    for module, forward in _fusable(model):
        module.forward = types.MethodType(partial(forward, backend=backend), module)


def unfuse_body(model: nn.Module) -> None:
    """HF's own forwards back (for comparisons)."""
    for module, _ in _fusable(model):
        module.__dict__.pop("forward", None)

"""The family table against what it describes: each entry's model_type, class-name prefix, softcap field, RMSNorm
style and epsilon, sliding-window source, tensor parallelism and experts, checked on transformers' own classes and
tiny models of each family (patch_model, fuse_body and tensor_parallel find their modules through it)."""

import re
import sys
import typing

import pytest
import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ppo_logprobs.workers import sharding
from ppo_logprobs.workers.families import FAMILIES, Family
from ppo_logprobs.workers.models.experts import experts_forward
from ppo_logprobs.workers.models.patch_model import head_softcap
from ppo_logprobs.workers.models.rms_norm import Style, rms_norm_reference
from ppo_logprobs.workers.models.tensor_parallel import cut_model
from ppo_logprobs.workers.sharding import SPLITS, check_shardable

from .models.test_patch_model import FAMILIES as TINY
from .models.test_patch_model import tiny

TINY_NAME = {config_cls.model_type: name for name, (config_cls, _) in TINY.items()}  # model_type -> tiny()'s name


def modeling(family: Family):
    """The transformers module that defines the family's classes."""
    return sys.modules[getattr(transformers, f"{family.prefix}ForCausalLM").__module__]


def of_class(model, name):
    return [m for m in model.modules() if type(m).__name__ == name]


def test_every_family_has_a_tiny_model_in_the_tests():
    """Adding a family is an entry in the table and its tests: test_patch_model's tiny models cover exactly it."""
    assert set(TINY_NAME) == set(FAMILIES)
    for model_type, family in FAMILIES.items():
        assert TINY[TINY_NAME[model_type]][1] is getattr(transformers, f"{family.prefix}ForCausalLM"), model_type


def test_the_fields_hold_the_values_their_readers_know():
    """fuse_body picks a formula by the norm's style and a window by its source: a typo would pass silently."""
    hints = typing.get_type_hints(Family)
    styles = typing.get_args(typing.get_args(typing.get_args(hints["norm"])[0])[0])
    windows = typing.get_args(typing.get_args(hints["window"])[0])
    assert set(styles) == set(typing.get_args(Style)) and set(windows) == {"none", "config", "module"}
    for model_type, family in FAMILIES.items():
        assert family.norm is None or (family.norm[0] in styles and isinstance(family.norm[1], str)), model_type
        assert family.window is None or family.window in windows, model_type
        assert family.prefix.isidentifier() and family.prefix[0].isupper(), model_type


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_the_prefix_names_the_families_classes(model_type):
    """`<prefix>ForCausalLM` is the class AutoModelForCausalLM builds for this model_type (whose config is of this
    model_type), and the modules the table's fields name exist under the prefix: `<prefix>RMSNorm` where a norm is
    given, `<prefix>Attention` where a window is, `<prefix>Experts` exactly where experts are."""
    family = FAMILIES[model_type]
    causal_lm = getattr(transformers, f"{family.prefix}ForCausalLM")
    assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] == causal_lm.__name__
    assert causal_lm.config_class.model_type == model_type
    module = modeling(family)
    assert family.norm is None or hasattr(module, f"{family.prefix}RMSNorm")
    assert family.window is None or hasattr(module, f"{family.prefix}Attention")
    assert hasattr(module, f"{family.prefix}Experts") == family.experts


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_the_softcap_field_is_the_configs_and_the_only_head_variant(model_type):
    """The field named is the config's final-logit softcap and patch_model's head applies its value; a family with
    none has no such field (or another head variant) that the head would leave out."""
    family = FAMILIES[model_type]
    model = tiny(TINY_NAME[model_type])
    variants = {"final_logit_softcapping", "logit_scale", "logits_scaling"} & set(model.config.to_dict())
    if family.softcap is None:
        assert not variants and head_softcap(model) is None
    else:
        assert variants == {family.softcap}
        setattr(model.config, family.softcap, 0.375)
        assert head_softcap(model) == 0.375


def test_patch_model_refuses_a_model_type_outside_the_table_naming_the_table():
    model = tiny("llama")
    model.config.model_type = "llama_next"
    with pytest.raises(ValueError, match=re.escape("model_type 'llama_next'") + ".*" +
                       re.escape(f"(supported: {', '.join(FAMILIES)})")):
        head_softcap(model)


@pytest.mark.parametrize("model_type", [t for t, f in FAMILIES.items() if f.norm])
def test_the_norm_style_and_epsilon_are_the_modules(model_type):
    """Every `<prefix>RMSNorm` of a tiny model (an epsilon large enough to count, random weights) equals the table's
    formula with the epsilon read from the attribute the table names."""
    style, eps = FAMILIES[model_type].norm
    model = tiny(TINY_NAME[model_type], rms_norm_eps=0.25)
    norms = of_class(model, f"{FAMILIES[model_type].prefix}RMSNorm")
    assert norms
    g = torch.Generator().manual_seed(0)
    for norm in norms:
        assert getattr(norm, eps) == 0.25
        with torch.no_grad():
            norm.weight.copy_(torch.randn(norm.weight.shape, generator=g))
            x = torch.randn(3, norm.weight.shape[0], generator=g)
            assert torch.equal(norm(x), rms_norm_reference(x, norm.weight, getattr(norm, eps), style))


SLIDING = dict(sliding_window=4, use_sliding_window=True)  # (Qwen's configs keep a window only with the flag)


@pytest.mark.parametrize("model_type", [t for t, f in FAMILIES.items() if f.window])
def test_the_window_comes_from_where_hfs_attention_reads_it(model_type):
    """"module": a sliding layer's attention holds the window (a full layer's may not); "config": no attention holds
    one and the config's changes HF's numbers; "none": neither holds one, and HF ignores a window put in the config.
    And an attention fused at all fits the fused forward: separate q/k/v/o projections, q/k norms per head, no
    attention-logit cap."""
    family = FAMILIES[model_type]
    extra = {"module": dict(SLIDING, layer_types=["sliding_attention", "full_attention"]), "config": SLIDING,
             "none": {}}[family.window]
    model = tiny(TINY_NAME[model_type], **extra)
    attentions = of_class(model, f"{family.prefix}Attention")
    assert len(attentions) == model.config.num_hidden_layers
    if family.window == "module":
        assert attentions[0].sliding_window == 4
    else:
        assert not any(hasattr(a, "sliding_window") for a in attentions)
        assert getattr(model.config, "sliding_window", None) == (4 if family.window == "config" else None)
        ids = torch.arange(3, 12)[None]  # 9 tokens: longer than the window
        with torch.no_grad():
            model.config.sliding_window = 4
            windowed = model(input_ids=ids).logits
            model.config.sliding_window = None
            whole = model(input_ids=ids).logits
        assert torch.equal(windowed, whole) == (family.window == "none")
    for attention in attentions:
        assert all(isinstance(getattr(attention, p, None), torch.nn.Linear) for p in ("q_proj", "k_proj", "v_proj",
                                                                                        "o_proj"))
        if hasattr(attention, "q_norm"):
            assert attention.q_norm.weight.shape == attention.k_norm.weight.shape == (attention.head_dim,)
    assert getattr(model.config, "attn_logit_softcapping", None) is None


@pytest.mark.parametrize("model_type", [t for t, f in FAMILIES.items() if f.experts])
def test_the_experts_modules_run_sorted_by_expert(model_type):
    """The `<prefix>Experts` modules of a tiny mixture give HF's outputs through models/experts.py."""
    model = tiny(TINY_NAME[model_type])
    experts = of_class(model, f"{FAMILIES[model_type].prefix}Experts")
    assert len(experts) == model.config.num_hidden_layers
    module, g = experts[0], torch.Generator().manual_seed(1)
    hidden = torch.randn(11, model.config.hidden_size, generator=g)
    top_k = torch.stack([torch.randperm(module.num_experts, generator=g)[:2] for _ in range(11)])  # [T, k]
    weights = torch.rand(11, 2, generator=g)
    with torch.no_grad():
        want = module(hidden, top_k, weights)
        got = experts_forward(module, hidden, top_k, weights, backend="torch")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


TENSOR_PARALLEL = [t for t, f in FAMILIES.items() if f.tensor_parallel]


def test_the_tensor_parallel_families_are_the_tables():
    assert TENSOR_PARALLEL and set(TENSOR_PARALLEL) < set(FAMILIES)
    assert list(sharding.FAMILIES) == TENSOR_PARALLEL


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_tensor_parallel_families_have_every_projection_the_cut_splits(model_type):
    """A family marked tensor parallel has, in each layer, the q/k/v/o weights that sharding.SPLITS cuts and either
    the dense gate/up/down or a mixture's fused experts, and every other weight of its MLP is one SPLITS cuts or a
    router (fused qkv or gate_up of another layout would stay whole on every rank and score wrong); a tiny model of
    it cuts in two. Any other family is refused, the message listing the table's tensor-parallel families."""
    family = FAMILIES[model_type]
    model = tiny(TINY_NAME[model_type])
    if not family.tensor_parallel:
        with pytest.raises(ValueError, match=re.escape(f"supports {', '.join(TENSOR_PARALLEL)}, not model_type "
                                                       f"'{model_type}'")):
            check_shardable(model.config, 2)
        return
    names = {name for name, _ in model.named_parameters()}
    attention = [s for s in SPLITS if s.startswith("self_attn.") and s.endswith(".weight")]
    dense = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
    experts = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    routers = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")  # (whole on every rank: each routes alike)
    for layer in range(model.config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        assert all(prefix + s in names for s in attention), layer
        assert all(prefix + s in names for s in dense) or all(prefix + s in names for s in experts), layer
        for name in (n for n in names if n.startswith(prefix + "mlp.")):
            assert name.endswith(tuple(SPLITS)) or name.endswith(routers), name
    cut_model(model, 1, 2)
    mlp = model.model.layers[0].mlp
    if hasattr(mlp, "experts"):
        assert mlp.experts.down_proj.shape[2] == mlp.experts.intermediate_dim // 2
        return
    assert model.model.layers[0].mlp.down_proj.weight.shape[1] == model.config.intermediate_size // 2

"""fuse_body on tiny models of each family (fp32, torch backend): which modules get forwards of their own, HF's
numbers from them (a padded batch; packed rows given cu_seq_lens, against each sequence alone), unfuse_body giving
HF's forwards back to the bit, fusing twice, and models it does not fuse."""

import pytest
import torch
import transformers

from ppo_logprobs.workers import patch_model
from ppo_logprobs.workers.models.fuse_body import fuse_body, unfuse_body
from ppo_logprobs.workers.models.varlen_attention import cu_seq_lens

from .test_patch_model import FAMILIES, batch, pack, tiny

# family -> the modules (class name without the family's prefix) that get our forwards: the RMSNorms, the
# attention blocks with separate q/k/v projections, the MoE experts and the SiLU-gated MLPs (Gemma's are GELU)
FUSED = {
    "llama": {"RMSNorm", "Attention", "MLP", "DecoderLayer"},  # (plain layers: adds in the projections)
    "mistral": {"RMSNorm", "Attention", "MLP", "DecoderLayer"},
    "qwen2": {"RMSNorm", "Attention", "MLP", "DecoderLayer"},
    "qwen3": {"RMSNorm", "Attention", "MLP", "DecoderLayer"},
    "phi3": {"RMSNorm"},  # fused qkv_proj and gate_up_proj: HF's attention and MLP
    "gemma2": {"RMSNorm"},  # attention logits capped: HF's attention
    "gemma3": {"RMSNorm", "Attention"},
    # (plain layers: the adds in o's epilogue and the experts' combine)
    "qwen3_moe": {"RMSNorm", "Attention", "Experts", "TopKRouter", "SparseMoeBlock", "DecoderLayer"},
    # (a shared expert: an MLP, and its block adds as HF adds)
    "qwen2_moe": {"RMSNorm", "Attention", "Experts", "TopKRouter", "MLP", "SparseMoeBlock", "DecoderLayer"},
    "mixtral": {"RMSNorm", "Attention", "Experts", "TopKRouter", "SparseMoeBlock", "DecoderLayer"},
    "olmoe": {"RMSNorm", "Experts", "TopKRouter"},  # q/k norms over all heads: HF's attention
}
# windows shorter than the longest packed sequence, from the config (Mistral, Mixtral) or the module (the others)
WINDOW = {"mistral": dict(sliding_window=4), "mixtral": dict(sliding_window=4), "gemma3": dict(sliding_window=4),
          "qwen2": dict(use_sliding_window=True, sliding_window=4, max_window_layers=0),
          "qwen3": dict(use_sliding_window=True, sliding_window=4, max_window_layers=0)}
PACKED_ATTENTION = [f for f, kinds in FUSED.items() if "Attention" in kinds]


def model_of(family):
    return tiny(family, **WINDOW.get(family, {}))


def prefix(model):
    return type(model).__name__.removesuffix("ForCausalLM")


def own_forwards(model):
    """Class names (less the family's prefix) of the modules holding a forward of their own."""
    return {type(m).__name__.removeprefix(prefix(model)) for m in model.modules() if "forward" in m.__dict__}


def packed_row():
    g = torch.Generator().manual_seed(3)
    sequences = [torch.randint(3, 97, (n,), generator=g) for n in (9, 1, 6, 12)]
    ids, positions = pack(sequences)
    cu, longest = cu_seq_lens(positions[0] == 0)
    return sequences, dict(input_ids=ids, position_ids=positions, cu_seq_lens=cu, max_length=longest)


def body_outputs(model):
    """The body's last hidden states on a left-padded batch and on a packed row given its offsets."""
    ids, mask = batch("left")
    _, packed = packed_row()
    with torch.no_grad():
        return [model.model(input_ids=ids, attention_mask=mask).last_hidden_state,
                model.model(**packed).last_hidden_state]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fusing_gives_the_tables_modules_forwards_of_their_own(family):
    model = model_of(family)
    classes = {type(m): type(m).forward for m in model.modules()}
    fuse_body(model, "torch")
    assert own_forwards(model) == FUSED[family]
    for module in model.modules():  # every module of a fused kind, none of the others
        kind = type(module).__name__.removeprefix(prefix(model))
        assert ("forward" in module.__dict__) == (kind in FUSED[family]), type(module).__name__
    assert {type(m): type(m).forward for m in model.modules()} == classes  # no class touched


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_body_gives_hf_numbers_on_a_padded_batch(family):
    """The whole model's logits, left padding and an attention mask: norms, MLPs and attention (no offsets given)
    take HF's formulas on the torch backend, and MoE experts run sorted by expert."""
    ids, mask = batch("left")
    with torch.no_grad():
        want = model_of(family)(input_ids=ids, attention_mask=mask).logits
        model = model_of(family)
        fuse_body(model, "torch")
        got = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", PACKED_ATTENTION)
def test_fused_attention_runs_each_packed_sequence_as_hf_runs_it_alone(family):
    """A packed row given cu_seq_lens: rotary embedding, grouped K/V heads, windows shorter than a sequence, each
    sequence attending only to itself; against HF's model on each sequence alone (its own forwards)."""
    hf = model_of(family)
    sequences, packed = packed_row()
    with torch.no_grad():
        want = torch.cat([hf.model(input_ids=seq[None]).last_hidden_state[0] for seq in sequences])
        fuse_body(hf, "torch")
        got = hf.model(**packed).last_hidden_state[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe", "qwen2_moe", "mixtral"])
def test_a_plain_layer_on_triton_adds_its_residuals_as_hf_does(family, monkeypatch):
    """The plain decoder layers' own forward (the Triton backend: the interpreter here, the kernels on a GPU), a dense
    MLP's add handed to its down projection and a mixture's to its experts' combine (a block with a shared expert
    adds after it): each packed sequence as HF's model runs it alone."""
    from ppo_logprobs.workers.models import experts

    added = []
    real = experts.combine
    monkeypatch.setattr(experts, "combine", lambda *a: added.append(a[3] is not None) or real(*a))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = model_of(family).to(device)
    sequences, packed = packed_row()
    sequences = [s.to(device) for s in sequences]
    packed = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in packed.items()}
    with torch.no_grad():
        want = torch.cat([hf.model(input_ids=seq[None]).last_hidden_state[0] for seq in sequences])
        fuse_body(hf, "triton")
        assert "DecoderLayer" in own_forwards(hf)
        added.clear()
        got = hf.model(**packed).last_hidden_state[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    layers = hf.config.num_hidden_layers
    assert added == ([] if family == "qwen2" else [family != "qwen2_moe"] * layers), added


@pytest.mark.parametrize("family", list(FAMILIES))
def test_unfuse_body_gives_hf_forwards_back_to_the_bit(family):
    never = body_outputs(model_of(family))
    model = model_of(family)
    fuse_body(model, "torch")
    fused = body_outputs(model)
    unfuse_body(model)
    assert own_forwards(model) == set()
    for got, want in zip(body_outputs(model), never, strict=True):
        assert torch.equal(got, want)
    if family in PACKED_ATTENTION:  # (fusing changed these numbers: HF's attention mixes a packed row's sequences)
        assert not torch.equal(fused[1], never[1])


def test_unfuse_body_leaves_the_forwards_it_did_not_give():
    """patch_model's scoring forward on the model stays; only the body's modules go back to HF's (invariant=False:
    no process-wide setting touched)."""
    model = patch_model(model_of("qwen2"), backend="torch", invariant=False)
    assert own_forwards(model) == {"ForCausalLM", "RMSNorm", "Attention", "MLP", "DecoderLayer"}
    unfuse_body(model)
    assert own_forwards(model) == {"ForCausalLM"}
    ids, mask = batch("right")
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)
    assert out.logits is None and out.log_probs.shape == ids.shape


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gemma3"])
def test_fusing_twice_is_fusing_once(family):
    """A second fuse_body replaces the forwards it gave (nothing stacks): the same bits as one, and one unfuse_body
    gives HF's back."""
    once = model_of(family)
    fuse_body(once, "torch")
    twice = model_of(family)
    fuse_body(twice, "torch")
    fuse_body(twice, "torch")
    assert own_forwards(twice) == FUSED[family]
    for got, want in zip(body_outputs(twice), body_outputs(once), strict=True):
        assert torch.equal(got, want)
    unfuse_body(twice)
    assert own_forwards(twice) == set()
    for got, want in zip(body_outputs(twice), body_outputs(model_of(family)), strict=True):
        assert torch.equal(got, want)


def test_fusing_again_takes_the_new_backend(monkeypatch):
    """The backend of the last fuse_body is the one that runs, resolved when the body runs: with the Triton
    interpreter off, CPU tensors refuse 'triton' (naming the device), and 'torch' then runs as if fused once."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    once = model_of("llama")
    fuse_body(once, "torch")
    want = body_outputs(once)
    model = model_of("llama")
    fuse_body(model, "torch")
    fuse_body(model, "triton")
    ids, mask = batch("right")
    with pytest.raises(ValueError, match=r"backend='triton' needs CUDA tensors \(got cpu\)"), torch.no_grad():
        model.model(input_ids=ids, attention_mask=mask)
    fuse_body(model, "torch")
    for got, expected in zip(body_outputs(model), want, strict=True):
        assert torch.equal(got, expected)


def test_a_model_of_no_fused_family_keeps_hf_forwards():
    """GPT-2: LayerNorms, a GELU MLP, a fused c_attn: nothing gets a forward of its own, and its numbers are the
    unfused model's to the bit."""

    def gpt2():
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=97, bos_token_id=1,
                                         eos_token_id=2)
        return transformers.GPT2LMHeadModel(config).eval()

    model = gpt2()
    fuse_body(model, "torch")
    assert not any("forward" in m.__dict__ for m in model.modules())
    ids, mask = batch("right")
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits,
                           gpt2()(input_ids=ids, attention_mask=mask).logits)


def test_a_silu_mlp_of_a_family_not_in_the_table_keeps_hf_forward():
    """Falcon-H1's MLP has gate/up/down and SiLU but scales both by its multipliers, which silu_mul knows nothing
    of: a module of a family outside the table is not fused on its looks."""
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1MLP

    torch.manual_seed(0)
    mlp = FalconH1MLP(transformers.FalconH1Config(hidden_size=32, intermediate_size=64, mlp_multipliers=[2.0, 0.5]))
    fuse_body(mlp, "triton")
    assert "forward" not in mlp.__dict__

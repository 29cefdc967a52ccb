"""Varlen attention (workers/models/varlen_attention.py) on its own: which models it refuses and why, how a call
becomes one packed row, and `attend` on packed rows against a float64 oracle with grouped key-value heads: each
sequence attends only to itself. The CPU path (sdpa per sequence) everywhere; the CUDA kernels (ours for heads up to
128, else FlashAttention's) on CUDA."""

import pytest
import torch
import transformers
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ppo_logprobs.workers.models.varlen_attention import (
    NAME,
    attend,
    cu_seq_lens,
    model_allows,
    one_row,
    varlen_attention,
)

from .test_causal_attention import oracle as segment_oracle

SMALL = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LENGTHS = (1, 7, 13)  # one packed row of 21 tokens
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 24  # three query heads read each key-value head
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
}
HEAD_SIZE = "its head size {} is not a multiple of 8 up to 256"
REFUSALS = {  # id: (family, config, why model_allows refuses it)
    "llama": ("llama", {}, None),
    "head-256": ("llama", dict(head_dim=256), None),
    "gemma2-uncapped": ("gemma2", dict(head_dim=8, attn_logit_softcapping=None), None),
    "softcap": ("gemma2", dict(head_dim=8), "its attention caps logits (attn_logit_softcapping)"),  # 50 by default
    "bidirectional": ("gemma3", dict(head_dim=8, use_bidirectional_attention=True), "its attention is bidirectional"),
    "head-12": ("llama", dict(head_dim=12), HEAD_SIZE.format(12)),
    "head-264": ("llama", dict(head_dim=264), HEAD_SIZE.format(264)),
    "derived-head-10": ("qwen2", dict(hidden_size=40), HEAD_SIZE.format(10)),  # no head_dim: 40 / 4 heads
}


@pytest.mark.parametrize(("family", "config", "reason"), REFUSALS.values(), ids=REFUSALS.keys())
def test_model_allows_names_why_a_model_cannot_run(family, config, reason):
    config_cls, model_cls = FAMILIES[family]
    assert model_allows(model_cls(config_cls(**{**SMALL, **config}))) == reason


def test_offsets_of_a_packed_row():
    starts = torch.tensor([1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0], dtype=torch.bool)  # lengths 1, 7, 3
    cu, longest = cu_seq_lens(starts)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 1, 8, 11] and longest == 7


def test_a_padded_or_packed_call_becomes_one_row_of_its_real_tokens():
    ids = torch.zeros(2, 6, dtype=torch.long)
    left_then_right = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    keep, positions, begins = one_row(ids, left_then_right, None)
    assert keep.tolist() == left_then_right.flatten().bool().tolist()
    assert positions.tolist() == [0, 1, 2, 3, 0, 1, 2]  # left padding shifts nothing
    assert begins.tolist() == [True, False, False, False, True, False, False]
    packed = torch.tensor([[0, 1, 2, 0, 0, 1]])  # sequences of 3, 1 and 2 in one row
    keep, positions, begins = one_row(ids[:1], None, packed)
    assert keep is None and positions.tolist() == [0, 1, 2, 0, 0, 1]
    assert begins.tolist() == [True, False, False, True, True, False]
    keep, positions, begins = one_row(ids[:1, :4], torch.tensor([[0, 1, 1, 1]]), torch.tensor([[0, 5, 6, 7]]))
    assert positions.tolist() == [5, 6, 7] and begins.tolist() == [True, False, False]  # a row's first real token


def packed_row(lengths, seed, dtype=torch.float32, device="cpu", head_dim=HEAD_DIM):
    """q [T, H, D], k and v [T, Hkv, D] of one row, and its offsets."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, head_dim, generator=g).to(device, dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu


def oracle(q, k, v, cu, scale=None, window=None):
    """Causal softmax attention of each sequence to itself in float64 (test_causal_attention's oracle)."""
    return segment_oracle(q, k, v, cu, cu, scale, window)


def sequences_of(out, cu):
    return [out[a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]


@pytest.mark.parametrize(("scale", "window"), [(None, None), (0.3, None), (None, 4)])
def test_each_sequence_attends_causally_to_itself_with_grouped_heads(scale, window):
    """fp32 against the float64 oracle: within 2e-6 (fp32's own rounding here is about 5e-7; a token attending across
    a sequence boundary, query heads reading the wrong key-value head or a window ignored are off by more than 2)."""
    q, k, v, cu = packed_row(LENGTHS, seed=0)
    out = attend(q, k, v, cu, max(LENGTHS), scale, window)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), oracle(q, k, v, cu, scale, window), rtol=0, atol=2e-6)


def test_another_sequences_tokens_leave_a_sequences_output_unchanged():
    """The same row with every other sequence's q, k and v redrawn: each sequence's output keeps its bits."""
    q, k, v, cu = packed_row(LENGTHS, seed=1)
    out = sequences_of(attend(q, k, v, cu, max(LENGTHS)), cu)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        mixed = packed_row(LENGTHS, seed=2 + i)[:3]
        for x, mine in zip(mixed, (q, k, v), strict=True):
            x[a:b] = mine[a:b]
        assert torch.equal(sequences_of(attend(*mixed, cu, max(LENGTHS)), cu)[i], out[i]), i


def test_the_attention_interface_takes_transformers_layout():
    """Registered under NAME; query [1, H, T, D], key and value [1, Hkv, T, D] -> [1, T, H, D], no weights."""
    assert ALL_ATTENTION_FUNCTIONS[NAME] is varlen_attention
    q, k, v, cu = packed_row(LENGTHS, seed=3)
    out, weights = varlen_attention(
        None, *(x.transpose(0, 1)[None] for x in (q, k, v)), None, scaling=0.5, cu_seq_lens=cu, max_length=max(LENGTHS)
    )
    assert weights is None
    assert torch.equal(out[0], attend(q, k, v, cu, max(LENGTHS), 0.5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("head_dim", [24, 256])
def test_cuda_kernel_keeps_sequences_apart_at_any_offset(window, head_dim):
    """Our kernel (heads of 24) and the FlashAttention varlen kernel (256) in bf16: within bf16's rounding of the
    float64 oracle (its output's half ulp and the probabilities it rounds to bf16: about 1e-2 here; a wrong head,
    window or boundary is off by more than 1), and a sequence's output has the same bits whatever its neighbours and
    wherever in the row it sits."""
    lengths = (1, 7, 13, 300, 129)
    q, k, v, cu = packed_row(lengths, seed=4, dtype=torch.bfloat16, device="cuda", head_dim=head_dim)
    out = attend(q, k, v, cu, max(lengths), None, window)
    want = oracle(q.cpu(), k.cpu(), v.cpu(), cu.cpu(), None, window)
    torch.testing.assert_close(out.double().cpu(), want, rtol=0, atol=3e-2)
    order = [3, 0, 4, 2, 1]
    moved = [torch.cat([sequences_of(x, cu)[i] for i in order]) for x in (q, k, v)]
    cu_moved = torch.tensor([0, *torch.tensor([lengths[i] for i in order]).cumsum(0).tolist()], dtype=torch.int32)
    again = sequences_of(attend(*moved, cu_moved.cuda(), max(lengths), None, window), cu_moved)
    mine = sequences_of(out, cu)
    for at, i in enumerate(order):
        assert torch.equal(again[at], mine[i]), i

"""Patched HuggingFace models against the unpatched model's own logits (fp32, tiny random configs)."""

import pytest
import torch
import transformers
from torch import nn

from ppo_logprobs.workers import load_model, patch_model

SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
}
# Gemma: a final-logit softcap small enough to bend these tiny models' logits, so that a head without it fails
GEMMA = dict(head_dim=8, final_logit_softcapping=0.05)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24)
EXTRA = {"gemma2": GEMMA, "gemma3": GEMMA, "qwen3_moe": MOE, "qwen2_moe": dict(MOE, shared_expert_intermediate_size=40),
         "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
         "olmoe": dict(num_experts=8, num_experts_per_tok=2)}


def tiny(family, tied=False, **extra):
    config_cls, model_cls = FAMILIES[family]
    config = config_cls(**SMALL, tie_word_embeddings=tied, **{**EXTRA.get(family, {}), **extra})
    torch.manual_seed(0)
    return model_cls(config).eval()


def reference(model, input_ids, attention_mask, temperature=1.0):
    """log_softmax of the unpatched model's logits (the class's own forward), aligned to the next token."""
    logits = type(model).forward(model, input_ids=input_ids, attention_mask=attention_mask).logits.float()
    t = temperature[..., None] if isinstance(temperature, torch.Tensor) else temperature
    log_p = (logits / t).log_softmax(-1)
    lp = log_p[:, :-1].gather(-1, input_ids[:, 1:, None])[..., 0]
    ent = -(log_p.exp() * log_p).sum(-1)[:, :-1]
    return lp, ent


def batch(padding_side, lengths=(11, 7, 3), total=11, vocab=97):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (len(lengths), total), generator=g)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for b, n in enumerate(lengths):
        if padding_side == "right":
            mask[b, :n] = 1
        else:
            mask[b, total - n :] = 1
    return ids, mask


# Gemma 2 caps attention logits: varlen refuses it (test_refusals_name_the_reason)
@pytest.mark.parametrize(("family", "attention"), [(f, a) for f in FAMILIES for a in ("auto", "varlen")
                                                   if not (f == "gemma2" and a == "varlen")])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_patched_model_matches_its_logits(family, tied, padding_side, attention):
    """"varlen" (CUDA's default for 16-bit models) runs the call as one row of its real tokens; off CUDA its
    attention is sdpa per sequence."""
    model = tiny(family, tied, **(dict(sliding_window=4) if family in ("mistral", "gemma3", "mixtral") else {}))
    ids, mask = batch(padding_side)
    temps = torch.linspace(0.5, 2.0, ids.numel()).view(ids.shape)
    for temperature in (1.0, 0.7, temps):
        ref_lp, ref_ent = reference(model, ids, mask, temperature)
        patch_model(model, backend="torch", packed_attention=attention)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, temperature=temperature)
        assert out.logits is None and out.log_probs.shape == ids.shape and out.entropy.shape == ids.shape
        real = (mask[:, :-1] * mask[:, 1:]).bool()  # scored positions: this token and the next are real
        torch.testing.assert_close(out.log_probs[:, :-1][real], ref_lp[real].detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(out.entropy[:, :-1][real], ref_ent[real].detach(), rtol=0, atol=1e-5)
        assert (out.log_probs[:, -1] == 0).all()
        assert (out.log_probs[:, :-1][~real] == 0).all() and (out.entropy[:, :-1][~real] == 0).all()
        del model.forward  # back to the class's forward for the next reference


def test_patch_touches_only_the_instance():
    a, b = tiny("qwen2"), tiny("qwen2")
    patch_model(a, backend="torch")
    ids = torch.randint(0, 97, (1, 5))
    assert type(b).forward is transformers.Qwen2ForCausalLM.forward
    assert b(input_ids=ids).logits is not None
    assert a(input_ids=ids).logits is None


def test_gemma_softcap_is_applied_in_the_head():
    model = tiny("gemma2")
    ids, mask = batch("right")
    ref_lp, _ = reference(model, ids, mask)
    model.config.final_logit_softcapping = None  # a head without the cap scores differently
    ref_uncapped, _ = reference(model, ids, mask)
    assert (ref_lp - ref_uncapped).abs().max() > 0.05


def test_refusals_name_the_reason():
    cohere = transformers.CohereForCausalLM(transformers.CohereConfig(**SMALL, logit_scale=0.5))
    with pytest.raises(ValueError, match="model_type 'cohere'"):
        patch_model(cohere)
    model = tiny("llama")
    model.lm_head.bias = nn.Parameter(torch.zeros(97))
    with pytest.raises(ValueError, match="has a bias"):
        patch_model(model)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=97))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        patch_model(gpt2)
    with pytest.raises(ValueError, match="'varlen' cannot run Gemma2ForCausalLM: its attention caps logits"):
        patch_model(tiny("gemma2"), packed_attention="varlen")


def test_an_id_outside_the_vocabulary_is_named_before_the_body_runs(monkeypatch):
    """input_ids the embedding does not have (and scored_labels the head does not) are refused by field, position
    and value before any of the body runs (on CUDA the embedding's lookup would be a device-side assert); ids under
    padding are not read; checked_inputs skips the check (the worker's requests are checked on the host)."""
    model = patch_model(tiny("qwen2"))
    ran = []
    embed = model.get_input_embeddings()
    real = type(embed).forward
    monkeypatch.setattr(type(embed), "forward", lambda self, x: ran.append(1) or real(self, x))
    for ids, value in (([[4, 2, 3, 7], [1, 97, 2, 2]], r"input_ids\[1, 1\] = 97"),
                       ([[1, -3]], r"input_ids\[0, 1\] = -3")):
        with pytest.raises(ValueError, match=value + r" is outside the vocabulary \[0, 97\)$"):
            model(input_ids=torch.tensor(ids))
    assert ran == []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[5, 6, 7, 8]]), attention_mask=torch.tensor([[1, 1, 1, 0]]))
        with pytest.raises(IndexError):  # (not checked: the embedding's own error, as before)
            model(input_ids=torch.tensor([[5, 6, 97]]), checked_inputs=True)
    assert out.log_probs.shape == (1, 4) and ran
    with pytest.raises(ValueError, match=r"scored_labels\[1\] = 97 is outside the vocabulary \[0, 97\) and is not "
                                         r"ignore_index \(-100\)"):
        model(input_ids=torch.tensor([[5, 6, 7]]), position_ids=torch.tensor([[0, 1, 2]]),
              scored=torch.tensor([0, 1]), scored_labels=torch.tensor([6, 97]))


def test_a_head_with_fewer_rows_than_the_embedding_still_names_a_label_it_does_not_have():
    """An id the embedding has but the head does not passes the check at the start; as a label the head refuses it
    by position and value (the head checks the labels again only where the start's check does not cover them)."""
    model = tiny("qwen2")
    model.lm_head = nn.Linear(32, 90, bias=False)
    model = patch_model(model)
    with pytest.raises(ValueError, match=r"labels\[1\] = 93 is outside the vocabulary \[0, 90\)"):
        model(input_ids=torch.tensor([[5, 6, 93]]))
    with torch.no_grad():  # (as the first token, 93 is no one's label)
        assert model(input_ids=torch.tensor([[93, 5, 6, 7]])).log_probs.shape == (1, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_trainers_forward_waits_on_the_device_once_for_its_checks():
    """A forward on inputs that no caller checked (a trainer's) checks its ids before any kernel; the head does not
    wait on the device again for the labels, which are those ids (the GPU would idle in the middle of the call while
    the host launches the head). A temperature tensor is still the head's to check."""
    import warnings

    model = load_model("tiny", dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 503, (2, 300), device="cuda")
    t = torch.full((2, 300), 0.7, device="cuda")

    def checks(**kw) -> int:  # the waits check_ids and the head's checks make (fused_log_probs.py's lines)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with torch.no_grad():
                    model(input_ids=ids, **kw)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return sum("synchroniz" in str(w.message) and w.filename.endswith("fused_log_probs.py") for w in caught)

    with torch.no_grad():
        model(input_ids=ids, temperature=t)  # (the kernels built)
    assert checks() == 1
    assert checks(temperature=t) == 3  # (the ids; the head's labels and temperatures)


def test_load_round_trips_through_save_pretrained(tmp_path):
    model = load_model("tiny", dtype=torch.float32, backend="torch")
    ids, mask = batch("right", vocab=model.config.vocab_size)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask)
    del model.forward
    model.save_pretrained(tmp_path)
    assert any(p.suffix == ".safetensors" for p in tmp_path.iterdir())
    loaded = load_model(str(tmp_path), dtype=torch.float32, backend="torch")
    with torch.no_grad():
        after = loaded(input_ids=ids, attention_mask=mask)
    assert torch.equal(before.log_probs, after.log_probs) and torch.equal(before.entropy, after.entropy)


def test_load_never_fetches(tmp_path):
    from ppo_logprobs.workers.errors import CheckpointNotFound

    with pytest.raises(CheckpointNotFound, match="no-such-model"):
        load_model(str(tmp_path / "no-such-model"))


def pack(sequences):
    """One row holding the sequences back to back, position_ids restarting at 0 for each."""
    ids = torch.cat(sequences)[None]
    positions = torch.cat([torch.arange(len(s)) for s in sequences])[None]
    return ids, positions


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3"])
@pytest.mark.parametrize("attn", ["sdpa", "eager", "flex_attention", "varlen"])
def test_packed_equals_each_sequence_alone(family, attn):
    """Packed rows through the model's own attention (a packed mask) or varlen attention (on the CPU its sdpa
    reference, which takes the same cumulative offsets, grouped heads and windows as the CUDA kernel)."""
    extra = dict(sliding_window=4) if family in ("mistral", "gemma3") else {}  # windows shorter than a sequence
    model = tiny(family, attn_implementation="sdpa" if attn == "varlen" else attn, **extra)
    patch_model(model, backend="torch", packed_attention="varlen" if attn == "varlen" else "auto")
    g = torch.Generator().manual_seed(3)
    sequences = [torch.randint(3, 97, (n,), generator=g) for n in (9, 1, 6, 12)]
    ids, positions = pack(sequences)
    temps = torch.rand(ids.shape, generator=g) + 0.5
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, temperature=temps)
        start = 0
        for seq in sequences:
            n = len(seq)
            alone = model(input_ids=seq[None], temperature=temps[:, start : start + n])
            torch.testing.assert_close(packed.log_probs[0, start : start + n], alone.log_probs[0], rtol=0, atol=1e-5)
            torch.testing.assert_close(packed.entropy[0, start : start + n], alone.entropy[0], rtol=0, atol=1e-5)
            assert packed.log_probs[0, start + n - 1] == 0  # no label across the boundary
            start += n


def test_packed_row_with_padding_at_the_end():
    model = patch_model(tiny("qwen2"), backend="torch")
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(3, 97, (7,), generator=g), torch.randint(3, 97, (5,), generator=g)
    ids, positions = pack([a, b, torch.zeros(4, dtype=torch.long)])  # 4 pad tokens, their own "sequence"
    mask = torch.ones_like(ids)
    mask[0, -4:] = 0
    with torch.no_grad():
        packed = model(input_ids=ids, attention_mask=mask, position_ids=positions)
        alone = model(input_ids=b[None])
    torch.testing.assert_close(packed.log_probs[0, 7:12], alone.log_probs[0], rtol=0, atol=1e-5)
    assert (packed.log_probs[0, 11:] == 0).all() and (packed.entropy[0, 11:] == 0).all()
    # padding before a real token of a packed row could be attended to: refused, naming the row
    mask = torch.ones(2, ids.shape[1], dtype=torch.long)
    mask[1, :3] = 0
    with pytest.raises(ValueError, match="attention_mask row 1: in packed rows"):
        model(input_ids=ids.expand(2, -1), attention_mask=mask, position_ids=positions.expand(2, -1))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("attention", ["auto", "varlen"])
def test_only_the_scored_positions_reach_the_head(packed, attention):
    """`scored` gives the same bits as scoring every position and picking those; no entropy when not asked for."""
    model = patch_model(tiny("llama"), backend="torch", packed_attention=attention)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 97, (n,), generator=g) for n in (9, 4, 13)]
    if packed:
        ids, positions = pack(seqs)
        inputs = dict(input_ids=ids, position_ids=positions)
    else:
        ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
        inputs = dict(input_ids=ids, attention_mask=(torch.arange(13) < torch.tensor([9, 4, 13])[:, None]).long())
    temperature = torch.rand(ids.shape, generator=g) + 0.5
    scored = torch.tensor([3, 5, 7, 2, 17, 20, 24])  # flat positions into [B * T] (26 or 39 of them)
    with torch.no_grad():
        everything = model(**inputs, temperature=temperature)
        some = model(**inputs, temperature=temperature, scored=scored)
        no_entropy = model(**inputs, temperature=temperature, scored=scored, compute_entropy=False)
    assert some.log_probs.shape == (7,) and no_entropy.entropy is None
    assert torch.equal(some.log_probs, everything.log_probs.reshape(-1)[scored])
    assert torch.equal(some.entropy, everything.entropy.reshape(-1)[scored])
    assert torch.equal(no_entropy.log_probs, some.log_probs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("lengths", "attention"), [((130, 7, 64), "sdpa"), ((700, 7, 400), "flex_attention")])
def test_cuda_packed_rows_run_flex_attention_when_long_and_equal_alone(lengths, attention):
    model = load_model("tiny", dtype=torch.float32, device="cuda")  # fp32: no varlen; head_dim 16: flex's least
    assert model.config._attn_implementation == "sdpa"
    seen = []
    model.base_model.register_forward_pre_hook(lambda *_: seen.append(model.config._attn_implementation))
    g = torch.Generator().manual_seed(5)
    sequences = [torch.randint(3, 500, (n,), generator=g) for n in lengths]
    ids, positions = pack(sequences)
    with torch.no_grad():
        packed = model(input_ids=ids.cuda(), position_ids=positions.cuda())
        assert seen == [attention]  # short rows keep sdpa's dense mask
        assert model.config._attn_implementation == "sdpa"  # switched for the packed call only
        start = 0
        for seq in sequences:
            alone = model(input_ids=seq[None].cuda())
            got = packed.log_probs[0, start : start + len(seq)]
            torch.testing.assert_close(got, alone.log_probs[0], rtol=0, atol=1e-4)
            start += len(seq)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_varlen_rows_equal_alone_and_give_a_sequence_its_bits_at_any_offset():
    model = load_model("tiny", dtype=torch.bfloat16, device="cuda")
    seen = []
    model.base_model.register_forward_pre_hook(lambda *_: seen.append(model.config._attn_implementation))
    g = torch.Generator().manual_seed(6)
    sequences = [torch.randint(3, 500, (n,), generator=g) for n in (300, 7, 1200, 45)]

    def run(order):
        ids, positions = pack([sequences[i] for i in order])
        out = model(input_ids=ids.cuda(), position_ids=positions.cuda()).log_probs[0]
        found, at = {}, 0
        for i in order:
            found[i] = out[at : at + len(sequences[i])]
            at += len(sequences[i])
        return found

    with torch.no_grad():
        forward, backward = run([0, 1, 2, 3]), run([3, 2, 1, 0])
        assert seen == ["ppo_varlen", "ppo_varlen"]
        for i, seq in enumerate(sequences):
            assert torch.equal(forward[i], backward[i]), i  # the same bits at another offset of the row
            alone = model(input_ids=seq[None].cuda()).log_probs[0]  # a row of its own
            assert torch.equal(forward[i], alone), i
            sdpa, _ = reference(model, seq[None].cuda(), None)  # the unpatched model: sdpa, [V] logits
            torch.testing.assert_close(forward[i][:-1], sdpa[0], rtol=0, atol=5e-2)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma3"])
def test_the_fused_body_kernels_give_the_model_its_numbers(family):
    """Our RMSNorm, rotary and SiLU-gated MLP kernels (the Triton interpreter on the CPU, compiled on a GPU) in place
    of HF's forwards, in a packed row, against the unpatched model (fp32)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny(family, **(dict(sliding_window=4) if family in ("mistral", "gemma3") else {})).to(device)
    ids, mask = (t.to(device) for t in batch("right"))
    ref_lp, ref_ent = reference(model, ids, mask)
    patch_model(model, backend="triton", packed_attention="varlen")
    fused = [m for m in model.modules() if "forward" in m.__dict__]
    kinds = {type(m).__name__.removeprefix(family.capitalize()) for m in fused}
    assert {"ForCausalLM", "RMSNorm", "Attention"} <= kinds and ("MLP" in kinds) == (family != "gemma3")
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)
    real = (mask[:, :-1] * mask[:, 1:]).bool()
    torch.testing.assert_close(out.log_probs[:, :-1][real], ref_lp[real].detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(out.entropy[:, :-1][real], ref_ent[real].detach(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("invariant", [True, False])
def test_a_call_of_padding_only_scores_nothing(invariant):
    """The one-row path with no real token at all (with or without the invariant mode's filler) returns zeros."""
    model = patch_model(tiny("qwen2"), backend="torch", packed_attention="varlen", invariant=invariant)
    with torch.no_grad():
        out = model(input_ids=torch.ones(2, 5, dtype=torch.long), attention_mask=torch.zeros(2, 5, dtype=torch.long))
    assert out.log_probs.shape == (2, 5) and (out.log_probs == 0).all() and (out.entropy == 0).all()

"""The fused head against a float64 oracle: values, gradients, options, edge cases, errors, batch invariance.

The Triton backend runs on CUDA when there is one, else in the Triton interpreter (tests/conftest.py), where
the tiles are small (16 tokens x 32 vocabulary entries x 16 hidden, 3 splits) so that small shapes still cross
tiles, splits and row groups.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppo_logprobs.workers import FusedLinearForPPO, fused_log_probs

from .reference import assert_same_bits, reference_log_probs

BACKENDS = ["torch", "triton"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# max |error| / (1 + max |logit|) allowed on outputs; fp32 accumulation lands near 1e-7
OUT_TOL = 2e-6
# relative norm error allowed on gradients, by input dtype (the gradient is rounded to that dtype at the end,
# and the Triton backend rounds d_logits to it too)
GRAD_TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def make_inputs(n, h, v, dtype=torch.bfloat16, seed=0, scale=1.0, shape=None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * (scale / math.sqrt(h))
    labels = torch.randint(0, v, (n,), generator=g)
    hidden, weight, labels = hidden.to(DEVICE, dtype), weight.to(DEVICE, dtype), labels.to(DEVICE)
    if shape is not None:
        hidden, labels = hidden.view(*shape, h), labels.view(shape)
    return hidden, weight, labels


def assert_close_to_reference(lp, ent, hidden, weight, labels, temperature=1.0, ignore_index=-100):
    ref_lp, ref_ent = reference_log_probs(hidden, weight, labels, temperature, ignore_index)
    assert lp.dtype == torch.float32 and lp.shape == labels.shape
    assert torch.isfinite(lp).all() and (lp <= 1e-6).all()
    scale = 1.0 + float((hidden.double() @ weight.double().T).abs().max())
    if isinstance(temperature, torch.Tensor):
        scale /= float(temperature.min())
    else:
        scale /= temperature
    assert (lp.double() - ref_lp).abs().max() <= OUT_TOL * scale
    if ent is not None:
        assert ent.dtype == torch.float32 and ent.shape == labels.shape
        assert torch.isfinite(ent).all()
        assert (ent.double() - ref_ent).abs().max() <= OUT_TOL * scale


def rel_err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,h,v", [(1, 16, 7), (37, 40, 203), (64, 24, 97), (130, 48, 257)])
def test_outputs_match_float64(backend, dtype, n, h, v):
    hidden, weight, labels = make_inputs(n, h, v, dtype, seed=n + v)
    lp, ent = fused_log_probs(hidden, weight, labels, backend=backend)
    assert_close_to_reference(lp, ent, hidden, weight, labels)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("which", ["both", "log_probs", "entropy"])
def test_gradients_match_float64(backend, dtype, which):
    hidden, weight, labels = make_inputs(45, 40, 203, dtype, seed=3, shape=(5, 9))
    labels[1, 2] = -100
    temperature = torch.rand(5, 9, generator=torch.Generator().manual_seed(1)).to(DEVICE) + 0.5
    g = torch.Generator().manual_seed(2)
    g_lp = torch.randn(5, 9, generator=g).to(DEVICE) * (which != "entropy")
    g_ent = torch.randn(5, 9, generator=g).to(DEVICE) * (which != "log_probs")

    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = fused_log_probs(h1, w1, labels, temperature, backend=backend, chunk_size=16)  # torch: 3 chunks
    loss = (lp * g_lp).sum() if which == "log_probs" else (lp * g_lp + ent * g_ent).sum()
    loss.backward()

    h2, w2 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref_lp, ref_ent = reference_log_probs(h2, w2, labels, temperature)
    (ref_lp * g_lp + ref_ent * g_ent).sum().backward()

    assert h1.grad.dtype == dtype and w1.grad.dtype == dtype
    assert rel_err(h1.grad, h2.grad) <= GRAD_TOL[dtype]
    assert rel_err(w1.grad, w2.grad) <= GRAD_TOL[dtype]
    assert (h1.grad[1, 2] == 0).all()  # an ignored token gets no gradient


def test_triton_backward_vocabulary_chunks_agree():
    """The Triton backward writes d_logits one vocabulary chunk at a time; the chunking must not matter."""
    from ppo_logprobs.workers.head.triton_log_probs_backward import triton_log_probs_backward
    from ppo_logprobs.workers.head.triton_log_probs_forward import triton_log_probs_forward

    hidden, weight, labels = make_inputs(50, 32, 203, torch.float32, seed=14)
    inv_t = torch.full((50,), 0.8, device=DEVICE)
    lp, ent, lse, _ = triton_log_probs_forward(hidden, weight, labels, inv_t, ignore_index=-100, compute_entropy=True)
    g = torch.randn(2, 50, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    args = (hidden, weight, labels, inv_t, lse, ent, g[0], g[1])
    whole = triton_log_probs_backward(*args, ignore_index=-100)
    for chunk_bytes in (50 * 4 * 32, 50 * 4 * 100):  # one tile per chunk; chunks not a multiple of V
        parts = triton_log_probs_backward(*args, ignore_index=-100, chunk_bytes=chunk_bytes)
        torch.testing.assert_close(parts[0], whole[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(parts[1], whole[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_copy_engine_and_pointer_reads_agree(dtype):
    """Tiles read through tensor descriptors (where H allows) and through pointers give the same numbers."""
    from dataclasses import replace

    from ppo_logprobs.workers.head.triton_log_probs_forward import tile_config, tile_operands, triton_log_probs_forward

    hidden, weight, labels = make_inputs(40, 40, 203, dtype, seed=15)
    inv_t = torch.ones(40, device=DEVICE)
    cfg = tile_config(dtype)
    if not tile_operands(hidden, weight, cfg)[2]:
        pytest.skip("this device has no tensor-descriptor path")
    outs = [
        triton_log_probs_forward(hidden, weight, labels, inv_t, ignore_index=-100, compute_entropy=True, config=c)
        for c in (cfg, replace(cfg, tma=False))
    ]
    for a, b in zip(*(out[:3] for out in outs), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_the_needed_gradient_is_computed(backend):
    hidden, weight, labels = make_inputs(20, 16, 40, torch.float32, seed=5)
    h = hidden.clone().requires_grad_()
    lp, _ = fused_log_probs(h, weight, labels, backend=backend, compute_entropy=False)
    lp.sum().backward()
    h2 = hidden.double().requires_grad_()
    reference_log_probs(h2, weight, labels)[0].sum().backward()
    assert weight.grad is None
    assert rel_err(h.grad, h2.grad) <= GRAD_TOL[torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
def test_temperature_float_and_tensor(backend):
    hidden, weight, labels = make_inputs(33, 16, 70, torch.float32, seed=7)
    lp, ent = fused_log_probs(hidden, weight, labels, 0.7, backend=backend)
    assert_close_to_reference(lp, ent, hidden, weight, labels, 0.7)
    temps = torch.linspace(0.25, 4.0, 33, device=DEVICE)
    lp, ent = fused_log_probs(hidden, weight, labels, temps, backend=backend)
    assert_close_to_reference(lp, ent, hidden, weight, labels, temps)
    # a per-token temperature equals scoring each token alone at its own temperature
    for i in (0, 16, 32):
        one = slice(i, i + 1)
        one_lp, one_ent = fused_log_probs(hidden[one], weight, labels[one], float(temps[i]), backend=backend)
        torch.testing.assert_close(one_lp[0], lp[i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(one_ent[0], ent[i], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_final_logit_softcap(backend, dtype):
    """Gemma's cap: z = softcap * tanh(logits / softcap), then the temperature; values and gradients."""
    hidden, weight, labels = make_inputs(45, 40, 203, dtype, seed=16, scale=40.0)  # logits well past the cap
    temps = torch.rand(45, generator=torch.Generator().manual_seed(6)).to(DEVICE) + 0.5
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = fused_log_probs(h1, w1, labels, temps, backend=backend, softcap=30.0, chunk_size=16)
    h2, w2 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref_lp, ref_ent = reference_log_probs(h2, w2, labels, temps, softcap=30.0)
    # the capped logits are within 30 / 0.5 = 60 of zero
    assert (lp.double() - ref_lp).abs().max() <= OUT_TOL * 61
    assert (ent.double() - ref_ent).abs().max() <= OUT_TOL * 61
    g = torch.randn(2, 45, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    (lp * g[0] + ent * g[1]).sum().backward()
    (ref_lp * g[0] + ref_ent * g[1]).sum().backward()
    assert rel_err(h1.grad, h2.grad) <= GRAD_TOL[dtype]
    assert rel_err(w1.grad, w2.grad) <= GRAD_TOL[dtype]
    uncapped, _ = fused_log_probs(hidden, weight, labels, temps, backend=backend)
    assert (uncapped - lp).abs().max() > 1.0  # the cap matters at this scale


@pytest.mark.parametrize("backend", BACKENDS)
def test_ignore_index_gives_zero(backend):
    hidden, weight, labels = make_inputs(30, 16, 50, torch.bfloat16, seed=8)
    labels[::3] = -1
    lp, ent = fused_log_probs(hidden, weight, labels, backend=backend, ignore_index=-1)
    assert (lp[::3] == 0).all() and (ent[::3] == 0).all()
    assert (lp[1::3] < 0).all() and (ent[1::3] > 0).all()
    assert_close_to_reference(lp, ent, hidden, weight, labels, ignore_index=-1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_peaked_logits_in_the_thousands(backend, dtype):
    hidden, weight, labels = make_inputs(40, 32, 111, dtype, seed=9)
    weight = weight * 900.0  # |logits| in the thousands (computed in fp32: no fp16 overflow)
    logits = hidden.double() @ weight.double().T
    assert logits.abs().max() > 2000
    labels[:20] = logits[:20].argmax(-1)  # half the tokens take the peak
    lp, ent = fused_log_probs(hidden, weight, labels, backend=backend)
    assert_close_to_reference(lp, ent, hidden, weight, labels)
    assert (ent >= 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_negative_logits(backend):
    hidden, weight, labels = make_inputs(25, 16, 77, torch.float32, seed=10)
    hidden, weight = hidden.abs(), -weight.abs() * 50
    assert (hidden @ weight.T).max() < 0
    lp, ent = fused_log_probs(hidden, weight, labels, backend=backend)
    assert_close_to_reference(lp, ent, hidden, weight, labels)


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_entry_vocabulary(backend):
    hidden, weight, labels = make_inputs(9, 16, 1, torch.float32, seed=11)
    lp, ent = fused_log_probs(hidden, weight, labels, backend=backend)
    assert (lp == 0).all() and ent.abs().max() < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_invariance(backend):
    """A token's outputs are bitwise the same whatever else shares its call (within one ulp in the interpreter)."""
    if backend == "torch" and DEVICE == "cuda":
        # cuBLAS may split a product's reduction differently for different output tiles (seen on an H200), so a
        # token's logits depend on its row in the chunk. Triton, the CUDA default, fixes the order itself.
        pytest.skip("the torch backend is batch invariant on the CPU only")
    hidden, weight, labels = make_inputs(70, 40, 203, torch.bfloat16, seed=12)
    temps = torch.rand(70, generator=torch.Generator().manual_seed(3)).to(DEVICE) + 0.5
    lp, ent = fused_log_probs(hidden, weight, labels, temps, backend=backend)
    perm = torch.randperm(70, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    interpreted = backend == "triton" and DEVICE == "cpu"
    for idx in (perm, perm[:1], perm[:17], perm[5:40], torch.tensor([69, 0, 69], device=DEVICE)):
        sub_lp, sub_ent = fused_log_probs(hidden[idx], weight, labels[idx], temps[idx], backend=backend)
        assert_same_bits(sub_lp, lp[idx], interpreted)
        assert_same_bits(sub_ent, ent[idx], interpreted)
    # the shape of the batch does not matter either
    lp3, ent3 = fused_log_probs(hidden.view(7, 10, 40), weight, labels.view(7, 10), temps.view(7, 10), backend=backend)
    assert_same_bits(lp3.flatten(), lp, interpreted)
    assert_same_bits(ent3.flatten(), ent, interpreted)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_agree_and_module(backend):
    hidden, weight, labels = make_inputs(24, 32, 90, torch.float32, seed=13, shape=(4, 6))
    head = FusedLinearForPPO(chunk_size=5, backend=backend)
    lp, ent = head(hidden, weight, labels, temperature=1.3)
    other = "torch" if backend == "triton" else "triton"
    lp2, ent2 = fused_log_probs(hidden, weight, labels, 1.3, backend=other)
    torch.testing.assert_close(lp, lp2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent2, rtol=1e-5, atol=1e-5)
    assert "chunk_size=5" in repr(head)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    hidden, weight, _ = make_inputs(1, 16, 10, torch.float32)
    labels = torch.zeros(0, 3, dtype=torch.long, device=DEVICE)
    h = torch.zeros(0, 3, 16, device=DEVICE, requires_grad=True)
    lp, ent = fused_log_probs(h, weight, labels, backend=backend)
    assert lp.shape == (0, 3) and ent.shape == (0, 3)
    lp.sum().backward()
    assert h.grad.shape == h.shape


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 40),
    h=st.integers(1, 50),
    v=st.integers(2, 150),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    temperature=st.floats(0.3, 3.0),
    backend=st.sampled_from(BACKENDS),
    seed=st.integers(0, 2**16),
)
def test_property_matches_oracle_and_bounds(n, h, v, dtype, temperature, backend, seed):
    hidden, weight, labels = make_inputs(n, h, v, dtype, seed=seed, scale=3.0)
    lp, ent = fused_log_probs(hidden, weight, labels, temperature, backend=backend)
    assert_close_to_reference(lp, ent, hidden, weight, labels, temperature)
    assert (ent >= -1e-5).all() and (ent <= math.log(v) + 1e-5).all()


# ---- errors: named field, position and value, raised before any kernel runs ----


def test_label_out_of_range_is_named():
    hidden, weight, labels = make_inputs(12, 16, 10, torch.float32, shape=(3, 4))
    labels[2, 1] = 10
    with pytest.raises(ValueError, match=r"labels\[2, 1\] = 10 is outside the vocabulary \[0, 10\)"):
        fused_log_probs(hidden, weight, labels)
    labels[2, 1] = -5
    with pytest.raises(ValueError, match=r"labels\[2, 1\] = -5 .*ignore_index \(-100\)"):
        fused_log_probs(hidden, weight, labels)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_temperature_is_refused(bad):
    hidden, weight, labels = make_inputs(6, 16, 10, torch.float32)
    with pytest.raises(ValueError, match="temperature must be a positive finite number"):
        fused_log_probs(hidden, weight, labels, bad)
    temps = torch.ones(6, device=DEVICE)
    temps[4] = bad
    with pytest.raises(ValueError, match=r"temperature\[4\] = .* must be a positive finite number"):
        fused_log_probs(hidden, weight, labels, temps)
    with pytest.raises(ValueError, match="shape of labels"):
        fused_log_probs(hidden, weight, labels, torch.ones(5, device=DEVICE))


def test_shape_dtype_and_backend_errors(monkeypatch):
    hidden, weight, labels = make_inputs(6, 16, 10, torch.float32)
    with pytest.raises(ValueError, match="H = weight.shape"):
        fused_log_probs(hidden[:, :15], weight, labels)
    with pytest.raises(ValueError, match="labels must have shape"):
        fused_log_probs(hidden, weight, labels[:5])
    with pytest.raises(ValueError, match="integer tensor"):
        fused_log_probs(hidden, weight, labels.float())
    with pytest.raises(ValueError, match="share a dtype"):
        fused_log_probs(hidden, weight.half(), labels)
    with pytest.raises(ValueError, match="not supported by backend 'triton'"):
        fused_log_probs(hidden.double(), weight.double(), labels, backend="triton")
    with pytest.raises(ValueError, match="backend must be"):
        fused_log_probs(hidden, weight, labels, backend="cuda")
    with pytest.raises(ValueError, match="chunk_size"):
        fused_log_probs(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="softcap must be None or a positive finite number, got -1"):
        fused_log_probs(hidden, weight, labels, softcap=-1.0)
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            fused_log_probs(hidden, weight, labels, backend="triton")

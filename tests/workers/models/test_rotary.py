"""The Triton rotary embedding against HF's apply_rotary_pos_emb (to the bit) and a float64 oracle."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ppo_logprobs.workers.models.rotary import rotary, rotary_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(t, h, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, d, generator=g).to(DEVICE, dtype)
    angle = torch.rand(t, d // 2, generator=g) * 100
    angle = torch.cat([angle, angle], -1)
    return x, angle.cos().to(DEVICE, dtype), angle.sin().to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 2), (7, 3, 16), (33, 5, 96), (20, 2, 128)])
def test_matches_hf_and_the_oracle(dtype, shape):
    x, cos, sin = inputs(*shape, dtype)
    out = rotary(x, cos, sin)
    hf, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    hf = hf[0].transpose(0, 1)  # [T, H, D]
    assert out.shape == x.shape and out.dtype == dtype
    assert torch.equal(out, hf)  # the same three roundings
    oracle = rotary_reference(x.double(), cos.double(), sin.double())
    tol = 1e-6 if dtype == torch.float32 else 2**-6
    assert ((out.double() - oracle).abs() / oracle.abs().clamp(min=1)).max() <= tol
    assert torch.equal(rotary_reference(x, cos, sin), hf)  # the torch formula is HF's


def test_a_token_has_the_same_bits_in_any_call():
    x, cos, sin = inputs(40, 4, 32, torch.bfloat16, seed=2)
    whole = rotary(x, cos, sin)
    assert torch.equal(rotary(x[13:14], cos[13:14], sin[13:14]), whole[13:14])
    assert torch.equal(rotary(x[5:29], cos[5:29], sin[5:29]), whole[5:29])


def test_gradient_equals_the_torch_formula():
    x, cos, sin = inputs(9, 3, 8, torch.float32, seed=3)
    grad = torch.randn(9, 3, 8, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    rotary(a, cos, sin).backward(grad)
    rotary_reference(b, cos, sin).backward(grad)
    torch.testing.assert_close(a.grad, b.grad)


def test_bad_shapes_are_refused():
    x, cos, sin = inputs(4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match=r"cos, sin \[T, D\]; got x \(4, 2, 8\), cos \(4, 6\)"):
        rotary(x, cos[:, :6], sin[:, :6])


@pytest.mark.parametrize("style", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_head_norm_in_the_same_pass_is_the_norm_then_the_rotation(style, dtype):
    """Qwen3's and Gemma 3's q/k norms in the rotary kernel: the separate kernels' result (RMSNorm, then rotary) within
    fp32's rounding, the float64 formula within bf16's (the norm's sum runs in another order: in bf16 a normed value
    may land an ulp away, and the rotation mixes two); and a token's bits in any call."""
    from ppo_logprobs.workers.models.rms_norm import rms_norm

    x, cos, sin = inputs(37, 5, 96, dtype, seed=5)
    weight = (torch.rand(96, generator=torch.Generator().manual_seed(6)) + 0.5).to(DEVICE, dtype)
    fused = rotary(x, cos, sin, (weight, 1e-6, style))
    apart = rotary(rms_norm(x, weight, 1e-6, style), cos, sin)
    oracle = rotary_reference(rms_norm(x.double(), weight.double(), 1e-6, style), cos.double(), sin.double())
    if dtype == torch.float32:
        torch.testing.assert_close(fused, apart, rtol=1e-6, atol=1e-6)
    ulps = (fused.double() - oracle).abs() / torch.finfo(dtype).eps / oracle.abs().clamp(min=1)
    assert ulps.max() <= (8 if dtype == torch.float32 else 4), ulps.max()
    assert torch.equal(rotary(x[11:12], cos[11:12], sin[11:12], (weight, 1e-6, style)), fused[11:12])


def test_the_gradients_through_a_head_norm_are_the_formulas():
    from ppo_logprobs.workers.models.rms_norm import rms_norm_reference

    x, cos, sin = inputs(9, 3, 8, torch.float32, seed=7)
    grad = torch.randn(9, 3, 8, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    weight = torch.rand(8, generator=torch.Generator().manual_seed(9)).to(DEVICE) + 0.5
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    wa, wb = weight.clone().requires_grad_(), weight.clone().requires_grad_()
    rotary(a, cos, sin, (wa, 1e-6, "llama")).backward(grad)
    rotary_reference(rms_norm_reference(b, wb, 1e-6, "llama"), cos, sin).backward(grad)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(wa.grad, wb.grad, rtol=1e-5, atol=1e-6)


def test_a_head_norm_of_another_width_is_refused():
    x, cos, sin = inputs(4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match=r"norm's weight must be \[8\] for x of shape \(4, 2, 8\), got \(6,\)"):
        rotary(x, cos, sin, (torch.ones(6, device=DEVICE), 1e-6, "llama"))

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

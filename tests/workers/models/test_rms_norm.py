"""The Triton RMSNorm against a float64 oracle and HF's own modules: values, gradients, batch invariance, errors.

On CPU the kernel runs in the Triton interpreter (tests/conftest.py)."""

import pytest
import torch
import transformers

from ppo_logprobs.workers.head.triton_log_probs_forward import interpreting
from ppo_logprobs.workers.models.rms_norm import rms_norm, rms_norm_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# relative error of a bf16 result rounded twice (as HF's "llama" formula does); the Triton interpreter truncates
# where the GPU rounds to nearest, which doubles it
BF16_TOL = 2**-7 * (2 if interpreting() else 1)


def oracle(x, weight, eps, style):
    x64, w64 = x.double(), weight.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return normed * (1 + w64) if style == "gemma" else normed * w64


def inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(DEVICE, dtype)
    return x, w


@pytest.mark.parametrize("style", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 7), (5, 37), (3, 4, 100), (9, 1030)])
def test_matches_the_oracle_and_the_torch_formula(style, dtype, shape):
    x, w = inputs(shape, dtype)
    out = rms_norm(x, w, 1e-6, style)
    assert out.shape == x.shape and out.dtype == dtype
    # within the rounding of the output dtype (plus HF's intermediate rounding to it for "llama")
    tol = 2e-6 if dtype == torch.float32 else BF16_TOL
    scale = oracle(x, w, 1e-6, style).abs().clamp(min=1)
    assert ((out.double() - oracle(x, w, 1e-6, style)).abs() / scale).max() <= tol
    ref = rms_norm_reference(x, w, 1e-6, style)
    assert ((out.double() - ref.double()).abs() / scale).max() <= tol


@pytest.mark.parametrize("style", ["llama", "gemma"])
def test_a_row_has_the_same_bits_in_any_batch(style):
    x, w = inputs((13, 96), torch.bfloat16, seed=3)
    whole = rms_norm(x, w, 1e-5, style)
    for lo, hi in [(0, 1), (4, 5), (2, 9), (12, 13)]:
        assert torch.equal(rms_norm(x[lo:hi], w, 1e-5, style), whole[lo:hi])


@pytest.mark.parametrize("style", ["llama", "gemma"])
def test_gradients_equal_the_torch_formula(style):
    x, w = inputs((6, 33), torch.float32, seed=5)
    grad = torch.randn(6, 33, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    rms_norm(xa, wa, 1e-6, style).backward(grad)
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    rms_norm_reference(xb, wb, 1e-6, style).backward(grad)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(wa.grad, wb.grad, rtol=1e-5, atol=1e-6)
    xc = x.clone().requires_grad_()  # a frozen weight: gradient for x only
    rms_norm(xc, w, 1e-6, style).backward(grad)
    torch.testing.assert_close(xc.grad, xb.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls, style", [(transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm, "llama"),
                                        (transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm, "gemma")])
def test_the_hf_module_is_the_formula(cls, style):
    """The torch formula here is HF's: a change in a new transformers release fails here, not silently."""
    module = cls(40, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        module.weight.normal_()
    x = torch.randn(3, 40, device=DEVICE, dtype=torch.bfloat16)
    module = module.to(torch.bfloat16)
    assert torch.equal(module(x), rms_norm_reference(x, module.weight, 1e-5, style))


def test_a_weight_of_another_size_is_refused():
    x, w = inputs((2, 8), torch.float32)
    with pytest.raises(ValueError, match=r"weight must be \[8\].*got \(9,\)"):
        rms_norm(x, torch.ones(9, device=DEVICE), 1e-6)

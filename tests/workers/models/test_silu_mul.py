"""The Triton silu(gate) * up against HF's two steps and a float64 oracle: values, gradients, errors."""

import pytest
import torch
from torch.nn import functional as F

from ppo_logprobs.workers.head.triton_log_probs_forward import interpreting
from ppo_logprobs.workers.models.silu_mul import silu_mul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (3, 37), (2, 5, 1001)])
def test_matches_hf_and_the_oracle(dtype, shape):
    g = torch.Generator().manual_seed(0)
    gate = (torch.randn(shape, generator=g) * 4).to(DEVICE, dtype)
    up = torch.randn(shape, generator=g).to(DEVICE, dtype)
    out = silu_mul(gate, up)
    assert out.shape == gate.shape and out.dtype == dtype
    hf = F.silu(gate) * up
    oracle = F.silu(gate.double()) * up.double()
    # two roundings to bf16, as HF's; the Triton interpreter truncates where the GPU rounds to nearest
    ulp = 2e-6 if dtype == torch.float32 else 2**-8 * (2 if interpreting() else 1)
    assert ((out.double() - oracle).abs() / oracle.abs().clamp(min=1)).max() <= 2 * ulp
    assert ((out.double() - hf.double()).abs() / oracle.abs().clamp(min=1)).max() <= 2 * ulp


def test_gradients_equal_hf():
    g = torch.Generator().manual_seed(1)
    gate, up, grad = (torch.randn(4, 29, generator=g).to(DEVICE) for _ in range(3))
    a, b = gate.clone().requires_grad_(), up.clone().requires_grad_()
    silu_mul(a, b).backward(grad)
    c, d = gate.clone().requires_grad_(), up.clone().requires_grad_()
    (F.silu(c) * d).backward(grad)
    torch.testing.assert_close(a.grad, c.grad)
    torch.testing.assert_close(b.grad, d.grad)


def test_mismatched_inputs_are_refused():
    with pytest.raises(ValueError, match=r"gate and up must match.*\(2, 3\).*\(2, 4\)"):
        silu_mul(torch.ones(2, 3, device=DEVICE), torch.ones(2, 4, device=DEVICE))

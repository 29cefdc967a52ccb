"""The fused softmax top-k router (workers/models/router.py) against its torch formula and HF's routers: the same
experts in the same order, weights within fp32 rounding, ties to the lower id, a token's routing whatever shares
its call, the formula's gradients, and routers of each family patched in."""

import pytest
import torch
import transformers

from ppo_logprobs.workers.models.fuse_body import fuse_body
from ppo_logprobs.workers.models.router import route, route_reference
from tests.workers.models.test_experts import SMALL, qwen3_moe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("experts,k", [(8, 1), (8, 2), (60, 4), (128, 8), (8, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_is_the_formula(experts, k, renormalize):
    logits = torch.randn(37, experts, generator=torch.Generator().manual_seed(experts + k)).to(DEVICE) * 3
    weights, index = route(logits, k, renormalize, torch.float32)
    want_weights, want_index = route_reference(logits, k, renormalize, torch.float32)
    assert torch.equal(index, want_index)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(37, device=DEVICE))


def test_ties_go_to_the_lower_expert_and_weights_take_the_dtype_asked():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0], [1.0, 1.0, 1.0, 1.0, 1.0]], device=DEVICE)
    weights, index = route(logits, 3, False, torch.bfloat16)
    assert index.tolist() == [[1, 2, 4], [0, 1, 2]]
    assert weights.dtype == torch.bfloat16
    torch.testing.assert_close(weights[1].float(), torch.full((3,), 0.2, device=DEVICE), rtol=0, atol=1e-3)


def test_a_tokens_routing_does_not_depend_on_its_neighbours():
    logits = torch.randn(300, 128, generator=torch.Generator().manual_seed(3)).to(DEVICE).bfloat16()
    weights, index = route(logits, 8, True, torch.bfloat16)
    for i in (0, 63, 64, 299):
        alone_w, alone_i = route(logits[i : i + 1], 8, True, torch.bfloat16)
        assert torch.equal(alone_i[0], index[i])
        assert torch.equal(alone_w[0], weights[i])


def test_gradients_are_the_formulas():
    logits = torch.randn(19, 16, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    grad = torch.randn(19, 4, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    got, want = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    (route(got, 4, True, torch.float32)[0] * grad).sum().backward()
    (route_reference(want, 4, True, torch.float32)[0] * grad).sum().backward()
    torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)


def test_a_top_k_wider_than_the_experts_is_refused():
    with pytest.raises(ValueError, match=r"at least k = 9 experts, got \(5, 8\)"):
        route(torch.zeros(5, 8), 9, True, torch.float32)


def _mixtral():
    config = transformers.MixtralConfig(**SMALL, num_local_experts=8, num_experts_per_tok=2, intermediate_size=24)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).eval()


def _qwen2_moe():
    config = transformers.Qwen2MoeConfig(**SMALL, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=24,
                                         shared_expert_intermediate_size=40, intermediate_size=48,
                                         norm_topk_prob=False)
    torch.manual_seed(0)
    return transformers.Qwen2MoeForCausalLM(config).eval()


@pytest.mark.parametrize("build", [lambda: qwen3_moe(8), _qwen2_moe, _mixtral], ids=["qwen3_moe", "qwen2_moe",
                                                                                     "mixtral"])
def test_each_familys_router_patched_in_is_hfs(build):
    """Qwen3-MoE (top 8, renormalised, weights in the logits' dtype), Qwen2-MoE (60 experts, not renormalised) and
    Mixtral (always renormalised, fp32 weights)."""
    model = build().to(DEVICE)
    fuse_body(model, backend="triton")
    router = model.model.layers[1].mlp.gate
    assert "forward" in router.__dict__
    hidden = torch.randn(29, 32, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    with torch.no_grad():
        logits, weights, index = router(hidden)
        want_logits, want_weights, want_index = type(router).forward(router, hidden)
    assert torch.equal(logits, want_logits) and torch.equal(index, want_index)
    assert weights.dtype == want_weights.dtype
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)

"""The vocab-parallel head: two CPU processes (gloo), each with half the vocabulary (an odd V, so the halves
differ), against the single-device head and a float64 oracle: values, gradients, ignore_index, per-token
temperature, softcap, no entropy, batch invariance, the same bits on both ranks; top-k, tail and candidates."""

import pytest
import torch
import torch.distributed as dist

from ppo_logprobs.workers import fused_log_probs
from ppo_logprobs.workers.head.triton_log_probs_forward import interpreting
from tests.helpers import free_port, ranks

from .reference import assert_same_bits, reference_log_probs

WORLD = 2
BACKENDS = ["torch"] + (["triton"] if interpreting() else [])
OUT_TOL = 2e-6  # as test_fused_log_probs: max |error| / (1 + max |logit|)
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def inputs(n, h, v, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * scale / h**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    temps = torch.rand(n, generator=g) + 0.5
    return hidden, weight, labels, temps


def same_on_every_rank(x):
    parts = [torch.empty_like(x) for _ in range(WORLD)]
    dist.all_gather(parts, x.contiguous())
    return all(torch.equal(p, parts[0]) for p in parts)


def check(rank, backend, dtype, softcap, ignore_index, device="cpu"):
    n, h, v = 37, 24, 503
    made = inputs(n, h, v, dtype, seed=5, scale=20.0 if softcap else 1.0)
    hidden, weight, labels, temps = (t.to(device) for t in made)
    labels[::5] = ignore_index
    labels[1] = 250  # the first row of rank 1 (503 = 252 + 251)
    labels[2] = 251  # the last row of rank 0
    rows = torch.tensor_split(torch.arange(v), WORLD)[rank]
    mine = weight[rows].clone().requires_grad_()
    h1 = hidden.clone().requires_grad_()
    kw = dict(backend=backend, softcap=softcap, ignore_index=ignore_index, chunk_size=16)
    lp, ent = fused_log_probs(h1, mine, labels, temps, process_group=dist.group.WORLD, **kw)
    assert same_on_every_rank(lp) and same_on_every_rank(ent)

    logits = hidden.double() @ weight.double().T
    scale = 1 + float((softcap * torch.tanh(logits / softcap) if softcap else logits).abs().max()) / 0.5
    one_lp, one_ent = fused_log_probs(hidden, weight, labels, temps, **kw)  # the single-device head
    torch.testing.assert_close(lp, one_lp, rtol=0, atol=OUT_TOL * scale)
    torch.testing.assert_close(ent, one_ent, rtol=0, atol=OUT_TOL * scale)
    h2, w2 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref_lp, ref_ent = reference_log_probs(h2, w2, labels, temps, ignore_index=ignore_index, softcap=softcap)
    assert (lp.double() - ref_lp).abs().max() <= OUT_TOL * scale
    assert (ent.double() - ref_ent).abs().max() <= OUT_TOL * scale
    assert (lp[::5] == 0).all() and (ent[::5] == 0).all()

    g = torch.randn(2, n, generator=torch.Generator().manual_seed(7)).to(device)
    (lp * g[0] + ent * g[1]).sum().backward()
    (ref_lp * g[0] + ref_ent * g[1]).sum().backward()
    err = lambda a, b: float((a.double() - b).norm() / b.norm())  # noqa: E731
    assert err(h1.grad, h2.grad) <= GRAD_TOL[dtype]  # d_hidden comes back whole
    assert err(mine.grad, w2.grad[rows]) <= GRAD_TOL[dtype]  # d_weight: this rank's rows
    assert (h1.grad[::5] == 0).all()

    # batch invariant: a token's bits do not depend on the other tokens of the call
    idx = torch.tensor([3, 1, 30], device=device)
    sub_lp, sub_ent = fused_log_probs(hidden[idx], mine.detach(), labels[idx], temps[idx],
                                      process_group=dist.group.WORLD, **kw)
    interpreted = backend == "triton" and device == "cpu"
    assert_same_bits(sub_lp, lp.detach()[idx], interpreted)
    assert_same_bits(sub_ent, ent.detach()[idx], interpreted)
    no_ent_lp, none = fused_log_probs(hidden, mine.detach(), labels, temps, process_group=dist.group.WORLD,
                                      compute_entropy=False, **kw)
    assert none is None
    torch.testing.assert_close(no_ent_lp, lp.detach(), rtol=0, atol=1e-6)

    # top-k, the tail and candidates (ids on both sides of the cut): each rank's lists merged in rank order (the
    # merge is the same for both backends; test_top_k.py checks each backend's own lists, so the interpreter is spared)
    if backend == "torch":
        asked = dict(top_k=5, token_ids=torch.tensor([250, 251, 0, 502, 251], device=device))
        both = fused_log_probs(hidden, mine.detach(), labels, temps, process_group=dist.group.WORLD, **asked, **kw)
        one = fused_log_probs(hidden, weight, labels, temps, **asked, **kw)
        assert torch.equal(both.top_ids, one.top_ids) and same_on_every_rank(both.top_ids)
        for name in ("top_log_probs", "tail_log_prob", "candidate_log_probs"):
            assert same_on_every_rank(getattr(both, name)), name
            torch.testing.assert_close(getattr(both, name), getattr(one, name), rtol=0, atol=OUT_TOL * scale)

    bad = labels.clone()
    bad[4] = v  # global ids: V is the whole vocabulary, not this rank's rows
    with pytest.raises(ValueError, match=r"labels\[4\] = 503 is outside the vocabulary \[0, 503\)"):
        fused_log_probs(hidden, mine.detach(), bad, process_group=dist.group.WORLD, **kw)


def run(rank, port, cases):
    if any("cuda" in case for case in cases):
        torch.cuda.set_device(0)
    # one thread a rank: a CPU BLAS that splits a product over threads may split it otherwise when the machine is
    # loaded, and the bits of a sub-batch then move (seen once, with another test run beside this one)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        for case in cases:
            check(rank, *case)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_ranks_match_one_device_and_the_oracle(backend):
    cases = [(backend, dtype, softcap, ignore_index) for dtype in (torch.float32, torch.bfloat16)
             for softcap, ignore_index in ((None, -100), (30.0, 7))]  # 7: an ignore_index that is a valid row
    ranks(run, (free_port(), cases), WORLD)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_ranks_on_cuda_match_one_device_and_the_oracle():
    """The Triton kernels compiled for the GPU; both ranks on one GPU (gloo carries CUDA tensors)."""
    cases = [("triton", dtype, softcap, ignore_index, "cuda") for dtype in (torch.float32, torch.bfloat16)
             for softcap, ignore_index in ((None, -100), (30.0, 7))]
    ranks(run, (free_port(), cases), WORLD)

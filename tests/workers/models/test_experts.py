"""Mixture-of-experts layers (workers/models/experts.py) against HF's own experts (fp32, tiny configs): tokens
sorted by expert, grouped products, the combine in rank order; top-k 1, 2 and 8, an expert without tokens, every
token to one expert, the "no expert" mark; and patched MoE models (Qwen3-MoE, and Qwen2-MoE with its shared expert)
against HF's forward."""

import pytest
import torch
import transformers

from ppo_logprobs.workers import patch_model
from ppo_logprobs.workers.models.experts import experts_forward, grouped_linear, sort_by_expert

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, pad_token_id=0, head_dim=8)


def qwen3_moe(top_k: int, experts: int = 8, **extra):
    config = transformers.Qwen3MoeConfig(**SMALL, num_experts=experts, num_experts_per_tok=top_k,
                                         moe_intermediate_size=24, intermediate_size=48, **extra)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # experts and routers far enough from their initial values to matter
        for name, p in model.named_parameters():
            if p.dim() == 3 or "mlp.gate" in name:
                p.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_assignments_sorted_by_expert_then_token_and_rank(backend):
    index = torch.tensor([[3, 0], [0, 3], [8, 1], [3, 1]])  # (8: HF's mark of no expert, with 8 experts)
    order, source, position, counts = sort_by_expert(index.to(DEVICE), 8, backend)
    # assignment t * 2 + r: expert 0 got (t0 r1), (t1 r0); 1 got (t2 r1), (t3 r1); 3 got three; "none" comes last
    assert order.tolist() == [1, 2, 5, 7, 0, 3, 6, 4]
    assert source.tolist() == [0, 1, 2, 3, 0, 1, 3, 2]
    assert position.tolist() == [4, 0, 1, 5, 7, 2, 6, 3]
    assert counts.tolist() == [2, 2, 0, 3, 0, 0, 0, 0, 1]


@pytest.mark.parametrize("groups,block_m,rows", [(6, 16, 80), (129, 128, 2400), (594, 16, 3000), (3, 4, 0)])
def test_the_schedule_kernel_gives_each_program_what_the_torch_statement_does(groups, block_m, rows):
    """group_schedule (one kernel) against group_schedule_reference: random counts, half the groups empty, every row
    in the last group, no rows at all; each program's group (-1 for the grid's spares), first row and end."""
    from ppo_logprobs.workers.head.triton_log_probs_forward import group_schedule, group_schedule_reference

    g = torch.Generator().manual_seed(groups)
    spread = torch.zeros(groups, dtype=torch.int64).index_add_(0, torch.randint(0, groups, (rows,), generator=g),
                                                               torch.ones(rows, dtype=torch.int64))
    half_empty = spread.clone()
    half_empty[: groups // 2] = 0
    half_empty[groups // 2] += rows - half_empty.sum()
    last = torch.zeros(groups, dtype=torch.int64)
    last[-1] = rows
    for counts in (spread, half_empty, last):
        got = group_schedule(counts.to(DEVICE), rows, block_m)
        want = group_schedule_reference(counts, rows, block_m)
        for name, a, b in zip(("group", "start", "end"), got, want, strict=True):
            assert torch.equal(a.cpu(), b), name


@pytest.mark.parametrize("experts,tokens,k", [(128, 75, 8), (60, 194, 4), (8, 375, 2)])
def test_the_counting_sort_kernel_places_every_assignment_as_a_stable_sort_does(experts, tokens, k, monkeypatch):
    """Assignments across several of the kernel's chunks (of 256 here, 1024 by default: any size gives the same
    places), skewed loads (half to one expert, some experts without any, some marked "none"): the kernel's places
    are torch's stable argsort's."""
    from ppo_logprobs.workers.models import experts as module
    monkeypatch.setattr(module, "_CHUNK", 256)  # (the interpreter sorts a chunk slowly)
    g = torch.Generator().manual_seed(experts)
    index = torch.randint(0, experts, (tokens, k), generator=g)
    index[: tokens // 2, 0] = 3
    index[index == 5] = 6
    index[::7, -1] = experts
    got = sort_by_expert(index.to(DEVICE), experts, "triton")
    want = sort_by_expert(index, experts, "torch")
    for name, a, b in zip(got._fields, got, want, strict=True):
        assert torch.equal(a.cpu(), b), name


def test_grouped_products_are_each_experts_matmul_on_odd_sizes():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(5, 7, 13, generator=g)  # 5 experts, out 7, in 13
    counts = [3, 0, 1, 6, 0, 2]  # an expert without rows; 2 rows of no expert at the end
    x = torch.randn(sum(counts), 13, generator=g)
    out = grouped_linear(x, weight, counts)
    lo = 0
    for e, n in enumerate(counts[:5]):
        torch.testing.assert_close(out[lo : lo + n], x[lo : lo + n] @ weight[e].T, rtol=0, atol=0)
        lo += n
    assert (out[lo:] == 0).all()


@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_experts_equal_hfs_for_any_top_k(top_k):
    model = qwen3_moe(top_k)
    block = model.model.layers[0].mlp
    hidden = torch.randn(23, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, weights, index = block.gate(hidden)
        want = type(block.experts).forward(block.experts, hidden, index, weights)
        got = experts_forward(block.experts, hidden, index, weights, backend="torch")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_one_expert_for_every_token_and_experts_without_any():
    block = qwen3_moe(2).model.layers[0].mlp
    hidden = torch.randn(9, 32, generator=torch.Generator().manual_seed(3))
    weights = torch.rand(9, 2, generator=torch.Generator().manual_seed(4))
    every = torch.full((9, 2), 5)  # every token's two ranks to expert 5: the other seven get nothing
    with torch.no_grad():
        want = type(block.experts).forward(block.experts, hidden, every, weights)
        torch.testing.assert_close(experts_forward(block.experts, hidden, every, weights, backend="torch"), want,
                                   rtol=0, atol=1e-5)
        # rank 1 marked "no expert" (index 8, as HF's eager loop skips it): rank 0 alone counts
        want = type(block.experts).forward(block.experts, hidden, every[:, :1] - 3, weights[:, :1])
        got = experts_forward(block.experts, hidden, torch.tensor([[2, 8]] * 9), weights, backend="torch")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_patched_moe_models_equal_hfs_forward_padded_and_packed(family):
    if family == "qwen3_moe":
        model = qwen3_moe(2)
    else:
        config = transformers.Qwen2MoeConfig(**SMALL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                                             shared_expert_intermediate_size=40, intermediate_size=48)
        torch.manual_seed(0)
        model = transformers.Qwen2MoeForCausalLM(config).eval()
    seqs = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in (11, 5, 8)]
    with torch.no_grad():
        alone = []
        for seq in seqs:
            log_p = type(model).forward(model, input_ids=seq[None]).logits[0].float().log_softmax(-1)
            alone.append(log_p[:-1].gather(-1, seq[1:, None])[:, 0])
        patch_model(model, backend="torch")
        packed = model(input_ids=torch.cat(seqs)[None],
                       position_ids=torch.cat([torch.arange(len(s)) for s in seqs])[None]).log_probs[0]
    at = 0
    for seq, want in zip(seqs, alone, strict=True):
        torch.testing.assert_close(packed[at : at + len(seq) - 1], want, rtol=0, atol=1e-5)
        at += len(seq)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gradients_are_hfs(backend):
    """The trainer's forward with grad goes through the same layer (on the Triton backend: the grouped kernels
    reading rows in place, and the combine kernel): gradients of the experts' weights, the routing weights and
    the input as HF's."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    block = qwen3_moe(2).model.layers[0].mlp.to(device)
    hidden = torch.randn(15, 32, generator=torch.Generator().manual_seed(5)).to(device)
    _, weights, index = block.gate(hidden)
    grads = []
    for forward in (type(block.experts).forward, lambda *a: experts_forward(*a, backend=backend)):
        x, w = hidden.clone().requires_grad_(), weights.detach().clone().requires_grad_()
        block.experts.zero_grad()
        (forward(block.experts, x, index, w) ** 2).sum().backward()
        grads.append((x.grad, w.grad, block.experts.gate_up_proj.grad.clone(), block.experts.down_proj.grad.clone()))
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_the_combine_kernel_sums_a_tokens_experts_in_rank_order_once_rounded():
    """combine: token t's rank-r output read at out[position[t, r]] (no copy in token order), weighted, summed in
    fp32 and rounded once, against float64; and its gradients those of the torch formula."""
    from ppo_logprobs.workers.models.grouped_gemm import combine

    g = torch.Generator().manual_seed(9)
    t, k, h = 13, 3, 37
    out = torch.randn(t * k + 2, h, generator=g).to(DEVICE, torch.bfloat16)  # (2 rows nobody reads)
    position = torch.randperm(t * k + 2, generator=g)[: t * k].view(t, k).to(DEVICE)
    weights = torch.rand(t, k, generator=g).to(DEVICE)
    got = combine(out, position, weights)
    want = (out[position].double() * weights.double()[..., None]).sum(1)
    assert got.dtype == torch.bfloat16
    terms = (out[position].double().abs() * weights.double()[..., None]).sum(1)
    # an fp32 sum rounded once to bf16: within one ulp (the Triton interpreter's rounding truncates)
    assert ((got.double() - want).abs() <= want.abs() * 2**-7 + terms * 2**-20).all()
    o32, w32 = out.float().requires_grad_(), weights.clone().requires_grad_()
    combine(o32, position, w32).pow(2).sum().backward()
    o_ref, w_ref = out.float().requires_grad_(), weights.clone().requires_grad_()
    (o_ref[position] * w_ref[..., None]).sum(1).pow(2).sum().backward()
    torch.testing.assert_close(o32.grad, o_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w32.grad, w_ref.grad, rtol=1e-5, atol=1e-5)


def test_the_combine_kernel_adds_a_residual_as_torch_adds_it_after():
    """combine(..., residual): `residual + combine(...)`'s bits (the sum rounded, the add in fp32 rounded once; in
    fp32 here, where the Triton interpreter's bf16 rounding truncates, and in bf16 on a GPU), the residual's gradient
    the output's, and a residual of the wrong shape or dtype refused by name."""
    from ppo_logprobs.workers.models.grouped_gemm import combine

    g = torch.Generator().manual_seed(11)
    t, k, h = 13, 3, 37
    position = torch.randperm(t * k, generator=g).view(t, k).to(DEVICE)
    weights = torch.rand(t, k, generator=g).to(DEVICE)
    for dtype in (torch.float32,) + ((torch.bfloat16,) if DEVICE == "cuda" else ()):
        out = (torch.randn(t * k, h, generator=g) * 4).to(DEVICE, dtype)
        residual = torch.randn(t, h, generator=g).to(DEVICE, dtype).requires_grad_()
        got = combine(out, position, weights, residual)
        assert got.dtype == dtype and torch.equal(got, residual + combine(out, position, weights)), dtype
        grad = torch.randn(t, h, generator=g).to(DEVICE, dtype)
        got.backward(grad)
        assert torch.equal(residual.grad, grad)
    with pytest.raises(ValueError, match=r"residual must be \[13, 37\] of torch.float32, got \(13, 36\)"):
        combine(out.float(), position, weights, torch.zeros(t, h - 1, device=DEVICE))


def test_the_gate_up_kernel_reads_gathered_rows_in_place():
    """grouped_gate_up(x, w, counts, source) is grouped_gate_up(x[source], w, counts), bit for bit, and gives x the
    gathered product's gradients (summed over a row read twice)."""
    from ppo_logprobs.workers.models.grouped_gemm import grouped_gate_up

    g = torch.Generator().manual_seed(10)
    x = torch.randn(9, 24, generator=g).to(DEVICE)
    gate_up = (torch.randn(3, 2 * 11, 24, generator=g) * 0.3).to(DEVICE)
    source = torch.tensor([4, 0, 8, 4, 1, 2, 7, 3, 0, 5, 6], device=DEVICE)  # (rows 0 and 4 twice)
    counts = [4, 0, 5, 2]  # (the last 2: no expert)
    in_place = grouped_gate_up(x, gate_up, counts, source=source)
    assert torch.equal(in_place, grouped_gate_up(x[source], gate_up, counts))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    grouped_gate_up(xa, gate_up, counts, source=source).sum().backward()
    grouped_gate_up(xb[source], gate_up, counts).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="counts sum to 11, the product has 10 rows"):
        grouped_gate_up(x, gate_up, counts, source=source[:10])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_kernel_is_each_experts_product_and_a_rows_bits_ignore_the_groups(dtype):
    """The Triton grouped GEMM (the interpreter off CUDA) against per-expert products in float64, on odd sizes with
    empty experts and rows of no expert; a row's result the same (within an ulp under the interpreter, bitwise
    on a GPU) whether its expert got 1 row or 37."""
    from ppo_logprobs.workers.models.grouped_gemm import grouped_gemm

    from ..head.reference import assert_same_bits

    g = torch.Generator().manual_seed(6)
    weight = torch.randn(5, 19, 45, generator=g).to(DEVICE, dtype)
    counts = [37, 0, 1, 20, 0, 3]
    x = torch.randn(sum(counts), 45, generator=g).to(DEVICE, dtype)
    out = grouped_gemm(x, weight, counts)
    lo = 0
    for e, n in enumerate(counts[:5]):
        want = x[lo : lo + n].double() @ weight[e].double().T
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[lo : lo + n].double(), want, rtol=tol, atol=tol)
        lo += n
    assert (out[lo:] == 0).all()
    alone = grouped_gemm(x[5:6], weight, [1, 0, 0, 0, 0, 0])  # row 5 of expert 0, now its only row
    assert_same_bits(alone[0].float(), out[5].float(), interpreted=DEVICE == "cpu")


def test_experts_through_the_grouped_kernel_equal_hfs():
    model = qwen3_moe(2).to(DEVICE)
    block = model.model.layers[1].mlp
    hidden = torch.randn(21, 32, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    with torch.no_grad():
        _, weights, index = block.gate(hidden)
        want = type(block.experts).forward(block.experts, hidden, index, weights)
        got = experts_forward(block.experts, hidden, index, weights, backend="triton")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_gate_up_kernel_is_the_product_then_silu_mul(dtype):
    """silu(gate) * up in the grouped kernel's epilogue: the unfused product's halves through silu_mul (the same
    roundings), and its gradients those of the torch formula."""
    from ppo_logprobs.workers.models.grouped_gemm import grouped_gate_up, grouped_gemm
    from ppo_logprobs.workers.models.silu_mul import silu_mul

    g = torch.Generator().manual_seed(8)
    gate_up = (torch.randn(4, 2 * 21, 33, generator=g) * 0.3).to(DEVICE, dtype)
    counts = [5, 0, 18, 2, 1]
    x = torch.randn(sum(counts), 33, generator=g).to(DEVICE, dtype)
    fused = grouped_gate_up(x, gate_up, counts)
    gate, up = grouped_gemm(x, gate_up, counts).chunk(2, dim=-1)
    want = silu_mul(gate.contiguous(), up.contiguous())
    tol = dict(rtol=0, atol=0) if DEVICE == "cuda" or dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(fused[:-1], want[:-1], **tol)
    assert (fused[-1] == 0).all()  # (the row of no expert)
    x32, w32 = x.float().requires_grad_(), gate_up.float().requires_grad_()
    grouped_gate_up(x32, w32, counts).sum().backward()
    xr, wr = x.float().requires_grad_(), gate_up.float().requires_grad_()
    lo, total = 0, 0
    for e, n in enumerate(counts[:4]):
        gr, ur = (xr[lo : lo + n] @ wr[e].T).chunk(2, dim=-1)
        total = total + (torch.nn.functional.silu(gr) * ur).sum()
        lo += n
    total.backward()
    torch.testing.assert_close(x32.grad, xr.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w32.grad, wr.grad, rtol=1e-4, atol=1e-4)

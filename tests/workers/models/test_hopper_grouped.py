"""hopper_grouped.py: a mixture's grouped products (gate/up with the SiLU middle, reading tokens' rows in place; down)
as a persistent Gluon GEMM. Built for sm_90a here; on a Hopper GPU against float64 on odd shapes (experts with no
rows, one row, rows across tiles, rows of no expert), against the Triton kernel, a row's bits whatever its expert's
other rows, and an MoE model taking it."""

from __future__ import annotations

import pytest
import torch

from ppo_logprobs.workers.models import grouped_gemm as gg
from ppo_logprobs.workers.models.causal_attention import hopper_kernels

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and hopper_kernels() is not None
NEEDS = "needs a Hopper GPU (and Triton 3.6 or later)"


@pytest.mark.skipif(hopper_kernels() is None, reason="Triton before 3.6")
def test_the_kernel_builds_for_sm90a_within_a_programs_shared_memory():
    """Compiled here for sm_90a (no GPU; a process without the interpreter), gate/up reading rows in place and down:
    each fits a Hopper program's shared memory and keeps a step of products in flight (wait_group 2); down spills
    nothing, gate/up at most 16 bytes (Triton 3.9's build of the gathering warps spills 12; 3.6's, what the GPU
    host runs, none)."""
    from .test_hopper_gated import builds_for_sm90a

    builds = builds_for_sm90a("from ppo_logprobs.workers.models import hopper_grouped as h\n"
                              "builds = [h.compile_sm90(gated, gather=gated) for gated in (True, False)]\n")
    assert len(builds) == 2, builds
    for shared, waits, *_ in builds:
        assert shared <= 232448 and waits, builds
    assert builds[0][2] <= 16 and builds[1][2] == 0, builds


def _inputs(experts: int, n: int, k: int, counts: list[int], dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(experts, n, k, generator=g) * k**-0.5).to("cuda", dtype)
    x = torch.randn(sum(counts), k, generator=g).to("cuda", dtype)
    return weight, x


def _exact(x: torch.Tensor, weight: torch.Tensor, counts: list[int], gated: bool) -> torch.Tensor:
    """Each expert's rows times its weight in float64 (gated: silu(gate) * up); rows of no expert zeros."""
    out = torch.zeros(len(x), weight.shape[1] // (2 if gated else 1), dtype=torch.float64, device=x.device)
    lo = 0
    for e, rows in enumerate(counts[: len(weight)]):
        y = x[lo : lo + rows].double() @ weight[e].double().T
        if gated:
            gate, up = y.chunk(2, dim=-1)
            y = torch.nn.functional.silu(gate) * up
        out[lo : lo + rows] = y
        lo += rows
    return out


# (experts with no rows, one row, rows across tiles of 128, the last tile ending inside a warpgroup's 64 rows,
# rows of no expert; K not a multiple of a step; outputs not a multiple of a tile)
COUNTS = [200, 0, 1, 64, 129, 0, 37, 3]


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason=NEEDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize(("n", "k"), [(160, 200), (272, 192)])
def test_grouped_products_are_within_rounding_of_float64_and_the_triton_kernels(dtype, gated, n, k, monkeypatch):
    """The kernel's products (gated: the middle) for each expert's rows within the dtype's rounding of float64, as
    close as the Triton kernel's; rows of no expert are zeros; reading rows in place (source) gives the gathered
    rows' bits (the Triton kernel's where K is not whole steps)."""
    weight, x = _inputs(len(COUNTS) - 1, n, k, COUNTS, dtype)
    counts = torch.tensor(COUNTS, device="cuda")
    assert gg._hopper(x, weight) is not None

    def run(t, source=None):
        return (gg.grouped_gate_up(t, weight, counts, source) if gated else gg.grouped_gemm(t, weight, counts))

    got = run(x)
    monkeypatch.setattr(gg, "GLUON", False)
    triton_kernel = run(x)
    monkeypatch.setattr(gg, "GLUON", True)
    exact = _exact(x, weight, COUNTS, gated)
    scale = exact.abs().max()
    err, err_triton = ((y.double() - exact).abs().max() / scale for y in (got, triton_kernel))
    assert err <= 2 * max(err_triton, torch.finfo(dtype).eps), (err, err_triton)
    assert (got[-COUNTS[-1]:] == 0).all()
    if gated:
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1)).to("cuda")
        tokens = torch.empty_like(x).index_copy_(0, perm, x)  # (x's rows scattered: source reads them back)
        from ppo_logprobs.workers.models import hopper_grouped

        in_place = hopper_grouped.gather_usable(tokens, weight, gg._tiles(dtype).block_m)
        assert in_place == (k % hopper_grouped.DEPTH == 0)
        assert torch.equal(run(tokens, perm), got if in_place else triton_kernel)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason=NEEDS)
@pytest.mark.parametrize("gated", [True, False])
def test_a_rows_bits_do_not_depend_on_its_experts_other_rows(gated):
    """Rows of an expert computed with 1, 7, 130 and 300 rows around them, at any offset inside a tile: the same
    bits."""
    weight, x = _inputs(3, 144, 96, [300, 0, 0], torch.bfloat16, seed=2)

    def run(rows, before):
        counts = torch.tensor([before, len(rows), 0, 0], device="cuda")
        pad = torch.randn(before, x.shape[1], device="cuda").to(x.dtype)
        y = torch.cat([pad, rows])
        return (gg.grouped_gate_up(y, weight, counts) if gated else gg.grouped_gemm(y, weight, counts))[before:]

    whole = run(x, 0)
    for start, stop, before in ((5, 6, 0), (100, 107, 37), (0, 130, 64), (170, 300, 127)):
        assert torch.equal(run(x[start:stop].clone(), before), whole[start:stop]), (start, stop, before)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason=NEEDS)
def test_a_moe_model_takes_the_kernel_and_keeps_a_sequences_bits(monkeypatch):
    """A small Qwen3-MoE in bf16 whose experts the kernel runs, patched: each expert layer launches it twice (gate/up
    reading rows in place, then down), its o projection adds the attention's residual (hopper_gated) and its
    experts' combine the mixture's; a sequence's log-probs have the same bits packed at any offset and alone, and are
    within bf16's reach of the unpatched model's."""
    import transformers

    from ppo_logprobs.workers.models import experts, hopper_gated, hopper_grouped

    from .test_hopper_gated import assert_packed_is_alone_and_near_hf

    config = transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=96, intermediate_size=192, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():  # (experts far from their initial values; routers sure of their choices, so that
        for name, p in model.named_parameters():  # rounding never swaps a token's experts against HF's)
            if p.dim() == 3 or "mlp.gate" in name:
                p.normal_(0, 0.05 if p.dim() == 3 else 0.5)
    calls, projections, added = [], [], []
    real, projected, combine = hopper_grouped.launch, hopper_gated.projected, experts.combine
    monkeypatch.setattr(hopper_grouped, "launch", lambda *a: calls.append(a[6]) or real(*a))
    monkeypatch.setattr(hopper_gated, "projected", lambda *a: projections.append(1) or projected(*a))
    monkeypatch.setattr(experts, "combine", lambda *a: added.append(a[3] is not None) or combine(*a))
    assert_packed_is_alone_and_near_hf(model)
    assert calls == [True, False] * (1 + 3) * 2 * config.num_hidden_layers, calls
    assert len(projections) == (1 + 3) * 2 * config.num_hidden_layers  # (o with the attention's residual added)
    assert added == [True] * (1 + 3) * 2 * config.num_hidden_layers, added  # (the mixture's, in the combine)

"""hopper_gated.py: the gated MLP's two products with silu(gate) * up in the GEMM's epilogue (Gluon, Hopper). Built for
sm_90a here; on a Hopper GPU against float64 on odd shapes, a row's bits alone and in a batch, its gradients, and the
patched MLP taking it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F

from ppo_logprobs.workers.models.causal_attention import hopper_kernels

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and hopper_kernels() is not None


@pytest.mark.skipif(hopper_kernels() is None, reason="Triton before 3.6")
def test_the_kernel_builds_for_sm90a_and_keeps_a_step_of_products_in_flight():
    """Compiled here for sm_90a, gated and with the residual (no GPU; a process without the interpreter): each fits
    a Hopper program's shared memory, spills nothing, and waits for the step before while this step's products run
    (wait_group 2)."""
    script = ("import sys; sys.path.insert(0, 'benchmarks')\n"
              "from compile_sm90 import _report\n"
              "from ppo_logprobs.workers.models import hopper_gated as h\n"
              "for gated in (True, False):\n"
              "    c = h.compile_sm90(gated); said, _ = _report(c)\n"
              "    print('shared', c.metadata.shared, 'waits2', 'wgmma.wait_group.sync.aligned 2;' in c.asm['ptx'])\n"
              "    print(*said, sep='\\n')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          cwd=root)
    builds = [line.split() for line in done.stdout.splitlines() if line.startswith("shared")]
    assert len(builds) == 2, done.stderr[-2000:]
    for _, shared, _, waits in builds:
        assert int(shared) <= 232448 and waits == "True", builds
    assert done.stdout.count("0 bytes spill stores") == 2, done.stdout


def _inputs(rows: int, k: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", dtype=dtype, generator=g)
    gate, up = (torch.randn(n, k, device="cuda", dtype=dtype, generator=g) * k**-0.5 for _ in range(2))
    return x, gate, up


def _exact(x, gate, up):
    x, gate, up = (t.double() for t in (x, gate, up))
    return F.silu(x @ gate.T) * (x @ up.T)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (and Triton 3.6 or later)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,k,n", [(1, 64, 128), (129, 200, 264), (300, 3584, 136), (1000, 520, 1032)])
def test_the_middle_is_within_rounding_of_float64_on_odd_shapes(dtype, rows, k, n):
    """Rows ending inside a tile, K not a multiple of a step, N not a multiple of a tile (but of 8): within the
    rounding of the dtype (the two products rounded before silu, as HF rounds) of float64, as close as cuBLAS's path;
    nothing written past the output."""
    from ppo_logprobs.workers.models import hopper_gated
    from ppo_logprobs.workers.models.silu_mul import silu_mul

    x, gate, up = _inputs(rows, k, n, dtype)
    assert hopper_gated.usable(x, gate, up)
    got = hopper_gated.middle(x, gate, up)
    exact = _exact(x, gate, up)
    before = silu_mul(F.linear(x, gate), F.linear(x, up)).double()
    scale = exact.abs().max()
    err, err_before = ((y.double() - exact).abs().max() / scale for y in (got, before))
    assert got.shape == (rows, n) and got.dtype == dtype
    assert err <= 2 * max(err_before, torch.finfo(dtype).eps), (err, err_before)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (and Triton 3.6 or later)")
def test_a_rows_bits_do_not_depend_on_the_rows_around_it():
    """Rows scored alone, in blocks that start inside a tile, and in the whole batch: the same bits."""
    from ppo_logprobs.workers.models import hopper_gated

    x, gate, up = _inputs(700, 512, 384, torch.bfloat16, seed=1)
    whole = hopper_gated.middle(x, gate, up)
    for start, stop in ((0, 1), (5, 6), (63, 200), (127, 129), (300, 700)):
        assert torch.equal(hopper_gated.middle(x[start:stop].clone(), gate, up), whole[start:stop]), (start, stop)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (and Triton 3.6 or later)")
def test_gradients_are_the_formulas():
    """`gated` with gradients: the forward's bits are middle's, and the gradients of x and both weights are the
    torch formula's (fp32 inputs to the reference: within bf16 rounding)."""
    from ppo_logprobs.workers.models import hopper_gated

    x, gate, up = (t.requires_grad_() for t in _inputs(130, 192, 256, torch.bfloat16, seed=2))
    out = hopper_gated.gated(x[None], gate, up)
    assert out.shape == (1, 130, 256)
    assert torch.equal(out[0], hopper_gated.middle(x.detach(), gate.detach(), up.detach()))
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, gate, up), grad)
    leaves = [t.detach().float().requires_grad_() for t in (x, gate, up)]
    want = torch.autograd.grad(F.silu(F.linear(leaves[0], leaves[1])) * F.linear(leaves[0], leaves[2]), leaves,
                               grad[0].float())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w, rtol=2e-2, atol=2e-2 * w.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (and Triton 3.6 or later)")
def test_what_the_kernel_refuses():
    """Inputs the copy engine cannot walk (K not a multiple of 8, a base off 16 bytes), fp32, mismatched weights."""
    from ppo_logprobs.workers.models import hopper_gated

    x, gate, up = _inputs(16, 64, 128, torch.bfloat16)
    assert hopper_gated.usable(x, gate, up)
    shifted = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")[1:].view_as(x).copy_(x)
    assert not hopper_gated.usable(shifted, gate, up)
    assert not hopper_gated.usable(x[:, :60], gate[:, :60], up[:, :60])
    assert not hopper_gated.usable(x.float(), gate.float(), up.float())
    assert not hopper_gated.usable(x, gate, up[:64])


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (and Triton 3.6 or later)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,k,n", [(1, 64, 128), (129, 200, 264), (300, 3584, 136), (1000, 520, 1032)])
def test_a_projection_plus_the_residual_is_hfs_rounding_of_float64(dtype, rows, k, n):
    """`plus`: residual + x @ weight.T on odd shapes (N ending inside either half of a 256-column tile), within the
    dtype's rounding of float64 and as close as torch's `residual + linear(x)`; rows alone and in the batch: the
    same bits."""
    from ppo_logprobs.workers.models import hopper_gated

    x, weight, _ = _inputs(rows, k, n, dtype, seed=3)
    residual = torch.randn(rows, n, device="cuda", dtype=dtype)
    got = hopper_gated.plus(x, weight, residual)
    exact = residual.double() + x.double() @ weight.double().T
    before = (residual + F.linear(x, weight)).double()
    scale = exact.abs().max()
    err, err_before = ((y.double() - exact).abs().max() / scale for y in (got, before))
    assert got.shape == (rows, n) and got.dtype == dtype
    assert err <= 2 * max(err_before, torch.finfo(dtype).eps), (err, err_before)
    for start, stop in ((0, 1), (rows // 2, rows)):
        alone = hopper_gated.plus(x[start:stop].clone(), weight, residual[start:stop].clone())
        assert torch.equal(alone, got[start:stop]), (start, stop)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (and Triton 3.6 or later)")
def test_a_projections_gradients_are_the_formulas():
    from ppo_logprobs.workers.models import hopper_gated

    x, weight, _ = _inputs(130, 192, 264, torch.bfloat16, seed=4)
    residual = torch.randn(1, 130, 264, device="cuda", dtype=torch.bfloat16)
    x, weight, residual = (t.requires_grad_() for t in (x, weight, residual))
    out = hopper_gated.projected(x[None], weight, residual)
    assert out.shape == residual.shape
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, weight, residual), grad)
    leaves = [t.detach().float().requires_grad_() for t in (x, weight, residual)]
    want = torch.autograd.grad(leaves[2] + F.linear(leaves[0][None], leaves[1]), leaves, grad.float())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w, rtol=2e-2, atol=2e-2 * w.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (and Triton 3.6 or later)")
def test_a_patched_model_runs_its_layers_through_the_kernels(monkeypatch):
    """The tiny Qwen2 in bf16, patched: a packed forward runs each layer's gate and up as one `gated` call and its
    two adds in `projected` (o and down); test_patch_model's GPU tests check the same forward's bits and numbers."""
    from ppo_logprobs.workers.models import hopper_gated, load_model

    calls = []
    for name in ("gated", "projected"):
        real = getattr(hopper_gated, name)
        monkeypatch.setattr(hopper_gated, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    model = load_model("tiny", device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        model(input_ids=torch.randint(0, model.config.vocab_size, (2, 300), device="cuda"))
    layers = model.config.num_hidden_layers
    assert sorted(calls) == ["gated"] * layers + ["projected"] * (2 * layers), calls

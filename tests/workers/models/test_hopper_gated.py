"""hopper_gated.py: the gated MLP's two products with silu(gate) * up in the GEMM's epilogue (Gluon, Hopper), the
projections with the residual in theirs, and q/k/v with biases and rotary in theirs. Built for sm_90a here; on a
Hopper GPU against float64 on odd shapes, a row's bits alone and in a batch, gradients, and patched models taking
them."""

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
    """Compiled here for sm_90a in its three modes (no GPU; a process without the interpreter): each fits a Hopper
    program's shared memory, spills nothing, and waits for the step before while this step's products run
    (wait_group 2); the projections store a tile's output while the next tile's first products run, the middle and
    q/k/v after their own."""
    builds = builds_for_sm90a("from ppo_logprobs.workers.models import hopper_gated as h\n"
                              "builds = [h.compile_sm90(mode) for mode in (h.GATED, h.PLUS, h.QKV)]\n")
    assert len(builds) == 3, builds
    for shared, waits, spilled, _ in builds:
        assert shared <= 232448 and waits and spilled == 0, builds
    assert [under for *_, under in builds] == [False, True, False], builds


def builds_for_sm90a(script: str) -> list[tuple[int, bool, int, bool]]:
    """Runs `script` (which leaves its compiled kernels in `builds`) in a process without the interpreter, from the
    repository's root; for each build: its shared memory, whether it waits for the step before while this step's
    products run (wgmma wait_group 2), the bytes ptxas spilled, and whether it issues a TMA store between products'
    commit and the wait for them (an epilogue under the tensor cores' work)."""
    script = ("import sys; sys.path.insert(0, 'benchmarks')\n" + script + "from compile_sm90 import _report\n"
              "def under(ptx):\n"
              "    committed = False\n"
              "    for line in ptx.splitlines():\n"
              "        if 'cp.async.bulk.tensor.2d.global.shared' in line and committed:\n"
              "            return True\n"
              "        committed = 'wgmma.commit_group' in line or committed and 'wgmma.wait_group' not in line\n"
              "    return False\n"
              "for c in builds:\n"
              "    print('built', c.metadata.shared, 'wgmma.wait_group.sync.aligned 2;' in c.asm['ptx'],\n"
              "          _report(c)[0][0].split(' bytes spill stores')[0].split()[-1], under(c.asm['ptx']))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          cwd=root)
    builds = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("built")]
    assert builds, done.stderr[-2000:]
    return [(int(shared), waits == "True", int(spilled), under == "True") for shared, waits, spilled, under in builds]


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


def _qkv_inputs(rows: int, k: int, heads: int, kv_heads: int, biased: bool, dtype: torch.dtype, seed: int = 0,
                normed: bool = False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", dtype=dtype, generator=g)
    weights = tuple(torch.randn(h * 128, k, device="cuda", dtype=dtype, generator=g) * k**-0.5
                    for h in (heads, kv_heads, kv_heads))
    biases = tuple(torch.randn(len(w), device="cuda", dtype=dtype, generator=g) for w in weights) if biased else None
    angles = torch.rand(rows, 64, device="cuda", dtype=torch.float64, generator=g) * 100
    angles = torch.cat([angles, angles], -1)  # (HF's layout: the frequencies twice)
    norms = (tuple(torch.rand(128, device="cuda", generator=g).to(dtype) + 0.5 for _ in range(2)) + (1e-6,)
             if normed else None)
    return x, weights, biases, angles.cos().to(dtype), angles.sin().to(dtype), norms


def _qkv_exact(x, weights, biases, cos, sin, norms=None):
    from ppo_logprobs.workers.models.rms_norm import rms_norm_reference
    from ppo_logprobs.workers.models.rotary import rotary_reference

    x, cos, sin = x.double(), cos.double(), sin.double()
    q, k, v = (F.linear(x, w.double(), None if b is None else b.double()).view(len(x), -1, 128)
               for w, b in zip(weights, biases or (None,) * 3, strict=True))
    if norms is not None:
        q, k = (rms_norm_reference(t, w.double(), norms[2], "llama") for t, w in zip((q, k), norms[:2], strict=True))
    return rotary_reference(q, cos, sin), rotary_reference(k, cos, sin), v


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (and Triton 3.6 or later)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,k,heads,kv_heads,biased,normed", [
    (1, 64, 2, 1, True, False), (129, 200, 3, 1, False, False), (300, 520, 4, 2, True, False),
    (70, 3584, 7, 1, True, False), (129, 200, 3, 1, False, True), (300, 520, 4, 2, True, True)])
def test_qkv_is_within_rounding_of_float64_and_rotates_as_rotary_does(dtype, rows, k, heads, kv_heads, biased, normed):
    """q, k, v of odd shapes (rows ending inside a tile, K not a multiple of a step, an odd count of heads: the
    last tile's second half past v), with and without q/k head norms, within the dtype's rounding of float64, as
    close as cuBLAS's projections and rotary's pass; the rotation is rotary.py's to the bit (the kernel's unrotated q
    and k, at cos 1 and sin 0, then rotary), v the kernel's unrotated v; rows alone and in the batch: the same
    bits."""
    from ppo_logprobs.workers.models import hopper_gated
    from ppo_logprobs.workers.models.rotary import rotary

    x, weights, biases, cos, sin, norms = _qkv_inputs(rows, k, heads, kv_heads, biased, dtype, normed=normed)
    assert hopper_gated.qkv_usable(x, weights, biases, cos, sin, norms)
    got = [t.view(rows, -1, 128) for t in hopper_gated.qkv(x, weights, biases, cos, sin, norms)]
    assert [tuple(t.shape) for t in got] == [(rows, heads, 128), (rows, kv_heads, 128), (rows, kv_heads, 128)]
    before = [F.linear(x, w, b).view(rows, -1, 128) for w, b in zip(weights, biases or (None,) * 3, strict=True)]
    before[:2] = [rotary(t, cos, sin, None if norms is None else (w, norms[2], "llama"))
                  for t, w in zip(before[:2], (norms or (None,) * 3)[:2], strict=True)]
    for y, b, e in zip(got, before, _qkv_exact(x, weights, biases, cos, sin, norms), strict=True):
        err, err_before = ((t.double() - e).abs().max() / e.abs().max() for t in (y, b))
        assert err <= 2 * max(err_before, torch.finfo(dtype).eps), (err, err_before)
    plain = [t.view(rows, -1, 128) for t in hopper_gated.qkv(x, weights, biases, torch.ones_like(cos),
                                                             torch.zeros_like(sin), norms)]
    assert torch.equal(got[0], rotary(plain[0], cos, sin)) and torch.equal(got[1], rotary(plain[1], cos, sin))
    assert torch.equal(got[2], plain[2])
    for start, stop in ((0, 1), (rows // 2, rows)):
        alone = hopper_gated.qkv(x[start:stop].clone(), weights, biases, cos[start:stop].clone(),
                                 sin[start:stop].clone(), norms)
        for a, w in zip(alone, got, strict=True):
            assert torch.equal(a.view(stop - start, -1, 128), w[start:stop]), (start, stop)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (and Triton 3.6 or later)")
@pytest.mark.parametrize("biased,normed", [(True, False), (False, False), (False, True)])
def test_qkv_gradients_are_the_formulas(biased, normed):
    """`rotated_qkv` with gradients: the forward's bits are qkv's, and the gradients of x, the weights, the biases
    and the head norms' weights are the torch formula's (fp32 inputs to the reference: within bf16 rounding)."""
    from ppo_logprobs.workers.models import hopper_gated
    from ppo_logprobs.workers.models.rms_norm import rms_norm_reference
    from ppo_logprobs.workers.models.rotary import rotary_reference

    x, weights, biases, cos, sin, norms = _qkv_inputs(130, 192, 3, 1, biased, torch.bfloat16, seed=5, normed=normed)
    leaves = [x, *weights, *(biases or ()), *(norms[:2] if norms else ())]
    for t in leaves:
        t.requires_grad_()
    out = hopper_gated.rotated_qkv(x, weights, biases, cos, sin, norms)
    plain = hopper_gated.qkv(x.detach(), [w.detach() for w in weights],
                             None if biases is None else [b.detach() for b in biases], cos, sin,
                             None if norms is None else (norms[0].detach(), norms[1].detach(), norms[2]))
    assert all(torch.equal(a, b) for a, b in zip(out, plain, strict=True))
    grads = [torch.randn_like(t) for t in out]
    got = torch.autograd.grad(out, leaves, grads)
    ref = [t.detach().float().requires_grad_() for t in leaves]
    bs = ref[4:7] if biased else [None] * 3
    q, k, v = (F.linear(ref[0], w, b).view(130, -1, 128) for w, b in zip(ref[1:4], bs, strict=True))
    if normed:
        q, k = (rms_norm_reference(t, w, norms[2], "llama") for t, w in zip((q, k), ref[-2:], strict=True))
    want = torch.autograd.grad(
        [rotary_reference(q, cos.float(), sin.float()), rotary_reference(k, cos.float(), sin.float()), v], ref,
        [g.float().view(130, -1, 128) for g in grads])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w, rtol=2e-2, atol=2e-2 * w.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (and Triton 3.6 or later)")
def test_what_qkv_refuses():
    """Heads other than 128 wide, cos and sin of another shape, dtype or layout, biases of another dtype or only
    some."""
    from ppo_logprobs.workers.models import hopper_gated

    x, weights, biases, cos, sin, _ = _qkv_inputs(16, 64, 2, 1, True, torch.bfloat16)
    assert hopper_gated.qkv_usable(x, weights, biases, cos, sin)
    assert hopper_gated.qkv_usable(x, weights, None, cos, sin)
    norms = (torch.ones(128, device="cuda", dtype=x.dtype),) * 2 + (1e-6,)
    assert hopper_gated.qkv_usable(x, weights, None, cos, sin, norms)
    assert not hopper_gated.qkv_usable(x, weights, None, cos, sin, (norms[0][:64], norms[1][:64], 1e-6))
    assert not hopper_gated.qkv_usable(x, weights, None, cos, sin, (norms[0].float(), norms[1].float(), 1e-6))
    assert not hopper_gated.qkv_usable(x, (weights[0][:192], *weights[1:]), None, cos, sin)
    assert not hopper_gated.qkv_usable(x, weights, biases, cos[:, :64], sin[:, :64])
    assert not hopper_gated.qkv_usable(x, weights, biases, cos[:8], sin[:8])
    assert not hopper_gated.qkv_usable(x, weights, biases, cos.float(), sin.float())
    assert not hopper_gated.qkv_usable(x, weights, biases, cos.T.contiguous().T, sin.T.contiguous().T)
    assert not hopper_gated.qkv_usable(x, weights, (biases[0].float(), *biases[1:]), cos, sin)
    assert not hopper_gated.qkv_usable(x, weights, (None, *biases[1:]), cos, sin)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (and Triton 3.6 or later)")
@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_a_model_with_heads_of_128_takes_qkv_and_keeps_a_sequences_bits(family, monkeypatch):
    """A small Qwen2 (q/k/v biases), Llama (none) and Qwen3 (q/k norms) with heads of 128 in bf16, patched: a packed
    forward runs each layer's q, k and v as one `rotated_qkv` call; a sequence's log-probs have the same bits packed
    at any offset and alone, and are within bf16's reach of the unpatched model's (HF's sdpa)."""
    import transformers

    from ppo_logprobs.workers.models import hopper_gated

    config_cls, model_cls = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                             "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
    config = config_cls(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = model_cls(config).to("cuda", torch.bfloat16).eval()
    calls = []
    real = hopper_gated.rotated_qkv
    monkeypatch.setattr(hopper_gated, "rotated_qkv", lambda *a: calls.append(1) or real(*a))
    assert_packed_is_alone_and_near_hf(model)
    assert len(calls) == 2 * (1 + 3) * config.num_hidden_layers, len(calls)


def assert_packed_is_alone_and_near_hf(model: torch.nn.Module) -> None:
    """Three sequences (300, 7 and 130 tokens) through the model patched, packed in two orders and alone (8
    forwards): a sequence's log-probs have the same bits packed at any offset and alone, and are within 5e-2 of the
    unpatched model's (HF's own forward)."""
    from ppo_logprobs.workers.models.patch_model import patch_model

    g = torch.Generator().manual_seed(7)
    sequences = [torch.randint(3, 500, (n,), generator=g) for n in (300, 7, 130)]
    with torch.no_grad():
        hf = [type(model).forward(model, input_ids=s[None].cuda()).logits.float().log_softmax(-1)[0, :-1]
              .gather(-1, s[1:, None].cuda())[:, 0] for s in sequences]
    patch_model(model, packed_attention="varlen")
    with torch.no_grad():
        for order in ([0, 1, 2], [2, 1, 0]):
            ids = torch.cat([sequences[i] for i in order])[None].cuda()
            positions = torch.cat([torch.arange(len(sequences[i])) for i in order])[None].cuda()
            out, at = model(input_ids=ids, position_ids=positions).log_probs[0], 0
            for i in order:
                n = len(sequences[i])
                alone = model(input_ids=sequences[i][None].cuda()).log_probs[0]
                assert torch.equal(out[at : at + n], alone), (order, i)
                torch.testing.assert_close(alone[:-1].float(), hf[i], rtol=0, atol=5e-2)
                at += n

"""The head's backends: which one `resolve_backend` picks for each device and request, its refusals (each naming
the value), and `backend_forward` / `backend_backward` running the backend the options name with the options given.

resolve_backend reads only the device's type, so CUDA devices are named here without a GPU. Under pytest the
Triton interpreter is on where there is no CUDA (tests/conftest.py); tests that need it off or on set it.
"""

import pytest
import torch

from ppo_logprobs.workers import fused_log_probs
from ppo_logprobs.workers.head.backends import HeadOptions, backend_backward, backend_forward, resolve_backend
from ppo_logprobs.workers.head.torch_log_probs import torch_log_probs_backward, torch_log_probs_forward

# Imported here, while conftest's TRITON_INTERPRET=1 holds (off CUDA): Triton fixes a kernel's target when its module
# is imported, and the tests below that turn the interpreter off would otherwise be the first to import them.
from ppo_logprobs.workers.head.triton_log_probs_backward import triton_log_probs_backward
from ppo_logprobs.workers.head.triton_log_probs_forward import triton_log_probs_forward

from .reference import reference_log_probs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUDA = ["cuda", "cuda:0", "cuda:3"]  # (no such GPU needed: only the type is read)
OFF_CUDA = ["cpu", "meta", "mps", "xpu"]


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture(params=["1", "true", "on"])
def interpreter(monkeypatch, request):
    monkeypatch.setenv("TRITON_INTERPRET", request.param)  # (every spelling Triton itself takes)


@pytest.mark.parametrize("device", CUDA)
def test_auto_is_triton_on_cuda(device):
    assert resolve_backend("auto", torch.device(device)) == "triton"


@pytest.mark.parametrize("device", OFF_CUDA)
@pytest.mark.parametrize("interpreted", [False, True])
def test_auto_is_torch_off_cuda_even_under_the_interpreter(device, interpreted, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpreted else "0")
    assert resolve_backend("auto", torch.device(device)) == "torch"


@pytest.mark.parametrize("device", CUDA + OFF_CUDA)
def test_torch_is_torch_on_every_device(device, no_interpreter):
    assert resolve_backend("torch", torch.device(device)) == "torch"


@pytest.mark.parametrize("device", CUDA)
def test_triton_on_cuda_needs_no_interpreter(device, no_interpreter):
    assert resolve_backend("triton", torch.device(device)) == "triton"


@pytest.mark.parametrize("device", OFF_CUDA)
def test_triton_off_cuda_runs_under_the_interpreter(device, interpreter):
    assert resolve_backend("triton", torch.device(device)) == "triton"


@pytest.mark.parametrize("device", OFF_CUDA)
@pytest.mark.parametrize("setting", [None, "0", "", "false"])
def test_triton_off_cuda_without_the_interpreter_is_refused_naming_the_device(device, setting, monkeypatch):
    if setting is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", setting)
    kind = torch.device(device).type
    with pytest.raises(ValueError, match=rf"backend='triton' needs CUDA tensors \(got {kind}\).*TRITON_INTERPRET=1"):
        resolve_backend("triton", torch.device(device))


@pytest.mark.parametrize("name", ["Triton", "TORCH", "cuda", "cpu", "", " torch", "triton ", "flash"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_unknown_backend_is_refused_naming_it(name, device):
    with pytest.raises(ValueError, match=rf"backend must be 'auto', 'torch' or 'triton', got {name!r}$"):
        resolve_backend(name, torch.device(device))


def test_a_backend_that_is_not_a_string_is_refused_naming_it():
    for name in (None, 1, True):
        with pytest.raises(ValueError, match=rf"got {name!r}$"):
            resolve_backend(name, torch.device("cpu"))


def test_fused_log_probs_refuses_through_resolve_backend(no_interpreter):
    """The head's entry point resolves its `backend` here: the same refusals, naming the same values (CPU tensors on
    any machine)."""
    g = torch.Generator().manual_seed(0)
    hidden, weight, labels = torch.randn(3, 8, generator=g), torch.randn(11, 8, generator=g), torch.tensor([0, 5, 10])
    with pytest.raises(ValueError, match="got 'fused'"):
        fused_log_probs(hidden, weight, labels, backend="fused")
    with pytest.raises(ValueError, match=r"needs CUDA tensors \(got cpu\)"):
        fused_log_probs(hidden, weight, labels, backend="triton")
    lp, ent = fused_log_probs(hidden, weight, labels, backend="auto")  # "auto": the torch backend on the CPU
    want_lp, want_ent = fused_log_probs(hidden, weight, labels, backend="torch")
    assert torch.equal(lp, want_lp) and torch.equal(ent, want_ent)


def head_inputs(n=21, h=24, v=70, seed=0):
    """fp32 inputs; token 9 is ignored (label -7, the ignore_index used below), token 4's label is 5."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h**0.5
    labels = torch.randint(0, v, (n,), generator=g)
    labels[4], labels[9] = 5, -7
    inv_temp = torch.rand(n, generator=g) + 0.5
    return hidden.to(DEVICE), weight.to(DEVICE), labels.to(DEVICE), inv_temp.to(DEVICE)


def direct_forward(backend, hidden, weight, labels, inv_temp, **kw):
    if backend == "torch":
        return torch_log_probs_forward(hidden, weight, labels, inv_temp, chunk_size=16, **kw)
    return triton_log_probs_forward(hidden, weight, labels, inv_temp, **kw)


def direct_backward(backend, *args, **kw):
    if backend == "torch":
        return torch_log_probs_backward(*args, chunk_size=16, **kw)
    return triton_log_probs_backward(*args, **kw)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backend_forward_runs_the_backend_the_options_name(backend):
    hidden, weight, labels, inv_temp = head_inputs()
    opts = HeadOptions(backend=backend, chunk_size=16)
    lp, ent, lse, _ = backend_forward(hidden, weight, labels, inv_temp, opts, ignore_index=-7)
    kw = dict(ignore_index=-7, compute_entropy=True)
    want = direct_forward(backend, hidden, weight, labels, inv_temp, **kw)[:3]
    other = direct_forward("triton" if backend == "torch" else "torch", hidden, weight, labels, inv_temp, **kw)[:3]
    assert all(torch.equal(a, b) for a, b in zip((lp, ent, lse), want, strict=True))
    # (the other backend's numbers are close but not these bits: what tells the two apart)
    assert not all(torch.equal(a, b) for a, b in zip(want, other, strict=True))
    for a, b in zip(want, other, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backend_forward_passes_the_options_on(backend):
    """The ignore_index keyword (not opts.ignore_index: the vocab-parallel head passes a marker of its own), the
    softcap, compute_entropy and top_k reach the backend; checked against the float64 oracle."""
    hidden, weight, labels, inv_temp = head_inputs(seed=1)
    opts = HeadOptions(backend=backend, ignore_index=5, compute_entropy=False, chunk_size=16, softcap=2.0, top_k=3)
    lp, ent, lse, extras = backend_forward(hidden, weight, labels, inv_temp, opts, ignore_index=-7)
    assert ent is None
    ref_lp, _ = reference_log_probs(hidden, weight, labels, 1.0 / inv_temp.double(), ignore_index=-7, softcap=2.0)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-5)  # token 4 (label 5) scored, token 9 is 0
    assert extras.top_ids.shape == (21, 3) and (extras.top_ids[9] == -1).all() and (extras.top_ids[4] >= 0).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(("need_hidden", "need_weight"), [(True, False), (False, True)])
def test_backend_backward_runs_the_backend_the_options_name(backend, need_hidden, need_weight):
    hidden, weight, labels, inv_temp = head_inputs(seed=2)
    opts = HeadOptions(backend=backend, chunk_size=16)
    lp, ent, lse, _ = backend_forward(hidden, weight, labels, inv_temp, opts, ignore_index=-7)
    g = torch.Generator().manual_seed(3)
    grad_lp, grad_ent = torch.randn(21, generator=g).to(DEVICE), torch.randn(21, generator=g).to(DEVICE)
    saved = (hidden, weight, labels, inv_temp, lse, ent)
    d_hidden, d_weight = backend_backward(saved, grad_lp, grad_ent, opts, ignore_index=-7,
                                          need_hidden=need_hidden, need_weight=need_weight)
    kw = dict(ignore_index=-7, need_hidden=need_hidden, need_weight=need_weight)
    want = direct_backward(backend, *saved, grad_lp, grad_ent, **kw)
    other = direct_backward("triton" if backend == "torch" else "torch", *saved, grad_lp, grad_ent, **kw)
    for got, expected, theirs, needed in zip((d_hidden, d_weight), want, other, (need_hidden, need_weight),
                                             strict=True):
        assert (got is None) == (not needed)
        if needed:
            assert torch.equal(got, expected)
            assert not torch.equal(expected, theirs)  # (what tells the two backends apart)
            torch.testing.assert_close(expected, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backend_backward_passes_the_softcap_on(backend):
    hidden, weight, labels, inv_temp = head_inputs(seed=4)
    opts = HeadOptions(backend=backend, chunk_size=16, softcap=3.0)
    _, ent, lse, _ = backend_forward(hidden, weight, labels, inv_temp, opts, ignore_index=-7)
    grad_lp = torch.randn(21, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    saved = (hidden, weight, labels, inv_temp, lse, ent)
    d_hidden, d_weight = backend_backward(saved, grad_lp, None, opts, ignore_index=-7, need_hidden=True,
                                          need_weight=False)
    kw = dict(ignore_index=-7, need_hidden=True, need_weight=False)
    capped, _ = direct_backward(backend, *saved, grad_lp, None, softcap=3.0, **kw)
    uncapped, _ = direct_backward(backend, *saved, grad_lp, None, **kw)
    assert d_weight is None and torch.equal(d_hidden, capped)
    assert (capped - uncapped).abs().max() > 1e-3  # (the cap matters here)

"""The Triton causal attention kernel (workers/models/causal_attention.py) against a float64 oracle: packed segments,
grouped key-value heads, a head size that is not a power of two, windows, and query segments after shared keys;
a query's bits whatever its neighbours and wherever its tile starts. In the interpreter here, on the device with
CUDA (where its backward, FlashAttention's, is checked against FlashAttention's own). Hopper's Gluon kernels
(hopper_attention.py): built for sm_90a here, and on a Hopper GPU the bits of the tiling they stand in for."""

import math
import os
import subprocess
import sys

import pytest
import torch

from ppo_logprobs.workers.models.causal_attention import (
    Tiles,
    _launch,
    _tiles,
    block_m,
    causal_attention,
    hopper_kernels,
    schedule,
    tiles_for,
)

from ..head.reference import assert_same_bits

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 24
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def segments(q_lengths, k_lengths, seed, dtype=torch.float32, head_dim=HEAD_DIM, heads=HEADS, kv_heads=KV_HEADS):
    """q [Tq, H, D], k and v [Tk, Hkv, D] of packed segments, and their offsets."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lengths), heads, head_dim, generator=g)
    k, v = (torch.randn(sum(k_lengths), kv_heads, head_dim, generator=g) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
                  for n in (q_lengths, k_lengths))
    return *(x.to(DEVICE, dtype) for x in (q, k, v)), cu_q, cu_k


def oracle(q, k, v, cu_q, cu_k, scale=None, window=None):
    """float64: query j of a segment of n_q sits at key position n_k - n_q + j and sees the keys at or before it
    (and, with a window, less than `window` behind it); query head h reads key-value head h // (H / Hkv)."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    spans = zip(cu_q.tolist(), cu_q[1:].tolist(), cu_k.tolist(), cu_k[1:].tolist(), strict=False)
    for a, b, c, e in spans:
        pos = torch.arange(b - a)[:, None] + (e - c) - (b - a)
        key = torch.arange(e - c)[None, :]
        allowed = (key <= pos) & ((pos - key < window) if window else True)
        for h in range(q.shape[1]):
            scores = (q[a:b, h] @ k[c:e, h // group].T * scale).masked_fill(~allowed, -math.inf)
            out[a:b, h] = scores.softmax(-1) @ v[c:e, h // group]
    return out


def pieces(x, cu):
    return [x[a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize(("scale", "window"), [(None, None), (0.3, None), (None, 5), (None, 20)])
def test_each_segment_attends_causally_to_its_own_keys(dtype, atol, scale, window):
    """Self-attention segments of 1 to 40 tokens (tiles of 16 here: one, two and three query and key blocks) and
    query segments after 14 and 21 keys of their own (the first's first query tile ends a key before a key block);
    fp32 within 2e-6 of the oracle (its own rounding is about 5e-7), bf16 within its rounding of inputs,
    probabilities and output (a wrong head, window, boundary or block is off by more than 1)."""
    q_lengths, k_lengths = (1, 7, 13, 40, 16, 5, 30), (1, 7, 13, 40, 30, 26, 30)
    q, k, v, cu_q, cu_k = segments(q_lengths, k_lengths, seed=0, dtype=dtype)
    out = causal_attention(q, k, v, cu_q, cu_k, max(q_lengths), max(k_lengths), scale, window)
    assert out.shape == q.shape and out.dtype == dtype
    want = oracle(q, k, v, cu_q, cu_k, scale, window)
    torch.testing.assert_close(out.double().cpu(), want, rtol=0, atol=atol)


@pytest.mark.parametrize("head_dim", [8, 64])
def test_head_sizes(head_dim):
    q, k, v, cu_q, cu_k = segments((9, 33), (9, 40), seed=1, head_dim=head_dim)
    out = causal_attention(q, k, v, cu_q, cu_k, 33, 40)
    torch.testing.assert_close(out.double().cpu(), oracle(q, k, v, cu_q, cu_k), rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("fused", [False, True])
def test_a_querys_bits_are_its_own(dtype, window, fused):
    """A sequence of 45 keys scored whole, in a row with other segments, and as suffixes of 40, 29 and 1 queries after
    its first 5, 16 and 44 keys (query tiles starting elsewhere, more masked blocks and fewer whole ones, blocks a
    query sees nothing of): every query has the same bits each time. On CUDA all sizes x 8, at heads of 24 (tiles of
    128 x 64) and of 128 (128 x 128, the tiling of most models). `fused`: scale and max in one FMA and the mask
    after exp2 (the default at heads over 64), its keys and values read as tensor descriptors here (bench_attention.py
    --sweep tries both), and not fused; each within the oracle's tolerance."""
    x8 = 8 if DEVICE == "cuda" else 1
    n, window = 45 * x8, window and window * x8
    a, b = 30 * x8, 3 * x8
    for head in (HEAD_DIM, 128) if DEVICE == "cuda" else (HEAD_DIM,):
        q, k, v, cu_q, cu_k = segments((n,), (n,), seed=2, dtype=dtype, head_dim=head)
        tiles = _tiles(head, dtype)._replace(fused=fused, tma=fused, gluon=_tiles(head, dtype).gluon if fused else "")

        def attention(q, k, v, cu_q, cu_k, max_q, scale, window, tiles=tiles, head=head):
            return _launch(q, k, v, cu_q, cu_k, max_q, scale or head**-0.5, window, tiles)[0]

        whole = attention(q, k, v, cu_q, cu_k, n, None, window)
        atol = 2e-6 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(whole.double().cpu(), oracle(q, k, v, cu_q, cu_k, None, window), rtol=0,
                                   atol=atol)
        others = segments((a, b), (a, b), seed=3, dtype=dtype, head_dim=head)
        for cut in (0, 5 * x8, 16 * x8, 44 * x8):
            row = [torch.cat([others[i][:a], x, others[i][a:]]) for i, x in enumerate((q[cut:], k, v))]
            cu_q2 = torch.tensor([0, a, a + n - cut, a + b + n - cut], dtype=torch.int32, device=DEVICE)
            cu_k2 = torch.tensor([0, a, a + n, a + b + n], dtype=torch.int32, device=DEVICE)
            out = attention(*row, cu_q2, cu_k2, max(a, n - cut), None, window)
            assert_same_bits(pieces(out, cu_q2)[1], whole[cut:], interpreted=DEVICE != "cuda")  # (see its note)


def test_the_tiling_fits_the_gpus_shared_memory():
    """Heads of 128 in bf16 take 128 x 128 tiles where a program may use Hopper's 227 KiB of shared memory (their
    three stages of keys and values and the queries: 224 KiB; on Hopper by the Gluon kernel's persistent form, with the
    same bits), 128 x 64 on an A100 (163 KiB), 64 x 64 on GPUs of 99 KiB (L40S, RTX 4090); smaller heads and fp32 one
    tiling everywhere."""
    hopper = Tiles(128, 128, 8, 3, fused=True, gluon="persistent")
    assert tiles_for(128, torch.bfloat16, 232448) == hopper == tiles_for(128, torch.bfloat16, None)
    assert tiles_for(128, torch.bfloat16, 166912) == Tiles(128, 64, 8, 3)
    assert tiles_for(96, torch.float16, 101376) == tiles_for(128, torch.bfloat16, 101376) == Tiles(64, 64, 4, 2)
    assert tiles_for(64, torch.bfloat16, 101376) == tiles_for(64, torch.bfloat16, None) == Tiles(128, 64, 4, 3)
    assert tiles_for(128, torch.float32, 101376) == Tiles(64, 32, 4, 2)


@pytest.mark.parametrize("window", [None, 7])
def test_tiles_from_a_schedule_on_the_device_give_the_grids_bits(window):
    """The schedule (what a CUDA graph's forward runs: a grid that does not change with the row) lists each
    (segment, block) once, each segment's last block first, empty segments none, with room to spare; the kernel
    walking it gives the plain grid's bits."""
    q_lengths, k_lengths = (1, 0, 7, 40, 16, 0, 30, 33), (1, 0, 7, 40, 30, 0, 30, 33)
    q, k, v, cu_q, cu_k = segments(q_lengths, k_lengths, seed=5)
    block = block_m(HEAD_DIM, q.dtype)
    want = [(s, b) for s, n in enumerate(q_lengths) for b in reversed(range(-(-n // block)))]
    plan = schedule(cu_q, block, len(want) + 9)
    count = int(plan.count[0])
    assert count == len(want) and plan.segment.shape == (len(want) + 9,)
    assert list(zip(plan.segment[:count].tolist(), plan.block[:count].tolist(), strict=True)) == want
    grid = causal_attention(q, k, v, cu_q, cu_k, max(q_lengths), max(k_lengths), None, window)
    walked = causal_attention(q, k, v, cu_q, cu_k, 0, 0, None, window, plan)
    assert torch.equal(walked, grid)


def test_bad_shapes_are_refused():
    q, k, v, cu_q, cu_k = segments((4,), (4,), seed=4)
    with pytest.raises(ValueError, match="query heads a multiple of key heads"):
        causal_attention(q[:, :5], k, v, cu_q, cu_k, 4, 4)
    with pytest.raises(ValueError, match="at most 256"):
        big = torch.zeros(4, 2, 264, device=DEVICE)
        causal_attention(big, big, big, cu_q, cu_k, 4, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 100])
def test_cuda_forward_and_backward_against_flash_attention(window):
    """bf16 on the device, segments of up to 700 tokens, two of them after shared keys: the output within bf16's
    rounding of FlashAttention's, the log-sum-exp FlashAttention's backward reads within 1e-5, and the gradients
    that backward gives from ours within bf16's rounding of those from its own forward."""
    q_lengths, k_lengths = (1, 130, 700, 64, 200), (1, 130, 700, 300, 333)
    q, k, v, cu_q, cu_k = segments(q_lengths, k_lengths, seed=5, dtype=torch.bfloat16, head_dim=128)
    args = (cu_q, cu_k, max(q_lengths), max(k_lengths))
    left = window - 1 if window else -1
    want, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, *args, 0.0, True, False,
                                                           window_size_left=left, window_size_right=0)
    out, our_lse = _launch(q, k, v, cu_q, cu_k, max(q_lengths), 128 ** -0.5, window)
    torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=2e-2)
    torch.testing.assert_close(our_lse, lse, rtol=0, atol=1e-5)
    grad = torch.randn_like(q)
    inputs = [x.detach().requires_grad_() for x in (q, k, v)]
    causal_attention(*inputs, *args, None, window).backward(grad)
    ours = [x.grad for x in inputs]
    inputs = [x.detach().requires_grad_() for x in (q, k, v)]
    torch.ops.aten._flash_attention_forward(*inputs, *args, 0.0, True, False, window_size_left=left,
                                            window_size_right=0)[0].backward(grad)
    for mine, theirs in zip(ours, (x.grad for x in inputs), strict=True):
        torch.testing.assert_close(mine.float(), theirs.float(), rtol=0, atol=5e-2 * theirs.abs().max().item())


FORMS = ["persistent"]  # hopper_attention.FORMS


@pytest.mark.skipif(hopper_kernels() is None, reason="Triton before 3.6")
def test_the_hopper_kernels_build_for_sm90a_and_overlap_the_softmax_with_the_products():
    """The Gluon kernel compiles for sm_90a here (Triton's own ptxas, no GPU; in a process without the interpreter),
    fits a Hopper program's 227 KiB of shared memory, and waits for one wgmma group while another is in flight (the
    softmax beside P V): what it is for; Triton's kernel waits for all (0) each time."""
    script = ("from ppo_logprobs.workers.models import hopper_attention as h\n"
              "for form in h.FORMS:\n"
              "    c = h.compile_sm90(form)\n"
              "    print(form, c.metadata.shared, 'wgmma.wait_group.sync.aligned 1;' in c.asm['ptx'])\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    lines = [line.split() for line in done.stdout.splitlines() if line.split()[:1] in ([f] for f in FORMS)]
    assert [line[0] for line in lines] == FORMS, done.stderr[-2000:]
    for form, shared, overlapped in lines:
        assert int(shared) <= 232448 and overlapped == "True", (form, shared, overlapped)


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and hopper_kernels() is not None


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (and Triton 3.6 or later)")
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("window", [None, 100, 333])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_hopper_kernels_give_the_bits_of_the_tiling_they_stand_in_for(form, window, dtype):
    """Segments of 1 to 1,100 tokens (ending inside a tile, on a tile's edge, one past it), two after shared keys,
    grouped heads: the Gluon kernel's output and log-sum-exp have the bits of the 128 x 128 fused tiling, on the
    plain grid and from a schedule (the CUDA graphs' forward, which the Triton kernel runs), so a sequence's bits do
    not depend on which ran; and each is within the oracle's tolerance."""
    q_lengths, k_lengths = (1, 127, 128, 129, 1100, 64, 200), (1, 127, 128, 129, 1100, 300, 333)
    q, k, v, cu_q, cu_k = segments(q_lengths, k_lengths, seed=6, dtype=dtype, head_dim=128)
    tiles = Tiles(128, 128, 8, 3, fused=True)
    args = (q, k, v, cu_q, cu_k, max(q_lengths), 128**-0.5, window)
    want, want_lse = _launch(*args, tiles)
    out, lse = _launch(*args, tiles._replace(gluon=form))
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    plan = schedule(cu_q, 128, sum(-(-n // 128) for n in q_lengths) + 4)
    walked, walked_lse = _launch(*args, tiles._replace(gluon=form), plan)
    assert torch.equal(walked, out) and torch.equal(walked_lse, lse)
    torch.testing.assert_close(out.double().cpu(), oracle(q, k, v, cu_q, cu_k, None, window), rtol=0, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (and Triton 3.6 or later)")
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("window", [None, 700])
def test_a_program_that_takes_many_tiles_gives_each_the_bits_of_the_tiling(form, window):
    """The 7B's heads (28 / 4) on 48 segments of 1 to 2,000 queries, some after shared keys: ~10,000 tiles, dozens to
    each of the GPU's programs, so that each program hands keys, values, queries and outputs from one tile to the next
    many times, on tiles of every length. Every output and log-sum-exp has the Triton tiling's bits."""
    g = torch.Generator().manual_seed(9)
    q_lengths = torch.randint(1, 2001, (48,), generator=g).tolist()
    k_lengths = [n + (int(torch.randint(0, 600, (1,), generator=g)) if i % 3 == 0 else 0)
                 for i, n in enumerate(q_lengths)]
    q, k, v, cu_q, cu_k = segments(q_lengths, k_lengths, seed=10, dtype=torch.bfloat16, head_dim=128, heads=28,
                                   kv_heads=4)
    assert hopper_kernels().usable(q, k, v)  # (the Gluon kernel runs, not the Triton one again)
    tiles = Tiles(128, 128, 8, 3, fused=True)
    args = (q, k, v, cu_q, cu_k, max(q_lengths), 128**-0.5, window)
    want, want_lse = _launch(*args, tiles)
    out, lse = _launch(*args, tiles._replace(gluon=form))
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (and Triton 3.6 or later)")
def test_keys_the_copy_engine_cannot_read_take_the_triton_kernel_with_the_same_bits():
    """Keys and values 2 bytes off a 16-byte boundary (a view one element into a buffer), which TMA cannot read: the
    Gluon tiling refuses them and the Triton kernel answers, with the bits it gives aligned copies."""
    q, k, v, cu_q, cu_k = segments((300, 129), (300, 129), seed=8, dtype=torch.bfloat16, head_dim=128)
    shifted = [torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:].view_as(x).copy_(x) for x in (k, v)]
    assert not hopper_kernels().usable(q, *shifted) and hopper_kernels().usable(q, k, v)
    tiles = Tiles(128, 128, 8, 3, fused=True)
    want, want_lse = _launch(q, k, v, cu_q, cu_k, 300, 128**-0.5, None, tiles)
    got, lse = _launch(q, *shifted, cu_q, cu_k, 300, 128**-0.5, None, tiles._replace(gluon="persistent"))
    assert torch.equal(got, want) and torch.equal(lse, want_lse)

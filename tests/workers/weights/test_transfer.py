"""Streaming a layout over a gloo group: every receiver gets exactly the sender's tensors in its dtypes."""

import inspect
import re
import threading

import pytest
import torch

from ppo_logprobs.workers.weights.staging import Layout, StagedWeights
from ppo_logprobs.workers.weights.transfer import (
    GroupSpec,
    _root0,
    broadcast_tensors,
    buckets,
    open_group,
    rebuild_on,
    receive_shared,
    receive_tensors,
    serve_store,
    share_handles,
)


def test_buckets_cover_the_layout_in_order():
    layout = Layout.of([(f"t{i}", (n,), torch.float32) for i, n in enumerate([10, 300, 7, 1, 900, 3])])
    plan = buckets(layout, bucket_bytes=1300)
    assert [e for b in plan for e in b] == list(layout.entries)
    for b in plan:
        assert len(b) == 1 or b[-1].offset + b[-1].nbytes - b[0].offset <= 1300


@pytest.mark.parametrize("bucket_bytes", [64, 1500, 1 << 20])
def test_two_receivers_get_the_senders_tensors(bucket_bytes):
    g = torch.Generator().manual_seed(0)
    sources = {  # as a trainer holds them: fp32 (converted), transposed (packed), already in the workers' dtype
        "a": torch.randn(7, 5, generator=g),
        "b": torch.randn(13, 3, generator=g).t(),
        "c": torch.randn(257, generator=g).to(torch.bfloat16),
        "d": torch.randn(1, generator=g),
        "e": torch.randn(31, 9, generator=g).to(torch.bfloat16),
        "f": torch.randn(1000, generator=g),  # alone in its bucket, converted: more than any packed bucket holds
    }
    layout = Layout.of([(n, tuple(t.shape), torch.bfloat16 if n != "d" else torch.float32) for n, t in sources.items()])
    store = serve_store("127.0.0.1", 60)
    spec = GroupSpec("test", "127.0.0.1", store.port, 3, "gloo", 60)
    received, errors = {}, []

    def receiver(rank):
        try:
            staged = StagedWeights(layout, torch.device("cpu"))
            receive_tensors(open_group(spec, rank), staged, bucket_bytes)
            received[rank] = staged
        except Exception as e:  # reported to the test thread
            errors.append(e)

    threads = [threading.Thread(target=receiver, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    broadcast_tensors(open_group(spec, 0, store), sources, layout, torch.device("cpu"), bucket_bytes)
    for t in threads:
        t.join(60)
    assert not errors and sorted(received) == [1, 2]
    for staged in received.values():
        for entry in layout.entries:
            expected = sources[entry.name].to(entry.dtype)
            assert torch.equal(staged.tensor(entry), expected), entry.name


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("bucket_bytes", [5000, 1 << 20])
def test_tensor_parallel_ranks_keep_their_parts_of_a_stream(tied, bucket_bytes):
    """A trainer's stream of whole tensors to the two ranks of a tensor-parallel worker: each
    rank stages exactly its parts (heads, MLP rows and columns, vocabulary rows; a tied model's head from the
    embedding), and nothing changes before the commit. In-process updates (update_weights) cut the same way."""
    from ppo_logprobs.workers import LogProbWorker
    from ppo_logprobs.workers.models.tensor_parallel import cut_model, shard_of

    from ...helpers import perturbed

    source = perturbed(11, tie_word_embeddings=tied)
    sent = dict(source.named_parameters())  # (a tied model names its embedding only)
    ranks = [LogProbWorker(cut_model(perturbed(0, tie_word_embeddings=tied), r, 2)) for r in (0, 1)]
    before = [{n: p.clone() for n, p in w.model.named_parameters()} for w in ranks]
    shapes = {n: tuple(t.shape) for n, t in sent.items()}
    layouts = [w.weights.layout_for(shapes) for w in ranks]
    assert layouts[0] == layouts[1] and [e.name for e in layouts[0].entries] == list(sent)  # whole tensors
    store = serve_store("127.0.0.1", 60)
    spec = GroupSpec("tp", "127.0.0.1", store.port, 3, "gloo", 60)
    errors = []

    def receive(rank):
        try:
            ranks[rank].weights.join_group(spec, rank + 1)
            ranks[rank].weights.stage_stream("tp", layouts[0], 1, bucket_bytes)
        except Exception as e:  # reported to the test thread
            errors.append(e)

    threads = [threading.Thread(target=receive, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    broadcast_tensors(open_group(spec, 0, store), sent, layouts[0], torch.device("cpu"), bucket_bytes)
    for t in threads:
        t.join(60)
    assert not errors
    for rank, w in enumerate(ranks):
        assert all(torch.equal(p, before[rank][n]) for n, p in w.model.named_parameters())  # staged only
        w.weights.commit(1)
        for name, p in w.model.named_parameters():
            whole = sent.get(name, sent["model.embed_tokens.weight"])  # the tied head: the embedding
            assert torch.equal(p, shard_of(name, whole.detach(), rank, 2, w.model.config)), name
        if tied:  # a rank rebuilt from the config its pool saved (a restart) is tied as before the cut
            from ppo_logprobs.workers import load_model
            from ppo_logprobs.workers.sharding import held_shard

            assert held_shard(load_model("", config=w.config(), shard=(rank, 2), backend="torch")).tied
        w.update_weights({n: t.detach() * 2 for n, t in sent.items()}, 2)
        for name, p in w.model.named_parameters():
            whole = sent.get(name, sent["model.embed_tokens.weight"]).detach() * 2
            assert torch.equal(p, shard_of(name, whole, rank, 2, w.model.config)), name


def test_a_senders_store_listens_on_the_address_it_gives_and_no_other():
    """A store served for loopback answers there and is not reachable on the machine's other addresses."""
    import socket

    import psutil

    others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
              if a.family == socket.AF_INET and not a.address.startswith("127.")]
    store = serve_store("127.0.0.1", 5)
    with socket.create_connection(("127.0.0.1", store.port), timeout=5):
        pass
    if not others:
        pytest.skip("this machine has no address but loopback")
    with pytest.raises(OSError), socket.create_connection((others[0], store.port), timeout=5):
        pass


def test_an_ipc_handle_is_mapped_on_this_processs_device_by_name(monkeypatch):
    """rebuild_on binds the handle to rebuild_cuda_tensor's parameters and replaces `storage_device` alone; a handle
    that does not fit this torch's rebuild_cuda_tensor is refused with a message naming the torch version."""
    import functools

    from torch.multiprocessing import reductions

    calls = []
    real = reductions.rebuild_cuda_tensor

    @functools.wraps(real)  # (the same signature, read through __wrapped__)
    def recorded(*args, **kwargs):
        calls.append(kwargs)

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", recorded)
    names = list(inspect.signature(real).parameters)
    handle = tuple(f"field {i}" for i in range(len(names)))
    handle = handle[:names.index("storage_device")] + (3,) + handle[names.index("storage_device") + 1 :]
    rebuild_on(handle, 0)
    assert calls == [{**dict(zip(names, handle, strict=True)), "storage_device": 0}]
    with pytest.raises(RuntimeError, match=rf"^torch {re.escape(torch.__version__)}: a CUDA IPC handle of"):
        rebuild_on((*handle, "one too many"), 0)
    with pytest.raises(RuntimeError, match=rf"^torch {re.escape(torch.__version__)}: .*not a device index"):
        rebuild_on(tuple("cuda:3" if n == "storage_device" else v for n, v in zip(names, handle, strict=True)), 0)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_an_nccl_group_takes_the_specs_timeout():
    from datetime import timedelta

    store = serve_store("127.0.0.1", 60)
    group = open_group(GroupSpec("nccl-timeout", "127.0.0.1", store.port, 1, "nccl", 7.0), 0, store)
    assert group.options._timeout == timedelta(seconds=7)  # (what set_timeout sets: torch's own name for it)
    x = torch.arange(5, device="cuda", dtype=torch.float32)
    group.broadcast([x], _root0()).wait()
    assert x.tolist() == [0, 1, 2, 3, 4]


def _receive_in_another_process(shared, out) -> None:
    torch.cuda.set_device(0)
    out.put([(lo, t.cpu().numpy().tobytes()) for lo, t in receive_shared(shared)])  # (plain bytes: this process exits)


@pytest.mark.gpu
@cuda
def test_tensors_shared_by_ipc_are_read_in_another_process():
    import torch.multiprocessing as mp

    layout = Layout.of([("a", (7, 5), torch.bfloat16), ("b", (300,), torch.float32)])
    sources = [torch.randn(7, 5, device="cuda").to(torch.bfloat16), torch.randn(300, device="cuda")]
    context = mp.get_context("spawn")
    out = context.Queue()
    child = context.Process(target=_receive_in_another_process, args=(share_handles(sources, layout), out))
    child.start()
    got = out.get(timeout=120)
    child.join(60)
    assert child.exitcode == 0
    assert [lo for lo, _ in got] == [e.offset for e in layout.entries]
    for (_, data), src in zip(got, sources, strict=True):
        assert data == src.cpu().view(-1).view(torch.uint8).numpy().tobytes()

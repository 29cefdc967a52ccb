"""Local copies of a worker's weights (weights/keep.py), without Ray: the safetensors writer, hard links to a
checkpoint, nothing of streams unless asked, and a writer that writes the newest version and skips the rest."""

import os
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ppo_logprobs.workers import load_model
from ppo_logprobs.workers.weights.checkpoint import read_checkpoint
from ppo_logprobs.workers.weights.keep import LocalCopy, write_safetensors
from ppo_logprobs.workers.weights.staging import Layout

from ...helpers import kept_calls, perturbed, save


def test_the_writer_gives_what_safetensors_and_our_reader_read_back(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a.bf16": torch.randn(3, 5, generator=g).bfloat16(), "b.f32": torch.randn(7, generator=g),
               "c.i64": torch.arange(-4, 5), "d.bool": torch.tensor([True, False, True]),
               "e.f16": torch.randn(2, 1, 3, generator=g).half(), "f.empty": torch.zeros(0, 4)}
    layout = Layout.of((n, tuple(t.shape), t.dtype) for n, t in tensors.items())  # aligned: gaps between tensors
    host = torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8)
    for e in layout.entries:
        host[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape).copy_(tensors[e.name])
    write_safetensors(tmp_path / "model.safetensors", layout, host)
    back = load_file(tmp_path / "model.safetensors")
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_checkpoints_are_linked_and_streams_not_kept_by_default(tmp_path):
    calls, _, on_kept = kept_calls()
    copy = LocalCopy(str(tmp_path / "copies"), on_kept)  # (an absolute root stays where it is)
    model = perturbed(1)
    first, second = save(model, tmp_path / "step-1"), save(perturbed(2), tmp_path / "step-2")
    copy.keep(1, model, first)
    copy.keep(2, model, second)
    assert [v for v, _ in calls] == [1, 2]
    assert os.path.samefile(Path(calls[1][1]) / "model.safetensors", Path(second) / "model.safetensors")
    assert sorted(p.name for p in (tmp_path / "copies").iterdir()) == ["v2"]  # the older copy is gone
    copy.keep(3, model, None)  # streamed weights: nothing written, no thread started
    assert copy.writer is None and len(calls) == 2 and not (tmp_path / "copies" / "v3").exists()


def test_the_writer_writes_the_newest_version_and_skips_those_that_came_meanwhile(tmp_path):
    calls, done, on_kept = kept_calls()
    copy = LocalCopy(str(tmp_path / "copies"), on_kept, streams=True)
    model = load_model("tiny", backend="torch")
    with copy.lock:  # as a commit would: the writer takes version 1 and waits to copy it out
        copy.keep(1, model, None)
        deadline = time.monotonic() + 60
        while copy._newest is not None:
            assert time.monotonic() < deadline, "the writer did not take version 1"
            time.sleep(0.001)
        copy.keep(2, model, None)
        copy.keep(3, model, None)  # replaces 2, which is never written
    deadline = time.monotonic() + 60
    while [v for v, _ in calls] != [1, 3]:
        assert time.monotonic() < deadline and len(calls) <= 2, calls
        time.sleep(0.01)
    written = read_checkpoint(load_model("tiny", backend="torch"), calls[-1][1])
    fresh = load_model("tiny", backend="torch")
    written.commit(fresh)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert sorted(p.name for p in (tmp_path / "copies").iterdir()) == ["v3"]


def test_a_checkpoint_that_cannot_be_linked_is_copied_only_when_streams_are_kept(tmp_path):
    other = Path("/dev/shm")
    if not other.is_dir() or os.stat(other).st_dev == os.stat(tempfile.gettempdir()).st_dev:
        pytest.skip("needs a second file system beside the temporary folder")
    model = perturbed(3)
    with tempfile.TemporaryDirectory(dir=other) as elsewhere:
        path = save(model, Path(elsewhere) / "step")
        calls, _, on_kept = kept_calls()
        LocalCopy(str(tmp_path / "links"), on_kept).keep(1, model, path)
        assert calls == []  # no link across file systems, and no copy unless asked
        calls, done, on_kept = kept_calls()
        LocalCopy(str(tmp_path / "copies"), on_kept, streams=True).keep(1, model, path)
        assert done.wait(60) and calls[0][0] == 1
        assert set(load_file(Path(calls[0][1]) / "model.safetensors")) == {n for n, _ in model.named_parameters()}

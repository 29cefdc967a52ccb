"""Weight updates through a pool's owner on a local Ray cluster: trainer processes streaming over gloo, refusals that
change nothing, a trainer killed mid-stream, restarted workers after each source, versions from two handles."""

import asyncio
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import ray
import torch
from safetensors.torch import load_file

from ppo_logprobs.workers import WorkerPool, load_model
from ppo_logprobs.workers.errors import (
    CheckpointNotFound,
    IncompatibleWeights,
    InvalidCheckpoint,
    NonFiniteWeights,
    WeightsUnavailable,
)

from ...helpers import alone, free_port, perturbed, random_sequences, save

SEQS = random_sequences(12, seed=50, hi=80)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def pool(cluster):
    """One pool of two workers for the tests below (each counts versions from the one it finds)."""
    pool = WorkerPool.create("tiny", 2, name="owner-test", max_tokens_per_batch=256, backend="torch")
    yield pool
    pool.shutdown()


def assert_serves(pool, model, version):
    results = pool.compute_log_probs(SEQS)
    for seq, r in zip(SEQS, results, strict=True):
        lp, ent = alone(model, seq)
        np.testing.assert_allclose(r.log_probs, lp, rtol=0, atol=1e-5)
        np.testing.assert_allclose(r.entropy, ent, rtol=0, atol=1e-5)
        assert r.weights_version == version
    assert pool.weights_version == version
    assert {h["weights_version"] for h in pool.health()} == {version}


TRAINER = """
import os, sys, ray, torch
from ppo_logprobs.workers import WorkerPool, load_model
ray.init(address=sys.argv[1], log_to_driver=False)
model = load_model("tiny", backend="torch")
g = torch.Generator().manual_seed(int(sys.argv[2]))
with torch.no_grad():
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g) * 0.05)
pool = WorkerPool.connect("owner-test")

class DiesAt(dict):
    # the trainer's tensors; reading the n-th one kills the process (a trainer killed mid-stream)
    def __init__(self, items, n):
        super().__init__(items)
        self.reads, self.n = 0, n
    def __getitem__(self, name):
        self.reads += 1
        if self.reads == self.n:
            os._exit(9)
        return super().__getitem__(name)

if sys.argv[3] == "fsdp":  # the trainer's own process group and FSDP2 shards beside the weight group
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[5], rank=0, world_size=1)
    fully_shard(model)
    print("sharded", type(model.lm_head.weight).__name__)

with pool.weight_sender(bucket_bytes=int(sys.argv[4])) as sender:
    if sys.argv[3] == "full":
        print("version", sender.send(model.named_parameters()))
        print("version", sender.send({"lm_head.weight": model.lm_head.weight * 2}))
    elif sys.argv[3] == "fsdp":
        print("version", sender.send(model.named_parameters()))
        dist.all_reduce(torch.ones(1))  # the trainer's own group still works
    else:
        sender.send(DiesAt(model.state_dict(), 12))
"""


def trainer(cluster, seed, mode, bucket_bytes=1 << 20):
    args = [cluster, str(seed), mode, str(bucket_bytes), str(free_port())]
    return subprocess.run([sys.executable, "-c", TRAINER, *args], capture_output=True, text=True, timeout=120)


def test_a_trainer_process_streams_full_and_partial_updates(cluster, pool):
    v = pool.weights_version
    done = trainer(cluster, 5, "full")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line.split()[1] for line in done.stdout.splitlines() if line.startswith("version")] == [str(v + 1),
                                                                                                  str(v + 2)]
    expected = perturbed(5)
    with torch.no_grad():
        expected.lm_head.weight.mul_(2)  # the partial update: only the head changed
    assert_serves(pool, expected, v + 2)


def test_a_trainer_holding_fsdp_shards_streams_them(cluster, pool):
    v = pool.weights_version
    done = trainer(cluster, 14, "fsdp", bucket_bytes=50_000)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sharded DTensor" in done.stdout and f"version {v + 1}" in done.stdout
    assert_serves(pool, perturbed(14), v + 1)


def test_a_trainer_killed_mid_stream_changes_nothing(cluster, pool, tmp_path):
    before = save(perturbed(17), tmp_path / "before")
    v = pool.update_weights(before)
    done = trainer(cluster, 6, "dies", bucket_bytes=20_000)  # many buckets: it dies after sending some
    assert done.returncode == 9, done.stderr[-3000:]
    assert_serves(pool, load_model(before, backend="torch"), v)
    new = perturbed(7)
    version = pool.update_weights(save(new, tmp_path / "ckpt"))  # the owner is free for the next update
    assert version > v
    assert_serves(pool, new, version)


def test_refused_updates_change_nothing(pool, tmp_path):
    path = save(perturbed(8), tmp_path / "good")
    v = pool.update_weights(path)
    truncated = tmp_path / "truncated"
    shutil.copytree(path, truncated)
    shard = next(truncated.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-64])
    norm = torch.ones(64)
    norm[37] = float("inf")  # a diverged trainer's weights: streamed, checked on every worker before any commits
    refusals = [
        ({"model.norm.weight": norm}, NonFiniteWeights, r"'model.norm.weight' holds NaN or infinite values"),
        ({"lm_head.weight": torch.zeros(7, 64)}, IncompatibleWeights, r"'lm_head.weight' has shape \[7, 64\]"),
        ({"model.layers.9.x": torch.zeros(1)}, IncompatibleWeights, "the update has 1 tensors the model does not"),
        (str(truncated), InvalidCheckpoint, "is truncated"),
        (str(tmp_path / "nothing-here"), CheckpointNotFound, "no checkpoint directory"),
    ]
    for weights, error, message in refusals:
        with pytest.raises(error, match=message):
            pool.update_weights(weights)
    assert_serves(pool, load_model(path, backend="torch"), v)
    assert pool.update_weights(path) == v + 1  # a refused update took no version
    assert pool.update_weights({"model.norm.weight": norm}, allow_non_finite=True) == v + 2  # unless allowed


def test_restarted_workers_come_back_with_the_current_weights(pool, tmp_path):
    path = save(perturbed(9), tmp_path / "step-1")
    version = pool.update_weights(path)
    pid = pool.health()[0]["pid"]
    ray.kill(pool.workers[0], no_restart=False)  # restarted from the checkpoint it was last given
    model = load_model(path, backend="torch")
    assert_serves(pool, model, version)
    assert pool.health()[0]["pid"] != pid

    shutil.rmtree(path)  # the trainer rotated its checkpoints: a restarted worker gets them from its peer
    ray.kill(pool.workers[1], no_restart=False)
    assert_serves(pool, model, version)

    streamed = perturbed(10)
    version = pool.update_weights(dict(streamed.named_parameters()))  # streamed from this process (gloo)
    ray.kill(pool.workers[0], no_restart=False)
    assert_serves(pool, streamed, version)


def test_two_handles_updating_at_once_get_distinct_increasing_versions(pool, tmp_path):
    paths = [save(perturbed(20 + i), tmp_path / f"c{i}") for i in range(4)]
    v = pool.weights_version
    other = WorkerPool.connect("owner-test")  # a trainer's handle beside the service's
    landed, errors = [], []

    def update(handle, path):
        try:
            landed.append((handle.update_weights(path), path))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=update, args=(h, p)) for h in (pool, other) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors
    versions = sorted(v for v, _ in landed)
    assert versions == list(range(v + 1, v + 9))
    last = max(landed)[1]
    assert_serves(other, load_model(last, backend="torch"), v + 8)


def kept(pool):
    """The local copy's path once the owner has heard it is whole (written in the background)."""
    deadline = time.monotonic() + 120
    while (keep := ray.get(pool.owner.state.remote())["source"].get("keep")) is None:
        assert time.monotonic() < deadline, "no local copy was kept"
        time.sleep(0.1)
    return keep


def copy_threads(worker) -> tuple:
    """What a worker runs to keep local copies: (keeps streamed weights, has a writer thread, threads named so)."""
    def of(w):
        copy = w.worker.weights._copy
        return copy.streams, copy.writer is not None, [t.name for t in threading.enumerate()
                                                              if t.name == "local-copy"]

    return ray.get(worker.__ray_call__.remote(of))


def test_a_lone_worker_at_defaults_links_checkpoints_and_writes_nothing_of_streams(cluster, tmp_path):
    pool = WorkerPool.create("tiny", 1, max_tokens_per_batch=256, backend="torch")
    try:
        path = save(perturbed(11), tmp_path / "step-1")
        model = load_model(path, backend="torch")
        version = pool.update_weights(path)
        keep = kept(pool)
        assert os.path.samefile(f"{keep}/model.safetensors", f"{path}/model.safetensors")  # a hard link: free
        shutil.rmtree(path)  # rotated away: no checkpoint, no peer
        ray.kill(pool.workers[0], no_restart=False)
        assert_serves(pool, model, version)
        for seed in (12, 13):  # back to back: the first leaves nothing running that the second waits on
            streamed = perturbed(seed)
            version = pool.update_weights(dict(streamed.named_parameters()))
            assert copy_threads(pool.workers[0]) == (False, False, [])
        assert ray.get(pool.owner.state.remote())["source"] == {"stream": True}
        assert_serves(pool, streamed, version)
    finally:
        pool.shutdown()


def test_one_worker_keeps_streamed_weights_when_asked(cluster):
    pool = WorkerPool.create("tiny", 1, max_tokens_per_batch=256, backend="torch", local_copy=True)
    try:
        for seed in (12, 13):
            streamed = perturbed(seed)
            version = pool.update_weights(dict(streamed.named_parameters()))
        keep = kept(pool)  # (the owner takes only the current version's copy)
        assert keep.endswith(f"v{version}") and copy_threads(pool.workers[0])[0]
        written = load_file(f"{keep}/model.safetensors")  # read back by safetensors itself
        assert {n: p.dtype for n, p in written.items()} == {n: p.dtype for n, p in streamed.named_parameters()}
        for name, p in streamed.named_parameters():
            assert torch.equal(written[name], p.detach()), name
        ray.kill(pool.workers[0], no_restart=False)
        assert_serves(pool, streamed, version)
    finally:
        pool.shutdown()


def test_a_lone_worker_restarted_after_a_stream_asks_for_the_weights_again(cluster):
    """At the defaults nothing of streamed weights is kept: the restarted worker says so (never scoring with old or
    initial weights) until the trainer's next send, through the sender it holds open."""
    pool = WorkerPool.create("tiny", 1, max_tokens_per_batch=256, backend="torch")
    try:
        with pool.weight_sender() as sender:
            sender.send(perturbed(13).named_parameters())
            streamed = perturbed(14)
            version = sender.send(streamed.named_parameters())
            ray.kill(pool.workers[0], no_restart=False)
            with pytest.raises(WeightsUnavailable, match=f"needs weights version {version}, which were streamed"):
                pool.compute_log_probs(SEQS)
            again = sender.send(streamed.named_parameters())  # the trainer's next step
        assert again == version + 1
        assert_serves(pool, streamed, again)
    finally:
        pool.shutdown()


class Held(dict):
    """A trainer's tensors, the second of which is handed over only once `release` is set: the workers wait
    mid-update, in their staging thread, meanwhile."""

    def __init__(self, items):
        super().__init__(items)
        self.reads, self.reached, self.release = 0, threading.Event(), threading.Event()

    def __getitem__(self, name):
        self.reads += 1
        if self.reads == 2:
            self.reached.set()
            self.release.wait(300)
        return super().__getitem__(name)


def test_workers_score_with_the_old_weights_while_an_update_is_received(cluster):
    pool = WorkerPool.create("tiny", 2, max_tokens_per_batch=256, backend="torch")
    streamed = perturbed(17)
    tensors = Held(streamed.named_parameters())
    landed = []
    sending = threading.Thread(target=lambda: landed.append(pool.update_weights(tensors)))
    try:
        sending.start()
        assert tensors.reached.wait(120)
        results = ray.get(pool.compute_log_probs_async(SEQS), timeout=120)  # (without staging beside: waits)
        for seq, r in zip(SEQS, results, strict=True):
            np.testing.assert_allclose(r.log_probs, alone(load_model("tiny", backend="torch"), seq)[0], atol=1e-5)
            assert r.weights_version == 0
        assert {h["weights_version"] for h in pool.health(timeout=60)} == {0}
        tensors.release.set()
        sending.join(120)
        assert landed == [1]
        assert_serves(pool, streamed, 1)
    finally:
        tensors.release.set()
        pool.shutdown()


def test_a_restarted_owner_counts_on_and_finds_its_workers(pool, tmp_path):
    first = pool.update_weights(save(perturbed(15), tmp_path / "a"))
    ray.kill(pool.owner, no_restart=False)  # Ray restarts it; its state is in the GCS, its workers found by name
    path = save(perturbed(16), tmp_path / "b")
    second = pool.update_weights(path)
    assert second > first
    assert_serves(pool, load_model(path, backend="torch"), second)


@ray.remote(concurrency_groups={"staging": 1})
class _HungReader:
    """A worker whose checkpoint read never ends (a hung network file system), scoring meanwhile."""

    def stage_checkpoint(self, path, version, check=False):
        threading.Event().wait()

    def ping(self):
        return "scoring"


def test_a_checkpoint_read_past_its_deadline_fails_the_update_and_the_worker_keeps_answering(cluster, monkeypatch):
    from ppo_logprobs.workers.errors import UpdateFailed
    from ppo_logprobs.workers.pool import owner

    monkeypatch.setattr(owner, "READ_DEADLINE_S", 1.0)
    worker = _HungReader.remote()
    try:
        with pytest.raises(UpdateFailed, match=r"did not finish reading the checkpoint '/mnt/slow/ckpt' within 1 s"):
            asyncio.run(owner.WeightOwner._read(worker, "/mnt/slow/ckpt", 3))
        assert ray.get(worker.ping.remote(), timeout=10) == "scoring"
    finally:
        ray.kill(worker)

"""Reloads through HTTP and trainer updates beside them: refusals change nothing, versions are unique and every
answer's results are those of its version's weights."""

import asyncio
import os
import re
import struct
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import ray
import torch

from ppo_logprobs.client import connect_pool
from ppo_logprobs.service import Settings
from ppo_logprobs.workers import load_model

from ..helpers import alone, perturbed, random_sequences, save, serving

SEQS = random_sequences(4, seed=60, hi=70)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    good = {save(perturbed(70 + i), root / f"step-{i}"): None for i in range(4)}
    for path in good:
        good[path] = load_model(path, backend="torch")
    return good, root


@pytest.fixture(scope="module")
def server():
    settings = Settings(models={"policy": "tiny"}, backend="torch", workers_per_model=2, pool_name="weights-test")
    with serving(3, {"weights": settings}) as url:
        yield url


def score(url):
    r = httpx.post(url + "/logprobs", json={"input_ids": SEQS}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def matches(body, model):
    for res, seq in zip(body["results"], SEQS, strict=True):
        lp, ent = alone(model, seq)
        if not (np.allclose(res["log_probs"], lp, rtol=0, atol=1e-5) and np.allclose(res["entropy"], ent, atol=1e-5)):
            return False
    return True


def refusals(root):
    shard = next((root / "step-0").glob("*.safetensors")).read_bytes()
    (root / "truncated").mkdir(exist_ok=True)
    (root / "truncated" / "model.safetensors").write_bytes(shard[:-100])
    (root / "garbage").mkdir(exist_ok=True)
    (root / "garbage" / "model.safetensors").write_bytes(b"\x00" * 64)
    (root / "empty").mkdir(exist_ok=True)
    (root / "fifo").mkdir(exist_ok=True)
    if not (root / "fifo" / "model.safetensors").exists():
        os.mkfifo(root / "fifo" / "model.safetensors")  # a reader that opened it would wait for a writer forever
    (root / "deep").mkdir(exist_ok=True)
    (root / "deep" / "model.safetensors").write_bytes(struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000)
    return [
        (save(perturbed(80, vocab_size=600), root / "vocab"), 409, "has shape [600, 64] in the checkpoint"),
        (save(perturbed(81, num_hidden_layers=3), root / "layers"), 409, "the checkpoint has 3 layers, the model 2"),
        (save(perturbed(82, intermediate_size=96), root / "mlp"), 409,
         "has shape [64, 96] in the checkpoint and [64, 128] in the model"),
        (str(root / "no-such-dir"), 404, "no checkpoint directory at"),
        ("/etc/passwd", 404, "no checkpoint directory at '/etc/passwd'"),
        ("Qwen/Qwen2.5-7B", 404, "no checkpoint directory at 'Qwen/Qwen2.5-7B'"),
        ("/tmp/a\x00b", 404, "no checkpoint directory"),
        (str(root / "truncated"), 422, "is truncated"),
        (str(root / "garbage"), 422, "has a malformed safetensors header"),
        (str(root / "empty"), 422, "has no *.safetensors weights"),
        (str(root / "fifo"), 422, "model.safetensors is not a regular file (a FIFO)"),
        (str(root / "deep"), 422, "has a malformed safetensors header"),
    ]


def test_refused_reloads_change_nothing(server, checkpoints):
    _, root = checkpoints
    before = score(server)
    for path, status, message in refusals(root):
        r = httpx.post(server + "/v1/models/policy/reload", json={"path": path}, timeout=120)
        assert r.status_code == status, (path, r.text)
        detail = r.json()["detail"]
        assert message in detail and "Traceback" not in detail and "\n" not in detail, detail
        after = score(server)
        assert after == before  # the same version, the same bits
    assert before["weights_version"] == 0 and matches(before, load_model("tiny", backend="torch"))


def test_scoring_and_readiness_go_on_while_bad_updates_are_refused(server, checkpoints, tmp_path):
    """A checkpoint with a NaN and one whose shard is a FIFO, each sent with scoring requests and readiness checks
    beside it: each is refused (4xx), and everything else is answered, with the weights served before."""
    _, root = checkpoints
    refusals(root)
    broken = perturbed(98)
    with torch.no_grad():
        broken.model.layers[1].mlp.down_proj.weight[3, 5] = float("inf")
    paths = [save(broken, tmp_path / "inf"), str(root / "fifo")]
    before = score(server)

    async def run(path):
        async with httpx.AsyncClient(base_url=server, timeout=60) as client:
            calls = [client.post("/v1/models/policy/reload", json={"path": path})]
            calls += [client.post("/logprobs", json={"input_ids": SEQS}) for _ in range(8)]
            calls += [client.get("/readyz") for _ in range(4)]
            return await asyncio.gather(*calls)

    for path, status in zip(paths, (409, 422), strict=True):
        reload, *answers = asyncio.run(run(path))
        assert reload.status_code == status, reload.text
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        assert all(a.json() in (before, {"ready": True}) for a in answers)  # the old version, the same bits


def test_concurrent_reloads_and_scoring(server, checkpoints):
    models, _ = checkpoints
    paths = list(models) * 2  # 8 reloads of 4 checkpoints

    async def scored(client):
        """A score, asked again after a 503 of weights that kept changing under its parts, as the clients do (eight
        reloads back to back can outrun the service's own VERSION_ATTEMPTS)."""
        for _ in range(10):
            r = await client.post("/logprobs", json={"input_ids": SEQS})
            if r.status_code != 503 or "the weights changed" not in r.text:
                return r
        return r

    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=300) as client:
            reloads = [client.post("/v1/models/policy/reload", json={"path": p}) for p in paths]
            scoring = [scored(client) for _ in range(16)]
            answers = await asyncio.gather(*reloads, *scoring)
            return answers[: len(paths)], answers[len(paths) :]

    reloads, scores = asyncio.run(run())
    assert all(r.status_code == 200 for r in reloads), [r.text for r in reloads]
    landed = {r.json()["weights_version"]: p for r, p in zip(reloads, paths, strict=True)}
    assert len(landed) == 8  # distinct versions
    start = min(landed)
    assert sorted(landed) == list(range(start, start + 8))
    landed[start - 1] = None  # before the first of these reloads (any earlier weights: checked only if seen)
    for r in scores:
        assert r.status_code == 200, r.text
        version = r.json()["weights_version"]
        if landed.get(version) is not None:
            assert matches(r.json(), models[landed[version]]), version
    final = score(server)
    assert final["weights_version"] == start + 7 and matches(final, models[landed[start + 7]])


def test_a_trainer_updating_beside_gateway_reloads(server, checkpoints):
    models, _ = checkpoints
    pool = connect_pool("policy", service="weights-test")  # the trainer's handle on the service's pool
    trainer_models = [perturbed(90 + i) for i in range(3)]
    landed, errors = [], []

    def trainer():
        try:
            with pool.weight_sender() as sender:
                for m in trainer_models:
                    landed.append(("trainer", sender.send(m.named_parameters()), m))
        except Exception as e:  # reported below
            errors.append(e)

    def gateway():
        for path in list(models)[:3]:
            r = httpx.post(server + "/v1/models/policy/reload", json={"path": path}, timeout=300)
            if r.status_code != 200:
                errors.append(r.text)
                return
            landed.append(("reload", r.json()["weights_version"], models[path]))

    threads = [threading.Thread(target=trainer), threading.Thread(target=gateway)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    versions = [v for _, v, _ in landed]
    assert len(set(versions)) == 6
    for who in ("trainer", "reload"):
        mine = [v for w, v, _ in landed if w == who]
        assert mine == sorted(mine)
    last = max(landed, key=lambda x: x[1])
    body = score(server)
    assert body["weights_version"] == last[1] == pool.weights_version
    assert matches(body, last[2])


def test_weights_that_give_non_finite_results_answer_500_with_an_id_in_the_log(server, tmp_path):
    """A checkpoint with a NaN is refused (409 naming the tensor, nothing changed) unless allowed; allowed, its
    non-finite results are a 500 whose id is in the log."""
    broken = perturbed(99)
    with torch.no_grad():
        broken.lm_head.weight[7, 0] = float("nan")
    path = save(broken, tmp_path / "nan")
    before = score(server)
    refused = httpx.post(server + "/v1/models/policy/reload", json={"path": path}, timeout=120)
    assert refused.status_code == 409, refused.text
    assert re.search(r"'(lm_head|model\.embed_tokens)\.weight' holds NaN or infinite values", refused.json()["detail"])
    assert score(server) == before  # the same version, the same bits
    assert httpx.post(server + "/v1/models/policy/reload", json={"path": path, "allow_non_finite": True},
                      timeout=120).status_code == 200
    r = httpx.post(server + "/logprobs", json={"input_ids": SEQS}, timeout=120)
    assert r.status_code == 500, r.text
    detail = r.json()["detail"]
    assert re.fullmatch(r"internal error [0-9a-f]{12} \(in the gateway's log\)", detail), detail
    error_id = detail.split()[2]
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    deadline = time.monotonic() + 30
    while not any(error_id in f.read_text(errors="replace") for f in logs.rglob("*") if f.is_file()):
        assert time.monotonic() < deadline, "the error id is not in the logs"
        time.sleep(0.5)

"""The per-token outputs' table (workers/outputs.py): a row added in a test, with its computation for the head's torch
backend, reaches every layer with nothing else changed: the head (fused_log_probs), the patched model's output, the
worker's results, the gateway's JSON and BINARY answers (the real FastAPI app over a real LogProbWorker, in this
process) and both clients' reading of them, and the HTTP schema's model of a result."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from ppo_logprobs.client import LogProbClient
from ppo_logprobs.service import Settings
from ppo_logprobs.service.app import Gateway, make_fastapi
from ppo_logprobs.workers import LogProbWorker, fused_log_probs, load_model
from ppo_logprobs.workers.outputs import OUTPUTS, Output, add, remove

from .helpers import random_sequences


def _best(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The test's output: each position's largest log-probability (that of its most likely token)."""
    return logits.max(dim=-1).values - lse


@pytest.fixture
def best():
    row = add(Output("best_log_prob", "<f4", "top_k", wide=False, description="the most likely token's log-prob",
                     torch=_best))
    yield row
    remove(row.name)


class _Pool:
    """A served model's pool made of one LogProbWorker in this process (what the routes call of a pool)."""

    def __init__(self, worker: LogProbWorker) -> None:
        self.worker, self.vocab_size = worker, worker.model.config.vocab_size

        async def state():
            return {"version": worker.weights_version}

        self.owner = SimpleNamespace(state=SimpleNamespace(remote=state))

    async def score(self, request):
        return self.worker.score_request(request)


def test_a_row_added_reaches_the_head_the_worker_the_answers_and_the_clients(best):
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 5, 16, generator=g), torch.randn(40, 16, generator=g)
    labels = torch.randint(0, 40, (2, 5), generator=g)
    labels[1, 4] = -100
    out = fused_log_probs(hidden, weight, labels, top_k=3, backend="torch")
    z = hidden.double() @ weight.double().T  # (the float64 reference)
    want = (z.max(-1).values - torch.logsumexp(z, -1)).masked_fill(labels == -100, 0)
    torch.testing.assert_close(out.best_log_prob.double(), want, rtol=0, atol=1e-5)
    assert out.extras.keys() == {"top_log_probs", "top_ids", "tail_log_prob", "best_log_prob"}
    assert fused_log_probs(hidden, weight, labels, backend="torch")[1] is not None  # (not asked: a plain pair)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (the compiled kernels take CUDA tensors)
    with pytest.raises(ValueError, match="'best_log_prob' has no Triton kernel"):
        fused_log_probs(hidden.to(device), weight.to(device), labels.to(device), top_k=3, backend="triton")

    model = load_model("tiny", backend="torch")
    ids = torch.tensor([[5, 17, 300, 42, 7]])
    patched = model(input_ids=ids, labels=ids.roll(-1, 1), top_k=2)
    torch.testing.assert_close(patched.best_log_prob, patched.top_log_probs[..., 0])
    assert patched["best_log_prob"] is patched.best_log_prob

    worker = LogProbWorker("tiny", backend="torch")
    seqs = random_sequences(5, seed=3, hi=40)
    scored = worker.score(seqs, 2, top_k=3)
    for s in scored:
        assert s.best_log_prob.dtype == np.float32
        np.testing.assert_array_equal(s.best_log_prob, s.top_log_probs[:, 0])
    assert worker.score(seqs, 2)[0].best_log_prob is None  # (not asked for)

    app = make_fastapi()
    app.state.gateway = Gateway(Settings(backend="torch"), {"policy": _Pool(worker)})
    for binary in (False, True):
        with LogProbClient("http://127.0.0.1", binary=binary) as client:
            client._http = TestClient(app, base_url=client.base_url)
            got = client.score(seqs, 2, top_k=3)
        for g_, s in zip(got, scored, strict=True):
            np.testing.assert_array_equal(g_.best_log_prob, s.best_log_prob)
            np.testing.assert_array_equal(g_.top_ids, s.top_ids)
    body = {"input_ids": seqs[:1], "score_from": 2, "top_k": 1}
    answer = TestClient(app, base_url="http://127.0.0.1").post("/logprobs", json=body).json()["results"][0]
    np.testing.assert_array_equal(np.array(answer["best_log_prob"], np.float32), scored[0].best_log_prob)

    from ppo_logprobs.service.schemas import sequence_result

    field = sequence_result().model_fields["best_log_prob"]  # (as the schema module makes it when loaded)
    assert field.description == "the most likely token's log-prob" and field.annotation == list[float] | None


def test_the_table_and_the_head_agree_on_the_built_in_rows():
    from ppo_logprobs.workers.models.patch_model import CausalLMOutputForPPO

    assert list(OUTPUTS) == ["top_log_probs", "top_ids", "tail_log_prob", "candidate_log_probs"]
    assert set(OUTPUTS) <= set(CausalLMOutputForPPO.__dataclass_fields__)
    assert OUTPUTS["tail_log_prob"].to_json(np.array([-math.inf, -1.5], np.float32)) == [None, -1.5]
    assert OUTPUTS["tail_log_prob"].from_json([None, -1.5]).tolist() == [-math.inf, -1.5]
    with pytest.raises(ValueError, match="an output named 'top_ids' exists"):
        add(Output("top_ids", "<i4", "top_k", wide=True))

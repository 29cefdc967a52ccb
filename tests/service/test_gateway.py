"""The gateway under Ray Serve, called over real HTTP on loopback."""

import asyncio
import importlib.metadata
import ipaddress
import os
import signal
import time

import httpx
import numpy as np
import pytest
import ray
from ray import serve

from ppo_logprobs.service import Settings
from ppo_logprobs.workers import load_model

from ..helpers import alone, perturbed, random_sequences, save, scoring_now, serving


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint directory of the tiny model with other weights (the reference model, and a reload)."""
    path = save(perturbed(9), tmp_path_factory.mktemp("ckpt"))
    return path, load_model(path, backend="torch")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A word-level tokenizer of the tiny model's 503 ids ("t0" .. "t502"), saved as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(503)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def server(checkpoint, tokenizer_dir):
    # one ingress replica each (a 2-core host's default; more cores give more): /metrics is the answering replica's
    one = dict(ingress_replicas=1)
    main = Settings(models={"policy": "tiny", "reference": checkpoint[0]}, backend="torch", max_request_tokens=4000,
                    pool_name="gw-main", max_tokens_per_batch=512, **one)
    # big and slow differ only in the gateway's settings: their keepers attach to one pool (made by the first, whose
    # workers' steps are of 512 tokens); small has its own, since a test deletes that application, which shuts its
    # pool down
    small = Settings(models={"policy": "tiny"}, backend="torch", max_queue=2, api_key="s3cret",
                     pool_name="gw-small", **one)
    big = Settings(models={"policy": "tiny"}, backend="torch", max_tokens_per_batch=512, pool_name="gw-big", **one)
    slow = Settings(models={"policy": "tiny"}, backend="torch", max_queue=2, body_timeout_s=15, pool_name="gw-big",
                    max_tokens_per_batch=512, max_top_k=4, max_token_ids=3, tokenizer=tokenizer_dir, **one)
    with serving(6, {"main": main, "small": small, "big": big, "slow": slow}) as url:
        yield url


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", backend="torch")


def post(server, body, path="/logprobs", **kw):
    return httpx.post(server + path, json=body, timeout=120, **kw)


def check(result, model, seq, score_from=1, temperature=1.0):
    lp, ent = alone(model, seq, score_from, temperature)
    np.testing.assert_allclose(np.array(result["log_probs"], dtype=np.float32), lp, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.array(result["entropy"], dtype=np.float32), ent, rtol=0, atol=1e-5)


def test_results_equal_the_model_in_order(server, tiny):
    seqs = random_sequences(12, seed=20, hi=90)
    starts = [1 + i % 4 for i in range(12)]
    r = post(server, {"input_ids": seqs, "score_from": starts, "temperature": 0.8})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "policy" and body["weights_version"] == 0
    assert body["usage"] == {"sequences": 12, "tokens": sum(map(len, seqs)), "computed_tokens": sum(map(len, seqs)),
                             "scored_tokens": sum(len(s) - k for s, k in zip(seqs, starts, strict=True))}
    for res, seq, s in zip(body["results"], seqs, starts, strict=True):
        check(res, tiny, seq, s, 0.8)
    r = post(server, {"input_ids": seqs[:2], "return_entropy": False})
    assert all("entropy" not in res for res in r.json()["results"])


def test_the_ingress_replicas_and_weight_owners_import_no_torch(server):
    """A process that holds only a pool's handles (an ingress replica, a pool's owner) loads neither torch nor
    transformers: it starts in a fraction of the time and memory (the actor class of a handle it receives is
    loaded with it, so that class imports them only when an actor is made)."""
    def imported(_) -> tuple[bool, bool]:
        import sys

        return "torch" in sys.modules, "transformers" in sys.modules

    actors = [a for a in ray.util.list_named_actors(all_namespaces=True)
              if "#LogProbsIngress#" in a["name"] or a["name"].endswith(":owner")]
    assert sum("#LogProbsIngress#" in a["name"] for a in actors) == 4 and len(actors) == 8  # (4 pools' owners)
    for a in actors:
        handle = ray.get_actor(a["name"], namespace=a["namespace"])
        assert ray.get(handle.__ray_call__.remote(imported), timeout=60) == (False, False), a["name"]


def test_two_models_chosen_per_request(server, tiny, checkpoint):
    seqs = random_sequences(3, seed=21)
    for name, model in (("policy", tiny), ("reference", checkpoint[1])):
        r = post(server, {"model": name, "input_ids": seqs})
        assert r.status_code == 200 and r.json()["model"] == name
        for res, seq in zip(r.json()["results"], seqs, strict=True):
            check(res, model, seq)
    listed = httpx.get(server + "/v1/models").json()["data"]
    assert [m["name"] for m in listed] == ["policy", "reference"] and listed[0]["vocab_size"] == 503


MALFORMED = [
    ("not json", "the body is not valid JSON", 422),
    ({}, "input_ids: Field required", 422),
    ({"input_ids": []}, "input_ids", 422),
    ({"input_ids": [[]]}, "input_ids[0] has 0 tokens", 422),
    ({"input_ids": [[5]]}, "input_ids[0] has 1 token; scoring needs at least 2", 422),
    ({"input_ids": [[1, 2], [3, 503]]}, "input_ids[1][1] = 503 is outside the vocabulary", 422),
    ({"input_ids": [[1, 2], [-4, 3]]}, "input_ids[1][0] = -4", 422),
    ({"input_ids": [[1, 2.5]]}, "input_ids[0][1]: ", 422),
    ({"input_ids": [[1, "2"]]}, "input_ids[0][1]: ", 422),
    ({"input_ids": "1 2 3"}, "input_ids", 422),
    # one sequence sent flat: said once, not once a token
    ({"input_ids": [1, 2, 3, 4]}, "input_ids[0]: Input should be a valid array (got 1), and 3 more like it (input_ids "
     "is a list of sequences, each a list of token ids)", 422),
    ({"input_ids": [[1, "a"], [2, "b"]]}, "input_ids[0][1]: Input should be a valid integer (got 'a'), and 1 more",
     422),
    ({"input_ids": [[1, 2, 3]], "score_from": 4}, "score_from[0] = 4 must be in [1, 3]", 422),
    ({"input_ids": [[1, 2, 3]], "score_from": 0}, "score_from[0] = 0", 422),
    ({"input_ids": [[1, 2, 3]], "score_from": [1, 1]}, "score_from has 2 entries for 1 sequences", 422),
    ({"input_ids": [[1, 2, 3]], "score_from": 1.5}, "score_from", 422),
    ({"input_ids": [[1, 2, 3]], "temperature": 0}, "temperature[0] = 0.0 must be a number in [0.01, 100]", 422),
    ({"input_ids": [[1, 2, 3]], "temperature": -1.0}, "temperature[0] = -1.0", 422),
    ({"input_ids": [[1, 2, 3]], "temperature": 1e-45}, "temperature[0] = 1e-45 must be a number in [0.01, 100]", 422),
    ({"input_ids": [[1, 2, 3]], "temperature": 1e-30}, "temperature[0] = 1e-30 must be a number in [0.01, 100]", 422),
    ({"input_ids": [[1, 2, 3]], "temperature": 1e308}, "temperature[0] = 1e+308 must be a number in [0.01, 100]", 422),
    ({"input_ids": [[1, 2, 3]], "model": "x" * 50000}, "model 'xxxxxxxx", 404),
    ({"input_ids": [[1, 2, 3]], "temperature": "hot"}, "temperature", 422),
    ({"input_ids": [[1, 2, 3]], "temperature": 2**1100}, "temperature: is beyond the range of a float64", 422),
    ({"input_ids": [[1, 2, 3]], "temperature": [-(2**1100)]}, "temperature[0]: is beyond the range of a float64", 422),
    ({"input_ids": [[1, 2, 3, 4]], "rollout_log_probs": [[-(10**400), -1, -1]]},
     "rollout_log_probs[0][0] = -1000000", 422),
    ({"input_ids": [[1, 2, 3, 4]], "rollout_log_probs": [[-1, -1, -(2**1100)]]}, "rollout_log_probs[0][2] = -135", 422),
    ({"input_ids": [[1, 2, 3]], "return_entropy": "yes"}, "return_entropy", 422),
    ({"input_ids": [[1, 2, 3]], "extra": 1}, "extra: Extra inputs are not permitted", 422),
    ({"input_ids": [[1, 2, 3]], "model": "critic"}, "model 'critic' is not served", 404),
    ({"input_ids": [list(range(1, 501))] * 9}, "the request has 4500 tokens; the limit is 4000", 413),
    ({"input_ids": [[1] * 513]}, "input_ids[0] has 513 tokens; this model takes at most 512", 413),
]


@pytest.mark.parametrize("body, message, status", MALFORMED)
def test_malformed_requests_get_a_4xx_naming_the_problem(server, body, message, status):
    if isinstance(body, str):
        r = httpx.post(server + "/logprobs", content=body, headers={"Content-Type": "application/json"}, timeout=60)
    else:
        r = post(server, body)
    assert r.status_code == status, r.text
    detail = r.json()["detail"]
    assert message in detail, detail
    assert len(detail) < 1100 and "Traceback" not in detail and "\x1b" not in detail and "\n" not in detail
    assert post(server, {"input_ids": [[1, 2, 3]]}).status_code == 200  # still healthy


def test_concurrent_clients_each_get_their_own_results(server, tiny):
    requests = [random_sequences(1 + i % 3, seed=100 + i, hi=50) for i in range(64)]

    async def run():
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=server, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(client.post("/logprobs", json={"input_ids": r}) for r in requests))

    responses = asyncio.run(run())
    for seqs, resp in zip(requests, responses, strict=True):
        assert resp.status_code == 200, resp.text
        for res, seq in zip(resp.json()["results"], seqs, strict=True):
            check(res, tiny, seq)


def test_auth_and_overload(server):
    seqs = [[1, 2, 3, 4]]
    assert post(server, {"input_ids": seqs}, "/small/logprobs").status_code == 401
    bad = {"Authorization": "Bearer wrong"}
    assert post(server, {"input_ids": seqs}, "/small/logprobs", headers=bad).status_code == 401
    good = {"Authorization": "Bearer s3cret"}
    assert post(server, {"input_ids": seqs}, "/small/logprobs", headers=good).status_code == 200
    assert httpx.get(server + "/small/healthz").status_code == 200  # health needs no key

    async def flood():
        async with httpx.AsyncClient(base_url=server, timeout=120, headers=good) as client:
            return await asyncio.gather(*(client.post("/small/logprobs", json={"input_ids": seqs}) for _ in range(40)))

    responses = asyncio.run(flood())
    codes = {r.status_code for r in responses}
    assert codes <= {200, 429} and 429 in codes and 200 in codes
    assert all(r.headers["Retry-After"] == "1" for r in responses if r.status_code == 429)


def test_reload_switches_to_the_new_checkpoint(server, tiny, checkpoint):
    seqs = random_sequences(3, seed=22)
    r = post(server, {"path": checkpoint[0]}, "/v1/models/policy/reload")
    assert r.status_code == 200, r.text
    assert r.json()["weights_version"] == 1
    body = post(server, {"input_ids": seqs}).json()
    assert body["weights_version"] == 1
    for res, seq in zip(body["results"], seqs, strict=True):
        check(res, checkpoint[1], seq)
    assert post(server, {"path": "/no/such/dir"}, "/v1/models/policy/reload").status_code >= 400
    assert post(server, {"input_ids": seqs}).json()["weights_version"] == 1


def test_health_ready_metrics_docs(server):
    assert httpx.get(server + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(server + "/readyz")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    answer = httpx.get(server + "/metrics")
    metrics, replica = answer.text, answer.headers["X-Replica"]
    assert f'ppo_logprobs_requests_total{{replica="{replica}",status="200"}}' in metrics
    assert "ppo_logprobs_latency_seconds_bucket" in metrics and "ppo_logprobs_queue_depth" in metrics
    assert f'ppo_logprobs_workers{{model="policy",replica="{replica}",state="live"}} 1.0' in metrics
    assert f'ppo_logprobs_weights_version{{model="reference",replica="{replica}"}} 0.0' in metrics
    assert httpx.get(server + "/docs").status_code == 200
    assert "/logprobs" in httpx.get(server + "/openapi.json").json()["paths"]


def test_a_worker_killed_under_load(server, tiny, checkpoint):
    """SIGKILL the policy worker's process mid-load: every answer is right for its own request or a clear 5xx,
    and the service recovers with the weights it served before (the reload test may have changed them)."""
    import os
    import signal
    import threading
    import time

    version = httpx.get(server + "/v1/models").json()["data"][0]["weights_version"]
    model = tiny if version == 0 else checkpoint[1]
    requests = [random_sequences(2, seed=300 + i, lo=100, hi=400) for i in range(24)]
    pid = next(w["pid"] for w in httpx.get(server + "/v1/health").json()["models"]["policy"])

    def kill_soon():  # once the worker is scoring the requests (mid-call)
        scoring_now(ray.get_actor("gw-main:policy:worker:0", namespace="ppo_logprobs"))
        os.kill(pid, signal.SIGKILL)

    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=300) as client:
            return await asyncio.gather(*(client.post("/logprobs", json={"input_ids": r}) for r in requests))

    killer = threading.Thread(target=kill_soon)
    killer.start()
    responses = asyncio.run(run())
    killer.join()
    for seqs, resp in zip(requests, responses, strict=True):
        if resp.status_code == 200:
            assert resp.json()["weights_version"] == version
            for res, seq in zip(resp.json()["results"], seqs, strict=True):
                check(res, model, seq)
        else:
            assert resp.status_code == 503 and "temporarily unavailable" in resp.json()["detail"]
    assert sum(r.status_code == 200 for r in responses) > 0
    deadline = time.monotonic() + 120
    while httpx.get(server + "/readyz", timeout=60).status_code != 200:
        assert time.monotonic() < deadline, "the service did not recover"
        time.sleep(1)
    assert next(w["pid"] for w in httpx.get(server + "/v1/health").json()["models"]["policy"]) != pid
    seqs = random_sequences(3, seed=400)
    body = post(server, {"input_ids": seqs}).json()
    assert body["weights_version"] == version
    for res, seq in zip(body["results"], seqs, strict=True):
        check(res, model, seq)


def metric(server, prefix, name, model="policy") -> float:
    key = {"Authorization": "Bearer s3cret"}  # (the small app's; the others have none and take any)
    for line in httpx.get(server + prefix + "/metrics", headers=key).text.splitlines():
        if line.startswith(f'{name}{{model="{model}",'):
            return float(line.split()[-1])
    return 0.0


def steps(server) -> int:
    """The steps the big app's workers have begun (their lines')."""
    return sum(w["steps"] for w in httpx.get(server + "/big/v1/health", timeout=60).json()["models"]["policy"])


def test_a_huge_request_does_not_hold_up_a_small_one(server, tiny):
    """131,072 sequences of 2 tokens (the request limit) go to the worker, whose line cuts them into steps of 2048
    tokens (128 of them, so that the small request arrives while they run, on a GPU too); the small one goes into
    the next step and is answered before the huge one."""
    huge = [[int(i % 500), int((i * 7) % 500)] for i in range(131072)]
    small = random_sequences(2, seed=500)
    done, before = [], steps(server)

    async def run():
        async with httpx.AsyncClient(base_url=server + "/big", timeout=600) as client:
            async def send(name, body):
                r = await client.post("/logprobs", json=body)
                done.append(name)
                return r

            big_task = asyncio.create_task(send("huge", {"input_ids": huge, "return_entropy": False}))
            while steps(server) == before:  # the huge request is being scored
                assert not big_task.done(), big_task.result().text
                await asyncio.sleep(0.05)
            small_r = await send("small", {"input_ids": small})
            return await big_task, small_r

    big_r, small_r = asyncio.run(run())
    assert big_r.status_code == 200 and small_r.status_code == 200, (big_r.text[:300], small_r.text[:300])
    assert done == ["small", "huge"]
    assert int(small_r.headers["X-Calls-Waited"]) <= 1  # at most the step that was running when it came
    assert steps(server) - before >= 128  # the huge one took 128 steps or more
    results = big_r.json()["results"]
    assert len(results) == 131072 and all("entropy" not in r for r in results[:10])
    for i in (0, 4097, 131071):  # spot checks: each sequence's one log-prob, in request order
        np.testing.assert_allclose(results[i]["log_probs"], alone(tiny, huge[i])[0], rtol=0, atol=1e-5)
    for res, seq in zip(small_r.json()["results"], small, strict=True):
        check(res, tiny, seq)


def test_bodies_over_the_limit_are_refused_before_parsing(server):
    limit = 16 * 4000 + (1 << 20)  # main: max_request_tokens=4000, default body limit
    r = httpx.post(server + "/logprobs", content=b"[" * (limit + 1), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and f"the limit is {limit}" in r.json()["detail"]

    def chunks():  # no Content-Length: counted while it arrives
        for _ in range(limit // 65536 + 2):
            yield b" " * 65536

    r = httpx.post(server + "/logprobs", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and f"the request body is over {limit} bytes" in r.json()["detail"]


def test_top_k_and_candidates_over_http_in_both_formats(server, checkpoint):
    """top_k and token_ids (one list per sequence, of several lengths) through the batcher, joined with a plain
    request in flight: JSON values as one worker gives them, BINARY the same bits; limits are the service's
    settings, and what exceeds them is a 422 naming the field."""
    from ppo_logprobs.workers import LogProbWorker
    from ppo_logprobs.workers.wire import BINARY, decode_binary

    seqs = random_sequences(6, seed=511, hi=80)
    ids = [[1, 2], [3], [4, 5, 6], [7], [8, 9], [10]]
    body = {"model": "reference", "input_ids": seqs, "score_from": 2, "top_k": 5, "token_ids": ids}
    want = LogProbWorker(checkpoint[1]).score(seqs, 2, top_k=5, token_ids=ids)  # ("policy" may have been reloaded)

    async def both():
        async with httpx.AsyncClient(base_url=server, timeout=120) as client:
            return await asyncio.gather(client.post("/logprobs", json=body),
                                        client.post("/logprobs", json={"model": "reference", "input_ids": seqs}))
    r, plain = asyncio.run(both())
    assert r.status_code == plain.status_code == 200, r.text
    assert all("top_ids" not in res or res["top_ids"] is None for res in plain.json()["results"])
    results = r.json()["results"]
    for i, (res, w) in enumerate(zip(results, want, strict=True)):
        assert np.array_equal(np.array(res["top_ids"]), w.top_ids), i
        for name in ("top_log_probs", "tail_log_prob", "candidate_log_probs"):
            np.testing.assert_allclose(np.array(res[name], dtype=np.float32), getattr(w, name), rtol=0, atol=1e-5)
        assert np.array(res["candidate_log_probs"]).shape == (len(seqs[i]) - 2, len(ids[i]))
    binary = post(server, body, headers={"Accept": BINARY})
    header, _, _, offsets = decode_binary(binary.content)
    arrays = header["arrays"]
    for i, res in enumerate(results):
        span = slice(offsets[i], offsets[i + 1])
        assert np.array_equal(arrays["top_ids"][span], np.array(res["top_ids"]))
        got = arrays["candidate_log_probs"][span, : arrays["candidate_counts"][i]]
        assert np.array_equal(got.view(np.uint32), np.array(res["candidate_log_probs"], np.float32).view(np.uint32))
    for extra, message in (({"top_k": 5}, "top_k = 5 must be an integer in [0, 4]"),
                           ({"token_ids": [1, 2, 3, 4]}, "token_ids has 4 ids; the limit is 3"),
                           ({"token_ids": [[1], [503]]}, "token_ids[1][0] = 503 is outside the vocabulary [0, 503)"),
                           ({"token_ids": [[1]]}, "token_ids has 1 lists for 2 sequences")):
        r = post(server, {"input_ids": seqs[:2], **extra}, "/slow/logprobs")
        assert r.status_code == 422 and message in r.json()["detail"], (extra, r.text)


def test_rollout_log_probs_give_each_result_its_mismatch_and_the_metrics_histograms(server):
    """A rollout engine's log-probs beside the sequences: each result says how far they are from ours (the same
    numbers as computed here from the answer's log-probs, ratio bounds from the settings), JSON and BINARY alike, and
    /metrics counts them per model; a request without them has none; a wrong list is a 422 naming it."""
    from ppo_logprobs.workers.request import mismatch
    from ppo_logprobs.workers.wire import BINARY, decode_binary

    seqs = random_sequences(5, seed=521, lo=4, hi=40)
    rng = np.random.default_rng(5)
    ours = [np.array(res["log_probs"], np.float32) for res in post(server, {"input_ids": seqs}).json()["results"]]
    rollout = [(lp + rng.normal(0, 0.2, lp.size) * (i % 2)).clip(max=0).tolist() for i, lp in enumerate(ours)]
    r = post(server, {"input_ids": seqs, "rollout_log_probs": rollout})
    assert r.status_code == 200, r.text
    offsets = np.concatenate([[0], np.cumsum([lp.size for lp in ours])])
    want = mismatch(np.concatenate(ours), np.concatenate(rollout), offsets, (0.8, 1.25))
    for i, res in enumerate(r.json()["results"]):
        for name, values in want.items():
            assert res["mismatch"][name] == pytest.approx(values[i], rel=1e-9, abs=1e-12), (name, i)
    assert r.json()["results"][0]["mismatch"]["max_abs"] <= 1e-5  # (sequence 0 got our own values back)
    header = decode_binary(post(server, {"input_ids": seqs, "rollout_log_probs": rollout},
                                headers={"Accept": BINARY}).content)[0]
    assert header["mismatch"]["kl_k3"] == [res["mismatch"]["kl_k3"] for res in r.json()["results"]]
    assert "mismatch" not in post(server, {"input_ids": seqs}).json()["results"][0]
    metrics = httpx.get(server + "/metrics").text
    assert 'ppo_logprobs_mismatch_kl_count{model="policy"' in metrics
    bad = post(server, {"input_ids": seqs[:2], "rollout_log_probs": [rollout[0], rollout[0]]})
    assert bad.status_code == 422 and "rollout_log_probs[1] has" in bad.json()["detail"]


def test_completions_with_echo_logprobs_and_prompt_logprobs_are_the_scores(server):
    """/v1/completions as OpenAI's and vLLM's clients read it: echo with logprobs: k (the first token None, then
    each prompt token's log-prob and its top k), prompt_logprobs: k ({id: {logprob, rank, decoded_token}}, the
    actual token always there), max_tokens 0; the values are /logprobs' for the same sequences."""
    prompts = random_sequences(2, seed=531, lo=6, hi=30)
    r = post(server, {"prompt": prompts, "echo": True, "logprobs": 3, "prompt_logprobs": 2, "max_tokens": 0},
             "/v1/completions")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "policy"
    assert body["usage"] == {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": 0,
                             "total_tokens": sum(map(len, prompts))}
    scores = post(server, {"input_ids": prompts, "top_k": 3}).json()["results"]
    for choice, prompt, want in zip(body["choices"], prompts, scores, strict=True):
        lp = choice["logprobs"]
        assert lp["tokens"] == [str(t) for t in prompt] and choice["text"] == " ".join(map(str, prompt))
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        np.testing.assert_allclose(lp["token_logprobs"][1:], want["log_probs"], rtol=0, atol=1e-5)
        assert [list(map(int, top)) for top in lp["top_logprobs"][1:]] == want["top_ids"]
        assert lp["text_offset"][:2] == [0, len(str(prompt[0])) + 1]
        listed = choice["prompt_logprobs"]
        assert listed[0] is None and len(listed) == len(prompt)
        for k, entry in enumerate(listed[1:]):
            actual = entry[str(prompt[k + 1])]
            assert actual["logprob"] == pytest.approx(want["log_probs"][k], abs=1e-5)
            ranked = [e for e in entry.values() if e["rank"] is not None]
            assert [e["rank"] for e in ranked] == [1, 2] and ranked[0]["decoded_token"] == str(want["top_ids"][k][0])
            assert actual["rank"] in (1, 2) if prompt[k + 1] in want["top_ids"][k][:2] else actual["rank"] is None


def test_completions_give_the_most_likely_next_token_and_refuse_what_they_cannot_do(server, tokenizer_dir):
    prompts = random_sequences(3, seed=532, lo=4, hi=20)
    r = post(server, {"prompt": prompts, "max_tokens": 1, "logprobs": 2, "temperature": 0, "return_token_ids": True},
             "/v1/completions")
    assert r.status_code == 200, r.text
    nexts = post(server, {"input_ids": [p + [0] for p in prompts], "top_k": 2}).json()["results"]
    for choice, prompt, want in zip(r.json()["choices"], prompts, nexts, strict=True):
        assert choice["token_ids"] == [want["top_ids"][-1][0]] and choice["prompt_token_ids"] == prompt
        assert choice["text"] == str(want["top_ids"][-1][0]) and choice["finish_reason"] == "length"
        assert choice["logprobs"]["token_logprobs"] == [pytest.approx(want["top_log_probs"][-1][0], abs=1e-5)]
        assert list(choice["logprobs"]["top_logprobs"][0]) == [str(t) for t in want["top_ids"][-1]]
    assert r.json()["usage"]["completion_tokens"] == 3
    for extra, message in (({}, "max_tokens = 16: this service scores prompts and generates at most one token"),
                           ({"max_tokens": 0, "stream": True}, "stream"),
                           ({"max_tokens": 0, "n": 2}, "n = 2"),
                           ({"max_tokens": 1, "top_p": 0.9}, "top_p")):
        r = post(server, {"prompt": prompts[0], **extra}, "/v1/completions")
        assert r.status_code == 400 and message in r.json()["detail"], (extra, r.text)
    r = post(server, {"prompt": "t5 t7", "max_tokens": 0, "echo": True, "logprobs": 0}, "/v1/completions")
    assert r.status_code == 400 and "needs a tokenizer" in r.json()["detail"]
    r = httpx.post(server + "/v1/completions", content=b'{"prompt": [1, 2], "max_tokens": 0}',
                   headers={"Content-Type": "text/plain"})
    assert r.status_code == 415  # (a web page's simple request, as for /logprobs)
    r = post(server, {"prompt": ["t5 t7 t9"], "max_tokens": 1, "echo": True, "logprobs": 1, "return_token_ids": True},
             "/slow/v1/completions")
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == [5, 7, 9]
    assert choice["logprobs"]["tokens"][:3] == ["t5", "t7", "t9"]
    assert choice["logprobs"]["tokens"][3] == f"t{choice['token_ids'][0]}"


def test_openai_clients_list_retrieve_and_score(server, checkpoint):
    """The `openai` package against the gateway, as vLLM users point it: models.list() and models.retrieve() in
    OpenAI's shapes (our fields beside), a 404 for a model not served, and completions.create(echo=True,
    logprobs=5) giving the model's log-probs of the prompt."""
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    listed = client.models.list()
    assert [m.id for m in listed.data] == ["policy", "reference"]
    assert all(m.object == "model" and m.owned_by == "ppo-logprobs" and m.created > 0 for m in listed.data)
    assert listed.data[0].model_extra["vocab_size"] == 503 and listed.data[1].model_extra["weights_version"] == 0
    assert client.models.retrieve("reference").id == "reference"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("nope")
    assert "'nope' is not served; served: policy, reference" in missing.value.message  # (OpenAI's error object)
    assert missing.value.type == "not_found_error" and str(missing.value.code) == "404"
    seq = [5, 17, 300, 42, 7]
    # (the reference: the policy's weights are another test's reload)
    completion = client.completions.create(model="reference", prompt=seq, echo=True, logprobs=5, max_tokens=0)
    logprobs = completion.choices[0].logprobs
    assert logprobs.token_logprobs[0] is None and len(logprobs.top_logprobs[1]) == 5
    lp, _ = alone(checkpoint[1], seq)
    np.testing.assert_allclose(np.array(logprobs.token_logprobs[1:], dtype=np.float32), lp, rtol=0, atol=1e-5)


def test_health_version_and_tokenize_in_vllms_shapes(server):
    assert httpx.get(server + "/health").status_code == 200 and httpx.get(server + "/health").content == b""
    assert httpx.get(server + "/version").json() == {"version": importlib.metadata.version("ppo-logprobs")}
    r = post(server, {"prompt": "t5 t7 t502"}, "/slow/tokenize")
    assert r.status_code == 200 and r.json() == {"count": 3, "max_model_len": 512, "tokens": [5, 7, 502]}
    r = post(server, {"tokens": [5, 7, 502]}, "/slow/detokenize")
    assert r.status_code == 200 and r.json() == {"prompt": "t5 t7 t502"}
    r = post(server, {"tokens": [5, 503]}, "/slow/detokenize")
    assert r.status_code == 422 and "tokens[1] = 503 is not a token id" in r.json()["detail"]
    r = post(server, {"prompt": "t5"}, "/tokenize")  # (main has no tokenizer)
    assert r.status_code == 400 and "--tokenizer" in r.json()["detail"]
    r = post(server, {"model": "nope", "prompt": "t5"}, "/slow/tokenize")
    assert r.status_code == 404 and "'nope' is not served" in r.json()["detail"]


def test_binary_results_are_the_json_results_bitwise(server):
    from ppo_logprobs.workers.wire import BINARY, decode_binary

    seqs = random_sequences(7, seed=501, hi=90)
    body = {"input_ids": seqs, "score_from": [1 + i % 3 for i in range(7)], "temperature": 0.7}
    as_json = post(server, body).json()
    r = post(server, body, headers={"Accept": BINARY})
    assert r.headers["content-type"] == BINARY
    header, log_probs, entropy, offsets = decode_binary(r.content)
    assert header["weights_version"] == as_json["weights_version"] and header["usage"] == as_json["usage"]
    for i, res in enumerate(as_json["results"]):
        span = slice(offsets[i], offsets[i + 1])
        for got, text in ((log_probs[span], res["log_probs"]), (entropy[span], res["entropy"])):
            assert np.array_equal(got.view(np.uint32), np.array(text, dtype=np.float32).view(np.uint32))


def test_readyz_says_only_ready_and_details_need_the_key(server):
    for prefix in ("", "/small"):  # without a key set, and with one
        anonymous = httpx.get(server + prefix + "/readyz")
        assert anonymous.status_code == 200 and anonymous.json() == {"ready": True}
    assert httpx.get(server + "/small/v1/health").status_code == 401
    keyed = httpx.get(server + "/small/v1/health", headers={"Authorization": "Bearer s3cret"}).json()
    assert keyed["ready"] and "pid" in keyed["models"]["policy"][0] and keyed["replica"]


def test_readiness_answers_at_once_while_every_worker_is_stopped(server):
    """Both models' workers SIGSTOPped: /readyz still answers, well inside the client's 6 s (it asks every worker at
    once with a 1 s deadline; it took 10 s a worker, one after another), and /v1/health names the silent ones."""
    pids = [w["pid"] for ws in httpx.get(server + "/v1/health").json()["models"].values() for w in ws]
    assert len(pids) == 2
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        ready = httpx.get(server + "/readyz", timeout=6)
        health = httpx.get(server + "/v1/health", timeout=30)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    assert (ready.status_code, ready.json()) == (503, {"ready": False})
    workers = [w for ws in health.json()["models"].values() for w in ws]
    assert health.status_code == 503 and all(w["error"] == "no answer within 5 s" for w in workers), workers
    assert httpx.get(server + "/readyz", timeout=30).status_code == 200


def test_the_services_sockets_listen_on_loopback(server):
    """Every listening socket of this Ray instance's processes is on loopback, Serve's replica gRPC servers too
    (Ray 2.60 binds them to all interfaces; service/loopback.py rebinds them: a Ray upgrade that defeats it fails
    here)."""
    import psutil

    me = psutil.Process()
    outside, replicas = [], 0
    for proc in [me, *me.children(recursive=True)]:
        try:
            sockets = proc.net_connections(kind="inet")
            name = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        listening = [s for s in sockets if s.status == psutil.CONN_LISTEN]
        replicas += "ServeReplica" in name and bool(listening)
        outside += [(name[:60], s.laddr) for s in listening
                    if not ipaddress.ip_address(s.laddr.ip.removeprefix("::ffff:")).is_loopback]
    assert replicas >= 4 and not outside, (replicas, outside)  # the ingress and keeper replicas of three apps


def test_the_service_comes_back_after_ten_worker_kills(server, tiny):
    seqs = random_sequences(3, seed=502)
    for kill in range(10):
        pid = httpx.get(server + "/big/v1/health").json()["models"]["policy"][0]["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:
            ready = httpx.get(server + "/big/v1/health", timeout=60)
            if ready.status_code == 200 and ready.json()["models"]["policy"][0]["pid"] != pid:
                break
            assert time.monotonic() < deadline, f"no recovery after kill {kill + 1}"
            time.sleep(0.2)
        r = post(server, {"input_ids": seqs}, "/big/logprobs")
        assert r.status_code == 200, (kill, r.text)
        for res, seq in zip(r.json()["results"], seqs, strict=True):
            check(res, tiny, seq)


def test_graceful_shutdown_finishes_requests_in_flight(server):
    """Deleting an application lets the requests it already holds finish (two requests of 64k tokens each, which
    the workers take a while to score: the deletion starts once its metrics show both out)."""
    import threading

    good = {"Authorization": "Bearer s3cret"}

    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=120, headers=good) as client:
            body = {"input_ids": random_sequences(256, seed=3, lo=250, hi=256), "return_entropy": False}
            tasks = [asyncio.create_task(client.post("/small/logprobs", json=body)) for _ in range(2)]
            deadline = time.monotonic() + 60
            while await asyncio.to_thread(metric, server, "/small", "ppo_logprobs_queue_depth") != 2:
                assert time.monotonic() < deadline, "the two requests were not seen queued"
            stopper = threading.Thread(target=serve.delete, args=("small",))
            stopper.start()
            done = await asyncio.gather(*tasks)
            stopper.join()
            return done

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200, 200]


def test_slow_senders_hold_up_no_scoring(server):
    """80 connections that send their headers, then a byte of their body now and then (more than the 66 requests a
    replica of this app held at once before): a normal request is answered before any of them, and each of them
    gets a 408 once its body deadline (15 s) has passed. (At 8 s the 408s came first once, the normal answer taking
    over 7 s on a 2-core machine with the suite's lanes and a compile beside it.)"""
    host, port = server.removeprefix("http://").split(":")
    order, detail = [], []

    async def slow_sender():
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /slow/logprobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{")
        answer = asyncio.create_task(reader.readline())
        for _ in range(120):  # a byte every 0.25 s, for up to 30 s
            await writer.drain()
            done, _ = await asyncio.wait([answer], timeout=0.25)
            if done:
                break
            writer.write(b" ")
        order.append(("slow", answer.result() if answer.done() else b"no answer"))
        writer.close()

    async def run():
        senders = [asyncio.create_task(slow_sender()) for _ in range(80)]
        await asyncio.sleep(1)  # (not synchronisation: the senders are connected and dribbling by then or not)
        async with httpx.AsyncClient(base_url=server, timeout=60) as client:
            r = await client.post("/slow/logprobs", json={"input_ids": [[1, 2, 3, 4]]})
        order.append(("normal", r.status_code))
        detail.append(r.text)
        await asyncio.gather(*senders)

    asyncio.run(run())
    assert order[0] == ("normal", 200), (order[:3], detail)
    assert all(kind == "slow" and b" 408 " in line for kind, line in order[1:]), order[1:4]

"""Clients and the command line against the real service over loopback."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest

from ppo_logprobs.client import AsyncLogProbClient, LogProbClient, LogProbError, connect_pool
from ppo_logprobs.client.log_prob_client import _chunks
from ppo_logprobs.service import Settings
from ppo_logprobs.workers import load_model

from ..helpers import alone, free_port, perturbed, random_sequences, save, serving

CLI = [sys.executable, "-m", "ppo_logprobs.client.cli"]


@pytest.fixture(scope="module")
def url():
    # (one ingress replica each, as a 2-core host gets by default: /metrics is the answering replica's)
    settings = Settings(models={"policy": "tiny"}, backend="torch", max_request_tokens=3000, pool_name="client-test",
                        ingress_replicas=1)
    guarded = Settings(models={"policy": "tiny"}, backend="torch", api_key="k3y", pool_name="client-test",
                       ingress_replicas=1)  # (the same pool)
    reloadable = Settings(models={"policy": "tiny"}, backend="torch", pool_name="client-reloadable")
    with serving(3, {"client": settings, "guarded": guarded, "reloadable": reloadable}) as url:
        yield url


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Other weights for the tiny model, saved, and the model loaded from them."""
    path = save(perturbed(7), tmp_path_factory.mktemp("client-ckpt"))
    return path, load_model(path, backend="torch")


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", backend="torch")


def assert_equal_to_model(results, seqs, model, starts=None):
    assert len(results) == len(seqs)
    for i, (r, seq) in enumerate(zip(results, seqs, strict=True)):
        lp, ent = alone(model, seq, starts[i] if starts else 1)
        assert r.log_probs.dtype == np.float32
        np.testing.assert_allclose(r.log_probs, lp, rtol=0, atol=1e-5, err_msg=f"sequence {i}")
        np.testing.assert_allclose(r.entropy, ent, rtol=0, atol=1e-5, err_msg=f"sequence {i}")


def requests_served(url) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("ppo_logprobs_requests_total"))


def test_sync_client_splits_large_batches_and_keeps_order(url, tiny):
    seqs = random_sequences(60, seed=30, lo=20, hi=200)  # ~6600 tokens: over the server's 3000 per request
    starts = [1 + i % 5 for i in range(60)]
    before = requests_served(url)
    with LogProbClient(url) as client:
        assert client.models()[0].max_request_tokens == 3000
        results = client.score(seqs, starts)
    assert_equal_to_model(results, seqs, tiny, starts)
    assert requests_served(url) - before >= len(_chunks(seqs, 3000)) >= 3


def test_async_client(url, tiny):
    seqs = random_sequences(30, seed=31, hi=120)

    async def run():
        async with AsyncLogProbClient(url, max_request_tokens=500) as client:
            return await client.score(seqs)

    assert_equal_to_model(asyncio.run(run()), seqs, tiny)


def test_top_k_and_candidates_split_across_requests_in_both_formats(url, tiny):
    """A batch over the server's per-request limit, asking for top_k and per-sequence candidates: numpy arrays
    [entries, k] and [entries, len(list)] in order, the same from BINARY and JSON, as one worker gives them; the
    async client alike; and the command line's --top-k."""
    from ppo_logprobs.workers import LogProbWorker

    seqs = random_sequences(24, seed=33, lo=60, hi=200)  # over 3000 tokens: several requests
    ids = [list(range(i % 4 + 1)) for i in range(24)]
    want = LogProbWorker(tiny).score(seqs, 3, top_k=4, token_ids=ids)
    with LogProbClient(url) as binary, LogProbClient(url, binary=False) as text:
        got, as_text = binary.score(seqs, 3, top_k=4, token_ids=ids), text.score(seqs, 3, top_k=4, token_ids=ids)
    for i, (g, t, w) in enumerate(zip(got, as_text, want, strict=True)):
        assert g.top_ids.dtype == np.int32 and g.top_ids.shape == (len(seqs[i]) - 3, 4)
        assert g.candidate_log_probs.shape == (len(seqs[i]) - 3, len(ids[i]))
        for name in ("top_log_probs", "top_ids", "tail_log_prob", "candidate_log_probs"):
            assert np.array_equal(getattr(g, name), getattr(t, name)), (name, i)
            np.testing.assert_allclose(getattr(g, name), getattr(w, name), rtol=0, atol=1e-5, err_msg=f"{name} {i}")

    async def run():
        async with AsyncLogProbClient(url, max_request_tokens=700) as client:
            return await client.score(seqs[:5], 3, top_k=2, token_ids=[9, 8])

    for g, w in zip(asyncio.run(run()), LogProbWorker(tiny).score(seqs[:5], 3, top_k=2, token_ids=[9, 8]),
                    strict=True):
        assert np.array_equal(g.top_ids, w.top_ids) and g.candidate_log_probs.shape[1] == 2


def test_score_command_writes_the_top_k(url, tiny, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    seqs = random_sequences(3, seed=34, lo=5, hi=30)
    src.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in seqs))
    done = subprocess.run(CLI + ["score", str(src), "-o", str(out), "--url", url, "--top-k", "3"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    from ppo_logprobs.workers import LogProbWorker

    for line, w in zip(out.read_text().splitlines(), LogProbWorker(tiny).score(seqs, top_k=3), strict=True):
        row = json.loads(line)
        assert np.array_equal(np.array(row["top_ids"]), w.top_ids)
        np.testing.assert_allclose(np.array(row["top_log_probs"], np.float32), w.top_log_probs, rtol=0, atol=1e-5)


def test_api_key_and_status_endpoints(url, tiny):
    seqs = random_sequences(2, seed=35)
    with LogProbClient(url + "/guarded") as anonymous:
        with pytest.raises(LogProbError, match="HTTP 401: missing or wrong API key"):
            anonymous.score(seqs)
    with LogProbClient(url + "/guarded", api_key="k3y") as client:
        assert client.alive() and client.ready()
        assert_equal_to_model(client.score(seqs), seqs, tiny)
        assert 'status="200"' in client.metrics()


def test_a_misspelt_option_is_named_before_anything_is_sent():
    """(nothing listens at port 9: the error comes before any connection is tried)"""
    with pytest.raises(TypeError, match="'temprature'.*temperature"):
        LogProbClient("http://127.0.0.1:9").score([[1, 2, 3]], temprature=0.7)
    with pytest.raises(TypeError, match="'temprature'.*temperature"):
        asyncio.run(AsyncLogProbClient("http://127.0.0.1:9").score([[1, 2, 3]], temprature=0.7))


def test_errors_carry_the_server_message(url):
    with LogProbClient(url) as client:
        with pytest.raises(LogProbError, match=r"HTTP 422: input_ids\[0\]\[1\] = 9999 is outside the vocabulary"):
            client.score([[1, 9999]])
        with pytest.raises(LogProbError, match="HTTP 404: model 'critic' is not served"):
            client.score([[1, 2]], model="critic")


class _Scripted(BaseHTTPRequestHandler):
    """An HTTP/1.1 proxy in front of the real service: the first POSTs get the answers in `script` (a status code
    as the gateway gives it, "drop": the connection is closed without an answer, "lost": Serve's proxy's plain
    500 for a replica that died, or "unrouted": the plain 404 of a proxy that knows no route yet), later ones are
    forwarded."""

    protocol_version = "HTTP/1.1"
    target: httpx.Client
    script: list = []
    posts: list = []
    after_first_forward = None  # called once the first forwarded POST has its answer

    def do_GET(self):
        self._answer(self.target.get(self.path))

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).posts.append(time.monotonic())
        if len(self.posts) <= len(self.script):
            step = self.script[len(self.posts) - 1]
            if step == "drop":
                self.close_connection = True
                return
            if step in ("lost", "unrouted"):
                self._answer(httpx.Response(500, text="Internal Server Error") if step == "lost" else
                             httpx.Response(404, text="Path '/logprobs' not found. Ping http://.../-/routes"))
                return
            self._answer(httpx.Response(step, json={"detail": f"scripted {step}"},
                                        headers={"Retry-After": "1", "X-Replica": "scripted"}))
            return
        headers = {"Content-Type": "application/json", "Accept": self.headers.get("Accept", "application/json")}
        response = self.target.post(self.path, content=body, headers=headers)
        if len(self.posts) == len(self.script) + 1 and type(self).after_first_forward is not None:
            type(self).after_first_forward()
        self._answer(response)

    def _answer(self, response):
        self.send_response(response.status_code)
        for name in ("Content-Type", "Retry-After", "X-Replica"):
            if name in response.headers:
                self.send_header(name, response.headers[name])
        self.send_header("Content-Length", str(len(response.content)))
        self.end_headers()
        self.wfile.write(response.content)

    def log_message(self, *args):
        pass


@pytest.fixture
def proxy(url):
    """Yields a function that starts the scripted proxy with a script and returns its URL."""
    servers = []

    def start(script, after_first_forward=None):
        _Scripted.target = httpx.Client(base_url=url, timeout=120)
        _Scripted.script, _Scripted.posts = script, []
        _Scripted.after_first_forward = after_first_forward
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
    _Scripted.target.close()


def test_retries_429_after_retry_after(proxy, tiny):
    seqs = random_sequences(4, seed=32)
    with LogProbClient(proxy([429])) as client:
        results = client.score(seqs)
        assert client.retries == 1
    assert_equal_to_model(results, seqs, tiny)
    posts = _Scripted.posts
    assert len(posts) == 2 and posts[1] - posts[0] >= 0.9  # waited Retry-After


def test_retries_a_dropped_connection(proxy, tiny):
    seqs = random_sequences(4, seed=36)
    with LogProbClient(proxy(["drop", "drop"]), backoff=0.01) as client:
        results = client.score(seqs)
        assert client.retries == 2
    assert_equal_to_model(results, seqs, tiny)
    assert len(_Scripted.posts) == 3

    async def run():
        async with AsyncLogProbClient(proxy(["drop", 503]), backoff=0.01) as client:
            return await client.score(seqs), client.retries

    results, retries = asyncio.run(run())
    assert retries == 2 and len(_Scripted.posts) == 3
    assert_equal_to_model(results, seqs, tiny)


def test_parts_answered_with_older_weights_are_asked_again(url, proxy, checkpoint):
    path, model = checkpoint
    seqs = random_sequences(9, seed=37, lo=40, hi=60)  # three parts of at most 150 tokens

    def reload():  # lands between the first part and the second
        r = httpx.post(url + "/reloadable/v1/models/policy/reload", json={"path": path}, timeout=120)
        assert r.status_code == 200, r.text

    with LogProbClient(proxy([], after_first_forward=reload) + "/reloadable", max_request_tokens=150) as client:
        results = client.score(seqs)
    assert {r.weights_version for r in results} == {1}
    assert_equal_to_model(results, seqs, model)
    assert len(_Scripted.posts) == len(_chunks(seqs, 150)) + 1  # the first part, asked again


@pytest.mark.parametrize("script, status", [(["drop"], 0), ([503], 503), ([429], 429)])
def test_reload_is_never_retried(proxy, script, status):
    with LogProbClient(proxy(script), backoff=0.01) as client:
        with pytest.raises(LogProbError) as raised:
            client.reload("policy", "/no/such/checkpoint")
        assert raised.value.status == status and client.retries == 0
    assert len(_Scripted.posts) == 1


@pytest.mark.parametrize("status", [400, 404, 422, 500])
def test_errors_that_are_not_transient_are_not_retried(proxy, status):
    with LogProbClient(proxy([status]), backoff=0.01) as client:
        with pytest.raises(LogProbError, match=f"HTTP {status}: scripted {status}"):
            client.score([[1, 2, 3]])
        assert client.retries == 0
    assert len(_Scripted.posts) == 1


def test_a_500_or_404_from_serves_proxy_is_retried(proxy, tiny):
    """Serve's proxy answers a plain 500 (no X-Replica) for a request whose ingress replica died, and a plain 404
    while it knows no route (HAProxy restarted): scoring is asked again; the gateway's own 500 and 404 (with
    X-Replica) are not (above)."""
    seqs = random_sequences(2, seed=37)
    with LogProbClient(proxy(["lost", "unrouted"]), backoff=0.01) as client:
        assert_equal_to_model(client.score(seqs), seqs, tiny)
        assert client.retries == 2


def test_nothing_listening_fails_at_once_in_one_line(tmp_path):
    """No service at the URL: the clients and both commands stop at the first refused connection (they retried 8
    times over two and a half minutes, in silence, before), naming the URL."""
    dead = f"http://127.0.0.1:{free_port()}"
    with LogProbClient(dead) as client:
        with pytest.raises(LogProbError, match=f"nothing listens at {dead} .*: is the service running"):
            client.score([[1, 2, 3]])
        assert client.retries == 0 and not client.ready() and not client.alive()

    async def run():
        async with AsyncLogProbClient(dead) as client:
            with pytest.raises(LogProbError, match=f"nothing listens at {dead}"):
                await client.score([[1, 2, 3]])
            return client.retries

    assert asyncio.run(run()) == 0
    (tmp_path / "in.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    for command in (["score", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")], ["bench"]):
        out = subprocess.run([*CLI, *command, "--url", dead], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith(f"{dead}: nothing listens at"), \
            out.stderr
        assert "Traceback" not in out.stderr


def test_a_url_no_retry_can_reach_fails_at_once_in_one_line(tmp_path):
    """A URL that is not http(s) or not a URL at all: no request is retried (UnsupportedProtocol was, 8 times over
    two minutes), and the commands end in one line."""
    for url, error in (("notaurl", "UnsupportedProtocol: Request URL is missing an 'http://' or 'https://' protocol"),
                       ("localhost:8000", "UnsupportedProtocol: Request URL has an unsupported protocol 'localhost://'")):
        with LogProbClient(url) as client:
            with pytest.raises(LogProbError, match=f"no request can be sent to {url} \\({error}"):
                client.score([[1, 2, 3]])
            assert client.retries == 0

        async def run(url=url):
            async with AsyncLogProbClient(url) as client:
                with pytest.raises(LogProbError, match="no request can be sent"):
                    await client.models()
                return client.retries

        assert asyncio.run(run()) == 0
    with pytest.raises(ValueError, match=r"'http://host:abc' is not a URL \(Invalid port: 'abc'\)"):
        LogProbClient("http://host:abc")
    for url, line in (("notaurl", "notaurl: no request can be sent to notaurl (UnsupportedProtocol: Request URL is "
                                  "missing an 'http://' or 'https://' protocol.)"),
                      ("http://host:abc", "'http://host:abc' is not a URL (Invalid port: 'abc'): give the service's, "
                                          "e.g. http://127.0.0.1:8000")):
        out = subprocess.run([*CLI, "bench", "--url", url], capture_output=True, text=True, timeout=60)
        assert (out.returncode, out.stderr) == (2, line + "\n")


@pytest.mark.parametrize("command, line", [
    (["score", "{tmp}/none.jsonl", "-o", "{tmp}/out.jsonl"], "{tmp}/none.jsonl: cannot read it (No such file or "
     "directory)"),
    (["score", "{tmp}/in.jsonl", "-o", "{tmp}/none/out.jsonl"], "--output {tmp}/none/out.jsonl: no directory "
     "'{tmp}/none'"),
    (["score", "{tmp}/in.jsonl", "-o", "{tmp}/out.jsonl", "--api-key-file", "{tmp}/none"], "--api-key-file "
     "{tmp}/none: cannot read it (No such file or directory)"),
    (["bench", "--api-key-file", "{tmp}"], "--api-key-file {tmp}: cannot read it (Is a directory)"),
    (["bench", "--api-key-file", "{tmp}/two-lines"], "the API key holds a line break or a character that is not "
     "printable ASCII: is its file more than the key?"),
    (["bench", "--min-len", "65", "--max-len", "64"], "--min-len 65 is above --max-len 64"),
    (["bench", "--clients", "0"], "--clients 0: give 1 or more"),
    (["score", "{tmp}/in.jsonl", "-o", "{tmp}/out.jsonl", "--batch-sequences", "0"], "--batch-sequences 0: give 1 or "
     "more"),
])
def test_a_mistake_on_the_command_line_is_one_line_and_exit_code_2(tmp_path, command, line):
    """Found before any request (nothing need listen at the URL): the one line names the flag or file and the value
    (they were tracebacks, a bench that never ended with --clients 0, or an output file that failed after scoring)."""
    (tmp_path / "in.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    (tmp_path / "two-lines").write_text("k3y\nk3y\n")
    command = [part.format(tmp=tmp_path) for part in command]
    out = subprocess.run([*CLI, *command, "--url", f"http://127.0.0.1:{free_port()}"], capture_output=True,
                         text=True, timeout=60)
    assert (out.returncode, out.stderr) == (2, line.format(tmp=tmp_path) + "\n")


def test_a_service_that_answered_and_then_refuses_is_retried_until_it_is_back(url, tiny, caplog):
    """Refused after it answered once (a restart: HAProxy's took 24 s): retried, each retry said as a warning,
    until the service is back on its port."""
    port = free_port()
    _Scripted.target, _Scripted.script, _Scripted.posts = httpx.Client(base_url=url, timeout=120), [], []

    class OneAnswerAConnection(_Scripted):  # (a kept-alive connection would outlive the server's shutdown)
        protocol_version = "HTTP/1.0"

    def serve() -> ThreadingHTTPServer:
        server = ThreadingHTTPServer(("127.0.0.1", port), OneAnswerAConnection)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    server = serve()
    client = LogProbClient(f"http://127.0.0.1:{port}", backoff=0.05)
    client.models()  # (reached once)
    server.shutdown()
    server.server_close()

    def back_after_a_retry() -> None:
        deadline = time.monotonic() + 60
        while client.retries == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        servers.append(serve())

    servers: list = []
    restarter = threading.Thread(target=back_after_a_retry)
    restarter.start()
    seqs = random_sequences(2, seed=38)
    try:
        with caplog.at_level("WARNING", logger="ppo_logprobs.client"):
            assert_equal_to_model(client.score(seqs), seqs, tiny)
    finally:
        restarter.join()
        client.close()
        for s in servers:
            s.shutdown()
            s.server_close()
        _Scripted.target.close()
    assert client.retries >= 1 and any("ConnectError" in r.message and "retry 1 of 8" in r.message
                                       for r in caplog.records)


def test_connect_pool_gives_the_services_workers(url, tiny):
    pool = connect_pool("policy", service="client-test")
    seqs = random_sequences(5, seed=33)
    assert_equal_to_model(pool.compute_log_probs(seqs), seqs, tiny)


def test_score_command_resumes_after_being_killed(url, tiny, tmp_path):
    seqs = random_sequences(300, seed=34, lo=5, hi=120)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"input_ids": s, "score_from": 1 + i % 3}) + "\n" for i, s in enumerate(seqs)))
    cmd = CLI + ["score", str(src), "-o", str(out), "--url", url, "--batch-sequences", "5"]
    first = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not out.exists() or out.read_text().count("\n") < 40:
        assert first.poll() is None and time.monotonic() < deadline, "the first run ended too early or hung"
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    kept = out.read_text().count("\n")
    assert 40 <= kept < 300
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    said = done.stderr.splitlines()  # (not a terminal: the counter's first and last lines, then what it wrote)
    assert said[0].startswith(f"{min(kept + 5, 300)}/300 sequences"), said
    assert said[-2].startswith("300/300 sequences") and said[-1].endswith(f"{kept} kept from before)"), said
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["index"] for line in lines] == list(range(300))
    for i, (line, seq) in enumerate(zip(lines, seqs, strict=True)):
        lp, ent = alone(tiny, seq, 1 + i % 3)
        np.testing.assert_allclose(np.array(line["log_probs"], dtype=np.float32), lp, rtol=0, atol=1e-5)
        np.testing.assert_allclose(np.array(line["entropy"], dtype=np.float32), ent, rtol=0, atol=1e-5)


@pytest.mark.parametrize("line, message", [
    ('{"input_ids": [1, true, 3]}', "input_ids[1] = True is not a token id (an integer)"),
    ('{"input_ids": [1, 2, 3], "score_from": 1.9}', "score_from = 1.9 must be an integer"),
    ('{"input_ids": [1, 2, 3], "score_from": "x"}', "score_from = 'x' must be an integer"),
    ('{"input_ids": [1, 2, 3], "score_from": 4}', "score_from = 4 must be in [1, 3] (len(input_ids))"),
    ('{"input_ids": [1, 2, 9999]}', "input_ids[2] = 9999 is outside the vocabulary [0, 503)"),
    ('{"input_ids": "1 2 3"}', "input_ids = '1 2 3' is not a list of token ids"),
    ('"x"', "expected a JSON object with 'input_ids'"),
])
def test_score_command_names_the_line_of_bad_input_in_one_line(url, tmp_path, line, message):
    """Checked against the model before anything is sent: the file's line, the field and the value, no traceback."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"input_ids": [1, 2, 3]}\n\n' + line + "\n")
    done = subprocess.run(CLI + ["score", str(src), "-o", str(out), "--url", url], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == f"{src}:3: {message}", done.stderr
    assert not out.exists() or out.read_text() == ""


def test_score_command_takes_the_key_from_the_environment_or_a_file_never_a_flag(url, tmp_path, tiny):
    src, key = tmp_path / "in.jsonl", tmp_path / "key"
    src.write_text('{"input_ids": [1, 2, 3]}\n')
    key.write_text("k3y\n")
    base = CLI + ["score", str(src), "--url", url + "/guarded"]
    by_env = subprocess.run(base + ["-o", str(tmp_path / "a.jsonl")], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PPO_LOGPROBS_API_KEY": "k3y"})
    by_file = subprocess.run(base + ["-o", str(tmp_path / "b.jsonl"), "--api-key-file", str(key)],
                             capture_output=True, text=True, timeout=120)
    assert by_env.returncode == 0 and by_file.returncode == 0, (by_env.stderr, by_file.stderr)
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text() != ""
    refused = subprocess.run(base + ["-o", str(tmp_path / "c.jsonl"), "--api-key", "k3y"], capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2 and "unrecognized arguments: --api-key" in refused.stderr
    without = subprocess.run(base + ["-o", str(tmp_path / "d.jsonl")], capture_output=True, text=True, timeout=120,
                             env={k: v for k, v in os.environ.items() if k != "PPO_LOGPROBS_API_KEY"})
    assert without.returncode == 2 and len(without.stderr.strip().splitlines()) == 1, without.stderr


def test_bench_command(url):
    done = subprocess.run(CLI + ["bench", "--url", url, "--requests", "12", "--clients", "4", "--max-len", "100"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["requests"] == 12 and report["tokens"] > 0 and report["tokens_per_s"] > 0
    # not a terminal: the first and the last count on lines of their own, not every count redrawn by "\r" (which
    # text mode reads as a line's end: then 12 lines and an empty first one)
    progress = done.stderr.splitlines()
    assert progress[0] == "1/12 requests" and progress[-1] == "12/12 requests" and len(progress) < 12, progress


def test_bench_command_names_the_served_models_when_asked_for_another(url):
    """(It benched the first served model instead.)"""
    done = subprocess.run(CLI + ["bench", "--url", url, "--model", "reference"], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stderr) == (2, f"{url} serves no model 'reference' (it serves ['policy'])\n")


@pytest.mark.parametrize("command, expected", [
    ([], "serve,score,bench"), (["score"], "--batch-sequences"),
    (["score"], "the logits are divided by it (default: 1.0)"), (["bench"], "requests in flight at once (default: 16)"),
    (["serve"], "--model"),
])
def test_help_of_each_command(command, expected):
    """Every option of every command says what it is, and its default once (serve's come from Settings)."""
    done = subprocess.run(CLI + command + ["--help"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0 and expected in done.stdout
    options = re.split(r"\n(?=  -)", done.stdout.split("\noptions:\n", 1)[1].strip("\n"))
    assert len(options) > 1 or command == []
    for option in options:  # its flags, then its help on that line or the next ones
        flags, text = (re.split(r"\s{2,}", option.strip(), maxsplit=1) + [""])[:2]
        assert text and not text.startswith("(default"), f"{flags}: no help"
        assert text.count("default:") <= 1, f"{flags}: the default said twice: {text}"


def test_a_request_is_cut_between_groups_of_a_shared_prompt_not_inside_them():
    prompts = [[p] * 130 for p in (1, 2, 3)]
    seqs = [prompt + [9] * 10 for prompt in prompts for _ in range(3)]  # three groups of three, 140 tokens each
    assert _chunks(seqs, 700) == [range(0, 3), range(3, 6), range(6, 9)]  # not 5 sequences, then 4
    assert _chunks(seqs, 300) == [range(0, 2), range(2, 3), range(3, 5), range(5, 6), range(6, 8), range(8, 9)]
    short = [[1, 2, 3]] * 9  # shorter than a shared prefix: cut where the limit falls
    assert _chunks(short, 12) == [range(0, 4), range(4, 8), range(8, 9)]


class _Fake:
    """A gateway in memory (httpx.MockTransport) for both clients: log-prob = the scored token, entropy = its place
    in its sequence; `versions` gives the weights version of each /logprobs answer in turn, `script` the status of
    the first ones (503 and 429 with Retry-After 0)."""

    def __init__(self, versions=(), script=()):
        self.versions, self.script = iter(versions), list(script)
        self.posts: list[list[list[int]]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [dict(id="policy", name="policy", vocab_size=100, max_length=50,
                                                           max_request_tokens=10, weights_version=0)]})
        if request.url.path in ("/readyz", "/healthz"):
            raise httpx.ConnectError("refused")
        if request.url.path == "/metrics":
            return httpx.Response(200, text="ppo_logprobs_requests_total 1\n")
        body = json.loads(request.content)
        self.posts.append(body["input_ids"])
        if self.script:
            return httpx.Response(self.script.pop(0), json={"detail": "scripted"},
                                  headers={"Retry-After": "0", "X-Replica": "fake"})
        results = [{"log_probs": seq[start:], "entropy": list(range(start, len(seq)))}
                   for seq, start in zip(body["input_ids"], body["score_from"], strict=True)]
        return httpx.Response(200, json={"weights_version": next(self.versions, 0), "results": results},
                              headers={"X-Replica": "fake"})


def on_fake(kind, fake: _Fake, method: str, *args, **kwargs):
    """client.method(*args, **kwargs) of a `kind` ("sync" or "async") client of `fake`, and the client."""
    if kind == "sync":
        with LogProbClient("http://fake", binary=False) as client:
            client._http = httpx.Client(base_url=client.base_url, transport=httpx.MockTransport(fake.handle))
            return getattr(client, method)(*args, **kwargs), client

    async def run():
        async with AsyncLogProbClient("http://fake", binary=False) as client:
            client._http = httpx.AsyncClient(base_url=client.base_url, transport=httpx.MockTransport(fake.handle))
            return await getattr(client, method)(*args, **kwargs), client

    return asyncio.run(run())


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_both_clients_split_ask_late_parts_again_and_keep_order_through_one_core(kind):
    seqs = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18]]  # parts of at most 10 tokens
    fake = _Fake(versions=[1, 2, 1, 2, 2])  # the first part and the third answered with older weights
    results, client = on_fake(kind, fake, "score", seqs, [1, 2, 1, 1, 2])
    assert [r.log_probs.tolist() for r in results] == [[2, 3, 4], [7], [9, 10, 11, 12], [14], [17, 18]]
    assert [r.entropy.tolist() for r in results] == [[1, 2, 3], [2], [1, 2, 3, 4], [1], [2, 3]]
    assert {r.weights_version for r in results} == {2}
    parts = [seqs[0:2], seqs[2:4], seqs[4:5]]
    assert fake.posts == parts + [parts[0], parts[2]] and client.retries == 0


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_both_clients_retry_alike_and_give_up_alike(kind, caplog):
    fake = _Fake(script=[503, 429])
    results, client = on_fake(kind, fake, "score", [[1, 2, 3]])
    assert results[0].log_probs.tolist() == [2, 3] and client.retries == 2 and len(fake.posts) == 3
    assert [r.getMessage() for r in caplog.records] == ["http://fake: HTTP 503; retry 1 of 8 in 0.0 s",
                                                        "http://fake: HTTP 429; retry 2 of 8 in 0.0 s"]
    changing = _Fake(versions=range(100))  # an update under every attempt
    with pytest.raises(LogProbError, match=r"^HTTP 503: the weights changed while the parts of this call were scored "
                                           r"\(versions \[3, 4\]\), 3 times; retry$"):
        on_fake(kind, changing, "score", [[1, 2, 3, 4, 5, 6]] * 2)  # two parts
    assert len(changing.posts) == 2 + 3  # each part once, then one a time asked again three times
    assert on_fake(kind, _Fake(), "ready")[0] is False and on_fake(kind, _Fake(), "alive")[0] is False
    assert on_fake(kind, _Fake(), "metrics")[0] == "ppo_logprobs_requests_total 1\n"
    with pytest.raises(ValueError, match="score_from and temperature need one value or 2"):
        on_fake(kind, _Fake(), "score", [[1, 2], [3, 4]], [1, 1, 1])

"""`python -m ppo_logprobs.service` (what `make serve` and `ppo-logprobs serve` run) in a process of its own, with
two ingress replicas behind Serve's HAProxy ingress (the default where it is installed): answers from both
replicas, bad input, body limits, media types and auth as test_gateway checks them behind Serve's Python proxy,
and no listener beyond loopback, HAProxy's included."""

import ipaddress
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from ppo_logprobs.workers.wire import BINARY

from ..helpers import free_port, random_sequences
from .test_gateway import MALFORMED

KEY = {"Authorization": "Bearer s3cret"}


@pytest.fixture(scope="module", params=["haproxy"])
def served(request, tmp_path_factory):
    port = free_port()
    env = {**os.environ, "PPO_LOGPROBS_API_KEY": "s3cret", "RAY_ADDRESS": "local", "PYTHONUNBUFFERED": "1",
           # the stop at the end need not hold each replica open 30 s for load balancers to deregister it
           "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
           # HAProxy's metrics and statistics frontends on ports of their own: Ray's fixed defaults (9101, 8404)
           # may still be held by an HAProxy of an earlier run that has not yet exited, and HAProxy then exits
           "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()), "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port())}
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ppo_logprobs.service", "--ingress", request.param, "--ingress-replicas", "2",
             "--port", str(port), "--backend", "torch", "--max-request-tokens", "4000", "--max-tokens-per-batch",
             "512", "--pool-name", f"cmd-{request.param}"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        yield url, proc, request.param
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def post(url, body, **kw):
    return httpx.post(url + "/logprobs", json=body, timeout=120, headers={**KEY, **kw.pop("headers", {})}, **kw)


def test_a_trainer_process_connects_to_the_pool_as_the_readme_writes_it(served):
    """`connect_pool(...)` from a plain Python process on the same machine, with none of the service's Ray settings
    in its environment (before, it dialled the machine's address while Ray listened on loopback, and retried)."""
    script = ("from ppo_logprobs.client import connect_pool\n"
              "pool = connect_pool('policy', service='cmd-haproxy')\n"
              "print(len(pool.compute_log_probs([[1, 2, 3, 4]])[0].log_probs))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split()[-1:] == ["3"], out.stderr[-3000:]


def test_both_replicas_answer(served):
    url, _, _ = served
    seqs = random_sequences(3, seed=900)
    replicas, results = set(), set()
    for _ in range(40):
        r = post(url, {"input_ids": seqs})
        assert r.status_code == 200, r.text
        replicas.add(r.headers["X-Replica"])
        results.add(tuple(r.json()["results"][0]["log_probs"]))
    assert len(replicas) == 2 and len(results) == 1


@pytest.mark.parametrize("body, message, status", MALFORMED)
def test_bad_input_is_named(served, body, message, status):
    url, _, _ = served
    if isinstance(body, str):
        r = httpx.post(url + "/logprobs", content=body, headers={**KEY, "Content-Type": "application/json"})
    else:
        r = post(url, body)
    assert r.status_code == status and message in r.json()["detail"], r.text


def test_auth_media_types_and_body_limits(served):
    url, _, _ = served
    body = {"input_ids": [[1, 2, 3, 4]]}
    assert httpx.post(url + "/logprobs", json=body).status_code == 401
    assert httpx.get(url + "/v1/health").status_code == 401 and httpx.get(url + "/readyz").json() == {"ready": True}
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        r = httpx.post(url + "/logprobs", content=b'{"input_ids": [[1, 2, 3]]}', headers={**KEY, "Content-Type": kind})
        assert r.status_code == 415 and "application/json" in r.json()["detail"], (kind, r.text)
    r = post(url, body, headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    for accept, binary in ((BINARY, True), (f"{BINARY}-evil", False), (f"{BINARY};q=0", False),
                           (f"application/json, {BINARY};q=0.5", False), (f"{BINARY}, application/json", True)):
        r = post(url, body, headers={"Accept": accept})
        assert r.status_code == 200 and (r.headers["content-type"] == BINARY) == binary, accept
    for value in (2**63, 2**64 - 1, 2**64 + 5):
        r = post(url, {**body, "score_from": value})
        assert r.status_code == 422 and f"score_from = {value}" in r.json()["detail"], r.text
    limit = 16 * 4000 + (1 << 20)  # the default body limit for max_request_tokens 4000
    near = b'{"input_ids": [[1, 2, 3, 4]]' + b" " * (limit - 100) + b"}"
    r = httpx.post(url + "/logprobs", content=near, headers={**KEY, "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text
    over = b" " * (limit + 1)
    r = httpx.post(url + "/logprobs", content=over, headers={**KEY, "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and f"the limit is {limit}" in r.json()["detail"]

    def chunks():  # no Content-Length: counted while it arrives
        for _ in range(limit // 65536 + 2):
            yield b" " * 65536

    r = httpx.post(url + "/logprobs", content=chunks(), headers={**KEY, "Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and f"over {limit} bytes" in r.json()["detail"]


def test_every_listener_is_on_loopback(served):
    url, proc, mode = served
    root = psutil.Process(proc.pid)
    outside, listeners = [], []
    for p in [root, *root.children(recursive=True)]:
        try:
            sockets = p.net_connections(kind="inet")
            name = " ".join(p.cmdline())[:80]
        except psutil.Error:
            continue
        listening = [s for s in sockets if s.status == psutil.CONN_LISTEN]
        listeners += [name] if listening else []
        outside += [(name, s.laddr) for s in listening
                    if not ipaddress.ip_address(s.laddr.ip.removeprefix("::ffff:")).is_loopback]
    assert not outside, outside
    assert sum("ServeReplica" in n for n in listeners) >= 3  # two ingress replicas and the keeper
    assert mode != "haproxy" or any("haproxy" in n.split()[0] for n in listeners), listeners

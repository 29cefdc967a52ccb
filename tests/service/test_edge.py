"""service/edge.py. The checks before any route: the key (every route but the open ones; the Bearer scheme in any
case) and, for a key-less loopback service, the Host header. Serve's HAProxy configuration with our bounds,
rendered by Serve's own code and run by the real HAProxy binary on loopback (no Ray cluster): a deadline for
headers (408, closed), a limit of connections per client address, 503 with Retry-After while no route is known,
and no UDP socket. The worker setup hook applies them, and a Ray that changed the template is refused. Every patch
of Ray's modules is undone after each test."""

import asyncio
import json
import socket

import psutil
import pytest
from ray.serve._private import haproxy, replica
from ray.serve.config import HTTPOptions

from ppo_logprobs.service import Settings
from ppo_logprobs.service.edge import (
    ENV,
    OPEN_ROUTES,
    Edge,
    edge_template,
    host_allowed,
    key_matches,
    refusal,
    setup_worker,
)

from ..helpers import free_port

EDGE = Edge(header_timeout_s=2, max_connections=64, max_connections_per_client=8, loopback=True)


@pytest.fixture(autouse=True)
def restored(monkeypatch):
    monkeypatch.setattr(replica, "add_port_to_grpc_server", replica.add_port_to_grpc_server)
    monkeypatch.setattr(haproxy, "HAPROXY_CONFIG_TEMPLATE", haproxy.HAPROXY_CONFIG_TEMPLATE)


@pytest.fixture
def started(tmp_path, monkeypatch):
    """Serve's HAProxy (its manager's own code: config rendered from the template the hook patched, process started)
    with the routes it has before any application is known, on a free loopback port; yields (port, process)."""
    for name, value in EDGE.environment().items():
        monkeypatch.setenv(name, value)
    setup_worker()  # (what every Ray process of `ppo-logprobs serve` runs first)
    port = free_port()
    cfg = haproxy.HAProxyConfig(
        http_options=HTTPOptions(host="127.0.0.1", port=port), socket_path=str(tmp_path / "admin.sock"),
        server_state_base=str(tmp_path), server_state_file=str(tmp_path / "state"), metrics_enabled=False,
        metrics_port=free_port(), stats_port=free_port(), maxconn=EDGE.max_connections,
    )
    api = haproxy.HAProxyApi(cfg=cfg, config_file_path=str(tmp_path / "haproxy.cfg"))
    loop = asyncio.new_event_loop()
    loop.run_until_complete(api.start())
    try:
        yield port, psutil.Process(api._proc.pid)
    finally:
        loop.run_until_complete(api.stop())
        loop.close()


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))
    return s


def answer(s: socket.socket) -> bytes:
    """What the server sends before it closes (b"" for a reset)."""
    out = b""
    try:
        while chunk := s.recv(4096):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def test_a_path_before_any_route_is_503_with_retry_after(started):
    port, _ = started
    s = connect(port)
    s.sendall(b"POST /logprobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
    head, _, body = answer(s).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower(), head
    assert json.loads(body) == {"detail": "the service is starting: retry", "error": {
        "message": "the service is starting: retry", "type": "service_unavailable_error", "code": 503}}


@pytest.mark.parametrize("sent", [b"", b"POST /logprobs HTTP/1.1\r\nHost: 127.0.0.1\r\n"])
def test_headers_that_do_not_arrive_whole_are_answered_408_and_closed(started, sent):
    port, _ = started
    s = connect(port)
    s.sendall(sent)
    got = answer(s)  # (the socket's 30 s timeout would raise: the deadline is 2 s)
    assert got.startswith(b"HTTP/1.1 408"), got


def test_one_client_address_holds_at_most_its_share_and_others_are_served(started):
    port, _ = started
    answers = []
    flood = []
    for _ in range(3 * EDGE.max_connections_per_client):
        try:
            s = connect(port, "127.0.0.2")
            s.sendall(b"POST /logprobs HTTP/1.1\r\n")
            flood.append(s)
        except ConnectionResetError:  # (refused: HAProxy closed it at once)
            answers.append(b"")
    s = connect(port)  # another address: served while the flood holds its share
    s.sendall(b"GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    assert answer(s).startswith(b"HTTP/1.1 503")
    answers += [answer(s) for s in flood]
    assert sum(a.startswith(b"HTTP/1.1 408") for a in answers) == EDGE.max_connections_per_client, answers
    assert all(a == b"" or a.startswith(b"HTTP/1.1 408") for a in answers)


def test_haproxy_holds_no_udp_socket_and_listens_on_loopback_only(started):
    _, proc = started
    sockets = proc.net_connections(kind="inet")
    assert not [s for s in sockets if s.type == socket.SOCK_DGRAM], sockets
    assert all(s.laddr.ip == "127.0.0.1" for s in sockets if s.status == psutil.CONN_LISTEN), sockets


def test_a_template_a_ray_upgrade_changed_is_refused():
    changed = haproxy.HAPROXY_CONFIG_TEMPLATE.replace("backend default_backend\n    http-request return status 404",
                                                      "backend default_backend\n    http-request return status 410")
    with pytest.raises(RuntimeError, match="Serve's HAProxy template has no single 'http-request return status 404"):
        edge_template(changed, EDGE)


@pytest.mark.parametrize("loopback", [True, False])
def test_the_worker_setup_hook_applies_the_edge_and_loopback_where_asked(monkeypatch, loopback):
    edge = Edge(10, 4096, 1024, loopback)
    for name, value in edge.environment().items():
        monkeypatch.setenv(name, value)
    assert json.loads(edge.environment()[ENV])["loopback"] is loopback
    original = replica.add_port_to_grpc_server
    setup_worker()
    template = haproxy.HAPROXY_CONFIG_TEMPLATE
    assert "timeout http-request 10s" in template and "sc0_conn_cur gt 1024" in template
    assert ("bind *:{{ config.stats_port }}" not in template) is loopback
    assert (replica.add_port_to_grpc_server is not original) is loopback


def scope(path: str, root: str = "", **headers: str) -> dict:
    return {"type": "http", "path": root + path, "root_path": root,
            "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}


def test_only_a_bearer_of_the_key_passes_the_scheme_in_any_case():
    assert all(key_matches("s3cret", header) for header in ("Bearer s3cret", "bearer s3cret", "BEARER s3cret"))
    for header in (None, "", "s3cret", "Bearer", "Basic s3cret", "Bearer s3cre", "Bearer s3cret2", "Bearer s3cret ",
                   "Bearer  s3cret", "Token s3cret"):
        assert not key_matches("s3cret", header), header


@pytest.mark.parametrize("root", ["", "/small"])
def test_with_a_key_every_route_but_the_open_ones_needs_it(root):
    settings = Settings(api_key="s3cret")
    for path in ("/logprobs", "/metrics", "/docs", "/openapi.json", "/v1/models", "/v1/models/policy", "/version",
                 "/tokenize", "/detokenize", "/no/such/route", "/"):
        assert refusal(settings, scope(path, root)) == (
            401, "missing or wrong API key: send 'Authorization: Bearer <key>'", {"WWW-Authenticate": "Bearer"}), path
        assert refusal(settings, scope(path, root, authorization="Bearer s3cret")) is None
    assert OPEN_ROUTES == {"/healthz", "/health", "/readyz"}
    assert all(refusal(settings, scope(path, root)) is None for path in OPEN_ROUTES)
    assert refusal(settings, scope("/x/healthz", root)) is not None


@pytest.mark.parametrize("host, allowed", [
    ("127.0.0.1:8000", True), ("127.0.0.1", True), ("127.3.4.5:1", True), ("localhost:8000", True),
    ("LOCALHOST", True), ("localhost.", True), ("app.localhost:8000", True), ("[::1]:8000", True), ("::1", True),
    ("evil.example", False), ("evil.example:8000", False), ("127.0.0.1.evil.example", False),
    ("localhost.evil.example", False), ("[::2]:80", False), ("10.0.0.1:8000", False), ("", False),
    ("trainer.internal:8000", True),
])
def test_a_keyless_loopback_service_answers_only_host_names_of_loopback_or_allowed(host, allowed):
    assert host_allowed(host, ["Trainer.Internal"]) is allowed
    refused = refusal(Settings(allowed_hosts=["trainer.internal"]), scope("/logprobs", host=host))
    assert (refused is None) is allowed
    if not allowed:
        assert refused[0] == 400 and f"Host {host!r} is not this service's" in refused[1]


def test_no_host_header_and_a_keyed_service_pass_the_host_check():
    assert refusal(Settings(), scope("/logprobs")) is None  # (no browser sends no Host)
    keyed = Settings(api_key="s3cret")
    assert refusal(keyed, scope("/logprobs", host="evil.example", authorization="Bearer s3cret")) is None

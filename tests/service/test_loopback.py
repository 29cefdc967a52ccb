"""service/loopback.py without starting Ray: Serve's own function for a replica's gRPC server, once wrapped, binds a
real gRPC server to loopback only; HAProxy's template gets its metrics and statistics frontends on 127.0.0.1; a
Ray that renamed either is refused. Every patch of Ray's modules is undone after each test."""

from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest
from ray.serve._private import haproxy, replica

from ppo_logprobs.service.loopback import (
    _loopback_address,
    keep_haproxy_on_loopback,
    keep_replica_grpc_on_loopback,
)

METRICS, STATS = "bind :{{ config.metrics_port }}", "bind *:{{ config.stats_port }}"


@pytest.fixture(autouse=True)
def restored(monkeypatch):
    """Ray's module attributes as they were, after the test (monkeypatch undoes its own settings)."""
    monkeypatch.setattr(replica, "add_port_to_grpc_server", replica.add_port_to_grpc_server)
    monkeypatch.setattr(haproxy, "HAPROXY_CONFIG_TEMPLATE", haproxy.HAPROXY_CONFIG_TEMPLATE)


def listening_ips(port: int) -> set[str]:
    return {c.laddr.ip.removeprefix("::ffff:") for c in psutil.Process().net_connections("inet")
            if c.laddr.port == port and c.status == psutil.CONN_LISTEN}


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_a_loopback_service_binds_the_replicas_grpc_server_to_loopback(host):
    keep_replica_grpc_on_loopback(host)
    wrapped = replica.add_port_to_grpc_server
    keep_replica_grpc_on_loopback(host)  # a second replica in the same process: wrapped once
    assert replica.add_port_to_grpc_server is wrapped
    server = grpc.server(ThreadPoolExecutor(1))
    try:
        port = replica.add_port_to_grpc_server(server, "[::]:0")  # the call Serve's replica makes
        server.start()
        assert listening_ips(port) == {"127.0.0.1"}
    finally:
        server.stop(None)


def test_a_public_service_leaves_serves_function_alone():
    original = replica.add_port_to_grpc_server
    keep_replica_grpc_on_loopback("0.0.0.0")
    assert replica.add_port_to_grpc_server is original


@pytest.mark.parametrize(
    "address, bound",
    [("[::]:0", "127.0.0.1:0"), ("0.0.0.0:5000", "127.0.0.1:5000"), (":7", "127.0.0.1:7"),
     ("10.1.2.3:7", "10.1.2.3:7"), ("[::1]:9", "[::1]:9")],
)
def test_only_all_interface_addresses_are_moved(address, bound):
    assert _loopback_address(address) == bound


def test_a_ray_without_the_grpc_function_is_refused(monkeypatch):
    monkeypatch.delattr(replica, "add_port_to_grpc_server")
    with pytest.raises(RuntimeError) as refused:
        keep_replica_grpc_on_loopback("127.0.0.1")
    assert str(refused.value) == ("ray.serve._private.replica.add_port_to_grpc_server is gone (a Ray upgrade?): "
                                  "cannot keep the replica's gRPC server on loopback")


def test_haproxy_metrics_and_statistics_bind_loopback():
    before = haproxy.HAPROXY_CONFIG_TEMPLATE
    keep_haproxy_on_loopback()
    after = haproxy.HAPROXY_CONFIG_TEMPLATE
    binds = [line.strip() for line in after.splitlines() if line.strip().startswith("bind ")]
    assert "bind 127.0.0.1:{{ config.metrics_port }}" in binds and "bind 127.0.0.1:{{ config.stats_port }}" in binds
    assert not [b for b in binds if b.startswith(("bind :", "bind *"))], binds
    assert after.count("\n") == before.count("\n") and len(binds) == sum(
        line.strip().startswith("bind ") for line in before.splitlines())  # nothing else added or removed


def test_a_template_without_a_known_bind_is_refused_and_left_as_it_was(monkeypatch):
    renamed = haproxy.HAPROXY_CONFIG_TEMPLATE.replace(STATS, "bind *:{{ config.stats_port_v2 }}")
    monkeypatch.setattr(haproxy, "HAPROXY_CONFIG_TEMPLATE", renamed)  # as a Ray upgrade might rename it
    with pytest.raises(RuntimeError) as refused:
        keep_haproxy_on_loopback()
    assert str(refused.value) == (f"Serve's HAProxy template has no {STATS!r} (a Ray upgrade?): cannot keep it on "
                                  "loopback")
    assert haproxy.HAPROXY_CONFIG_TEMPLATE == renamed and METRICS in renamed


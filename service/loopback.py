"""A service on loopback keeps every listener of its Serve processes on loopback.

Ray Serve 2.60 starts, in every replica, a gRPC server for calls between deployments bound to all interfaces
(`ray/serve/_private/replica.py`: `add_port_to_grpc_server(self._server, "[::]:0")`, called when the replica has
finished its user constructor). It carries pickled calls guarded only by Ray's cluster token. When the gateway
listens on loopback (one machine), every Ray node is on this machine too, so the constructor of each of our
replicas rebinds that server to 127.0.0.1 by wrapping the function the replica module calls. If a Ray upgrade
renames it, `keep_replica_grpc_on_loopback` raises rather than serve with the port open, and
tests/service/test_gateway.py checks the sockets of every service process.

Serve's HAProxy ingress (`--ingress haproxy`) binds its Prometheus and statistics frontends to all interfaces too,
from a template that `ray/serve/_private/haproxy.py` renders; `edge.setup_worker`, the Ray worker-process setup hook
that `ppo-logprobs serve` installs, puts both on 127.0.0.1 for a loopback service (and the replicas' gRPC servers,
for replicas of any deployment).
"""

from __future__ import annotations

import logging

from .config import is_loopback

log = logging.getLogger(__name__)


def _loopback_address(address: str) -> str:
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host in ("[::]", "0.0.0.0", "") else address


def keep_replica_grpc_on_loopback(host: str) -> None:
    """When `host` (where the gateway listens) is loopback, this replica's inter-deployment gRPC server binds
    127.0.0.1 instead of all interfaces. Call it from a replica's constructor."""
    if not is_loopback(host):
        return
    from ray.serve._private import replica

    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None:
        raise RuntimeError("ray.serve._private.replica.add_port_to_grpc_server is gone (a Ray upgrade?): cannot keep "
                           "the replica's gRPC server on loopback")
    if getattr(bind, "_on_loopback", False):
        return

    def on_loopback(server, address: str):
        return bind(server, _loopback_address(address))

    on_loopback._on_loopback = True
    replica.add_port_to_grpc_server = on_loopback


_HAPROXY_BINDS = ("bind :{{ config.metrics_port }}", "bind *:{{ config.stats_port }}")


def keep_haproxy_on_loopback() -> None:
    """Serve's HAProxy configuration with its metrics and statistics frontends on 127.0.0.1."""
    from ray.serve._private import haproxy

    template = haproxy.HAPROXY_CONFIG_TEMPLATE
    for bind in _HAPROXY_BINDS:
        if bind not in template:
            raise RuntimeError(f"Serve's HAProxy template has no {bind!r} (a Ray upgrade?): cannot keep it on loopback")
        template = template.replace(bind, bind.replace(":{{", "127.0.0.1:{{").replace("*", ""))
    haproxy.HAPROXY_CONFIG_TEMPLATE = template


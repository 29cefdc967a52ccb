"""The edge: what every request meets before a route. Two parts.

In front of every route of an ingress replica (`refusal`, which the app's middleware asks): a key-less service on
loopback answers only Host headers that name loopback (or `allowed_hosts`), so that a web page whose name was
rebound to 127.0.0.1 cannot read it; with an API key, every route but OPEN_ROUTES needs it.

In Serve's HAProxy ingress, the bounds Serve's configuration lacks, added where `ppo-logprobs serve` starts the
service. Serve renders HAProxy's configuration from a template (`ray/serve/_private/haproxy_templates.py`) with no
deadline for a request's headers (`timeout client 3600s`, no `timeout http-request`), no limit per client, a 404
for every path while it has no routes yet (as after HAProxy restarts), and a UDP syslog target that binds 0.0.0.0.
`Edge` holds our bounds; `edge_template` writes them into the template; `setup_worker`, the Ray worker-process
setup hook that `ppo-logprobs serve` installs, applies them (and, for a loopback service, `loopback.py`'s
rebinding) in every Ray process it starts, HAProxy's manager among them.
A template a Ray upgrade changed is refused, not half patched.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from dataclasses import asdict, dataclass

from .config import is_loopback

# answered without the key: liveness (ours, and vLLM's /health) and readiness, nothing more
OPEN_ROUTES = frozenset({"/healthz", "/health", "/readyz"})
ENV = "PPO_LOGPROBS_EDGE"  # the Edge, as JSON, for the processes Ray starts

_FRONTEND = "    bind {{ config.frontend_host }}:{{ config.frontend_port }}\n"
_NOT_FOUND = ("    http-request return status 404 content-type text/plain lf-string \"Path '%[path]' not found. Ping "
              "http://.../-/routes for available routes.\"\n")
_LOG = "    log {{ config.log_target }} local0 info\n"


@dataclass(frozen=True)
class Edge:
    header_timeout_s: float  # a request's line and headers must arrive whole within this (else 408, closed)
    max_connections: int  # connections HAProxy holds at once (Serve's maxconn)
    max_connections_per_client: int  # by source address; more are refused
    loopback: bool  # the service listens on loopback only

    @classmethod
    def of(cls, settings) -> Edge:
        return cls(settings.body_timeout_s, settings.max_connections, settings.max_connections_per_client,
                   is_loopback(settings.host))

    def environment(self) -> dict[str, str]:
        """What the driver sets before Ray starts (every process Ray starts inherits it): the Edge itself, and
        Serve's own knobs for what it lets us set."""
        idle = max(1, round(self.header_timeout_s))
        return {ENV: json.dumps(asdict(self)), "RAY_SERVE_HAPROXY_MAXCONN": str(self.max_connections),
                # an idle client (before its headers, or stalled in its body) is dropped after this, not an hour
                "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": str(idle),
                # a stopping replica stays reachable this long, then refuses new connections (HAProxy retries them
                # on another replica) and finishes those in flight: Serve's 30 s made every stop of the service
                # (Ctrl-C, SIGTERM) take over 30 s, with a warning that its controller did not stop in time
                "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}


def edge_template(template: str, edge: Edge) -> str:
    """Serve's HAProxy template with our bounds: a deadline for headers and a limit of connections per client in the
    HTTP frontend; 503 with Retry-After instead of 404 while HAProxy knows no route yet; its log to stderr (a file
    of Serve's) at warning level instead of UDP syslog."""
    for anchor in (_FRONTEND, _NOT_FOUND, _LOG):
        if template.count(anchor) != 1:
            raise RuntimeError(f"Serve's HAProxy template has no single {anchor.strip()[:60]!r} (a Ray upgrade?): "
                               "cannot bound the edge")
    bounds = (
        f"    timeout http-request {edge.header_timeout_s:g}s\n"
        "    stick-table type ipv6 size 256k expire 120s store conn_cur\n"
        "    tcp-request connection track-sc0 src\n"
        f"    tcp-request connection reject if {{ sc0_conn_cur gt {edge.max_connections_per_client} }}\n"
    )
    from .errors import error_body  # (here, not at the top: this module is read before Ray is imported)

    body = json.dumps(error_body("the service is starting: retry", 503)).replace('"', '\\"')
    starting = ("{%- if backends %}\n" + _NOT_FOUND + "{%- else %}\n"
                f"    http-request return status 503 content-type application/json hdr Retry-After 1 string "
                f"\"{body}\"\n{{%- endif %}}\n")
    return (template.replace(_FRONTEND, _FRONTEND + bounds).replace(_NOT_FOUND, starting)
            .replace(_LOG, "    log stderr format raw local0 warning\n"))


def _no_other_nodes(record: logging.LogRecord) -> bool:
    return "won't accept connections from HAProxy on other nodes" not in record.getMessage()


def _refusals_in_one_line(record: logging.LogRecord) -> bool:
    """Serve's controller logs a replica whose constructor raised with the whole traceback, Serve's frames and ours
    (44 lines where a keeper's workers refused their model). Where the cause is one of ppo_logprobs' own errors, whose
    message says all (IncompatibleWeights naming the tensor, say), the record keeps only that line."""
    error = record.exc_info[1] if record.exc_info else None
    last = str(error).rstrip().rsplit("\n", 1)[-1] if error is not None else ""
    if last.startswith(f"{__package__.rsplit('.', 1)[0]}.workers.errors."):
        record.msg, record.args = f"{record.getMessage().rstrip('.')}: {last}", ()
        record.exc_info = record.exc_text = None
    return True


def setup_worker() -> None:
    """Ray's worker_process_setup_hook for `ppo-logprobs serve`: runs in every Ray worker process it starts."""
    from ray.serve._private import haproxy

    from .loopback import keep_haproxy_on_loopback, keep_replica_grpc_on_loopback

    edge = Edge(**json.loads(os.environ[ENV]))
    if edge.loopback:
        keep_replica_grpc_on_loopback("127.0.0.1")
        keep_haproxy_on_loopback()
        # (Serve's controller warns, at every start, that HAProxy on other nodes cannot reach a replica on loopback:
        # a service on loopback keeps Ray there too, so it has no other nodes)
        logging.getLogger("ray.serve").addFilter(_no_other_nodes)
    logging.getLogger("ray.serve").addFilter(_refusals_in_one_line)
    haproxy.HAPROXY_CONFIG_TEMPLATE = edge_template(haproxy.HAPROXY_CONFIG_TEMPLATE, edge)


def refusal(settings, scope: dict) -> tuple[int, str, dict[str, str]] | None:
    """(status, detail, headers) of the answer a request gets instead of its route, or None to let it through."""
    host = authorization = None
    for name, value in scope["headers"]:
        if name == b"host" and host is None:
            host = value.decode("latin-1")
        elif name == b"authorization" and authorization is None:
            authorization = value.decode("latin-1")
    if settings.api_key is None:
        if host is not None and is_loopback(settings.host) and not host_allowed(host, settings.allowed_hosts):
            return 400, (f"Host {host[:100]!r} is not this service's: without an API key, a service on loopback "
                         "answers Host names of loopback (or its allowed_hosts)"), {}
        return None
    if route_of(scope) in OPEN_ROUTES or key_matches(settings.api_key.get_secret_value(), authorization):
        return None
    return 401, "missing or wrong API key: send 'Authorization: Bearer <key>'", {"WWW-Authenticate": "Bearer"}


def route_of(scope: dict) -> str:
    """The request's path below the application's prefix (Serve's route_prefix, in `root_path`)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def key_matches(key: str, authorization: str | None) -> bool:
    """Whether 'Authorization: Bearer <key>' carries `key` (the scheme in any case, as RFC 9110 says)."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), key.encode())


def host_allowed(host: str, allowed: list[str]) -> bool:
    """Whether a Host header ('name', 'name:port', '[v6]:port') names loopback or one of `allowed`."""
    value = host.strip().lower()
    if value.startswith("["):
        name = value[1 : value.find("]")] if "]" in value else value
    else:
        name = value.rsplit(":", 1)[0] if value.count(":") == 1 else value
    name = name.rstrip(".")
    return is_loopback(name) or name.endswith(".localhost") or name in {a.lower() for a in allowed}

"""`python -m ppo_logprobs.service`: start Ray, the gateway and its workers; serve until interrupted."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
from typing import NoReturn

from pydantic import ValidationError
from pydantic_settings import SettingsError

from .config import Settings, is_loopback
from .edge import Edge

log = logging.getLogger("ppo_logprobs.service")


def fail(message: str) -> NoReturn:
    """A start-up mistake: one line on stderr, exit code 2 (as argparse's own)."""
    sys.stderr.write(f"ppo-logprobs serve: {message}\n")
    raise SystemExit(2)


def _values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] if a == flag else a.split("=", 1)[1] for i, a in enumerate(argv)
            if (a == flag and i + 1 < len(argv)) or a.startswith(flag + "=")]


def _one_line(error: ValidationError) -> str:
    parts = []
    for e in error.errors():
        message = e["msg"].removeprefix("Value error, ")
        if e["loc"]:
            parts.append(f"--{'.'.join(map(str, e['loc'])).replace('_', '-')}: {message} (got {e['input']!r:.200})")
        else:
            parts.append(message)
    return "; ".join(parts)


def parse_args(argv: list[str] | None = None) -> Settings:
    """Settings from flags (generated from Settings; `--help` lists them) over PPO_LOGPROBS_* variables; a mistake
    ends the command in one line (fail)."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--api-key" or a.startswith("--api-key=") for a in argv):
        fail("the API key is read from PPO_LOGPROBS_API_KEY or --api-key-file, never from a flag (other users of the "
             "machine would see it in ps)")
    for value in _values(argv, "--models"):
        if "=" not in value and not value.lstrip().startswith("{"):
            fail(f"--models {value}: give NAME=PATH, the name clients ask for and the checkpoint directory (e.g. "
                 f"--models policy={value})")
    try:
        return Settings(_cli_parse_args=argv)
    except ValidationError as e:
        fail(_one_line(e))
    except SettingsError as e:
        fail(str(e).splitlines()[0])


def checkpoint_problem(path: str) -> str | None:
    """Why `path` cannot be loaded as a model, as far as can be told without loading it (None: nothing found)."""
    if not os.path.isdir(path):
        return f"no directory {path!r}"
    if not os.path.isfile(os.path.join(path, "config.json")):
        return f"{path!r} has no config.json: not a HuggingFace checkpoint directory"
    if not any(f.endswith(".safetensors") or f.startswith("pytorch_model") and f.endswith(".bin")
               for f in os.listdir(path)):
        return f"{path!r} has no weights (*.safetensors or pytorch_model*.bin)"
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # (whatever transformers raises for a config it cannot read: JSON, an unknown model_type)
        return f"cannot read {os.path.join(path, 'config.json')!r} ({str(e).splitlines()[0]:.200})"
    from ..workers.weights.checkpoint import check_shards

    try:
        check_shards(path)  # (the shards' headers and sizes; no tensor is read)
    except ValueError as e:  # (InvalidCheckpoint: it names the shard)
        return str(e)
    return None


def preflight(settings: Settings) -> None:
    """What start-up would fail on later, checked before Ray starts: each checkpoint directory (on this machine;
    joining a cluster through RAY_ADDRESS, the GPU nodes may hold paths this one does not: then only a warning),
    the tokenizer, and the port."""
    for name, path in settings.models.items():
        if path == "tiny":
            continue
        problem = checkpoint_problem(path)
        if problem and os.environ.get("RAY_ADDRESS") in (None, "", "local"):
            fail(f"--models {name}={path}: {problem}")
        if problem:
            log.warning("--models %s=%s: %s on this machine (the GPU nodes must have it)", name, path, problem)
    if settings.tokenizer is not None and not os.path.isdir(settings.tokenizer):
        fail(f"--tokenizer {settings.tokenizer}: no directory {settings.tokenizer!r}")
    if settings.tokenizer is not None:
        try:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(settings.tokenizer, local_files_only=True)
        except Exception as e:  # (whatever transformers raises for a directory it cannot read)
            fail(f"--tokenizer {settings.tokenizer}: cannot load a tokenizer from it ({str(e).splitlines()[0]:.200})")
    with socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((settings.host, settings.port))
        except OSError as e:
            fail(f"--port {settings.port}: cannot listen on {settings.host}:{settings.port} ({e.strerror}): another "
                 "service holds it? choose one with --port")


_RAISED = re.compile(r"^(?:\w+\.)*(\w+: .+)$", re.M)  # a traceback's last line: "module.Type: message"


def deploy_failure(settings: Settings, app) -> str | None:
    """Why the application (serve.status()'s overview of it) failed to deploy, in one line; None if it did not. The
    reason is the last exception its failed deployment's traceback names: the deepest cause, which Ray prints after
    the remote traceback it came in (a worker's load_model, under the keeper's pool, under the keeper's replica)."""
    if app is None or app.status != "DEPLOY_FAILED":
        return None
    failed = {name: d.message for name, d in app.deployments.items() if d.status == "DEPLOY_FAILED"}
    if not failed:
        return f"the service did not start: {app.message:.300}"
    name = "PoolKeeper" if "PoolKeeper" in failed else next(iter(failed))  # (an ingress replica waits on the keeper)
    raised = _RAISED.findall(failed[name])
    reason = raised[-1] if raised else failed[name].strip().splitlines()[0]
    if name != "PoolKeeper":
        return f"the service did not start: {name}: {reason:.300}"
    # the keeper makes every model's pool, named '<pool_name>:<model>' (its workers too): the one that failed, or all
    named = [m for m in settings.models if len(settings.models) == 1 or f"{settings.pool_name}:{m}:" in failed[name]]
    flags = " ".join(f"--models {m}={settings.models[m]}" for m in named or settings.models)
    return f"{flags}: the workers did not start: {reason:.300}"


def curl_example(settings: Settings) -> str:
    """A request to paste; it names the key's variable, never the key."""
    body = json.dumps({"model": next(iter(settings.models)), "input_ids": [[1, 2, 3, 4], [5, 6, 7]],
                       "score_from": [2, 1]})
    auth = ' -H "Authorization: Bearer $PPO_LOGPROBS_API_KEY"' if settings.api_key else ""
    return (f"curl -s http://{settings.host}:{settings.port}/logprobs -H 'Content-Type: application/json'{auth} "
            f"-d '{body}'")


def haproxy_files(folder: str) -> dict[str, str]:
    """The variables that put HAProxy's configuration, state and admin sockets in a folder of this user's (mkdtemp:
    mode 0700), where the environment does not already say; Serve's defaults are in /tmp/haproxy-serve, where an
    admin socket of mode 666 lets any local user command it. The name is short: a node's id (56 characters) goes
    below it, and HAProxy takes socket paths of at most 97."""
    files = {"CONFIG_FILE_LOC": "haproxy.cfg", "SOCKET_PATH": "admin.sock", "SERVER_STATE_BASE": "",
             "SERVER_STATE_FILE": "server-state", "METRICS_SOCKET_PATH": "metrics.sock"}
    return {f"RAY_SERVE_HAPROXY_{name}": os.environ.get(f"RAY_SERVE_HAPROXY_{name}",
                                                       os.path.join(folder, file).rstrip("/"))
            for name, file in files.items()}


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = parse_args(argv)
    preflight(settings)
    ## NB: Ray and Serve read these when they are imported (here and in every process Ray starts), so they are set
    # before the imports below.
    loopback = is_loopback(settings.host)
    if loopback:
        # a one-machine service keeps Ray's own listeners on loopback too (docs/security.md)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    folder = None
    if settings.ingress == "haproxy":
        os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
        folder = tempfile.mkdtemp(prefix="ppl-")
        os.environ.update(haproxy_files(folder))
    elif not loopback:
        log.warning("Serve's Python proxy has no deadline for a request's headers: behind it, slow clients can hold "
                    "connections open (the haproxy ingress bounds them)")
    for name, value in Edge.of(settings).environment().items():
        os.environ.setdefault(name, value)
    serve_until_stopped(settings, folder)


def remove_haproxy_folder(folder: str, wait_s: float = 10.0) -> None:
    """SIGTERM to every HAProxy still running on a configuration in `folder`, a wait for them to exit, and the folder
    removed. Serve's shutdown stops them; a SIGTERM to the service's process group does not reach them (Ray's
    workers, which start them, are in groups of their own), and without this they went on serving the port after
    the service exited."""
    import time

    left = []
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else ()):  # (Linux's; Ray's HAProxy)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:  # (gone, or not ours to read)
            continue
        if os.path.basename(args[0]) == "haproxy" and any(a.startswith(folder + os.sep) for a in args):
            try:
                os.kill(int(pid), signal.SIGTERM)
                left.append(int(pid))
            except OSError:
                pass
    deadline = time.monotonic() + wait_s
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [pid for pid in left if os.path.exists(f"/proc/{pid}") and not _zombie(pid)]
    if left:
        log.warning("HAProxy (pid %s) did not exit within %.0f s of SIGTERM", ", ".join(map(str, left)), wait_s)
    shutil.rmtree(folder, ignore_errors=True)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def serve_until_stopped(settings: Settings, folder: str | None) -> None:
    """Ray, Serve and the application up until Ctrl-C or SIGTERM, then down; `folder` (HAProxy's files) removed."""
    import ray
    from ray import serve

    from .app import build_app, shut_down_serve

    # every Ray process this starts applies the edge's bounds first (edge.py), HAProxy's manager among them; the
    # environment goes with the job too, for the worker processes of a cluster that `ray start` began (RAY_ADDRESS),
    # which inherit their raylet's environment, not ours
    # (each as main() left it: an operator's own value of one of these stands); HAProxy's files too: its manager is
    # such a worker, and in its raylet's /tmp/haproxy-serve the admin socket is anyone's
    env = {**{name: os.environ.get(name, value) for name, value in Edge.of(settings).environment().items()},
           **({"RAY_SERVE_ENABLE_HA_PROXY": "1"} if settings.ingress == "haproxy" else {}),
           **(haproxy_files(folder) if folder is not None else {})}
    ray_stopped = False  # (by a signal to the whole process group, under Serve's shutdown)
    try:
        ray.init(include_dashboard=False, runtime_env={"env_vars": env,
                                                       "worker_process_setup_hook": f"{__package__}.edge.setup_worker"})
        # SIGTERM stops the service as Ctrl-C does, from here on: Ray's own handler ended this process with a stack
        # dump and no Serve shutdown when it came while the application was deploying (/readyz can answer 200
        # before serve.run returns)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            logging.getLogger("ray.serve").setLevel(settings.serve_log_level)  # (Serve's lines in this process too)
            serve.start(proxy_location="EveryNode", http_options={"host": settings.host, "port": settings.port},
                        logging_config={"log_level": settings.serve_log_level})
            n = settings.workers_per_model
            # (a GPU worker's start is quiet for most of a minute: BENCHMARKS.md, "Recovery on a GPU")
            log.info("starting %s on %d worker%s each: a worker loads its model%s, then this says where it is ready",
                     ", ".join(f"{name} ({path})" for name, path in settings.models.items()), n, "s" * (n > 1),
                     ", compiles its kernels for the GPU and warms them up (about a minute the first time, more for a "
                     "large model; Triton's cache keeps the kernels for the next)" if ray.cluster_resources().get("GPU")
                     else "")
            try:
                serve.run(build_app(settings), name="ppo_logprobs", route_prefix="/")
            except RuntimeError:  # it failed to deploy: its reason in one line, after all Ray has to say (its log)
                reason = deploy_failure(settings, serve.status().applications.get("ppo_logprobs"))
                if reason is None:
                    raise
                shut_down_serve()
                ray.shutdown()
                fail(reason)
            url = f"http://{settings.host}:{settings.port}"
            log.info("ready on %s (docs at %s/docs). Try:", url, url)
            log.info("  %s", curl_example(settings))
            threading.Event().wait()  # until Ctrl-C or SIGTERM
        except KeyboardInterrupt:
            log.info("shutting down: finishing requests in flight")
            ray_stopped = not stop_serve()
    finally:
        if folder is not None:
            remove_haproxy_folder(folder)
        if not ray_stopped:
            ray.shutdown()
    log.info("stopped")  # (after Ctrl-C or SIGTERM: Serve and the Ray this process started are down)
    if ray_stopped:  # (Ray's shutdown at the interpreter's exit would end it with status 1 on finding its raylet gone)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def stop_serve() -> bool:
    """Serve shut down (shut_down_serve), unless the Ray this process started stops under it: a SIGTERM to the whole
    process group (`kill -- -PGID`, systemd's default stop) reaches its raylet and GCS too, and Serve would wait 30 s
    for a controller that is already gone. False in that case."""
    import ray

    from .app import shut_down_serve

    stopping = threading.Thread(target=shut_down_serve, name="serve-shutdown", daemon=True)
    stopping.start()
    node = getattr(ray._private.worker, "_global_node", None)  # (None when this process joined a running cluster)
    while stopping.is_alive():
        stopping.join(0.25)
        gone = sorted({kind for kind, _ in node.dead_processes()} & {"raylet", "gcs_server"}) if node else []
        if gone and stopping.is_alive():
            log.info("Ray's %s stopped with this process (a signal to its process group): nothing left to drain",
                     " and ".join(gone))
            return False
    return True


if __name__ == "__main__":
    main()

"""`python -m ppo_logprobs.service`: start Ray, the gateway and its workers; serve until interrupted."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading

from .config import Settings, is_loopback

log = logging.getLogger("ppo_logprobs.service")


def parse_args(argv: list[str] | None = None) -> Settings:
    """Settings from flags (generated from Settings; `--help` lists them) over PPO_LOGPROBS_* variables."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--api-key" or a.startswith("--api-key=") for a in argv):
        raise SystemExit("the API key is read from PPO_LOGPROBS_API_KEY or --api-key-file, never from a flag "
                         "(other users of the machine would see it in ps)")
    return Settings(_cli_parse_args=argv)


def curl_example(settings: Settings) -> str:
    """A request to paste; it names the key's variable, never the key."""
    body = json.dumps({"model": next(iter(settings.models)), "input_ids": [[1, 2, 3, 4], [5, 6, 7]],
                       "score_from": [2, 1]})
    auth = ' -H "Authorization: Bearer $PPO_LOGPROBS_API_KEY"' if settings.api_key else ""
    return (f"curl -s http://{settings.host}:{settings.port}/logprobs -H 'Content-Type: application/json'{auth} "
            f"-d '{body}'")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = parse_args(argv)
    ## NB: Ray and Serve read these when they are imported, so they are set before the imports below.
    if is_loopback(settings.host):
        # a one-machine service keeps Ray's own listeners on loopback too (README: Security)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if settings.ingress == "haproxy":
        os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
    import ray
    from ray import serve

    from .app import build_app

    ray.init(include_dashboard=False)
    serve.start(proxy_location="EveryNode", http_options={"host": settings.host, "port": settings.port})
    serve.run(build_app(settings), name="ppo_logprobs", route_prefix="/")
    url = f"http://{settings.host}:{settings.port}"
    log.info("ready on %s (docs at %s/docs). Try:", url, url)
    log.info("  %s", curl_example(settings))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    log.info("shutting down: finishing requests in flight")
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()

"""`python -m ppo_logprobs.service`: start Ray, the gateway and its workers; serve until interrupted."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading

from .config import Settings

log = logging.getLogger("ppo_logprobs.service")


def parse_args(argv: list[str] | None = None) -> Settings:
    """Settings from flags (generated from Settings; `--help` lists them) over PPO_LOGPROBS_* variables."""
    return Settings(_cli_parse_args=sys.argv[1:] if argv is None else argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = parse_args(argv)
    import ray
    from ray import serve

    from .app import build_app

    ray.init(include_dashboard=False)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(build_app(settings), name="ppo_logprobs", route_prefix="/")
    first = next(iter(settings.models))
    body = json.dumps({"model": first, "input_ids": [[1, 2, 3, 4], [5, 6, 7]], "score_from": [2, 1]})
    auth = ' -H "Authorization: Bearer $PPO_LOGPROBS_API_KEY"' if settings.api_key else ""
    url = f"http://{settings.host}:{settings.port}"
    log.info("ready on %s (docs at %s/docs). Try:", url, url)
    log.info("  curl -s %s/logprobs -H 'Content-Type: application/json'%s -d '%s'", url, auth, body)
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

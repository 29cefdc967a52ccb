"""The README's quick start, run as written against `make serve` itself (the tiny model as "policy", the default
pool name), so that the README cannot drift from what works: its curl command, its Python blocks (each in a fresh
process, as a user pastes them) and its command-line block. Only the port is changed, to a free one. Then a SIGTERM
to make alone (as a supervisor sends it) stops the whole service: before, make's shell died and left the service
running."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from ..helpers import free_port, stop_service, wait_ready

README = Path(__file__).parents[2] / "README.md"


def quick_start() -> list[tuple[str, str]]:
    """(language, text) of each fenced block of the README's "## Quick start" section."""
    text = README.read_text()
    section = text[text.index("## Quick start"):]
    section = section[: section.index("\n## ", 1)]
    return [(m.group(1), m.group(2)) for m in re.finditer(r"```(\w*)\n(.*?)```", section, re.S)]


@pytest.fixture(scope="module")
def make_serve(tmp_path_factory):
    """(url, make's process, its log): `make serve ARGS="--port N"` in the repository, with this environment as
    its .venv (already built: not remade)."""
    port, venv = free_port(), sys.prefix
    # (HAProxy's metrics and statistics frontends off Ray's fixed ports, which an HAProxy of the file before may
    # still hold: test_serve_command.py)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
           "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port())}
    log = tmp_path_factory.mktemp("make-serve") / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["make", "serve", f"VENV={venv}", "-o", f"{venv}/.installed", f"ARGS=--port {port}"],
                                cwd=README.parent, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log)
        yield url, proc, log
    finally:
        stop_service(proc)  # (the last test has stopped it already)


@pytest.fixture(scope="module")
def url(make_serve):
    return make_serve[0]


def run(argv, cwd, **kw):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # (a user's shell has none: find the Ray)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=cwd, env=env, **kw)
    assert out.returncode == 0, (argv, out.stdout, out.stderr)
    return out.stdout


def test_the_quick_start_runs_as_written(url, tmp_path):
    blocks = quick_start()
    assert [lang for lang, _ in blocks] == ["", "python", "python", ""]
    curl, shown = blocks[0][1].split("\n->")
    answer = json.loads(run(["bash", "-c", curl.replace("http://127.0.0.1:8000", url)], tmp_path))
    assert [len(r["log_probs"]) for r in answer["results"]] == [2, 2]
    # the answer as the README shows it: its fields in their order, the usage whole
    assert [key for key in re.findall(r'"(\w+)":', shown) if key in answer] == list(answer), shown
    assert json.loads(re.search(r'"usage": (\{.*?\})', shown)[1]) == answer["usage"], answer["usage"]
    for _, code in blocks[1:3]:
        printed = run([sys.executable, "-c", code.replace("http://127.0.0.1:8000", url)], tmp_path)
        assert "[" in printed  # each block prints its arrays
    commands = blocks[3][1].replace(".venv/bin/ppo-logprobs", f"{Path(sys.executable).parent}/ppo-logprobs")
    commands = re.sub(r"(ppo-logprobs (score|bench))", rf"\1 --url {url}", commands)
    run(["bash", "-ec", commands], tmp_path)
    scored = [json.loads(line) for line in (tmp_path / "scores.jsonl").read_text().splitlines()]
    assert len(scored) == 1 and len(scored[0]["log_probs"]) == 2


def test_a_sigterm_to_make_stops_the_service_and_leaves_nothing_behind(make_serve):
    """After the quick start (pytest runs a file's tests in order): SIGTERM to make's process alone. make passes it
    to its child, which is the service itself (the recipe execs it), so the service shuts down in order, its last line
    says it stopped, and make exits once it has; every process the service started (Ray's, HAProxy) is gone soon
    after."""
    _, proc, log = make_serve
    started = psutil.Process(proc.pid).children(recursive=True)
    assert any("ppo_logprobs.service" in " ".join(p.cmdline()) for p in started), [p.cmdline() for p in started]
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)
    _, alive = psutil.wait_procs(started, timeout=30)  # (as test_serve_errors.py waits for a stopped service's)
    left = [p.cmdline()[:3] for p in alive]
    for p in alive:  # (so that the files after meet no service of this one)
        with contextlib.suppress(psutil.Error):
            p.kill()
    assert not left, left
    text = log.read_text()
    assert "shutting down: finishing requests in flight" in text and text.rstrip().endswith("stopped"), text[-3000:]

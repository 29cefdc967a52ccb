"""The README's quick start, run as written against a live service (`make serve`'s settings: the tiny model as
"policy", the default pool name), so that the README cannot drift from what works: its curl command, its Python
blocks (each in a fresh process, as a user pastes them) and its command-line block. Only the URL is changed, to
the test's port."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ppo_logprobs.service import Settings

from ..helpers import serving

README = Path(__file__).parents[2] / "README.md"


def quick_start() -> list[tuple[str, str]]:
    """(language, text) of each fenced block of the README's "## Quick start" section."""
    text = README.read_text()
    section = text[text.index("## Quick start"):]
    section = section[: section.index("\n## ", 1)]
    return [(m.group(1), m.group(2)) for m in re.finditer(r"```(\w*)\n(.*?)```", section, re.S)]


@pytest.fixture(scope="module")
def url():
    with serving(3, {"readme": Settings(backend="torch")}) as url:
        yield url


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

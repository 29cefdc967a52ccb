"""The docs' code blocks marked runnable (`<!-- runnable -->` on the line before the fence) run as written, each in
a fresh Python process as a reader pastes it: they cannot drift from what works. (The README's quick start, which
needs a live service, is tests/service/test_readme.py's.)"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
MARKED = re.compile(r"^<!-- runnable -->\n```python\n(.*?)^```", re.M | re.S)


def runnable() -> list[tuple[str, str]]:
    """(file:line, code) of each marked block."""
    blocks = []
    for path in sorted(DOCS.glob("*.md")):
        text = path.read_text()
        blocks += [(f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1)) for m in MARKED.finditer(text)]
    return blocks


def test_some_blocks_are_marked():
    assert len(runnable()) >= 2


@pytest.mark.parametrize(("where", "code"), runnable(), ids=[where for where, _ in runnable()])
def test_a_marked_block_runs_as_written(where, code, tmp_path):
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, (where, done.stderr[-3000:])
    assert done.stdout.strip(), where  # (each prints what it shows)

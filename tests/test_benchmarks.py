"""The benchmark scripts, which want a GPU and minutes, kept runnable between GPU calls: every name one imports from a
neighbour (bench_model) or from this project (ppo_logprobs.workers...) exists, so that a helper moved or renamed is
found here and not on a GPU host (bench_recovery.py imported free_port from bench_gateway.py for a while after it had
gone); and the forward benchmarks' CPU dry runs run. (The Ray ones' dry runs start clusters, a minute or more each:
bench_weights.py read a sender attribute that had gone, found by running it by hand.)"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def missing_imports(scripts: list[Path]) -> list[str]:
    """`from M import N` in `scripts` (at the top or inside a function) whose N is not in M, for M a script beside
    them (read: its top-level definitions) or a module of this project (imported: its lazy attributes count)."""
    missing = []
    for script in scripts:
        for node in ast.walk(ast.parse(script.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            neighbour = script.parent / f"{node.module}.py"
            if neighbour.exists():
                have = set()
                for top in ast.parse(neighbour.read_text()).body:
                    if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        have.add(top.name)
                    elif isinstance(top, (ast.Import, ast.ImportFrom)):
                        have.update((a.asname or a.name).split(".")[0] for a in top.names)
                    elif isinstance(top, (ast.Assign, ast.AnnAssign)):
                        targets = top.targets if isinstance(top, ast.Assign) else [top.target]
                        have.update(t.id for t in targets if isinstance(t, ast.Name))
                gone = [a.name for a in node.names if a.name not in have]
            elif node.module.startswith("ppo_logprobs."):
                module = importlib.import_module(node.module)
                gone = []
                for a in node.names:
                    try:
                        getattr(module, a.name)
                    except AttributeError:
                        try:
                            importlib.import_module(f"{node.module}.{a.name}")
                        except ModuleNotFoundError:
                            gone.append(a.name)
            else:
                continue
            missing += [f"{script.name}:{node.lineno}: {node.module}.{name}" for name in gone]
    return missing


def test_the_benchmarks_import_what_exists(tmp_path):
    (tmp_path / "bench_a.py").write_text("from bench_b import here, gone\n"
                                         "def f():\n    from ppo_logprobs.workers.head import Backend, nothing\n")
    (tmp_path / "bench_b.py").write_text("import os\nhere = 1\n")
    assert missing_imports([tmp_path / "bench_a.py"]) == ["bench_a.py:1: bench_b.gone",
                                                          "bench_a.py:3: ppo_logprobs.workers.head.nothing"]
    assert missing_imports(sorted((ROOT / "benchmarks").glob("*.py"))) == []


@pytest.mark.parametrize("command", [["bench_model.py", "--tiny"], ["bench_moe.py", "--tiny"], ["bench_invariance.py"],
                                     ["bench_prefix.py", "--tiny"], ["bench_mlp.py", "--tiny"]], ids=lambda c: c[0])
def test_a_forward_benchmarks_cpu_dry_run_runs_and_writes_its_results(command, tmp_path):
    """The dry runs of the benchmarks behind issue 41's figures (tiny configurations, every path they time): as a
    reader runs them before a GPU call, each to its JSON."""
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, *command, "--out", str(out)], cwd=ROOT / "benchmarks", capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(out.read_text())

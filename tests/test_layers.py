"""The package's import graph, read from the source with `ast` (nothing is imported): no import cycles, and each
layer imports only its own layer and the ones below it. An import inside a function (lazy) is an edge too; the
messages mark it. Not seen: imports by string (workers/__init__.py's lazy attribute table, `import_module`).

Layers, bottom to top: the contract (workers/{errors,outputs,request,wire,sharding,families,distributed,prefixes}.py),
the head, the weights (tensors staged, read, sent: they know no model class), the models, the pool (with the workers
package itself and its __main__), the service, and the client, which imports only the contract when it is imported (a
rollout worker needs neither Ray nor torch) and the pool only inside `connect_pool` (a trainer's); the framework
adapters (integrations) on top."""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("workers", "service", "client", "integrations")  # the import root's subpackages (pyproject.toml's package-dir)
W = "ppo_logprobs.workers"
CONTRACT = {f"{W}.{name}" for name in ("errors", "outputs", "request", "wire", "sharding", "families", "distributed",
                                        "prefixes")}
ORDER = ("contract", "head", "weights", "models", "pool", "service", "client", "integrations")  # bottom to top
CLIENT_MAY_IMPORT = {"contract", "client"}

@dataclass(frozen=True)
class Edge:
    source: str  # importing module
    target: str  # imported module (for `from m import name`: m.name when that is a module, else m)
    where: str  # path:line of the import statement
    lazy: bool  # inside a function: runs at call time, not import time

    def __str__(self) -> str:
        return f"{self.where}: {self.source} imports {self.target}{' (lazy)' if self.lazy else ''}"


def modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is a package's __init__), for every .py under the import root's subpackages."""
    found = {}
    for top in TOPS:
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            package = parts[-1] == "__init__"
            found[".".join(("ppo_logprobs", *(parts[:-1] if package else parts)))] = (path, package)
    return found


def imports(root: Path) -> list[Edge]:
    """Every import of a `ppo_logprobs` module by one of the package's modules, relative ones resolved."""
    known = modules(root)
    edges = []
    for name, (path, package) in known.items():
        here = name.split(".") if package else name.split(".")[:-1]  # the package relative imports start from
        where = path.relative_to(root).as_posix()

        def visit(node: ast.AST, lazy: bool, name=name, here=here, where=where) -> None:
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    assert node.level <= len(here), f"{where}:{node.lineno}: relative import beyond the import root"
                    base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            else:
                targets = []
            for target in dict.fromkeys(targets):
                if target == "ppo_logprobs" or target.startswith("ppo_logprobs."):
                    edges.append(Edge(name, target, f"{where}:{node.lineno}", lazy))
            inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for child in ast.iter_child_nodes(node):
                visit(child, inner)

        visit(ast.parse(path.read_text(), str(path)), False)
    return edges


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (its modules in import order) per strongly connected component of more than one module, or of one
    that imports itself (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(_cycle_through(v, component, graph))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def _cycle_through(start: str, component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest path from `start` back to itself inside its component (breadth first)."""
    paths, seen = [[start]], set()
    while paths:
        path = paths.pop(0)
        for w in sorted(graph.get(path[-1], ())):
            if w == start:
                return path
            if w in component and w not in seen:
                seen.add(w)
                paths.append([*path, w])
    raise AssertionError(f"no cycle through {start}")


def layer(module: str) -> str | None:
    if module in CONTRACT:
        return "contract"
    for name in ("head", "models", "weights", "pool"):
        if module == f"{W}.{name}" or module.startswith(f"{W}.{name}."):
            return name
    if module in (W, f"{W}.__main__"):
        return "pool"
    for top in ("service", "client", "integrations"):
        if module == f"ppo_logprobs.{top}" or module.startswith(f"ppo_logprobs.{top}."):
            return top
    return None


def breaches(edges: list[Edge]) -> list[Edge]:
    """The edges that import a higher layer, and the client's imports of anything but the contract and itself (but
    for the pool, lazily)."""
    bad = []
    for e in edges:
        source, target = layer(e.source), layer(e.target)
        client_ok = target in CLIENT_MAY_IMPORT or (e.lazy and target == "pool")
        if ORDER.index(target) > ORDER.index(source) or (source == "client" and not client_ok):
            bad.append(e)
    return bad


@functools.cache
def package_imports() -> tuple[Edge, ...]:
    return tuple(imports(ROOT))


def graph_of(edges) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
    return graph


DEEP = """import ppo_logprobs.workers.errors as e
from . import other


def f():
    from ppo_logprobs.service import app
"""


def test_the_reader_resolves_imports_and_finds_cycles_and_breaches(tmp_path):
    """A made-up package: relative imports from a package and from a module, a `from` of a module and of a name,
    lazy imports in a function and a method, imports of other packages left out; a cycle and two breaches."""
    files = {
        "workers/__init__.py": "from .models import thing\n",
        "workers/errors.py": "import os\nfrom typing import Any\n",
        "workers/models/__init__.py": "from .. import errors\nfrom ..errors import E, F\n",
        "workers/models/deep.py": DEEP,
        "workers/models/other.py": "from .deep import g\n",
        "service/__init__.py": "",
        "service/app.py": "class C:\n    def m(self):\n        import ppo_logprobs.client\n",
        "client/__init__.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    edges = imports(tmp_path)
    models, errors = f"{W}.models", f"{W}.errors"
    assert {(e.source, e.target, e.where, e.lazy) for e in edges} == {
        (W, models, "workers/__init__.py:1", False),
        (models, errors, "workers/models/__init__.py:1", False),
        (models, errors, "workers/models/__init__.py:2", False),
        (f"{models}.deep", errors, "workers/models/deep.py:1", False),
        (f"{models}.deep", f"{models}.other", "workers/models/deep.py:2", False),
        (f"{models}.deep", "ppo_logprobs.service.app", "workers/models/deep.py:6", True),
        (f"{models}.other", f"{models}.deep", "workers/models/other.py:1", False),
        ("ppo_logprobs.service.app", "ppo_logprobs.client", "service/app.py:3", True),
    }
    assert cycles(graph_of(edges)) == [[f"{models}.deep", f"{models}.other"]]
    assert [e.where for e in breaches(edges)] == ["workers/models/deep.py:6", "service/app.py:3"]


def test_every_module_has_a_layer_and_every_import_a_module():
    known = modules(ROOT)
    assert [m for m in known if layer(m) is None] == [], "add these modules to a layer (tests/test_layers.py)"
    assert [str(e) for e in package_imports() if e.target not in known] == []
    assert len(package_imports()) > 50  # the reader found the package's imports


def test_no_import_cycles():
    edges = package_imports()
    found = cycles(graph_of(edges))
    report = []
    for cycle in found:
        inside = [str(e) for e in edges if e.source in cycle and e.target in cycle]
        report.append(" -> ".join([*cycle, cycle[0]]) + "\n    " + "\n    ".join(inside))
    assert not found, "import cycles:\n" + "\n".join(report)


def test_layers_import_only_downward():
    bad = [e for e in breaches(list(package_imports()))]
    assert not bad, f"imports of a higher layer ({' < '.join(ORDER)}; the client only the contract):\n" + "\n".join(
        map(str, bad)
    )


def test_a_process_holding_only_a_pools_handles_loads_no_torch():
    """What an ingress replica, a pool's owner and the pool's scoring tasks import (the gateway's app, the pool's
    handle class, the client) loads neither torch nor transformers: each such process starts in a fraction of the
    time, and a worker process Ray reuses for one of them stays light. test_gateway checks it of live replicas."""
    import subprocess
    import sys

    code = ("import sys, ppo_logprobs.service.app, ppo_logprobs.workers.pool.worker_pool, ppo_logprobs.client; "
            "from ppo_logprobs.workers import SequenceScores; "  # (a trainer's type hints: the contract's class)
            "print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

"""Every Triton kernel launch in the package says `enable_fp_fusion` (whether `a * b + c` may become one FMA), read
from the source with `ast`: Triton 3.9 warns where it is left out and 3.10 turns its default off, which would change
the kernels' bits and speed from what was measured (docs/contributing.md)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def launches(root: Path) -> list[tuple[str, bool]]:
    """(path:line, says enable_fp_fusion) for each `<name>kernel[grid](...)` call under workers/."""
    found = []
    for path in sorted((root / "workers").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id.endswith("kernel")):
                found.append((f"{path.relative_to(root)}:{node.lineno}",
                              any(k.arg == "enable_fp_fusion" for k in node.keywords)))
    return found


def test_the_reader_finds_launches_with_and_without_the_option(tmp_path):
    (tmp_path / "workers").mkdir()
    (tmp_path / "workers" / "k.py").write_text(
        "def f(x):\n    _a_kernel[(1,)](x, BLOCK=4)\n    _b_kernel[grid](x, enable_fp_fusion=False)\n    other[0](x)\n")
    assert launches(tmp_path) == [("workers/k.py:2", False), ("workers/k.py:3", True)]


def test_every_launch_says_whether_it_fuses_multiply_adds():
    found = launches(ROOT)
    assert len(found) > 15  # (the reader found the package's launches)
    assert [where for where, says in found if not says] == []

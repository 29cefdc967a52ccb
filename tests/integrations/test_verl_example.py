"""examples/verl_reference.py as users run it (`make test-integrations`): verl's RefPolicy role built as its trainer
builds it, scoring through the service, gives verl's own reference numbers."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("verl")

EXAMPLE = Path(__file__).parents[2] / "examples" / "verl_reference.py"


def test_the_reference_role_gives_verls_numbers():
    spec = importlib.util.spec_from_file_location("verl_reference", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--steps", "2"])
    assert result["max_abs_difference"] <= 1e-5
    assert result["verl_reference_gib"] > 0

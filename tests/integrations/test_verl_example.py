"""examples/verl_reference.py as users run it (`make test-integrations`): verl's RefPolicy role built as its trainer
builds it, scoring through the service, gives verl's own reference numbers."""

import pytest

from ..helpers import example

pytest.importorskip("verl")


def test_the_reference_role_gives_verls_numbers(recwarn):
    result = example("verl_reference").main(["--steps", "2"])
    assert result["max_abs_difference"] <= 1e-5
    assert result["verl_reference_gib"] > 0
    # (the arrays back from the role's rank 0 come through Ray's object store, read-only: torch warned on each run)
    assert not [str(w.message) for w in recwarn if "not writable" in str(w.message)]

"""examples/grpo_trl.py run as users run it, on the tiny model (CPU): the same GRPO steps with TRL's own reference
model and with the service's, the same losses, no reference weights on the trainer with the service, and the
adapter's answer the pool's own."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("trl")

EXAMPLE = Path(__file__).parents[2] / "examples" / "grpo_trl.py"


def test_the_service_as_reference_gives_trls_losses_with_no_reference_on_the_trainer():
    spec = importlib.util.spec_from_file_location("grpo_trl", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--steps", "2", "--repeats", "1"])
    own, served = result["reference_on_trainer"], result["reference_from_service"]
    assert len(own["loss"]) == len(served["loss"]) == 2
    assert served["loss"] == pytest.approx(own["loss"], abs=1e-5)
    assert own["reference_on_trainer_gib"] > 0 and served["reference_on_trainer_gib"] == 0
    assert result["adapter"]["bitwise_equal"]

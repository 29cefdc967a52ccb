"""examples/grpo_trl.py run as users run it, on the tiny model (CPU): the same GRPO steps with TRL's own reference
model and with the service's, the same losses, no reference weights on the trainer with the service, and the
adapter's answer the pool's own."""

import pytest

from ..helpers import example

pytest.importorskip("trl")


def test_the_service_as_reference_gives_trls_losses_with_no_reference_on_the_trainer():
    result = example("grpo_trl").main(["--steps", "2", "--repeats", "1"])
    own, served = result["reference_on_trainer"], result["reference_from_service"]
    assert len(own["loss"]) == len(served["loss"]) == 2
    assert served["loss"] == pytest.approx(own["loss"], abs=1e-5)
    assert own["reference_on_trainer_gib"] > 0 and served["reference_on_trainer_gib"] == 0
    assert result["adapter"]["bitwise_equal"]

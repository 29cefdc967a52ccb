"""examples/ppo_loop.py run as users run it, on the tiny model (CPU): a real PPO loop whose old-policy
log-probs come from the service and whose new ones from the trainer's forward with gradients."""

import pytest

from ..helpers import example


@pytest.mark.parametrize("http", [False, True], ids=["pool", "http"])
def test_the_first_ratio_of_every_step_is_exactly_one_and_training_moves(http):
    result = example("ppo_loop").main(["--steps", "2", *(["--http"] if http else [])])
    steps = result["steps"]
    assert [s["version"] for s in steps] == [1, 2]  # each step's weights reached the pool (and were scored next)
    for s in steps:
        first, later = s["minibatches"][0], s["minibatches"][1:]
        assert first == {"max_abs_ratio_minus_1": 0.0, "share_not_1": 0.0}, s  # new == old, bitwise
        assert later and all(m["max_abs_ratio_minus_1"] > 0 for m in later), s  # the optimizer moved the policy
    assert result["parameters_changed"] > 0

"""service/schemas.py's value types, in every request body: every boolean takes only true or false, and every float
field refuses an integer beyond a float64's range (which float() would raise on) while it takes any float64. A
field added to a body is found here by its type, and must be listed to pass."""

import typing

import pytest
from pydantic import BaseModel, ValidationError

from ppo_logprobs.service.completions import CompletionRequest
from ppo_logprobs.service.schemas import LogProbsRequest, ReloadRequest

REQUIRED = {LogProbsRequest: {"input_ids": [[1, 2]]}, ReloadRequest: {"path": "/ckpt"},
            CompletionRequest: {"prompt": [1, 2]}}
# float fields taking one value (or a list of them); rollout_log_probs (a list per sequence) is checked in
# workers/request.py's rollout_values, in numpy (tests/workers/test_request.py)
FLOATS = {LogProbsRequest: ["temperature"], ReloadRequest: [], CompletionRequest: ["temperature", "top_p"]}


def fields_of(model: type[BaseModel], kind: type) -> list[str]:
    def uses(annotation) -> bool:
        return annotation is kind or any(uses(a) for a in typing.get_args(annotation))

    return [name for name, field in model.model_fields.items() if uses(field.annotation)]


@pytest.mark.parametrize("model", list(REQUIRED))
def test_every_boolean_of_a_request_takes_only_true_or_false(model):
    flags = fields_of(model, bool)
    assert flags, model  # (each body has one)
    for name in flags:
        for value in ("yes", "true", 1, 0, "1", None):
            with pytest.raises(ValidationError, match=name):
                model.model_validate({**REQUIRED[model], name: value})
        assert getattr(model.model_validate({**REQUIRED[model], name: True}), name) is True


@pytest.mark.parametrize("model", list(REQUIRED))
def test_every_float_field_refuses_integers_beyond_a_float64(model):
    assert [n for n in fields_of(model, float) if n != "rollout_log_probs"] == FLOATS[model]
    for name in FLOATS[model]:
        for value in (2**1024, -(2**1100), 10**400):
            with pytest.raises(ValidationError, match="is beyond the range of a float64"):
                model.model_validate({**REQUIRED[model], name: value})
        for value in (2**1024 - 1, 1e308, -5, 0.5):
            assert getattr(model.model_validate({**REQUIRED[model], name: value}), name) == value

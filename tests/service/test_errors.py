"""Every error type says what it is (the caller's fault, transient, or the service's) and to_response answers by
that alone: no list of types to keep in step with the errors modules."""

import json

import pytest
from ray.exceptions import ActorDiedError

from ppo_logprobs.service.errors import (
    NonFiniteResults,
    Overloaded,
    WorkersTimedOut,
    as_http_exception,
    to_response,
)
from ppo_logprobs.workers import errors


def leaves(kind: type) -> list[type]:
    found = [kind]
    for sub in kind.__subclasses__():
        found += leaves(sub)
    return found


def answer(exc: BaseException) -> tuple[int, str, dict]:
    response = to_response(exc)
    return response.status_code, json.loads(response.body)["detail"], dict(response.headers)


@pytest.mark.parametrize("kind", [k for k in leaves(errors.ServiceError) if k is not Overloaded],
                         ids=lambda k: k.__name__)
def test_each_error_type_answers_its_own_status(kind):
    status, detail, headers = answer(kind("what was wrong, in one line"))
    assert status == kind.status
    if kind.status < 500:  # the caller's fault: its message
        assert detail == "what was wrong, in one line" and not kind.transient
    elif kind.transient:  # retry: the reason and when
        assert status == 503 and detail.startswith("temporarily unavailable: what was wrong") and \
            headers["retry-after"] == "1"
    else:  # the service's fault: an id to find it in the log, nothing else
        assert status == 500 and detail.startswith("internal error ") and "what was wrong" not in detail


def test_the_nature_of_the_errors_the_service_raises():
    assert [(k.status, k.transient) for k in (errors.TooLarge, errors.RequestError, errors.CheckpointNotFound,
                                               errors.InvalidCheckpoint, errors.IncompatibleWeights,
                                               errors.NonFiniteWeights)] == \
        [(413, False), (422, False), (404, False), (422, False), (409, False), (409, False)]
    assert all(k.transient and k.status == 503 for k in (errors.UpdateFailed, errors.WeightsUnavailable,
                                                         errors.WorkerLost, errors.WeightsChanged, WorkersTimedOut))
    assert not NonFiniteResults.transient and NonFiniteResults.status == 500
    status, detail, headers = answer(Overloaded(retry_after=2.0))
    assert (status, headers["retry-after"]) == (429, "2") and "overloaded" in detail
    status, detail, _ = answer(ActorDiedError())  # Ray's word for a worker being restarted
    assert status == 503 and detail == "temporarily unavailable: a worker is restarting; retry"
    status, detail, _ = answer(KeyError("a bug"))
    assert status == 500 and "a bug" not in detail


def test_an_error_raised_as_an_http_exception_gets_the_same_answer():
    """What a dependency raises reaches the client through the app's HTTPException handler (to_response): the same
    status, message and headers as the error answered directly; an unexpected one is logged once, under the id the
    answer names."""
    from fastapi import HTTPException

    from ppo_logprobs.service.schemas import LogProbsRequest

    try:
        LogProbsRequest.model_validate_json(b'{"input_ids": "no"}')
    except Exception as e:
        invalid = e
    late = HTTPException(408, "too slow", headers={"Connection": "close"})
    assert as_http_exception(late) is late
    for exc in (errors.TooLarge("too long"), invalid, Overloaded(retry_after=3.0), errors.WorkerLost("gone"),
                ActorDiedError()):
        assert answer(as_http_exception(exc)) == answer(exc), exc
    status, detail, _ = answer(as_http_exception(KeyError("a bug")))
    assert status == 500 and detail.startswith("internal error ") and "a bug" not in detail

"""Every failure to one HTTP answer, in one place (`to_response`): the request's fault is a 4xx with a one-line
message naming what is wrong; a transient state of the service is a 503 (or 429) with Retry-After; anything else
is a 500 with an error id that is also in the gateway's log. No answer carries a traceback, an ANSI code, a process
id or a server path beyond what the request itself named."""

from __future__ import annotations

import logging
import re
import uuid

from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray.exceptions import ActorUnavailableError, RayActorError
from starlette.exceptions import HTTPException as AnyHTTPException  # (FastAPI's and the router's own 404 and 405)

from ppo_logprobs.workers.errors import Overloaded, ServiceError, Transient, cause, clip

log = logging.getLogger("ppo_logprobs.service")

_RAY_TRANSIENT = (RayActorError, ActorUnavailableError)  # a worker restarting, as Ray says it
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class NonFiniteResults(ServiceError, RuntimeError):
    """The model produced NaN or infinite values (broken weights?); never sent to a client."""


class WorkersTimedOut(Transient, RuntimeError):
    """A worker call outlived request_timeout_s."""


def one_line(text: str, limit: int = 300) -> str:
    return clip(" ".join(_ANSI.sub("", text).split()), limit)


def _validation_detail(errors: list[dict]) -> str:
    # where a value fails one of our own checks (a float64's range), that is the error; the union members it was
    # also tried as only repeat it
    errors = [e for e in errors if e["type"] == "value_error"] or errors
    # the same error at several positions (a flat list where sequences were asked for) is said once, with a count
    alike: dict[tuple, list[dict]] = {}
    for err in errors:
        loc = [x for x in err["loc"] if x != "body" and not _union_tag(x)]
        err = dict(err, where="".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip("."))
        # (alike: the same error at the same field, tried as the same member of a union, but at other indices)
        kind = (err["type"], err["msg"], tuple(x for x in err["loc"] if not isinstance(x, int)))
        alike.setdefault(kind, []).append(err)
    parts = []
    for err, *more in list(alike.values())[:5]:
        if err["type"] == "json_invalid":
            parts.append(f"the body is not valid JSON ({err.get('ctx', {}).get('error', 'decode error')})")
            continue
        value = f" (got {err['input']!r:.60})" if "input" in err and err["type"] != "missing" else ""
        also = f", and {len(more)} more like it" if more else ""
        hint = _HINTS.get((err["type"], err["where"].split("[")[0], err["where"].count("[")), "")
        parts.append(f"{err['where'] or 'body'}: {err['msg'].removeprefix('Value error, ')}{value}{also}{hint}")
    return "; ".join(dict.fromkeys(parts))


# (type, field, depth): what the field is, where the mistake is one of shape (one sequence sent flat)
_HINTS = {("list_type", "input_ids", 1): " (input_ids is a list of sequences, each a list of token ids)"}


def _union_tag(x) -> bool:
    """Whether a location item names a member of a union pydantic tried ('float', 'list[int]', ...), not a field."""
    return isinstance(x, str) and ("[" in x or x in ("float", "int", "str", "bool", "none"))


_KINDS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error",
          503: "service_unavailable_error"}


def error_body(detail: str, status: int) -> dict:
    """An error answer's body: `detail` (FastAPI's key, which our clients read) and the same message in OpenAI's
    `error` object, which the `openai` package and OpenAI-style clients read (`message`, `type`, `code`)."""
    kind = _KINDS.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"detail": detail, "error": {"message": detail, "type": kind, "code": status}}


def _answer(detail: str, status: int, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(detail, status), status_code=status, headers=headers)


def _answer_of(exc: BaseException) -> tuple[str, int, dict | None]:
    """(detail, status, headers) of the answer to `exc`; an unexpected error is logged under the id it names."""
    exc = cause(exc)
    if isinstance(exc, AnyHTTPException):
        return exc.detail, exc.status_code, exc.headers
    if isinstance(exc, (RequestValidationError, ValidationError)):
        return one_line(_validation_detail(exc.errors()), 1000), 422, None
    if isinstance(exc, Overloaded):
        return str(exc), exc.status, {"Retry-After": f"{exc.retry_after:.0f}"}
    if isinstance(exc, ServiceError) and exc.status < 500:  # the caller's fault (the type says so)
        return one_line(str(exc)), exc.status, None
    if (isinstance(exc, ServiceError) and exc.transient) or isinstance(exc, _RAY_TRANSIENT):
        reason = one_line(str(exc), 200) if not isinstance(exc, _RAY_TRANSIENT) else "a worker is restarting"
        return f"temporarily unavailable: {reason}; retry", 503, {"Retry-After": "1"}
    error_id = uuid.uuid4().hex[:12]
    log.error("error %s: %s", error_id, type(exc).__name__, exc_info=exc)
    return f"internal error {error_id} (in the gateway's log)", 500, None


def to_response(exc: BaseException) -> JSONResponse:
    return _answer(*_answer_of(exc))


def as_http_exception(exc: BaseException) -> HTTPException:
    """`exc` as an HTTPException of the same answer, for code whose errors FastAPI handles rather than a route (a
    dependency): the app answers an HTTPException with to_response, so the client gets what the route would give."""
    if isinstance(exc, HTTPException):
        return exc
    detail, status, headers = _answer_of(exc)
    return HTTPException(status, detail, headers=headers)

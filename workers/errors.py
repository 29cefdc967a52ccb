"""Typed errors of the workers, so that every caller (the pool, the gateway, a trainer) can tell whose fault a
failure is: the request's (bad weights, bad input), or a transient state of the service."""

from __future__ import annotations


def clip(text: str, limit: int) -> str:
    """text cut to `limit` characters (user strings echoed in messages)."""
    return text if len(text) <= limit else text[:limit] + "..."


class ServiceError(Exception):
    """Base of the errors raised on purpose. Each type says what it is: `status`, the HTTP answer it maps to (a 4xx
    is the caller's fault, with a message naming what is wrong), and `transient`, whether the same call may succeed
    later (clients retry those; a 503). The others are faults of the service (500)."""

    status = 500
    transient = False


class CallersFault(ServiceError):
    status = 400


class Transient(ServiceError):
    status = 503
    transient = True


class RequestError(CallersFault, ValueError):
    """Bad input, before any device work; the message names the field, the sequence and the value."""

    status = 422


class TooLarge(RequestError):
    """A sequence or request over the configured length limits."""

    status = 413


class BadWeights(CallersFault, ValueError):
    """A weight source the pool cannot take; nothing was changed."""

    status = 409


class CheckpointNotFound(BadWeights):
    """No checkpoint directory at the given path (or it cannot be read)."""

    status = 404


class InvalidCheckpoint(BadWeights):
    """The directory is not a usable safetensors checkpoint: no shards, a malformed header, a truncated file."""

    status = 422


class IncompatibleWeights(BadWeights):
    """Names, shapes or dtypes that do not fit the served model (another vocabulary, layer count, hidden size)."""


class NonFiniteWeights(IncompatibleWeights):
    """An update holding NaN or infinite values (a diverged trainer): refused unless the caller allows them."""


def non_finite(name: str) -> NonFiniteWeights:
    return NonFiniteWeights(f"{name!r} holds NaN or infinite values: the update was refused and every worker kept "
                            "its weights (allow_non_finite=True takes such weights)")


class UpdateFailed(Transient, RuntimeError):
    """A weight update did not land (the sender died mid-stream, a worker failed): every worker kept its weights
    and version."""


class NotShared(UpdateFailed):
    """A worker does not hold the tensors a sender on its GPU shared before (it was restarted): the sender shares
    them again."""


class WeightsUnavailable(Transient, RuntimeError):
    """A worker has no weights to serve yet (restarted and not restored)."""


class WorkerLost(Transient, RuntimeError):
    """A worker died more often than a call re-sent its share (Ray restarts it)."""


class Overloaded(Transient):
    """A queue is full (a worker's line, or an ingress replica's); the caller should retry after `retry_after`
    seconds."""

    status = 429

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"overloaded: retry after {retry_after:.0f} s")
        self.retry_after = retry_after

    def __reduce__(self):  # (raised in a worker, it crosses Ray with its own argument, not its message)
        return type(self), (self.retry_after,)


class WeightsChanged(Transient, RuntimeError):
    """The weights changed under a call more often than it re-asked."""


class OutOfMemoryInForward(ServiceError, RuntimeError):
    """A rank of a tensor-parallel worker ran out of memory inside a forward: the other ranks are left waiting in its
    collectives, so the forward cannot be split where it failed; the leader runs the call again in a new group,
    every rank then splitting forwards of that size up front (RankGroup._agree_room)."""


def cause(error: BaseException) -> BaseException:
    """The exception a remote call raised, without Ray's wrapping (typed errors keep their type and message)."""
    from ray.exceptions import RayTaskError

    while isinstance(error, RayTaskError) and error.cause is not None:
        error = error.cause
    return error


def get(ref, timeout: float | None = None):
    """ray.get that raises what the remote call raised (see `cause`)."""
    import ray

    try:
        return ray.get(ref, timeout=timeout)
    except Exception as e:
        raise cause(e) from None

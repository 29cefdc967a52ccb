"""Typed errors of the workers, so that every caller (the pool, the gateway, a trainer) can tell whose fault a
failure is: the request's (bad weights, bad input), or a transient state of the service."""

from __future__ import annotations


class BadWeights(ValueError):
    """A weight source the pool cannot take; nothing was changed."""


class CheckpointNotFound(BadWeights):
    """No checkpoint directory at the given path (or it cannot be read)."""


class InvalidCheckpoint(BadWeights):
    """The directory is not a usable safetensors checkpoint: no shards, a malformed header, a truncated file."""


class IncompatibleWeights(BadWeights):
    """Names, shapes or dtypes that do not fit the served model (another vocabulary, layer count, hidden size)."""


class UpdateFailed(RuntimeError):
    """A weight update did not land (the sender died mid-stream, a worker failed): every worker kept its weights
    and version."""


class WeightsUnavailable(RuntimeError):
    """A worker has no weights to serve yet (restarted and not restored); transient."""

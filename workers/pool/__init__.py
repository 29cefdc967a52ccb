"""LogProbWorker (one model on one device) and WorkerPool (Ray actors holding them).

Attributes load lazily, so that a process holding only a pool's handles (a gateway's ingress) imports no torch."""

from importlib import import_module

_WHERE = {"LogProbWorker": ".log_prob_worker", "SequenceScores": "..request"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_WHERE[name], __name__), name)

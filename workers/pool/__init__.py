"""LogProbWorker (one model on one device) and WorkerPool (Ray actors holding them)."""

from .log_prob_worker import LogProbWorker, SequenceScores

__all__ = ["LogProbWorker", "SequenceScores"]

"""Clients of ppo-logprobs: HTTP (sync and async) for rollout workers, connect_pool for trainers, the CLI."""

from .log_prob_client import AsyncLogProbClient, LogProbClient, LogProbError, SequenceLogProbs, connect_pool

__all__ = ["AsyncLogProbClient", "LogProbClient", "LogProbError", "SequenceLogProbs", "connect_pool"]

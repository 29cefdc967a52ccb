"""Request and response bodies of the HTTP API. Imports pydantic only, so clients can reuse them."""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, create_model

from ppo_logprobs.workers.outputs import OUTPUTS, Output
from ppo_logprobs.workers.wire import ModelInfo


def _float64(value: float | int) -> float | int:
    if isinstance(value, int) and not -(2**1024) < value < 2**1024:
        raise ValueError("is beyond the range of a float64")
    return value


# The value types of every request body: a JSON number that a float64 holds (an integer as large as 2**1100 is
# refused, not an OverflowError later), and true or false only ("yes", 1 and "true" are refused).
Float = Annotated[StrictFloat | StrictInt, AfterValidator(_float64)]
Flag = StrictBool


class LogProbsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="a served model's name; default: the first one")
    input_ids: list[list[StrictInt]] = Field(..., min_length=1, description="token ids, one list per sequence")
    score_from: StrictInt | list[StrictInt] = Field(
        1, description="first scored position: entry k of a result is log p(seq[s + k] | seq[:s + k])"
    )
    temperature: Float | list[Float] = Field(
        1.0, description="divides the logits; one value or one per sequence, each in [0.01, 100]"
    )
    return_entropy: Flag = True
    top_k: StrictInt = Field(0, description="also each entry's k most likely tokens (log-probs, ids) and the "
                             "log-probability of all the others (the tail); at most the service's max_top_k")
    token_ids: list[StrictInt] | list[list[StrictInt]] | None = Field(
        None, description="candidate ids whose log-probs each entry gives: one list for every sequence, or one per "
        "sequence (yes/no judges, constrained choices)")
    rollout_log_probs: list[list[StrictFloat | StrictInt]] | None = Field(
        None, description="the rollout engine's log-probs of the scored tokens, one list per sequence (its entries); "
        "each result then says how far they are from ours (mismatch)")


class _SequenceResult(BaseModel):
    log_probs: list[float]
    entropy: list[float] | None = None
    mismatch: dict[str, float] | None = Field(
        None, description="given rollout_log_probs: mean_abs and max_abs of ours - rollout, kl_k3 (the k3 estimate of "
        "KL(rollout || ours)) and outside (the share of tokens whose ratio exp(ours - rollout) lies outside the "
        "service's ratio_bounds)")


def _output_field(output: Output) -> tuple:
    """A per-token output's field in a result (workers/outputs.py): a list per entry where it is wide."""
    value = int if np.dtype(output.dtype).kind in "iu" else float
    value = value | None if output.null is not None else value
    return (list[list[value]] if output.wide else list[value]) | None, Field(None, description=output.description)


def sequence_result() -> type[BaseModel]:
    """A result's model, made from the per-token outputs' table."""
    return create_model("SequenceResult", __base__=_SequenceResult,
                        **{name: _output_field(output) for name, output in OUTPUTS.items()})


SequenceResult = sequence_result()


class Usage(BaseModel):
    sequences: int
    tokens: int
    scored_tokens: int
    computed_tokens: int  # tokens the forwards computed for these sequences: fewer than `tokens` where they share a
    # prefix (a piece shared by k sequences counts 1/k to each, so joined requests split it between them)


class LogProbsResponse(BaseModel):
    model: str
    weights_version: int
    results: list[SequenceResult]
    usage: Usage


class ModelList(BaseModel):
    """OpenAI's list shape."""

    object: Literal["list"] = "list"
    data: list[ModelInfo]


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body (text prompts; chat messages are not taken)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    add_special_tokens: Flag = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(..., min_length=1, max_length=4096, description="a checkpoint directory readable by the workers")
    allow_non_finite: Flag = Field(False, description="take weights holding NaN or infinite values (refused with 409 "
                                   "otherwise)")


class ErrorResponse(BaseModel):
    detail: str

"""Request and response bodies of the HTTP API. Imports pydantic only, so clients can reuse them."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from ppo_logprobs.workers.wire import ModelInfo


class LogProbsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="a served model's name; default: the first one")
    input_ids: list[list[StrictInt]] = Field(..., min_length=1, description="token ids, one list per sequence")
    score_from: StrictInt | list[StrictInt] = Field(
        1, description="first scored position: entry k of a result is log p(seq[s + k] | seq[:s + k])"
    )
    temperature: StrictFloat | StrictInt | list[StrictFloat | StrictInt] = Field(
        1.0, description="divides the logits; one value or one per sequence, each in [0.01, 100]"
    )
    return_entropy: StrictBool = True


class SequenceResult(BaseModel):
    log_probs: list[float]
    entropy: list[float] | None = None


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
    models: list[ModelInfo]


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(..., min_length=1, max_length=4096, description="a checkpoint directory readable by the workers")
    allow_non_finite: bool = Field(False, description="take weights holding NaN or infinite values (refused with 409 "
                                   "otherwise)")


class ErrorResponse(BaseModel):
    detail: str

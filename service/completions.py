"""`POST /v1/completions` for scoring, in the shape OpenAI's and vLLM's completions clients read: prompts as token ids
(or text, with a tokenizer), `echo` with `logprobs: k` (OpenAI's tokens / token_logprobs / top_logprobs /
text_offset), vLLM's `prompt_logprobs: k` ({token id: {logprob, rank, decoded_token}} per prompt token), and
`max_tokens` 0 or 1. One generated token is the most likely next token (greedy), from the same pass; longer
generation is refused, saying so. The scores come through the same hand-over and workers as /logprobs."""

from __future__ import annotations

import time
import uuid

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from ppo_logprobs.workers.errors import RequestError, TooLarge
from ppo_logprobs.workers.request import ScoreResult

from .schemas import Flag, Float


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # (clients send fields that do not change scoring: user, stop, ...)

    model: str | None = None
    prompt: list[StrictInt] | list[list[StrictInt]] | str | list[str]
    echo: Flag = False
    logprobs: StrictInt | None = Field(None, ge=0)
    prompt_logprobs: StrictInt | None = Field(None, ge=0)
    temperature: Float | None = None
    max_tokens: StrictInt | None = 16
    n: StrictInt = 1
    stream: Flag = False
    return_token_ids: Flag = False
    top_p: Float | None = None


class Refused(RequestError):
    """What the endpoint cannot do (generation beyond one token, streaming, text without a tokenizer): a 400."""

    status = 400


def prompts_of(body: CompletionRequest, tokenizer) -> list[list[int]]:
    """The prompts as token id lists; Refused for what this endpoint does not do."""
    if body.stream:
        raise Refused("stream: this endpoint scores, and answers whole; send stream false")
    if body.n != 1:
        raise Refused(f"n = {body.n}: this endpoint gives one choice per prompt")
    if body.max_tokens not in (0, 1):
        raise Refused(f"max_tokens = {body.max_tokens}: this service scores prompts and generates at most one token "
                      "(max_tokens 0 or 1); use an inference server for longer generation")
    if body.max_tokens == 1 and body.top_p not in (None, 1, 1.0):
        raise Refused("top_p: the one generated token is the most likely one (greedy); leave top_p unset")
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
        if tokenizer is None:
            raise Refused("prompt as text needs a tokenizer (the service's --tokenizer); send token ids instead")
        texts = [prompt] if isinstance(prompt, str) else prompt
        return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    if not prompt:
        raise RequestError("prompt must hold at least one token id")
    return [prompt] if isinstance(prompt[0], int) else prompt  # type: ignore[list-item]


def scoring_inputs(prompts: list[list[int]], body: CompletionRequest, *, vocab_size: int, max_length: int,
                   max_top_k: int) -> tuple[list[list[int]], float, int]:
    """(sequences, temperature, top_k) to score: with max_tokens 1, each prompt gets a placeholder token so that its
    last position, which predicts the next token, is scored too. Temperature 0 (greedy) scores at 1. A refusal
    names what the client sent (`prompt`, `logprobs`, `prompt_logprobs`), not the scoring request made of it."""
    extra = body.max_tokens or 0
    single = isinstance(body.prompt, list) and bool(body.prompt) and isinstance(body.prompt[0], int)
    for i, p in enumerate(prompts):
        where = "prompt" if single else f"prompt[{i}]"
        if len(p) + extra < 2:
            raise RequestError(f"{where} has {len(p)} token{'s' * (len(p) != 1)}; scoring needs at least 2 "
                               "(or max_tokens 1)")
        if len(p) + extra > max_length:
            raise TooLarge(f"{where} has {len(p)} tokens; this model takes at most {max_length - extra}"
                           + (" with max_tokens 1" if extra else ""))
        if p and (min(p) < 0 or max(p) >= vocab_size):  # (min and max in C; the Python scan only to name it)
            j = next(j for j, x in enumerate(p) if not 0 <= x < vocab_size)
            raise RequestError(f"{where}[{j}] = {p[j]} is outside the vocabulary [0, {vocab_size})")
    for field in ("logprobs", "prompt_logprobs"):
        if (asked := getattr(body, field)) is not None and asked > max_top_k:
            raise RequestError(f"{field} = {asked}: this service gives at most {max_top_k} (its max_top_k)")
    seqs = [list(p) + [0] * extra for p in prompts]
    temperature = 1.0 if not body.temperature else float(body.temperature)
    k = max(body.logprobs or 0, body.prompt_logprobs or 0, 1 if body.max_tokens else 0)
    return seqs, temperature, k


def _text(tokenizer, ids: list[int]) -> list[str]:
    if tokenizer is None:
        return [str(i) for i in ids]
    return [tokenizer.decode([i]) for i in ids]


def _top(seq, row: int, k: int) -> tuple[list[int], list[float]]:
    """The k most likely tokens of an entry (ids, log-probs); none for k = 0."""
    if not k:
        return [], []
    return seq.top_ids[row, :k].tolist(), [float(x) for x in seq.top_log_probs[row, :k]]


def answer(name: str, prompts: list[list[int]], body: CompletionRequest, result: ScoreResult, tokenizer) -> dict:
    """The completions object of these prompts' scores (from scoring_inputs' sequences, in order)."""
    choices, generated_total = [], 0
    for i, seq in enumerate(result.sequences()):
        prompt = prompts[i]
        n = len(prompt) - 1  # entries scoring prompt tokens 1..
        choice: dict = {"index": i, "finish_reason": "length"}
        new_ids: list[int] = []
        if body.max_tokens:
            new_ids = [int(seq.top_ids[n, 0])]
            generated_total += 1
        tokens_ids = (prompt if body.echo else []) + new_ids
        strings = _text(tokenizer, tokens_ids)
        choice["text"] = "".join(strings) if tokenizer is not None else " ".join(strings)
        if body.logprobs is not None:
            values: list[float | None] = []
            tops: list[dict | None] = []
            k = body.logprobs
            rows = ([None] + list(range(n)) if body.echo else []) + ([n] if body.max_tokens else [])
            for row in rows:
                if row is None:
                    values.append(None)
                    tops.append(None)
                    continue
                is_new = body.max_tokens and row == n
                values.append(float(seq.top_log_probs[row, 0] if is_new else seq.log_probs[row]))
                ids, lps = _top(seq, row, k)
                tops.append(dict(zip(_text(tokenizer, ids), lps, strict=True)))
            sep = 0 if tokenizer is not None else 1
            offsets = np.concatenate([[0], np.cumsum([len(s) + sep for s in strings])[:-1]]).astype(int).tolist()
            choice["logprobs"] = {"tokens": strings, "token_logprobs": values, "top_logprobs": tops,
                                  "text_offset": offsets if strings else []}
        else:
            choice["logprobs"] = None
        if body.prompt_logprobs is not None:
            k = body.prompt_logprobs
            listed: list[dict | None] = [None]
            for row in range(n):
                ids, lps = _top(seq, row, k)
                entry = {str(t): {"logprob": lp, "rank": r + 1, "decoded_token": s}
                         for r, (t, lp, s) in enumerate(zip(ids, lps, _text(tokenizer, ids), strict=True))}
                actual = prompt[row + 1]
                if str(actual) not in entry:  # (its rank is past the top k: not computed)
                    entry[str(actual)] = {"logprob": float(seq.log_probs[row]), "rank": None,
                                          "decoded_token": _text(tokenizer, [actual])[0]}
                listed.append(entry)
            choice["prompt_logprobs"] = listed
        if body.return_token_ids:
            choice["prompt_token_ids"] = list(prompt)
            choice["token_ids"] = new_ids
        choices.append(choice)
    prompt_tokens = sum(map(len, prompts))
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": name,
            "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": generated_total,
                                          "total_tokens": prompt_tokens + generated_total}}

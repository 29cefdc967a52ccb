"""/v1/completions' own logic, without the gateway: CompletionRequest's validation, prompts_of (token ids, a batch,
text through a tokenizer, and what it refuses), scoring_inputs (a placeholder for the generated token, the widest
top-k, temperature) and answer (OpenAI's tokens / token_logprobs / top_logprobs / text_offset, vLLM's
prompt_logprobs, the one greedy token). The scores come from a LogProbWorker on the tiny model (as the gateway's
batcher gives them) and are checked against the plain model's float64 log-softmax."""

import time

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from ppo_logprobs.service.completions import CompletionRequest, Refused, answer, prompts_of, scoring_inputs
from ppo_logprobs.workers import LogProbWorker
from ppo_logprobs.workers.errors import RequestError, TooLarge

from ..helpers import TINY_VOCAB


@pytest.fixture(scope="module")
def worker():
    return LogProbWorker("tiny", backend="torch")


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level tokenizer of the tiny model's ids ("t0" .. "t502"), as test_gateway's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(TINY_VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0")


LIMITS = dict(vocab_size=TINY_VOCAB, max_length=512, max_top_k=64)  # (the gateway passes its model's and settings')


def oracle(model, seq, temperature=1.0) -> np.ndarray:
    """The plain (unpatched) model's float64 log-softmax at each position of seq: [len(seq), vocab]."""
    with torch.no_grad():
        logits = type(model).forward(model, input_ids=torch.tensor([seq])).logits[0]
    return (logits.double() / temperature).log_softmax(-1).numpy()


def complete(worker, tokenizer=None, **fields) -> dict:
    """The completions object the route answers for these fields: prompts_of, scoring_inputs, the worker's scores
    of those sequences (as the route builds its ScoreRequest), answer."""
    body = CompletionRequest(**fields)
    prompts = prompts_of(body, tokenizer)
    seqs, temperature, k = scoring_inputs(prompts, body, **LIMITS)
    result = worker.score_request(worker.request(seqs, 1, temperature=temperature, return_entropy=False, top_k=k))
    return answer("policy", prompts, body, result, tokenizer)


def top(row: np.ndarray, k: int) -> tuple[list[int], np.ndarray]:
    ids = np.argsort(-row, kind="stable")[:k]
    return ids.tolist(), row[ids]


PROMPTS = [[5, 17, 300, 42, 7], [11, 402], [250, 3, 3, 99, 480, 1, 64, 2]]


def test_a_prompt_of_token_ids_and_a_batch_of_them_are_both_lists_of_prompts():
    assert prompts_of(CompletionRequest(prompt=[5, 17, 300], max_tokens=0), None) == [[5, 17, 300]]
    assert prompts_of(CompletionRequest(prompt=PROMPTS, max_tokens=1), None) == PROMPTS


def test_text_prompts_are_tokenized_one_by_one_with_a_tokenizer_and_refused_without_one(tokenizer):
    assert prompts_of(CompletionRequest(prompt="t5 t7 t9", max_tokens=0), tokenizer) == [[5, 7, 9]]
    assert prompts_of(CompletionRequest(prompt=["t1 t2", "t3 t4 t502"], max_tokens=0), tokenizer) == [[1, 2],
                                                                                                     [3, 4, 502]]
    for prompt in ("t5 t7 t9", ["t1 t2", "t3"]):
        with pytest.raises(Refused) as refused:
            prompts_of(CompletionRequest(prompt=prompt, max_tokens=0), None)
        assert str(refused.value) == ("prompt as text needs a tokenizer (the service's --tokenizer); send token ids "
                                      "instead")
    assert Refused.status == 400 and issubclass(Refused, RequestError)  # (the caller's fault, mapped as such)


@pytest.mark.parametrize("prompt, loc, value", [
    ([1, "a"], ("prompt", "list[int]", 1), "a"),
    ([1, [2]], ("prompt", "list[int]", 1), [2]),
    ([True, 1], ("prompt", "list[int]", 0), True),
    ([[1, 2.5]], ("prompt", "list[list[int]]", 0, 1), 2.5),
    ([[[1]]], ("prompt", "list[list[int]]", 0, 0), [1]),
    (5, ("prompt", "list[int]"), 5),
], ids=["text-among-ids", "list-among-ids", "bool", "float", "nested-too-deep", "a-number"])
def test_prompts_that_are_neither_token_ids_nor_text_are_refused_naming_the_prompt_and_the_value(prompt, loc, value):
    with pytest.raises(ValidationError) as invalid:
        CompletionRequest(prompt=prompt, max_tokens=0)
    errors = invalid.value.errors()
    assert {e["loc"][0] for e in errors} == {"prompt"}
    assert (loc, value) in [(e["loc"], e["input"]) for e in errors]


def test_fields_are_strict_and_those_that_do_not_change_scoring_are_ignored():
    body = CompletionRequest(prompt=[1, 2], max_tokens=0, user="u", stop=["\n"], best_of=1, presence_penalty=0.5)
    assert body.model_dump(exclude_unset=True) == {"prompt": [1, 2], "max_tokens": 0}
    for field, value, message in (("logprobs", True, "Input should be a valid integer"),
                                  ("logprobs", -1, "Input should be greater than or equal to 0"),
                                  ("prompt_logprobs", -2, "Input should be greater than or equal to 0"),
                                  ("max_tokens", 1.0, "Input should be a valid integer"),
                                  ("echo", 1, "Input should be a valid boolean")):
        with pytest.raises(ValidationError) as invalid:
            CompletionRequest(prompt=[1, 2], **{field: value})
        (error,) = invalid.value.errors()
        assert (error["loc"], error["input"], error["msg"]) == ((field,), value, message)


def test_an_empty_prompt_is_refused():
    with pytest.raises(RequestError, match="^prompt must hold at least one token id$") as refused:
        prompts_of(CompletionRequest(prompt=[], max_tokens=0), None)
    assert not isinstance(refused.value, Refused)  # (bad input, a 422: not something the endpoint cannot do)


def test_a_prompt_too_short_to_score_is_refused_naming_it_and_a_single_token_is_enough_with_max_tokens_1(tokenizer):
    body = CompletionRequest(prompt=[[5, 6], [7]], max_tokens=0)
    with pytest.raises(RequestError) as short:
        scoring_inputs(prompts_of(body, None), body, **LIMITS)
    assert str(short.value) == "prompt[1] has 1 token; scoring needs at least 2 (or max_tokens 1)"
    body = CompletionRequest(prompt=[[5, 6], []], max_tokens=1)
    with pytest.raises(RequestError, match=r"^prompt\[1\] has 0 tokens; scoring needs at least 2 \(or max_tokens 1\)$"):
        scoring_inputs(prompts_of(body, None), body, **LIMITS)
    body = CompletionRequest(prompt=["t5 t6", ""], max_tokens=0)  # (text that makes no tokens)
    with pytest.raises(RequestError, match=r"^prompt\[1\] has 0 tokens"):
        scoring_inputs(prompts_of(body, tokenizer), body, **LIMITS)
    body = CompletionRequest(prompt=[[5, 6], [7]], max_tokens=1)
    assert scoring_inputs(prompts_of(body, None), body, **LIMITS)[0] == [[5, 6, 0], [7, 0]]


def test_token_ids_outside_the_vocabulary_are_refused_naming_the_prompt_entry_and_the_value():
    """The client sent `prompt` (one list of ids, or a batch of them), so that is the field the message names, not
    the scoring request made of it."""
    for prompt, where, value in (([[1, 2], [3, 4, TINY_VOCAB]], "prompt[1][2]", TINY_VOCAB),
                                 ([-1, 2], "prompt[0]", -1)):
        body = CompletionRequest(prompt=prompt, max_tokens=1)
        with pytest.raises(RequestError) as refused:
            scoring_inputs(prompts_of(body, None), body, **LIMITS)
        assert str(refused.value) == f"{where} = {value} is outside the vocabulary [0, {TINY_VOCAB})"


def test_a_prompt_too_long_and_a_top_k_too_wide_are_refused_naming_what_the_client_sent():
    """The placeholder for the generated token is not the client's: the limit it is told leaves room for it."""
    body = CompletionRequest(prompt=[[1, 2], [3] * 512], max_tokens=1)
    with pytest.raises(TooLarge) as long:
        scoring_inputs(prompts_of(body, None), body, **LIMITS)
    assert str(long.value) == "prompt[1] has 512 tokens; this model takes at most 511 with max_tokens 1"
    assert scoring_inputs(prompts_of(body := CompletionRequest(prompt=[3] * 512, max_tokens=0), None), body,
                          **LIMITS)[0] == [[3] * 512]
    for field in ("logprobs", "prompt_logprobs"):
        body = CompletionRequest(prompt=[1, 2], max_tokens=0, **{field: 65})
        with pytest.raises(RequestError) as wide:
            scoring_inputs(prompts_of(body, None), body, **LIMITS)
        assert str(wide.value) == f"{field} = 65: this service gives at most 64 (its max_top_k)"


@pytest.mark.parametrize("max_tokens", [16, 2, None, -1])
def test_generation_beyond_one_token_is_refused_saying_so(max_tokens):
    body = CompletionRequest(prompt=[1, 2]) if max_tokens == 16 else CompletionRequest(prompt=[1, 2],
                                                                                       max_tokens=max_tokens)
    assert body.max_tokens == max_tokens  # (16 is OpenAI's default: a request that says nothing is refused)
    with pytest.raises(Refused) as refused:
        prompts_of(body, None)
    assert str(refused.value) == (f"max_tokens = {max_tokens}: this service scores prompts and generates at most one "
                                  "token (max_tokens 0 or 1); use an inference server for longer generation")


def test_streaming_several_choices_and_sampling_the_generated_token_are_refused():
    for fields, message in (({"stream": True}, "stream: this endpoint scores, and answers whole; send stream false"),
                            ({"n": 2}, "n = 2: this endpoint gives one choice per prompt"),
                            ({"max_tokens": 1, "top_p": 0.9},
                             "top_p: the one generated token is the most likely one (greedy); leave top_p unset")):
        with pytest.raises(Refused) as refused:
            prompts_of(CompletionRequest(prompt=[1, 2], **{"max_tokens": 0, **fields}), None)
        assert str(refused.value) == message
    for fields in ({"max_tokens": 0, "top_p": 0.9}, {"max_tokens": 1, "top_p": 1}, {"max_tokens": 1, "top_p": 1.0}):
        assert prompts_of(CompletionRequest(prompt=[1, 2], **fields), None) == [[1, 2]]  # (nothing sampled)


def test_scoring_inputs_ask_for_the_widest_top_k_and_score_temperature_0_at_1():
    def inputs(**fields):
        body = CompletionRequest(prompt=[[1, 2, 3], [4, 5]], **{"max_tokens": 0, **fields})
        return scoring_inputs(prompts_of(body, None), body, **LIMITS)

    assert inputs() == ([[1, 2, 3], [4, 5]], 1.0, 0)
    assert inputs(max_tokens=1) == ([[1, 2, 3, 0], [4, 5, 0]], 1.0, 1)  # (the greedy token needs the top 1)
    assert inputs(logprobs=3, prompt_logprobs=5)[2] == 5 and inputs(logprobs=4, prompt_logprobs=2)[2] == 4
    assert inputs(logprobs=0, max_tokens=1)[2] == 1 and inputs(prompt_logprobs=0)[2] == 0
    for temperature, scored_at in ((0, 1.0), (0.0, 1.0), (None, 1.0), (0.5, 0.5), (2, 2.0)):
        t = inputs(temperature=temperature)[1]
        assert t == scored_at and type(t) is float


def test_echo_with_logprobs_gives_each_prompt_tokens_log_prob_and_its_top_k_in_openai_shape(worker):
    start = int(time.time())
    body = complete(worker, prompt=PROMPTS, echo=True, logprobs=3, max_tokens=0)
    assert (body["object"], body["model"]) == ("text_completion", "policy")
    assert body["id"].startswith("cmpl-") and len(body["id"]) == 37 and start <= body["created"] <= int(time.time())
    tokens = sum(map(len, PROMPTS))
    assert body["usage"] == {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for choice, prompt in zip(body["choices"], PROMPTS, strict=True):
        want = oracle(worker.model, prompt)
        assert choice["finish_reason"] == "length" and "prompt_logprobs" not in choice and "token_ids" not in choice
        assert choice["text"] == " ".join(map(str, prompt))
        lp = choice["logprobs"]
        assert lp["tokens"] == [str(t) for t in prompt]
        assert all(choice["text"][at : at + len(s)] == s for s, at in zip(lp["tokens"], lp["text_offset"], strict=True))
        assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(str(prompt[0])) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # (the first token has no score)
        np.testing.assert_allclose(lp["token_logprobs"][1:], want[np.arange(len(prompt) - 1), prompt[1:]], rtol=0,
                                   atol=1e-5)
        assert len(lp["top_logprobs"]) == len(prompt)
        for row, given in enumerate(lp["top_logprobs"][1:]):
            ids, values = top(want[row], 3)
            assert list(given) == [str(i) for i in ids]  # most likely first
            np.testing.assert_allclose(list(given.values()), values, rtol=0, atol=1e-5)


def test_the_values_are_the_workers_own_scores_of_the_same_sequences(worker):
    """answer copies the worker's numbers: the same float32 values it gives for these sequences with their top-k."""
    body = complete(worker, prompt=PROMPTS, echo=True, logprobs=2, prompt_logprobs=2, max_tokens=0)
    for choice, own in zip(body["choices"], worker.score(PROMPTS, return_entropy=False, top_k=2), strict=True):
        assert choice["logprobs"]["token_logprobs"][1:] == own.log_probs.tolist()
        assert [list(map(int, t)) for t in choice["logprobs"]["top_logprobs"][1:]] == own.top_ids.tolist()
        assert [list(t.values()) for t in choice["logprobs"]["top_logprobs"][1:]] == own.top_log_probs.tolist()
        assert [[e["logprob"] for e in entry.values() if e["rank"]] for entry in choice["prompt_logprobs"][1:]] == \
            own.top_log_probs.tolist()


def test_logprobs_0_gives_the_chosen_tokens_without_alternatives_and_no_logprobs_gives_none(worker):
    (choice,) = complete(worker, prompt=PROMPTS[0], echo=True, logprobs=0, max_tokens=0)["choices"]
    assert choice["logprobs"]["top_logprobs"] == [None] + [{}] * (len(PROMPTS[0]) - 1)
    assert choice["logprobs"]["token_logprobs"][0] is None and len(choice["logprobs"]["token_logprobs"]) == 5
    (choice,) = complete(worker, prompt=PROMPTS[0], logprobs=3, max_tokens=0)["choices"]  # no echo: nothing to list
    assert choice["text"] == "" and choice["logprobs"] == {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                           "text_offset": []}
    (choice,) = complete(worker, prompt=PROMPTS[0], echo=True, max_tokens=0)["choices"]
    assert choice["logprobs"] is None and choice["text"] == "5 17 300 42 7"


def test_prompt_logprobs_give_each_prompt_token_its_top_k_and_itself_with_its_rank_in_vllm_shape(worker):
    first = oracle(worker.model, [5])[0]
    likely = top(first, 1)[0][0]  # the most likely token after 5: rank 1 in the prompt below
    prompt = [5, likely, 300, 42]
    want = oracle(worker.model, prompt)
    (choice,) = complete(worker, prompt=prompt, prompt_logprobs=2, max_tokens=0)["choices"]
    assert choice["logprobs"] is None and choice["text"] == ""  # (prompt_logprobs does not need echo)
    listed = choice["prompt_logprobs"]
    assert len(listed) == len(prompt) and listed[0] is None
    for row, entry in enumerate(listed[1:]):
        ids, values = top(want[row], 2)
        actual = prompt[row + 1]
        for rank, (i, value) in enumerate(zip(ids, values, strict=True), start=1):
            assert entry[str(i)]["rank"] == rank and entry[str(i)]["decoded_token"] == str(i)
            assert entry[str(i)]["logprob"] == pytest.approx(value, abs=1e-5)
        if actual in ids:
            assert list(entry) == [str(i) for i in ids]
        else:  # past the top k: its log-prob, with no rank (not computed)
            assert list(entry) == [str(i) for i in ids] + [str(actual)]
            assert entry[str(actual)]["rank"] is None and entry[str(actual)]["decoded_token"] == str(actual)
            assert entry[str(actual)]["logprob"] == pytest.approx(want[row, actual], abs=1e-5)
    assert listed[1][str(likely)]["rank"] == 1 and listed[2][str(300)]["rank"] is None


def test_max_tokens_1_generates_the_most_likely_next_token_from_the_same_pass(worker):
    body = complete(worker, prompt=PROMPTS, max_tokens=1, logprobs=2, return_token_ids=True, temperature=0)
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["total_tokens"] == sum(map(len, PROMPTS)) + 3
    for choice, prompt in zip(body["choices"], PROMPTS, strict=True):
        ids, values = top(oracle(worker.model, prompt)[-1], 2)  # the prompt's last position predicts the next token
        assert choice["token_ids"] == [ids[0]] and choice["prompt_token_ids"] == prompt
        assert choice["text"] == str(ids[0]) and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert lp["tokens"] == [str(ids[0])] and lp["text_offset"] == [0]
        np.testing.assert_allclose(lp["token_logprobs"], values[:1], rtol=0, atol=1e-5)
        assert list(lp["top_logprobs"][0]) == [str(i) for i in ids]
    (choice,) = complete(worker, prompt=PROMPTS[1], max_tokens=1, echo=True, logprobs=1)["choices"]
    want = oracle(worker.model, PROMPTS[1])
    new = int(np.argmax(want[-1]))
    assert choice["logprobs"]["tokens"] == ["11", "402", str(new)] and choice["text"] == f"11 402 {new}"
    assert choice["logprobs"]["text_offset"] == [0, 3, 7]
    lps = choice["logprobs"]["token_logprobs"]
    assert lps[0] is None
    np.testing.assert_allclose(lps[1:], [want[0, 402], want[1, new]], rtol=0, atol=1e-5)
    (choice,) = complete(worker, prompt=[9], max_tokens=1, return_token_ids=True)["choices"]  # one token is enough
    assert choice["token_ids"] == [int(np.argmax(oracle(worker.model, [9])[0]))] and choice["logprobs"] is None


def test_temperature_scales_the_scores(worker):
    (hot,) = complete(worker, prompt=PROMPTS[0], echo=True, logprobs=1, max_tokens=0, temperature=0.5)["choices"]
    np.testing.assert_allclose(hot["logprobs"]["token_logprobs"][1:],
                               oracle(worker.model, PROMPTS[0], 0.5)[np.arange(4), PROMPTS[0][1:]], rtol=0, atol=1e-5)
    greedy, plain = (complete(worker, prompt=PROMPTS[0], echo=True, logprobs=1, max_tokens=0, **t)["choices"][0]
                     for t in ({"temperature": 0}, {}))
    assert greedy["logprobs"] == plain["logprobs"]


def test_with_a_tokenizer_tokens_are_decoded_and_offsets_count_characters(worker, tokenizer):
    (choice,) = complete(worker, tokenizer, prompt="t5 t17 t300", max_tokens=1, echo=True, logprobs=2,
                         prompt_logprobs=1, return_token_ids=True)["choices"]
    new = choice["token_ids"][0]
    assert choice["prompt_token_ids"] == [5, 17, 300] and new == int(np.argmax(oracle(worker.model, [5, 17, 300])[-1]))
    lp = choice["logprobs"]
    assert lp["tokens"] == ["t5", "t17", "t300", f"t{new}"] and choice["text"] == f"t5t17t300t{new}"
    assert lp["text_offset"] == [0, 2, 5, 9]
    assert all(key.startswith("t") and int(key[1:]) < TINY_VOCAB for t in lp["top_logprobs"][1:] for key in t)
    assert list(lp["top_logprobs"][-1])[0] == f"t{new}"
    for entry in choice["prompt_logprobs"][1:]:  # keys stay ids; decoded_token is the text
        assert all(e["decoded_token"] == f"t{key}" for key, e in entry.items())

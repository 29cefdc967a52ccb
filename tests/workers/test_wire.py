"""The HTTP result formats (workers/wire.py), alone: JSON text and the binary body read back bitwise, and a
malformed binary body refused."""

import json

import numpy as np
import pytest

from ppo_logprobs.workers.wire import ModelInfo, decode_binary, encode_binary, encode_json


def results(entropy: bool):
    rng = np.random.default_rng(0)
    offsets = np.array([0, 3, 3, 10], dtype=np.int64)  # a sequence with no scored tokens in the middle
    values = rng.standard_normal(10).astype(np.float32) * 1e3
    values[[0, 7]] = [np.float32(-0.0), np.nextafter(np.float32(1), np.float32(2))]  # bits that text must keep
    return values, (rng.random(10).astype(np.float32) if entropy else None), offsets


@pytest.mark.parametrize("entropy", [True, False])
def test_both_formats_give_back_every_bit(entropy):
    header = {"model": "policy", "weights_version": 7, "usage": {"tokens": 13}}
    lp, ent, offsets = results(entropy)
    got_header, got_lp, got_ent, got_offsets = decode_binary(encode_binary(header, lp, ent, offsets))
    assert got_header["model"] == "policy" and got_header["weights_version"] == 7 and got_header["sequences"] == 3
    assert got_lp.tobytes() == lp.tobytes() and np.array_equal(got_offsets, offsets)
    assert (got_ent is None) if ent is None else got_ent.tobytes() == ent.tobytes()
    body = json.loads(encode_json(header, lp, ent, offsets))
    assert body["weights_version"] == 7 and [len(r["log_probs"]) for r in body["results"]] == [3, 0, 7]
    text = np.array([x for r in body["results"] for x in r["log_probs"]], dtype=np.float32)
    assert text.tobytes() == lp.tobytes()  # the shortest text that reads back to the same float32
    assert all(("entropy" in r) == entropy for r in body["results"])


@pytest.mark.parametrize("cut", [0, 3, 20, -5])
def test_a_malformed_binary_body_is_refused(cut):
    body = encode_binary({"model": "m", "weights_version": 1}, *results(True))
    with pytest.raises(ValueError):
        decode_binary(body[:cut] if cut else b"")


def test_model_info_is_the_contracts():
    info = ModelInfo(id="policy", name="policy", vocab_size=503, max_length=256, max_request_tokens=4000,
                     weights_version=2)
    assert ModelInfo(**json.loads(info.model_dump_json())) == info


def test_top_k_and_candidates_travel_in_both_formats():
    """Per-entry top lists, the tail and candidate columns, bitwise in BINARY and as text in JSON, each sequence's
    candidates cut to its own count; a tail of -inf (every token in the top k) is null in JSON."""
    lp, ent, offsets = results(True)
    rng = np.random.default_rng(1)
    extras = {"top_log_probs": rng.standard_normal((10, 3)).astype(np.float32),
              "top_ids": rng.integers(0, 503, (10, 3)).astype(np.int32),
              "tail_log_prob": rng.standard_normal(10).astype(np.float32),
              "candidate_log_probs": rng.standard_normal((10, 4)).astype(np.float32)}
    extras["tail_log_prob"][4] = -np.inf
    counts = np.array([4, 1, 2])
    header, got_lp, _, _ = decode_binary(encode_binary({"model": "m"}, lp, ent, offsets, extras, counts))
    assert got_lp.tobytes() == lp.tobytes() and header["extras"]["top_ids"] == 3
    for name, values in extras.items():
        assert header["arrays"][name].tobytes() == values.astype(header["arrays"][name].dtype).tobytes(), name
    assert header["arrays"]["candidate_counts"].tolist() == [4, 1, 2]
    body = json.loads(encode_json({"model": "m"}, lp, ent, offsets, extras, counts))
    last = body["results"][2]
    assert np.array(last["top_ids"]).shape == (7, 3) and np.array(last["candidate_log_probs"]).shape == (7, 2)
    assert np.array(body["results"][0]["candidate_log_probs"]).shape == (3, 4)
    assert last["tail_log_prob"][1] is None  # entry 4 of the whole: -inf
    text = np.array([row for r in body["results"] for row in r["top_log_probs"]], dtype=np.float32)
    assert text.tobytes() == extras["top_log_probs"].tobytes()

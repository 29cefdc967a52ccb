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
    info = ModelInfo(name="policy", vocab_size=503, max_length=256, max_request_tokens=4000, weights_version=2)
    assert ModelInfo(**json.loads(info.model_dump_json())) == info

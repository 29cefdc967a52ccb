"""The body as CUDA graphs (workers/models/graphs.py): its buckets here; on CUDA (skipped without), a worker's
results with graphs are the bits without them, at row lengths across buckets, beside shared prompts (which run
without), and after a weight update (a graph reads the parameters where they are)."""

import numpy as np
import pytest
import torch

from ppo_logprobs.workers import LogProbWorker, load_model
from ppo_logprobs.workers.models.graphs import MAX_BUCKET, MIN_BUCKET, buckets, capturable, graph_tokens, use_graphs
from ppo_logprobs.workers.models.patch_model import allow_split_k
from tests.helpers import small_cuda_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_buckets_are_an_eighth_apart_and_end_at_the_limit():
    sizes = buckets(16896)
    assert sizes[0] == MIN_BUCKET and sizes[-1] == MAX_BUCKET == 16896 and len(sizes) == 41 and sizes[-2] == 16384
    gaps = np.diff(sizes)
    assert (gaps > 0).all() and (gaps <= np.maximum(MIN_BUCKET, np.array(sizes[:-1]) // 8)).all()
    assert buckets(1000)[-1] == 1000 and buckets(1 << 20)[-1] == MAX_BUCKET
    assert buckets(MIN_BUCKET - 1) == [] and buckets(MIN_BUCKET) == [MIN_BUCKET]


def test_graphs_stop_where_a_rows_kernels_hide_its_launch():
    """The longest row given a graph falls with the body's size: every bucket for the 1.5B shape (as measured with
    graphs), rows up to ~3.4k tokens for the 7B's (whose rows of 16,384 ran 2% slower with graphs)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def shape(hidden, inter, heads, kv):
        config = Qwen2Config(vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=28,
                             num_attention_heads=heads, num_key_value_heads=kv)
        with torch.device("meta"):
            return Qwen2ForCausalLM(config)

    assert MAX_BUCKET <= graph_tokens(shape(1536, 8960, 12, 2)) < 20000
    assert 3000 < graph_tokens(shape(3584, 18944, 28, 4)) < 4000
    assert graph_tokens(load_model("tiny", device="cpu")) > MAX_BUCKET


def test_a_body_that_cannot_be_captured_says_why():
    model = load_model("tiny", device="cpu")
    assert capturable(model) == "its attention is not our varlen kernel's"
    assert use_graphs(model, 4096) is None


@pytest.fixture(scope="module")
def model():
    yield small_cuda_model()
    allow_split_k(True)  # the process-wide setting back for the tests that follow


def flat(results):
    return np.concatenate([np.concatenate([r.log_probs, r.entropy]) for r in results])


@pytest.mark.gpu
@cuda
def test_graphs_give_the_bits_of_the_forward_they_replace(model):
    rng = np.random.default_rng(0)
    plain = LogProbWorker(model, max_tokens_per_batch=3000, cuda_graphs=False)
    assert plain.graphs is None
    graphed = LogProbWorker(model, max_tokens_per_batch=3000)
    assert len(graphed.graphs.graphs) == len(buckets(3000))
    prompt = rng.integers(0, 4099, 200).tolist()  # (shared by three sequences a call: MIN_SHARED_PREFIX is 128)
    for total in (2, 127, 129, 1000, 1025, 2999, 3000, 7000):  # rows across buckets, one and several per call
        lengths = rng.integers(2, 700, 64)
        lengths = lengths[np.cumsum(lengths) <= total] if total > 700 else [total]
        seqs = [rng.integers(0, 4099, n).tolist() for n in lengths]
        shared = [prompt + s[:20] for s in seqs[:3]]  # (a group sharing a prompt: its row runs without graphs)
        before = graphed.graphs.replays
        got = graphed.score(seqs, return_entropy=True)
        assert graphed.graphs.replays > before
        assert np.array_equal(flat(got), flat(plain.score(seqs, return_entropy=True))), total
        got = graphed.score(seqs + shared, return_entropy=True)  # (small calls: one row, with shared keys)
        assert np.array_equal(flat(got), flat(plain.score(seqs + shared, return_entropy=True))), total
    # a weight update reaches the graphs: they read the parameters in place
    weights = {name: p * 1.01 for name, p in model.named_parameters() if name.endswith("mlp.down_proj.weight")}
    old = graphed.score([prompt], return_entropy=True)
    graphed.update_weights(weights, 1)
    new = graphed.score([prompt], return_entropy=True)
    assert not np.array_equal(flat(new), flat(old))
    assert np.array_equal(flat(new), flat(plain.score([prompt], return_entropy=True)))

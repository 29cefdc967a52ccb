"""load_model: the built-in tiny model, local checkpoint directories as HF saves them (whole, or this rank's parts),
a model built from a config, the dtype option, and its refusals; nothing is asked of a hub (fp32, tiny configs)."""

import http.server
import os
import re
import threading

import pytest
import safetensors.torch
import torch
import transformers
from huggingface_hub import constants
from transformers import Qwen2Config, Qwen2ForCausalLM

from ppo_logprobs.workers import load_model
from ppo_logprobs.workers.errors import CheckpointNotFound, IncompatibleWeights, InvalidCheckpoint
from ppo_logprobs.workers.models.load_model import TINY_CONFIG
from ppo_logprobs.workers.models.tensor_parallel import shard_of
from ppo_logprobs.workers.sharding import Shard, held_shard

from ...helpers import with_tensors
from .test_patch_model import FAMILIES, tiny

IDS = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(7))


def params(model):
    return dict(model.named_parameters())


def assert_same_parameters(got, want):
    got, want = params(got), params(want)
    assert got.keys() == want.keys()
    for name, p in want.items():
        assert got[name].dtype == p.dtype and torch.equal(got[name], p), name


def saved(model, path) -> str:
    model.save_pretrained(path)
    return str(path)


def test_tiny_is_seeded_apart_from_the_global_rng():
    """The same weights in every process whatever its RNG did before, and the caller's RNG left where it was."""
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = load_model("tiny")
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(456)
    b = load_model("tiny", backend="torch")
    assert_same_parameters(a, b)
    assert type(a) is transformers.Qwen2ForCausalLM and not a.training
    assert {k: getattr(a.config, k) for k in TINY_CONFIG} == TINY_CONFIG
    assert {p.dtype for p in a.parameters()} == {torch.float32}
    with torch.no_grad():
        out = b(input_ids=IDS)
    assert out.logits is None and out.log_probs.shape == IDS.shape and (out.log_probs[:, :-1] < 0).all()


def test_tiny_takes_dtype_and_attention():
    fp32 = load_model("tiny")
    bf16 = load_model("tiny", dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    for name, p in params(fp32).items():
        assert torch.equal(params(bf16)[name], p.to(torch.bfloat16)), name
    assert load_model("tiny", attn_implementation="eager").config._attn_implementation == "eager"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_saved_checkpoint_loads_bitwise_and_patched(tmp_path, family):
    """save_pretrained's directory gives the same class, config (Gemma's softcap, the experts' routing) and
    parameters, bit for bit, in eval mode, patched: it returns log-probs, not logits."""
    source = tiny(family)
    model = load_model(saved(source, tmp_path), backend="torch")
    assert type(model) is type(source) and not model.training
    assert {**model.config.to_dict(), "_name_or_path": ""} == source.config.to_dict()
    assert_same_parameters(model, source)
    with torch.no_grad():
        out = model(input_ids=IDS)
    assert out.logits is None and out.log_probs.shape == out.entropy.shape == IDS.shape
    assert (out.log_probs[:, :-1] < 0).all() and (out.log_probs[:, -1] == 0).all()


@pytest.mark.parametrize("shard", [None, (0, 1)], ids=["whole", "built-and-read"])
def test_dtype_none_keeps_the_checkpoints_and_a_dtype_converts(tmp_path, shard):
    """Both ways a directory is read: HF's loader, and the model built from its config then filled by
    read_checkpoint (a shard of one rank)."""
    bf16 = saved(tiny("llama").to(torch.bfloat16), tmp_path / "bf16")
    fp32_source = tiny("llama")
    fp32 = saved(fp32_source, tmp_path / "fp32")
    source = tiny("llama").to(torch.bfloat16)
    assert_same_parameters(load_model(bf16, shard=shard), source)
    assert_same_parameters(load_model(bf16, dtype=torch.float32, shard=shard), source.float())  # exact: widening
    assert_same_parameters(load_model(fp32, dtype=torch.bfloat16, shard=shard), fp32_source.to(torch.bfloat16))
    assert_same_parameters(load_model(fp32, dtype="bfloat16", shard=shard), fp32_source.to(torch.bfloat16))
    with pytest.raises(ValueError, match="dtype 'bf16' is not a torch dtype"):
        load_model(fp32, dtype="bf16", shard=shard)


def test_a_config_builds_its_model_without_reading_the_path(tmp_path):
    source = tiny("qwen3").to(torch.bfloat16)
    config = {**source.config.to_dict(), "dtype": "bfloat16"}  # as the config of a loaded bf16 checkpoint has it
    model = load_model(str(tmp_path / "absent"), config=config, backend="torch")
    assert type(model) is transformers.Qwen3ForCausalLM and not model.training
    assert {n: (p.shape, p.dtype) for n, p in params(model).items()} == {
        n: (p.shape, p.dtype) for n, p in params(source).items()}  # the config's dtype, a string in its dict
    model = load_model(str(tmp_path / "absent"), config=config, dtype=torch.float32, backend="torch")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with torch.no_grad():
        assert model(input_ids=IDS).logits is None


@pytest.mark.parametrize("rank", [0, 1])
def test_a_shard_reads_its_part_of_a_checkpoint(tmp_path, rank):
    """shard=(rank, size) without a group: exactly shard_of each checkpoint tensor, marked as that part; it refuses
    to score until patched with its group."""
    source = tiny("qwen2")
    model = load_model(saved(source, tmp_path), shard=(rank, 2), backend="torch")
    assert held_shard(model) == Shard(rank, 2, False) and not model.training
    whole = params(source)
    assert params(model).keys() == whole.keys()
    for name, p in params(model).items():
        assert torch.equal(p, shard_of(name, whole[name], rank, 2, source.config)), name
    assert model.lm_head.weight.shape[0] == (49 if rank == 0 else 48)  # V = 97 cut unevenly: the head is cut
    with pytest.raises(RuntimeError, match=f"this model holds rank {rank} of 2's part"):
        model(input_ids=IDS)


def missing(tmp_path):
    return str(tmp_path / "no-such-model"), {}


def a_file(tmp_path):
    (tmp_path / "weights.txt").write_text("not a checkpoint")
    return str(tmp_path / "weights.txt"), {}


def empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    return str(tmp_path / "empty"), {}


def config_only(tmp_path, **options):
    tiny("qwen2").config.save_pretrained(tmp_path / "config-only")
    return str(tmp_path / "config-only"), options


def truncated(tmp_path):
    path = saved(tiny("qwen2"), tmp_path / "truncated")
    shard = tmp_path / "truncated" / "model.safetensors"
    os.truncate(shard, shard.stat().st_size // 2)
    return path, {}


def other_shapes(tmp_path):
    """Weights of an MLP 96 wide under a config that says 128."""
    Qwen2ForCausalLM(Qwen2Config(**{**TINY_CONFIG, "intermediate_size": 96})).save_pretrained(tmp_path / "other")
    Qwen2Config(**TINY_CONFIG).save_pretrained(tmp_path / "other")
    return str(tmp_path / "other"), {}


def a_tensor_short(tmp_path):
    path = saved(Qwen2ForCausalLM(Qwen2Config(**TINY_CONFIG)), tmp_path / "short")
    shard = tmp_path / "short" / "model.safetensors"
    tensors = safetensors.torch.load_file(shard)
    del tensors["model.norm.weight"]
    safetensors.torch.save_file(tensors, shard, metadata={"format": "pt"})
    return path, {}


GPT2 = dict(n_embd=32, n_layer=1, n_head=2, vocab_size=97, bos_token_id=1, eos_token_id=2)


def gpt2(tmp_path):
    return saved(transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)), tmp_path / "gpt2"), {}


# (case, error, message: "{path}" stands for the path given)
REFUSALS = [
    (missing, CheckpointNotFound, "no checkpoint directory at '{path}'"),
    (a_file, CheckpointNotFound, "no checkpoint directory at '{path}'"),
    (empty_directory, InvalidCheckpoint, "'{path}' has no config.json"),
    (config_only, (OSError, ValueError), "{path}"),
    (truncated, InvalidCheckpoint, "model.safetensors is truncated: tensor '.+' ends at byte \\d+, the file has \\d+"),
    (other_shapes, IncompatibleWeights, "'model.layers.0.mlp.down_proj.weight' has shape \\[64, 96\\] in '{path}' and "
     "\\[64, 128\\] in the model its config.json describes"),
    (a_tensor_short, IncompatibleWeights, "'{path}' lacks 1 of the model's parameters, e.g. 'model.norm.weight'"),
    (gpt2, ValueError, "cannot patch GPT2LMHeadModel \\(model_type 'gpt2'\\)"),
    (lambda p: (str(p / "absent"), dict(config={"model_type": "no-such-family"})), ValueError, "no-such-family"),
    (lambda p: (str(p / "absent"), dict(config=transformers.GPT2Config(**GPT2).to_dict())), ValueError,
     "cannot patch GPT2LMHeadModel \\(model_type 'gpt2'\\)"),
    # this rank's parts only
    (lambda p: (missing(p)[0], dict(shard=(0, 2))), CheckpointNotFound, "no checkpoint directory at '{path}'"),
    (lambda p: config_only(p, shard=(0, 2)), InvalidCheckpoint, "{path}' has no \\*.safetensors weights"),
    (lambda p: (saved(tiny("phi3"), p / "phi3"), dict(shard=(0, 2))), ValueError,
     "tensor parallelism supports .*, not model_type 'phi3'"),
    (lambda p: (saved(tiny("qwen2"), p / "qwen2"), dict(shard=(1, 3))), ValueError,
     "num_attention_heads = 4 does not divide among 3 ranks"),
]


@pytest.mark.parametrize(("case", "error", "message"), REFUSALS, ids=[
    "missing", "a-file", "empty-directory", "config-only", "truncated", "other-shapes", "a-tensor-short",
    "unsupported-family", "unknown-config",
    "unsupported-config", "shard-missing", "shard-config-only", "shard-unsupported-family", "shard-indivisible"])
def test_refusals_name_the_path_or_the_reason(tmp_path, capfd, case, error, message):
    path, options = case(tmp_path)
    capfd.readouterr()
    with pytest.raises(error, match=message.replace("{path}", re.escape(path))):
        load_model(path, **options)
    printed = "".join(capfd.readouterr())
    assert "LOAD REPORT" not in printed and "Loading weights" not in printed, printed  # HF's, above the one line


def test_tensors_the_model_does_not_use_are_named_in_one_warning(tmp_path, capfd, caplog):
    """A value head saved beside the policy loads (HF leaves it unread) and is said in one line, not HF's table."""
    source = Qwen2ForCausalLM(Qwen2Config(**TINY_CONFIG))
    path = with_tensors(saved(source, tmp_path / "critic"), **{"v_head.summary.weight": torch.ones(1, 64),
                                                               "v_head.summary.bias": torch.ones(1)})
    capfd.readouterr()
    with caplog.at_level("WARNING", logger="ppo_logprobs"):
        assert_same_parameters(load_model(path), source.eval())
        part = load_model(path, shard=(1, 2))  # (a tensor-parallel rank's parts, read by read_checkpoint)
    for name, p in params(part).items():
        assert torch.equal(p, shard_of(name, params(source)[name], 1, 2, source.config)), name
    assert [r.getMessage() for r in caplog.records if r.name.startswith("ppo_logprobs")] == [
        f"{path!r} has 2 tensors the model does not use, left unread: 'v_head.summary.bias', 'v_head.summary.weight'"
    ] * 2
    printed = "".join(capfd.readouterr())
    assert "LOAD REPORT" not in printed and "Loading weights" not in printed, printed
    assert transformers.utils.logging.is_progress_bar_enabled()  # the caller's settings back


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A hub on loopback that answers 404 to everything and records the paths asked for, in place of the real one
    (online mode, an empty cache)."""
    asked = []

    class Hub(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            self.send_error(404)

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    thread = threading.Thread(target=server.serve_forever, kwargs=dict(poll_interval=0.01), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.chdir(tmp_path)  # where "org/name" is no local directory
    try:
        yield asked
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_hub_name_is_refused_without_asking_the_hub(hub):
    name = "ppo-logprobs-tests/not-a-directory"
    with pytest.raises(CheckpointNotFound, match=f"no checkpoint directory at '{name}'"):
        load_model(name)  # (not looked up in HF's cache either: a local directory or nothing)
    assert not [path for path in hub if name in path]
    # the same name through HF's own loader, allowed to download: the hub above sees it ask (so it would have seen
    # load_model ask)
    with pytest.raises(OSError):
        transformers.AutoModelForCausalLM.from_pretrained(name)
    assert [path for path in hub if name in path]


def test_a_hub_style_name_that_is_a_local_directory_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = tiny("qwen2")
    saved(source, tmp_path / "org" / "name")
    assert_same_parameters(load_model("org/name"), source)

"""Settings and the serve command line: flags generated from Settings, the API key kept secret."""

import re
from typing import get_args

import pytest

from ppo_logprobs.service import Settings
from ppo_logprobs.service.__main__ import curl_example, parse_args


def test_the_key_never_shows(monkeypatch, tmp_path):
    settings = Settings(api_key="s3cret-key", host="0.0.0.0")
    for text in (repr(settings), str(settings), settings.model_dump_json(), curl_example(settings)):
        assert "s3cret-key" not in text
    assert "$PPO_LOGPROBS_API_KEY" in curl_example(settings)
    assert settings.api_key.get_secret_value() == "s3cret-key"
    monkeypatch.setenv("PPO_LOGPROBS_API_KEY", "from-env")
    assert Settings().api_key.get_secret_value() == "from-env"
    (tmp_path / "key").write_text("from-file\n")
    assert parse_args(["--api-key-file", str(tmp_path / "key")]).api_key.get_secret_value() == "from-file"


def test_an_empty_key_is_no_key():
    assert Settings(api_key="").api_key is None
    with pytest.raises(ValueError, match="an API key is required to listen on '0.0.0.0'"):
        Settings(api_key="", host="0.0.0.0")
    with pytest.raises(ValueError, match="cannot read api_key_file '/no/such/key'"):
        Settings(api_key_file="/no/such/key")


def test_serve_flags_come_from_settings(capsys):
    settings = parse_args(["--models", "policy=/ckpt/a", "--models", "reference=/ckpt/b", "--workers-per-model", "2",
                           "--max-body-bytes", "4096", "--pool-name", "svc"])
    assert settings.models == {"policy": "/ckpt/a", "reference": "/ckpt/b"}
    assert (settings.workers_per_model, settings.max_body_bytes, settings.pool_name) == (2, 4096, "svc")
    assert parse_args([]).pool_name == Settings().pool_name == "ppo_logprobs"  # one default
    with pytest.raises(SystemExit):
        parse_args(["--api-key", "on-the-command-line"])  # no such flag: it would show in ps
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    usage = capsys.readouterr().out
    for name in Settings.model_fields:
        flag = re.search("--" + name.replace("_", "-") + r"(?![-\w])", usage)
        assert bool(flag) == (name != "api_key"), name


def test_dtype_and_backend_are_the_names_the_workers_take():
    """Checked with the other settings, before Ray starts (config.py imports no torch): each dtype name is a
    floating-point dtype of torch (what load_model looks up), and the backends are the head's."""
    import torch

    from ppo_logprobs.service.config import Backend, Dtype
    from ppo_logprobs.workers.head import Backend as HeadBackend

    for name in get_args(Dtype):
        assert isinstance(getattr(torch, name), torch.dtype) and getattr(torch, name).is_floating_point, name
    assert set(get_args(Backend)) == set(get_args(HeadBackend))
    assert Settings(dtype="bfloat16", backend="triton").dtype == "bfloat16"
    for field, value in (("dtype", "bf16"), ("dtype", "Tensor"), ("backend", "foo")):
        with pytest.raises(ValueError, match=f"{field}\n  Input should be"):
            Settings(**{field: value})

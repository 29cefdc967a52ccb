"""deploy/*.yaml against Ray's own validation: the cluster launcher's schema and Serve's deploy schema."""

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.schema import ServeDeploySchema

from ppo_logprobs.service.app import app_builder
from ppo_logprobs.service.config import Settings

DEPLOY = Path(__file__).parents[2] / "deploy"


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-local.yaml"])
def test_cluster_files_pass_the_launchers_validation(name):
    config = prepare_config(load(name))  # what `ray up` does first: fill defaults, then validate
    validate_config(config)
    assert config["head_start_ray_commands"] and config["worker_start_ray_commands"]
    broken = copy.deepcopy(config)
    broken["available_node_types"]["not_a_node_type"] = {"bogus": 1}  # the validation is real
    with pytest.raises(jsonschema.ValidationError):
        validate_config(broken)


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-local.yaml"])
def test_every_node_starts_ray_with_the_same_ingress(name):
    config = load(name)
    starts = [c for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 2 and len({"RAY_SERVE_ENABLE_HA_PROXY=1" in c for c in starts}) == 1, starts


def test_gpu_nodes_carry_the_worker_resource():
    gpu = load("cluster.yaml")["available_node_types"]["gpu"]["resources"]
    assert gpu["GPU"] == gpu["logprob_gpu"]
    assert "logprob_gpu" not in load("cluster.yaml")["available_node_types"]["head"]["resources"]
    assert "logprob_gpu" in " ".join(load("cluster-local.yaml")["worker_start_ray_commands"])


def test_serve_file_passes_the_deploy_schema_and_our_settings():
    config = load("serve.yaml")
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == "ppo_logprobs.service.app:app_builder"
    # the args are exactly the gateway's settings, once its placeholder key is replaced, as its comment asks
    with pytest.raises(ValueError, match="the API key is deploy/serve.yaml's placeholder 'CHANGE-ME'"):
        Settings(**app.args)
    settings = Settings(**{**app.args, "api_key": "a-real-secret"})
    assert settings.worker_resources == {"logprob_gpu": 1} and settings.pool_name == "ppo_logprobs"
    assert config["proxy_location"] == "EveryNode" and settings.ingress_replicas > 1
    assert callable(app_builder)
    with pytest.raises(ValueError, match="an API key is required"):
        Settings(**{**app.args, "api_key": None})

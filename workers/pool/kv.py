"""The few small values a pool keeps in Ray's GCS key-value store, so that they outlive the process that wrote them.

## NB: Ray has no public key-value store; `ray.experimental.internal_kv` is private (underscored, unversioned) and
# may change with Ray. It is used here and nowhere else, so a Ray upgrade that moves it is mended in this file.
What is kept there, all in NAMESPACE, each value JSON text:
- `weights:<pool name or uuid>`: a WeightOwner's state (version counter, where the weights are, the workers' names),
  so that a restarted owner goes on counting where it stopped (owner.py);
- `spec:<pool name>`: the settings a named pool was made with, so that a replaced keeper attaches to a running pool
  only when it was made the same way (service/keeper.py).
"""

from __future__ import annotations

from ray.experimental import internal_kv

NAMESPACE = "ppo_logprobs"  # the Ray namespace of named pools (their actors), and of the values kept here


def get(key: str) -> bytes | None:
    """The value kept under `key`, or None."""
    return internal_kv._internal_kv_get(key, namespace=NAMESPACE)


def put(key: str, value: str) -> None:
    """Keeps `value` under `key`, replacing what was there."""
    internal_kv._internal_kv_put(key, value, overwrite=True, namespace=NAMESPACE)


def delete(key: str) -> None:
    internal_kv._internal_kv_del(key, namespace=NAMESPACE)

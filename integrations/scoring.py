"""What the framework adapters share: a scoring service reached through a WorkerPool or over HTTP, the padded
[rows, columns] batches of the frameworks turned into unpadded token lists (nothing padded reaches a worker), and
the per-token answers put back where the framework expects them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


class Service:
    """A scoring service: a `WorkerPool` (or its name on this Ray cluster: `"<service>:<model>"` for the pools of
    `ppo-logprobs serve`, or the name given to `WorkerPool.create`), a `LogProbClient`, or the HTTP service's URL.
    `model`: the served model's name, for HTTP (a pool is one model already)."""

    def __init__(self, target, *, model: str = "policy", api_key: str | None = None) -> None:
        if isinstance(target, str) and target.startswith(("http://", "https://")):
            from ppo_logprobs.client import LogProbClient

            target = LogProbClient(target, api_key=api_key)
        elif isinstance(target, str):
            target = _pool_named(target)
        if not hasattr(target, "compute_log_probs") and not hasattr(target, "score"):
            raise TypeError(f"a scoring service is a WorkerPool, a LogProbClient, a pool's name or a URL, not "
                            f"{type(target).__name__}")
        self.target, self.model = target, model

    @property
    def pool(self):
        """The WorkerPool behind this service (weights are sent to a pool), or None over HTTP."""
        return self.target if hasattr(self.target, "compute_log_probs") else None

    def score(self, seqs: list[np.ndarray] | list[list[int]], starts: list[int], temperature: float | list[float],
              entropy: bool, rollout: list[list[float]] | None = None) -> list:
        """One result per sequence (`.log_probs`, `.entropy`, `.weights_version`, `.mismatch`), one call."""
        if self.pool is not None:
            return self.pool.compute_log_probs(seqs, starts, temperature=temperature, return_entropy=entropy,
                                              rollout_log_probs=rollout)
        return self.target.score(seqs, starts, temperature=temperature, model=self.model, return_entropy=entropy,
                                 rollout_log_probs=rollout)


def _pool_named(name: str):
    import ray

    from ppo_logprobs.client import connect_pool
    from ppo_logprobs.workers import WorkerPool

    service, _, model = name.rpartition(":")
    if service:
        return connect_pool(model, service=service)
    if not ray.is_initialized():
        ray.init(address="auto")
    return WorkerPool.connect(name)


@dataclass
class Rows:
    """A padded batch's rows as the service takes them: row b is seqs[b], scored from starts[b]; its entries land
    at columns[b] of the last `width` columns (the response). Rows with no response token are not sent (`sent`)."""

    seqs: list[np.ndarray]  # int64 token ids
    starts: list[int]
    columns: list[np.ndarray]  # int64 [entries of row b]
    sent: list[int]  # the rows that have entries
    shape: tuple[int, int]  # (rows, width)

    def place(self, values: Sequence[np.ndarray], *, dtype: torch.dtype, device) -> torch.Tensor:
        """[rows, width] of `dtype`: each sent row's values at its columns, 0 elsewhere (the padding)."""
        out = np.zeros(self.shape, np.float32)
        for b, v in zip(self.sent, values, strict=True):
            out[b, self.columns[b]] = v
        return torch.from_numpy(out).to(device=device, dtype=dtype)


def unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor, width: int) -> Rows:
    """Rows of `input_ids` [B, L] with the positions where `attention_mask` is 0 taken out, the last `width`
    columns being the response: a row's tokens before that are its prompt (at least one), each token after is
    scored. Any padding (left, right, both) is taken out, which is what the frameworks' position ids (counted over
    the mask) mean."""
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
                         "must be the same [rows, tokens]")
    if not 0 < width <= input_ids.shape[1]:
        raise ValueError(f"the response is {width} of {input_ids.shape[1]} columns")
    ids, mask = input_ids.cpu().numpy(), attention_mask.cpu().numpy() != 0
    first = ids.shape[1] - width
    seqs, starts, columns, sent = [], [], [], []
    for b in range(ids.shape[0]):
        kept = np.flatnonzero(mask[b])
        response = kept >= first
        start = int((~response).sum())
        if start == 0:
            raise ValueError(f"row {b} has no prompt token before its response (attention_mask is 0 on all of "
                             f"its first {first} columns)")
        seqs.append(ids[b, kept])
        starts.append(start)
        columns.append(kept[response] - first)
        if len(kept) > start:
            sent.append(b)
    return Rows(seqs, starts, columns, sent, (ids.shape[0], width))


def score_rows(service: Service, rows: Rows, temperature: float | list[float], entropy: bool,
               rollout: list[list[float]] | None = None) -> list:
    """The service's results for the rows that have entries (`rows.sent`, in order). `temperature`: one, or one
    per row; `rollout`: one list per sent row."""
    if not rows.sent:
        return []
    if isinstance(temperature, list):
        temperature = [temperature[b] for b in rows.sent]
    return service.score([rows.seqs[b] for b in rows.sent], [rows.starts[b] for b in rows.sent], temperature,
                         entropy, rollout)

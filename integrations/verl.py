"""verl: a worker for the reference role of verl's Ray trainer (`Role.RefPolicy`) whose log-probs come from
ppo-logprobs, so that no reference copy of the model is built in the trainer's GPU processes.

    from verl.trainer.ppo.ray_trainer import Role
    from ppo_logprobs.integrations.verl import reference_worker

    role_worker_mapping[Role.RefPolicy] = ray.remote(reference_worker("ppo_logprobs:reference"))
    mapping[Role.RefPolicy] = "global_pool"

(docs/trainers.md says which of verl's settings go with it.) The worker takes what verl 0.9's trainer sends its
reference worker, a TensorDict without padding (nested `input_ids`, the padded `prompts` and `attention_mask`,
`temperature`), and answers as verl's own does: a nested `log_probs` over every position, entry t being the
log-probability of token t + 1 (the trainer cuts the response out). A `DataProto` in verl's padded layout
(left-padded prompts, right-padded responses, `meta_info["temperature"]`) gets `ref_log_prob` [batch, response]
float32 back, 0 at padding, as verl's padded workers give it. The batch's rollout log-probs stay out of it: against
the reference they would measure the policy's drift, not the mismatch between engines (verl's own debug metrics
compare them with the actor's old log-probs).
"""

from __future__ import annotations

import numpy as np
import torch

try:
    from tensordict import TensorDict
    from verl import DataProto
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, Execute, register
    from verl.utils import tensordict_utils as tu
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("ppo_logprobs.integrations.verl needs verl: pip install 'ppo-logprobs[verl]'") from e

from .scoring import Rows, Service, score_rows, unpad


def _temperatures(value) -> float | list[float]:
    """verl's temperature: absent (1), a number, or a tensor of one per sequence."""
    if value is None:
        return 1.0
    if isinstance(value, torch.Tensor):
        return value.float().tolist() if value.numel() > 1 else float(value)
    return float(value)


def score_unpadded(service: Service, data: TensorDict) -> TensorDict:
    """verl 0.9's reference call: `data` without padding (as `left_right_2_no_padding` makes it) -> `log_probs`
    (and `entropy` when `calculate_entropy`), nested like `input_ids`: entry t for token t + 1, 0 on the prompt's
    positions but its last and on the sequence's last position."""
    ids = data["input_ids"]
    offsets = ids.offsets().tolist()
    values = ids.values().cpu().numpy()  # (views of one array: the pool takes them with no per-token work)
    seqs = [values[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    prompt_width = data["prompts"].shape[1]
    starts = data["attention_mask"][:, :prompt_width].sum(1).tolist()  # each sequence's prompt tokens
    entropy = bool(tu.get(data, "calculate_entropy", default=False))
    rows = Rows(seqs, starts, [], [b for b, (s, p) in enumerate(zip(seqs, starts, strict=True)) if len(s) > p],
                (len(seqs), 0))
    results = score_rows(service, rows, _temperatures(tu.get(data, "temperature")), entropy)
    sent = rows.sent
    out = {"log_probs": _nested(seqs, starts, sent, [r.log_probs for r in results])}
    if entropy:
        out["entropy"] = _nested(seqs, starts, sent, [r.entropy for r in results])
    return tu.get_tensordict(out)


def _nested(seqs, starts, sent, values) -> torch.Tensor:
    rows = [np.zeros(len(s), np.float32) for s in seqs]
    for b, v in zip(sent, values, strict=True):
        rows[b][starts[b] - 1 : len(seqs[b]) - 1] = v
    return torch.nested.nested_tensor([torch.from_numpy(r) for r in rows], layout=torch.jagged)


def score_padded(service: Service, data: DataProto, key: str = "ref_log_prob") -> DataProto:
    """verl's padded layout: `input_ids` = prompts (left-padded) + `responses` (right-padded), `attention_mask`
    over both -> `key` [batch, response] float32 (and `entropys` when meta_info calculate_entropy), 0 at padding."""
    batch = data.batch
    width = batch["responses"].shape[1]
    rows = unpad(batch["input_ids"], batch["attention_mask"], width)
    entropy = bool(data.meta_info.get("calculate_entropy", False))
    results = score_rows(service, rows, _temperatures(data.meta_info.get("temperature")), entropy)
    out = {key: rows.place([r.log_probs for r in results], dtype=torch.float32, device="cpu")}
    if entropy:
        out["entropys"] = rows.place([r.entropy for r in results], dtype=torch.float32, device="cpu")
    return DataProto.from_dict(tensors=out)


class ServiceRefWorker(Worker):
    """The worker verl's trainer builds for `Role.RefPolicy`; `reference_worker(service)` makes the class with its
    service set. The service holds the model, so the role needs no GPU memory of its own, and the whole batch goes
    to rank 0 and to the service in one call: split over the ranks, it would reach the service as one smaller call
    a rank (each packed alone) after a hop through each."""

    service_target = None  # what scoring.Service takes: a URL, a pool's name, a WorkerPool or a LogProbClient
    service_model = "policy"  # the served model's name (HTTP)
    api_key: str | None = None

    def __init__(self, config=None, role: str = "ref", **_) -> None:
        super().__init__()
        self.config, self.role, self.service = config, role, None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        if self.service_target is None:
            raise ValueError("ServiceRefWorker has no service: make its class with reference_worker(service)")
        self.service = Service(self.service_target, model=self.service_model, api_key=self.api_key)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def compute_ref_log_prob(self, data):
        if isinstance(data, DataProto):
            return score_padded(self.service, data)
        return score_unpadded(self.service, data)


def reference_worker(service, *, model: str = "policy", api_key: str | None = None) -> type[ServiceRefWorker]:
    """The reference worker class for verl's role mapping, scoring through `service` (a URL, a pool's name such as
    "ppo_logprobs:reference", a WorkerPool or a LogProbClient; `model`: the served name over HTTP)."""
    return type("ServiceRefWorker", (ServiceRefWorker,),
                {"service_target": service, "service_model": model, "api_key": api_key})

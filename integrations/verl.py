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


def batch_of(data) -> dict:
    """What the role's rank 0 is sent: the batch's tokens as numpy arrays (Ray moves those without pickling torch's
    tensors: the nested ones cost ~25 ms a GRPO batch each way), the temperature and whether entropy is asked.
    `data`: verl 0.9's TensorDict without padding, or a DataProto in verl's padded layout."""
    if isinstance(data, DataProto):
        return dict(input_ids=data.batch["input_ids"].cpu().numpy(),
                    attention_mask=data.batch["attention_mask"].cpu().numpy(),
                    width=data.batch["responses"].shape[1],
                    temperature=_temperatures(data.meta_info.get("temperature")),
                    entropy=bool(data.meta_info.get("calculate_entropy", False)))
    ids = data["input_ids"]
    return dict(values=ids.values().cpu().numpy(), offsets=ids.offsets().cpu().numpy(),
                starts=data["attention_mask"][:, : data["prompts"].shape[1]].sum(1).cpu().numpy(),
                temperature=_temperatures(tu.get(data, "temperature")),
                entropy=bool(tu.get(data, "calculate_entropy", default=False)))


def score_batch(service: Service, batch: dict) -> dict:
    """batch_of's batch scored: numpy arrays of what verl's own reference worker returns (see tensors_of)."""
    if "input_ids" in batch:  # padded
        rows = unpad(torch.from_numpy(batch["input_ids"]), torch.from_numpy(batch["attention_mask"]), batch["width"])
        results = score_rows(service, rows, batch["temperature"], batch["entropy"])
        out = {"ref_log_prob": [r.log_probs for r in results]}
        if batch["entropy"]:
            out["entropys"] = [r.entropy for r in results]
        return {k: rows.place(v, dtype=torch.float32, device="cpu").numpy() for k, v in out.items()}
    values, offsets, starts = batch["values"], batch["offsets"], batch["starts"].tolist()
    seqs = [values[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]  # (views: no per-token work)
    rows = Rows(seqs, starts, [], [b for b, (s, p) in enumerate(zip(seqs, starts, strict=True)) if len(s) > p],
                (len(seqs), 0))
    results = score_rows(service, rows, batch["temperature"], batch["entropy"])

    def flat(values) -> np.ndarray:  # entry t of a sequence for its token t + 1; 0 where nothing is scored
        out = np.zeros(len(batch["values"]), np.float32)
        for b, v in zip(rows.sent, values, strict=True):
            out[offsets[b] + starts[b] - 1 : offsets[b + 1] - 1] = v
        return out

    out = {"log_probs": flat(r.log_probs for r in results), "offsets": offsets}
    if batch["entropy"]:
        out["entropy"] = flat(r.entropy for r in results)
    return out


def tensors_of(out: dict) -> TensorDict | DataProto:
    """score_batch's arrays in verl's types: a TensorDict of `log_probs` (and `entropy`) nested like the batch's
    `input_ids`, or a DataProto of `ref_log_prob` (and `entropys`) [batch, response] float32, 0 at padding."""
    if "offsets" not in out:
        return DataProto.from_dict(tensors={k: _tensor(v) for k, v in out.items()})
    offsets = _tensor(out.pop("offsets"))
    return tu.get_tensordict({k: torch.nested.nested_tensor_from_jagged(_tensor(v), offsets) for k, v in out.items()})


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor of the array's memory, or of a copy where the array is read-only (one that came through Ray's object
    store: torch warned, and a write to the tensor would be undefined)."""
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def score_unpadded(service: Service, data: TensorDict) -> TensorDict:
    """verl 0.9's reference call: `data` without padding (as `left_right_2_no_padding` makes it) -> `log_probs`
    (and `entropy` when `calculate_entropy`), nested like `input_ids`: entry t for token t + 1, 0 on the prompt's
    positions but its last and on the sequence's last position."""
    return tensors_of(score_batch(service, batch_of(data)))


def score_padded(service: Service, data: DataProto) -> DataProto:
    """verl's padded layout: `input_ids` = prompts (left-padded) + `responses` (right-padded), `attention_mask`
    over both -> `ref_log_prob` [batch, response] float32 (and `entropys` when meta_info calculate_entropy), 0 at
    padding."""
    return tensors_of(score_batch(service, batch_of(data)))


class ServiceRefWorker(Worker):
    """The worker verl's trainer builds for `Role.RefPolicy`; `reference_worker(service)` makes the class with its
    service set. The service holds the model, so the role needs no GPU memory of its own, and the whole batch goes
    to rank 0 and to the service in one call: split over the ranks, it would reach the service as one smaller call
    a rank (each packed alone) after a hop through each. The trainer's process sends rank 0 the batch as numpy
    arrays (batch_of) and turns the arrays it gets back into verl's types (tensors_of)."""

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

    @register(dispatch_mode={"dispatch_fn": lambda _, data: ((batch_of(data),), {}),  # (in the trainer's process)
                             "collect_fn": lambda _, out: tensors_of(out)}, execute_mode=Execute.RANK_ZERO)
    def compute_ref_log_prob(self, batch: dict) -> dict:
        return score_batch(self.service, batch)


def reference_worker(service, *, model: str = "policy", api_key: str | None = None) -> type[ServiceRefWorker]:
    """The reference worker class for verl's role mapping, scoring through `service` (a URL, a pool's name such as
    "ppo_logprobs:reference", a WorkerPool or a LogProbClient; `model`: the served name over HTTP)."""
    return type("ServiceRefWorker", (ServiceRefWorker,),
                {"service_target": service, "service_model": model, "api_key": api_key})

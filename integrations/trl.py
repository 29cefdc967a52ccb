"""TRL: `GRPOTrainer` and `RLOOTrainer` whose reference log-probs come from ppo-logprobs, so that no reference model
is built on the trainer, and (optionally) whose old-policy log-probs come from a policy pool that the trainer keeps
at its own weights. The loss, masks and metrics are TRL's own; only where the log-probs are computed changes.

    from ppo_logprobs.integrations.trl import GRPOTrainer

    trainer = GRPOTrainer(model="Qwen/Qwen2.5-1.5B-Instruct", reward_funcs=reward, args=GRPOConfig(beta=0.04, ...),
                          train_dataset=dataset, reference="http://127.0.0.1:8000", reference_model="policy")

`reference` (and `old_policy`) take what `scoring.Service` takes: a URL, a `LogProbClient`, a `WorkerPool` or a
pool's name. A batch's completions go to the service in one call, so the G completions of a prompt share its
forward (the service finds the common prompt). When the rollouts came with the engine's log-probs (TRL's vLLM
modes), they go along with the old-policy call, and the trainer logs the service's k3 KL to them as
`ppo_logprobs/rollout_kl_k3`.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import trl
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("ppo_logprobs.integrations.trl needs TRL: pip install 'ppo-logprobs[trl]'") from e

from .scoring import Service, score_rows, unpad


class RemoteModel:
    """Stands where TRL keeps its reference model: the service that scores for it."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def __repr__(self) -> str:
        return f"RemoteModel({self.service.target!r})"


class ServiceScoring:
    """The mixin: put it before a TRL trainer class. `reference`: the service holding the reference model (TRL's
    `args.beta` must be > 0: with 0 TRL uses no reference); `reference_model`: its served name over HTTP.
    `old_policy`: a policy `WorkerPool` (or its name) that scores old log-probs wherever TRL would recompute them
    on the trainer (GRPO with num_iterations > 1 or unaligned steps, RLOO always); the trainer sends it its weights
    when training starts and after every optimizer step (`WorkerPool.weight_sender`)."""

    def __init__(self, *args, reference=None, reference_model: str = "policy", old_policy=None,
                 api_key: str | None = None, **kwargs) -> None:
        config = kwargs["args"] if "args" in kwargs else (args[2] if len(args) > 2 else None)
        if reference is not None:
            if config is None or not config.beta:
                raise ValueError("reference= scores the KL penalty, which needs args with beta > 0 (with beta 0, "
                                 "TRL's default for GRPO, no reference is used)")
            if config.sync_ref_model:
                raise ValueError("sync_ref_model=True moves a reference model on the trainer; with reference= the "
                                 "service holds it: update the service's weights instead (WorkerPool.update_weights "
                                 "or the reload route)")
            beta, config.beta = config.beta, 0.0  # so that TRL builds no reference model
        try:
            super().__init__(*args, **kwargs)
        finally:
            if reference is not None:
                config.beta = beta
        if reference is not None:
            self.beta = beta
            self.ref_model = RemoteModel(Service(reference, model=reference_model, api_key=api_key))
        self.old_policy = None
        if old_policy is not None:
            self.old_policy = Service(old_policy)
            if self.old_policy.pool is None:
                raise ValueError("old_policy= must be a WorkerPool or a pool's name (the trainer sends it its weights "
                                 "after each step; a URL takes no weights)")
            self.add_callback(_SendWeights(self))
        self.policy_version = None  # the old_policy pool's weights version that matches the trainer's
        self.rollout_log_probs = None  # the last generation's rollout log-probs (one list per completion), if any

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **extra):
        if isinstance(model, RemoteModel):
            service = model.service
        elif self.old_policy is not None and model is self.model and not torch.is_grad_enabled():
            service = self.old_policy
        else:
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              batch_size, compute_entropy, compute_aux_loss, **extra)
        given = sorted(k for k, v in extra.items() if v is not None)
        if given:
            raise NotImplementedError(f"the service scores text only; this batch has {', '.join(given)}")
        rows = unpad(input_ids, attention_mask, logits_to_keep)
        # the rollout's log-probs go with the policy's scoring only: against the reference they measure the
        # policy's drift, not the mismatch between engines
        rollout = self._rollout_for(rows) if service is self.old_policy else None
        results = score_rows(service, rows, self.temperature, compute_entropy, rollout)
        if service is self.old_policy and self.policy_version is not None:
            versions = sorted({r.weights_version for r in results})
            if versions != [self.policy_version]:
                raise RuntimeError(f"old log-probs of weights version {versions}, but the trainer's weights are "
                                   f"version {self.policy_version}")
        self._log_mismatch(results)
        logps = rows.place([r.log_probs for r in results], dtype=torch.float32, device=input_ids.device)
        entropy = None
        if compute_entropy:
            entropy = rows.place([r.entropy for r in results], dtype=torch.float32, device=input_ids.device)
        return logps, entropy, None

    def _rollout_for(self, rows) -> list[list[float]] | None:
        """The rollout log-probs of the rows' entries, when the last generation had them for every entry."""
        given = self.rollout_log_probs
        if given is None or len(given) != len(rows.seqs):
            return None
        chosen = [given[b] for b in rows.sent]
        if any(v is None or len(v) != len(rows.columns[b]) or any(x is None for x in v)
               for b, v in zip(rows.sent, chosen, strict=True)):
            return None
        return [[float(x) for x in v] for v in chosen]

    def _log_mismatch(self, results) -> None:
        kl = [r.mismatch["kl_k3"] for r in results if r.mismatch]
        if kl:
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["ppo_logprobs/rollout_kl_k3"].append(float(np.mean(kl)))


class _SendWeights(TrainerCallback):
    """Keeps the old_policy pool at the trainer's weights: at the start and after every optimizer step."""

    def __init__(self, trainer: ServiceScoring) -> None:
        self.trainer, self.sender = trainer, None

    def _send(self) -> None:
        trainer = self.trainer
        if trainer.accelerator.is_main_process:
            if self.sender is None:
                self.sender = trainer.old_policy.pool.weight_sender()
            model = trainer.accelerator.unwrap_model(trainer.model)
            trainer.policy_version = self.sender.send(model.named_parameters())
        trainer.accelerator.wait_for_everyone()

    def on_train_begin(self, args, state, control, **kwargs):
        self._send()

    def on_step_end(self, args, state, control, **kwargs):
        self._send()

    def on_train_end(self, args, state, control, **kwargs):
        if self.sender is not None:
            self.sender.close()
            self.sender = None


class GRPOTrainer(ServiceScoring, trl.GRPOTrainer):
    """TRL's GRPOTrainer with `reference=` / `old_policy=` (see ServiceScoring)."""

    def _generate(self, prompts):
        generated = super()._generate(prompts)
        self.rollout_log_probs = generated[4]  # the engine's log-probs of each completion's tokens (vLLM), or None
        return generated


class RLOOTrainer(ServiceScoring, trl.RLOOTrainer):
    """TRL's RLOOTrainer with `reference=` / `old_policy=` (see ServiceScoring)."""

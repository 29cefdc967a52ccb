"""verl's reference role served by ppo-logprobs, against verl's own reference math in the trainer's process: GRPO
batches in verl's layout scored both ways, printing the time of each and the reference weights each side holds.

The service side is built as verl's RayPPOTrainer builds its `Role.RefPolicy` workers (the class from
`reference_worker`, fused by `create_colocated_worker_cls`, a RayWorkerGroup), and gets what verl 0.9's trainer
sends it (the batch without padding). verl's side is what its reference worker computes: the HF model's logits over
the padded batch, divided by the temperature, through `logprobs_from_logits`. Needs verl (`make
test-integrations` builds an environment with it: `.venv-integrations/bin/python examples/verl_reference.py`).

  python examples/verl_reference.py                          # CPU: the tiny model
  python examples/verl_reference.py --model /ckpt --steps 5  # one GPU: a checkpoint directory
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import ray
import torch
from verl import DataProto
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.single_controller.ray.base import create_colocated_worker_cls
from verl.trainer.ppo.utils import Role
from verl.utils import tensordict_utils as tu
from verl.utils.model import compute_position_id_with_mask
from verl.utils.torch_functional import logprobs_from_logits
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from ppo_logprobs.integrations.scoring import Service
from ppo_logprobs.integrations.verl import reference_worker, score_unpadded
from ppo_logprobs.workers import WorkerPool


def rollouts(prompts: int, group: int, prompt: int, response: int, vocab: int, seed: int) -> dict:
    """verl's padded batch: `prompts` prompts (left-padded to `prompt`), each with `group` responses (right-padded
    to `response`)."""
    g = np.random.default_rng(seed)
    ids, masks = [], []
    for _ in range(prompts):
        p = g.integers(2, vocab, g.integers(prompt // 4, prompt + 1))
        for _ in range(group):
            r = g.integers(2, vocab, g.integers(response // 4, response + 1))
            ids.append(np.concatenate([np.zeros(prompt - len(p)), p, r, np.zeros(response - len(r))]))
            masks.append(np.concatenate([np.zeros(prompt - len(p)), np.ones(len(p) + len(r)),
                                         np.zeros(response - len(r))]))
    input_ids, attention_mask = torch.tensor(np.array(ids)).long(), torch.tensor(np.array(masks)).long()
    return dict(input_ids=input_ids, attention_mask=attention_mask, prompts=input_ids[:, :prompt],
                responses=input_ids[:, prompt:], response_mask=attention_mask[:, prompt:],
                position_ids=compute_position_id_with_mask(attention_mask))


def verls_own(hf, batch: dict, temperature: float, device) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(**{k: batch[k].to(device) for k in ("input_ids", "attention_mask", "position_ids")}).logits
        width = batch["responses"].shape[1]
        return logprobs_from_logits(logits[:, -width - 1 : -1].float() / temperature, batch["responses"].to(device))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="'tiny' (built in) or a local checkpoint directory")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2, help="processes of the reference role")
    parser.add_argument("--temperature", type=float, default=0.9)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    prompts, group, prompt, response = (4, 8, 2048, 1024) if cuda else (2, 4, 16, 12)
    if args.model == "tiny":
        from ppo_logprobs.workers.models.load_model import _tiny_model

        hf = _tiny_model(None).to(device).eval()
    else:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto").to(device).eval()
    ray.init(num_cpus=args.ranks + 2, num_gpus=1 if cuda else 0, include_dashboard=False, log_to_driver=False)
    options = dict(num_gpus_per_worker=0.5) if cuda else dict(backend="torch")
    WorkerPool.create(args.model, 1, name="verl-example-ref", **options)
    roles = {Role.RefPolicy: ray.remote(reference_worker("verl-example-ref"))}  # the trainer's role mapping
    classes = {str(Role.RefPolicy): RayClassWithInitArgs(roles[Role.RefPolicy], config=None, role="ref")}
    group_of_ranks = RayWorkerGroup(resource_pool=RayResourcePool([args.ranks], use_gpu=False, max_colocate_count=1),
                                    ray_cls_with_init=create_colocated_worker_cls(class_dict=classes),
                                    device_name="cpu")
    ref = group_of_ranks.spawn(prefix_set=classes.keys())[str(Role.RefPolicy)]
    ref.init_model()
    times = {"service": [], "verl": [], "pool": [], "adapter": []}
    pool = WorkerPool.connect("verl-example-ref")
    worst = 0.0
    print(f"model {args.model} on {device}; {prompts} prompts x G={group}, prompts up to {prompt} tokens, responses "
          f"up to {response}; the reference role in {args.ranks} processes", flush=True)
    for step in range(-1, args.steps):  # step -1 warms every side up, untimed
        # each side gets a batch of its own, as each trainer step brings one the workers have not seen (a batch
        # scored right after another side scored it would find its shapes planned and compiled)
        batch, other, third = (rollouts(prompts, group, prompt, response, hf.config.vocab_size, seed=3 * step + k)
                               for k in (3, 4, 5))
        # (verl's trainer makes the no-padding batch for any reference worker: not timed)
        data, data3 = (left_right_2_no_padding(DataProto.from_dict(tensors=b).to_tensordict()) for b in (batch, third))
        for d in (data, data3):
            tu.assign_non_tensor(d, temperature=args.temperature, calculate_entropy=False, compute_loss=False)
        start = time.perf_counter()
        out = ref.compute_ref_log_prob(data)
        times["service"].append(time.perf_counter() - start)
        served = no_padding_2_padding(tu.get(out, "log_probs"), data)  # (verl's trainer does this for any worker)
        mask = other["attention_mask"].bool()
        seqs = [row[m].tolist() for row, m in zip(other["input_ids"], mask, strict=True)]
        start = time.perf_counter()
        pool.compute_log_probs(seqs, other["attention_mask"][:, :prompt].sum(1).tolist(), temperature=args.temperature,
                               return_entropy=False)
        times["pool"].append(time.perf_counter() - start)
        start = time.perf_counter()
        score_unpadded(Service(pool), data3)  # the adapter without verl's worker group
        times["adapter"].append(time.perf_counter() - start)
        start = time.perf_counter()
        own = verls_own(hf, batch, args.temperature, device)
        if cuda:
            torch.cuda.synchronize()
        times["verl"].append(time.perf_counter() - start)
        if step < 0:
            times = {k: [] for k in times}
            continue
        mask = batch["response_mask"].bool()
        worst = max(worst, float((served[mask] - own.cpu()[mask]).abs().max()))
    held = sum(p.numel() * p.element_size() for p in hf.parameters()) / 2**30
    result = dict(model=args.model, device=str(device), max_abs_difference=worst, verl_reference_gib=held,
                  **{f"{side}_s": statistics.median(t) for side, t in times.items()})
    print(f"\n{'reference':<32}{'s a batch (median)':>20}{'weights in the trainer GiB':>28}")
    print(f"{'verl (the HF model here)':<32}{result['verl_s']:>20.3f}{held:>28.3f}")
    print(f"{'ppo-logprobs (RefPolicy role)':<32}{result['service_s']:>20.3f}{0:>28.3f}")
    print(f"{'the adapter, no worker group':<32}{result['adapter_s']:>20.3f}")
    print(f"{'the pool directly, a like batch':<32}{result['pool_s']:>20.3f}")
    print(f"largest |service - verl| over the response tokens: {worst:.2e}")
    ray.shutdown()
    return result


if __name__ == "__main__":
    main()

"""TRL's GRPOTrainer with its reference log-probs from ppo-logprobs, against TRL's own reference model on the trainer:
the same GRPO steps both ways, printing each way's step time and the trainer's memory.

The rollouts are a fixed set (random token ids, the same in both runs: generation is not what is compared), G
completions per prompt; a made-up reward (the share of even ids) gives GRPO something to learn. With the service,
the reference is a WorkerPool of the same checkpoint in this process's Ray (on a GPU: sharing it with the trainer),
and the trainer builds no reference model. After the steps, one batch is scored both through the adapter and by
`WorkerPool.compute_log_probs` directly, to show what the adapter adds.

  python examples/grpo_trl.py                                    # CPU: the tiny model, 3 steps each way
  python examples/grpo_trl.py --model /ckpt/qwen2.5-1.5b          # one GPU: a checkpoint directory
  python examples/grpo_trl.py --shape qwen2.5-1.5b --out r.json   # one GPU: random weights of that shape
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import zlib

import numpy as np
import ray
import torch
import trl
from datasets import Dataset
from transformers import PreTrainedTokenizerFast, TrainerCallback

from ppo_logprobs.integrations.scoring import unpad
from ppo_logprobs.integrations.trl import GRPOTrainer
from ppo_logprobs.workers import WorkerPool

SHAPES = {  # random weights of a real model's shape (Qwen2ForCausalLM)
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                         tie_word_embeddings=True, rope_theta=1e6),
}


def checkpoint(model: str, shape: str | None, where: str) -> str:
    """A directory holding the model and a word-level tokenizer of its ids ("t0" pads, "t1" ends)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if shape is not None:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            torch.manual_seed(0)
            Qwen2ForCausalLM(Qwen2Config(**SHAPES[shape], dtype="bfloat16")).to(torch.bfloat16).save_pretrained(where)
        vocab = SHAPES[shape]["vocab_size"]
    elif model == "tiny":
        from ppo_logprobs.workers.models.load_model import _tiny_model

        _tiny_model(None).save_pretrained(where)
        vocab = AutoConfig.from_pretrained(where).vocab_size
    else:
        AutoModelForCausalLM.from_pretrained(model).save_pretrained(where)  # (a local directory: nothing fetched)
        vocab = AutoConfig.from_pretrained(where).vocab_size
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t0", eos_token="t1").save_pretrained(
        where)
    return where


def rollout_func(vocab: int, prompt: tuple[int, int], response: tuple[int, int]):
    """TRL's rollout hook: each prompt's ids drawn from its text (so a group shares them), each completion's from
    the prompt and its place in the batch; the same in every run."""

    def rollouts(prompts: list[str], trainer) -> dict:
        prompt_ids, completion_ids = [], []
        for i, text in enumerate(prompts):
            g = np.random.default_rng(zlib.crc32(text.encode()))
            prompt_ids.append(g.integers(2, vocab, g.integers(prompt[0], prompt[1] + 1)).tolist())
            g = np.random.default_rng([zlib.crc32(text.encode()), i, trainer.state.global_step])
            completion_ids.append(g.integers(2, vocab, g.integers(response[0], response[1] + 1)).tolist())
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    return rollouts


def even_share(completion_ids, **_) -> list[float]:
    return [float(np.mean(np.asarray(c) % 2 == 0)) for c in completion_ids]


class StepClock(TrainerCallback):
    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - self.start)


def run(cls, path: str, args: argparse.Namespace, sizes: dict, **service):
    """Some GRPO steps: the step times after the first, the trainer's peak memory and its reference's bytes; and
    the trainer."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=not cuda, bf16=cuda, per_device_train_batch_size=sizes["batch"],
        num_generations=args.group, max_completion_length=sizes["response"][1], beta=args.beta, learning_rate=1e-6,
        max_steps=args.steps, logging_steps=1, report_to=[], save_strategy="no", seed=0,
        gradient_checkpointing=cuda, disable_tqdm=True)
    prompts = Dataset.from_dict({"prompt": [f"prompt {i}" for i in range(64)]})
    clock = StepClock()
    trainer = cls(model=path, reward_funcs=even_share, args=config, train_dataset=prompts,
                  processing_class=PreTrainedTokenizerFast.from_pretrained(path), callbacks=[clock],
                  rollout_func=rollout_func(sizes["vocab"], sizes["prompt"], sizes["response"]), **service)
    ref = trainer.ref_model
    ref_bytes = sum(p.numel() * p.element_size() for p in ref.parameters()) if isinstance(ref, torch.nn.Module) else 0
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    kls = [row.get("kl") for row in trainer.state.log_history if "loss" in row]
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    used = (torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]) / 2**30 if cuda else None
    result = dict(step_s=statistics.median(clock.seconds[1:]) if len(clock.seconds) > 1 else clock.seconds[0],
                  step_times=clock.seconds, trainer_peak_gib=peak, gpu_in_use_gib=used,
                  reference_on_trainer_gib=ref_bytes / 2**30, loss=losses, kl=kls)
    return result, trainer


def adapter_against_pool(trainer: GRPOTrainer, pool: WorkerPool, sizes: dict, group: int, repeats: int) -> dict:
    """One GRPO-shaped batch in TRL's layout (prompts left-padded, completions right-padded) scored through the
    trainer's hook (unpadding, the call, padding back) and by the pool directly on the same token lists; the
    median seconds of each, and whether the two agree bit for bit."""
    g = np.random.default_rng(0)
    width_p, width_c = sizes["prompt"][1], sizes["response"][1]
    ids = torch.zeros((sizes["batch"], width_p + width_c), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b in range(sizes["batch"]):
        if b % group == 0:
            prompt = torch.from_numpy(g.integers(2, sizes["vocab"], g.integers(sizes["prompt"][0], width_p + 1)))
        completion = torch.from_numpy(g.integers(2, sizes["vocab"], g.integers(sizes["response"][0], width_c + 1)))
        ids[b, width_p - len(prompt) : width_p], mask[b, width_p - len(prompt) : width_p] = prompt, 1
        ids[b, width_p : width_p + len(completion)], mask[b, width_p : width_p + len(completion)] = completion, 1
    rows = unpad(ids, mask, width_c)
    times = {"adapter": [], "pool": []}
    for _ in range(repeats + 1):  # (the first of each is a warm-up)
        start = time.perf_counter()
        via, _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask, width_c)
        times["adapter"].append(time.perf_counter() - start)
        start = time.perf_counter()
        direct = pool.compute_log_probs(rows.seqs, rows.starts, return_entropy=False)
        times["pool"].append(time.perf_counter() - start)
    same = all(np.array_equal(via[b, rows.columns[b]].cpu().numpy(), r.log_probs)
               for b, r in zip(rows.sent, direct, strict=True))
    adapter, direct_s = statistics.median(times["adapter"][1:]), statistics.median(times["pool"][1:])
    return dict(adapter_s=adapter, pool_s=direct_s, ratio=direct_s / adapter, tokens=int(mask.sum()),
                bitwise_equal=same)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="'tiny' (built in) or a local checkpoint directory")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="random weights of this shape instead of --model")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--group", type=int, default=None, help="completions per prompt (default: 4 CPU, 8 GPU)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of the adapter-against-pool check")
    parser.add_argument("--out", help="write the figures here (JSON)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    args.group = args.group or (8 if cuda else 4)
    sizes = dict(prompt=(512, 2048) if cuda else (6, 20), response=(256, 1024) if cuda else (4, 12),
                 batch=args.prompts * args.group)
    if not cuda:
        torch.set_num_threads(1)
    path = checkpoint(args.model, args.shape, tempfile.mkdtemp())
    sizes["vocab"] = PreTrainedTokenizerFast.from_pretrained(path).vocab_size
    print(f"model {args.shape or args.model} on {'cuda' if cuda else 'cpu'}: {args.steps} GRPO steps each way, "
          f"{args.prompts} prompts x G={args.group}, prompts {sizes['prompt']} tokens, responses {sizes['response']}",
          flush=True)
    own, trainer = run(trl.GRPOTrainer, path, args, sizes)
    del trainer
    ray.init(num_cpus=4, num_gpus=1 if cuda else 0, include_dashboard=False, log_to_driver=False)
    # the reference: WorkerPool.create's defaults, but a half GPU (the trainer holds the other half) and, on the
    # CPU, the torch backend (Triton's interpreter would be slow)
    options = dict(num_gpus_per_worker=0.5) if cuda else dict(backend="torch")
    pool = WorkerPool.create(path, 1, **options)
    served, trainer = run(GRPOTrainer, path, args, sizes, reference=pool)
    check = adapter_against_pool(trainer, pool, sizes, args.group, args.repeats)
    pool.shutdown()
    ray.shutdown()
    result = dict(model=args.shape or args.model, device="cuda" if cuda else "cpu", steps=args.steps,
                  group=args.group, prompts=args.prompts, sizes=sizes, beta=args.beta, pool_options=options,
                  trl=trl.__version__, reference_on_trainer=own, reference_from_service=served, adapter=check)
    print(f"\n{'reference':<22}{'step s':>9}{'trainer peak GiB':>18}{'GPU in use GiB':>16}{'ref on trainer GiB':>20}")
    for name, r in (("on the trainer (TRL)", own), ("from the service", served)):
        peak = "-" if r["trainer_peak_gib"] is None else f"{r['trainer_peak_gib']:.2f}"
        used = "-" if r["gpu_in_use_gib"] is None else f"{r['gpu_in_use_gib']:.2f}"
        print(f"{name:<22}{r['step_s']:>9.3f}{peak:>18}{used:>16}{r['reference_on_trainer_gib']:>20.3f}")
    print(f"losses: TRL {[round(x, 6) for x in own['loss']]}, service {[round(x, 6) for x in served['loss']]}")
    print(f"one batch of {check['tokens']} tokens: adapter {check['adapter_s'] * 1e3:.1f} ms, pool directly "
          f"{check['pool_s'] * 1e3:.1f} ms (ratio {check['ratio']:.3f}), bitwise equal: {check['bitwise_equal']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()

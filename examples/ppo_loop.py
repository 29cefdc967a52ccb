"""A PPO loop that uses ppo-logprobs as its old-policy and reference scorer, in the shape RL trainers have.

The trainer (this process) holds the policy on its device with AdamW. Each step it:
1. takes a batch of rollouts (fixed prompts and responses with a made-up reward: the share of even token ids in
   the response, so that training moves the policy somewhere),
2. gets old-policy log-probs from the policy pool (or over HTTP from the gateway's /logprobs, as rollout workers
   would: --http) and reference log-probs from the reference pool, both at once,
3. runs the clipped PPO loss with a KL penalty to the reference (k3) over minibatches, for --epochs passes,
   computing its new log-probs with LogProbWorker(model).log_probs_with_grad: the workers' own forward,
4. sends the new weights to the policy pool through the open `weight_sender()`.

At the first minibatch of each step the policy has not changed since it was scored, so new == old and the ratio
must be 1. In the invariant mode (the default) it is exactly 1.0 on every token; --fast shows what bf16 noise does
without it. On the CPU the bits match only for the same batch (docs/exactness.md): there the first minibatch is the
whole batch, which is what the workers scored.

  python examples/ppo_loop.py                                  # CPU: the tiny model, 3 steps
  python examples/ppo_loop.py --model /tmp/q15 --steps 5       # one GPU, bf16 (a directory with a config)
  python examples/ppo_loop.py --model /tmp/q15 --fast          # without batch invariance
  python examples/ppo_loop.py --http                           # old log-probs through the gateway
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed

import numpy as np
import ray
import torch

from ppo_logprobs.workers import LogProbWorker, WorkerPool, load_model


def rollouts(n: int, prompt: int, longest: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """n prompt + response token lists (responses of 1/4 to all of `longest` tokens) and the prompt lengths."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(1, longest // 4), longest + 1, size=n)
    seqs = [rng.integers(0, vocab, size=prompt + int(k)).tolist() for k in lengths]
    return seqs, [prompt] * n


def rewards(seqs: list[list[int]], starts: list[int]) -> torch.Tensor:
    return torch.tensor([float(np.mean(np.asarray(s[p:]) % 2 == 0)) for s, p in zip(seqs, starts, strict=True)])


_HTTP = ThreadPoolExecutor(1)  # the HTTP client's calls, made beside the reference pool's


def scored_async(pool: WorkerPool, client, seqs, starts) -> Future:
    """The scores, to come: the pool's call, or (HTTP) the client's, in a thread."""
    if client is None:
        return pool.compute_log_probs_async(seqs, starts, return_entropy=False).future()
    return _HTTP.submit(client.score, seqs, starts, return_entropy=False)


def wait_each(futures: dict[str, Future], start: float) -> tuple[dict, dict]:
    """Each future's result, and the seconds from `start` until it was in."""
    names = {future: name for name, future in futures.items()}
    results, seconds = {}, {}
    for future in as_completed(names):
        results[names[future]], seconds[names[future]] = future.result(), time.perf_counter() - start
    return results, seconds


def ppo_step(trainer: LogProbWorker, optimizer, seqs, starts, old, ref, advantages, *, minibatches: int,
             epochs: int, clip: float, kl_coef: float, device) -> tuple[list[dict], float]:
    """The clipped PPO loss with a k3 KL penalty, `epochs` passes of `minibatches` minibatches. Returns the ratio
    statistics of each minibatch and the mean loss."""
    order = np.arange(len(seqs))
    stats, losses = [], []
    for _ in range(epochs):
        for part in np.array_split(order, minibatches):
            new, _ = trainer.log_probs_with_grad([seqs[i] for i in part], [starts[i] for i in part])
            new = torch.cat(new)
            old_mb = torch.from_numpy(np.concatenate([old[i] for i in part])).to(device)
            ref_mb = torch.from_numpy(np.concatenate([ref[i] for i in part])).to(device)
            adv = torch.repeat_interleave(advantages[part].to(device), torch.tensor([len(old[i]) for i in part],
                                                                                   device=device))
            ratio = torch.exp(new.float() - old_mb)
            pg = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
            log_ref_ratio = ref_mb - new.float()
            kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
            loss = (pg + kl_coef * kl).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            off = (ratio.detach() - 1).abs()
            stats.append(dict(max_abs_ratio_minus_1=float(off.max()), share_not_1=float((off != 0).float().mean())))
            losses.append(float(loss.detach()))
    return stats, float(np.mean(losses))


def start_gateway(model: str, options: dict, gpus: float):
    """The service in this process's Ray (Serve on a free loopback port), its policy model at `model`."""
    import socket

    from ray import serve

    from ppo_logprobs.client import LogProbClient, connect_pool
    from ppo_logprobs.service import Settings
    from ppo_logprobs.service.app import build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    settings = Settings(models={"policy": model}, pool_name="ppo-loop", gpus_per_worker=gpus or None,
                        **{k: str(v).removeprefix("torch.") for k, v in options.items()})
    serve.run(build_app(settings), name="ppo-loop", route_prefix="/")
    return connect_pool("policy", service="ppo-loop"), LogProbClient(f"http://127.0.0.1:{port}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="'tiny' (built in) or a local checkpoint directory")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rollouts", type=int, default=None, help="per step (default: 16 on the CPU, 64 on a GPU)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default: 8 on the CPU, 256 on a GPU)")
    parser.add_argument("--response", type=int, default=None,
                        help="longest response (default: 24 on the CPU, 1024 on a GPU)")
    parser.add_argument("--minibatches", type=int, default=None, help="per epoch (default: 1 on the CPU, 4 on a GPU)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--kl-coef", type=float, default=0.01)
    parser.add_argument("--fast", action="store_true", help="the fast mode: not batch invariant")
    parser.add_argument("--http", action="store_true", help="old log-probs from the gateway's /logprobs")
    parser.add_argument("--out", help="write the per-step figures here (JSON)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    rollouts_n = args.rollouts or (64 if cuda else 16)
    prompt, response = args.prompt or (256 if cuda else 8), args.response or (1024 if cuda else 24)
    minibatches = args.minibatches or (4 if cuda else 1)
    options = dict(dtype=torch.bfloat16) if cuda else dict(backend="torch")
    if args.fast:
        options["invariant"] = False

    if not cuda:  # a CPU's BLAS may sum differently with more threads; a worker actor of one CPU runs one
        torch.set_num_threads(1)
    trainer_model = load_model(args.model, device=device, **options)
    trainer = LogProbWorker(trainer_model)  # the workers' forward, with gradients, in this process
    optimizer = torch.optim.AdamW(trainer_model.parameters(), lr=args.lr, fused=cuda)
    vocab = trainer_model.config.vocab_size
    initial = {n: p.detach().clone() for n, p in trainer_model.named_parameters()}

    ray.init(num_cpus=max(4, torch.get_num_threads()), include_dashboard=False, log_to_driver=False)
    share = 0.5 if cuda else 0  # one GPU: the two pools share it with this process
    if args.http:
        policy, client = start_gateway(args.model, {k: v for k, v in options.items() if k != "invariant"}, share)
    else:
        policy = WorkerPool.create(args.model, 1, num_gpus_per_worker=share, **options)
        client = None
    reference = WorkerPool.create(args.model, 1, num_gpus_per_worker=share, **options)
    sender = policy.weight_sender()
    print(f"model {args.model} on {device}, {'fast' if args.fast else 'invariant'} mode, "
          f"old log-probs {'over HTTP' if args.http else 'from the pool'}; {rollouts_n} rollouts of {prompt} + up to "
          f"{response} tokens, {minibatches} minibatches x {args.epochs} epochs", flush=True)
    print(f"{'step':>4}{'policy s':>10}{'ref s':>8}{'train s':>9}{'sync s':>8}{'sync %':>8}{'loss':>10}"
          f"{'max|r-1|':>11}{'r != 1':>8}{'version':>8}", flush=True)
    steps = []
    for step in range(args.steps):
        start = time.perf_counter()
        seqs, starts = rollouts(rollouts_n, prompt, response, vocab, seed=step)
        asked = time.perf_counter()
        scored, seconds = wait_each(dict(policy=scored_async(policy, client, seqs, starts),
                                         reference=scored_async(reference, None, seqs, starts)), asked)
        versions = {r.weights_version for r in scored["policy"]}
        assert versions == {step}, f"old log-probs of weights version {versions}, expected {step}"
        old = [r.log_probs for r in scored["policy"]]
        ref = [r.log_probs for r in scored["reference"]]
        reward = rewards(seqs, starts)
        advantages = (reward - reward.mean()) / (reward.std() + 1e-6)
        trained = time.perf_counter()
        stats, loss = ppo_step(trainer, optimizer, seqs, starts, old, ref, advantages, minibatches=minibatches,
                               epochs=args.epochs, clip=args.clip, kl_coef=args.kl_coef, device=device)
        optimizer.zero_grad(set_to_none=True)  # (the gradients are not needed until the next step)
        if cuda:  # give back what training cached, so the policy worker can stage the update on the GPU we share
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        synced = time.perf_counter()
        version = sender.send(trainer_model.named_parameters())
        done = time.perf_counter()
        row = dict(step=step, policy_s=seconds["policy"], reference_s=seconds["reference"],
                   train_s=synced - trained, sync_s=done - synced, step_s=done - start, loss=loss, version=version,
                   first_minibatch=stats[0], minibatches=stats)
        steps.append(row)
        print(f"{step:>4}{row['policy_s']:>10.3f}{row['reference_s']:>8.3f}{row['train_s']:>9.3f}"
              f"{row['sync_s']:>8.3f}{100 * row['sync_s'] / row['step_s']:>8.2f}{loss:>10.4f}"
              f"{stats[0]['max_abs_ratio_minus_1']:>11.3g}{stats[0]['share_not_1']:>8.1%}{version:>8}", flush=True)
    sender.close()
    changed = sum(not torch.equal(p.detach(), initial[n]) for n, p in trainer_model.named_parameters())
    result = dict(model=args.model, device=str(device), mode="fast" if args.fast else "invariant", http=args.http,
                  rollouts=rollouts_n, prompt=prompt, response=response, minibatches=minibatches, epochs=args.epochs,
                  lr=args.lr, parameters_changed=changed, steps=steps,
                  max_first_minibatch_ratio_off=max(s["first_minibatch"]["max_abs_ratio_minus_1"] for s in steps))
    print(f"max |ratio - 1| at the first minibatch over all steps: {result['max_first_minibatch_ratio_off']:.3g}; "
          f"{changed} parameter tensors changed; pool at weights version {policy.weights_version}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    for pool in (reference, *(() if args.http else (policy,))):
        pool.shutdown()
    if args.http:
        from ppo_logprobs.service.app import shut_down_serve

        shut_down_serve()
    ray.shutdown()
    return result


if __name__ == "__main__":
    main()

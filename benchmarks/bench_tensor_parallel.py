"""Tensor parallelism (issue 12), one process per GPU (torch.multiprocessing, NCCL; gloo on the CPU):

- a Llama-3-70B-shaped model (80 layers, hidden 8192, 64 / 8 heads, MLP 28672, vocabulary 128256), random bf16
  weights built per rank (`build_sharded`: no 70B checkpoint needed), TP = 2: 8 x 4096 tokens scored; tokens/s,
  memory per GPU, and tokens/s x parameters against the 7B shape on one GPU in the same run;
- the Qwen2.5-7B shape: TP = 2 over both GPUs against two TP = 1 models, one per GPU, scoring at once;
- the head alone, N x H x V = 8192 x 8192 x 128256: vocab-parallel over both GPUs (half the rows each) against
  the single-GPU head, and the cuBLAS product hidden @ weight.T of each (the floor), forward.

Timing: median of 3 after one warm-up, each pass between barriers (the slowest rank's time).

  python benchmarks/bench_tensor_parallel.py --out tp.json     # nvidia-h200-x2
  python benchmarks/bench_tensor_parallel.py --tiny            # CPU dry run: 2 gloo ranks, small shapes
  python benchmarks/bench_tensor_parallel.py --one-gpu         # one H200: both 70B ranks on it (see below)

--one-gpu checks that the 70B shape builds, fits and scores at TP = 2 where only one GPU is lent: both ranks share
cuda:0 (half of 139 GiB each) and talk through gloo (host memory), scoring 8 x 4096 tokens one sequence per
forward. It reports memory per rank and that the ranks agree; its time says nothing about TP on two GPUs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from ppo_logprobs.workers import fused_log_probs
from ppo_logprobs.workers.models.patch_model import patch_model
from ppo_logprobs.workers.models.tensor_parallel import build_sharded, connect

LLAMA3_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                  tie_word_embeddings=False)
QWEN25_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1e6,
                 tie_word_embeddings=False)
TINY_70B = dict(LLAMA3_70B, vocab_size=1001, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=2)
TINY_7B = dict(QWEN25_7B, vocab_size=1003, hidden_size=56, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)


def timed(fn, device, reps: int, together: bool = True) -> float:
    """Median seconds of `reps` passes after one warm-up; each pass between barriers (the slowest rank), unless
    this rank times alone (`together` False)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        if together:
            dist.barrier()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if together:
            dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def score(config: dict, rank: int, size: int, group, device, dtype, tokens: tuple[int, int], reps: int) -> dict:
    """Builds this rank's part of the model (size 1: the whole model, alone on this device) and times scoring."""
    cls = LlamaConfig if config["hidden_size"] in (8192, 64) else Qwen2Config
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(cls(**config)).parameters())
    model = build_sharded(cls(**config), rank, size, device=device, dtype=dtype)
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if group is not None:
        connect(model, group)
    patch_model(model, backend="auto" if device.type == "cuda" else "torch", process_group=group)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config["vocab_size"], tokens, generator=g).to(device)
    with torch.no_grad():
        out = model(input_ids=ids)
        assert torch.isfinite(out.log_probs).all()
        seconds = timed(lambda: model(input_ids=ids), device, reps)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    model = out = None  # freed before the next case builds its own
    gc.collect()  # (a connected model's forwards hold it in a cycle)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(seconds=seconds, tokens_per_s=tokens[0] * tokens[1] / seconds, params=params,
                weights_gib=weights / 2**30, peak_gib=peak / 2**30)


def head(rank: int, size: int, group, device, dtype, shape: tuple[int, int, int], reps: int) -> dict:
    n, h, v = shape
    g = torch.Generator(device=device).manual_seed(1)
    hidden = torch.randn(n, h, device=device, dtype=dtype, generator=g)
    weight = torch.randn(v, h, device=device, dtype=dtype, generator=g) / h**0.5
    labels = torch.randint(0, v, (n,), device=device, generator=g)
    rows = torch.tensor_split(torch.arange(v, device=device), size)[rank]
    mine = weight[rows].contiguous()
    backend = "auto" if device.type == "cuda" else "torch"
    with torch.no_grad():
        split = timed(lambda: fused_log_probs(hidden, mine, labels, process_group=group, backend=backend), device, reps)
        split_gemm = timed(lambda: hidden @ mine.T, device, reps)
        whole = timed(lambda: fused_log_probs(hidden, weight, labels, backend=backend), device, reps)
        whole_gemm = timed(lambda: hidden @ weight.T, device, reps)
    return dict(vocab_parallel_s=split, its_gemm_s=split_gemm, single_device_s=whole, single_gemm_s=whole_gemm,
                speedup=whole / split, vocab_parallel_over_gemm=split / split_gemm)


def fits(rank: int, group, device, dtype, config: dict, tokens: tuple[int, int]) -> dict:
    """--one-gpu: this rank's part of the model built, and each sequence scored in a forward of its own."""
    model = build_sharded(LlamaConfig(**config), rank, 2, device=device, dtype=dtype)
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    patch_model(connect(model, group), backend="auto" if device.type == "cuda" else "torch", process_group=group)
    ids = torch.randint(0, config["vocab_size"], tokens, generator=torch.Generator().manual_seed(0)).to(device)
    start = time.perf_counter()
    with torch.no_grad():
        log_probs = torch.cat([model(input_ids=row[None]).log_probs for row in ids])
    every = [torch.empty_like(log_probs) for _ in range(2)]
    dist.all_gather(every, log_probs)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return dict(scored_tokens=log_probs.numel(), finite=bool(torch.isfinite(log_probs).all()),
                ranks_agree=bool(torch.equal(every[0], every[1])), seconds=time.perf_counter() - start,
                weights_gib=weights / 2**30, peak_gib=peak / 2**30)


def head_halves(device, dtype, shape: tuple[int, int, int], reps: int) -> dict:
    """--one-gpu: the head's work on one rank of two (half the vocabulary rows, no group: the combine, one
    all-gather of 3 floats a token, is not in it) against the whole head, each beside its cuBLAS GEMM."""
    n, h, v = shape
    g = torch.Generator(device=device).manual_seed(1)
    hidden = torch.randn(n, h, device=device, dtype=dtype, generator=g)
    weight = torch.randn(v, h, device=device, dtype=dtype, generator=g) / h**0.5
    labels = torch.randint(0, v // 2, (n,), device=device, generator=g)
    half = weight[: -(-v // 2)].contiguous()
    backend = "auto" if device.type == "cuda" else "torch"
    out = {}
    with torch.no_grad():
        for name, w in (("half", half), ("whole", weight)):
            head = lambda w=w: fused_log_probs(hidden, w, labels, backend=backend)  # noqa: E731
            out[f"{name}_head_s"] = timed(head, device, reps, together=False)
            out[f"{name}_gemm_s"] = timed(lambda w=w: hidden @ w.T, device, reps, together=False)
    return out


def run(rank: int, port: int, args) -> None:
    cuda = not args.tiny
    device = torch.device("cuda", 0 if args.one_gpu else rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    nccl = cuda and not args.one_gpu
    dist.init_process_group("nccl" if nccl else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, device_id=device if nccl else None)
    world = dist.group.WORLD
    dtype = torch.bfloat16 if cuda else torch.float32
    tokens = (8, 4096) if cuda else (2, 32)
    reps = 3 if cuda else 1
    results = {}
    if args.one_gpu:
        try:
            mine = fits(rank, world, device, dtype, TINY_70B if args.tiny else LLAMA3_70B, tokens)
            every = [None, None]
            dist.all_gather_object(every, mine)
            gc.collect()  # (the connected model's forwards hold it in a cycle)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            dist.barrier()  # both models freed; rank 1 then waits at the last barrier, the GPU rank 0's alone
            if rank == 0:
                halves = head_halves(device, dtype, (8192, 8192, 128256) if cuda else (64, 48, 1001), 10 * reps)
                out = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__, ranks=every, head=halves)
                print(json.dumps(out, indent=1), flush=True)
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump(out, f, indent=1)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        return
    def note(name: str, value: dict) -> None:
        results[name] = value
        if rank == 0:  # (as each case ends, in case a run is cut short)
            print(name, json.dumps(value), flush=True)

    try:
        note("7B shape, TP = 1, one model per GPU, both at once",
             score(TINY_7B if args.tiny else QWEN25_7B, 0, 1, None, device, dtype, tokens, reps))
        note("7B shape, TP = 2",
             score(TINY_7B if args.tiny else QWEN25_7B, rank, 2, world, device, dtype, tokens, reps))
        if not args.skip_70b:
            note("70B shape, TP = 2",
                 score(TINY_70B if args.tiny else LLAMA3_70B, rank, 2, world, device, dtype, tokens, reps))
        note("head", head(rank, 2, world, device, dtype, (8192, 8192, 128256) if cuda else (64, 48, 1001), reps))
        every = [None, None]
        dist.all_gather_object(every, results)
        if rank == 0:
            report(every, args)
    finally:
        dist.destroy_process_group()


def report(every: list[dict], args) -> None:
    r0 = every[0]
    one = r0["7B shape, TP = 1, one model per GPU, both at once"]  # passes end at a barrier: one time for both
    out = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__, tiny=args.tiny,
               gpus=[torch.cuda.get_device_name(i) for i in range(2)] if not args.tiny else None, ranks=every)
    lines = [f"7B shape, 2 x TP = 1: {2 * one['tokens_per_s']:,.0f} tokens/s (each GPU {one['tokens_per_s']:,.0f})",
             f"7B shape, TP = 2: {r0['7B shape, TP = 2']['tokens_per_s']:,.0f} tokens/s"]
    if "70B shape, TP = 2" in r0:
        big = r0["70B shape, TP = 2"]
        # per GPU: tokens/s x parameters over 2 GPUs, against the same on one GPU for the 7B shape
        ratio = big["tokens_per_s"] * big["params"] / 2 / (one["tokens_per_s"] * one["params"])
        out["70B_tokens_x_params_per_gpu_over_7B"] = ratio
        lines.append(f"70B shape ({big['params'] / 1e9:.1f}B), TP = 2: {big['tokens_per_s']:,.0f} tokens/s; weights "
                     f"{[round(r['70B shape, TP = 2']['weights_gib'], 1) for r in every]} GiB, peak "
                     f"{[round(r['70B shape, TP = 2']['peak_gib'], 1) for r in every]} GiB per GPU; tokens/s x "
                     f"parameters per GPU against the 7B shape ({one['params'] / 1e9:.1f}B) on one GPU: {ratio:.0%}")
    hd = r0["head"]
    lines.append(f"head: vocab-parallel {hd['vocab_parallel_s'] * 1e3:.1f} ms (its half GEMM "
                 f"{hd['its_gemm_s'] * 1e3:.1f} ms), one GPU {hd['single_device_s'] * 1e3:.1f} ms (GEMM "
                 f"{hd['single_gemm_s'] * 1e3:.1f} ms): {hd['speedup']:.2f}x")
    out["summary"] = lines
    print("\n".join(lines), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: gloo, small shapes")
    parser.add_argument("--skip-70b", action="store_true")
    parser.add_argument("--one-gpu", action="store_true", help="the 70B shape's two ranks on one GPU (gloo)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if not args.tiny and not args.one_gpu and torch.cuda.device_count() < 2:
        raise SystemExit("needs two GPUs (nvidia-h200-x2); --tiny runs the CPU dry run")
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(port, args), nprocs=2)


if __name__ == "__main__":
    main()

"""Mixture of experts (issue 24): the Qwen3-30B-A3B shape with random bf16 weights, scoring 8 x 4096 tokens and
mixed-length rollouts: our patched model through LogProbWorker.score (its defaults) against HF's own forward (logits,
then log_softmax) with its experts as `grouped_mm` and as `eager` loops, in one run; the active-parameter FLOP
floor beside them (2 x active parameters x tokens at the same run's bf16 GEMM rate). Also how many sequences'
results differ between scored alone and packed with the others (the invariant mode promises none), and on CUDA
the memory a call allocates at its peak beyond the weights, ours and HF grouped_mm's. The floor's GEMM and our call
each run back to back for --warmup seconds (3) before they are timed, past a GPU's first second of load.

  python benchmarks/bench_moe.py --out moe.json         # one H200
  python benchmarks/bench_moe.py --tiny                 # a CPU dry run, tiny config
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from ppo_logprobs.workers import LogProbWorker, patch_model
from ppo_logprobs.workers.models import grouped_gemm as gg
from ppo_logprobs.workers.models.fuse_body import unfuse_body

QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
                     rope_theta=1e6, tie_word_embeddings=False)
TINY = dict(vocab_size=503, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            max_position_embeddings=4096, tie_word_embeddings=False)


def build(config: dict, device: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """The model with random weights, the same bits for the same seed in any process."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config, attn_implementation="sdpa")).eval()
    finally:
        torch.set_default_dtype(default)
    return random_weights(model, seed)


def random_weights(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter drawn from N(0, 0.02) after seeding: the same bits for the same seed in any process."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def active_parameters(config: dict) -> int:
    """Parameters a token's forward multiplies by: attention, the router, its k experts, the head."""
    h, heads, kv, d = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], \
        config["head_dim"]
    attention = h * d * (heads + 2 * kv) + heads * d * h
    experts = config["num_experts_per_tok"] * 3 * h * config["moe_intermediate_size"]
    return config["num_hidden_layers"] * (attention + config["num_experts"] * h + experts) + config["vocab_size"] * h


def timed(fn, cuda: bool, reps: int) -> float:
    fn()
    seconds = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds))


def peak_extra_gib(fn) -> float:
    """GiB allocated at the peak of one call of fn beyond what was allocated before it (CUDA)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def hf_scores(model, seqs: list[list[int]], device: str):
    """HF's forward (its own experts implementation), one padded batch: logits, log_softmax, the labels' log-probs."""
    longest = max(map(len, seqs))
    ids = torch.zeros(len(seqs), longest, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    with torch.no_grad():
        logits = type(model).forward(model, input_ids=ids, attention_mask=mask).logits
        # a row at a time: float32 log-softmax of all 12 padded rollouts at once would not fit beside the weights
        return [logits[b, :-1].float().log_softmax(-1).gather(-1, ids[b, 1:, None]) for b in range(len(seqs))]


def host_waits(fn) -> dict[str, int]:
    """The Python lines where one call of fn waits for the device (torch's sync debug mode), printed and returned
    (line: times)."""
    import collections
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    torch.cuda.set_sync_debug_mode(0)
    where = collections.Counter(f"{w.filename.split('site-packages/')[-1]}:{w.lineno}" for w in caught
                                if "synchroniz" in str(w.message))
    print("host waits on the device (synchronizing calls in one call):", flush=True)
    for line, n in where.most_common(15):
        print(f"  {n:5d}  {line}", flush=True)
    return dict(where.most_common(15))


def device_gaps(prof) -> dict:
    """Where the device waits for the host in a profiled call: from the first host op to the first kernel, idle time
    between kernels (by the kernel that ends each wait), printed and returned (ms)."""
    import collections
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "kernel")
    host = min(e["ts"] for e in events if e.get("cat") == "cpu_op")
    idle, after = 0.0, collections.Counter()
    for (_, end, _), (start, _, name) in zip(kernels, kernels[1:], strict=False):
        if start > end:
            idle += start - end
            after[name[:60]] += start - end
    span = (kernels[-1][1] - kernels[0][0]) / 1e3
    print(f"host ops before the first kernel: {(kernels[0][0] - host) / 1e3:.1f} ms; device idle between kernels: "
          f"{idle / 1e3:.1f} ms of {span:.1f} ms from first kernel to last; the largest waits end at:", flush=True)
    for name, us in after.most_common(12):
        print(f"  {us / 1e3:8.2f} ms  {name}", flush=True)
    return dict(before_first_kernel_ms=(kernels[0][0] - host) / 1e3, idle_between_ms=idle / 1e3, span_ms=span,
                waits_end_at_ms={name: us / 1e3 for name, us in after.most_common(12)})


def profile(model, seqs: list[list[int]], cuda: bool, tiny: bool) -> None:
    """The kernels of one scoring call (ours, after a warm-up call), by total device time; on CUDA also where the
    host waits for the device (the Python lines of synchronizing calls) and where the device waits for the host
    (idle time between kernels, by the kernel that ends the wait)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    patch_model(model, backend="torch" if tiny else "auto")
    worker = LogProbWorker(model)
    worker.score(seqs)
    print(f"one call, unprofiled: {timed(lambda: worker.score(seqs), cuda, 3) * 1e3:.1f} ms (median of 3)", flush=True)
    if cuda:
        host_waits(lambda: worker.score(seqs))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profiler(activities=activities) as prof:
        worker.score(seqs)
        if cuda:
            torch.cuda.synchronize()
    key = "device_time_total" if cuda else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70), flush=True)
    if not cuda:
        return
    device_gaps(prof)


def sweep(config: dict, tokens: int, device: str, dtype: torch.dtype, cuda: bool) -> None:
    """One expert layer (tokens routed uniformly at random, the shape's top k): our gate/up, down and combine
    kernels under several tilings, torch._grouped_mm on the same sorted rows, and a dense GEMM of gate/up's
    FLOPs; ms and TFLOP/s."""
    from ppo_logprobs.workers.models.experts import sort_by_expert

    h, i, e, k = (config[key] for key in ("hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok"))
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(tokens, h, device=device, dtype=dtype, generator=g)
    gate_up = torch.randn(e, 2 * i, h, device=device, dtype=dtype, generator=g) * 0.02
    down = torch.randn(e, h, i, device=device, dtype=dtype, generator=g) * 0.02
    index = torch.randn(tokens, e, device=device, generator=g).topk(k, dim=-1).indices
    weights = torch.rand(tokens, k, device=device, generator=g)
    order, source, position, counts = sort_by_expert(index, e, "triton")
    middle = gg.grouped_gate_up(hidden, gate_up, counts, source=source)
    out = gg.grouped_gemm(middle, down, counts)
    flops = 2 * tokens * k * h * i
    timer = ms_timer(cuda)
    rows = []

    def row(name: str, fn, f: float) -> None:
        ms = timer(fn)
        rows.append(dict(case=name, ms=ms, tflops=f / ms / 1e9))
        print(f"{name:>44} {ms:9.3f} ms {f / ms / 1e9:7.1f} TFLOP/s", flush=True)

    x = hidden[source]
    offsets = torch.cumsum(counts[:e], 0).to(torch.int32)
    if cuda:
        row("torch._grouped_mm gate_up (rows gathered)", lambda: torch._grouped_mm(x, gate_up.transpose(-2, -1),
                                                                                  offs=offsets), 2 * flops)
        row("torch._grouped_mm down", lambda: torch._grouped_mm(middle, down.transpose(-2, -1), offs=offsets), flops)
        a, b = torch.randn(tokens * k, h, device=device, dtype=dtype), torch.randn(h, 2 * i, device=device, dtype=dtype)
        row("dense GEMM of gate_up's FLOPs", lambda: a @ b, 2 * flops)
    gate_up_tilings = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 128, 8, 2), (64, 128, 64, 4, 4),
                       (128, 64, 64, 4, 4)]
    down_tilings = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 2),
                    (256, 128, 64, 8, 3), (128, 128, 128, 8, 2)]
    default = gg._tiles
    products = (("gate_up+silu", gate_up_tilings, lambda: gg.grouped_gate_up(hidden, gate_up, counts, source=source)),
                ("down", down_tilings, lambda: gg.grouped_gemm(middle, down, counts)))
    for name, _, product in products:
        if gg._hopper(hidden, gate_up) is not None:
            row(f"ours {name} (hopper_grouped, the default)", product, (2 if name == "down" else 4) * flops / 2)
    gg.GLUON = False  # (the Triton kernel under its tilings)
    try:
        for name, tilings, product in products:
            for tiles in [default(dtype, name != "down")] + ([gg.Tiles(*c) for c in tilings] if cuda else []):
                gg._tiles = lambda _dtype, _gated=False, tiles=tiles: tiles
                label = "x".join(map(str, tiles[:3])) + f" w{tiles.num_warps} s{tiles.num_stages}"
                try:
                    row(f"ours {name} {label}", product, (2 if name == "down" else 4) * flops / 2)
                except Exception as err:  # noqa: BLE001 (a tiling that does not compile is a finding of the sweep)
                    print(f"{name} {label}: {type(err).__name__}: {str(err)[:100]}", flush=True)
    finally:
        gg._tiles, gg.GLUON = default, True
    row("ours sort by expert", lambda: sort_by_expert(index, e, "triton"), 0)
    row("ours combine", lambda: gg.combine(out, position.view(tokens, k), weights), 0)


def busy(fn, seconds: float, cuda: bool) -> None:
    """fn back to back for `seconds` (none off CUDA): a GPU at its power cap runs its first second or two of load at
    lower clocks (BENCHMARKS.md), which do_bench's warm-up (25-100 ms) does not cover. A long call (a model's
    forward) ends it soon after `seconds`; short ones queue up to 20 ahead of the device."""
    start, calls = time.perf_counter(), 0
    while cuda and time.perf_counter() - start < seconds:
        fn()
        calls += 1
        if calls % 20 == 0:
            torch.cuda.synchronize()
    if cuda:
        torch.cuda.synchronize()


def ms_timer(cuda: bool, rep: int = 100):
    """fn -> its milliseconds: triton's do_bench (median over `rep` ms of calls) on CUDA, else one call after one."""
    if cuda:
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=rep)
    return lambda fn: timed(fn, False, 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU dry run with a tiny config")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="where our forward's time goes: its kernels, then exit")
    parser.add_argument("--sweep", action="store_true",
                        help="one expert layer's kernels for several tilings, beside torch._grouped_mm, then exit")
    parser.add_argument("--skip-hf", action="store_true", help="no HF baselines (their figures: BENCHMARKS.md)")
    parser.add_argument("--before", action="store_true",
                        help="ours with the Triton grouped kernels too (the path before hopper_grouped), same run")
    parser.add_argument("--warmup", type=float, default=3.0, metavar="SECONDS",
                        help="the floor's GEMM and our call back to back for this long before each is timed (0: as "
                        "before 2026-12-07; HF's baselines follow the floor's warm-up)")
    parser.add_argument("--out")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    config = TINY if args.tiny else QWEN3_30B_A3B
    if args.sweep:
        sweep(config, 32768 // (32 if args.tiny else 1), device, dtype, cuda)
        return
    model = build(config, device, dtype)
    rng = np.random.default_rng(0)
    scale = 32 if args.tiny else 1
    cases = {"8 x 4096": [rng.integers(0, config["vocab_size"], 4096 // scale).tolist() for _ in range(8)],
             "mixed rollouts": [rng.integers(0, config["vocab_size"], int(n) // scale).tolist()
                                for n in rng.integers(256, 4096, 12)]}
    floor_rate = None
    if cuda:  # the same run's bf16 GEMM rate, on a shape like the experts' and attention's
        a, b = torch.randn(8192, 2048, device=device, dtype=dtype), torch.randn(2048, 6144, device=device, dtype=dtype)
        busy(lambda: a @ b, args.warmup, cuda)
        floor_rate = 2 * 8192 * 2048 * 6144 / timed(lambda: a @ b, True, 20)
    if args.profile:
        profile(model, cases["8 x 4096"], cuda, args.tiny)
        return
    rows = []
    for name, seqs in cases.items():
        tokens = sum(map(len, seqs))
        row = dict(case=name, tokens=tokens)
        for impl in () if args.skip_hf else ("grouped_mm", "eager"):
            try:
                model.set_experts_implementation(impl)
                row[f"hf_{impl}_tokens_per_s"] = tokens / timed(lambda: hf_scores(model, seqs, device), cuda,
                                                                 args.reps)
                if cuda:
                    row[f"hf_{impl}_peak_extra_gib"] = peak_extra_gib(lambda: hf_scores(model, seqs, device))
            except (torch.OutOfMemoryError, ValueError, AttributeError, NotImplementedError) as e:
                row[f"hf_{impl}"] = f"{type(e).__name__}: {str(e)[:120]}"
            if cuda:
                torch.cuda.empty_cache()
        patch_model(model, backend="torch" if args.tiny else "auto")
        worker = LogProbWorker(model)
        busy(lambda: worker.score(seqs), args.warmup, cuda)
        row["ours_tokens_per_s"] = tokens / timed(lambda: worker.score(seqs), cuda, args.reps)
        if args.before:
            gg.GLUON = False
            row["ours_triton_grouped_tokens_per_s"] = tokens / timed(lambda: worker.score(seqs), cuda, args.reps)
            gg.GLUON = True
        if cuda:  # beside the sorted rows' buffers of one expert layer (its middle and its down products, bf16)
            row["ours_peak_extra_gib"] = peak_extra_gib(lambda: worker.score(seqs))
            row["sorted_buffers_gib"] = tokens * config["num_experts_per_tok"] * 2 * (
                config["moe_intermediate_size"] + config["hidden_size"]) / 2**30
        packed = worker.score(seqs)
        alone = [worker.score([s])[0] for s in seqs]
        row["sequences_differing"] = sum(not np.array_equal(p.log_probs, a.log_probs) for p, a in zip(packed, alone,
                                                                                                     strict=True))
        if floor_rate:
            row["floor_tokens_per_s"] = floor_rate / (2 * active_parameters(config))
            row["of_floor"] = row["ours_tokens_per_s"] / row["floor_tokens_per_s"]
        del model.forward  # (HF's own forwards for the next case's baselines)
        unfuse_body(model)
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = dict(model="tiny Qwen3-MoE" if args.tiny else "Qwen3-30B-A3B shape, random bf16", device=device,
                torch=torch.__version__, gpu=torch.cuda.get_device_name() if cuda else None,
                active_parameters=active_parameters(config),
                options={k: v for k, v in vars(args).items() if k != "out" and v != parser.get_default(k)},
                timing=dict(warmup_s=args.warmup if cuda else 0, reps=args.reps))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"{'case':>16}{'tokens':>8}{'ours tok/s':>12}{'HF grouped_mm':>15}{'HF eager':>10}{'of floor':>10}"
          f"{'differ':>8}{'ours, Triton grouped':>22}")
    for r in rows:
        hf = [r.get(f"hf_{i}_tokens_per_s") for i in ("grouped_mm", "eager")]
        print(f"{r['case']:>16}{r['tokens']:>8}{r['ours_tokens_per_s']:>12.0f}"
              + "".join(f"{x:>15.0f}" if x else f"{'-':>15}" for x in hf[:1])
              + "".join(f"{x:>10.0f}" if x else f"{'-':>10}" for x in hf[1:])
              + (f"{r['of_floor']:>10.2f}" if "of_floor" in r else f"{'-':>10}") + f"{r['sequences_differing']:>8}"
              + f"{r.get('ours_triton_grouped_tokens_per_s', 0):>22.0f}")
    for r in rows:
        if "ours_peak_extra_gib" in r:
            print(f"{r['case']}: peak GiB beyond the weights: ours {r['ours_peak_extra_gib']:.2f} (one layer's sorted "
                  f"rows {r['sorted_buffers_gib']:.2f}), HF grouped_mm {r.get('hf_grouped_mm_peak_extra_gib', 0):.2f}")


if __name__ == "__main__":
    main()

"""End-to-end scoring with a patched HuggingFace model on one GPU, no grad.

Fixed batch (8 x 4096 tokens): the decoder body alone (with our fused RMSNorm and MLP middle, and with HF's), HF
full logits -> log_softmax (naive), and the patched model (fused head) in its invariant and fast modes. Mixed
lengths (32 rollouts, prompt 512 + response 64..4000 tokens, arrival order): naive HF on right-padded batches of
2 / 4 / 8, the patched model on padded batches of 8 (it unpads them into one row), on rows packed here (padding
at the end) attending through flex_attention and through varlen attention, and LogProbWorker.score (the service's
path: rows packed without padding, prompts unscored, results on the host) in both modes. Prints tokens/s and
peak memory beyond the model. Each case is called for --warmup seconds (3), then timed by the median of --reps (5)
calls: a GPU held at its power cap runs its first second or two of load at lower clocks (BENCHMARKS.md).

  python benchmarks/bench_model.py --out model.json     # Qwen2.5-7B shape, random bf16 weights, on CUDA
  python benchmarks/bench_model.py --tiny               # a dry run of every path on the CPU, tiny config
  python benchmarks/bench_model.py --skip-fixed --skip-mixed --long 32768 65536 131072   # long context alone
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from bench_moe import device_gaps, host_waits  # the same directory
from transformers import Qwen2Config, Qwen2ForCausalLM

from ppo_logprobs.workers import LogProbWorker, patch_model
from ppo_logprobs.workers.models import causal_attention as ca
from ppo_logprobs.workers.models import fuse_body as body
from ppo_logprobs.workers.models.fuse_body import fuse_body, unfuse_body
from ppo_logprobs.workers.models.patch_model import allow_split_k
from ppo_logprobs.workers.request import MAX_TOKENS_PER_BATCH

QWEN25_7B = dict(
    vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
    num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False,
)
QWEN25_1_5B = dict(
    vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True,
)
TINY = dict(vocab_size=503, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)


def build(config: dict, device: str, dtype: torch.dtype):
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(Qwen2Config(**config, attn_implementation="sdpa")).eval()
    finally:
        torch.set_default_dtype(default)
    return model


def fast(model, backend: str) -> None:
    """patch_model(invariant=False), and cuBLAS's process-wide defaults back (split-K allowed)."""
    patch_model(model, backend=backend, invariant=False)
    allow_split_k(True)


# kernel name fragment -> what the time goes to (the first that matches; GEMMs by cuBLAS's kernel names)
_KINDS = (("_body_gemm_kernel", "GEMMs (ours: gate/up + silu, + residual)"), ("attention", "attention"),
          ("_attn", "attention"), ("_persistent_kernel", "attention"),
          ("_rms_norm", "RMSNorm (ours)"), ("_silu_mul", "silu(gate) * up (ours)"), ("log_probs", "head (ours)"),
          ("combine_splits", "head (ours)"), ("flash", "attention"), ("fmha", "attention"), ("cudnn", "attention"),
          ("gemm", "GEMMs"), ("nvjet", "GEMMs"), ("xmma", "GEMMs"), ("cutlass", "GEMMs"), ("gemv", "GEMMs"))


def profile(fn, device: str, layers: int) -> dict:
    """GPU time of one call split by kind of kernel (torch.profiler), printed as a table (and a layer's share: the
    kind's time over the model's layers), then its 12 costliest kernels by name; on CUDA also where the device waits
    for the host (bench_moe.device_gaps) and where the host waits for the device (bench_moe.host_waits)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    fn()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch_profile(activities=activities, record_shapes=True) as prof:
        fn()
        sync(device)
    kinds: dict[str, float] = {}
    names: dict[str, float] = {}
    for e in prof.key_averages():
        us = e.device_time_total if device == "cuda" else e.self_cpu_time_total
        if us <= 0 or (device == "cuda" and e.device_type.name != "CUDA"):
            continue
        kind = next((k for frag, k in _KINDS if frag in e.key.lower()), "other (elementwise, copies)")
        kinds[kind] = kinds.get(kind, 0) + us / 1e3
        names[e.key[:60]] = names.get(e.key[:60], 0) + us / 1e3
    total = sum(kinds.values())
    wall = timed(fn, device, 3)[0] * 1e3  # (unprofiled)
    print(f"{'':>30} {'ms':>9} {'share':>6} {'a layer':>9}")
    for kind, ms in sorted(kinds.items(), key=lambda x: -x[1]):
        print(f"{kind:>30} {ms:9.2f} {100 * ms / total:5.1f}% {ms / layers:9.3f}")
    print(f"{'kernels, all':>30} {total:9.2f} ms; the call (unprofiled, median of 3) {wall:.2f} ms: the GPU idles "
          f"{wall - total:.2f} ms ({100 * (wall - total) / wall:.1f}%) of it")
    top = dict(sorted(names.items(), key=lambda x: -x[1])[:12])
    for name, ms in top.items():
        print(f"{'':>8}{name:>60} {ms:8.2f} ms")
    result = dict(total_ms=total, wall_ms=wall, idle_ms=wall - total, layers=layers, by_kind=kinds, kernels_top=top,
                  gemms=gemm_shapes(prof, device))
    if device == "cuda":
        result["gaps"] = device_gaps(prof)
        result["host_waits"] = host_waits(fn)
    return result


def gemm_shapes(prof, device: str) -> list[dict]:
    """The profiled call's matrix products by shape (aten::mm and aten::addmm, from the profiler's input shapes):
    calls, time and TFLOP/s in the call, beside the floor: a plain torch.mm of the same shape (a weight's transposed
    view, no bias) timed here, at this process's cuBLAS settings (the invariant mode's: cuBLASLt, no split sums) and
    at cuBLAS's defaults. Printed as a table and returned."""
    from bench_moe import ms_timer

    time_ms = ms_timer(device == "cuda", rep=50)
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        matrices = [s for s in e.input_shapes if len(s) == 2][:2] if e.key in ("aten::mm", "aten::addmm") else []
        if len(matrices) < 2:
            continue
        (m, k), (_, n) = matrices
        us = e.device_time_total if device == "cuda" else e.cpu_time_total
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        a, w = torch.randn(m, k, device=device, dtype=dtype), torch.randn(n, k, device=device, dtype=dtype)
        floors = {}
        for name, split in (("invariant", False), ("cuBLAS defaults", True)):
            if device == "cuda":
                allow_split_k(split)
            floors[name] = time_ms(lambda a=a, w=w: torch.mm(a, w.t()))
        if device == "cuda":
            allow_split_k(False)  # (the patched model's mode)
        flop = 2 * m * k * n
        rows.append(dict(op=e.key, m=m, k=k, n=n, calls=e.count, ms=us / 1e3,
                         tflops=flop * e.count / us / 1e6 if us else None,
                         floor_ms={name: ms * e.count for name, ms in floors.items()},
                         floor_tflops={name: flop / ms / 1e9 for name, ms in floors.items()}))
        del a, w
    print(f"{'GEMM (M x K x N)':>28} {'calls':>5} {'ms':>8} {'TF/s':>6} {'mm ms':>8} {'mm TF/s':>7} "
          f"{'default TF/s':>12}")
    for r in sorted(rows, key=lambda r: -r["ms"]):
        print(f"{r['op'] + ' ' + str(r['m']) + 'x' + str(r['k']) + 'x' + str(r['n']):>28} {r['calls']:5d} "
              f"{r['ms']:8.2f} {r['tflops'] or 0:6.1f} {r['floor_ms']['invariant']:8.2f} "
              f"{r['floor_tflops']['invariant']:7.1f} {r['floor_tflops']['cuBLAS defaults']:12.1f}")
    return rows


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, reps: int, warmup: float = 0) -> tuple[float, int]:
    """(median seconds of reps calls, peak bytes allocated beyond the start), after calls for `warmup` seconds (one
    at least)."""
    start = time.perf_counter()
    while True:
        fn()
        sync(device)
        if time.perf_counter() - start >= warmup:
            break
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else 0
    return statistics.median(times), peak


def sustained(fn, device: str, seconds: float) -> tuple[float, list[tuple[float, float, float, float]]]:
    """fn called back to back for `seconds` after one warm-up: the loop's start (epoch seconds, to line it up with
    nvidia-smi's log) and (start, duration, the device's part, the host's part) of each call, in seconds. The
    device's part is between CUDA events at the call's ends (the duration again off CUDA); the host's is until fn
    returned, its kernels queued: well under the duration, the host ran ahead of the GPU, so a slower call was the
    GPU's."""
    fn()
    sync(device)
    calls, begin, epoch = [], time.perf_counter(), time.time()
    while time.perf_counter() - begin < seconds:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device == "cuda" else None
        start = time.perf_counter()
        if events:
            events[0].record()
        fn()
        queued = time.perf_counter() - start
        if events:
            events[1].record()
        sync(device)
        took = time.perf_counter() - start
        calls.append((start - begin, took, events[0].elapsed_time(events[1]) / 1e3 if events else took, queued))
    return epoch, calls


def naive_scores(model, ids, mask):
    logits = type(model).forward(model, input_ids=ids, attention_mask=mask, use_cache=False).logits  # [B, T, V]
    log_p = logits.float().log_softmax(-1)
    lp = log_p[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return lp, -(log_p.exp() * log_p).sum(-1)[:, :-1]


def padded_batches(seqs, batch_size, device):
    for i in range(0, len(seqs), batch_size):
        group = seqs[i : i + batch_size]
        t = max(len(s) for s in group)
        ids = torch.zeros(len(group), t, dtype=torch.long)
        mask = torch.zeros(len(group), t, dtype=torch.long)
        for b, s in enumerate(group):
            ids[b, : len(s)], mask[b, : len(s)] = s, 1
        yield ids.to(device), mask.to(device)


def packed_rows(seqs, row_tokens, device):
    """First fit in arrival order into rows of exactly row_tokens (padding at the end is its own sequence)."""
    rows: list[list[torch.Tensor]] = []
    for s in seqs:
        if len(s) > row_tokens:
            raise ValueError(f"a sequence of {len(s)} tokens does not fit rows of {row_tokens}")
        for row in rows:
            if sum(len(x) for x in row) + len(s) <= row_tokens:
                row.append(s)
                break
        else:
            rows.append([s])
    for row in rows:
        used = sum(len(x) for x in row)
        parts = row + ([torch.zeros(row_tokens - used, dtype=torch.long)] if used < row_tokens else [])
        ids = torch.cat(parts)[None]
        positions = torch.cat([torch.arange(len(p)) for p in parts])[None]
        mask = torch.ones_like(ids)
        mask[0, used:] = 0
        yield ids.to(device), positions.to(device), mask.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU dry run with a tiny config")
    parser.add_argument("--out")
    parser.add_argument("--skip-fixed", action="store_true")
    parser.add_argument("--skip-mixed", action="store_true")
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument("--worker-only", action="store_true", help="of the mixed cases, only LogProbWorker's")
    parser.add_argument("--attn", default="sdpa", help="attention for the fixed batch and padded batches")
    parser.add_argument("--profile", action="store_true", help="only a profile of one patched 8 x 4096 forward")
    parser.add_argument("--sustained", type=float, metavar="SECONDS",
                        help="only the patched 8 x 4096 forward back to back for SECONDS: its calls' median by window "
                        "(the first 3 calls, as the fixed case timed them before --warmup, then by when they started)")
    parser.add_argument("--long", type=int, nargs="*", default=[],
                        help="also one sequence of each of these lengths (a worker with max_tokens_per_batch = it)")
    parser.add_argument("--warmup", type=float, default=3.0, metavar="SECONDS",
                        help="each case's calls before its timed ones (one at least): a GPU at its power cap runs "
                        "its first second or two of load at lower clocks (BENCHMARKS.md)")
    parser.add_argument("--reps", type=int, default=5, help="each case's timed calls (their median)")
    parser.add_argument("--rows", type=int, nargs="+", default=[MAX_TOKENS_PER_BATCH, 32768],
                        help="the mixed cases' row lengths (the worker's max_tokens_per_batch; the default's first)")
    parser.add_argument("--top-k", type=int, nargs="*", default=[],
                        help="the worker's invariant scoring also asked for these top-k (issue 23), beside plain")
    parser.add_argument("--gluon", choices=["none", "persistent"],
                        help="attention at heads over 64 on Hopper by this form of hopper_attention.py's kernel "
                        "(Tiles.gluon; none: the Triton kernel), not the default's (issue 41)")
    parser.add_argument("--mlp", choices=["ours", "no-qkv", "gated", "cublas"],
                        help="the body's GEMMs on Hopper, not the default's (ours: hopper_gated.py's gate and up with "
                        "silu(gate) * up in the epilogue, q/k/v with biases and rotary in theirs, and the o and down "
                        "projections with the residual added in theirs; no-qkv: q/k/v by cuBLAS and rotary.py; gated: "
                        "gate and up alone, the layers' adds torch's; cublas: cuBLAS and silu_mul's pass)")
    args = parser.parse_args()
    if args.mlp in ("no-qkv", "gated"):
        body._rotated_qkv = lambda *_: None
    if args.mlp == "cublas":  # (fuse_body reads its kernels through this function at each call)
        body._hopper_gated = lambda: None
    if args.mlp == "gated":  # (the layers fuse_body patches, read when the model is patched below)
        body._LAYERS = set()
    if args.gluon:  # (the process's tiling table, which every forward here reads)
        ca._WIDE = (ca._WIDE[0]._replace(gluon="" if args.gluon == "none" else args.gluon), *ca._WIDE[1:])
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    batch, seq_len, prompt, resp, rollouts = (2, 64, 16, (8, 40), 6) if args.tiny else (8, 4096, 512, (64, 4000), 32)
    row_sizes = (128,) if args.tiny else args.rows
    reps, warmup = (1, 0) if args.tiny else (args.reps, args.warmup)
    clock = lambda fn: timed(fn, device, reps, warmup)  # noqa: E731
    model = build(TINY if args.tiny else QWEN25_7B, device, dtype)
    model.config._attn_implementation = args.attn
    backend = "torch" if args.tiny else "auto"
    patch_model(model, backend=backend)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    results, meta = [], dict(date=time.strftime("%Y-%m-%d"), device=device, torch=torch.__version__,
                             options={k: v for k, v in vars(args).items()
                                      if v != parser.get_default(k) and k != "out"},
                             timing=dict(warmup_s=warmup, reps=reps))
    if device == "cuda":
        meta["attention_tiles"] = ca._tiles(128, dtype)._asdict()
        meta["gpu"] = torch.cuda.get_device_name()
        meta["model_bytes"] = torch.cuda.memory_allocated()
    print(f"# {meta}", flush=True)

    def record(case, impl, tokens, seconds, peak, **extra):
        results.append(dict(case=case, impl=impl, tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds,
                            extra_gib=peak / 2**30, **extra))
        print(json.dumps(results[-1]), flush=True)

    with torch.no_grad():
        if args.profile:
            ids = torch.randint(0, vocab, (batch, seq_len), generator=g).to(device)
            meta["profile"] = profile(lambda: model(input_ids=ids), device, model.config.num_hidden_layers)
            args.skip_fixed = args.skip_mixed = True
        if args.sustained:
            ids = torch.randint(0, vocab, (batch, seq_len), generator=g).to(device)
            meta["sustained_epoch"], calls = sustained(lambda: model(input_ids=ids), device, args.sustained)
            windows = [("first 3 calls", calls[:3])]
            for lo, hi in ((3, 10), (10, 20), (20, 40), (40, 60), (60, float("inf"))):
                windows.append((f"calls started {lo}-{hi} s", [c for c in calls if lo <= c[0] < hi]))
            for name, window in windows:
                if window:
                    record("sustained", name, batch * seq_len, statistics.median(c[1] for c in window), 0,
                           calls=len(window), device_s=statistics.median(c[2] for c in window),
                           host_s=statistics.median(c[3] for c in window))
            names = ("start", "seconds", "device_s", "host_s")
            meta["first_calls"] = [dict(zip(names, c, strict=True)) for c in calls[:12]]
            args.skip_fixed = args.skip_mixed = True
        if not args.skip_fixed:
            ids = torch.randint(0, vocab, (batch, seq_len), generator=g).to(device)
            tokens = batch * seq_len
            s, p = clock(lambda: model.model(input_ids=ids, use_cache=False))
            record("fixed", f"body ({args.attn})", tokens, s, p)
            unfuse_body(model)
            s, p = clock(lambda: model.model(input_ids=ids, use_cache=False))
            record("fixed", f"body, HF forwards ({args.attn})", tokens, s, p)
            fuse_body(model, backend)
            if not args.skip_naive:
                s, p = clock(lambda: naive_scores(model, ids, None))
                record("fixed", "naive", tokens, s, p)
            s, p = clock(lambda: model(input_ids=ids))
            ref_lp, _ = naive_scores(model, ids[:2], None)  # (two rows: all eight's fp32 logits take 40 GB)
            fused = model(input_ids=ids)
            diff = float((fused.log_probs[:2, :-1] - ref_lp).abs().max())
            record("fixed", "patched (invariant)", tokens, s, p, max_diff_vs_naive=diff)
            del ref_lp, fused
            fast(model, backend)
            s, p = clock(lambda: model(input_ids=ids))
            record("fixed", "patched (fast)", tokens, s, p)
            patch_model(model, backend=backend)

        if not args.skip_mixed:
            lengths = [prompt + int(torch.randint(resp[0], resp[1] + 1, (1,), generator=g)) for _ in range(rollouts)]
            seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
            real = sum(lengths)
            print(f"# mixed: {rollouts} rollouts, {real} real tokens", flush=True)
            for bs in () if args.skip_naive else (2, 4, 8):
                batches = list(padded_batches(seqs, bs, device))
                try:
                    s, p = clock(lambda b=batches: [naive_scores(model, i, m) for i, m in b])
                    record("mixed", f"naive padded x{bs}", real, s, p)
                except torch.OutOfMemoryError:
                    print(f"naive padded x{bs}: out of memory", flush=True)
            batches = [] if args.worker_only else list(padded_batches(seqs, 8, device))
            if batches:
                s, p = clock(lambda: [model(input_ids=i, attention_mask=m) for i, m in batches])
                record("mixed", "patched, padded x8", real, s, p)
            for attention in () if args.worker_only else ("flex", "varlen"):  # patch_model's packed_attention
                patch_model(model, backend=backend, packed_attention=attention)
                for r in row_sizes[:1] if attention == "flex" else row_sizes:
                    rows = list(packed_rows(seqs, r, device))
                    fn = lambda rows=rows: [model(input_ids=i, position_ids=q, attention_mask=m) for i, q, m in rows]
                    s, p = clock(fn)
                    record("mixed", f"patched, rows of {r} ({attention})", real, s, p, rows=len(rows))
            # the worker's own path: rows packed without padding, prompts unscored, results gathered to the host
            lists = [x.tolist() for x in seqs]
            for mode in ("invariant", "fast"):
                patch_model(model, backend=backend)
                if mode == "fast":
                    fast(model, backend)
                for r in row_sizes:
                    if mode == "invariant":  # (the default's CUDA graphs against none, in the same run)
                        worker = LogProbWorker(model, max_tokens_per_batch=r, cuda_graphs=False)
                        s, p = clock(lambda w=worker: w.score(lists, score_from=prompt))
                        record("mixed", f"worker, rows of {r} ({mode}), no CUDA graphs", real, s, p)
                    worker = LogProbWorker(model, max_tokens_per_batch=r)
                    s, p = clock(lambda w=worker: w.score(lists, score_from=prompt))
                    worker.stats["rows"] = 0
                    worker.score(lists, score_from=prompt)
                    record("mixed", f"worker, rows of {r} ({mode})", real, s, p, rows=worker.stats["rows"])
                    plain_s = s
                    for k in args.top_k if mode == "invariant" else ():
                        s, p = clock(lambda w=worker, k=k: w.score(lists, score_from=prompt, top_k=k))
                        record("mixed", f"worker, rows of {r} ({mode}), top-{k}", real, s, p, vs_plain=s / plain_s)
            patch_model(model, backend=backend)

        for n in args.long:  # long context: one sequence a call, by a worker that takes it (one forward)
            worker = LogProbWorker(model, max_tokens_per_batch=n)
            seq = torch.randint(0, vocab, (n,), generator=g).tolist()
            s, p = timed(lambda w=worker, seq=seq: w.score([seq]), device, 1)
            record("long", f"worker, one sequence of {n}", n, s, p, max_tokens_per_batch=n)

    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
    print(f"options: {meta['options'] or 'the defaults'}")
    print(f"{'case':>6} {'impl':>34} {'tokens/s':>10} {'extra GiB':>10}")
    for r in results:
        print(f"{r['case']:>6} {r['impl']:>34} {r['tokens_per_s']:10.0f} {r['extra_gib']:10.2f}")


if __name__ == "__main__":
    main()

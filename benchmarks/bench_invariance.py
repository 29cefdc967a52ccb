"""Is a sequence's result the same bits wherever it is scored, and what does that cost?

Study (the default): random-length sequences scored
- alone, one request each (the reference);
- packed with the others into rows of three budgets, in three orders, so each lands at other offsets among
  other neighbours;
- by pools of one and of two workers (Ray actors, other processes; with --pool), or, for a model built in memory
  (no checkpoint for a pool to load), by a second worker in a process of its own that builds the same model;
- by a trainer: the patched model's own forward with gradients on, right-padded micro-batches of 4096 tokens;
- and, apart, GRPO groups (responses to shared prompts) by a worker that computes each prompt once, against each
  sequence alone with sharing off.
Each is compared with "alone": the largest |difference| of log-probs and entropies, and how many sequences
differ at all. Run for the invariant mode (patch_model's default) and the fast one (invariant=False), and for
the invariant mode with HF's own forwards for norms, MLPs and attention blocks (what fuse_body replaces).

Probe (--probe): which row counts M change a GEMM's bits for the model's shapes (rows compared with the same
rows of an M = 32768 product), under cuBLAS's default, with split-K allowed, and through cuBLASLt with split-K
forbidden (cuBLAS proper takes no such setting), and what each costs; and the same for torch's RMSNorm against ours.

  python benchmarks/bench_pool.py --save-random /tmp/q7
  python benchmarks/bench_invariance.py --model /tmp/q7 --pool --out invariance.json    # H200
  python benchmarks/bench_invariance.py --probe --out probe.json                         # H200
  python benchmarks/bench_invariance.py                                                  # CPU dry run, tiny model
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import numpy as np
import torch
from bench_model import fast  # the same directory

from ppo_logprobs.workers import LogProbWorker, WorkerPool
from ppo_logprobs.workers.models.fuse_body import unfuse_body
from ppo_logprobs.workers.models.patch_model import patch_model
from ppo_logprobs.workers.request import MAX_TOKENS_PER_BATCH


def random_lengths(n: int, lo: int, hi: int, seed: int) -> np.ndarray:
    """Log-uniform in [lo, hi]: as many short sequences (below any GEMM threshold) as long ones."""
    rng = np.random.default_rng(seed)
    return np.exp(rng.uniform(np.log(lo), np.log(hi), n)).astype(np.int64)


def by_worker(worker: LogProbWorker, seqs: list, budget: int, order: np.ndarray) -> list:
    worker.max_tokens_per_batch = budget
    got = worker.score([seqs[i] for i in order])
    out = [None] * len(seqs)
    for i, r in zip(order, got, strict=True):
        out[i] = (r.log_probs, r.entropy)
    return out


def trainer_batches(lengths: list[int], budget: int) -> list[range]:
    """Consecutive sequences, right-padded, at most `budget` tokens counting padding (a trainer's micro-batches)."""
    batches, start = [], 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or (i + 1 - start) * max(lengths[start : i + 1]) > budget:
            batches.append(range(start, i))
            start = i
    return batches


def by_trainer(model: torch.nn.Module, seqs: list, budget: int = 4096) -> list:
    """The patched model's forward with gradients on (weights requiring grad), right-padded micro-batches."""
    params = [p for p in model.parameters()]
    for p in params:
        p.requires_grad_(True)
    device = params[0].device
    out = []
    try:
        with torch.enable_grad():
            for rows in trainer_batches([len(s) for s in seqs], budget):
                group = [seqs[i] for i in rows]
                t = max(len(s) for s in group)
                ids = torch.zeros(len(group), t, dtype=torch.long)
                mask = torch.zeros(len(group), t, dtype=torch.long)
                for b, s in enumerate(group):
                    ids[b, : len(s)], mask[b, : len(s)] = torch.tensor(s), 1
                res = model(input_ids=ids.to(device), attention_mask=mask.to(device))
                assert res.log_probs.requires_grad  # a real training forward
                lp, ent = res.log_probs.detach().cpu().numpy(), res.entropy.detach().cpu().numpy()
                out += [(lp[b, : len(s) - 1], ent[b, : len(s) - 1]) for b, s in enumerate(group)]
    finally:
        for p in params:
            p.requires_grad_(False)
    return out


def compare(got: list, ref: list) -> dict:
    lp = max(float(np.abs(a[0] - b[0]).max(initial=0)) for a, b in zip(got, ref, strict=True))
    ent = max(float(np.abs(a[1] - b[1]).max(initial=0)) for a, b in zip(got, ref, strict=True))
    differ = sum(not (np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])) for a, b in zip(got, ref, strict=True))
    return dict(max_lp=lp, max_entropy=ent, sequences_differing=differ)


def study(worker: LogProbWorker, seqs: list, budgets: tuple, label: str, trainer_rows: int = 4096) -> dict:
    rng = np.random.default_rng(1)
    start = time.perf_counter()
    alone = [by_worker(worker, [s], budgets[0], np.array([0]))[0] for s in seqs]
    results = dict(alone_s=time.perf_counter() - start)
    for k, budget in enumerate(budgets):
        order = rng.permutation(len(seqs))
        t0 = time.perf_counter()
        got = by_worker(worker, seqs, budget, order)
        results[f"packed rows of {budget}, order {k}"] = dict(**compare(got, alone), seconds=time.perf_counter() - t0)
    try:
        results["trainer forward with grad"] = compare(by_trainer(worker.model, seqs, trainer_rows), alone)
    except torch.OutOfMemoryError as e:  # (the MoE shape's longest sequence with grad on an 80 GB GPU)
        results["trainer forward with grad"] = f"OutOfMemoryError: {str(e)[:80]}"
        print(f"{label:>28} {'trainer forward with grad':>34} {results['trainer forward with grad']}", flush=True)
        torch.cuda.empty_cache()
    for case, r in results.items():
        if isinstance(r, dict):
            print(f"{label:>28} {case:>34} {r['max_lp']:10.3g} {r['max_entropy']:10.3g} "
                  f"{r['sequences_differing']:4d}/{len(seqs)}", flush=True)
    return dict(results=results, alone=alone)


def shared_study(model: torch.nn.Module, vocab: int, label: str, cuda: bool) -> dict:
    """GRPO groups (2..8 responses to each of 8 prompts) scored by a worker that shares their prompts (prefixes.py),
    against each sequence scored alone with sharing off."""
    rng = np.random.default_rng(3)
    lo, hi, minimum, budget = (300, 3000, 128, 32768) if cuda else (6, 30, 4, 400)
    seqs = []
    for _ in range(8):
        prompt = rng.integers(0, vocab, int(rng.integers(lo, hi))).tolist()
        seqs += [prompt + rng.integers(0, vocab, int(rng.integers(1, hi // 4))).tolist()
                 for _ in range(int(rng.integers(2, 9)))]
    alone_worker = LogProbWorker(model, layout="packed", min_shared_prefix=None)
    alone = [(r.log_probs, r.entropy) for r in (alone_worker.score([s])[0] for s in seqs)]
    sharing = LogProbWorker(model, layout="packed", min_shared_prefix=minimum, max_tokens_per_batch=budget)
    got = [(r.log_probs, r.entropy) for r in sharing.score(seqs)]
    r = dict(**compare(got, alone), tokens=sum(map(len, seqs)), computed_tokens=sharing.stats["computed_tokens"])
    print(f"{label:>28} {'shared prefixes (GRPO groups)':>34} {r['max_lp']:10.3g} {r['max_entropy']:10.3g} "
          f"{r['sequences_differing']:4d}/{len(seqs)}", flush=True)
    return r


def by_pool(model: str, workers: int, seqs: list, budget: int, **options) -> list:
    import ray

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    gpus = 1 / workers if torch.cuda.is_available() else 0
    pool = WorkerPool.create(model, workers, num_gpus_per_worker=gpus, max_tokens_per_batch=budget, **options)
    try:
        got = pool.compute_log_probs(seqs)
    finally:
        pool.shutdown()
    return [(r.log_probs, r.entropy) for r in got]


def probe(device: str, out: dict) -> None:
    """Row-count dependence of cuBLAS GEMMs (Qwen2.5-7B shapes) and of RMSNorm, with timings."""
    import triton.testing

    from ppo_logprobs.workers.models.rms_norm import rms_norm, rms_norm_reference

    matmul = torch.backends.cuda.matmul
    settings = {
        "default": lambda: (setattr(matmul, "allow_bf16_reduced_precision_reduction", (True, True)),
                            torch.backends.cuda.preferred_blas_library("cublas")),
        "cuBLASLt": lambda: (setattr(matmul, "allow_bf16_reduced_precision_reduction", (True, True)),
                             torch.backends.cuda.preferred_blas_library("cublaslt")),
        "cuBLASLt, no split-K": lambda: (setattr(matmul, "allow_bf16_reduced_precision_reduction", (False, False)),
                                         torch.backends.cuda.preferred_blas_library("cublaslt")),
    }
    shapes = {"q (bias)": (3584, 3584, True), "k (bias)": (3584, 512, True), "o": (3584, 3584, False),
              "gate": (3584, 18944, False), "down": (18944, 3584, False)}
    rows = [1, 2, 7, 16, 33, 64, 100, 127, 128, 129, 200, 256, 300, 512, 1000, 2048, 4096, 8192, 16384]
    g = torch.Generator(device=device).manual_seed(0)
    big = 32768
    report = {}
    for name, (k, n, bias) in shapes.items():
        x = torch.randn(big, k, device=device, generator=g, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, generator=g, dtype=torch.bfloat16) / k**0.5
        b = torch.randn(n, device=device, generator=g, dtype=torch.bfloat16) if bias else None
        for setting, apply in settings.items():
            apply()
            full = torch.nn.functional.linear(x, w, b)
            bad = [m for m in rows for off in (0, 5000)
                   if not torch.equal(torch.nn.functional.linear(x[off : off + m], w, b), full[off : off + m])]
            times = {m: triton.testing.do_bench(lambda m=m: torch.nn.functional.linear(x[:m], w, b), rep=50)
                     for m in (128, 1024, 16384)}
            report[f"{name} | {setting}"] = dict(rows_that_differ=sorted(set(bad)), ms=times)
            print(f"{name:>9} {setting:>22} differ at M={sorted(set(bad))} ms={times}", flush=True)
    settings["default"]()
    x = torch.randn(big, 3584, device=device, generator=g, dtype=torch.bfloat16) * 3
    w = torch.randn(3584, device=device, generator=g, dtype=torch.bfloat16)
    for name, fn in (("torch RMSNorm", lambda t: rms_norm_reference(t, w, 1e-6, "llama")),
                     ("our RMSNorm", lambda t: rms_norm(t, w, 1e-6, "llama"))):
        full = fn(x)
        bad = [m for m in rows for off in (0, 5000) if not torch.equal(fn(x[off : off + m]), full[off : off + m])]
        ms = triton.testing.do_bench(lambda fn=fn: fn(x), rep=50)
        report[name] = dict(rows_that_differ=sorted(set(bad)), ms_32768_rows=ms)
        print(f"{name:>14} differ at M={sorted(set(bad))}; 32768 rows: {ms:.3f} ms", flush=True)
    out["probe"] = report
    out["attention"] = attention_probe(device)


def attention_probe(device: str) -> dict:
    """Attention kernels for 8 x 4096 tokens, 28 / 4 heads, head size 128 (Qwen2.5-7B): time, and whether a
    sequence gets the same bits alone and at an offset of a packed row (the varlen kernels)."""
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device=device).manual_seed(1)
    b, t, hq, hk, d = 8, 4096, 28, 4, 128
    q = torch.randn(b * t, hq, d, device=device, generator=g, dtype=torch.bfloat16)
    k = torch.randn(b * t, hk, d, device=device, generator=g, dtype=torch.bfloat16)
    v = torch.randn(b * t, hk, d, device=device, generator=g, dtype=torch.bfloat16)
    cu = torch.arange(0, b * t + 1, t, device=device, dtype=torch.int32)
    kr, vr = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
    dense = [x.view(b, t, -1, d).transpose(1, 2) for x in (q, kr, vr)]  # [B, H, T, D]

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(*dense, is_causal=True)
        return run

    def flash(qq, kk, vv, cuq, n):
        return torch.ops.aten._flash_attention_forward(qq, kk, vv, cuq, cuq, n, n, 0.0, True, False)[0]

    def varlen(qq, kk, vv, cuq, n):
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(qq, kk.repeat_interleave(hq // hk, 1), vv.repeat_interleave(hq // hk, 1), cuq, cuq, n, n,
                           window_size=(-1, 0))

    def cudnn(qq, kk, vv, cuq, n):
        kk, vv = kk.repeat_interleave(hq // hk, 1), vv.repeat_interleave(hq // hk, 1)
        return torch.ops.aten._cudnn_attention_forward(qq, kk, vv, None, cuq, cuq, n, n, False, 0.0, True, False)[0]

    kernels = {"sdpa flash [B, H, T, D]": sdpa(SDPBackend.FLASH_ATTENTION),
               "sdpa cuDNN [B, H, T, D]": sdpa(SDPBackend.CUDNN_ATTENTION),
               "varlen_attn, K/V repeated": lambda: varlen(q, k, v, cu, t),
               "aten flash varlen, GQA": lambda: flash(q, k, v, cu, t),
               "aten cuDNN ragged, K/V repeated": lambda: cudnn(q, k, v, cu, t)}
    report = {}
    for name, fn in kernels.items():
        try:
            ms = triton.testing.do_bench(fn, rep=100)
        except Exception as e:  # noqa: BLE001 (a kernel this torch lacks is a finding, not a failure)
            report[name] = dict(error=str(e).splitlines()[0][:200])
            print(f"{name:>32} unavailable: {report[name]['error']}", flush=True)
            continue
        report[name] = dict(ms=ms)
        varlen_fn = {"varlen_attn, K/V repeated": varlen, "aten flash varlen, GQA": flash,
                     "aten cuDNN ragged, K/V repeated": cudnn}.get(name)
        if varlen_fn is not None:  # sequence 2 (1000 tokens) alone vs at offset 3000 of a row of three
            lens = torch.tensor([3000, 1000, 700])
            cur = torch.cat([torch.zeros(1), lens.cumsum(0)]).to(device, torch.int32)
            row = varlen_fn(q[:4700], k[:4700], v[:4700], cur, 3000)
            one = varlen_fn(q[3000:4000], k[3000:4000], v[3000:4000], cur[:2] * 0 + torch.tensor([0, 1000],
                            device=device, dtype=torch.int32), 1000)
            report[name]["offset_invariant"] = bool(torch.equal(row[3000:4000], one))
        print(f"{name:>32} {ms:8.3f} ms {report[name]}", flush=True)
    return report


IN_MEMORY = ("qwen3-30b-a3b", "qwen2.5-7b")  # shapes built with random weights instead of loaded


def in_memory(name: str, cuda: bool) -> torch.nn.Module:
    """That shape (a tiny config of its kind off CUDA) with random weights, the same in every process."""
    import bench_model
    import bench_moe

    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if name == "qwen3-30b-a3b":
        return bench_moe.build(bench_moe.QWEN3_30B_A3B if cuda else bench_moe.TINY, device, dtype)
    model = bench_model.build(bench_model.QWEN25_7B if cuda else bench_model.TINY, device, dtype)
    return bench_moe.random_weights(model)


def by_other_process(model: str, seqs: list, budget: int, order: np.ndarray, options: dict) -> list:
    """The sequences scored by a second worker in a process of its own (`--child`), which builds the model itself,
    packed in rows of `budget` in `order`."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        np.savez(f"{tmp}/in.npz", tokens=np.concatenate(seqs), lengths=[len(s) for s in seqs], order=order,
                 budget=budget, backend=options.get("backend", "auto"))
        subprocess.run([sys.executable, __file__, "--model", model, "--child", tmp], check=True)
        got = np.load(f"{tmp}/out.npz")
        ends = np.cumsum([len(s) - 1 for s in seqs])
        return list(zip(np.split(got["log_probs"], ends[:-1]), np.split(got["entropy"], ends[:-1]), strict=True))


def child(model: str, tmp: str) -> None:
    """--child: score what by_other_process left in `tmp` with a worker of this process; results back there."""
    given = np.load(f"{tmp}/in.npz")
    seqs = [s.tolist() for s in np.split(given["tokens"], np.cumsum(given["lengths"])[:-1])]
    backend = str(given["backend"])
    worker = LogProbWorker(patch_model(in_memory(model, torch.cuda.is_available()), backend=backend),
                           max_tokens_per_batch=int(given["budget"]))
    got = by_worker(worker, seqs, int(given["budget"]), given["order"])
    np.savez(f"{tmp}/out.npz", log_probs=np.concatenate([r[0] for r in got]),
             entropy=np.concatenate([r[1] for r in got]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny",
                        help="a checkpoint, 'tiny', or 'qwen3-30b-a3b' / 'qwen2.5-7b' (random bf16, built in memory)")
    parser.add_argument("--modes", default="invariant,fast,hf", help="comma-separated: invariant,fast,hf (HF bodies)")
    parser.add_argument("--sequences", type=int, default=200)
    parser.add_argument("--pool", action="store_true", help="also pools of 1 and 2 workers (Ray actors)")
    parser.add_argument("--probe", action="store_true", help="the GEMM and RMSNorm row-count probe only")
    parser.add_argument("--trainer-rows", type=int, default=4096,
                        help="tokens a trainer's micro-batch, padding counted (a longer sequence goes alone)")
    parser.add_argument("--out")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # (by_other_process's second worker)
    args = parser.parse_args()
    if args.child:
        child(args.model, args.child)
        return
    if args.pool and args.model in IN_MEMORY:
        parser.error("--pool loads the model in each worker: give a checkpoint")
    cuda = torch.cuda.is_available()
    out = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
               gpu=torch.cuda.get_device_name() if cuda else None,
               options={k: v for k, v in vars(args).items() if k == "trainer_rows" and v != 4096})
    if args.probe:
        probe("cuda", out)
    else:
        options = dict(dtype=torch.bfloat16) if cuda else dict(backend="torch")
        model = args.model
        if args.model in IN_MEMORY:  # (no checkpoint on disk: 15 and 61 GB)
            options = {} if cuda else dict(backend="torch")
            model = patch_model(in_memory(args.model, cuda), **options)  # (a worker warms a module up as given)
        lengths = random_lengths(args.sequences if cuda else 12, 2, 4096 if cuda else 60, seed=0)
        out.update(model=args.model, options={"modes": args.modes} if args.modes != "invariant,fast,hf" else {})
        budgets = (MAX_TOKENS_PER_BATCH, 32768, 8192) if cuda else (64, 128, 100)  # (a worker's default first)
        worker = LogProbWorker(model, max_tokens_per_batch=max(budgets), **options)
        vocab = worker.model.config.vocab_size
        rng = np.random.default_rng(2)
        seqs = [rng.integers(0, vocab, n).tolist() for n in lengths]
        out.update(sequences=len(seqs), tokens=int(lengths.sum()))
        print(f"# {len(seqs)} sequences, {lengths.sum()} tokens, lengths {lengths.min()}..{lengths.max()}")
        print(f"{'mode':>28} {'case':>34} {'max|dlp|':>10} {'max|dent|':>10} {'seqs':>8}", flush=True)
        backend = options.get("backend", "auto")
        modes = {}
        for label, invariant, fused in (("invariant", True, True), ("fast", False, True),
                                        ("invariant, HF body forwards", True, False)):
            if {"invariant": "invariant", "fast": "fast"}.get(label, "hf") not in args.modes.split(","):
                continue
            if invariant:
                patch_model(worker.model, backend=backend)
            else:
                fast(worker.model, backend)
            if not fused:
                unfuse_body(worker.model)
            modes[label] = study(worker, seqs, budgets, label, args.trainer_rows)
            modes[label]["results"]["shared prefixes (GRPO groups)"] = shared_study(worker.model, vocab, label, cuda)
        patch_model(worker.model, backend=backend)
        out["modes"] = {k: v["results"] for k, v in modes.items()}
        if args.model in IN_MEMORY and "invariant" in modes:  # (a pool would need a checkpoint)
            reference = modes["invariant"]["alone"]
            del worker, model
            gc.collect()  # (the patched forward holds its model in a cycle)
            if cuda:
                torch.cuda.empty_cache()
            order = np.random.default_rng(3).permutation(len(seqs))
            r = compare(by_other_process(args.model, seqs, budgets[0], order, options), reference)
            out["modes"]["invariant"]["a second worker in its own process"] = r
            print(f"{'invariant':>28} {'a second worker, its own process':>34} {r['max_lp']:10.3g} "
                  f"{r['max_entropy']:10.3g} {r['sequences_differing']:4d}/{len(seqs)}", flush=True)
        elif args.pool:
            reference = modes["invariant"]["alone"]
            del worker
            if cuda:
                torch.cuda.empty_cache()
            for n in (1, 2):
                r = compare(by_pool(args.model, n, seqs, budgets[0], **options), reference)
                out["modes"]["invariant"][f"pool of {n}"] = r
                print(f"{'invariant':>28} {f'pool of {n} worker(s)':>34} {r['max_lp']:10.3g} "
                      f"{r['max_entropy']:10.3g} {r['sequences_differing']:4d}/{len(seqs)}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

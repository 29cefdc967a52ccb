"""GPU benchmark of the fused head against the cuBLAS floor and the naive full-logits path.

For each shape N x H x V (bf16), in one run: the floor (hidden @ weight.T for forward; the three GEMMs for
forward+backward), the naive path (logits -> log_softmax, autograd), our torch backend and our Triton backend.
Prints time (median of do_bench), ratio to the floor, peak extra memory and max error against float64 on a
sample of rows. Writes everything as JSON.

  python benchmarks/bench_head.py --out results.json            # the table of BENCHMARKS.md
  python benchmarks/bench_head.py --sweep --shapes 8192x4096x151936   # tile configurations of the kernels
  python benchmarks/bench_head.py --curve --out curve.json        # time and memory against N (for the plot)
  python benchmarks/bench_head.py --top-k --out topk.json         # plain, top-k 1/20/64/256, 16 candidates
  TRITON_INTERPRET=1 python benchmarks/bench_head.py --top-k --shapes 64x32x503   # a CPU dry run
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace

import torch
from bench_moe import busy  # the same directory
from triton.testing import do_bench

from ppo_logprobs.workers import fused_log_probs
from ppo_logprobs.workers.head.triton_log_probs_backward import triton_log_probs_backward
from ppo_logprobs.workers.head.triton_log_probs_forward import tile_config, top_width, triton_log_probs_forward

SHAPES = [(4096, 4096, 128256), (8192, 4096, 151936), (32768, 4096, 151936)]
SAMPLE_ROWS = 256


def make_inputs(n: int, h: int, v: int, seed: int = 0, device: str = "cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, device=device, generator=g).bfloat16()
    weight = (torch.randn(v, h, device=device, generator=g) * (2.0 / math.sqrt(h))).bfloat16()  # logits ~ N(0, 4)
    labels = torch.randint(0, v, (n,), device=device, generator=g)
    return hidden, weight, labels


def naive(hidden, weight, labels):
    logits = (hidden @ weight.T).float()
    log_p = logits.log_softmax(-1)
    return log_p.gather(-1, labels[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)


def ours(backend):
    return lambda hidden, weight, labels: fused_log_probs(hidden, weight, labels, backend=backend)


def reference_rows(hidden, weight, labels, rows):
    logits = hidden[rows].double() @ weight.double().T
    log_p = logits.log_softmax(-1)
    return log_p.gather(-1, labels[rows, None])[:, 0], -(log_p.exp() * log_p).sum(-1)


def peak_extra(fn) -> float:
    """Peak memory allocated by fn beyond what was allocated before it, in bytes."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def bench(fn) -> float:
    return do_bench(fn, warmup=100, rep=400, return_mode="median")


def measure_forward(name, fn, hidden, weight, labels, floor_ms, rows, ref):
    with torch.no_grad():
        try:
            mem = peak_extra(lambda: fn(hidden, weight, labels))
            ms = bench(lambda: fn(hidden, weight, labels))
            lp, ent = fn(hidden, weight, labels)
        except torch.OutOfMemoryError:
            return dict(impl=name, mode="forward", oom=True)
    err_lp = float((lp[rows].double() - ref[0]).abs().max())
    err_ent = float((ent[rows].double() - ref[1]).abs().max())
    del lp, ent
    return dict(impl=name, mode="forward", ms=ms, ratio=ms / floor_ms, extra_bytes=mem, err_lp=err_lp, err_ent=err_ent)


def measure_backward(name, fn, hidden, weight, labels, floor_ms, g_lp, g_ent):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()

    def step():
        lp, ent = fn(h, w, labels)
        torch.autograd.backward([lp, ent], [g_lp, g_ent])

    try:
        mem = peak_extra(step)
        ms = do_bench(step, warmup=100, rep=400, grad_to_none=[h, w], return_mode="median")
    except torch.OutOfMemoryError:
        return dict(impl=name, mode="forward+backward", oom=True)
    return dict(impl=name, mode="forward+backward", ms=ms, ratio=ms / floor_ms, extra_bytes=mem)


def run_table(shapes, impls, backward: bool):
    """Each implementation is timed right after its own floor, so clock drift between them cancels out."""
    results = []
    for n, h, v in shapes:
        hidden, weight, labels = make_inputs(n, h, v)
        rows = torch.randperm(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
        rows = rows[:SAMPLE_ROWS]
        ref = reference_rows(hidden, weight, labels, rows)
        floor_fn = lambda: hidden @ weight.T
        for name, fn in impls.items():
            floor = bench(floor_fn)
            r = measure_forward(name, fn, hidden, weight, labels, floor, rows, ref)
            results.append(dict(shape=[n, h, v], floor_ms=floor, floor_tflops=2 * n * h * v / floor / 1e9, **r))
            print(json.dumps(results[-1]), flush=True)
        if backward:
            d_logits = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)
            floor3_fn = lambda: (hidden @ weight.T, d_logits @ weight, d_logits.T @ hidden)
            g_lp, g_ent = torch.randn(2, n, device="cuda")
            for name, fn in impls.items():
                if name == "torch":  # fp32 backward GEMMs: minutes at these shapes, and not the point
                    continue
                floor3 = bench(floor3_fn)
                r = measure_backward(name, fn, hidden, weight, labels, floor3, g_lp, g_ent)
                results.append(dict(shape=[n, h, v], floor_ms=floor3, **r))
                print(json.dumps(results[-1]), flush=True)
            del d_logits
        torch.cuda.empty_cache()
    return results


def run_sweep(shapes):
    base = tile_config(torch.bfloat16)
    variants = {
        "default": base,
        "pointers": replace(base, tma=False),
        "s4": replace(base, num_stages=4),
        "k128s3": replace(base, block_h=128, num_stages=3),
        "k128s2": replace(base, block_h=128, num_stages=2),
        "splits16g8": replace(base, num_splits=16, group_r=8),
        "splits33": replace(base, num_splits=33),  # (rows of 512k tokens x 33 splits: whole waves on 132 SMs)
        "splits8": replace(base, num_splits=8),  # (the default before 66: the last of 15.5 waves half empty)
        "256x128": replace(base, block_n=256, block_v=128),
        "g32": replace(base, group_r=32),
    }
    results = []
    for n, h, v in shapes:
        hidden, weight, labels = make_inputs(n, h, v)
        inv_t = torch.ones(n, device="cuda")
        floor = bench(lambda: hidden @ weight.T)
        ref_lp, ref_ent, lse, _ = triton_log_probs_forward(hidden, weight, labels, inv_t, ignore_index=-100,
                                                           compute_entropy=True, config=base)
        g = torch.randn(n, device="cuda")
        for name, cfg in variants.items():
            try:
                fwd = lambda: triton_log_probs_forward(hidden, weight, labels, inv_t, ignore_index=-100,
                                                       compute_entropy=True, config=cfg)
                lp, ent, _, _ = fwd()
                ms_f = bench(fwd)
                bwd = lambda: triton_log_probs_backward(hidden, weight, labels, inv_t, lse, ref_ent, g, g,
                                                        ignore_index=-100, config=cfg)
                ms_b = bench(bwd)
                diff = float((lp - ref_lp).abs().max())
            except Exception as e:  # a config that does not compile or fit is reported, not fatal
                print(f"{name}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            results.append(dict(shape=[n, h, v], config=name, fwd_ms=ms_f, fwd_ratio=ms_f / floor, bwd_ms=ms_b,
                                bwd_ratio_vs_2gemm=ms_b / (2 * floor), max_diff_vs_default=diff))
            print(json.dumps(results[-1]), flush=True)
    return results


def run_curve(h=4096, v=151936):
    results = []
    for n in (1024, 2048, 4096, 8192, 16384, 32768):
        hidden, weight, labels = make_inputs(n, h, v)
        with torch.no_grad():
            for name, fn in (("naive", naive), ("triton", ours("triton"))):
                try:
                    mem = peak_extra(lambda: fn(hidden, weight, labels))
                    ms = bench(lambda: fn(hidden, weight, labels))
                except torch.OutOfMemoryError:
                    continue
                results.append(dict(n=n, impl=name, ms=ms, extra_bytes=mem))
                print(json.dumps(results[-1]), flush=True)
        torch.cuda.empty_cache()
    return results


def print_table(results):
    head = ("shape", "mode", "impl", "ms", "ratio", "extra MiB", "err lp", "err ent")
    print("{:>22} {:>17} {:>7} {:>9} {:>6} {:>10} {:>8} {:>8}".format(*head))
    for r in results:
        shape = "x".join(map(str, r["shape"]))
        if r.get("oom"):
            print(f"{shape:>22} {r['mode']:>17} {r['impl']:>7}  OOM")
            continue
        errs = f"{r['err_lp']:8.1e} {r['err_ent']:8.1e}" if "err_lp" in r else ""
        print(f"{shape:>22} {r['mode']:>17} {r['impl']:>7} {r['ms']:9.3f} {r['ratio']:6.3f} "
              f"{r['extra_bytes'] / 2**20:10.1f} {errs}")


def run_top_k(shapes, device: str) -> list[dict]:
    """The Triton forward alone, then asked for the top k (1, 20, 64, 256) and for 16 candidate ids, each against
    the same run's GEMM (hidden @ weight.T, the floor) and the plain forward; the top-k log-probs' and the plain
    log-probs' largest error against float64 on sampled rows, and whether the ids are a stable sort's (ties to the
    lower id); and the full-logits way (logits, log_softmax, torch.topk) as what a scorer without a fused head pays."""
    cuda = device == "cuda"
    timer = bench if cuda else (lambda fn: _cpu_ms(fn))
    results = []

    last = [time.perf_counter()]

    def add(r: dict) -> None:  # printed as it comes, with its wall time (compiling, checking): a slow case shows
        r["wall_s"], last[0] = time.perf_counter() - last[0], time.perf_counter()
        results.append(r)
        _print_top_k(r)
    for n, h, v in shapes:
        hidden, weight, labels = make_inputs(n, h, v, device=device)
        rows = torch.randperm(n, generator=torch.Generator().manual_seed(1))[:SAMPLE_ROWS].to(device)
        log_p = (hidden[rows].double() @ weight.double().T).log_softmax(-1)
        order = torch.sort(log_p, dim=-1, descending=True, stable=True).indices
        floor = timer(lambda: hidden @ weight.T)
        candidates = torch.randint(0, v, (16,), generator=torch.Generator().manual_seed(2)).to(device)
        plain_ms = timer(lambda: fused_log_probs(hidden, weight, labels, backend="triton"))
        plain_err = float((fused_log_probs(hidden, weight, labels, backend="triton")[0][rows].double()
                           - log_p.gather(-1, labels[rows, None])[:, 0]).abs().max())
        base = dict(shape=f"{n}x{h}x{v}", floor_ms=floor, plain_ms=plain_ms, plain_err=plain_err)
        add(dict(base, case="plain", ms=plain_ms, ratio=plain_ms / floor, vs_plain=1.0))
        for k in (1, 20, 64, 256):
            if k > v:
                continue
            fn = lambda k=k: fused_log_probs(hidden, weight, labels, backend="triton", top_k=k)  # noqa: E731
            ms = timer(fn)
            out = fn()
            ids = order[:, :k]
            err = float((out.top_log_probs[rows].double() - log_p.gather(-1, ids)).abs().max())
            # ids the float64 order puts elsewhere: near-ties (values within fp32 rounding) or a wrong answer
            gap = float((log_p.gather(-1, out.top_ids[rows]) - log_p.gather(-1, ids)).abs().max())
            add(dict(base, case=f"top-{k}", ms=ms, ratio=ms / floor, vs_plain=ms / plain_ms, err=err,
                     ids_equal=bool(torch.equal(out.top_ids[rows], ids)),
                     ids_differing=int((out.top_ids[rows] != ids).sum()), value_gap_at_our_ids=gap,
                     again=_computed_again(log_p, k, max(tile_config(hidden.dtype).block_v, top_width(k)))))
        fn = lambda: fused_log_probs(hidden, weight, labels, backend="triton", token_ids=candidates)  # noqa: E731
        ms = timer(fn)
        err = float((fn().candidate_log_probs[rows].double() - log_p[:, candidates]).abs().max())
        add(dict(base, case="16 candidates", ms=ms, ratio=ms / floor, vs_plain=ms / plain_ms, err=err))

        def full_logits():
            return torch.topk((hidden @ weight.T).float().log_softmax(-1), 20, dim=-1)

        try:
            ms = timer(full_logits)
            add(dict(base, case="full logits + topk 20", ms=ms, ratio=ms / floor, vs_plain=ms / plain_ms))
        except torch.OutOfMemoryError:
            add(dict(base, case="full logits + topk 20", oom=True))
    return results


def _computed_again(log_p, k: int, block_v: int) -> float:
    """Of the sampled rows' k chosen tiles (largest maxima), the share the second pass computes again: a second
    largest at or above the k-th tile maximum (from float64 logits, so near-ties may count either way)."""
    padded = torch.nn.functional.pad(log_p, (0, -log_p.shape[1] % block_v), value=float("-inf"))
    tiles = padded.unflatten(1, (-1, block_v))
    top2 = tiles.topk(2, dim=-1).values
    k_tiles = min(k, tiles.shape[1])
    low = top2[..., 0].topk(k_tiles, dim=-1).values[:, -1:]
    return float(((top2[..., 0] >= low) & (top2[..., 1] >= low)).sum() / (len(log_p) * k_tiles))


def _print_top_k(r: dict) -> None:
    print(f"{r['shape']:>20} {r['case']:>22} " + (f"{r['ms']:9.3f} ms {r['ratio']:6.3f}x GEMM "
          f"{r['vs_plain']:6.3f}x plain" if "ms" in r else "out of memory")
          + (f"  err {r['err']:.1e} (plain {r['plain_err']:.1e})" if "err" in r else "")
          + (" ids =" if r.get("ids_equal") else f" ids differ at {r['ids_differing']} (gap "
             f"{r['value_gap_at_our_ids']:.1e})" if "ids_equal" in r else "")
          + (f", {r['again']:.1%} of chosen tiles again" if "again" in r else "") + f" ({r['wall_s']:.0f} s)",
          flush=True)


def _cpu_ms(fn) -> float:
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", help="NxHxV, default: the three of BENCHMARKS.md")
    parser.add_argument("--impls", default="naive,torch,triton", help="comma-separated: naive,torch,triton")
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="time tile configurations instead")
    parser.add_argument("--curve", action="store_true", help="time and memory against N, naive vs triton")
    parser.add_argument("--top-k", action="store_true", help="top-k and candidates against plain (forward, Triton)")
    parser.add_argument("--profile", action="store_true", help="with --top-k: each top-k call's kernels, profiled")
    parser.add_argument("--warmup", type=float, default=3.0, metavar="SECONDS",
                        help="the first shape's GEMM back to back for this long before anything is timed (0: "
                        "do_bench's own warm-up alone, as before 2026-12-07)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    cuda = torch.cuda.is_available()
    meta = dict(gpu=torch.cuda.get_device_properties(0).name if cuda else None, torch=torch.__version__,
                date=time.strftime("%Y-%m-%d"), warmup_s=args.warmup if cuda else 0)
    print(f"# {meta}", flush=True)
    if cuda and args.warmup:  # (the first case timed would otherwise run at the clocks of the card's first second)
        hidden, weight, _ = make_inputs(*shapes[0][:2], 32768)
        busy(lambda: hidden @ weight.T, args.warmup, cuda)
        del hidden, weight
    if args.top_k:
        results = run_top_k(shapes if args.shapes else [(32768, 4096, 151936)], "cuda" if cuda else "cpu")
        if args.profile:
            from bench_model import profile
            n, h, v = shapes[0] if args.shapes else (32768, 4096, 151936)
            hidden, weight, labels = make_inputs(n, h, v, device="cuda" if cuda else "cpu")
            for k in (k for k in (0, 64, 256) if k <= v):
                print(f"# top-{k}, {n}x{h}x{v}: the kernels", flush=True)
                profile(lambda k=k: fused_log_probs(hidden, weight, labels, backend="triton", top_k=k),
                        "cuda" if cuda else "cpu")
    elif args.sweep:
        results = run_sweep(shapes)
    elif args.curve:
        results = run_curve()
    else:
        impls = {"naive": naive, "torch": ours("torch"), "triton": ours("triton")}
        results = run_table(shapes, {k: impls[k] for k in args.impls.split(",")}, not args.no_backward)
        print_table(results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)


if __name__ == "__main__":
    main()

"""Causal attention of packed sequences: our Triton kernel (workers/models/causal_attention.py, what `attend` runs for
heads of up to 128) against torch's FlashAttention varlen kernel on the same row, in one run, with the same run's
bf16 GEMM rate beside them (4096^3) as the floor; ms, TFLOP/s (causal FLOPs: 4 x keys seen x head size per query
head) and whether each sequence scored alone keeps its bits in the packed row; and ours again with each call after a
GEMM of the 7B's MLP size, as inside the model (where the profile finds it slower). The floor's GEMM and each case's
kernel first run back to back for --warmup seconds (3), past the clock dip of a GPU's first second of load; the cases
are timed in turn, --rounds times (3), and each one's median reported.

  python benchmarks/bench_attention.py --out attention.json   # one H200
  python benchmarks/bench_attention.py --sweep                # the kernel's tilings on the first case
  python benchmarks/bench_attention.py --gluon                # hopper_attention.py's forms in turn (Hopper), bits
  python benchmarks/bench_attention.py --launch               # host time of a launch, Triton and Gluon, small rows
  TRITON_INTERPRET=1 python benchmarks/bench_attention.py --tiny   # a CPU dry run
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch
from bench_moe import busy, ms_timer, timed  # the same directory

from ppo_logprobs.workers.models import causal_attention as ca

CASES = {  # name: (sequence lengths, query heads, key-value heads, head size)
    "8 x 4096, Qwen3-30B-A3B heads": ([4096] * 8, 32, 4, 128),
    "mixed rollouts, Qwen3-30B-A3B heads": (np.random.default_rng(0).integers(256, 4096, 12).tolist(), 32, 4, 128),
    "8 x 4096, Qwen2.5-7B heads": ([4096] * 8, 28, 4, 128),
}
SWEEP = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3), (128, 32, 4, 3), (128, 64, 4, 3),
         (64, 64, 4, 3), (64, 128, 4, 3),
         # fused: scale and max in one FMA, the mask after exp2 (causal_attention._key_block); then keys and values
         # read as tensor descriptors (the copy engine)
         (128, 64, 8, 3, True), (128, 64, 8, 4, True), (128, 128, 8, 2, True), (128, 128, 8, 3, True),
         (128, 64, 8, 3, False, True), (128, 64, 8, 3, True, True), (128, 128, 8, 2, True, True),
         (128, 128, 8, 3, True, True), (128, 64, 8, 4, True, True),
         # hopper_attention.py's Gluon kernels (Tiles.gluon)
         (128, 128, 8, 3, True, False, "persistent")]
GLUON_FORMS = ["persistent"]  # hopper_attention.FORMS (imported only where Gluon is)


def row_of(lengths: list[int], heads: int, kv_heads: int, d: int, device: str, dtype: torch.dtype):
    g = torch.Generator(device=device).manual_seed(0)
    t = sum(lengths)
    q = torch.randn(t, heads, d, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(t, kv_heads, d, device=device, dtype=dtype, generator=g) for _ in range(2))
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device=device)
    return q, k, v, cu


def after_gemm_ms(fn, x, w, cuda: bool, n: int = 50) -> float:
    """fn's median ms when each call follows a GEMM of the 7B's MLP width (x @ w), as it does inside the model: the
    clocks and the L2 as a layer's projections leave them (its own benchmark times it call after call)."""
    times = []
    for _ in range(n + 5):
        x @ w
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            times.append((start, end))
        else:
            times.append(timed(fn, False, 1) * 1e3)
    if cuda:
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in times]
    return float(np.median(times[-n:]))


def suffix_bits_differ(q, k, v, n: int, d: int, tiles=None, launch=None) -> int:
    """Queries of the row's first sequence (n tokens) whose output bits differ between the sequence scored whole and
    as a suffix after its first c keys, for c in 1, n / 3, n - 1 (query tiles starting elsewhere: other blocks masked),
    with this tiling (or `launch(q, k, v, cu_q, cu_k, max_q)` -> out): what a kernel must keep for shared prefixes
    (0)."""
    launch = launch or (lambda *a: ca._launch(*a, d**-0.5, None, tiles)[0])
    seg = lambda *bounds: torch.tensor(bounds, dtype=torch.int32, device=q.device)  # noqa: E731
    whole = launch(q[:n], k[:n], v[:n], seg(0, n), seg(0, n), n)
    differ = 0
    for cut in (1, n // 3, n - 1):
        part = launch(q[cut:n], k[:n], v[:n], seg(0, n - cut), seg(0, n), n - cut)
        differ += int((part != whole[cut:]).any(-1).any(-1).sum())
    return differ


def gluon_check(time_ms, forms: list[str], warmup: float, rounds: int) -> dict:
    """workers/models/hopper_attention.py's forms (Tiles.gluon, Hopper) against the Triton kernel at the same tiling on
    each case: the largest difference, queries with the same bits (output and log-sum-exp), queries whose bits differ
    as suffixes, and the time, the kernels in turn within each case, `rounds` times (each after `warmup` seconds of
    itself, a third of that after the first round), with each form's median ratio to the first's; then against
    float64 on small segments (with keys shared ahead of two of them), grouped heads, with and without a window."""
    default = ca._tiles(128, torch.bfloat16)._replace(gluon="")  # (the Triton kernel, whatever the default form)
    found = {}
    for name, (lengths, heads, kv_heads, d) in CASES.items():
        q, k, v, cu = row_of(lengths, heads, kv_heads, d, "cuda", torch.bfloat16)
        flops = 4 * sum(n * (n + 1) / 2 for n in lengths) * heads * d
        ours, ours_lse = ca._launch(q, k, v, cu, cu, max(lengths), d**-0.5, None, default)
        calls = {"triton": lambda: ca._launch(q, k, v, cu, cu, max(lengths), d**-0.5, None, default)}
        case = found[name] = {}
        for form in forms:
            tiles = default._replace(gluon=form)
            try:
                got, lse = ca._launch(q, k, v, cu, cu, max(lengths), d**-0.5, None, tiles)
            except Exception as err:  # noqa: BLE001 (a form that fails is a finding)
                print(f"{name}, {form}: {type(err).__name__}: {str(err)[:200]}", flush=True)
                continue
            same = (ours == got).all(-1).all(-1) & (ours_lse == lse).all(0)
            case[form] = dict(max_diff=float((ours.float() - got.float()).abs().max()),
                              same_bits=float(same.float().mean()),
                              suffix_bits_differ=suffix_bits_differ(q, k, v, lengths[0], d, tiles))
            print(f"{name}, {form}: {case[form]}", flush=True)
            calls[form] = lambda tiles=tiles: ca._launch(q, k, v, cu, cu, max(lengths), d**-0.5, None, tiles)
        tflops = {kernel: [] for kernel in calls}
        for r in range(rounds):
            for kernel, call in (calls.items() if r % 2 == 0 else reversed(calls.items())):
                busy(call, warmup if r == 0 else warmup / 3, True)
                tflops[kernel].append(flops / time_ms(call) / 1e9)
        first = tflops[forms[0]] if forms[0] in tflops else None
        for kernel, runs in tflops.items():
            ratio = float(np.median([a / b for a, b in zip(runs, first, strict=True)])) if first else None
            case.setdefault(kernel, {}).update(tflops=float(np.median(runs)), tflops_rounds=runs,
                                               **{f"ratio_to_{forms[0]}": ratio})
            print(f"{name}, {kernel}: {np.median(runs):.1f} TFLOP/s (rounds {' '.join(f'{x:.1f}' for x in runs)})"
                  + (f", {ratio:.4f} of {forms[0]}'s" if first else ""), flush=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    q_lengths, k_lengths = [1, 5, 129, 300, 517, 200, 64], [1, 5, 129, 300, 517, 333, 64 + 190]
    q = torch.randn(sum(q_lengths), 6, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(sum(k_lengths), 2, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *np.cumsum(n)], dtype=torch.int32, device="cuda") for n in (q_lengths, k_lengths))
    for form in forms:
        for window in (None, 150):
            out, lse = ca._launch(q, k, v, cu_q, cu_k, max(q_lengths), 128**-0.5, window, default._replace(gluon=form))
            worst = worst_lse = 0.0
            for i in range(len(q_lengths)):
                a, b, c, e = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
                qq = q[a:b].double()
                kk, vv = (x[c:e].double().repeat_interleave(3, 1) for x in (k, v))
                scores = torch.einsum("qhd,khd->hqk", qq, kk) / math.sqrt(128)
                behind = torch.arange(b - a, device="cuda")[:, None] + (e - c) - (b - a) - torch.arange(
                    e - c, device="cuda")[None, :]
                scores = scores.masked_fill((behind < 0) | (behind >= (window or e)), -math.inf)
                want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
                worst = max(worst, float((out[a:b].double() - want).abs().max()))
                worst_lse = max(worst_lse, float((lse[:, a:b].double() - scores.logsumexp(-1)).abs().max()))
            print(f"{form}, window {window}, against float64 (segments of 1 to 517 queries, two after shared keys, "
                  f"6 / 2 heads): max |diff| {worst:.3g} (bf16 output: ~1e-2 expected), log-sum-exp {worst_lse:.3g}",
                  flush=True)
            found[f"float64, {form}, window {window}"] = dict(max_diff=worst, lse_max_diff=worst_lse)
    return found


def launch_cost(cuda: bool) -> None:
    """Microseconds a call of causal_attention._launch takes the host (300 calls, no sync between) and until the device
    is done, on one segment of 28 / 4 heads (the 7B's), by the Triton kernel at the default tiling and by the Gluon
    kernel: what causal_attention.GLUON_TOKENS weighs."""
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    base = ca._tiles(128, dtype)._replace(gluon="")
    forms = ["", "persistent"] if cuda and torch.cuda.get_device_capability()[0] == 9 else [""]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    print(f"{'tokens':>7} {'kernel':>10} {'host us/call':>13} {'device us/call':>15}")
    for n in (128, 512, 2048) if cuda else (16,):
        q, k, v, cu = row_of([n], 28, 4, 128, device, dtype)
        for form in forms:
            tiles = base._replace(gluon=form)

            def call(tiles=tiles, q=q, k=k, v=v, cu=cu, n=n):
                return ca._launch(q, k, v, cu, cu, n, 128**-0.5, None, tiles)

            for _ in range(20 if cuda else 1):
                call()
            sync()
            reps, start = 300 if cuda else 2, time.perf_counter()
            for _ in range(reps):
                call()
            host = (time.perf_counter() - start) / reps * 1e6
            sync()
            print(f"{n:>7} {form or 'triton':>10} {host:>13.1f} {(time.perf_counter() - start) / reps * 1e6:>15.1f}")


def sm_clock_mhz() -> int | None:
    try:
        return torch.cuda.clock_rate()
    except Exception:  # noqa: BLE001 (no NVML here: the figure is left out)
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: short sequences, fp32")
    parser.add_argument("--sweep", action="store_true", help="the kernel's tilings on the first case, then exit")
    parser.add_argument("--gluon", nargs="*", choices=GLUON_FORMS,
                        help="hopper_attention.py's kernel (its forms; default: all) against the Triton kernel at "
                        "its tiling (Hopper): bits, float64, and the kernels timed in turn; then exit")
    parser.add_argument("--launch", action="store_true", help="a launch's host time on small rows, then exit")
    parser.add_argument("--warmup", type=float, default=3.0, metavar="SECONDS",
                        help="the floor's GEMM and each case's kernel back to back for this long before they are "
                        "timed (0: do_bench's own warm-up alone, as before 2026-12-07)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="the cases timed in turn this many times, the median reported (1: each once, in order)")
    parser.add_argument("--out")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    if args.launch:
        return launch_cost(cuda)
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    time_ms = ms_timer(cuda, rep=200)
    floor = None
    if cuda:
        a, b = torch.randn(4096, 4096, device=device, dtype=dtype), torch.randn(4096, 4096, device=device, dtype=dtype)
        busy(lambda: a @ b, args.warmup, cuda)
        floor = 2 * 4096**3 / time_ms(lambda: a @ b) / 1e9
    if args.gluon is not None:
        if not cuda or torch.cuda.get_device_capability()[0] != 9:
            raise SystemExit("--gluon: hopper_attention.py's kernels need a Hopper GPU")
        found = gluon_check(time_ms, args.gluon or GLUON_FORMS, args.warmup, args.rounds)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, warmup_s=args.warmup,
                               rounds=args.rounds, gemm_floor_tflops=floor, cases=found), f, indent=1)
        return
    cases = {}
    for name, (lengths, heads, kv_heads, d) in CASES.items():
        if args.tiny:
            lengths, heads, kv_heads, d = [n // 64 for n in lengths], 4, 2, 16
        q, k, v, cu = row_of(lengths, heads, kv_heads, d, device, dtype)
        longest = max(lengths)
        flops = 4 * sum(n * (n + 1) / 2 for n in lengths) * heads * d

        def ours(tiles=None, q=q, k=k, v=v, cu=cu, longest=longest, d=d):
            return ca._launch(q, k, v, cu, cu, longest, d**-0.5, None, tiles)[0]

        if args.sweep:
            fused = ca._tiles(d, dtype)._replace(fused=True, tma=True)  # (a CPU dry run: the default, and fused)
            for tiles in [ca._tiles(d, dtype)] + ([ca.Tiles(*c) for c in SWEEP] if cuda else [fused]):
                try:
                    ms = time_ms(lambda tiles=tiles: ours(tiles))
                    print(f"{name}: {tiles} {ms:8.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s, queries whose bits differ "
                          f"as suffixes: {suffix_bits_differ(q, k, v, lengths[0], d, tiles)}", flush=True)
                except Exception as err:  # noqa: BLE001 (a tiling that does not compile is a finding of the sweep)
                    print(f"{name}: {tiles} {type(err).__name__}: {str(err)[:100]}", flush=True)
            return
        cases[name] = (lengths, heads, kv_heads, d, q, k, v, cu, flops, ours)
    # the cases in turn, --rounds times (each after --warmup seconds of its own kernel in the first round, a third of
    # that later), the median taken: a case timed last in one pass ran 3-9% under the same kernel timed in turn
    # (BENCHMARKS.md), the card hotter by then
    times = {name: [] for name in cases}
    clocks = {name: [] for name in cases}
    for r in range(args.rounds if cuda else 1):
        for name, case in cases.items():
            busy(case[-1], args.warmup if r == 0 else args.warmup / 3, cuda)
            times[name].append(time_ms(case[-1]))
            clocks[name].append(sm_clock_mhz() if cuda else None)
    rows = []
    for name, (lengths, heads, kv_heads, d, q, k, v, cu, flops, ours) in cases.items():
        longest = max(lengths)
        result = dict(case=name, tokens=sum(lengths), heads=heads, kv_heads=kv_heads, head_dim=d,
                      ours_ms=float(np.median(times[name])), ours_ms_rounds=times[name],
                      tiles=list(ca._tiles(d, dtype)), sm_clock_mhz_rounds=clocks[name])
        hidden, width = (3584, 18944) if not args.tiny else (64, 128)  # (Qwen2.5-7B's hidden and MLP sizes)
        x = torch.randn(sum(lengths), hidden, device=device, dtype=dtype)
        w = torch.randn(hidden, width, device=device, dtype=dtype)
        result["ours_after_gemm_ms"] = after_gemm_ms(ours, x, w, cuda, n=50 if cuda else 1)
        result["sm_clock_mhz_after_gemms"] = sm_clock_mhz() if cuda else None
        del x, w
        if cuda:
            result["flash_attention_ms"] = time_ms(lambda q=q, k=k, v=v, cu=cu, longest=longest: (
                torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, True, False)))
        packed = ours()
        spans = list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))
        alone = [ca._launch(q[a:b], k[a:b], v[a:b], *[torch.tensor([0, b - a], dtype=torch.int32, device=device)] * 2,
                            b - a, d**-0.5, None)[0] for a, b in spans]
        result["sequences_differing"] = sum(not torch.equal(x, packed[a:b]) for x, (a, b) in
                                            zip(alone, spans, strict=True))
        for key in ("ours", "ours_after_gemm", "flash_attention"):
            if f"{key}_ms" in result:
                result[f"{key}_tflops"] = flops / result[f"{key}_ms"] / 1e9
        result["ours_tflops_rounds"] = [flops / ms / 1e9 for ms in times[name]]
        result["gemm_floor_tflops"] = floor
        rows.append(result)
        print(json.dumps(result), flush=True)
    meta = dict(device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__, dtype=str(dtype),
                options={k: v for k, v in vars(args).items() if k != "out" and v != parser.get_default(k)},
                timing=dict(warmup_s=args.warmup if cuda else 0, rounds=args.rounds if cuda else 1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"{'case':>38} {'ours ms':>8} {'after GEMM':>10} {'FA2 ms':>8} {'ours TF/s':>9} {'FA2 TF/s':>9} "
          f"{'GEMM TF/s':>9} {'differ':>6}  ours TF/s by round")
    for r in rows:
        print(f"{r['case']:>38} {r['ours_ms']:8.2f} {r['ours_after_gemm_ms']:10.2f} "
              f"{r.get('flash_attention_ms', float('nan')):8.2f} "
              f"{r.get('ours_tflops', float('nan')):9.1f} {r.get('flash_attention_tflops', float('nan')):9.1f} "
              f"{r['gemm_floor_tflops'] or float('nan'):9.1f} {r['sequences_differing']:6d}  "
              + " ".join(f"{x:.1f}" for x in r["ours_tflops_rounds"]))


if __name__ == "__main__":
    main()

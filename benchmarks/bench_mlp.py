"""The gated MLP's first half, silu(x @ gate.T) * (x @ up.T): cuBLAS's two GEMMs and silu_mul.py's pass (the path
before hopper_gated.py) against hopper_gated.py's one GEMM with the middle in its epilogue, with the same run's
floor beside them: one cuBLAS GEMM of the same FLOPs (x @ [gate; up].T, the two weights in one tensor). ms and
TFLOP/s (2 x rows x K x 2N), in invariant mode (cuBLAS without split-K, as workers run); then each path's error
against float64 on 256 rows and whether rows keep their bits alone (1, 7 and 256 rows) and in the whole batch.

  python benchmarks/bench_mlp.py --out mlp.json     # one Hopper GPU
  python benchmarks/bench_mlp.py --projections      # o and down plus the residual; q/k/v with biases and rotary
  TRITON_INTERPRET=1 python benchmarks/bench_mlp.py --tiny   # a CPU dry run (cuBLAS's path only)
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from bench_moe import ms_timer  # the same directory
from torch.nn import functional as F

from ppo_logprobs.workers.models import hopper_gated
from ppo_logprobs.workers.models.patch_model import allow_split_k
from ppo_logprobs.workers.models.rotary import rotary, rotary_reference
from ppo_logprobs.workers.models.silu_mul import silu_mul

SHAPES = {"Qwen2.5-7B": (3584, 18944), "Llama-3.1-8B": (4096, 14336), "Qwen2.5-1.5B": (1536, 8960)}  # K, N
PROJECTIONS = {"Qwen2.5-7B o": (3584, 3584), "Qwen2.5-7B down": (18944, 3584)}  # K, N: plus the residual
QKV = {"Qwen2.5-7B q/k/v": (3584, 28, 4, True), "Llama-3.1-8B q/k/v": (4096, 32, 8, False)}  # K, heads, kv heads, bias
ROWS = (32768, 8192, 2048)
ERROR = "max abs error / max abs (256 rows, float64)"
SWEEP = ((4, 8), (3, 8), (4, 4), (4, 16), (4, 1))  # hopper_gated's (stages, group): the default first


def paths(gate: torch.Tensor, up: torch.Tensor, fused: bool) -> dict:
    both = torch.cat([gate, up])
    out = {"cuBLAS x 2 + silu_mul": lambda x: silu_mul(F.linear(x, gate), F.linear(x, up)),
           "floor: one cuBLAS GEMM": lambda x: F.linear(x, both)}
    if fused:
        out["hopper_gated"] = lambda x: hopper_gated.middle(x, gate, up)
    return out


def reference(x, gate, up) -> torch.Tensor:
    x, gate, up = (t.double() for t in (x, gate, up))
    return F.silu(x @ gate.T) * (x @ up.T)


def rope(rows: int, device: str, dtype: torch.dtype, d: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [rows, d] as HF's rotary embedding makes them (theta 1e6) for sequences of 4096 packed in a row."""
    freqs = (torch.arange(rows, device=device) % 4096)[:, None].double() / 1e6 ** (
        torch.arange(0, d, 2, device=device).double() / d)
    angles = torch.cat([freqs, freqs], -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def qkv_paths(weights, biases, cos, sin, fused: bool) -> dict:
    both = torch.cat(weights)

    def before(x):
        q, k, v = (F.linear(x, w, b).view(len(x), -1, 128) for w, b in zip(weights, biases or (None,) * 3, strict=True))
        return rotary(q, cos, sin), rotary(k, cos, sin), v

    out = {"cuBLAS x 3 + rotary x 2": before, "floor: one cuBLAS GEMM": lambda x: F.linear(x, both)}
    if fused:
        out["hopper_gated.qkv"] = lambda x: hopper_gated.qkv(x, weights, biases, cos, sin)
    return out


def qkv_reference(x, weights, biases, cos, sin) -> list[torch.Tensor]:
    x, cos, sin = x.double(), cos.double(), sin.double()
    q, k, v = (F.linear(x, w.double(), None if b is None else b.double()).view(len(x), -1, 128)
               for w, b in zip(weights, biases or (None,) * 3, strict=True))
    return [rotary_reference(q, cos, sin), rotary_reference(k, cos, sin), v]


def sweep(timer, device: str) -> None:
    k, n = SHAPES["Qwen2.5-7B"]
    g = torch.Generator(device=device).manual_seed(0)
    gate, up = (torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) * k**-0.5 for _ in range(2))
    x = torch.randn(ROWS[0], k, device=device, dtype=torch.bfloat16, generator=g)
    floor = timer(lambda: F.linear(x, torch.cat([gate, up])))
    print(f"floor (one cuBLAS GEMM): {floor:.3f} ms, {4 * ROWS[0] * k * n / floor / 1e9:.1f} TFLOP/s")
    want = hopper_gated.middle(x, gate, up)
    for stages, group in SWEEP:
        ms = timer(lambda: hopper_gated.middle(x, gate, up, stages, group))  # noqa: B023
        same = torch.equal(hopper_gated.middle(x, gate, up, stages, group), want)
        print(f"stages {stages}, group {group:2d}: {ms:.3f} ms, {4 * ROWS[0] * k * n / ms / 1e9:.1f} TFLOP/s, "
              f"{ms / floor:.3f} x the floor, bits as the default's: {same}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU dry run, small shapes")
    parser.add_argument("--sweep", action="store_true", help="hopper_gated's ring and tile order on the 7B's shape")
    parser.add_argument("--projections", action="store_true",
                        help="only the projections: o and down (plus the residual), q/k/v (biases, rotary)")
    parser.add_argument("--out")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    allow_split_k(False)
    shapes = {"tiny": (64, 96)} if args.tiny else {} if args.projections else SHAPES
    rows_list = (300, 64) if args.tiny else ROWS
    timer = ms_timer(cuda)
    if args.sweep:
        return sweep(timer, device)
    results = []
    for name, (k, n) in ({} if args.tiny else PROJECTIONS).items():
        g = torch.Generator(device=device).manual_seed(0)
        weight = torch.randn(n, k, device=device, dtype=dtype, generator=g) * k**-0.5
        x = torch.randn(ROWS[0], k, device=device, dtype=dtype, generator=g)
        residual = torch.randn(ROWS[0], n, device=device, dtype=dtype, generator=g)
        row = {"shape": name, "K": k, "N": n, "rows": ROWS[0], "projection": True}
        for label, fn in {"residual + cuBLAS": lambda: residual + F.linear(x, weight),  # noqa: B023
                          "floor: cuBLAS alone": lambda: F.linear(x, weight),  # noqa: B023
                          "hopper_gated.plus": lambda: hopper_gated.plus(x, weight, residual)}.items():  # noqa: B023
            ms = timer(fn)
            row[label] = {"ms": ms, "tflops": 2 * ROWS[0] * k * n / ms / 1e9}
        exact = residual[:256].double() + x[:256].double() @ weight.double().T
        row[ERROR] = {  # (cuBLAS's path, then ours)
            label: (y[:256].double() - exact).abs().max().item() / exact.abs().max().item()
            for label, y in (("residual + cuBLAS", residual + F.linear(x, weight)),
                             ("hopper_gated.plus", hopper_gated.plus(x, weight, residual)))}
        results.append(row)
        print(json.dumps(row), flush=True)
    for name, (k, heads, kv_heads, biased) in ({"tiny q/k/v": (64, 2, 1, True)} if args.tiny else QKV).items():
        g = torch.Generator(device=device).manual_seed(0)
        weights = tuple(torch.randn(h * 128, k, device=device, dtype=dtype, generator=g) * k**-0.5
                        for h in (heads, kv_heads, kv_heads))
        biases = (tuple(torch.randn(len(w), device=device, dtype=dtype, generator=g) for w in weights) if biased
                  else None)
        x = torch.randn(rows_list[0], k, device=device, dtype=dtype, generator=g)
        cos, sin = rope(len(x), device, dtype)
        fused = cuda and hopper_gated.qkv_usable(x, weights, biases, cos, sin)
        n = sum(len(w) for w in weights)
        row = {"shape": name, "K": k, "N": n, "rows": len(x), "projection": True, "bias": biased}
        for label, fn in qkv_paths(weights, biases, cos, sin, fused).items():
            ms = timer(lambda: fn(x))  # noqa: B023
            row[label] = {"ms": ms, "tflops": 2 * len(x) * k * n / ms / 1e9}
        exact = qkv_reference(x[:256], weights, biases, cos[:256], sin[:256])
        row[ERROR] = {}
        for label, fn in qkv_paths(weights, biases, cos, sin, fused).items():
            if not label.startswith("floor"):
                got = [t.reshape(len(x), -1, 128)[:256].double() for t in fn(x)]
                row[ERROR][label] = max(((a - e).abs().max() / e.abs().max()).item()
                                        for a, e in zip(got, exact, strict=True))
        if fused:
            whole = hopper_gated.qkv(x, weights, biases, cos, sin)
            row["rows whose bits differ alone vs in the batch"] = sum(
                int((a != w[start:stop]).any(1).sum()) for start, stop in ((0, 1), (5, 12), (100, 356))
                for a, w in zip(hopper_gated.qkv(x[start:stop].clone(), weights, biases, cos[start:stop].clone(),
                                                 sin[start:stop].clone()), whole, strict=True))
        results.append(row)
        print(json.dumps(row), flush=True)
    for name, (k, n) in shapes.items():
        g = torch.Generator(device=device).manual_seed(0)
        gate, up = (torch.randn(n, k, device=device, dtype=dtype, generator=g) * k**-0.5 for _ in range(2))
        x_all = torch.randn(max(rows_list), k, device=device, dtype=dtype, generator=g)
        fused = cuda and hopper_gated.usable(x_all, gate, up)
        for rows in rows_list:
            x = x_all[:rows]
            row = {"shape": name, "K": k, "N": n, "rows": rows}
            for label, fn in paths(gate, up, fused).items():
                ms = timer(lambda: fn(x))  # noqa: B023
                row[label] = {"ms": ms, "tflops": 4 * rows * k * n / ms / 1e9}
            results.append(row)
            print(json.dumps(row), flush=True)
        exact = reference(x_all[:256], gate, up)
        scale = exact.abs().max().item()
        for label, fn in paths(gate, up, fused).items():
            if label.startswith("floor"):
                continue
            whole = fn(x_all)
            alone = [fn(x_all[:m].clone()) for m in (1, 7, 256)]
            results.append({"shape": name, "path": label,
                            "max abs error / max abs (256 rows, float64)":
                            (whole[:256].double() - exact).abs().max().item() / scale,
                            "rows whose bits differ alone vs in the batch":
                            sum(int((a != whole[:len(a)]).any(1).sum()) for a in alone)})
            print(json.dumps(results[-1]), flush=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "invariant": True,
            "options": {k: v for k, v in vars(args).items() if v and k != "out"},
            "tile": dict(rows=2 * hopper_gated.ROWS, columns=hopper_gated.COLUMNS, depth=hopper_gated.DEPTH,
                         stages=hopper_gated.STAGES, group=hopper_gated.GROUP)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    print(f"\n{meta['gpu']}: ms (TFLOP/s)")
    for row in results:
        if row.get("projection"):
            print(f"{row['shape']:18} {row['rows']:6d} " + " ".join(
                f"{label} {row[label]['ms']:.3f} ({row[label]['tflops']:.1f})" for label in row
                if isinstance(row[label], dict) and "ms" in row[label])
                + "  errors " + ", ".join(f"{e:.2e}" for e in row[ERROR].values())
                + (f"  rows differing {row['rows whose bits differ alone vs in the batch']}"
                   if "rows whose bits differ alone vs in the batch" in row else ""))
    labels = list(paths(gate, up, fused)) if shapes else []
    print(f"{'shape':14} {'rows':>6} " + " ".join(f"{label:>24}" for label in labels))
    for row in results:
        if "rows" in row and not row.get("projection"):
            print(f"{row['shape']:14} {row['rows']:6d} " + " ".join(
                f"{row[label]['ms']:11.3f} ({row[label]['tflops']:6.1f})" if label in row else f"{'':>24}"
                for label in labels))
    for row in results:
        if "path" in row:
            print(f"{row['shape']:14} {row['path']:22} error {row['max abs error / max abs (256 rows, float64)']:.2e}"
                  f"  rows differing {row['rows whose bits differ alone vs in the batch']}")


if __name__ == "__main__":
    main()

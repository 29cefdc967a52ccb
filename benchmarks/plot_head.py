"""Plot time and peak extra memory against N, naive vs fused, from `bench_head.py --curve` JSON.

  .venv/bin/pip install -e '.[bench]'    # matplotlib: not in the environment `make` builds
  python benchmarks/plot_head.py benchmarks/results/head_curve_h200.json benchmarks/head_curve_h200.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    with open(src) as f:
        data = json.load(f)
    meta, results = data["meta"], data["results"]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    for impl, label in (("naive", "naive logits + log_softmax"), ("triton", "fused Triton head")):
        rows = sorted((r for r in results if r["impl"] == impl), key=lambda r: r["n"])
        ns = [r["n"] for r in rows]
        ax_t.plot(ns, [r["ms"] for r in rows], marker="o", label=label)
        ax_m.plot(ns, [r["extra_bytes"] / 2**30 for r in rows], marker="o", label=label)
    for ax, title in ((ax_t, "forward time (ms)"), (ax_m, "peak extra memory (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens N (H=4096, V=151936, bf16)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"log-prob + entropy head, {meta['gpu']}, {meta['date']}")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""The top-k combine kernel compiled for sm_90a on a machine without a GPU (Triton's own ptxas), with the registers
and spills ptxas reports for each (TOP_K, rows a program) the head launches: a check before a GPU is at hand that a
kernel change compiles for Hopper and does not spill.

  python benchmarks/compile_sm90.py                 # k = 20, 64, 128, 256 as triton_log_probs_forward sizes them
"""

from __future__ import annotations

import os
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ppo_logprobs.workers.head import triton_log_probs_forward as forward  # noqa: E402

I64 = {"labels_ptr", "pair_keys_ptr", "tile_key_ptr", "top_tiles_ptr", "top_ids_ptr", "candidates_ptr"}
I32 = {"pair_count_ptr"}
INTS = {"N", "num_splits", "ignore_index", "num_tiles", "k_tiles", "k", "C"}


def ptxas() -> str:
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    newest = os.path.join(bin_dir, "ptxas-blackwell")  # (the one that reads the PTX version Triton writes)
    return newest if os.path.exists(newest) else os.path.join(bin_dir, "ptxas")


def combine(k: int) -> str:
    fn = forward._triton_combine_splits_kernel
    width = forward.top_width(k)
    block = forward.combine_rows(width)
    const = dict(COMPUTE_ENTROPY=True, TOP_K=width, CANDIDATES=False, TILES=16,
                 BLOCK_V=forward.tile_config(torch.bfloat16).block_v, BLOCK=block)
    sig = {n: "constexpr" if n in const else "i32" if n in INTS else "*i64" if n in I64 else "*i32" if n in I32
           else "*fp32"
           for n in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    out = subprocess.run([ptxas(), "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True,
                         text=True)
    said = [line.split("info    :")[-1].strip() for line in out.stderr.splitlines()
            if "Used" in line or "spill" in line]
    return f"k = {k:3d} (TOP_K {width}, {block} rows a program): " + "; ".join(said)


if __name__ == "__main__":
    for k in (20, 64, 128, 256):
        print(combine(k), flush=True)

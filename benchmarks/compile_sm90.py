"""The head's first pass (bf16 tiles, TMA, plain and with a top-k's tile statistics) and its top-k combine
compiled for sm_90a on a machine without a GPU (Triton's own ptxas), with the registers and spills ptxas reports and
the first pass's machine instructions (nvdisasm): a check before a GPU is at hand that a kernel change compiles for
Hopper, does not spill, and what it adds to the first pass's tile loop. Its epilogue is not hidden behind the tensor
cores: on an H100, the top-k statistics of stop 55 (1,465 instructions more than before) cost top-1 about 2 ms of a
65 ms call.

  python benchmarks/compile_sm90.py      # the first pass, the combine at k = 20, 64, 128, 256 as launched, the
                                         # attention kernel at its tiling and two the sweep tries, then
                                         # hopper_attention.py's forms, with a window and without, and
                                         # hopper_gated.py's GEMM and hopper_grouped.py's
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ppo_logprobs.workers.head import triton_log_probs_forward as forward  # noqa: E402
from ppo_logprobs.workers.models import causal_attention as attn  # noqa: E402
from ppo_logprobs.workers.models import hopper_attention as ha  # noqa: E402
from ppo_logprobs.workers.models import hopper_gated, hopper_grouped  # noqa: E402

I64 = {"labels_ptr", "pair_keys_ptr", "tile_key_ptr", "top_tiles_ptr", "top_ids_ptr", "candidates_ptr"}
I32 = {"pair_count_ptr", "tile_second_ptr"}
INTS = {"N", "num_splits", "ignore_index", "num_tiles", "k_tiles", "k", "C"}
FIRST_INTS = {"N", "V", "H", "stride_hn", "stride_wv", "tiles_per_split", "num_splits", "C"}


def ptxas() -> str:
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    newest = os.path.join(bin_dir, "ptxas-blackwell")  # (the one that reads the PTX version Triton writes)
    return newest if os.path.exists(newest) else os.path.join(bin_dir, "ptxas")


def _build(fn, sig: dict, const: dict, num_warps: int, num_stages: int = 3, attrs: dict | None = None,
           fusion: bool = True) -> tuple[list[str], int]:
    """ptxas's report (registers, spills) and the machine code's instruction count."""
    return _report(triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=fusion)))


def _report(compiled) -> tuple[list[str], int]:
    waits = re.findall(r"wgmma.wait_group.sync.aligned\s+(\d+)", compiled.asm["ptx"])
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        out = subprocess.run([ptxas(), "-v", "--gpu-name", "sm_90a", ptx, "-o", cubin], capture_output=True,
                             text=True)
        sass = subprocess.run([os.path.join(os.path.dirname(ptxas()), "nvdisasm"), "-c", cubin], capture_output=True,
                              text=True).stdout
    said = [line.split("info    :")[-1].strip() for line in out.stderr.splitlines()
            if any(word in line for word in ("Used", "spill", "injected"))]  # (injected: a wgmma wait ptxas added)
    said += [f"{compiled.metadata.shared} bytes of shared memory (Triton's)", f"wgmma waits {', '.join(waits)}"]
    at = re.compile(r"\s+/\*[0-9a-f]{4,}\*/")  # (an instruction's line: its offset)
    return said, sum(1 for line in sass.splitlines() if at.match(line) and "NOP" not in line)


def first_pass(tile_stats: bool) -> str:
    fn = forward._triton_log_probs_forward_kernel
    cfg = forward.tile_config(torch.bfloat16)
    const = dict(SOFTCAP=False, COMPUTE_ENTROPY=True, EVEN_H=True, DOT_PRECISION="tf32", USE_TMA=True,
                 TILE_STATS=tile_stats, CANDIDATES=False, GROUP_R=cfg.group_r, BLOCK_N=cfg.block_n,
                 BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h)
    tiles = {"hidden": f"tensordesc<bf16[{cfg.block_n},{cfg.block_h}]>",
             "weight": f"tensordesc<bf16[{cfg.block_v},{cfg.block_h}]>"}
    sig = {n: "constexpr" if n in const else tiles.get(n) or ("i32" if n in FIRST_INTS else "fp32" if n == "softcap"
           else "*i64" if n in I64 else "*i32" if n in I32 else "*fp32") for n in fn.arg_names}
    said, instructions = _build(fn, sig, const, cfg.num_warps, cfg.num_stages)
    kind = "top-k statistics" if tile_stats else "plain"
    return f"first pass, {kind}: {instructions} instructions; " + "; ".join(said)


def combine(k: int) -> str:
    fn = forward._triton_combine_splits_kernel
    width = forward.top_width(k)
    block = forward.combine_rows(width)
    const = dict(COMPUTE_ENTROPY=True, TOP_K=width, CANDIDATES=False, TILES=16,
                 BLOCK_V=forward.tile_config(torch.bfloat16).block_v, BLOCK=block)
    sig = {n: "constexpr" if n in const else "i32" if n in INTS else "*i64" if n in I64 else "*i32" if n in I32
           else "*fp32"
           for n in fn.arg_names}
    said, _ = _build(fn, sig, const, num_warps=4)
    return f"k = {k:3d} (TOP_K {width}, {block} rows a program): " + "; ".join(said)


def attention(tiles: attn.Tiles) -> str:
    """The causal attention kernel at head size 128, bf16, with this tiling; its loads are pipelined (cp.async) or
    read by the copy engine (TMA) only where Triton can prove the pointers' alignment, given here as launches do."""
    fn = attn._attention_kernel
    const = dict(D=128, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=128, WINDOW=False,
                 DOT_PRECISION="tf32", FUSED=tiles.fused, TMA=tiles.tma)
    given = {"k_ptr", "v_ptr"} if tiles.tma else set()
    sig = {n: "constexpr" if n in const else f"tensordesc<bf16[{tiles.block_n},128]>" if n in given
           else "fp32" if n == "scale" else "*i32" if n.startswith("cu_") else "*fp32" if n == "lse_ptr"
           else "*bf16" if n.endswith("_ptr") else "i32" for n in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
               if n not in given and (n.endswith("_ptr") or n.startswith(("cu_", "stride_")) or n == "total_q")}
    said, instructions = _build(fn, sig, const, tiles.num_warps, tiles.num_stages, aligned, fusion=tiles.fused)
    return f"attention {tuple(tiles)}: {instructions} instructions; " + "; ".join(said)


def hopper(form: str, window: bool) -> str:
    """hopper_attention.py's kernel of this form (heads of 128, bf16), with a window or without."""
    said, instructions = _report(ha.compile_sm90(form, window))
    return f"Hopper attention, {form}{', window' if window else ''}: {instructions} instructions; " + "; ".join(said)


if __name__ == "__main__":
    for tile_stats in (False, True):
        print(first_pass(tile_stats), flush=True)
    for k in (20, 64, 128, 256):
        print(combine(k), flush=True)
    default = attn._tiles(128, torch.bfloat16)._replace(gluon="")  # (the Triton kernel at the default tiling)
    for tiles in (default, attn.Tiles(128, 64, 8, 3), attn.Tiles(128, 128, 8, 3, True, True)):
        print(attention(tiles), flush=True)
    for form in ha.FORMS:
        for window in (False, True):
            print(hopper(form, window), flush=True)
    for mode, normed, what in ((hopper_gated.GATED, False, "the MLP's gate and up"),
                               (hopper_gated.PLUS, False, "a projection plus the residual"),
                               (hopper_gated.QKV, False, "q, k, v with biases and rotary"),
                               (hopper_gated.QKV, True, "q, k, v with q/k norms and rotary")):
        said, instructions = _report(hopper_gated.compile_sm90(mode, normed))
        print(f"hopper_gated ({what}): {instructions} instructions; " + "; ".join(said), flush=True)
    for gated, gather, what in ((True, True, "a mixture's gate/up, rows read in place"),
                                (True, False, "gate/up of rows in expert order"), (False, False, "down")):
        said, instructions = _report(hopper_grouped.compile_sm90(gated, gather))
        print(f"hopper_grouped ({what}): {instructions} instructions; " + "; ".join(said), flush=True)

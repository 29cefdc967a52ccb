"""A kernel whose sizes change from call to call builds alike whatever those sizes are. Triton builds a kernel again
for an integer argument divisible by 16 and for one equal to 1 (a constant then), and a build that lays a sum out
otherwise across threads, or fuses another multiply into an add, gives a row other bits in a batch of another size: the
top-k combine did (one ulp of a tail in a call cut into chunks of 128 rows, BENCHMARKS.md, 2026-12-06). Each kernel
below, built for sm_90a here (Triton's own ptxas, no GPU), either opts out of that for its batch-dependent arguments
(`do_not_specialize`) or has the same float instructions and the same layouts with them divisible by 16, equal to 1,
and neither."""

import json
import os
import subprocess
import sys

import pytest
import triton

from ppo_logprobs.workers.models.causal_attention import hopper_kernels

# (module, kernel, the arguments that change with the batch, pointer and float types (int32 otherwise), constexprs,
# warps, fp fusion as launched)
KERNELS = [
    ("head.triton_log_probs_forward", "_triton_combine_splits_kernel", ["N"], {"*": "*fp32", "labels_ptr": "*i64",
     "pair_keys_ptr": "*i64", "tile_key_ptr": "*i64", "top_tiles_ptr": "*i64", "top_ids_ptr": "*i64",
     "candidates_ptr": "*i64", "pair_count_ptr": "*i32"},
     dict(COMPUTE_ENTROPY=True, TOP_K=32, CANDIDATES=True, TILES=16, BLOCK_V=256, BLOCK=16), 4, True),
    ("head.triton_log_probs_forward", "_triton_top_tiles_kernel", ["programs"], {"*": "*fp32", "hidden": "*bf16",
     "weight": "*bf16", "pair_ptr": "*i64", "tile_ptr": "*i64", "start_ptr": "*i64", "end_ptr": "*i64",
     "top_tiles_ptr": "*i64", "pair_keys_ptr": "*i64", "pair_count_ptr": "*i32", "softcap": "fp32"},
     dict(SOFTCAP=False, EVEN_H=True, DOT_PRECISION="tf32", TOP_K=64, EVERY=False, BLOCK_N=128, BLOCK_V=256,
          BLOCK_H=64), 8, True),
    ("models.rms_norm", "_rms_norm_kernel", ["n_rows"], {"*": "*bf16", "eps": "fp32"},
     dict(GEMMA=False, BLOCK_H=2048, ROWS=2), 4, True),
    ("models.rotary", "_rotary_kernel", ["n_rows"], {"*": "*bf16", "eps": "fp32"},
     dict(BLOCK_D=64, ROWS=16, BF16=True, NORM=True, GEMMA=False), 4, False),
    ("models.router", "_route_kernel", ["T"], {"*": "*bf16", "logits_ptr": "*fp32", "index_ptr": "*i64"},
     dict(K=8, RENORM=True, BLOCK_T=64, BLOCK_E=128, BLOCK_K=8), 4, True),
    ("models.grouped_gemm", "_combine_kernel", ["T"], {"*": "*bf16", "position_ptr": "*i64"},
     dict(K=8, RESIDUAL=True, BLOCK_T=32, BLOCK_H=128), 4, True),
    ("models.silu_mul", "_silu_mul_kernel", ["n"], {"*": "*bf16"}, dict(BLOCK=1024), 4, True),
    ("models.causal_attention", "_attention_kernel", ["q_blocks", "total_q"], {"*": "*bf16", "cu_q": "*i32",
     "cu_k": "*i32", "lse_ptr": "*fp32", "scale": "fp32"},
     dict(D=128, BLOCK_M=128, BLOCK_N=128, BLOCK_D=128, WINDOW=False, DOT_PRECISION="tf32", FUSED=True, TMA=False),
     8, True),
]

READ = r"""
import importlib, json, re, sys
from collections import Counter

def read(k):
    '''A build's float arithmetic (PTX: fp32, bf16 or fp16 where a sum rounded to them runs so, a pair counted as two;
    wgmma's products) and its layouts (TTGIR; Gluon's are #ttg. too).'''
    arithmetic = Counter()
    for op in re.findall(r"^\s*((?:fma|add|sub|mul|ex2|lg2|max|min|rsqrt|sqrt|div|rcp)\.[a-z0-9.]*(?:f32|f16x2|f16)"
                         r"|wgmma\.mma_async\.[a-z0-9.]*)", k.asm["ptx"], re.M):
        arithmetic[op.removesuffix("x2")] += 2 if op.endswith("x2") else 1
    names = dict(re.findall(r"^(#\w+) = (#ttg\..*)$", k.asm["ttgir"], re.M))  # (a build numbers them its own way)
    layouts = {re.sub(r"#\w+", lambda m: names.get(m[0], m[0]), x)
               for x in re.findall(r"#ttg\.\w+<[^>]*>", k.asm["ttgir"])}
    return dict(arithmetic), sorted(layouts)
"""

SCRIPT = READ + r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def build(fn, sig, const, attrs, warps, fusion):
    return read(triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=warps, num_stages=3, enable_fp_fusion=fusion)))

for module, name, varying, types, const, warps, fusion in json.loads(sys.argv[1]):
    fn = getattr(importlib.import_module("ppo_logprobs.workers." + module), name)
    opted_out = sorted(p.name for p in fn.params if p.do_not_specialize)
    sig = {n: "constexpr" if n in const else types.get(n) or (types["*"] if n.endswith("_ptr") else "i32")
           for n in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
    loose = [n for n in varying if n not in opted_out]
    builds = [build(fn, sig, const, aligned, warps, fusion)]
    if loose:
        sixteen = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in loose}
        builds.append(build(fn, sig, const, {**aligned, **sixteen}, warps, fusion))
        builds.append(build(fn, {**sig, **dict.fromkeys(loose, "constexpr")}, {**const, **dict.fromkeys(loose, 1)},
                            aligned, warps, fusion))
    print(json.dumps(dict(kernel=name, varying=loose, builds=builds)), flush=True)
"""


# (module, kernel, the arguments that change with the batch, compile_sm90's arguments for each build workers launch)
GLUON = [
    ("hopper_gated", "_body_gemm_kernel", ["n_rows", "m_tiles"],  # (GATED, PLUS, QKV, QKV with q/k norms)
     [dict(mode=0), dict(mode=1), dict(mode=2), dict(mode=2, normed=True)]),
    ("hopper_grouped", "_grouped_kernel", ["n_source", "m_tiles"],  # (experts.py: gate/up, rows read in place; down)
     [dict(gated=True, gather=True), dict(gated=False, gather=False)]),
    ("hopper_attention", "_persistent_kernel", ["q_blocks", "per_head", "n_tiles", "total_q"],
     [dict(form="persistent", window=False), dict(form="persistent", window=True)]),
]

GLUON_SCRIPT = READ + r"""
sys.path.insert(0, sys.argv[2])
from compile_sm90 import _report  # (benchmarks/: Triton's own ptxas on a build; its report keeps an injected wait)

for module, name, varying, args in json.loads(sys.argv[1]):
    m = importlib.import_module("ppo_logprobs.workers.models." + module)
    assert set(varying) <= set(getattr(m, name).arg_names), (name, varying)
    plain = m.compile_sm90(**args, divisible=(), ones=())
    builds = [read(plain)] + [read(m.compile_sm90(**args, divisible=sixteen, ones=ones))
                              for sixteen, ones in ((tuple(varying), ()), ((), tuple(varying)))]
    print(json.dumps(dict(kernel=name, args=args, varying=varying, builds=builds, ptxas=_report(plain)[0])),
          flush=True)
"""


def built(script: str, kernels: list) -> list[dict]:
    """What `script` prints of each of `kernels`, run in a process without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    benchmarks = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    done = subprocess.run([sys.executable, "-c", script, json.dumps(kernels), benchmarks], env=env,
                          capture_output=True, text=True, timeout=300)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["kernel"] for r in results] == [k[1] for k in kernels], done.stderr[-3000:]
    return results


def assert_alike(r: dict) -> None:
    """The builds with the batch's sizes divisible by 16 and equal to 1 are the plain one's."""
    plain, *others = r["builds"]
    assert plain[0], r  # (the reader found the kernel's arithmetic)
    name = f"{r['kernel']} {r['args']}" if "args" in r else r["kernel"]
    for how, other in zip(("divisible by 16", "equal to 1"), others, strict=False):  # (none where it opts out)
        assert other == plain, (f"{name}, {r['varying']} {how}: {other[0]} against {plain[0]}; layouts of one build "
                                f"only: {sorted(set(plain[1]) ^ set(other[1]))}")


@pytest.mark.skipif("nvidia" not in triton.backends.backends, reason="Triton without its NVIDIA backend")
def test_batch_dependent_sizes_do_not_change_a_kernels_build():
    results = built(SCRIPT, KERNELS)
    for r in results:
        assert_alike(r)
    assert results[0]["varying"] == []  # (the top-k combine, whose build did differ, opts out of it)


@pytest.fixture(scope="module")
def gluon_builds() -> list[dict]:
    if "nvidia" not in triton.backends.backends:
        pytest.skip("Triton without its NVIDIA backend")
    if hopper_kernels() is None:
        pytest.skip("Triton before 3.6")
    return built(GLUON_SCRIPT, [(m, k, varying, args) for m, k, varying, modes in GLUON for args in modes])


def test_batch_dependent_sizes_do_not_change_a_gluon_kernels_build(gluon_builds):
    """The Gluon kernels (Hopper) in each mode workers launch, built by their module's compile_sm90: alike with the
    batch's sizes divisible by 16, equal to 1 and neither (attention's total_q too, which compile_sm90 otherwise
    takes as divisible)."""
    for r in gluon_builds:
        assert_alike(r)


def test_ptxas_adds_no_wgmma_wait_to_a_gluon_kernel(gluon_builds):
    """ptxas waits for every wgmma in flight before an instruction that reads registers it cannot prove a finished
    wgmma wrote ("wgmma.wait_group is injected", C7517), and so runs in turn what the kernel was written to overlap:
    a tried attention form stored its last tile's output under the next tile's first scores, and ptxas made it wait
    for those scores first (BENCHMARKS.md, 2026-12-07). Each Gluon kernel, in each mode workers launch, builds
    without one."""
    for r in gluon_builds:
        assert not [line for line in r["ptxas"] if "injected" in line], (r["kernel"], r["args"], r["ptxas"])

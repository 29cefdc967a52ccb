"""`python -m ppo_logprobs.workers`: a small demo of the fused head.

Scores random tokens with both backends available here and checks them against the full-logits computation.
"""

import logging
import time

import torch

from . import fused_log_probs

log = logging.getLogger("ppo_logprobs.demo")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    n, h, v = 2048, 512, 32000
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(device, dtype)
    weight = (torch.randn(v, h, generator=g) * 2 / h**0.5).to(device, dtype)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    log.info("scoring %d tokens, hidden %d, vocabulary %d, %s on %s", n, h, v, dtype, device)

    logits = hidden.double() @ weight.double().T
    log_p = logits.log_softmax(-1)
    ref_lp = log_p.gather(-1, labels[:, None])[:, 0]
    ref_ent = -(log_p.exp() * log_p).sum(-1)
    backends = ["torch", "triton"] if device == "cuda" else ["torch"]
    for backend in backends:
        start = time.perf_counter()
        lp, ent = fused_log_probs(hidden, weight, labels, backend=backend)
        if device == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3
        log.info(
            "%-6s first call %.1f ms  mean log-prob %.4f  mean entropy %.4f  max error vs float64: %.1e / %.1e",
            backend, ms, lp.mean(), ent.mean(),
            (lp.double() - ref_lp).abs().max(), (ent.double() - ref_ent).abs().max(),
        )


if __name__ == "__main__":
    main()

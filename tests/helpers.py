"""Shared test helpers: random token sequences, the in-process model's own answer, a free loopback port."""

import socket

import numpy as np
import torch

TINY_VOCAB = 503  # the built-in "tiny" model


def random_sequences(n, seed, lo=2, hi=60):
    g = np.random.default_rng(seed)
    return [g.integers(0, TINY_VOCAB, g.integers(lo, hi)).tolist() for _ in range(n)]


def alone(model, seq, score_from=1, temperature=1.0):
    """The patched model on one unpadded sequence, cut to the entries a worker returns for it."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([seq]), temperature=temperature)
    span = slice(score_from - 1, len(seq) - 1)
    return out.log_probs[0, span].numpy(), out.entropy[0, span].numpy()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

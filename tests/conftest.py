"""Test set-up: without CUDA, Triton kernels run in the interpreter (must be set before they are imported)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

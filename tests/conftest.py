"""Test set-up: without CUDA, Triton kernels run in the interpreter (must be set before they are imported);
Ray stays on loopback (it would otherwise advertise the machine's own address), and a test's `ray.init()` starts
a Ray of its own (it would otherwise join any Ray already running on the machine, or fail on one that died
there without cleaning up)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_ADDRESS", "local")

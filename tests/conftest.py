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

# Files that start Ray clusters run first: with `make test`'s two processes (pytest-xdist, a file at a time), the
# short CPU-only files then fill the gaps at the end instead of one long Ray file running alone.
_RAY_FIRST = ("tests/service/", "tests/workers/pool/", "tests/client/", "tests/deploy/", "tests/examples/")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not item.nodeid.startswith(_RAY_FIRST))  # (stable: each file's order kept)

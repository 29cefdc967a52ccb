"""Test set-up: without CUDA, Triton kernels run in the interpreter (must be set before they are imported) and
torch.compile is off; Ray stays on loopback (it would otherwise advertise the machine's own address), and a test's
`ray.init()` starts a Ray of its own (it would otherwise join any Ray already running on the machine, or fail on one
that died there without cleaning up)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # HF's flex attention as torch's eager reference, not compiled (the compile took a minute of the suite's CPU;
    # the masks are the same)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_ADDRESS", "local")

KEPT = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "torch/_inductor/compile_worker")


def _descendants() -> set[int]:
    """This pytest process's live descendants (a Ray it started, with its workers; a service it ran), less the
    helpers that multiprocessing starts on first use and keeps for the life of this process (its resource tracker,
    and the server that helpers.ranks forks from) and the compile workers torch.compile keeps on a GPU: a file that
    started them would otherwise wait the whole deadline for them."""
    import psutil

    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and not any(
                    helper in " ".join(child.cmdline()) for helper in KEPT):
                found.add(child.pid)
        except psutil.Error:  # (gone meanwhile)
            pass
    return found


@pytest.fixture(autouse=True, scope="module")
def _processes_gone_after_the_file():
    """After a file, wait until the processes it started have exited: ray.shutdown() does not wait for them, and
    the next file's Ray would otherwise meet them (a second replica of a deployment's name, a GCS for
    connect_pool() to choose from). Only this process's own: `make test` runs Ray files in three processes side by
    side, each file with a Ray of its own."""
    import time

    before = _descendants()
    yield
    deadline = time.monotonic() + 60
    while _descendants() - before and time.monotonic() < deadline:
        time.sleep(0.2)

"""Test set-up: without CUDA, Triton kernels run in the interpreter (must be set before they are imported);
Ray stays on loopback (it would otherwise advertise the machine's own address), and a test's `ray.init()` starts
a Ray of its own (it would otherwise join any Ray already running on the machine, or fail on one that died
there without cleaning up)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_ADDRESS", "local")

# The files that start Ray clusters (`make test` runs them in one pytest process, the rest in another beside it)
_RAY = ("tests/service/", "tests/workers/pool/", "tests/client/", "tests/deploy/", "tests/examples/",
        "tests/integrations/")


def _ray_processes() -> set[int]:
    import psutil

    found = set()
    for proc in psutil.process_iter(["name", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or ())
        if proc.info["name"] in ("gcs_server", "raylet") or "ray::" in cmdline or "ServeReplica:" in cmdline \
                or "haproxy" in (proc.info["name"] or ""):
            found.add(proc.pid)
    return found


@pytest.fixture(autouse=True, scope="module")
def _ray_gone_after_the_file(request):
    """After a file that started a Ray cluster, wait until that cluster's processes have exited: ray.shutdown() does
    not wait for them, and the next file's Ray would otherwise meet them (a second GCS on the machine, for
    connect_pool() to choose from; a second replica of a deployment's name)."""
    if not request.node.nodeid.startswith(_RAY):
        yield
        return
    import time

    before = _ray_processes()
    yield
    deadline = time.monotonic() + 60
    while _ray_processes() - before and time.monotonic() < deadline:
        time.sleep(0.5)

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

# `make test` runs two pytest processes (pytest-xdist, --dist loadgroup). The files that start Ray clusters are one
# group, run one after the other by one process: a machine then runs one Ray at a time, as the service and
# `connect_pool()` (which joins "the Ray on this machine") expect. Every other file is a group of its own, spread
# over both processes. The Ray files are collected first, so the short files fill the end of the run.
_RAY = ("tests/service/", "tests/workers/pool/", "tests/client/", "tests/deploy/", "tests/examples/")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not item.nodeid.startswith(_RAY))  # (stable: each file's order kept)
    for item in items:
        path = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group("ray" if path.startswith(_RAY) else path))


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

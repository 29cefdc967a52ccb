"""Shared test helpers: random token sequences, the in-process model's own answer, other weights for the tiny
model and their checkpoint, a small patched model on CUDA, a free loopback port, a local Ray with the gateway
served, a `ppo-logprobs serve` process waited for and stopped."""

import contextlib
import os
import random
import signal
import socket
import subprocess
import time

import numpy as np
import ray
import torch
from ray import serve

from ppo_logprobs.service import build_app
from ppo_logprobs.service.app import shut_down_serve
from ppo_logprobs.workers import load_model, patch_model
from ppo_logprobs.workers.models.load_model import TINY_CONFIG

TINY_VOCAB = 503  # the built-in "tiny" model


def ranks(fn, args, nprocs):
    """fn(rank, *args) in `nprocs` processes, as torch.multiprocessing.spawn runs it, but forked from one server
    process that has imported this module (torch, Ray, this package) and transformers' models once for this pytest
    process (a spawned process imports them again: about 4 s of CPU each). Nothing the server imports touches CUDA,
    so a rank may use it. Raises if a rank fails."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(
        [__name__, "torch.distributed", "transformers.modeling_utils"])
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def random_sequences(n, seed, lo=2, hi=60):
    g = np.random.default_rng(seed)
    return [g.integers(0, TINY_VOCAB, g.integers(lo, hi)).tolist() for _ in range(n)]


def alone(model, seq, score_from=1, temperature=1.0):
    """The patched model on one unpadded sequence, cut to the entries a worker returns for it."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([seq]), temperature=temperature)
    span = slice(score_from - 1, len(seq) - 1)
    return out.log_probs[0, span].numpy(), out.entropy[0, span].numpy()


def perturbed(seed, device="cpu", **config):
    """The tiny model (or, with `config`, the tiny config changed by it), its weights moved by seeded noise of
    0.05; patched (torch backend on the CPU)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if config:
        model = patch_model(Qwen2ForCausalLM(Qwen2Config(**{**TINY_CONFIG, **config})).to(device), backend="torch")
    else:
        model = load_model("tiny", device=device, backend="torch" if device == "cpu" else "auto")
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, device=device) * 0.05)
    return model


def small_cuda_model():
    """A patched bf16 Qwen2 of 3 layers (heads of 64, grouped 4 to 1, vocabulary 4,099) on CUDA, seeded: where the
    GPU tests look at bits through the body's kernels. Its invariant mode sets a process-wide cuBLAS setting, which
    the caller turns back (allow_split_k(True))."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=4099, hidden_size=512, intermediate_size=1408, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    return patch_model(model)


def save(model, path, **kw) -> str:
    """save_pretrained of a patched instance (as its plain class), which keeps its patch; returns the path."""
    patched = model.__dict__.pop("forward", None)
    try:
        model.save_pretrained(path, **kw)
    finally:
        if patched is not None:
            model.forward = patched
    return str(path)


def with_tensors(path: str, **extra: torch.Tensor) -> str:
    """The checkpoint at `path` (one shard, as `save` writes a tiny model) with `extra` tensors added to it."""
    from safetensors.torch import load_file, save_file

    shard = os.path.join(path, "model.safetensors")
    save_file(load_file(shard) | extra, shard, metadata={"format": "pt"})
    return path


def example(name: str):
    """examples/<name>.py imported as a module, as a user runs the file (its main() takes the argv)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now, below the kernel's range of ports for outgoing connections and above Ray's worker
    ports (10002-19999): a port the kernel handed out could be given to another process's outgoing connection before
    the server meant to bind it does (HAProxy once failed to start so, its port taken by one of Ray's connections).
    Never one it gave before in this process: a test that asks for several (HAProxy's listener, metrics and stats)
    binds them only later, and two equal ones would fail the second bind."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except OSError:
        low = 32768
    ports = range(20000, max(low, 20001))
    for port in random.sample(ports, min(200, len(ports))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError(f"no free loopback port in 20000-{low - 1}")


@contextlib.contextmanager
def serving(num_cpus, apps):
    """A local Ray of num_cpus CPUs and no GPUs (workers placed by CPU on any host) with Serve on a free loopback
    port, running each app {name: Settings}, the first at "/" and the others at "/<name>"; yields the base URL.
    The apps start side by side, but one that shares another's pools (its pool_name) once that one's are made."""
    ray.init(num_cpus=num_cpus, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        makers, attachers, named = [], [], set()
        for i, (name, settings) in enumerate(apps.items()):
            target = serve.RunTarget(build_app(settings), name=name, route_prefix="/" if i == 0 else f"/{name}")
            (attachers if settings.pool_name in named else makers).append(target)
            named.add(settings.pool_name)
        for targets in (makers, attachers):
            if targets:
                serve.run_many(targets)
        yield f"http://127.0.0.1:{port}"
    finally:
        shut_down_serve()
        ray.shutdown()


def wait_ready(url: str, proc: subprocess.Popen, log, timeout_s: float = 240) -> None:
    """Returns once the service at `url` answers /readyz 200; fails with the end of its `log` (a Path) if its
    process ends first or `timeout_s` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        try:
            if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)


def wait_logged(text: str, log, proc: subprocess.Popen, timeout_s: float = 120, every_s: float = 0.1) -> None:
    """Returns once `text` is in `log` (a Path); fails with the log's end if `proc` ends first or `timeout_s`
    passes."""
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(every_s)


def stop_service(proc: subprocess.Popen) -> None:
    """SIGTERM, as an operator stops it; its process group killed if it has not exited within 120 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def scoring_now(worker, timeout_s: float = 120.0) -> None:
    """Returns once `worker` (a pool's actor) is inside a scoring call, asked in its staging thread, which answers
    beside the call: a kill made next lands mid-call."""
    import time

    deadline = time.monotonic() + timeout_s
    while not ray.get(worker.__ray_call__.options(concurrency_group="staging").remote(lambda w: w.worker.scoring)):
        assert time.monotonic() < deadline, "the worker did not start scoring"
        time.sleep(0.005)

def kept_calls():
    """(calls, done, on_kept): an on_kept callback for a local copy that records (version, path) and sets done."""
    import threading

    calls, done = [], threading.Event()

    def on_kept(version, path):
        calls.append((version, path))
        done.set()

    return calls, done, on_kept

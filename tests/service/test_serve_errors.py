"""Start-up mistakes of `ppo-logprobs serve`, each ended before Ray starts in one line that names the setting and
its value, with exit code 2 (they were tracebacks of 19-349 lines, or a service that started and then failed every
request); a model that cannot load, found only once Ray has started, ends the command the same way; a SIGTERM while
it starts stops it in order."""

import os
import signal
import socket
import subprocess
import sys

import pytest

from ..helpers import free_port, wait_logged

SERVE = [sys.executable, "-m", "ppo_logprobs.client.cli", "serve"]


def serve(*args, **env):
    environment = {k: v for k, v in os.environ.items() if k != "PPO_LOGPROBS_API_KEY"} | env
    return subprocess.run([*SERVE, *args], capture_output=True, text=True, timeout=120, env=environment)


@pytest.mark.parametrize("args, env, line", [
    (["--host", "0.0.0.0"], {}, "an API key is required to listen on '0.0.0.0' (anything but loopback): set "
     "PPO_LOGPROBS_API_KEY or --api-key-file"),
    (["--host", "0.0.0.0"], {"PPO_LOGPROBS_API_KEY": "CHANGE-ME"}, "the API key is deploy/serve.yaml's placeholder "
     "'CHANGE-ME'"),
    (["--models", "/ckpt/a"], {}, "--models /ckpt/a: give NAME=PATH, the name clients ask for and the checkpoint "
     "directory (e.g. --models policy=/ckpt/a)"),
    (["--models", "policy=/nonexistent"], {}, "--models policy=/nonexistent: no directory '/nonexistent'"),
    (["--models", "policy=/"], {}, "--models policy=/: '/' has no config.json: not a HuggingFace checkpoint"),
    (["--tokenizer", "/no/such/dir"], {}, "--tokenizer /no/such/dir: no directory '/no/such/dir'"),
    (["--tokenizer", "/"], {}, "--tokenizer /: cannot load a tokenizer from it"),
    (["--max-queue", "x"], {}, "--max-queue: Input should be a valid integer"),
    (["--dtype", "bf16"], {}, "--dtype: Input should be 'bfloat16', 'float16', 'float32', 'float64', 'half', 'float' "
     "or 'double' (got 'bf16')"),
    (["--backend", "foo"], {}, "--backend: Input should be 'auto', 'triton' or 'torch' (got 'foo')"),
    (["--api-key", "k"], {}, "the API key is read from PPO_LOGPROBS_API_KEY or --api-key-file, never from a flag"),
])
def test_a_mistake_is_one_line_and_exit_code_2(args, env, line):
    out = serve(*args, **env)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"ppo-logprobs serve: {line}"), out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_a_port_in_use_is_named():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = serve("--port", str(port))
    assert out.returncode == 2 and out.stderr == (
        f"ppo-logprobs serve: --port {port}: cannot listen on 127.0.0.1:{port} (Address already in use): another "
        "service holds it? choose one with --port\n")


@pytest.mark.parametrize("files, line", [
    ({"config.json": '{"model_type": "qwen2"}'}, "has no weights (*.safetensors or pytorch_model*.bin)"),
    ({"config.json": '{"model_type": "no-such-model"}', "model.safetensors": ""}, "cannot read "),
    ({"config.json": "{not json", "model.safetensors": ""}, "cannot read "),
    ({"config.json": '{"model_type": "qwen2"}', "model.safetensors": "not a safetensors file"},
     "model.safetensors is not a safetensors file or is truncated (header of "),
])
def test_a_checkpoint_that_cannot_load_is_named_before_ray_starts(tmp_path, files, line):
    """A directory with a config.json but no weights, a config transformers cannot read, or a shard that is not
    whole, ends in one line (it used to reach the workers, and Serve retried the pool's replica three times before
    giving up)."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    out = serve("--models", f"policy={tmp_path}")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"ppo-logprobs serve: --models policy={tmp_path}: "), out.stderr
    assert line in out.stderr and "Traceback" not in out.stderr


def test_a_model_that_cannot_load_stops_the_service_in_one_line(tmp_path):
    """A checkpoint that passes the checks above but whose weights do not fit its config: Ray starts, the keeper's
    workers refuse it, and the service stops with the reason as its last line (Serve retried the keeper three
    times, each loading the model again, and the command ended in a traceback of its own that did not say why)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ppo_logprobs.workers.models.load_model import TINY_CONFIG

    Qwen2ForCausalLM(Qwen2Config(**{**TINY_CONFIG, "intermediate_size": 96})).save_pretrained(tmp_path)
    Qwen2Config(**TINY_CONFIG).save_pretrained(tmp_path)
    out = serve("--models", f"policy={tmp_path}", "--ingress", "python", "--port", str(free_port()),
                "--backend", "torch", "--pool-name", "cannot-load")
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.splitlines()[-1] == (
        f"ppo-logprobs serve: --models policy={tmp_path}: the workers did not start: IncompatibleWeights: "
        f"'model.layers.0.mlp.down_proj.weight' has shape [64, 96] in '{tmp_path}' and [64, 128] in the model its "
        "config.json describes"), out.stderr[-3000:]
    # the keeper's replica was started once, and Serve's controller logged its failure in one line ending in the
    # refusal, not with the 44 lines of its traceback; the worker's refusal was not logged by Ray as a creation
    # task's error, nor once for each retry "left"
    failed = [line for line in out.stderr.splitlines() if "Exception in Replica(" in line]
    assert len(failed) == 1 and failed[0].endswith("the replica will be stopped: ppo_logprobs.workers.errors."
                                                   "IncompatibleWeights: 'model.layers.0.mlp.down_proj.weight' has "
                                                   f"shape [64, 96] in '{tmp_path}' and [64, 128] in the model its "
                                                   "config.json describes"), out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "LOAD REPORT" not in out.stderr, out.stderr[-3000:]  # (HF's table)
    assert "creation task" not in out.stderr and "Task PoolWorker.info failed" not in out.stderr, out.stderr[-3000:]
    # nor Serve's shutdown as a failure of its controller's task to be retried (printed on every stop before)
    assert "retries remaining" not in out.stdout + out.stderr, out.stdout[-3000:]


def test_a_sigterm_while_it_deploys_stops_it_in_order(tmp_path):
    """SIGTERM while the application deploys (/readyz can answer 200 before that ends): Serve is shut down, every
    process the command started exits and so does the command, with 0, as after it is ready (Ray's own handler
    ended it with a stack dump and no shutdown)."""
    import psutil

    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([*SERVE, "--ingress", "python", "--port", str(free_port()), "--backend", "torch",
                                 "--pool-name", "stopped-early"], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_logged("ppo_logprobs.service starting ", log, proc)  # (Serve started; serve.run's deployment next)
        started = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log.read_text()[-3000:]
    finally:
        proc.kill()
    _, alive = psutil.wait_procs(started, timeout=60)
    assert not alive, [p.cmdline()[:3] for p in alive]
    text = log.read_text()
    assert "shutting down: finishing requests in flight" in text and "SIGTERM received" not in text, text[-3000:]
    # Serve's shutdown is not reported as its controller's task failing (Ray printed "(raylet) Task
    # ServeController.graceful_shutdown failed. There are infinite retries remaining" on every stop)
    assert "retries remaining" not in text and "graceful_shutdown failed" not in text, text[-3000:]

"""Weight updates into CUDA workers: checkpoints through pinned buffers, NCCL streams from a trainer's GPU (two GPUs:
the trainer is this process on the last GPU, the worker gets the first), and CUDA IPC from a trainer on the worker's
own GPU. Skipped without CUDA."""

import pytest
import ray
import torch

from ppo_logprobs.workers import WorkerPool
from ppo_logprobs.workers.errors import NonFiniteWeights

from ...helpers import perturbed, save

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)  # the worker takes GPU 0
    yield
    ray.shutdown()


def weights_of(worker) -> dict:
    return ray.get(worker.__ray_call__.remote(lambda w: {n: p.cpu() for n, p in w.worker.model.named_parameters()}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_checkpoint_lands_bitwise_on_the_gpu(cluster, tmp_path, dtype):
    source = perturbed(1)
    save(source, tmp_path)
    pool = WorkerPool.create("tiny", 1, dtype=dtype, local_copy=False)
    try:
        assert pool.update_weights(str(tmp_path)) == 1
        got = weights_of(pool.workers[0])
        for name, p in source.named_parameters():
            assert torch.equal(got[name], p.to(dtype)), name
    finally:
        pool.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs the trainer and the worker on two GPUs")
def test_a_trainer_streams_over_nccl(cluster):
    trainer_device = f"cuda:{torch.cuda.device_count() - 1}"
    pool = WorkerPool.create("tiny", 1, dtype=torch.bfloat16, local_copy=False)
    try:
        model = perturbed(2, trainer_device)  # fp32 on the trainer, bf16 in the worker
        with pool.weight_sender(device=trainer_device, bucket_bytes=64 << 10) as sender:
            assert sender.backend == "nccl"
            assert sender.send(model.named_parameters()) == 1
            got = weights_of(pool.workers[0])
            for name, p in model.named_parameters():
                assert torch.equal(got[name], p.detach().to(torch.bfloat16).cpu()), name
            head = torch.randn(503, 64, device=trainer_device)
            assert sender.send({"lm_head.weight": head}) == 2
        got2 = weights_of(pool.workers[0])
        for name in got:
            expected = head.to(torch.bfloat16).cpu() if name == "lm_head.weight" else got[name]
            assert torch.equal(got2[name], expected), name
        assert {r.weights_version for r in pool.compute_log_probs([[1, 2, 3, 4]])} == {2}
    finally:
        pool.shutdown()


def test_a_trainer_on_the_workers_gpu_shares_its_tensors_by_ipc(cluster):
    pool = WorkerPool.create("tiny", 1, dtype=torch.bfloat16, local_copy=False)  # on GPU 0, as Ray numbers it
    try:
        model = perturbed(3, "cuda:0")  # this process on the same GPU: NCCL cannot join the two
        with pool.weight_sender(device="cuda:0", bucket_bytes=64 << 10) as sender:
            assert sender.backend == "ipc"
            assert sender.send(model.named_parameters()) == 1
            sent = {n: p.detach().to(torch.bfloat16).cpu() for n, p in model.named_parameters()}
            with torch.no_grad():  # the worker reads the tensors in place, and copied them at the commit
                dict(model.named_parameters())["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
            with pytest.raises(NonFiniteWeights, match="layers.1.mlp.up_proj"):
                sender.send(model.named_parameters())
        got = weights_of(pool.workers[0])
        for name, p in sent.items():
            assert torch.equal(got[name], p), name
        head = {"lm_head.weight": torch.randn(503, 64, device="cuda:0", dtype=torch.bfloat16)}
        assert pool.update_weights(head) == 2  # a CUDA state dict, partial, the same way
        assert torch.equal(weights_of(pool.workers[0])["lm_head.weight"], head["lm_head.weight"].cpu())
        assert {r.weights_version for r in pool.compute_log_probs([[1, 2, 3, 4]])} == {2}
    finally:
        pool.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_host_state_dict_goes_through_this_processs_gpu(cluster, dtype):
    """Host tensors (a trainer offloading to the CPU) are converted and copied to this process's GPU through pinned
    buffers, the chunks of a bucket's many tensors at once, then sent."""
    pool = WorkerPool.create("tiny", 1, dtype=torch.bfloat16)
    try:
        model = perturbed(4)
        state = {n: p.detach().to(dtype) for n, p in model.named_parameters()}  # in host memory
        assert pool.update_weights(state) == 1
        got = weights_of(pool.workers[0])
        for name, p in state.items():
            assert torch.equal(got[name], p.to(torch.bfloat16)), name
    finally:
        pool.shutdown()


def test_a_bf16_trainers_parameters_are_mapped_once_and_read_again_at_each_update(cluster):
    """Tensors already in the workers' dtype are shared where they lie, once: later sends name them by key and the
    worker reads them again; a worker that lost them (restarted; here it lets them go) gets them shared anew;
    closing lets them go."""
    pool = WorkerPool.create("tiny", 1, dtype=torch.bfloat16, local_copy=False)
    worker = pool.workers[0]
    held = lambda: ray.get(worker.__ray_call__.remote(lambda w: w._weights._shared and w._weights._shared[0]))
    try:
        params = dict(perturbed(5, "cuda:0").to(torch.bfloat16).named_parameters())
        keys = []
        with pool.weight_sender(device="cuda:0") as sender:
            for step in range(1, 5):
                with torch.no_grad():  # what an optimizer step does: the same storages, new values
                    params["model.layers.0.self_attn.q_proj.weight"].add_(0.25)
                    params["lm_head.weight"].mul_(1.5)
                assert sender.send(params) == step
                got = weights_of(worker)
                for name, p in params.items():
                    assert torch.equal(got[name], p.detach().cpu()), (step, name)
                keys.append(held())
                if step == 2:
                    ray.get(worker.release_shared.remote())
            assert keys[0] == keys[1] and keys[2] != keys[1] and keys[3] == keys[2], keys
        assert held() is None
        assert {r.weights_version for r in pool.compute_log_probs([[1, 2, 3, 4]])} == {4}
    finally:
        pool.shutdown()

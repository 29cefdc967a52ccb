"""Host-to-device copies through the ring of pinned buffers: many chunks from many threads through few buffers land
whole (a buffer is filled again only once its last copy out has finished); checkpoint reads and a sender's host
tensors, both through the ring, land bitwise on the GPU. Skipped without CUDA."""

import queue
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ppo_logprobs.workers import load_model
from ppo_logprobs.workers.weights.checkpoint import read_checkpoint
from ppo_logprobs.workers.weights.pinned import copy_through_pinned
from ppo_logprobs.workers.weights.transfer import copy_from_host

from ...helpers import perturbed, save

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def test_many_chunks_through_two_buffers_land_whole():
    chunk, chunks = 1 << 20, 61  # a buffer's bytes; chunks, from 8 threads through 2 buffers
    slots = queue.Queue()
    for _ in range(2):
        slots.put((torch.empty(chunk, dtype=torch.uint8, pin_memory=True), torch.cuda.Stream(), None))
    src = torch.randint(-2**31, 2**31 - 1, (chunks * chunk // 4,), dtype=torch.int32)
    dst = torch.empty_like(src, device="cuda")  # (no kernel that the copies on other streams would race)
    n = chunk // 4

    def run(i: int) -> torch.cuda.Event:
        part = slice(i * n, (i + 1) * n)
        return copy_through_pinned(slots, chunk, lambda buf: buf.view(torch.int32).copy_(src[part]),
                                   lambda buf: dst[part].copy_(buf.view(torch.int32), non_blocking=True))

    with ThreadPoolExecutor(8) as pool:
        events = list(pool.map(run, range(chunks)))
    for event in events:
        torch.cuda.current_stream().wait_event(event)
    assert torch.equal(dst.cpu(), src)
    assert slots.qsize() == 2  # every buffer back in the ring


def test_a_checkpoint_and_host_tensors_land_bitwise_on_the_gpu(tmp_path):
    source = perturbed(1)
    path = save(source, tmp_path / "ckpt")
    model = load_model("tiny", dtype=torch.bfloat16, device="cuda", backend="torch")  # fp32 in the file: converted
    read_checkpoint(model, path).commit(model)
    got = dict(model.named_parameters())
    for name, p in source.named_parameters():
        assert torch.equal(got[name].cpu(), p.to(torch.bfloat16)), name

    host = {name: p.detach() * 3 for name, p in source.named_parameters()}  # fp32 in host memory
    dst = {name: torch.empty_like(p, device="cuda", dtype=torch.bfloat16) for name, p in host.items()}
    copy_from_host([(dst[name], host[name]) for name in host])
    torch.cuda.synchronize()
    for name, t in host.items():
        assert torch.equal(dst[name].cpu(), t.to(torch.bfloat16)), name

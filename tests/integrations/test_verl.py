"""The verl adapter against verl itself (`make test-integrations`: verl pins an older transformers, so it has its
own environment): the reference log-probs and entropies it returns, in both of verl's layouts, equal verl's own
log-prob math on the same model (fp32 on the CPU: <= 1e-5) and the pool's own answer (bitwise), for left- and
right-padded prompts, ragged responses with an EOS inside, temperature != 1 (one, or one per sequence) and GRPO
groups; and verl's worker group builds the worker and dispatches a batch to it."""

import numpy as np
import pytest
import ray
import torch

verl = pytest.importorskip("verl")

from verl import DataProto  # noqa: E402
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.model import compute_position_id_with_mask  # noqa: E402
from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

from ppo_logprobs.integrations.scoring import Service  # noqa: E402
from ppo_logprobs.integrations.verl import reference_worker, score_padded, score_unpadded  # noqa: E402
from ppo_logprobs.workers import WorkerPool  # noqa: E402
from ppo_logprobs.workers.models.load_model import _tiny_model  # noqa: E402
from tests.helpers import TINY_VOCAB  # noqa: E402

PAD, EOS, P, R = 0, 1, 9, 12


@pytest.fixture(scope="module")
def pool():
    ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        yield WorkerPool.create("tiny", 1, backend="torch", name="verl-ref")
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def hf():
    return _tiny_model(None).eval()  # the same weights as the pool's, HF's own forward


def batch(groups: int, size: int, seed: int, prompt_padding: str) -> dict:
    """verl's padded rollout batch: prompts padded to P on the left (or, `right`, on the right: the mask has a hole),
    responses right-padded to R, an EOS inside most of them; each prompt `size` times (a GRPO group)."""
    g = np.random.default_rng(seed)
    prompts, responses, prompt_mask, response_mask = [], [], [], []
    for _ in range(groups):
        n = int(g.integers(1, P + 1))
        prompt = np.full(P, PAD)
        mask = np.zeros(P, int)
        where = slice(P - n, P) if prompt_padding == "left" else slice(0, n)
        prompt[where], mask[where] = g.integers(2, TINY_VOCAB, n), 1
        for _ in range(size):
            k = int(g.integers(1, R + 1))
            response = np.full(R, PAD)
            response[:k] = g.integers(2, TINY_VOCAB, k)
            if k < R:
                response[k - 1] = EOS
            prompts.append(prompt), prompt_mask.append(mask)
            responses.append(response), response_mask.append(np.arange(R) < k)
    prompts, responses = torch.tensor(np.array(prompts)), torch.tensor(np.array(responses))
    attention_mask = torch.cat([torch.tensor(np.array(prompt_mask)), torch.tensor(np.array(response_mask))], 1)
    return dict(prompts=prompts, responses=responses, input_ids=torch.cat([prompts, responses], 1),
                attention_mask=attention_mask, position_ids=compute_position_id_with_mask(attention_mask),
                response_mask=attention_mask[:, P:])


def verls_own(hf, b: dict, temperature) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's math on its padded layout: logits / temperature, the response's positions, logprobs_from_logits
    and entropy_from_logits."""
    with torch.no_grad():
        logits = hf(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                    position_ids=b["position_ids"]).logits
    t = torch.as_tensor(temperature, dtype=torch.float32).reshape(-1, 1, 1)
    logits = (logits / t)[:, -R - 1 : -1]
    return logprobs_from_logits(logits, b["responses"]), entropy_from_logits(logits)


LAYOUTS = [(1, 1, "left"), (3, 4, "left"), (4, 2, "right"), (2, 3, "right")]


@pytest.mark.parametrize("groups,size,padding", LAYOUTS)
@pytest.mark.parametrize("temperature", [1.0, 0.7, "per sequence"])
def test_both_layouts_give_verls_own_numbers_and_the_pools(pool, hf, groups, size, padding, temperature):
    b = batch(groups, size, seed=groups * 10 + size, prompt_padding=padding)
    n = groups * size
    if temperature == "per sequence":
        temperature = torch.linspace(0.6, 1.4, n)
    mask = b["response_mask"].bool()
    # verl's math reads the response's first logit at the last prompt column, which holds a prompt token only when
    # prompts are left-padded (as verl's rollout pads them): right-padded ones are compared with the same batch
    # left-padded (the same tokens)
    want, want_entropy = verls_own(hf, batch(groups, size, groups * 10 + size, "left"), temperature)
    service = Service(pool)
    direct = pool.compute_log_probs(
        [row[m].tolist() for row, m in zip(b["input_ids"], b["attention_mask"].bool(), strict=True)],
        b["attention_mask"][:, :P].sum(1).tolist(),
        temperature=temperature.tolist() if isinstance(temperature, torch.Tensor) else temperature, return_entropy=True)

    padded = score_padded(service, DataProto.from_dict(
        tensors=b, meta_info=dict(temperature=temperature, calculate_entropy=True)))
    ref, entropy = padded.batch["ref_log_prob"], padded.batch["entropys"]
    td = DataProto.from_dict(tensors=b).to_tensordict()
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=temperature, calculate_entropy=True)
    out = score_unpadded(service, td)
    nopad = no_padding_2_padding(tu.get(out, "log_probs"), td)
    nopad_entropy = no_padding_2_padding(tu.get(out, "entropy"), td)

    for got, own in ((ref, want), (nopad, want), (entropy, want_entropy), (nopad_entropy, want_entropy)):
        assert got.shape == (n, R) and got.dtype == torch.float32
        assert not got[~mask].any()  # 0 at the padding
        torch.testing.assert_close(got[mask], own[mask], atol=1e-5, rtol=0)
    for i, r in enumerate(direct):  # the pool's own answer, bit for bit
        k = int(mask[i].sum())
        np.testing.assert_array_equal(ref[i, :k].numpy(), r.log_probs)
        np.testing.assert_array_equal(nopad[i, :k].numpy(), r.log_probs)
        np.testing.assert_array_equal(entropy[i, :k].numpy(), r.entropy)


def test_verls_worker_group_builds_the_worker_and_scores_a_batch_in_one_call(pool):
    """As verl's RayPPOTrainer.init_workers builds the RefPolicy role of its role mapping: the class with its init
    arguments, fused by create_colocated_worker_cls, a RayWorkerGroup over a resource pool (two CPU processes
    here), spawned by role; init_model, then compute_ref_log_prob of the no-padding batch and of a padded DataProto."""
    from verl.single_controller.ray.base import create_colocated_worker_cls
    from verl.trainer.ppo.utils import Role  # (what ray_trainer imports; ray_trainer itself needs vLLM-side packages)

    role_worker_mapping = {Role.RefPolicy: ray.remote(reference_worker("verl-ref"))}
    class_dict = {str(Role.RefPolicy): RayClassWithInitArgs(role_worker_mapping[Role.RefPolicy], config=None,
                                                            role=str(Role.RefPolicy))}
    group = RayWorkerGroup(resource_pool=RayResourcePool([2], use_gpu=False, max_colocate_count=1),
                           ray_cls_with_init=create_colocated_worker_cls(class_dict=class_dict), device_name="cpu")
    ref = group.spawn(prefix_set=class_dict.keys())[str(Role.RefPolicy)]
    ref.init_model()
    b = batch(4, 2, seed=9, prompt_padding="left")
    td = left_right_2_no_padding(DataProto.from_dict(tensors=b).to_tensordict())
    tu.assign_non_tensor(td, temperature=0.9, calculate_entropy=False, compute_loss=False)
    got = no_padding_2_padding(tu.get(ref.compute_ref_log_prob(td), "log_probs"), td)
    want = no_padding_2_padding(tu.get(score_unpadded(Service(pool), td), "log_probs"), td)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert got[b["response_mask"].bool()].ne(0).all()
    padded = DataProto.from_dict(tensors=b, meta_info=dict(temperature=0.9, calculate_entropy=True))
    got, want = ref.compute_ref_log_prob(padded), score_padded(Service(pool), padded)  # verl's padded layout
    assert isinstance(got, DataProto) and set(got.batch.keys()) == {"ref_log_prob", "entropys"}
    for key in ("ref_log_prob", "entropys"):
        torch.testing.assert_close(got.batch[key], want.batch[key], atol=0, rtol=0)


def test_a_worker_without_a_service_says_so():
    from ppo_logprobs.integrations.verl import ServiceRefWorker

    with pytest.raises(ValueError, match="reference_worker"):
        ServiceRefWorker.init_model(ServiceRefWorker.__new__(ServiceRefWorker))

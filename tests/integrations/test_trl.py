"""The TRL adapter against TRL itself (the package `make test` installs): the reference log-probs from the service
equal those of TRL's own reference model of the same weights, and two GRPO steps (and RLOO steps, with old log-probs
from a policy pool) give TRL's own loss and KL, with no reference model on the trainer."""

import math

import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402

from ppo_logprobs.integrations.trl import GRPOTrainer, RemoteModel, RLOOTrainer  # noqa: E402
from ppo_logprobs.service import Settings  # noqa: E402
from ppo_logprobs.workers import WorkerPool, load_model  # noqa: E402
from tests.helpers import TINY_VOCAB, save, serving  # noqa: E402

PAD, EOS = 0, 1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny model and a word-level tokenizer of its ids ("t0" .. "t502"; t0 pads, t1 ends), in one directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-trl")
    model = load_model("tiny", backend="torch")
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD, EOS
    save(model, path)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(TINY_VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t0", eos_token="t1")
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def service(checkpoint):
    """The service (`make serve`'s app) serving the checkpoint as "reference", and a policy pool beside it."""
    settings = Settings(models={"reference": checkpoint}, backend="torch", pool_name="trl")
    with serving(4, {"trl": settings}) as url:
        yield url, WorkerPool.create(checkpoint, 1, backend="torch", name="trl-policy")


def config(tmp_path, trainer="grpo", **options):
    make = trl.GRPOConfig if trainer == "grpo" else trl.RLOOConfig
    options = {"beta": 0.2, "temperature": 0.7, "learning_rate": 0.05, **options}
    return make(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=8, num_generations=4,
                max_completion_length=7, max_steps=2, logging_steps=1, report_to=[], save_strategy="no", seed=0,
                bf16=False, **options)


def dataset():
    return Dataset.from_dict({"prompt": ["t5 t6 t7", "t9 t10", "t11 t12 t13 t14 t15", "t3", "t40 t41"] * 4})


def longer(completions, **_):  # a reward that moves the policy: long completions of even ids
    return [float(sum(int(w[1:]) % 2 == 0 for w in c.split())) for c in completions]


def trainer(cls, checkpoint, args, **kwargs):
    from transformers import PreTrainedTokenizerFast

    # (given: AutoTokenizer would take the config's Qwen2 tokenizer class, which does not read this vocabulary)
    return cls(model=checkpoint, reward_funcs=longer, args=args, train_dataset=dataset(),
               processing_class=PreTrainedTokenizerFast.from_pretrained(checkpoint), **kwargs)


def batch(groups: int, size: int, seed: int):
    """TRL's layout: prompts left-padded, completions right-padded after their EOS (kept in the mask) and then
    filled with more tokens the mask hides; `size` completions of each prompt (a GRPO group)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, TINY_VOCAB, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)
               for _ in range(groups)]
    width = max(map(len, prompts))
    ids, mask = [], []
    for p in prompts:
        for _ in range(size):
            completion = torch.randint(2, TINY_VOCAB, (10,), generator=g)
            length = int(torch.randint(1, 11, (1,), generator=g))  # ragged; 10: ends without an EOS
            if length < 10:
                completion[length - 1] = EOS
            ids.append(torch.cat([torch.full((width - len(p),), PAD), p, completion]))
            mask.append(torch.cat([torch.zeros(width - len(p)), torch.ones(len(p)), torch.arange(10) < length]))
    return torch.stack(ids), torch.stack(mask).long()


def test_the_reference_log_probs_are_trls_own(service, checkpoint, tmp_path):
    url, _ = service
    ours = trainer(GRPOTrainer, checkpoint, config(tmp_path / "a"), reference=url, reference_model="reference")
    theirs = trainer(trl.GRPOTrainer, checkpoint, config(tmp_path / "b"))
    assert isinstance(ours.ref_model, RemoteModel) and isinstance(theirs.ref_model, torch.nn.Module)
    assert ours.beta == theirs.beta == 0.2
    with torch.no_grad():
        for seed, (groups, size) in enumerate([(1, 1), (3, 4), (5, 2)]):
            ids, mask = batch(groups, size, seed)
            got, none, aux = ours._get_per_token_logps_and_entropies(ours.ref_model, ids, mask, 10)
            want, _, _ = theirs._get_per_token_logps_and_entropies(theirs.ref_model, ids, mask, 10)
            assert none is None and aux is None and got.shape == want.shape == (groups * size, 10)
            assert got.dtype == want.dtype == torch.float32
            assert torch.equal(got[mask[:, -10:] == 0], torch.zeros_like(got[mask[:, -10:] == 0]))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            # entropies (asked of the policy's forward, which starts at the same weights)
            _, entropy, _ = ours._get_per_token_logps_and_entropies(ours.ref_model, ids, mask, 10, compute_entropy=True)
            _, own, _ = theirs._get_per_token_logps_and_entropies(theirs.model, ids, mask, 10, compute_entropy=True)
            torch.testing.assert_close(entropy, own, atol=1e-5, rtol=0)


def test_rollout_log_probs_go_with_the_old_policys_call_and_their_kl_is_logged(service, checkpoint, tmp_path):
    """The engine's log-probs of a rollout go with the policy's scoring (not the reference's: there they would
    measure the policy's drift), and the service's k3 KL to them is a trainer metric."""
    url, policy = service
    ours = trainer(GRPOTrainer, checkpoint, config(tmp_path), reference=url, reference_model="reference",
                   old_policy=policy)
    ids, mask = batch(2, 3, seed=7)
    ours.model.train()  # (as in a training step: the metrics go to "train")
    with torch.no_grad():
        exact, _, _ = ours._get_per_token_logps_and_entropies(ours.model, ids, mask, 10)  # (the pool's)
        keep = mask[:, -10:] == 1
        ours.rollout_log_probs = [row[k].tolist() for row, k in zip(exact - 0.1, keep, strict=True)]
        ours._get_per_token_logps_and_entropies(ours.ref_model, ids, mask, 10)
        assert "ppo_logprobs/rollout_kl_k3" not in ours._metrics["train"]
        ours._get_per_token_logps_and_entropies(ours.model, ids, mask, 10)
    (kl,) = ours._metrics["train"]["ppo_logprobs/rollout_kl_k3"]
    assert kl == pytest.approx(math.exp(0.1) - 0.1 - 1, rel=1e-3)  # every token 0.1 off: k3 = e^d - d - 1
    ours.rollout_log_probs = [[0.0]]  # another batch's: not passed
    with torch.no_grad():
        ours._get_per_token_logps_and_entropies(ours.model, ids, mask, 10)
    assert len(ours._metrics["train"]["ppo_logprobs/rollout_kl_k3"]) == 1


def _history(t):
    t.train()
    return [{k: v for k, v in row.items() if k in ("loss", "kl", "clip_ratio/region_mean", "reward")}
            for row in t.state.log_history if "loss" in row]


@pytest.mark.parametrize("cls,name", [(GRPOTrainer, "grpo"), (RLOOTrainer, "rloo")])
def test_two_steps_give_trls_own_loss_and_kl(service, checkpoint, tmp_path, cls, name):
    """GRPO with its reference from the service; with num_iterations=2 TRL also recomputes old log-probs, which
    come from the policy pool the trainer updates (RLOO recomputes them always)."""
    url, policy = service
    options = dict(num_iterations=2) if name == "grpo" else {}
    runs = []
    for ours in (True, False):
        kwargs = dict(reference=url, reference_model="reference", old_policy=policy) if ours else {}
        t = trainer(cls if ours else getattr(trl, cls.__name__), checkpoint, config(tmp_path / str(ours), name,
                    **options), **kwargs)
        calls = []
        if ours:  # count the calls each service takes
            for service in (t.ref_model.service, t.old_policy):
                service.score = lambda *a, _f=service.score, _calls=calls, **k: _calls.append(_f) or _f(*a, **k)
        torch.manual_seed(0)  # the same samples in both runs (TRL's reference model drew from the RNG when built)
        runs.append(_history(t))
        if ours:
            assert isinstance(t.ref_model, RemoteModel)
            assert t.policy_version == policy.weights_version > 0  # the pool took every step's weights
            # each generation's reference and old log-probs, each from its service: GRPO generates once for its two
            # iterations, RLOO at each of the two steps
            assert len(calls) == (2 if name == "grpo" else 4) and len(set(calls)) == 2, calls
    ours, theirs = runs
    assert len(ours) == len(theirs) == 2
    for mine, own in zip(ours, theirs, strict=True):
        assert mine.keys() == own.keys() and "kl" in mine
        for key in mine:
            assert mine[key] == pytest.approx(own[key], abs=1e-5), (key, ours, theirs)
    assert ours[1]["kl"] > 1e-4  # the second step's policy has moved from the reference


def test_what_the_adapter_refuses(service, checkpoint, tmp_path):
    url, _ = service
    with pytest.raises(ValueError, match="beta > 0"):
        trainer(GRPOTrainer, checkpoint, config(tmp_path, beta=0.0), reference=url)
    with pytest.raises(ValueError, match="sync_ref_model"):
        trainer(GRPOTrainer, checkpoint, config(tmp_path, sync_ref_model=True), reference=url)
    with pytest.raises(ValueError, match="old_policy= must be a WorkerPool"):
        trainer(GRPOTrainer, checkpoint, config(tmp_path), old_policy=url)

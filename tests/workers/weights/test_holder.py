"""The weight side of a worker (workers/weights/holder.py) on its own, in this process, without Ray: staging a
checkpoint or tensors, then commit or abort by version; the finiteness check; update_weights of a dict or a path;
a restarted worker's rule (all its weights or none); layout_for; a tensor-parallel rank's parts; the local copy.
Streams and shared tensors need a process group or CUDA (test_transfer.py and the pool's tests)."""

import tempfile
from pathlib import Path

import pytest
import torch

from ppo_logprobs.workers import load_model
from ppo_logprobs.workers.errors import (
    CheckpointNotFound,
    IncompatibleWeights,
    NonFiniteWeights,
    UpdateFailed,
    WeightsUnavailable,
)
from ppo_logprobs.workers.models.tensor_parallel import shard_of
from ppo_logprobs.workers.weights.checkpoint import read_checkpoint
from ppo_logprobs.workers.weights.holder import WeightsHolder

from ...helpers import kept_calls, perturbed, save

DOWN = "model.layers.1.mlp.down_proj.weight"
NORM = "model.norm.weight"


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor, so that NaN payloads, -0.0 and subnormals compare exactly."""
    return t.detach().reshape(-1).view(torch.uint8)


def params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_holds(model, want: dict[str, torch.Tensor]) -> None:
    """Every parameter named in `want` holds exactly its bytes."""
    have = params(model)
    for name, t in want.items():
        assert have[name].dtype == t.dtype and torch.equal(bits(have[name]), bits(t)), name


def noise(model, seed: int) -> dict[str, torch.Tensor]:
    """A full state dict for `model`: its parameters moved by seeded noise, in fp32 whatever the model's dtypes."""
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach().float() + torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def test_a_staged_checkpoint_reaches_the_model_bitwise_only_on_commit(tmp_path):
    source = perturbed(1)
    path = save(source, tmp_path / "ckpt")
    holder = WeightsHolder(load_model("tiny", backend="torch"), 0)
    before = snapshot(holder.model)
    assert holder.stage_checkpoint(path, 1) is None
    assert_holds(holder.model, before)
    assert holder.version == 0
    assert holder.commit(1) == 1
    assert holder.version == 1
    assert_holds(holder.model, snapshot(source))


def test_an_aborted_update_leaves_weights_and_version_and_cannot_be_committed(tmp_path):
    path = save(perturbed(2), tmp_path / "ckpt")
    holder = WeightsHolder(load_model("tiny", backend="torch"), 0)
    before = snapshot(holder.model)
    holder.stage_checkpoint(path, 1)
    holder.abort(1)
    with pytest.raises(UpdateFailed, match="no staged weights of version 1 to commit"):
        holder.commit(1)
    assert_holds(holder.model, before)
    assert holder.version == 0


def test_aborting_another_version_keeps_the_staged_one():
    holder = WeightsHolder(load_model("tiny", backend="torch"), 0)
    update = {NORM: torch.full((64,), 0.5)}
    holder.stage_tensors(update, 1)
    holder.abort(2)  # (a late abort of an update that was never staged here)
    assert holder.commit(1) == 1
    assert_holds(holder.model, update)


def test_only_the_version_staged_last_commits_and_only_once():
    holder = WeightsHolder(load_model("tiny", backend="torch"), 0)
    before = snapshot(holder.model)
    first, second = {NORM: torch.full((64,), 1.5)}, {NORM: torch.full((64,), -2.5)}
    holder.stage_tensors(first, 1)
    holder.stage_tensors(second, 2)  # replaces version 1
    for version in (1, 3):
        with pytest.raises(UpdateFailed, match=f"no staged weights of version {version} to commit"):
            holder.commit(version)
    assert_holds(holder.model, before)
    assert holder.version == 0
    assert holder.commit(2) == 2
    assert_holds(holder.model, second)
    with pytest.raises(UpdateFailed, match="no staged weights of version 2 to commit"):
        holder.commit(2)
    assert holder.version == 2


def test_staging_a_version_again_replaces_what_was_staged_under_it():
    holder = WeightsHolder(load_model("tiny", backend="torch"), 0)
    holder.stage_tensors({NORM: torch.full((64,), 1.5)}, 1)
    again = {NORM: torch.full((64,), 3.25)}
    holder.stage_tensors(again, 1)
    holder.commit(1)
    assert_holds(holder.model, again)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_check_names_the_first_staged_tensor_that_is_not_finite(tmp_path, bad):
    """Tensors staged in the update's order (the down projection before the embedding here): the first bad one is
    named, and only when asked to check. A checkpoint's bad tensor is named too."""
    holder = WeightsHolder(load_model("tiny", backend="torch"), 0)
    update = {n: p.detach().clone() for n, p in reversed(list(holder.model.named_parameters()))}
    update[DOWN][5, 7] = bad
    update["model.embed_tokens.weight"][0, 0] = bad
    assert holder.stage_tensors(update, 1) is None
    assert holder.stage_tensors(update, 1, check=True) == DOWN
    source = perturbed(3)
    with torch.no_grad():
        params(source)[DOWN][63, 127] = bad
    path = save(source, tmp_path / "ckpt")
    assert holder.stage_checkpoint(path, 2) is None
    assert holder.stage_checkpoint(path, 2, check=True) == DOWN


def test_update_weights_refuses_non_finite_values_naming_the_tensor_and_changes_nothing(tmp_path):
    holder = WeightsHolder(load_model("tiny", backend="torch"), 4)
    before = snapshot(holder.model)
    bad = {DOWN: torch.zeros(64, 128), NORM: torch.ones(64)}
    bad[DOWN][10, 20] = float("nan")
    source = perturbed(4)
    with torch.no_grad():
        params(source)[NORM][3] = float("inf")
    path = save(source, tmp_path / "ckpt")
    for weights, name in ((bad, DOWN), (path, NORM)):
        with pytest.raises(NonFiniteWeights, match=f"'{name}' holds NaN or infinite values"):
            holder.update_weights(weights, 5)
        assert_holds(holder.model, before)
        assert holder.version == 4
        with pytest.raises(UpdateFailed, match="no staged weights of version 5"):  # the refused update was dropped
            holder.commit(5)


def test_update_weights_takes_non_finite_values_when_allowed():
    holder = WeightsHolder(load_model("tiny", backend="torch"), 0)
    update = {NORM: torch.linspace(-1, 1, 64)}
    update[NORM][[0, 1, 2]] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    assert holder.update_weights(update, 1, allow_non_finite=True) == 1
    assert_holds(holder.model, update)


def test_update_weights_with_a_full_state_dict_sets_every_parameter_bitwise():
    holder = WeightsHolder(load_model("tiny", backend="torch"), 0)
    update = perturbed(5).state_dict()
    assert holder.update_weights(update, 7) == 7
    assert holder.version == 7
    assert_holds(holder.model, {n: update[n] for n in params(holder.model)})


def test_a_partial_state_dict_changes_only_its_tensors():
    holder = WeightsHolder(load_model("tiny", backend="torch"), 0)
    before = snapshot(holder.model)
    update = {n: t for n, t in noise(holder.model, 6).items() if n in (DOWN, NORM)}
    assert holder.update_weights(update, 1) == 1
    assert_holds(holder.model, update)
    assert_holds(holder.model, {n: t for n, t in before.items() if n not in update})


def test_a_state_dict_lands_in_the_models_dtypes_and_is_checked_there():
    """fp32 tensors given to bf16 and fp16 parameters land converted; a value finite in fp32 but past fp16's range
    is an infinity in the model, and is refused as one."""
    model = load_model("tiny", backend="torch")
    model.lm_head.to(torch.bfloat16)
    model.model.norm.to(torch.float16)
    holder = WeightsHolder(model, 0)
    update = {n: t for n, t in noise(model, 7).items() if n in ("lm_head.weight", NORM)}
    holder.update_weights(update, 1)
    assert_holds(model, {"lm_head.weight": update["lm_head.weight"].bfloat16(), NORM: update[NORM].half()})
    with pytest.raises(NonFiniteWeights, match=f"'{NORM}' holds NaN or infinite values"):
        holder.update_weights({NORM: torch.full((64,), 1e5)}, 2)
    assert holder.version == 1


@pytest.mark.parametrize("as_path", [False, True])
def test_update_weights_from_a_checkpoint_path(tmp_path, as_path):
    source = perturbed(8)
    holder = WeightsHolder(load_model("tiny", backend="torch"), 0)
    path = save(source, tmp_path / "ckpt")
    assert holder.update_weights(Path(path) if as_path else path, 3) == 3  # (a str or any os.PathLike)
    assert holder.version == 3
    assert_holds(holder.model, snapshot(source))


def test_a_bad_checkpoint_path_is_refused_naming_the_problem_and_changes_nothing(tmp_path):
    holder = WeightsHolder(load_model("tiny", backend="torch"), 2)
    before = snapshot(holder.model)
    other = save(perturbed(9, vocab_size=600), tmp_path / "other")
    cases = [
        (str(tmp_path / "missing"), CheckpointNotFound, "no checkpoint directory at '.*missing'"),
        (other, IncompatibleWeights, r"'lm_head.weight' has shape \[600, 64\] in the checkpoint and \[503, 64\]"),
    ]
    for path, error, message in cases:
        with pytest.raises(error, match=message):
            holder.update_weights(path, 3)
    assert_holds(holder.model, before)
    assert holder.version == 2


def test_an_incompatible_state_dict_is_refused_naming_the_tensor_and_changes_nothing():
    holder = WeightsHolder(load_model("tiny", backend="torch"), 0)
    before = snapshot(holder.model)
    cases = [
        ({NORM: torch.ones(65)}, rf"'{NORM}' has shape \[65\] in the update and \[64\] in the model"),
        ({"model.layers.0.mlp.up_proj.weight": torch.ones(128, 64), "model.nrm.weight": torch.ones(64)},
         "the update has 1 tensors the model does not, e.g. 'model.nrm.weight'$"),  # (a partial update: no layer
        ({}, "the update holds no tensors"),                                          # count to compare)
        ({NORM: torch.arange(64)}, f"'{NORM}' is torch.int64 in the update; the model's parameters are floating"),
        ({NORM: [1.0] * 64}, f"'{NORM}' is list in the update"),
        ([(NORM, torch.ones(64))], "an update is a checkpoint path or a dict of tensors, not list"),
    ]
    for update, message in cases:
        with pytest.raises(IncompatibleWeights, match=message):
            holder.update_weights(update, 1)
        with pytest.raises(UpdateFailed, match="no staged weights of version 1"):  # (a refused update is not staged)
            holder.commit(1)
    assert_holds(holder.model, before)
    assert holder.version == 0


def test_a_restarted_holder_takes_every_parameter_or_none():
    """Version None (a restarted worker's initial values): a partial update, staged or planned, is refused as
    WeightsUnavailable naming a parameter it lacks; a full one is taken, and partial ones after it."""
    holder = WeightsHolder(load_model("tiny", backend="torch"), None)
    before = snapshot(holder.model)
    partial = {NORM: torch.ones(64)}
    lacks = "a partial update cannot give it them .*the update lacks 26 of the model's parameters, e.g. 'model.embed"
    with pytest.raises(WeightsUnavailable, match=lacks):
        holder.update_weights(partial, 1)
    for lay_out in (True, False):  # (a pool's other workers check their own state without laying it out)
        with pytest.raises(WeightsUnavailable, match=lacks):
            holder.layout_for({NORM: (64,)}, lay_out=lay_out)
    assert_holds(holder.model, before)
    assert holder.version is None
    full = noise(holder.model, 10)
    assert holder.update_weights(full, 1) == 1
    assert_holds(holder.model, full)
    assert holder.update_weights(partial, 2) == 2
    assert_holds(holder.model, partial)


def test_layout_for_checks_names_and_shapes_and_lays_out_the_models_dtypes_in_the_update_order():
    model = load_model("tiny", backend="torch")
    model.lm_head.to(torch.bfloat16)
    holder = WeightsHolder(model, 0)
    shapes = {n: tuple(p.shape) for n, p in reversed(list(model.named_parameters()))}
    layout = holder.layout_for(shapes, full=True)
    assert [(e.name, e.shape, e.dtype) for e in layout.entries] == [
        (n, shapes[n], torch.bfloat16 if n == "lm_head.weight" else torch.float32) for n in shapes
    ]
    assert {e.name for e in holder.full_layout().entries} == set(shapes)
    assert [e.name for e in holder.layout_for({NORM: (64,)}).entries] == [NORM]
    with pytest.raises(IncompatibleWeights, match="the update lacks 26 of the model's parameters"):
        holder.layout_for({NORM: (64,)}, full=True)
    with pytest.raises(IncompatibleWeights, match=rf"'{DOWN}' has shape \[128, 64\] in the update and \[64, 128\]"):
        holder.layout_for({DOWN: (128, 64)})


def test_layout_for_a_group_this_holder_has_not_joined_is_refused_naming_it():
    holder = WeightsHolder(load_model("tiny", backend="torch"), 0)
    for lay_out in (True, False):
        with pytest.raises(UpdateFailed, match="not in the sender's group 'trainer-3'"):
            holder.layout_for({NORM: (64,)}, group="trainer-3", lay_out=lay_out)


def test_the_workers_that_do_not_lay_an_update_out_answer_none():
    """The pool's owner has one worker lay an update out; the others, holding weights, only check their group."""
    holder = WeightsHolder(load_model("tiny", backend="torch"), 0)
    assert holder.layout_for({NORM: (64,)}, lay_out=False) is None
    assert holder.layout_for({NORM: (64,)}).entries[0].name == NORM


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_rank_plans_whole_tensors_and_keeps_its_parts(rank):
    """A rank of 2 (sharding.py): the layout a sender sends is the whole tensors in the rank's dtypes; an update of
    whole tensors lands as shard_of each; the rank's own cut shapes are refused as not the whole model's."""
    model = load_model("tiny", backend="torch", shard=(rank, 2))
    model.lm_head.to(torch.bfloat16)
    holder = WeightsHolder(model, 0)
    whole = perturbed(11).state_dict()
    shapes = {n: tuple(t.shape) for n, t in whole.items() if n in params(model)}
    layout = holder.layout_for(shapes)
    assert {e.name: (e.shape, e.dtype) for e in layout.entries} == {
        n: (s, torch.bfloat16 if n == "lm_head.weight" else torch.float32) for n, s in shapes.items()
    }
    holder.update_weights({n: whole[n] for n in shapes}, 1)
    assert_holds(model, {n: shard_of(n, whole[n], rank, 2, model.config).to(p.dtype) for n, p in params(model).items()})
    with pytest.raises(IncompatibleWeights, match=r"q_proj.weight has shape \[32, 64\], not 64 entries along dim 0"):
        holder.layout_for({n: tuple(p.shape) for n, p in model.named_parameters()})


def test_shared_tensors_laid_out_for_another_model_are_refused():
    """A colocated sender's layout is checked against this model before anything is mapped: none at all, or one in
    other dtypes, is refused, and nothing is staged."""
    model = load_model("tiny", backend="torch")
    holder = WeightsHolder(model, 0)
    other = load_model("tiny", backend="torch", dtype=torch.bfloat16)
    bf16 = WeightsHolder(other, 0).layout_for({n: tuple(p.shape) for n, p in other.named_parameters()})
    for layout in (None, bf16):
        with pytest.raises(UpdateFailed, match="the sender's layout is not this worker's"):
            holder.stage_shared("key", [], layout, 1)
    with pytest.raises(UpdateFailed, match="no staged weights of version 1"):
        holder.commit(1)


def test_committed_checkpoints_are_kept_as_links_and_only_the_newest(tmp_path):
    calls, _, on_kept = kept_calls()
    root = tmp_path / "copies"
    holder = WeightsHolder(load_model("tiny", backend="torch"), 0, keep_dir=str(root), on_kept=on_kept)
    assert holder.keep_root == root
    first, second = save(perturbed(13), tmp_path / "step-1"), save(perturbed(14), tmp_path / "step-2")
    holder.update_weights(first, 1)
    assert calls == [(1, str(root / "v1"))]
    holder.stage_checkpoint(second, 2)
    assert len(calls) == 1  # staged is not kept
    holder.commit(2)
    assert calls == [(1, str(root / "v1")), (2, str(root / "v2"))]
    assert (root / "v2" / "model.safetensors").samefile(Path(second) / "model.safetensors")
    assert sorted(p.name for p in root.iterdir()) == ["v2"]
    holder.remove_local_copy()
    assert not root.exists()


def test_streamed_weights_are_kept_only_with_keep_streams(tmp_path):
    """Tensors (not a checkpoint) committed: nothing kept by default; with keep_streams a safetensors copy that
    reads back as the committed weights."""
    calls, _, on_kept = kept_calls()
    plain = WeightsHolder(load_model("tiny", backend="torch"), 0, keep_dir=str(tmp_path / "plain"), on_kept=on_kept)
    plain.update_weights(perturbed(15).state_dict(), 1)
    assert calls == [] and not (tmp_path / "plain").exists()
    calls, done, on_kept = kept_calls()
    holder = WeightsHolder(load_model("tiny", backend="torch"), 0, keep_dir=str(tmp_path / "streams"),
                           keep_streams=True, on_kept=on_kept)
    holder.update_weights(perturbed(16).state_dict(), 1)
    assert done.wait(60), "the local copy was not written"
    assert calls == [(1, str(tmp_path / "streams" / "v1"))]
    fresh = load_model("tiny", backend="torch")
    read_checkpoint(fresh, calls[0][1]).commit(fresh)
    assert_holds(fresh, snapshot(holder.model))


def test_the_local_copy_root_is_where_asked():
    """No keep_dir: no root, and removing the copy does nothing; a relative one lies under the temporary folder."""
    bare = WeightsHolder(load_model("tiny", backend="torch"), 0)
    assert bare.keep_root is None
    bare.remove_local_copy()
    relative = WeightsHolder(bare.model, 0, keep_dir="ppo-logprobs-holder-test")
    assert relative.keep_root == Path(tempfile.gettempdir()) / "ppo-logprobs-holder-test"

"""Load a HuggingFace causal LM from a local directory (or the built-in "tiny" model) and patch it."""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from ..errors import IncompatibleWeights, InvalidCheckpoint, clip
from ..head import Backend
from ..weights.checkpoint import check_shards, checkpoint_dir, read_checkpoint, say_unused
from .patch_model import allow_split_k, patch_model
from .tensor_parallel import build_sharded, connect, cut_model

# A real Qwen2 architecture, small enough for CPU tests and demos; its weights are random with a fixed seed.
TINY_CONFIG = dict(
    vocab_size=503, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
)


def _tiny_model(attn_implementation: str | None) -> nn.Module:
    config = Qwen2Config(**TINY_CONFIG)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(config)


def _not_a_load_report(record: logging.LogRecord) -> bool:
    return "LOAD REPORT" not in str(record.msg)


@contextmanager
def _quiet_hf_loading():
    """HF's progress bar (a line per worker in the service's log) and its load report off while it reads a
    directory: the report's mismatched and missing tensors are load_model's one-line errors, its unused tensors a
    one-line warning."""
    hf = logging.getLogger("transformers.modeling_utils")
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    hf.addFilter(_not_a_load_report)
    try:
        yield
    finally:
        hf.removeFilter(_not_a_load_report)
        if bars:
            hf_logging.enable_progress_bar()


def load_model(
    name_or_path: str,
    *,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
    backend: Backend = "auto",
    config: dict | None = None,
    process_group=None,
    shard: tuple[int, int] | None = None,
    invariant: bool = True,
) -> nn.Module:
    """A patched causal LM in eval mode: "tiny" (built in) or a local directory with config and safetensors.

    Nothing is fetched from a hub: a name that is not a local directory fails; so does a checkpoint whose shards are
    not whole (InvalidCheckpoint) or whose tensors do not fit its config.json (IncompatibleWeights: a shape that
    differs, a parameter missing, which HF would leave random). With `config` (a config's
    `to_dict()`), name_or_path is not read: the model of that config is built on `device` with weights left as
    initialised, for a weight update to fill. With `process_group`, this rank's tensor-parallel part
    (tensor_parallel.py): built alone and filled with its part of each checkpoint tensor (the whole model exists
    nowhere), or from `config` left as initialised. `shard` (rank, size) does the same without a group yet (a
    pool's rank joins its group later; it scores only then). `invariant=False`: the fast mode (patch_model's
    invariant, and cuBLAS's process-wide defaults back: docs/exactness.md).
    """
    if isinstance(dtype, str):  # ("bfloat16", as HF and the service's settings name it)
        named = getattr(torch, dtype, None)
        if not isinstance(named, torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype (e.g. 'bfloat16', 'float32')")
        dtype = named
    if process_group is not None:
        shard = (process_group.rank(), process_group.size())
    if config is None and name_or_path != "tiny":  # (HF would also look in its cache, and blame the network)
        if not (checkpoint_dir(str(name_or_path)) / "config.json").is_file():
            raise InvalidCheckpoint(f"{clip(str(name_or_path), 200)!r} has no config.json")
    built = None  # a config to build from: a config's dict, or a directory's config when only parts are read
    if config is not None:
        config = dict(config)
        built = AutoConfig.for_model(config.pop("model_type"), **config)
        dtype = dtype or config.get("dtype")
    elif name_or_path != "tiny" and shard is not None:  # this rank's parts are built and read, never the whole
        built = AutoConfig.from_pretrained(name_or_path, local_files_only=True)
        dtype = dtype or getattr(built, "dtype", None)
    if built is not None:
        if attn_implementation is not None:
            built._attn_implementation = attn_implementation
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype or torch.float32
        if shard is not None:
            model = build_sharded(built, *shard, device=device or "cpu", dtype=dtype)  # already cut
            shard = None
            if config is None:
                read_checkpoint(model, name_or_path).commit(model)
        else:
            with torch.device(device or "cpu"):
                model = AutoModelForCausalLM.from_config(built, dtype=dtype)
    elif name_or_path == "tiny":
        model = _tiny_model(attn_implementation)
    else:
        check_shards(str(name_or_path))  # InvalidCheckpoint naming the shard (HF raised safetensors' own error)
        # (HF left a tensor of another shape, or one the checkpoint lacks, as initialised: random, with a report in
        # the log; a mismatch raised an error that pointed to the report)
        with _quiet_hf_loading():
            model, loaded = AutoModelForCausalLM.from_pretrained(
                name_or_path, dtype=dtype or "auto", attn_implementation=attn_implementation, local_files_only=True,
                output_loading_info=True, ignore_mismatched_sizes=True,
            )
        where = clip(str(name_or_path), 200)
        if loaded["mismatched_keys"]:
            name, theirs, mine = sorted(loaded["mismatched_keys"])[0]
            raise IncompatibleWeights(f"{name!r} has shape {list(theirs)} in {where!r} and {list(mine)} in the model "
                                      "its config.json describes")
        if loaded["missing_keys"]:
            missing = sorted(loaded["missing_keys"])
            raise IncompatibleWeights(f"{where!r} lacks {len(missing)} of the model's parameters, e.g. {missing[0]!r}")
        if loaded["unexpected_keys"]:  # e.g. a value head saved beside the policy
            say_unused(name_or_path, loaded["unexpected_keys"])
    if shard is not None:
        cut_model(model, *shard)
    if process_group is not None:
        connect(model, process_group)
    if dtype is not None:
        model = model.to(dtype)
    if device is not None:
        model = model.to(device)
    if not invariant:
        allow_split_k(True)
    return patch_model(model.eval(), backend=backend, process_group=process_group, invariant=invariant)

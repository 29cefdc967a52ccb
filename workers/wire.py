"""How results travel over HTTP: JSON (float32 values written as the shortest text that reads back to the same
float32) or, when the client's Accept header names BINARY, a compact binary body read back bitwise.

BINARY body: a little-endian uint32 n, n bytes of JSON header {"model", "weights_version", "usage", "sequences",
"entropy": bool, "extras": {name: width}}, then int64 offsets [sequences + 1], float32 log_probs [offsets[-1]],
float32 entropy of the same length when the header says so, then each per-token output it names, in the order
and dtypes of their table (workers/outputs.py), [offsets[-1], width] (or [offsets[-1]] for width 0), and after
them, when any is asked for by token_ids, int64 candidate counts [sequences] (how many of the columns each
sequence asked for). Sequence i's values are [offsets[i], offsets[i + 1]).
About 4 bytes per scored token per array, against about 10-11 as JSON text. Also what a served model is
(ModelInfo). Part of the contract between the gateway and its clients: imports numpy, orjson and pydantic only.
"""

from __future__ import annotations

import json
import struct
from typing import Literal

import numpy as np
import orjson
from pydantic import BaseModel, Field

from .outputs import OUTPUTS

BINARY = "application/x-ppo-logprobs"


def encode_json(header: dict, log_probs: np.ndarray, entropy: np.ndarray | None, offsets: np.ndarray,
                extras: dict[str, np.ndarray] | None = None, candidates: np.ndarray | None = None) -> bytes:
    """{**header, "results": [{"log_probs": [...], "entropy": [...], ...extras}, ...]} with float32 values; each
    extra per entry (a list per entry where it has a width), candidates cut to each sequence's count. A header's
    per-sequence "mismatch" ({name: [value per sequence]}) goes into each result as {name: value}."""
    cuts = offsets[1:-1]
    results = [{"log_probs": a} for a in np.split(log_probs, cuts)]
    if "mismatch" in header:
        header = dict(header)
        stats = header.pop("mismatch")
        for i, result in enumerate(results):
            result["mismatch"] = {name: values[i] for name, values in stats.items()}
    columns = {} if entropy is None else {"entropy": entropy}
    columns.update(extras or {})
    for name, values in columns.items():
        for result, part in zip(results, np.split(values, cuts), strict=True):
            result[name] = part
    if candidates is not None:  # (the wide outputs of token_ids, each sequence's cut to its own list)
        for name in extras or {}:
            if OUTPUTS[name].per_candidate:
                for result, count in zip(results, candidates, strict=True):
                    result[name] = np.ascontiguousarray(result[name][:, :count])
    return orjson.dumps({**header, "results": results}, option=orjson.OPT_SERIALIZE_NUMPY)


def encode_binary(header: dict, log_probs: np.ndarray, entropy: np.ndarray | None, offsets: np.ndarray,
                  extras: dict[str, np.ndarray] | None = None, candidates: np.ndarray | None = None) -> bytes:
    extras = extras or {}
    widths = {name: (values.shape[1] if values.ndim == 2 else 0) for name, values in extras.items()}
    head = orjson.dumps({**header, "sequences": len(offsets) - 1, "entropy": entropy is not None,
                         "extras": widths})
    parts = [struct.pack("<I", len(head)), head, offsets.astype("<i8").tobytes(), log_probs.astype("<f4").tobytes()]
    if entropy is not None:
        parts.append(entropy.astype("<f4").tobytes())
    for name, output in OUTPUTS.items():
        if name in extras:
            parts.append(np.ascontiguousarray(extras[name], dtype=output.dtype).tobytes())
    by_ids = [name for name in extras if OUTPUTS[name].asked_by == "token_ids"]
    if by_ids:
        counts = candidates if candidates is not None else np.full(len(offsets) - 1, max(widths[n] for n in by_ids))
        parts.append(np.asarray(counts, dtype="<i8").tobytes())
    return b"".join(parts)


def decode_binary(body: bytes) -> tuple[dict, np.ndarray, np.ndarray | None, np.ndarray]:
    """(header, log_probs, entropy or None, offsets) of a BINARY body; ValueError if it is malformed. The extras
    the header names are in header["arrays"] (by name; candidate counts per sequence as "candidate_counts")."""
    try:
        (n,) = struct.unpack_from("<I", body)
        header = json.loads(body[4 : 4 + n])
        at = 4 + n
        count = header["sequences"] + 1
        offsets = np.frombuffer(body, dtype="<i8", count=count, offset=at)
        at += 8 * count
        total = int(offsets[-1])
        log_probs = np.frombuffer(body, dtype="<f4", count=total, offset=at)
        at += 4 * total
        entropy = None
        if header["entropy"]:
            entropy = np.frombuffer(body, dtype="<f4", count=total, offset=at)
            at += 4 * total
        arrays = {}
        named = header.get("extras", {})
        if set(named) - set(OUTPUTS):
            raise ValueError(f"outputs this client does not know: {sorted(set(named) - set(OUTPUTS))}")
        for name, output in OUTPUTS.items():
            if name in named:
                width = int(named[name])
                values = np.frombuffer(body, dtype=output.dtype, count=total * max(width, 1), offset=at)
                arrays[name] = values.reshape(total, width) if width else values
                at += values.nbytes
        if any(OUTPUTS[name].asked_by == "token_ids" for name in arrays):
            arrays["candidate_counts"] = np.frombuffer(body, dtype="<i8", count=header["sequences"], offset=at)
            at += 8 * header["sequences"]
        if at != len(body):
            raise ValueError(f"{len(body) - at} bytes past the arrays the header names")
        header["arrays"] = arrays
    except (struct.error, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed {BINARY} body: {e}") from None
    return header, log_probs, entropy, offsets


class ModelInfo(BaseModel):
    """A served model, as OpenAI's model object (id, object, created, owned_by) with ours beside."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(0, description="when this gateway replica started (Unix seconds)")
    owned_by: str = "ppo-logprobs"
    name: str = Field(..., description="the same as id")
    vocab_size: int
    max_length: int = Field(..., description="tokens in one sequence")
    max_request_tokens: int = Field(..., description="tokens in one request; clients split larger batches")
    weights_version: int

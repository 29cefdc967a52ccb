"""How results travel over HTTP: JSON (float32 values written as the shortest text that reads back to the same
float32) or, when the client's Accept header names BINARY, a compact binary body read back bitwise.

BINARY body: a little-endian uint32 n, n bytes of JSON header {"model", "weights_version", "usage", "sequences",
"entropy": bool}, then int64 offsets [sequences + 1], float32 log_probs [offsets[-1]], and float32 entropy of the
same length when the header says so. Sequence i's values are [offsets[i], offsets[i + 1]). About 4 bytes per scored
token per array, against about 10-11 as JSON text. Also what a served model is (ModelInfo). Part of the contract
between the gateway and its clients: imports numpy, orjson and pydantic only.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import orjson
from pydantic import BaseModel, Field

BINARY = "application/x-ppo-logprobs"


def encode_json(header: dict, log_probs: np.ndarray, entropy: np.ndarray | None, offsets: np.ndarray) -> bytes:
    """{**header, "results": [{"log_probs": [...], "entropy": [...]}, ...]} with float32 values."""
    cuts = offsets[1:-1]
    lp = np.split(log_probs, cuts)
    if entropy is None:
        results = [{"log_probs": a} for a in lp]
    else:
        results = [{"log_probs": a, "entropy": b} for a, b in zip(lp, np.split(entropy, cuts), strict=True)]
    return orjson.dumps({**header, "results": results}, option=orjson.OPT_SERIALIZE_NUMPY)


def encode_binary(header: dict, log_probs: np.ndarray, entropy: np.ndarray | None, offsets: np.ndarray) -> bytes:
    head = orjson.dumps({**header, "sequences": len(offsets) - 1, "entropy": entropy is not None})
    parts = [struct.pack("<I", len(head)), head, offsets.astype("<i8").tobytes(), log_probs.astype("<f4").tobytes()]
    if entropy is not None:
        parts.append(entropy.astype("<f4").tobytes())
    return b"".join(parts)


def decode_binary(body: bytes) -> tuple[dict, np.ndarray, np.ndarray | None, np.ndarray]:
    """(header, log_probs, entropy or None, offsets) of a BINARY body; ValueError if it is malformed."""
    try:
        (n,) = struct.unpack_from("<I", body)
        header = json.loads(body[4 : 4 + n])
        at = 4 + n
        count = header["sequences"] + 1
        offsets = np.frombuffer(body, dtype="<i8", count=count, offset=at)
        at += 8 * count
        total = int(offsets[-1])
        log_probs = np.frombuffer(body, dtype="<f4", count=total, offset=at)
        entropy = np.frombuffer(body, dtype="<f4", count=total, offset=at + 4 * total) if header["entropy"] else None
    except (struct.error, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed {BINARY} body: {e}") from None
    return header, log_probs, entropy, offsets


class ModelInfo(BaseModel):
    name: str
    vocab_size: int
    max_length: int = Field(..., description="tokens in one sequence")
    max_request_tokens: int = Field(..., description="tokens in one request; clients split larger batches")
    weights_version: int

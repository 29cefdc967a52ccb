"""The per-token outputs a score gives beside log_probs and entropy, in one table. What each layer holds of them is
derived from it: the worker's buffers, a result's fields (ScoreResult, SequenceScores), the BINARY body's arrays
(their order and dtypes), the HTTP schema, the clients' reading of JSON and the `score` command's lines. A new
output is a row here plus its kernel in the head (a row may carry `torch`: its values from a chunk's logits, which
the head's torch backend computes for it). Imports numpy only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np


@dataclass(frozen=True)
class Output:
    """One per-token output: `name`; `dtype`, its values' (little-endian numpy: in results and in BINARY bodies);
    `asked_by`, the request option that asks for it (top_k > 0, or token_ids given); `wide`: [entries, n] with n
    that option's size (k, or the candidate ids), else one value an entry; `null`: the value JSON writes as null
    (a non-finite float) and a client reads null back as; `description`, the HTTP schema's; `torch`: for a row
    that the head's torch backend computes itself, its values [rows, ...] from a chunk's fp32 logits [rows, V] and
    their logsumexp [rows] (the built-in rows are computed by both backends' own code)."""

    name: str
    dtype: str
    asked_by: Literal["top_k", "token_ids"]
    wide: bool
    null: float | None = None
    description: str = ""
    torch: Callable | None = None

    @property
    def per_candidate(self) -> bool:
        """A column per candidate id: each sequence's values are cut to its own list's length."""
        return self.asked_by == "token_ids" and self.wide

    def width(self, top_k: int, candidates: int) -> int | None:
        """Its values' width for a request asking top_k and candidate lists `candidates` wide: None when it is not
        asked for, 0 for one value an entry."""
        n = top_k if self.asked_by == "top_k" else candidates
        return None if not n else (n if self.wide else 0)

    def empty(self, entries: int, width: int) -> np.ndarray:
        return np.empty((entries, width) if width else entries, dtype=self.dtype)

    def from_json(self, values: list) -> np.ndarray:
        """Its values as JSON carried them (null read back as `null`)."""
        if self.null is not None:
            values = [[self.null if x is None else x for x in v] if isinstance(v, list) else self.null if v is None
                      else v for v in values]
        return np.asarray(values, dtype=self.dtype)

    def to_json(self, values: np.ndarray) -> list:
        """Its values as JSON carries them (`null` written as null)."""
        listed = values.tolist()
        if self.null is None:
            return listed
        return [[None if x == self.null else x for x in v] if isinstance(v, list) else None if v == self.null else v
                for v in listed]


OUTPUTS: dict[str, Output] = {}  # by name, in the order a BINARY body holds them


def add(output: Output) -> Output:
    """Registers a row (a new output; a test's)."""
    if output.name in OUTPUTS or output.name in ("log_probs", "entropy"):
        raise ValueError(f"an output named {output.name!r} exists")
    OUTPUTS[output.name] = output
    return output


def remove(name: str) -> None:
    OUTPUTS.pop(name)


for _row in (
    Output("top_log_probs", "<f4", "top_k", True, description="[entries, k], most likely first"),
    Output("top_ids", "<i4", "top_k", True, description="[entries, k]; ties to the lower id"),
    Output("tail_log_prob", "<f4", "top_k", False, null=-np.inf,
           description="every token outside the top k (null: none)"),
    Output("candidate_log_probs", "<f4", "token_ids", True, description="[entries, len(token_ids)]"),
):
    add(_row)


def asked(top_k: int, candidates: int) -> dict[Output, int]:
    """The outputs a request asking these gives, each with its width (0: one value an entry)."""
    return {o: w for o in OUTPUTS.values() if (w := o.width(top_k, candidates)) is not None}

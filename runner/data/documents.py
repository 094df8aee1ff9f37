"""Document masking for packed rows (`data.document_mask=true`).

A training row is a window of a token stream in which documents follow each other, each ended by
the tokenizer's end-of-document id. With document masking every row also carries

    segment_ids  int32[T]  which document of the row each input token belongs to (a document
                           owns its end-of-document token); attention never crosses segments
    positions    int32[T]  the token's position within its document, restarting at 0

and the target after an end-of-document token (the next document's first token) is masked out,
so a packed row's summed loss is the sum of its documents' losses, each computed alone. The
fields are a pure function of the row's tokens, so the batch stays a pure function of
(seed, strategy, step) and exact resume is untouched.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import grain
import numpy as np

from runner.errors import ConfigError

MODEL_INPUTS = ("segment_ids", "positions")  # the batch fields a model takes besides the tokens


@dataclass(frozen=True)
class DocumentMask:
    """Adds segment ids and per-document positions to an example and masks cross-document targets."""

    eod_id: int

    def __call__(self, example: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = np.asarray(example["x"])
        ends = x == self.eod_id
        segment_ids = np.concatenate([[0], np.cumsum(ends[:-1])]).astype(np.int32)
        starts = np.flatnonzero(np.concatenate([[True], ends[:-1]]))  # first index of each segment
        positions = (np.arange(len(x)) - starts[segment_ids]).astype(np.int32)
        mask = (example["mask"] * ~ends).astype(example["mask"].dtype)
        return {**example, "mask": mask, "segment_ids": segment_ids, "positions": positions}


class DocumentMasked:
    """A dataset strategy whose training and validation rows are document-masked; everything else
    is the wrapped strategy's. Its fingerprint differs, so a run cannot silently resume across a
    change of data.document_mask."""

    def __init__(self, strategy: Any) -> None:
        eod_id = getattr(strategy, "eod_id", None)
        if eod_id is None:
            raise ConfigError("data.document_mask", True, f"the dataset strategy {type(strategy).__name__} has no "
                              "documents (no end-of-document token to split rows at).",
                              "use a token-store strategy (mixture, sequential), or data.document_mask=false.")
        self.inner = strategy
        self.mask = DocumentMask(int(eod_id))
        self.fingerprint = hashlib.sha256(f"{strategy.fingerprint}/document_mask".encode()).hexdigest()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def train(self, seq_len: int, seed: int, global_batch: int | None = None) -> grain.MapDataset:
        return self.inner.train(seq_len, seed, global_batch).map(self.mask)

    def validation(self, seq_len: int, max_rows: int) -> dict[str, grain.MapDataset]:
        return {name: rows.map(self.mask) for name, rows in self.inner.validation(seq_len, max_rows).items()}


def model_inputs(micro: Any) -> dict[str, Any]:
    """The extra model arguments a batch carries (none without document masking)."""
    return {k: micro[k] for k in MODEL_INPUTS if k in micro}

"""Tokenizers: text <-> token ids. The byte tokenizer needs no vocabulary file, so it always works."""

from __future__ import annotations

from typing import ClassVar, Protocol

import numpy as np

from runner.registry import Registry


class Tokenizer(Protocol):
    """What stores and samplers need from a tokenizer."""

    name: str
    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: np.ndarray) -> str: ...


TOKENIZERS: Registry[type[Tokenizer]] = Registry("tokenizer", "data.tokenizer")


@TOKENIZERS.register("byte")
class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255 plus one end-of-document token (256).

    Lossless for any text and vocabulary-free, so the embedded corpus and tests never depend on a
    downloaded vocabulary.
    """

    name: ClassVar[str] = "byte"
    eod_id: ClassVar[int] = 256
    vocab_size: ClassVar[int] = 257

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: np.ndarray) -> str:
        """Bytes back to text; eod is dropped, and ids that are not bytes show as U+FFFD.

        Out-of-range ids can come from a model whose output layer is wider than the vocabulary;
        showing them beats crashing a sample printout.
        """
        ids = np.asarray(ids).ravel().astype(np.int64)
        ids = ids[ids != self.eod_id]
        ids = np.where((ids >= 0) & (ids < 256), ids, 0xFF)  # a lone 0xFF byte decodes to U+FFFD
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

"""Tokenizers: text <-> token ids.

``byte`` needs no vocabulary file, so it always works. ``hf`` (a Hugging Face ``tokenizer.json``),
``tiktoken`` (a BPE rank file) and ``train-bpe`` (a byte-level BPE trained on the corpus being
prepared) are chosen with ``--tokenizer`` of ``python -m runner.data.prepare``; the prepared store
keeps a copy of the vocabulary file, so it can always be decoded again (``TokenStore.load_tokenizer``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, ClassVar, Iterable, Protocol, Sequence

import numpy as np

from runner.errors import ConfigError, UserError
from runner.registry import Registry

KEY = "--tokenizer"
# End-of-text tokens of common vocabularies, tried in order when the user names none.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


class Tokenizer(Protocol):
    """What stores and samplers need from a tokenizer.

    Optional extras, used when present: ``encode_batch(texts)`` (faster bulk encoding),
    ``config()`` (a JSON record kept in the store's meta) and ``files()`` (name -> bytes, copied
    into the store), and a classmethod ``from_store(store)`` that rebuilds it from those.
    """

    name: str
    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: np.ndarray) -> str: ...


class StoredFiles(Protocol):
    """What a tokenizer reads back from the token store it was saved in (runner.data.store's
    TokenStore), so the tokenizer module needs no import of the store module."""

    meta: dict[str, Any]
    location: str

    def read_file(self, name: str) -> bytes: ...

    def local_copy(self, name: str) -> Path: ...


TOKENIZERS: Registry[Any] = Registry("tokenizer", KEY)


def encode_batch(tokenizer: Tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """Token ids of each text, through the tokenizer's bulk path when it has one."""
    bulk = getattr(tokenizer, "encode_batch", None)
    return bulk(texts) if bulk is not None else [tokenizer.encode(t) for t in texts]


def parse_tokenizer_spec(spec: str, key: str = KEY) -> tuple[Any, str]:
    """``kind:ARG`` (or a bare ``kind``) -> (registered class, ARG).

    A spec whose ``kind`` is not registered but looks like an import path (``pkg.mod:Class``) is
    imported instead, and the class is built without arguments.
    """
    kind, sep, arg = spec.partition(":")
    if kind in TOKENIZERS:
        return TOKENIZERS.get(kind), arg
    if TOKENIZERS.is_import_path(spec) and "." in kind:
        return TOKENIZERS.get(spec), ""
    raise ConfigError(
        key, spec, "there is no tokenizer of that kind.",
        "use `byte`, `hf:PATH/tokenizer.json`, `tiktoken:PATH.tiktoken`, `train-bpe:VOCAB_SIZE`, "
        "or an import path such as `my_pkg.module:MyTokenizer`.",
    )


def load_tokenizer(spec: str, key: str = KEY, **options: Any) -> Tokenizer:
    """The tokenizer named by ``spec`` (not ``train-bpe``, which needs a corpus; see ``TrainedBPE``)."""
    cls, arg = parse_tokenizer_spec(spec, key)
    if getattr(cls, "TRAINS", False):
        raise ValueError(f"{spec!r} must be trained on a corpus first (TrainedBPE.train)")
    from_arg = getattr(cls, "from_arg", None)
    if from_arg is None:
        return cls()
    return from_arg(arg, key=key, spec=spec, **options)


def _read_vocab_file(arg: str, key: str, spec: str, what: str) -> tuple[Path, bytes]:
    if not arg:
        raise ConfigError(key, spec, f"it names no {what} file.", f"write `{spec.split(':')[0]}:PATH`.")
    path = Path(arg).expanduser()
    try:
        return path, path.read_bytes()
    except OSError as err:
        raise ConfigError(key, spec, f"the {what} file {path} cannot be read ({err.strerror or err}).",
                          "give the path of an existing file.") from None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------------- byte


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


# ----------------------------------------------------------------------------- Hugging Face


@TOKENIZERS.register("hf")
class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer.json.

    The end-of-document id is the vocabulary's own end-of-text token (``--eod-token``, else the
    first of ``EOD_CANDIDATES`` it has); a vocabulary without one gets one extra id past its end.
    Special-token strings inside documents are encoded as plain text, so raw text can never forge
    a document boundary.
    """

    name: ClassVar[str] = "hf"
    FILE: ClassVar[str] = "tokenizer.json"

    def __init__(self, data: bytes, eod_token: str | None = None, *, key: str = KEY, spec: str = "hf") -> None:
        from tokenizers import Tokenizer as HFCore

        try:
            self._tok = HFCore.from_str(data.decode("utf-8"))
        except Exception as err:  # tokenizers raises a bare Exception for malformed files
            raise ConfigError(key, spec, f"it is not a valid Hugging Face tokenizer.json ({err}).",
                              "give a tokenizer.json saved by `tokenizers` or `transformers`.") from None
        self._tok.encode_special_tokens = True
        self.data = data
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._base_size = max(vocab.values()) + 1
        if eod_token is not None and eod_token not in vocab:
            raise ConfigError("--eod-token", eod_token, f"the tokenizer ({spec}) has no such token.",
                              "name a token of its vocabulary, or leave --eod-token out.")
        if eod_token is None:
            eod_token = next((t for t in EOD_CANDIDATES if t in vocab), None)
        self.eod_token = eod_token
        self.eod_id = vocab[eod_token] if eod_token is not None else self._base_size
        self.vocab_size = self._base_size + (eod_token is None)

    @classmethod
    def from_arg(cls, arg: str, *, key: str = KEY, spec: str = "hf", eod_token: str | None = None,
                 **_: Any) -> HFTokenizer:
        _, data = _read_vocab_file(arg, key, spec, "tokenizer.json")
        return cls(data, eod_token, key=key, spec=spec)

    @classmethod
    def from_store(cls, store: StoredFiles) -> HFTokenizer:
        config = store.meta["tokenizer_config"]
        return cls(store.read_file(config["file"]), config.get("eod_token"), spec=f"hf in {store.location}")

    def config(self) -> dict[str, Any]:
        return {"file": self.FILE, "sha256": _sha256(self.data), "eod_token": self.eod_token}

    def files(self) -> dict[str, bytes]:
        return {self.FILE: self.data}

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        dtype = np.uint16 if self.vocab_size <= 2**16 else np.uint32
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=dtype) for e in encodings]

    def decode(self, ids: np.ndarray) -> str:
        ids = np.asarray(ids).ravel().astype(np.int64)
        ids = ids[(ids >= 0) & (ids < self._base_size) & (ids != self.eod_id)]
        return self._tok.decode(ids.tolist(), skip_special_tokens=True)


@TOKENIZERS.register("train-bpe")
class TrainedBPE(HFTokenizer):
    """``train-bpe:VOCAB_SIZE``: a byte-level BPE trained with ``tokenizers`` on the corpus itself.

    The result is an ordinary ``hf`` tokenizer (saved as tokenizer.json in the store) whose
    vocabulary holds the 256 bytes, ``<|endoftext|>`` and the learned merges, at most VOCAB_SIZE
    in all (fewer when the corpus runs out of pairs to merge).
    """

    TRAINS: ClassVar[bool] = True
    EOD: ClassVar[str] = "<|endoftext|>"

    @staticmethod
    def parse_vocab_size(arg: str, key: str = KEY, spec: str = "train-bpe") -> int:
        try:
            size = int(arg)
        except ValueError:
            size = -1
        if not 257 <= size <= 2**32 - 1:
            raise ConfigError(key, spec, "the vocabulary size must be a whole number of at least 257 "
                              "(256 bytes plus the end-of-document token).", "write e.g. `train-bpe:32000`.")
        return size

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, length: int | None = None) -> HFTokenizer:
        """Learn merges from ``texts``; deterministic for the same texts in the same order."""
        from tokenizers import Tokenizer as HFCore
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = HFCore(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[cls.EOD], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(texts, trainer=trainer, length=length)
        return HFTokenizer(tok.to_str().encode("utf-8"), cls.EOD)


# ----------------------------------------------------------------------------- tiktoken


def _tiktoken_patterns() -> dict[str, str]:
    """Pre-tokenization regexes by name. tiktoken exports GPT-2's as a constant; the others live
    only inside tiktoken_ext constructors that download their rank files, so they are copied here."""
    from tiktoken_ext.openai_public import r50k_pat_str

    return {
        "gpt2": r50k_pat_str,
        "cl100k": r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""",
        "o200k": "|".join([
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""\p{N}{1,3}""",
            r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
            r"""\s*[\r\n]+""",
            r"""\s+(?!\S)""",
            r"""\s+""",
        ]),
    }


TIKTOKEN_PATTERNS = ("gpt2", "cl100k", "o200k")
_PATTERN_HINTS = {"gpt2": "gpt2", "r50k": "gpt2", "p50k": "gpt2", "cl100k": "cl100k", "o200k": "o200k"}


@TOKENIZERS.register("tiktoken")
class TiktokenTokenizer:
    """A tiktoken BPE rank file (``NAME.tiktoken``) read from a local path, never downloaded.

    Rank files hold no pre-tokenization regex, so it is chosen with ``--tiktoken-pattern``
    (gpt2, cl100k, o200k), or guessed from the file name (r50k/p50k/gpt2, cl100k, o200k). The
    end-of-document token ``<|endoftext|>`` gets the id after the last rank, as in GPT-2.
    """

    name: ClassVar[str] = "tiktoken"
    FILE: ClassVar[str] = "tokenizer.tiktoken"

    def __init__(self, path: Path, sha256: str, pattern: str, pat_str: str) -> None:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        # The expected hash makes tiktoken's path-keyed file cache re-read a file that changed.
        ranks = load_tiktoken_bpe(str(path), expected_hash=sha256)
        self.sha256, self.pattern, self.pat_str = sha256, pattern, pat_str
        self.eod_id = max(ranks.values()) + 1
        self.vocab_size = self.eod_id + 1
        self._enc = tiktoken.Encoding(f"runner-{sha256[:12]}", pat_str=pat_str, mergeable_ranks=ranks,
                                      special_tokens={"<|endoftext|>": self.eod_id})
        self._path = path

    @classmethod
    def from_arg(cls, arg: str, *, key: str = KEY, spec: str = "tiktoken", tiktoken_pattern: str | None = None,
                 **_: Any) -> TiktokenTokenizer:
        path, data = _read_vocab_file(arg, key, spec, ".tiktoken rank")
        if tiktoken_pattern is None:
            hints = [p for hint, p in _PATTERN_HINTS.items() if hint in path.name.lower()]
            if not hints:
                raise UserError(f"The pre-tokenization regex of the tiktoken rank file {path.name} cannot be "
                                f"guessed from its name. Fix: pass --tiktoken-pattern with one of: "
                                f"{', '.join(TIKTOKEN_PATTERNS)} (the one its vocabulary was trained with).")
            tiktoken_pattern = hints[0]
        if tiktoken_pattern not in TIKTOKEN_PATTERNS:
            raise ConfigError("--tiktoken-pattern", tiktoken_pattern, "it is not a known pattern.",
                              f"use one of: {', '.join(TIKTOKEN_PATTERNS)}.")
        try:
            return cls(path.absolute(), _sha256(data), tiktoken_pattern, _tiktoken_patterns()[tiktoken_pattern])
        except ValueError as err:
            raise ConfigError(key, spec, f"it is not a valid tiktoken rank file ({err}).",
                              "give a file of `base64-token rank` lines, such as cl100k_base.tiktoken.") from None

    @classmethod
    def from_store(cls, store: StoredFiles) -> TiktokenTokenizer:
        config = store.meta["tokenizer_config"]
        path = store.local_copy(config["file"])
        return cls(path, config["sha256"], config["pattern"], config["pat_str"])

    def config(self) -> dict[str, Any]:
        return {"file": self.FILE, "sha256": self.sha256, "pattern": self.pattern, "pat_str": self.pat_str}

    def files(self) -> dict[str, bytes]:
        return {self.FILE: self._path.read_bytes()}

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        dtype = np.uint16 if self.vocab_size <= 2**16 else np.uint32
        threads = 1 if os.environ.get("RUNNER_PREPARE_WORKER") else min(8, os.cpu_count() or 1)
        return [np.asarray(ids, dtype=dtype)
                for ids in self._enc.encode_ordinary_batch(list(texts), num_threads=threads)]

    def decode(self, ids: np.ndarray) -> str:
        ids = np.asarray(ids).ravel().astype(np.int64)
        ids = ids[(ids >= 0) & (ids < self.eod_id)]
        return self._enc.decode(ids.tolist(), errors="replace")


def check_user_tokenizer(tokenizer: Any, spec: str) -> Tokenizer:
    """A plugged-in tokenizer must expose the protocol's attributes; say which one is missing."""
    for attr in ("name", "vocab_size", "eod_id", "encode", "decode"):
        if not hasattr(tokenizer, attr):
            raise UserError(f"The tokenizer {spec!r} has no `{attr}`. Fix: implement "
                            "runner.data.tokenizer.Tokenizer (name, vocab_size, eod_id, encode, decode).")
    return tokenizer

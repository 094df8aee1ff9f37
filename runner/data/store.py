"""A local flat token store: one raw token file per split plus ``meta.json``.

Raw little-endian arrays can be memory-mapped, so any window of any split is a cheap slice and
the training batch can be computed from (seed, step) alone, on any host, without an iterator state.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from runner.data.tokenizer import Tokenizer
from runner.errors import UserError

FORMAT = "runner-flat-v1"
SPLITS = ("train", "val")
META_FILE = "meta.json"
PREPARE_HINT = (
    "prepare one with `runner.data.store.write_store(...)`, or use the path `default` "
    "for the embedded corpus"
)


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The narrowest little-endian unsigned dtype that holds every token id."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


@dataclass(frozen=True)
class TokenStore:
    """An opened, validated store; token arrays are read-only memory maps."""

    path: Path
    meta: Mapping[str, Any]
    _splits: Mapping[str, np.ndarray]

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> TokenStore:
        path = Path(path).expanduser()
        meta_path = path / META_FILE
        if not meta_path.is_file():
            raise UserError(f"There is no token store at {path} (no {META_FILE} there). Fix: {PREPARE_HINT}.")
        meta = _read_meta(path, meta_path)
        dtype = np.dtype(meta["dtype"]).newbyteorder("<")
        splits: dict[str, np.ndarray] = {}
        for split in SPLITS:
            count = meta["splits"][split]["tokens"]
            splits[split] = _map_split(path, split, count, dtype)
        return cls(path, meta, splits)

    def tokens(self, split: str) -> np.ndarray:
        """All tokens of ``split`` (documents back to back, each followed by eod)."""
        if split not in self._splits:
            raise ValueError(f"unknown split {split!r}; a store has {', '.join(SPLITS)}")
        return self._splits[split]

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def tokenizer(self) -> str:
        return str(self.meta["tokenizer"])

    @property
    def eod_id(self) -> int:
        return int(self.meta["eod_id"])


def _corrupt(path: Path, problem: str) -> UserError:
    return UserError(f"Corrupt token store at {path}: {problem} Fix: delete {path} and prepare it again.")


def _read_meta(path: Path, meta_path: Path) -> dict[str, Any]:
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _corrupt(path, f"{META_FILE} cannot be read ({err}).") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise _corrupt(path, f"{META_FILE} has format {found!r}, expected {FORMAT!r}.")
    try:
        if np.dtype(meta["dtype"]) not in (np.dtype("u2"), np.dtype("u4")):
            raise _corrupt(path, f"dtype {meta['dtype']!r} is not uint16 or uint32.")
        for split in SPLITS:
            if int(meta["splits"][split]["tokens"]) < 0:
                raise _corrupt(path, f"negative token count for split {split!r}.")
        missing = [f for f in ("vocab_size", "tokenizer", "eod_id", "fingerprint") if f not in meta]
        if missing:
            raise _corrupt(path, f"{META_FILE} lacks the field(s) {', '.join(missing)}.")
    except (KeyError, TypeError, ValueError) as err:
        raise _corrupt(path, f"{META_FILE} lacks or mangles a required field ({err!r}).") from None
    return meta


def _map_split(path: Path, split: str, count: int, dtype: np.dtype) -> np.ndarray:
    file = path / f"{split}.bin"
    if not file.is_file():
        raise _corrupt(path, f"{file.name} is missing.")
    size = file.stat().st_size
    if size != count * dtype.itemsize:
        raise _corrupt(
            path,
            f"{file.name} has {size} bytes but {META_FILE} says {count} tokens of {dtype.itemsize} bytes "
            f"({count * dtype.itemsize} bytes).",
        )
    if count == 0:  # mmap cannot map an empty file
        return np.zeros(0, dtype)
    return np.memmap(file, dtype=dtype, mode="r", shape=(count,))


def write_store(
    path: str | os.PathLike[str],
    docs_by_split: Mapping[str, Iterable[np.ndarray]],
    tokenizer: Tokenizer,
    sources: Sequence[Any],
    *,
    exist_ok: bool = False,
) -> TokenStore:
    """Write token documents (eod appended to each) as a store at ``path``, atomically.

    The store is built in a temporary directory beside ``path`` and renamed into place, so a
    reader never sees a half-written store. If another process finishes the same store first,
    theirs is kept and opened. An existing store is an error unless ``exist_ok``.
    """
    path = Path(path).expanduser()
    if set(docs_by_split) != set(SPLITS):
        raise ValueError(f"docs_by_split must have exactly the splits {SPLITS}, got {sorted(docs_by_split)}")
    if (path / META_FILE).exists():
        if exist_ok:
            return TokenStore.open(path)
        raise UserError(f"A token store already exists at {path}. Fix: delete it, or choose another path.")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"Cannot create {path.parent} for a token store ({err}). Fix: choose a writable path.") from None
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        meta = _write_splits(tmp, docs_by_split, tokenizer, sources)
        _write_durably(tmp / META_FILE, json.dumps(meta, indent=1).encode())
        try:
            os.rename(tmp, path)
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            # Another process renamed its (identically built) store into place first: keep theirs.
        else:
            _fsync_dir(path.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return TokenStore.open(path)


def _write_splits(
    directory: Path, docs_by_split: Mapping[str, Iterable[np.ndarray]], tokenizer: Tokenizer, sources: Sequence[Any]
) -> dict[str, Any]:
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    eod = np.array([tokenizer.eod_id], dtype).tobytes()
    digest = hashlib.sha256()
    splits: dict[str, dict[str, int]] = {}
    for split in SPLITS:
        tokens = documents = 0
        with open(directory / f"{split}.bin", "wb") as out:
            for doc in docs_by_split[split]:
                ids = np.asarray(doc)
                if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
                    raise ValueError(f"a {split} document has token ids outside [0, {tokenizer.vocab_size})")
                data = ids.astype(dtype).tobytes() + eod
                out.write(data)
                digest.update(data)
                tokens += ids.size + 1
                documents += 1
            out.flush()
            os.fsync(out.fileno())
        digest.update(f"|{split}:{tokens}|".encode())  # split boundaries are part of the identity
        splits[split] = {"tokens": tokens, "documents": documents}
    return {
        "format": FORMAT,
        "dtype": dtype.name,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": tokenizer.name,
        "eod_id": tokenizer.eod_id,
        "splits": splits,
        "sources": list(sources),
        "fingerprint": digest.hexdigest(),
    }


def _write_durably(file: Path, data: bytes) -> None:
    with open(file, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

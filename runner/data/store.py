"""Token stores: every document's tokens back to back per split (train, val), plus ``meta.json``.

Two formats hold the same content and open through the same ``TokenStore.open``, which reads
``meta.json`` through a tensorstore kvstore and dispatches on its ``format``:

* ``flat`` (``runner-flat-v1``): one raw little-endian file per split, memory-mapped, so any window
  is a free slice. Local directories only.
* ``zarr3`` (``runner-zarr3-v1``): one 1-D zarr v3 array per split, written and read with
  tensorstore, at a local path or any URL tensorstore's kvstore understands (``gs://bucket/dir``);
  4M-token shard objects of zstd-compressed 16K-token chunks, so a random window reads ~32 KB.
  Local and remote locations differ only in the kvstore spec (``kvstore_spec``); everything after
  it, writing and reading, is one code path. Reads go through tensorstore's chunk cache.

Either way a window of tokens is a pure function of its position, so the training batch can be
computed from (seed, step) alone, on any host, without an iterator state. The fingerprint is a
sha256 of the tokens and split boundaries only, so the same data has the same fingerprint in
both formats.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence

import numpy as np

from runner.checkpoint.files import atomic_write
from runner.checkpoint.storage import cache_root, is_remote
from runner.data.tokenizer import TOKENIZERS, Tokenizer
from runner.errors import UserError

FLAT_FORMAT = FORMAT = "runner-flat-v1"
ZARR3_FORMAT = "runner-zarr3-v1"
FORMATS = {"flat": FLAT_FORMAT, "zarr3": ZARR3_FORMAT}  # --format name -> meta "format"
SPLITS = ("train", "val")
META_FILE = "meta.json"
# zarr3 layout: shards (one object each, so a bucket holds few large objects) of small chunks (the
# unit a random window read fetches and decompresses: 16K tokens, 32 KB at uint16).
ZARR_SHARD_TOKENS = 1 << 22
ZARR_CHUNK_TOKENS = 1 << 14
ZARR_MAX_TOKENS = 1 << 48  # arrays are created this long, then cut to the real length at the end
ZARR_CACHE_BYTES = 1 << 28  # tensorstore chunk cache per opened zarr3 store
PREPARE_HINT = (
    "prepare one with `python -m runner.data.prepare INPUT... --output PATH` (see docs/data.md), "
    "or use the path `default` for the embedded corpus"
)


class MissingStoreError(UserError):
    """There is no store (no meta.json) at the location; strategies re-raise it with the config key."""


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The narrowest little-endian unsigned dtype that holds every token id."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def normalize_location(location: str | os.PathLike[str]) -> str:
    """A URL without its trailing slash, or an absolute local path (``~`` expanded)."""
    loc = os.fspath(location)
    return loc.rstrip("/") if is_remote(loc) else str(Path(loc).expanduser().absolute())


def kvstore_spec(location: str | os.PathLike[str]) -> Any:
    """The tensorstore kvstore spec of a store directory: ``{"driver": "file"}`` for a local path,
    whatever tensorstore parses the URL into otherwise (``gs://b/p`` -> the ``gcs`` driver)."""
    import tensorstore as ts

    loc = normalize_location(location)
    if is_remote(loc):
        return ts.KvStore.Spec(loc + "/")
    return ts.KvStore.Spec({"driver": "file", "path": loc + "/"})


def _kvstore(location: str) -> Any:
    import tensorstore as ts

    return ts.KvStore.open(kvstore_spec(location)).result()


def _corrupt(location: str, problem: str) -> UserError:
    return UserError(f"Corrupt token store at {location}: {problem} Fix: delete {location} and prepare it again.")


# ----------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class ZarrTokens:
    """One zarr3 split as a read-only 1-D token array: slicing reads through the chunk cache."""

    array: Any  # tensorstore.TensorStore
    location: str

    def __len__(self) -> int:
        return int(self.array.shape[0])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.array.dtype.numpy_dtype)

    def __getitem__(self, index: Any) -> np.ndarray:
        try:
            return np.asarray(self.array[index].read().result())
        except ValueError as err:  # tensorstore reports a missing or undecodable chunk this way
            raise _corrupt(self.location, f"a chunk cannot be read ({err}).") from None

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        data = self[:]
        return data if dtype is None else data.astype(dtype)


@dataclass(frozen=True)
class TokenStore:
    """An opened, validated store. ``tokens(split)`` is a numpy memmap (flat) or ``ZarrTokens``."""

    location: str
    meta: Mapping[str, Any]
    _splits: Mapping[str, Any]

    @classmethod
    def open(cls, location: str | os.PathLike[str]) -> TokenStore:
        loc = normalize_location(location)
        try:
            found = _kvstore(loc).read(META_FILE).result()
        except ValueError as err:
            raise UserError(f"Cannot read the token store at {loc} ({err}). Fix: check the location and, "
                            "for a bucket, your credentials.") from None
        if found.state != "value":
            raise MissingStoreError(f"There is no token store at {loc} (no {META_FILE} there). Fix: {PREPARE_HINT}.")
        meta = _parse_meta(loc, bytes(found.value))
        opener = _open_flat if meta["format"] == FLAT_FORMAT else _open_zarr3
        return cls(loc, meta, opener(loc, meta))

    def tokens(self, split: str) -> Any:
        """All tokens of ``split`` (documents back to back, each followed by eod)."""
        if split not in self._splits:
            raise ValueError(f"unknown split {split!r}; a store has {', '.join(SPLITS)}")
        return self._splits[split]

    @property
    def path(self) -> Path:
        """The local directory (meaningful for local stores only)."""
        return Path(self.location)

    @property
    def name(self) -> str:
        return PurePosixPath(self.location).name

    @property
    def format(self) -> str:
        return str(self.meta["format"])

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def tokenizer(self) -> str:
        """The tokenizer's name in ``TOKENIZERS`` (``byte``, ``hf``, ``tiktoken``, ...)."""
        return str(self.meta["tokenizer"])

    @property
    def tokenizer_id(self) -> str:
        """Name plus vocabulary-file hash: two stores agree on it iff their token ids mean the same."""
        sha = (self.meta.get("tokenizer_config") or {}).get("sha256")
        return f"{self.tokenizer}:{sha[:16]}" if sha else self.tokenizer

    @property
    def eod_id(self) -> int:
        return int(self.meta["eod_id"])

    def read_file(self, name: str) -> bytes:
        """A file kept beside the tokens (e.g. the tokenizer's vocabulary), local or remote alike."""
        found = _kvstore(self.location).read(name).result()
        if found.state != "value":
            raise _corrupt(self.location, f"{name}, named in {META_FILE}, is missing.")
        return bytes(found.value)

    def local_copy(self, name: str) -> Path:
        """A local path holding ``read_file(name)``: the file itself, or a cached copy of a remote one."""
        if not is_remote(self.location):
            path = self.path / name
            if not path.is_file():
                raise _corrupt(self.location, f"{name}, named in {META_FILE}, is missing.")
            return path
        data = self.read_file(name)
        path = cache_root() / "store-files" / hashlib.sha256(data).hexdigest() / name
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, data)
        return path

    def load_tokenizer(self) -> Tokenizer:
        """The tokenizer that produced these tokens, rebuilt from the store alone."""
        cls = TOKENIZERS.get(self.tokenizer)
        tokenizer = cls.from_store(self) if hasattr(cls, "from_store") else cls()
        if (tokenizer.vocab_size, tokenizer.eod_id) != (self.vocab_size, self.eod_id):
            raise _corrupt(self.location, f"its tokenizer has vocab {tokenizer.vocab_size} / eod "
                           f"{tokenizer.eod_id}, but {META_FILE} says {self.vocab_size} / {self.eod_id}.")
        return tokenizer


def _parse_meta(location: str, raw: bytes) -> dict[str, Any]:
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _corrupt(location, f"{META_FILE} cannot be read ({err}).") from None
    if not isinstance(meta, dict) or meta.get("format") not in FORMATS.values():
        found = meta.get("format") if isinstance(meta, dict) else None
        raise _corrupt(location, f"{META_FILE} has format {found!r}, expected one of "
                       f"{', '.join(repr(f) for f in FORMATS.values())}.")
    try:
        if np.dtype(meta["dtype"]) not in (np.dtype("u2"), np.dtype("u4")):
            raise _corrupt(location, f"dtype {meta['dtype']!r} is not uint16 or uint32.")
        for split in SPLITS:
            if int(meta["splits"][split]["tokens"]) < 0:
                raise _corrupt(location, f"negative token count for split {split!r}.")
        missing = [f for f in ("vocab_size", "tokenizer", "eod_id", "fingerprint") if f not in meta]
        if missing:
            raise _corrupt(location, f"{META_FILE} lacks the field(s) {', '.join(missing)}.")
    except (KeyError, TypeError, ValueError) as err:
        raise _corrupt(location, f"{META_FILE} lacks or mangles a required field ({err!r}).") from None
    return meta


def _open_flat(location: str, meta: Mapping[str, Any]) -> dict[str, np.ndarray]:
    if is_remote(location):
        raise UserError(f"The token store at {location} is in the flat format, which is memory-mapped and "
                        "so must be local. Fix: copy it to a local disk, or prepare it with --format zarr3.")
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    splits = {}
    for split in SPLITS:
        count = int(meta["splits"][split]["tokens"])
        file = Path(location) / f"{split}.bin"
        if not file.is_file():
            raise _corrupt(location, f"{file.name} is missing.")
        size = file.stat().st_size
        if size != count * dtype.itemsize:
            raise _corrupt(location, f"{file.name} has {size} bytes but {META_FILE} says {count} tokens of "
                           f"{dtype.itemsize} bytes ({count * dtype.itemsize} bytes).")
        # mmap cannot map an empty file
        splits[split] = np.zeros(0, dtype) if count == 0 else np.memmap(file, dtype=dtype, mode="r", shape=(count,))
    return splits


def _open_zarr3(location: str, meta: Mapping[str, Any]) -> dict[str, ZarrTokens]:
    import tensorstore as ts

    context = ts.Context({"cache_pool": {"total_bytes_limit": ZARR_CACHE_BYTES}})
    splits = {}
    for split in SPLITS:
        count = int(meta["splits"][split]["tokens"])
        spec = {"driver": "zarr3", "kvstore": (kvstore_spec(location) / f"{split}/").to_json(),
                "recheck_cached_data": False}  # a finished store never changes
        try:
            array = ts.open(spec, read=True, open=True, context=context).result()
        except ValueError as err:
            raise _corrupt(location, f"the {split} array cannot be opened ({err}).") from None
        if array.rank != 1 or array.shape[0] != count or np.dtype(array.dtype.numpy_dtype) != np.dtype(meta["dtype"]):
            raise _corrupt(location, f"the {split} array is {array.dtype.name}{list(array.shape)} but {META_FILE} "
                           f"says {meta['dtype']}[{count}].")
        splits[split] = ZarrTokens(array, location)
    return splits


# ----------------------------------------------------------------------------- writing


class _Sink(Protocol):
    def write(self, data: np.ndarray) -> None: ...

    def close(self) -> None: ...


class _FileSink:
    def __init__(self, file: Path) -> None:
        self._file = open(file, "wb")

    def write(self, data: np.ndarray) -> None:
        self._file.write(data.data)

    def close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


class _ZarrSink:
    """Appends tokens to a zarr3 array in whole shards (no read-modify-write), a few writes in flight."""

    def __init__(self, spec: Any, dtype: np.dtype) -> None:
        import tensorstore as ts

        chunk_codecs = [{"name": "bytes", "configuration": {"endian": "little"}},
                        {"name": "zstd", "configuration": {"level": 3}}]
        metadata = {
            "shape": [ZARR_MAX_TOKENS],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [ZARR_SHARD_TOKENS]}},
            "data_type": dtype.name,
            "codecs": [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": [ZARR_CHUNK_TOKENS], "codecs": chunk_codecs,
                "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
            }}],
        }
        self._array = ts.open({"driver": "zarr3", "kvstore": spec.to_json(), "metadata": metadata},
                              create=True, delete_existing=True).result()
        self._buffer = np.empty(ZARR_SHARD_TOKENS, dtype)
        self._filled = self._offset = 0
        self._pending: list[Any] = []

    def write(self, data: np.ndarray) -> None:
        pos = 0
        while pos < data.size:
            take = min(ZARR_SHARD_TOKENS - self._filled, data.size - pos)
            self._buffer[self._filled:self._filled + take] = data[pos:pos + take]
            self._filled += take
            pos += take
            if self._filled == ZARR_SHARD_TOKENS:
                self._flush()

    def _flush(self) -> None:
        if self._filled:
            end = self._offset + self._filled
            self._pending.append(self._array[self._offset:end].write(self._buffer[:self._filled].copy()))
            self._offset, self._filled = end, 0
        while len(self._pending) > 4:
            self._pending.pop(0).result()

    def close(self) -> None:
        self._flush()
        for write in self._pending:
            write.result()
        self._array.resize(exclusive_max=[self._offset], shrink_only=True, resize_metadata_only=True).result()


def write_store(
    path: str | os.PathLike[str],
    docs_by_split: Mapping[str, Iterable[np.ndarray]],
    tokenizer: Tokenizer,
    sources: Sequence[Any],
    *,
    exist_ok: bool = False,
    format: str = "flat",
) -> TokenStore:
    """Write token documents (eod appended to each) as a store at ``path``; see ``build_store``."""
    if set(docs_by_split) != set(SPLITS):
        raise ValueError(f"docs_by_split must have exactly the splits {SPLITS}, got {sorted(docs_by_split)}")
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    eod = np.array([tokenizer.eod_id], dtype)
    documents = dict.fromkeys(SPLITS, 0)

    def chunks(split: str) -> Iterator[np.ndarray]:
        for doc in docs_by_split[split]:
            ids = np.asarray(doc)
            if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
                raise ValueError(f"a {split} document has token ids outside [0, {tokenizer.vocab_size})")
            documents[split] += 1
            yield np.concatenate([ids.astype(dtype), eod])

    return build_store(path, {s: chunks(s) for s in SPLITS}, tokenizer, sources, documents=documents,
                       exist_ok=exist_ok, format=format)


def build_store(
    location: str | os.PathLike[str],
    chunks_by_split: Mapping[str, Iterable[np.ndarray]],
    tokenizer: Tokenizer,
    sources: Sequence[Any],
    *,
    documents: Mapping[str, int],
    exist_ok: bool = False,
    format: str = "flat",
    extra_meta: Mapping[str, Any] | None = None,
) -> TokenStore:
    """Write a store from token chunks whose eod ids are already in place; ``documents`` (per split)
    is read after that split's chunks are consumed, so a generator may count as it goes.

    flat: built in a temporary directory beside the target and renamed into place, so a reader
    never sees a half-written store; if another process finishes the same store first, theirs is
    kept. zarr3: arrays first, ``meta.json`` last (it is the commit marker: without it there is no
    store), which works the same on a bucket. An existing store is an error unless ``exist_ok``.
    """
    if format not in FORMATS:
        raise UserError(f"Unknown store format {format!r}. Fix: use one of: {', '.join(FORMATS)}.")
    loc = normalize_location(location)
    if format == "flat" and is_remote(loc):
        raise UserError(f"Cannot write a flat token store to {loc}: flat stores are memory-mapped local "
                        "files. Fix: use --format zarr3 for a bucket, or a local path.")
    try:
        exists = _kvstore(loc).read(META_FILE).result().state == "value"
    except ValueError as err:
        raise UserError(f"Cannot reach {loc} to write a token store ({err}). Fix: choose a reachable, "
                        "writable location.") from None
    if exists:
        if exist_ok:
            return TokenStore.open(loc)
        raise UserError(f"A token store already exists at {loc}. Fix: delete it, or choose another path.")
    files = tokenizer.files() if hasattr(tokenizer, "files") else {}
    if format == "zarr3":
        kvstore = kvstore_spec(loc)
        meta = _write_splits(lambda split, dtype: _ZarrSink(kvstore / f"{split}/", dtype),
                             chunks_by_split, tokenizer, sources, documents, ZARR3_FORMAT, extra_meta)
        store = _kvstore(loc)
        for name, data in sorted(files.items()):
            store.write(name, data).result()
        store.write(META_FILE, _meta_bytes(meta)).result()
        return TokenStore.open(loc)
    path = Path(loc)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"Cannot create {path.parent} for a token store ({err}). Fix: choose a writable path.") from None
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        meta = _write_splits(lambda split, dtype: _FileSink(tmp / f"{split}.bin"),
                             chunks_by_split, tokenizer, sources, documents, FLAT_FORMAT, extra_meta)
        for name, data in sorted(files.items()):
            _write_durably(tmp / name, data)
        _write_durably(tmp / META_FILE, _meta_bytes(meta))
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
    open_sink: Callable[[str, np.dtype], _Sink],
    chunks_by_split: Mapping[str, Iterable[np.ndarray]],
    tokenizer: Tokenizer,
    sources: Sequence[Any],
    documents: Mapping[str, int],
    format: str,
    extra_meta: Mapping[str, Any] | None,
) -> dict[str, Any]:
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    digest = hashlib.sha256()
    splits: dict[str, dict[str, int]] = {}
    for split in SPLITS:  # in this order: the fingerprint covers them back to back
        sink = open_sink(split, dtype)
        tokens = 0
        for chunk in chunks_by_split[split]:
            data = np.ascontiguousarray(chunk, dtype=dtype)
            sink.write(data)
            digest.update(data.data)
            tokens += data.size
        sink.close()
        digest.update(f"|{split}:{tokens}|".encode())  # split boundaries are part of the identity
        splits[split] = {"tokens": tokens, "documents": int(documents[split])}
    meta: dict[str, Any] = {
        "format": format,
        "dtype": dtype.name,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": tokenizer.name,
        "eod_id": tokenizer.eod_id,
        "splits": splits,
        "sources": list(sources),
        "fingerprint": digest.hexdigest(),
    }
    if hasattr(tokenizer, "config"):
        meta["tokenizer_config"] = tokenizer.config()
    meta.update(extra_meta or {})
    return meta


def _meta_bytes(meta: Mapping[str, Any]) -> bytes:
    return json.dumps(meta, indent=1).encode()


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

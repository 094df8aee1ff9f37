"""The embedded default corpus: the Python standard library's own sources and docs.

Every Python installation ships it, so a fresh checkout can train on real text with no download.
The stdlib differs between Python versions; the store fingerprint records which one was used.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import os
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from runner.checkpoint.storage import cache_root
from runner.data.store import META_FILE, write_store
from runner.data.tokenizer import ByteTokenizer
from runner.errors import UserError

STORE_NAME = "stdlib-byte-v1"
DEFAULT_MAX_BYTES = 8 * 2**20  # a few seconds to prepare, ~8M byte tokens
VAL_ONE_IN = 50  # about 2% of documents go to validation ...
MIN_VAL_BYTES = 100 * 2**10  # ... but at least this much (or a tenth of a tiny corpus)
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
_TOPICS = "pydoc_data/topics.py"


@dataclass(frozen=True)
class Document:
    name: str  # relative path (for topics: "pydoc_data/topics.py#topic"); decides the split
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents(max_bytes: int = DEFAULT_MAX_BYTES, root: Path | None = None) -> list[Document]:
    """pydoc topic texts, then stdlib ``.py`` files by sorted path, until ``max_bytes`` (UTF-8)."""
    root = stdlib_root() if root is None else root
    docs: list[Document] = []
    total = 0
    for doc in _all_documents(root):
        size = len(doc.text.encode("utf-8"))
        if total + size > max_bytes:
            break
        docs.append(doc)
        total += size
    if len(docs) < 2:
        raise UserError(
            f"Found too little Python standard library text under {root} to build the default corpus "
            f"(max_bytes={max_bytes}). Fix: raise the byte cap, or set data.sources to a prepared token store."
        )
    return docs


def _all_documents(root: Path) -> Iterator[Document]:
    yield from _topic_documents(root / _TOPICS)
    for rel in _source_paths(root):
        if rel != _TOPICS:
            yield Document(rel, (root / rel).read_bytes().decode("utf-8", errors="replace"))


def _topic_documents(file: Path) -> Iterator[Document]:
    """The help texts of ``pydoc_data/topics.py`` (a literal dict), prose rather than code."""
    if not file.is_file():
        return
    for node in ast.parse(file.read_bytes()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "topics" for t in node.targets):
            topics = ast.literal_eval(node.value)
            for name in sorted(topics):
                yield Document(f"{_TOPICS}#{name}", topics[name])
            return


def _source_paths(root: Path) -> list[str]:
    """Sorted relative paths of stdlib ``.py`` files, minus third-party code, tests and venvs."""
    paths: list[str] = []
    for directory, subdirs, files in os.walk(root):
        if (Path(directory) / "pyvenv.cfg").exists():
            subdirs[:] = []
            continue
        subdirs[:] = [d for d in subdirs if d not in _SKIP_DIRS]
        rel_dir = Path(directory).relative_to(root)
        paths.extend(
            (rel_dir / f).as_posix()
            for f in files
            if f.endswith(".py") and not f.startswith("_sysconfigdata")  # build-machine specific
        )
    return sorted(paths)


def split_documents(docs: list[Document]) -> dict[str, list[Document]]:
    """Train/val by a stable hash of each document's name; val gets the lowest hashes.

    One in ``VAL_ONE_IN`` documents (by hash) is validation, topped up in hash order until it
    holds ``MIN_VAL_BYTES`` (a tenth of the corpus when that is smaller).
    """
    size = {d.name: len(d.text.encode("utf-8")) for d in docs}
    digest = {d.name: hashlib.sha1(d.name.encode()).hexdigest() for d in docs}
    min_val = min(MIN_VAL_BYTES, sum(size.values()) // 10)
    val_names = {name for name, h in digest.items() if int(h, 16) % VAL_ONE_IN == 0}
    val_bytes = sum(size[n] for n in val_names)
    by_hash = sorted(digest, key=digest.__getitem__)
    for name in by_hash:
        if val_names and val_bytes >= min_val:
            break
        if name not in val_names:
            val_names.add(name)
            val_bytes += size[name]
    if len(val_names) == len(docs):  # train must keep something
        val_names.discard(by_hash[-1])
    return {
        "train": [d for d in docs if d.name not in val_names],
        "val": [d for d in docs if d.name in val_names],
    }


def default_store(cache_dir: Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """The embedded corpus as a byte-token store, prepared on first use and then reused.

    Safe for several processes at once: one builds under a file lock, the rest wait and reuse it.
    """
    root = cache_root() if cache_dir is None else Path(cache_dir)
    name = STORE_NAME if max_bytes == DEFAULT_MAX_BYTES else f"{STORE_NAME}-cap{max_bytes}"
    path = root / name
    if (path / META_FILE).is_file():
        return path
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f"{name}.lock", "a")
    except OSError as err:
        raise UserError(
            f"Cannot create the data cache {root} ({err}). Fix: set RUNNER_CACHE to a writable directory."
        ) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (path / META_FILE).is_file():
            _prepare(path, max_bytes)
    return path


def _prepare(path: Path, max_bytes: int) -> None:
    tokenizer = ByteTokenizer()
    root = stdlib_root()
    docs = stdlib_documents(max_bytes, root)
    splits = split_documents(docs)
    source = {
        "kind": "python-stdlib",
        "python": platform.python_version(),
        "root": str(root),
        "max_bytes": max_bytes,
        "documents": len(docs),
    }
    write_store(
        path,
        {split: (tokenizer.encode(d.text) for d in split_docs) for split, split_docs in splits.items()},
        tokenizer,
        [source],
        exist_ok=True,
    )


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats/token) of the token frequencies: the loss of the best context-free model.

    A language model that learned anything beyond token frequencies must get below it.
    """
    counts = np.bincount(np.asarray(tokens).ravel(), minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())

"""Dataset strategies: what the model trains on, as a grain.MapDataset indexed by global row.

Element ``i`` of ``train(seq_len, seed)`` depends only on (strategy settings, seed, i). The loader
maps (step, micro-batch, row) to ``i``, so a batch is a pure function of the step: resuming needs
no iterator state and may change the number of hosts or devices.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import grain
import numpy as np

from runner.data.corpus import default_store
from runner.data.store import TokenStore
from runner.errors import ConfigError
from runner.registry import Registry

Example = dict[str, np.ndarray]  # {"x": int32[T], "y": int32[T], "mask": float32[T]}


class DatasetStrategy(Protocol):
    vocab_size: int
    fingerprint: str  # changes whenever the training data would change
    tokenizer: str | None  # name in runner.data.tokenizer.TOKENIZERS, None if not text

    def train(self, seq_len: int, seed: int) -> grain.MapDataset: ...

    def validation(self, seq_len: int, max_rows: int) -> dict[str, grain.MapDataset]: ...


DATASET_STRATEGIES: Registry[Any] = Registry("dataset strategy", "data.strategy")


def build_strategy(name: str, settings: Mapping[str, Any] | Any, key: str = "data") -> DatasetStrategy:
    """The strategy registered as ``name``, built from its settings (``key`` prefixes error keys).

    ``settings`` is either a raw mapping, whose every key must be a setting of this strategy (so
    typos are caught), or a typed spec dataclass such as the job's ``data`` section, whose field
    names the spec already checked; from it only the fields this strategy declares are taken.
    A registered (or imported) strategy is a class with ``SETTINGS`` and ``from_settings``.
    """
    cls = DATASET_STRATEGIES.get(name)
    if dataclasses.is_dataclass(settings) and not isinstance(settings, type):
        fields = dataclasses.asdict(settings)
        settings = {k: v for k, v in fields.items() if k in getattr(cls, "SETTINGS", fields)}
    if not isinstance(settings, Mapping):
        raise ConfigError(key, settings, "dataset strategy settings must be a mapping.", "write them as key: value pairs.")
    return cls.from_settings(settings, key)


def derive_seed(*parts: object, bits: int = 32) -> int:
    """A well-mixed seed from any parts; unrelated for neighbouring inputs (seed 1 vs seed 2)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**bits


def example_from_window(window: np.ndarray) -> Example:
    """seq_len+1 tokens -> inputs, next-token targets and a mask (every target is a real token)."""
    window = np.asarray(window, dtype=np.int32)
    return {"x": window[:-1], "y": window[1:], "mask": np.ones(len(window) - 1, np.float32)}


def _check_keys(settings: Mapping[str, Any], allowed: Sequence[str], key: str) -> None:
    for name in settings:
        if name not in allowed:
            raise ConfigError(
                f"{key}.{name}", settings[name], "is not a setting of this dataset strategy.",
                f"remove it; the known settings are: {', '.join(allowed)}.",
            )


# ----------------------------------------------------------------------------- mixture


@dataclass(frozen=True)
class Windows:
    """Window ``j`` of a token array: tokens [j*T, j*T + T + 1) as an example (stride T)."""

    tokens: np.ndarray
    seq_len: int

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __call__(self, j: int) -> Example:
        start = int(j) * self.seq_len
        return example_from_window(self.tokens[start : start + self.seq_len + 1])


@dataclass(frozen=True)
class Source:
    name: str
    store: TokenStore
    weight: float  # 0 means validation only
    key: str  # config key of this source, e.g. "data.sources[0]"


@DATASET_STRATEGIES.register("mixture")
class MixtureStrategy:
    """Token stores mixed by weight; each store is reshuffled every epoch and repeats forever.

    Shuffling is grain's index_shuffle permutation with the epoch folded into the seed, so each
    epoch visits every window exactly once; mixing is grain's deterministic proportional mix.
    """

    SETTINGS = ("sources",)
    SOURCE_SETTINGS = ("name", "path", "weight")

    def __init__(self, sources: Sequence[Source]) -> None:
        self.sources = tuple(sources)
        first = self.sources[0]
        self.vocab_size = first.store.vocab_size
        self.tokenizer: str | None = first.store.tokenizer
        for src in self.sources[1:]:
            if (src.store.tokenizer, src.store.vocab_size) != (self.tokenizer, self.vocab_size):
                raise ConfigError(
                    f"{src.key}.path", str(src.store.path),
                    f"its store uses tokenizer {src.store.tokenizer!r} (vocab {src.store.vocab_size}) but "
                    f"{first.key} uses {self.tokenizer!r} (vocab {self.vocab_size}).",
                    "mix only stores prepared with the same tokenizer.",
                )
        self.fingerprint = hashlib.sha256(
            json.dumps(
                {
                    "strategy": "mixture",
                    "tokenizer": self.tokenizer,
                    "sources": [[s.name, s.store.fingerprint, s.weight] for s in self.sources],
                }
            ).encode()
        ).hexdigest()

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], key: str = "data") -> MixtureStrategy:
        _check_keys(settings, cls.SETTINGS, key)
        entries = settings.get("sources", [{"path": "default"}])
        if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence) or not entries:
            raise ConfigError(
                f"{key}.sources", entries, "must be a non-empty list of sources.",
                "write e.g. `sources: [{path: default, weight: 1}]`.",
            )
        sources = [_parse_source(entry, f"{key}.sources[{i}]") for i, entry in enumerate(entries)]
        names = [s.name for s in sources]
        for i, src in enumerate(sources):
            if names.index(src.name) != i:
                raise ConfigError(
                    f"{src.key}.name", src.name, "another source already has this name.",
                    "give each source a distinct `name`.",
                )
        if not any(s.weight > 0 for s in sources):
            raise ConfigError(
                f"{key}.sources", [s.weight for s in sources], "all source weights are zero, nothing to train on.",
                "give at least one source a positive weight.",
            )
        for src in sources:
            if src.weight > 0 and len(src.store.tokens("train")) == 0:
                raise ConfigError(
                    f"{src.key}.path", str(src.store.path), "its train split is empty.",
                    "prepare the store with training documents, or give it weight 0.",
                )
        return cls(sources)

    def train(self, seq_len: int, seed: int) -> grain.MapDataset:
        parts, weights = [], []
        for src in self.sources:
            if src.weight <= 0:
                continue
            windows = self._windows(src, "train", seq_len)
            shuffle_seed = derive_seed("mixture/train", int(seed), src.name)
            parts.append(grain.MapDataset.range(len(windows)).shuffle(seed=shuffle_seed).repeat().map(windows))
            weights.append(src.weight)
        return parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, weights)

    def validation(self, seq_len: int, max_rows: int) -> dict[str, grain.MapDataset]:
        """The first ``max_rows`` windows of each source's val split, always in the same order."""
        out = {}
        for src in self.sources:
            windows = self._windows(src, "val", seq_len)
            out[src.name] = grain.MapDataset.range(min(max_rows, len(windows))).map(windows)
        return out

    @staticmethod
    def _windows(src: Source, split: str, seq_len: int) -> Windows:
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        windows = Windows(src.store.tokens(split), seq_len)
        if len(windows) == 0:
            raise ConfigError(
                f"{src.key}.path", str(src.store.path),
                f"its {split} split has {len(windows.tokens)} tokens, too few for one window of "
                f"seq_len+1={seq_len + 1} tokens.",
                "use a shorter seq_len or a larger store.",
            )
        return windows


def _parse_source(entry: Any, key: str) -> Source:
    if isinstance(entry, (str, bytes)) or not isinstance(entry, Mapping):
        raise ConfigError(key, entry, "a source must be a mapping.", "write e.g. `{path: default, weight: 1}`.")
    _check_keys(entry, MixtureStrategy.SOURCE_SETTINGS, key)
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
        raise ConfigError(
            f"{key}.weight", weight, "must be a finite number >= 0.",
            "use a relative weight such as 1 or 0.25 (0 means validation only).",
        )
    raw = entry.get("path")
    if raw is not None and not isinstance(raw, (str, Path)):
        raise ConfigError(f"{key}.path", raw, "must be a directory path.", "give the path of a prepared token store.")
    if raw in (None, "", "default"):
        path, default_name = default_store(), "stdlib"
    else:
        path = Path(raw).expanduser()
        default_name = path.name
        if not (path / "meta.json").is_file():
            raise ConfigError(
                f"{key}.path", str(raw), f"there is no token store at {path.resolve()}.",
                "prepare one there (runner.data.store.write_store), fix the path, or use `default` for the "
                "embedded corpus.",
            )
    name = entry.get("name") or default_name
    if not isinstance(name, str):
        raise ConfigError(f"{key}.name", name, "must be a string.", "name the source, e.g. `name: web`.")
    return Source(name=name, store=TokenStore.open(path), weight=float(weight), key=key)


# ----------------------------------------------------------------------------- synthetic


@dataclass(frozen=True)
class RandomRows:
    """Row ``i``: uniform random tokens from a generator seeded by (seed, i) alone."""

    vocab_size: int
    seq_len: int
    seed: int

    def __call__(self, i: int) -> Example:
        rng = np.random.default_rng([self.seed, int(i)])
        return example_from_window(rng.integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int32))


@DATASET_STRATEGIES.register("synthetic")
class SyntheticStrategy:
    """Random tokens at full speed: for throughput tests and runs that must not touch disk."""

    SETTINGS = ("vocab_size",)
    tokenizer: str | None = None

    def __init__(self, vocab_size: int = 257) -> None:
        self.vocab_size = vocab_size
        self.fingerprint = hashlib.sha256(
            json.dumps({"strategy": "synthetic", "vocab_size": vocab_size}).encode()
        ).hexdigest()

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], key: str = "data") -> SyntheticStrategy:
        _check_keys(settings, cls.SETTINGS, key)
        vocab_size = settings.get("vocab_size", 257)
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 2 <= vocab_size <= 2**31 - 1:
            raise ConfigError(
                f"{key}.vocab_size", vocab_size, "must be an integer of at least 2.", "use e.g. 257 or 32000."
            )
        return cls(vocab_size)

    def train(self, seq_len: int, seed: int) -> grain.MapDataset:
        rows = RandomRows(self.vocab_size, seq_len, derive_seed("synthetic/train", int(seed), bits=63))
        return grain.MapDataset.range(sys.maxsize).map(rows)

    def validation(self, seq_len: int, max_rows: int) -> dict[str, grain.MapDataset]:
        rows = RandomRows(self.vocab_size, seq_len, derive_seed("synthetic/val", bits=63))
        return {"synthetic": grain.MapDataset.range(max_rows).map(rows)}

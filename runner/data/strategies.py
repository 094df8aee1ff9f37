"""Dataset strategies: what the model trains on, as a grain.MapDataset indexed by global row.

Element ``i`` of ``train(seq_len, seed, global_batch)`` depends only on (strategy settings, seed,
global_batch, i). The loader maps (step, micro-batch, row) to ``i = step * global_batch + ...``,
so a batch is a pure function of the step: resuming needs no iterator state and may change the
number of hosts or devices.

* ``mixture``: token stores mixed by weight, exactly per block of rows (see ``MixtureStrategy``).
* ``sequential``: stages of mixtures that take over at given steps (curricula, annealing).
* ``synthetic``: random tokens, for throughput tests.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import math
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import grain
import numpy as np

# The interleaving grain's own `MapDataset.mix` uses; called directly because `mix` first rescales
# the weights to integers with the smallest at 100 and truncates the rest (3:7 becomes 100:233),
# which breaks "exactly these proportions". Pinned grain version; tests check the proportions.
from grain._src.python.dataset.transformations.mix import _dataset_and_key_of_next_element

from runner.data.corpus import default_store
from runner.data.store import MissingStoreError, TokenStore, normalize_location
from runner.errors import ConfigError
from runner.registry import Registry

Example = dict[str, np.ndarray]  # {"x": int32[T], "y": int32[T], "mask": float32[T]}


class DatasetStrategy(Protocol):
    vocab_size: int
    fingerprint: str  # changes whenever the training data would change
    tokenizer: str | None  # name in runner.data.tokenizer.TOKENIZERS, None if not text
    eod_id: int | None  # the end-of-document token, None if the rows are not documents

    def train(self, seq_len: int, seed: int, global_batch: int | None = None) -> grain.MapDataset:
        """Row ``i`` of the training data. ``global_batch`` (rows per optimizer step) lets a
        strategy act on step boundaries (``sequential``); strategies that do not need it ignore it."""
        ...

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


def integer_proportions(weights: Sequence[float]) -> tuple[int, ...]:
    """Positive weights as the smallest whole numbers in the same ratio.

    Each weight is read as the nearest fraction with a denominator of at most 10**6, so weights
    written with up to six decimals (0.3, 0.25, 1/3 as 0.333333...) are taken exactly.
    """
    fractions = [Fraction(w).limit_denominator(10**6) for w in weights]
    scale = math.lcm(*(f.denominator for f in fractions))
    ints = [int(f * scale) for f in fractions]
    common = math.gcd(*ints)
    return tuple(i // common for i in ints)


@dataclass(frozen=True)
class ExactMix(grain.transforms.DatasetSelectionMap):
    """Row ``k`` -> (source, row within source) with exact integer proportions.

    Among rows ``[0, k)`` source ``j`` gets ``ceil``-rounded shares of ``k * p_j / sum(p)``, so
    every aligned block of ``sum(p)`` rows holds exactly ``p_j`` rows of source ``j``.
    """

    proportions: tuple[int, ...]

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, k: int) -> tuple[int, int]:
        return _dataset_and_key_of_next_element(int(k), self.proportions)


@DATASET_STRATEGIES.register("mixture")
class MixtureStrategy:
    """Token stores mixed by weight; each store is reshuffled every epoch and repeats forever.

    Shuffling is grain's index_shuffle permutation with the epoch folded into the seed, so each
    epoch visits every window exactly once. Mixing is exact per block: the positive weights are
    reduced to the smallest integers in the same ratio (``integer_proportions``: 3:1 -> 3, 1;
    0.3:0.7 -> 3, 7), and every block of ``block_rows = sum`` of them consecutive rows, counted
    from row 0, holds exactly that many windows of each source. A block of batches is therefore
    ``lcm(block_rows, global_batch) / global_batch`` steps (``block_steps``); 3:1 at batch 256 is
    one step, 0.3:0.7 at batch 256 five steps.
    """

    SETTINGS = ("sources",)
    SOURCE_SETTINGS = ("name", "path", "weight")

    def __init__(self, sources: Sequence[Source]) -> None:
        self.sources = tuple(sources)
        first = self.sources[0]
        self.vocab_size = first.store.vocab_size
        self.tokenizer: str | None = first.store.tokenizer
        self.eod_id: int | None = first.store.eod_id
        check_same_tokenizer(self.sources)
        self.proportions = integer_proportions([s.weight for s in self.sources if s.weight > 0])
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

    @property
    def block_rows(self) -> int:
        """Rows per block that holds exactly the configured proportions."""
        return sum(self.proportions)

    def block_steps(self, global_batch: int) -> int:
        """Steps per block of batches that holds exactly the configured proportions."""
        return math.lcm(self.block_rows, global_batch) // global_batch

    def train(self, seq_len: int, seed: int, global_batch: int | None = None) -> grain.MapDataset:
        parts = []
        for src in self.sources:
            if src.weight <= 0:
                continue
            windows = self._windows(src, "train", seq_len)
            shuffle_seed = derive_seed("mixture/train", int(seed), src.name)
            parts.append(grain.MapDataset.range(len(windows)).shuffle(seed=shuffle_seed).repeat().map(windows))
        if len(parts) == 1:
            return parts[0]
        return grain.MapDataset.select_from_datasets(parts, ExactMix(self.proportions))

    def validation(self, seq_len: int, max_rows: int) -> dict[str, grain.MapDataset]:
        """The first ``max_rows`` windows of each source's val split, always in the same order.

        A store prepared without validation documents (an empty val split) gives no rows, and the
        evaluators skip it.
        """
        out = {}
        for src in self.sources:
            if len(src.store.tokens("val")) == 0:
                out[src.name] = grain.MapDataset.range(0)
                continue
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
                f"{src.key}.path", src.store.location,
                f"its {split} split has {len(windows.tokens)} tokens, too few for one window of "
                f"seq_len+1={seq_len + 1} tokens (train.seq_len={seq_len}).",
                f"use a train.seq_len below {max(len(windows.tokens) - 1, 1)}, or a larger store.",
            )
        return windows


def check_same_tokenizer(sources: Sequence[Source]) -> None:
    """Token ids only mean the same across stores prepared with the same tokenizer."""
    first = sources[0]
    for src in sources[1:]:
        if (src.store.tokenizer_id, src.store.vocab_size) != (first.store.tokenizer_id, first.store.vocab_size):
            raise ConfigError(
                f"{src.key}.path", src.store.location,
                f"its store uses tokenizer {src.store.tokenizer_id!r} (vocab {src.store.vocab_size}) but "
                f"{first.key} uses {first.store.tokenizer_id!r} (vocab {first.store.vocab_size}).",
                "mix only stores prepared with the same tokenizer.",
            )


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
        raise ConfigError(f"{key}.path", raw, "must be a directory path or a URL.",
                          "give the location of a prepared token store.")
    if raw in (None, "", "default"):
        store, default_name = TokenStore.open(default_store()), "stdlib"
    else:
        try:
            store = TokenStore.open(raw)
        except MissingStoreError:
            raise ConfigError(
                f"{key}.path", str(raw), f"there is no token store at {normalize_location(raw)}.",
                "prepare one there (`python -m runner.data.prepare INPUT... --output PATH`), fix the path, "
                "or use `default` for the embedded corpus.",
            ) from None
        default_name = store.name
    name = entry.get("name") or default_name
    if not isinstance(name, str):
        raise ConfigError(f"{key}.name", name, "must be a string.", "name the source, e.g. `name: web`.")
    return Source(name=name, store=store, weight=float(weight), key=key)


# ----------------------------------------------------------------------------- sequential


@dataclass(frozen=True)
class StageRows(grain.transforms.DatasetSelectionMap):
    """Global row ``k`` -> (stage, row within the stage); stage ``i`` starts at row ``starts[i]``."""

    starts: tuple[int, ...]

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, k: int) -> tuple[int, int]:
        stage = bisect.bisect_right(self.starts, int(k)) - 1
        return stage, int(k) - self.starts[stage]


@dataclass(frozen=True)
class Stage:
    until_step: int | None  # None: to the end of training
    mixture: MixtureStrategy


@DATASET_STRATEGIES.register("sequential")
class SequentialStrategy:
    """Stages that take over at given steps: curricula, annealing on better data, switching stores.

    ``stages=[{until_step: 1000, sources: [...]}, {sources: [...]}]``: stage ``i`` trains steps
    ``[until_step of stage i-1, until_step of stage i)``; the last one has no ``until_step`` and
    runs to the end. Each stage is a ``mixture`` of its own sources and weights (exact per block,
    counted from the stage's first row). Stage boundaries are global rows ``step * global_batch``,
    so every step's batch comes from one stage and is a pure function of (seed, settings, step).
    Each stage shuffles its stores with a seed of its own and starts their epochs afresh.
    Validation covers every source of every stage once (by name).
    """

    SETTINGS = ("stages",)
    STAGE_SETTINGS = ("until_step", "sources")

    def __init__(self, stages: Sequence[Stage]) -> None:
        self.stages = tuple(stages)
        sources = [src for stage in self.stages for src in stage.mixture.sources]
        check_same_tokenizer(sources)
        self.vocab_size = sources[0].store.vocab_size
        self.tokenizer: str | None = sources[0].store.tokenizer
        self.eod_id: int | None = sources[0].store.eod_id
        self.fingerprint = hashlib.sha256(
            json.dumps(
                {
                    "strategy": "sequential",
                    "stages": [[stage.until_step, stage.mixture.fingerprint] for stage in self.stages],
                }
            ).encode()
        ).hexdigest()

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], key: str = "data") -> SequentialStrategy:
        _check_keys(settings, cls.SETTINGS, key)
        entries = settings.get("stages")
        example = "write e.g. `data.stages=[{until_step: 1000, sources: [{path: a}]}, {sources: [{path: b}]}]`."
        if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence) or not entries:
            raise ConfigError(f"{key}.stages", entries, "the sequential strategy needs a non-empty list of stages.",
                              example)
        stages: list[Stage] = []
        previous = 0
        for i, entry in enumerate(entries):
            stage_key = f"{key}.stages[{i}]"
            if isinstance(entry, (str, bytes)) or not isinstance(entry, Mapping):
                raise ConfigError(stage_key, entry, "a stage must be a mapping.", example)
            _check_keys(entry, cls.STAGE_SETTINGS, stage_key)
            until = entry.get("until_step")
            last = i == len(entries) - 1
            if last and until is not None:
                raise ConfigError(f"{stage_key}.until_step", until, "the last stage runs to the end of training.",
                                  "remove its until_step (or add a stage after it).")
            if not last and (isinstance(until, bool) or not isinstance(until, int) or until <= previous):
                raise ConfigError(
                    f"{stage_key}.until_step", until,
                    f"every stage but the last needs a whole-number until_step above the previous one ({previous}).",
                    f"set it to the step where stage {i + 1} should take over.",
                )
            mixture = MixtureStrategy.from_settings({"sources": entry.get("sources")}, stage_key)
            stages.append(Stage(until, mixture))
            previous = until if until is not None else previous
        by_name: dict[str, Source] = {}
        for stage in stages:
            for src in stage.mixture.sources:
                seen = by_name.setdefault(src.name, src)
                if seen.store.location != src.store.location:
                    raise ConfigError(
                        f"{src.key}.name", src.name,
                        f"{seen.key} already uses this name for another store ({seen.store.location}).",
                        "give different stores different names (the name labels validation metrics).",
                    )
        return cls(stages)

    def stage_at(self, step: int) -> int:
        """The stage that trains ``step``."""
        return bisect.bisect_right([s.until_step for s in self.stages[:-1]], step)

    def train(self, seq_len: int, seed: int, global_batch: int | None = None) -> grain.MapDataset:
        parts = [stage.mixture.train(seq_len, derive_seed("sequential/stage", int(seed), i))
                 for i, stage in enumerate(self.stages)]
        if len(parts) == 1:
            return parts[0]
        if global_batch is None or global_batch < 1:
            raise ValueError("the sequential strategy needs global_batch (rows per step) to place its stages")
        starts = (0, *(stage.until_step * global_batch for stage in self.stages[:-1]))  # type: ignore[operator]
        return grain.MapDataset.select_from_datasets(parts, StageRows(starts))

    def validation(self, seq_len: int, max_rows: int) -> dict[str, grain.MapDataset]:
        out: dict[str, grain.MapDataset] = {}
        for stage in self.stages:
            for name, dataset in stage.mixture.validation(seq_len, max_rows).items():
                out.setdefault(name, dataset)
        return out


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
    eod_id: int | None = None  # random tokens: no documents

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

    def train(self, seq_len: int, seed: int, global_batch: int | None = None) -> grain.MapDataset:
        rows = RandomRows(self.vocab_size, seq_len, derive_seed("synthetic/train", int(seed), bits=63))
        return grain.MapDataset.range(sys.maxsize).map(rows)

    def validation(self, seq_len: int, max_rows: int) -> dict[str, grain.MapDataset]:
        rows = RandomRows(self.vocab_size, seq_len, derive_seed("synthetic/val", bits=63))
        return {"synthetic": grain.MapDataset.range(max_rows).map(rows)}


def check_spec(spec: Any) -> None:
    """The data section: a known strategy, and sources for a mixture."""
    DATASET_STRATEGIES.get(spec.data.strategy)
    if not spec.data.sources and spec.data.strategy == "mixture":
        raise ConfigError("data.sources", [], "a mixture needs at least one source.",
                          "list sources, e.g. data.sources=[{path: default}].")

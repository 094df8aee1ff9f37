"""Data pipeline: tokenizer, token store, embedded corpus, strategies and the step-pure loader."""

from __future__ import annotations

import json
import math
import multiprocessing
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from runner.data import store as store_module
from runner.data.corpus import default_store, unigram_entropy
from runner.data.loader import BatchLoader
from runner.data.store import TokenStore, write_store
from runner.data.strategies import DATASET_STRATEGIES, DatasetStrategy, build_strategy
from runner.data.tokenizer import TOKENIZERS, ByteTokenizer
from runner.errors import ConfigError, UserError


@dataclass(frozen=True)
class IdTokenizer:
    """Stand-in tokenizer with a 16-bit vocabulary, so test tokens can encode their own position."""

    name: str = "ids16"
    vocab_size: int = 2**16
    eod_id: int = 2**16 - 1


def make_store(path: Path, train: list[np.ndarray], val: list[np.ndarray] | None = None) -> Path:
    val = [np.arange(100, dtype=np.int64)] if val is None else val
    write_store(path, {"train": train, "val": val}, IdTokenizer(), [{"kind": "test"}])
    return path


def mixture(*sources: tuple[Path | str, float]) -> DatasetStrategy:
    return build_strategy("mixture", {"sources": [{"path": str(p), "weight": w} for p, w in sources]})


def same_batch(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- tokenizer


def test_byte_tokenizer_round_trip() -> None:
    tok = TOKENIZERS.get("byte")()
    text = "def f(x):\n    return 'héllo ✓'\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint16 and ids.max() < 256
    assert tok.decode(ids) == text
    assert tok.decode(np.concatenate([ids, [tok.eod_id]])) == text  # eod is dropped
    assert (tok.name, tok.vocab_size, tok.eod_id) == ("byte", 257, 256)
    assert tok.decode(np.array([104, 999, 105])) == "h\ufffdi"


# ----------------------------------------------------------------------------- store


def test_store_write_open_and_fingerprint(tmp_path: Path) -> None:
    docs = [np.array([1, 2, 3]), np.array([4, 5])]
    make_store(tmp_path / "a", docs)
    st = TokenStore.open(tmp_path / "a")
    eod = IdTokenizer.eod_id
    assert st.tokens("train").tolist() == [1, 2, 3, eod, 4, 5, eod]
    assert st.tokens("val").tolist() == list(range(100)) + [eod]
    meta = json.loads((tmp_path / "a" / "meta.json").read_text())
    assert meta["format"] == "runner-flat-v1" and meta["dtype"] == "uint16"
    assert meta["splits"]["train"] == {"tokens": 7, "documents": 2}
    assert st.vocab_size == 2**16 and st.tokenizer == "ids16" and st.eod_id == eod
    # Same tokens -> same fingerprint; different tokens or a moved split boundary -> different.
    assert TokenStore.open(make_store(tmp_path / "b", docs)).fingerprint == st.fingerprint
    assert TokenStore.open(make_store(tmp_path / "c", docs[:1])).fingerprint != st.fingerprint
    assert len(st.fingerprint) == 64
    with pytest.raises(UserError, match="already exists"):
        make_store(tmp_path / "a", docs)


def test_store_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no token store at .*nowhere.*prepare one"):
        TokenStore.open(tmp_path / "nowhere")
    path = make_store(tmp_path / "s", [np.arange(50)])
    with open(path / "train.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(UserError, match="Corrupt token store .*train.bin has 10 bytes"):
        TokenStore.open(path)


def test_write_store_keeps_a_concurrent_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """If another process renames its store into place while we write, theirs is kept."""
    target = tmp_path / "race"
    real_write = store_module._write_splits

    def write_then_lose(*args, **kwargs):  # type: ignore[no-untyped-def]
        meta = real_write(*args, **kwargs)
        monkeypatch.setattr(store_module, "_write_splits", real_write)
        make_store(target, [np.array([9, 9, 9])])  # the "other process" finishes first
        return meta

    monkeypatch.setattr(store_module, "_write_splits", write_then_lose)
    kept = write_store(target, {"train": [np.array([1])], "val": [np.array([2])]}, IdTokenizer(), [])
    assert kept.tokens("train").tolist() == [9, 9, 9, IdTokenizer.eod_id]
    assert [p.name for p in tmp_path.iterdir()] == ["race"]  # our temp dir is gone


# ----------------------------------------------------------------------------- corpus


def test_default_store_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))
    path = default_store(max_bytes=300_000)
    assert path.parent == tmp_path
    st = TokenStore.open(path)
    train, val = st.tokens("train"), st.tokens("val")
    assert st.tokenizer == "byte" and st.vocab_size == 257
    assert len(train) > len(val) >= 30_000  # val holds at least a tenth of a small corpus
    documents = sum(split["documents"] for split in st.meta["splits"].values())
    assert len(train) + len(val) <= 300_000 + documents  # the byte cap, plus one eod per document
    mtime = (path / "meta.json").stat().st_mtime_ns
    assert default_store(max_bytes=300_000) == path
    assert (path / "meta.json").stat().st_mtime_ns == mtime
    assert TokenStore.open(path).fingerprint == st.fingerprint
    text = ByteTokenizer().decode(np.asarray(train[:2000]))
    assert "\ufffd" not in text and len(text.split()) > 50  # real text


@pytest.mark.e2e
def test_default_store_is_safe_for_concurrent_processes(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        paths = pool.starmap(default_store, [(tmp_path, 200_000)] * 3)
    assert len(set(paths)) == 1
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [paths[0].name]
    TokenStore.open(paths[0])


def test_unigram_entropy() -> None:
    assert unigram_entropy(np.arange(8).repeat(5), 257) == pytest.approx(math.log(8))
    assert unigram_entropy(np.zeros(10, np.int64), 4) == 0.0


def test_default_corpus_through_the_mixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path))
    strategy = build_strategy("mixture", {})  # no sources: the embedded corpus
    assert (strategy.vocab_size, strategy.tokenizer) == (257, "byte")
    ex = strategy.train(128, seed=0)[0]
    assert ex["x"].shape == (128,) and ex["x"].dtype == np.int32 and ex["mask"].dtype == np.float32
    assert np.array_equal(ex["x"][1:], ex["y"][:-1]) and ex["mask"].sum() == 128
    val = strategy.validation(128, max_rows=64)
    assert list(val) == ["stdlib"] and len(val["stdlib"]) == 64
    train_tokens = TokenStore.open(tmp_path / "stdlib-byte-v1").tokens("train")
    assert 2.0 < unigram_entropy(train_tokens, 257) < math.log(257)


# ----------------------------------------------------------------------------- mixture + loader


@pytest.fixture
def numbered(tmp_path: Path) -> Path:
    """A store of 50 windows of seq_len 4 whose window j starts with token 4*j."""
    return make_store(tmp_path / "numbered", [np.arange(200)], [np.arange(1000, 1041)])


def test_batches_are_pure_functions_of_the_step(numbered: Path) -> None:
    layout = dict(global_batch=8, accumulate_steps=2)
    a = BatchLoader(mixture((numbered, 1)).train(4, seed=7), start_step=0, **layout)
    b = BatchLoader(mixture((numbered, 1)).train(4, seed=7), start_step=5, **layout)
    for step in (0, 3, 11, 1000):
        assert same_batch(a.batch_at(step), b.batch_at(step))
    assert [same_batch(next(b), b.batch_at(s)) for s in (5, 6)] == [True, True]
    assert b.next_step == 7 and b.wait_seconds >= 0
    # batch_at agrees with reading the dataset's global rows one by one.
    ds = mixture((numbered, 1)).train(4, seed=7)
    rows = a.global_rows(6)
    assert rows.tolist() == [[48, 49, 50, 51], [52, 53, 54, 55]]
    direct = np.stack([ds[int(r)]["x"] for r in rows.ravel()]).reshape(2, 4, 4)
    assert np.array_equal(a.batch_at(6)["x"], direct)
    other_seed = BatchLoader(mixture((numbered, 1)).train(4, seed=8), start_step=0, **layout)
    assert not same_batch(a.batch_at(0), other_seed.batch_at(0))
    for loader in (a, b, other_seed):
        loader.close()


def test_host_sharding_and_accumulation_do_not_change_the_global_batch(numbered: Path) -> None:
    ds = mixture((numbered, 1)).train(4, seed=3)
    whole = BatchLoader(ds, global_batch=8, accumulate_steps=2, start_step=0)
    hosts = [
        BatchLoader(ds, global_batch=8, accumulate_steps=2, start_step=2, process_index=p, process_count=2)
        for p in range(2)
    ]
    single_micro = BatchLoader(ds, global_batch=8, accumulate_steps=1, start_step=0)
    for step in (2, 3, 77):
        shards = [h.batch_at(step) for h in hosts]
        assert shards[0]["x"].shape == (2, 2, 4)
        joined = {k: np.concatenate([s[k] for s in shards], axis=1) for k in shards[0]}
        assert same_batch(joined, whole.batch_at(step))
        flat = {k: v.reshape(8, 4) for k, v in whole.batch_at(step).items()}
        assert same_batch(flat, {k: v.reshape(8, 4) for k, v in single_micro.batch_at(step).items()})
    assert same_batch(next(hosts[1]), hosts[1].batch_at(2))
    for loader in (whole, single_micro, *hosts):
        loader.close()


def test_each_epoch_is_a_fresh_permutation(numbered: Path) -> None:
    ds = mixture((numbered, 1)).train(4, seed=0)
    order = [int(ds[i]["x"][0]) // 4 for i in range(150)]
    epochs = [order[0:50], order[50:100], order[100:150]]
    for epoch in epochs:
        assert sorted(epoch) == list(range(50))
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != list(range(50))


def test_validation_is_the_first_windows_in_fixed_order(numbered: Path) -> None:
    strategy = mixture((numbered, 1))
    val = strategy.validation(4, max_rows=100)["numbered"]
    assert len(val) == 10  # 41 val tokens + eod = 42 -> 10 windows of 4+1 at stride 4
    assert [int(val[j]["x"][0]) for j in range(10)] == list(range(1000, 1040, 4))
    assert len(strategy.validation(4, max_rows=3)["numbered"]) == 3


def test_mixture_proportions(tmp_path: Path) -> None:
    """grain's mix scales weights to integers (smallest -> 100) and is exact per block of their sum."""
    low = make_store(tmp_path / "low", [np.arange(0, 4000)])
    high = make_store(tmp_path / "high", [np.arange(30000, 34000)])
    strategy = mixture((low, 3), (high, 1))
    ds = strategy.train(4, seed=1)
    from_low = np.array([ds[i]["x"][0] < 30000 for i in range(4000)])
    assert from_low.sum() == 3000
    assert (from_low.reshape(-1, 400).sum(axis=1) == 300).all()  # every block of 300+100 rows
    assert (from_low.reshape(-1, 4).sum(axis=1) == 3).all()  # and, for 3:1, every block of 4
    assert set(strategy.validation(4, 2)) == {"low", "high"}


def test_zero_weight_source_is_validation_only(tmp_path: Path) -> None:
    low = make_store(tmp_path / "low", [np.arange(0, 400)])
    high = make_store(tmp_path / "high", [np.arange(30000, 30400)])
    strategy = mixture((low, 1), (high, 0))
    ds = strategy.train(4, seed=1)
    assert all(ds[i]["x"][0] < 30000 for i in range(300))
    assert set(strategy.validation(4, 2)) == {"low", "high"}


def test_fingerprint_tracks_data_and_weights(tmp_path: Path, numbered: Path) -> None:
    other = make_store(tmp_path / "other", [np.arange(300)])
    base = mixture((numbered, 1), (other, 1)).fingerprint
    assert mixture((numbered, 1), (other, 1)).fingerprint == base
    assert mixture((numbered, 2), (other, 1)).fingerprint != base
    assert mixture((numbered, 1)).fingerprint != base


def test_synthetic_is_deterministic() -> None:
    a = build_strategy("synthetic", {"vocab_size": 100})
    b = build_strategy("synthetic", {"vocab_size": 100})
    assert a.fingerprint == b.fingerprint and a.vocab_size == 100
    rows_a = [a.train(16, seed=1)[i] for i in (0, 5, 10**12)]
    rows_b = [b.train(16, seed=1)[i] for i in (0, 5, 10**12)]
    assert all(same_batch(x, y) for x, y in zip(rows_a, rows_b))
    assert not same_batch(a.train(16, seed=2)[0], rows_a[0])
    assert not same_batch(a.train(16, seed=1)[1], rows_a[0])
    assert all(0 <= r["x"].min() and r["x"].max() < 100 and np.array_equal(r["x"][1:], r["y"][:-1]) for r in rows_a)
    val = a.validation(16, max_rows=4)["synthetic"]
    assert len(val) == 4 and same_batch(val[2], b.validation(16, 4)["synthetic"][2])
    assert not same_batch(val[0], rows_a[0])
    loader = BatchLoader(a.train(16, seed=1), global_batch=4, accumulate_steps=1, start_step=3)
    assert same_batch(next(loader), loader.batch_at(3))
    loader.close()


@dataclass(frozen=True)
class SourceSection:
    name: str = ""
    path: str = "default"
    weight: float = 1.0


@dataclass(frozen=True)
class DataSection:
    """Shaped like a job spec's typed ``data`` section: strategy settings plus loader settings."""

    strategy: str = "mixture"
    sources: tuple[SourceSection, ...] = ()
    prefetch: int = 2


def test_typed_spec_sections_give_each_strategy_its_own_fields(numbered: Path) -> None:
    section = DataSection(sources=(SourceSection(path=str(numbered), weight=2.0),))
    assert build_strategy("mixture", section).fingerprint == mixture((numbered, 2)).fingerprint
    assert build_strategy("synthetic", section).vocab_size == 257  # sources/prefetch are not its business
    with pytest.raises(ConfigError, match="data.prefetch"):  # a raw mapping is checked strictly
        build_strategy("mixture", {"sources": [{"path": str(numbered)}], "prefetch": 2})


# ----------------------------------------------------------------------------- errors


def test_config_errors_name_the_key(tmp_path: Path, numbered: Path) -> None:
    def key_of(settings: dict, name: str = "mixture") -> str:
        with pytest.raises(ConfigError) as err:
            build_strategy(name, settings)
        return err.value.key

    assert key_of({"sources": [{"path": str(tmp_path / "missing")}]}) == "data.sources[0].path"
    assert key_of({"sources": [{"path": str(numbered), "weight": 0}]}) == "data.sources"
    assert key_of({"sources": [{"path": str(numbered), "weight": -1}]}) == "data.sources[0].weight"
    assert key_of({"sources": []}) == "data.sources"
    assert key_of({"sources": [{"path": str(numbered), "wieght": 1}]}) == "data.sources[0].wieght"
    assert key_of({"sources": [{"path": str(numbered)}, {"path": str(numbered)}]}) == "data.sources[1].name"
    assert key_of({"vocab_size": 1}, "synthetic") == "data.vocab_size"
    assert key_of({}, "no-such-strategy") == "data.strategy"
    assert "mixture" in DATASET_STRATEGIES and "synthetic" in DATASET_STRATEGIES


def test_store_too_short_for_seq_len(tmp_path: Path) -> None:
    tiny = make_store(tmp_path / "tiny", [np.arange(10)])
    strategy = mixture((tiny, 1))
    with pytest.raises(ConfigError, match="too few for one window") as err:
        strategy.train(64, seed=0)
    assert err.value.key == "data.sources[0].path"
    empty = make_store(tmp_path / "empty", [])
    with pytest.raises(ConfigError, match="train split is empty"):
        mixture((empty, 1))


def test_batch_layout_errors(numbered: Path) -> None:
    ds = mixture((numbered, 1)).train(4, seed=0)
    with pytest.raises(ConfigError, match="train.batch_size") as err:
        BatchLoader(ds, global_batch=10, accumulate_steps=4, start_step=0)
    assert "multiple of 4" in str(err.value)
    with pytest.raises(ConfigError, match="processes"):
        BatchLoader(ds, global_batch=6, accumulate_steps=2, start_step=0, process_count=2)


# ----------------------------------------------------------------------------- tokenizers (issue 5)


TOKENIZER_TEXTS = [f"def f{i}(x):\n    return x * {i}  # the café ✓ {i}\n" * 3 for i in range(40)]


def test_tokenizer_registry_and_specs(tmp_path: Path) -> None:
    from runner.data.tokenizer import TrainedBPE, load_tokenizer, parse_tokenizer_spec

    assert {"byte", "hf", "tiktoken", "train-bpe"} <= set(TOKENIZERS.names())
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert parse_tokenizer_spec("hf:dir/tokenizer.json")[1] == "dir/tokenizer.json"
    with pytest.raises(ConfigError, match="no tokenizer of that kind") as err:
        parse_tokenizer_spec("spm:x.model")
    assert err.value.key == "--tokenizer"
    with pytest.raises(ConfigError, match="at least 257"):
        TrainedBPE.parse_vocab_size("12")
    with pytest.raises(ValueError, match="trained"):
        load_tokenizer("train-bpe:300")


def test_hf_tokenizer_round_trip_and_eod(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as Core
    from tokenizers import models, pre_tokenizers

    from runner.data.tokenizer import HFTokenizer, TrainedBPE, load_tokenizer

    trained = TrainedBPE.train(iter(TOKENIZER_TEXTS), 300)
    assert (trained.name, trained.vocab_size, trained.eod_id, trained.eod_token) == ("hf", 300, 0, "<|endoftext|>")
    assert TrainedBPE.train(iter(TOKENIZER_TEXTS), 300).data == trained.data  # deterministic
    (tmp_path / "tokenizer.json").write_bytes(trained.data)
    tok = load_tokenizer(f"hf:{tmp_path / 'tokenizer.json'}")
    ids = tok.encode(TOKENIZER_TEXTS[3])
    assert len(ids) < len(TOKENIZER_TEXTS[3].encode()) and tok.decode(ids) == TOKENIZER_TEXTS[3]
    assert tok.decode(np.concatenate([ids, [tok.eod_id, 10**6]])) == TOKENIZER_TEXTS[3]
    # A literal "<|endoftext|>" in a document is text, not a document boundary.
    assert tok.eod_id not in tok.encode("a <|endoftext|> b").tolist()
    # A vocabulary without an end-of-text token gets one extra id.
    plain = Core(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    plain.add_tokens(["hello"])
    no_eod = HFTokenizer(plain.to_str().encode())
    assert no_eod.eod_token is None and no_eod.vocab_size == no_eod.eod_id + 1
    with pytest.raises(ConfigError, match="no such token") as err:
        HFTokenizer(trained.data, "<eos>")
    assert err.value.key == "--eod-token"
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a valid Hugging Face tokenizer.json"):
        load_tokenizer(f"hf:{tmp_path / 'broken.json'}")


def test_tiktoken_round_trip(tmp_path: Path) -> None:
    from runner.data.tokenizer import load_tokenizer
    from tests.data.test_prepare import write_tiktoken

    ranks = write_tiktoken(tmp_path / "r50k_tiny.tiktoken")  # the name says which regex: gpt2's
    tok = load_tokenizer(f"tiktoken:{tmp_path / 'r50k_tiny.tiktoken'}")
    assert (tok.vocab_size, tok.eod_id, tok.pattern) == (len(ranks) + 1, len(ranks), "gpt2")
    ids = tok.encode("the thing in the ring")
    assert ranks.index(b" the") in ids.tolist() and tok.decode(ids) == "the thing in the ring"
    assert tok.decode(np.append(ids, tok.eod_id)) == "the thing in the ring"
    (tmp_path / "bad.tiktoken").write_text("not base64 at all\n")
    with pytest.raises(ConfigError, match="not a valid tiktoken rank file"):
        load_tokenizer(f"tiktoken:{tmp_path / 'bad.tiktoken'}", tiktoken_pattern="cl100k")


# ----------------------------------------------------------------------------- zarr3 stores


def test_zarr3_store_through_token_store_open(tmp_path: Path) -> None:
    docs = [np.arange(i * 1000, i * 1000 + 700) for i in range(30)]
    flat = TokenStore.open(make_store(tmp_path / "flat", docs))
    zarr = write_store(tmp_path / "zarr", {"train": docs, "val": [np.arange(100)]}, IdTokenizer(), [{"kind": "test"}],
                       format="zarr3")
    assert zarr.format == "runner-zarr3-v1" and zarr.fingerprint == flat.fingerprint
    reopened = TokenStore.open(tmp_path / "zarr")  # the same TokenStore.open, dispatching on meta.format
    train = reopened.tokens("train")
    assert len(train) == len(flat.tokens("train")) == 30 * 701
    assert np.array_equal(train[5000:6025], flat.tokens("train")[5000:6025])
    assert np.array_equal(np.asarray(reopened.tokens("val")), np.asarray(flat.tokens("val")))
    with pytest.raises(UserError, match="already exists"):
        write_store(tmp_path / "zarr", {"train": docs, "val": []}, IdTokenizer(), [], format="zarr3")


def test_gs_urls_use_the_same_kvstore_spec_code() -> None:
    """No bucket here: check that a gs:// location becomes tensorstore's gcs kvstore, split arrays
    included, through the very function local stores use."""
    from runner.data.store import kvstore_spec

    assert kvstore_spec("gs://bucket/stores/web/").to_json() == {"driver": "gcs", "bucket": "bucket",
                                                                "path": "stores/web/"}
    assert (kvstore_spec("gs://bucket/stores/web") / "train/").to_json()["path"] == "stores/web/train/"
    assert kvstore_spec("/data/web").to_json() == {"driver": "file", "path": "/data/web/"}


def test_corrupt_stores_are_named(tmp_path: Path) -> None:
    docs = [np.arange(3000)]

    def zarr_store(name: str) -> Path:
        write_store(tmp_path / name, {"train": docs, "val": [np.arange(50)]}, IdTokenizer(), [], format="zarr3")
        return tmp_path / name

    path = make_store(tmp_path / "badjson", docs)
    (path / "meta.json").write_text("{ truncated")
    with pytest.raises(UserError, match="Corrupt token store .*meta.json cannot be read"):
        TokenStore.open(path)
    path = make_store(tmp_path / "badformat", docs)
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "format": "parquet-v9"}))
    with pytest.raises(UserError, match="format 'parquet-v9'"):
        TokenStore.open(path)
    path = zarr_store("nometa-count")
    meta = json.loads((path / "meta.json").read_text())
    meta["splits"]["train"]["tokens"] += 5
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"the train array is uint16\[3001\] but meta.json says uint16\[3006\]"):
        TokenStore.open(path)
    path = zarr_store("noarray")
    (path / "val" / "zarr.json").unlink()
    with pytest.raises(UserError, match="the val array cannot be opened"):
        TokenStore.open(path)
    path = zarr_store("truncated")
    shard = next(p for p in (path / "train").rglob("*") if p.is_file() and p.name != "zarr.json")
    shard.write_bytes(shard.read_bytes()[:40])
    strategy = mixture((path, 1))
    with pytest.raises(UserError, match="Corrupt token store .*a chunk cannot be read"):
        strategy.train(64, seed=0)[0]


def test_store_with_an_empty_val_split_is_not_evaluated(tmp_path: Path) -> None:
    path = make_store(tmp_path / "trainonly", [np.arange(500)], val=[])
    path_short = make_store(tmp_path / "shortval", [np.arange(500)], val=[np.arange(3)])
    empty = TokenStore.open(path)
    assert len(empty.tokens("val")) == 0
    assert len(mixture((path, 1)).validation(16, 8)["trainonly"]) == 0
    with pytest.raises(ConfigError, match="val split has 4 tokens, too few"):
        mixture((path_short, 1)).validation(16, 8)


def test_seq_len_longer_than_a_zarr3_store_can_serve(tmp_path: Path) -> None:
    write_store(tmp_path / "z", {"train": [np.arange(100)], "val": [np.arange(10)]}, IdTokenizer(), [], format="zarr3")
    with pytest.raises(ConfigError, match=r"101 tokens, too few .*train.seq_len=128.*below 100") as err:
        mixture((tmp_path / "z", 1)).train(128, seed=0)
    assert err.value.key == "data.sources[0].path"


def test_stores_of_different_tokenizers_do_not_mix(tmp_path: Path, numbered: Path) -> None:
    byte = write_store(tmp_path / "byte", {"train": [np.arange(200)], "val": []}, ByteTokenizer(), [])
    with pytest.raises(ConfigError, match="mix only stores prepared with the same tokenizer") as err:
        mixture((numbered, 1), (byte.location, 1))
    assert err.value.key == "data.sources[1].path"


# ----------------------------------------------------------------------------- exact mixture blocks


def test_integer_proportions() -> None:
    from runner.data.strategies import integer_proportions

    assert integer_proportions([3, 1]) == (3, 1)
    assert integer_proportions([0.3, 0.7]) == (3, 7)
    assert integer_proportions([1 / 3, 2 / 3]) == (1, 2)
    assert integer_proportions([0.25, 0.25, 0.5]) == (1, 1, 2)
    assert integer_proportions([2.5, 1]) == (5, 2)


def test_each_block_of_batches_holds_exactly_the_proportions(tmp_path: Path) -> None:
    """0.3 : 0.7 -> blocks of 3 + 7 = 10 rows; at a global batch of 4, lcm(10, 4) / 4 = 5 steps."""
    low = make_store(tmp_path / "low", [np.arange(0, 4000)])
    high = make_store(tmp_path / "high", [np.arange(30000, 34000)])
    strategy = mixture((low, 0.3), (high, 0.7))
    assert strategy.block_rows == 10 and strategy.block_steps(4) == 5 and strategy.block_steps(256) == 5
    loader = BatchLoader(strategy.train(4, seed=2, global_batch=4), global_batch=4, accumulate_steps=2, start_step=0)
    steps = 60
    from_low = np.array([(loader.batch_at(s)["x"][..., 0] < 30000).sum() for s in range(steps)])
    assert (from_low.reshape(-1, 5).sum(axis=1) == 6).all()  # 6 of every 20 rows, in every block of 5 steps
    assert len(set(from_low[:5].tolist())) > 1  # not trivially per step: single steps vary
    loader.close()
    # grain's own `mix` would have rescaled 3:7 to 100:233 and drifted from 30%.
    assert from_low.sum() == 0.3 * steps * 4


# ----------------------------------------------------------------------------- sequential


def sequential(*stages: tuple[int | None, list[tuple[Path, float]]]) -> DatasetStrategy:
    return build_strategy("sequential", {"stages": [
        {**({"until_step": until} if until is not None else {}),
         "sources": [{"path": str(p), "weight": w} for p, w in sources]}
        for until, sources in stages]})


def test_sequential_switches_stages_at_steps(tmp_path: Path) -> None:
    a = make_store(tmp_path / "a", [np.arange(0, 4000)])
    b = make_store(tmp_path / "b", [np.arange(30000, 34000)])
    strategy = sequential((3, [(a, 1)]), (7, [(a, 1), (b, 1)]), (None, [(b, 1)]))
    assert strategy.vocab_size == 2**16 and [strategy.stage_at(s) for s in (0, 2, 3, 6, 7, 10**6)] == [0, 0, 1, 1, 2, 2]
    loader = BatchLoader(strategy.train(4, seed=5, global_batch=8), global_batch=8, accumulate_steps=2, start_step=0)
    share_b = [float((loader.batch_at(s)["x"][..., 0] >= 30000).mean()) for s in range(12)]
    assert share_b == [0.0] * 3 + [0.5] * 4 + [1.0] * 5  # 1:1 is exact in every step of 8 rows
    # A pure function of (seed, settings, step): a fresh strategy and a loader started late agree.
    again = sequential((3, [(a, 1)]), (7, [(a, 1), (b, 1)]), (None, [(b, 1)]))
    late = BatchLoader(again.train(4, seed=5, global_batch=8), global_batch=8, accumulate_steps=2, start_step=6)
    assert again.fingerprint == strategy.fingerprint
    for step in (6, 7, 40):
        assert same_batch(late.batch_at(step), loader.batch_at(step))
    assert same_batch(next(late), loader.batch_at(6))
    # Boundaries are steps, so they move with the batch size; until_step is part of the fingerprint.
    other = BatchLoader(strategy.train(4, seed=5, global_batch=4), global_batch=4, accumulate_steps=1, start_step=0)
    assert [float((other.batch_at(s)["x"][..., 0] >= 30000).mean()) for s in (2, 3)] == [0.0, 0.5]
    assert sequential((4, [(a, 1)]), (7, [(a, 1), (b, 1)]), (None, [(b, 1)])).fingerprint != strategy.fingerprint
    assert set(strategy.validation(4, 2)) == {"a", "b"}
    with pytest.raises(ValueError, match="global_batch"):
        strategy.train(4, seed=5)
    for each in (loader, late, other):
        each.close()


def test_sequential_from_the_typed_spec(tmp_path: Path) -> None:
    from runner.spec import spec_from_dict

    a = make_store(tmp_path / "a", [np.arange(0, 400)])
    b = make_store(tmp_path / "b", [np.arange(30000, 30400)])
    spec = spec_from_dict({"data": {"strategy": "sequential", "stages": [
        {"until_step": 2, "sources": [{"path": str(a)}]}, {"sources": [{"path": str(b), "weight": 2}]}]}})
    strategy = build_strategy(spec.data.strategy, spec.data)
    assert strategy.fingerprint == sequential((2, [(a, 1)]), (None, [(b, 2)])).fingerprint
    assert build_strategy("mixture", spec.data).fingerprint != strategy.fingerprint  # mixture ignores stages


def test_sequential_config_errors(tmp_path: Path, numbered: Path) -> None:
    other = make_store(tmp_path / "numbered2", [np.arange(300)])
    (tmp_path / "x").mkdir()
    renamed = make_store(tmp_path / "x" / "numbered", [np.arange(300)])

    def key_of(stages: object) -> str:
        with pytest.raises(ConfigError) as err:
            build_strategy("sequential", {"stages": stages})
        return err.value.key

    src = [{"path": str(numbered)}]
    assert key_of([]) == "data.stages"
    assert key_of([{"until_step": 5, "sources": src}]) == "data.stages[0].until_step"  # the last runs to the end
    assert key_of([{"sources": src}, {"sources": src}]) == "data.stages[0].until_step"
    assert key_of([{"until_step": 5, "sources": src}, {"until_step": 5, "sources": src},
                   {"sources": src}]) == "data.stages[1].until_step"
    assert key_of([{"until_step": 5, "sources": src}, {"sources": [{"path": str(other), "weight": 0}]}]) \
        == "data.stages[1].sources"
    assert key_of([{"until_step": 5, "sources": src}, {"sources": [{"path": str(other), "weight": -2}]}]) \
        == "data.stages[1].sources[0].weight"
    assert key_of([{"until_step": 5, "sources": src}, {"soruces": src}]) == "data.stages[1].soruces"
    assert key_of([{"until_step": 5}, {"sources": src}]) == "data.stages[0].sources"
    assert key_of([{"until_step": 5, "sources": src}, {"sources": [{"path": str(renamed)}]}]) \
        == "data.stages[1].sources[0].name"  # two stores both called "numbered"
    assert key_of([{"sources": [{"path": str(tmp_path / "nope")}]}]) == "data.stages[0].sources[0].path"

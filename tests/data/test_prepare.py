"""`python -m runner.data.prepare`: inputs, splits, tokenizers, formats, resumption and errors."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runner.data.loader import BatchLoader
from runner.data.prepare import main as prepare_main
from runner.data.store import TokenStore
from runner.data.strategies import build_strategy
from runner.data.tokenizer import ByteTokenizer

WORDS = (
    "the of and to in is was for that with as on by at from this are be or it an which have not has "
    "data model token train loss step batch shard store window value layer weight gradient resume "
    "café naïve über ✓ 東京 λx → 2024 3.14 x_1 f(x) {'a': [1, 2]}"
).split()


def make_text(rng: np.random.Generator, label: str) -> str:
    words = rng.choice(WORDS, size=int(rng.integers(30, 300)))
    lines = [" ".join(words[i:i + 12]) for i in range(0, len(words), 12)]
    return f"{label}\n" + "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """12 text files, a JSONL of 40 documents (field `content`), a Parquet of 40 rows in row groups
    of 7 (column `body`); each document unique. Returns the paths and every text in input order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    (root / "texts").mkdir()
    texts: list[str] = []
    for i in range(12):
        text = make_text(rng, f"text file {i}")
        (root / "texts" / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
        texts.append(text)
    (root / "texts" / "empty.txt").write_text("")  # no document
    with open(root / "web.jsonl", "w", encoding="utf-8") as f:
        for i in range(40):
            text = make_text(rng, f"jsonl line {i}")
            f.write(json.dumps({"id": i, "content": text}) + "\n")
            texts.append(text)
        f.write("\n")  # blank lines are skipped
    rows = [make_text(rng, f"parquet row {i}") for i in range(40)]
    pq.write_table(pa.table({"body": rows + [None], "n": list(range(41))}), root / "books.parquet", row_group_size=7)
    texts.extend(rows)
    args = [str(root / "texts" / "*.txt"), str(root / "web.jsonl"), str(root / "books.parquet"),
            "--jsonl-field", "content", "--parquet-column", "body"]
    return {"root": root, "texts": texts, "args": args}


def run_prepare(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner.data.prepare", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})


def split_of(text: str, fraction: float) -> str:
    """The documented rule: BLAKE2b-64 of the UTF-8 text, little-endian, as a fraction of 2**64."""
    value = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return "val" if value < fraction * 2**64 else "train"


def documents(tokens: np.ndarray, eod: int) -> list[np.ndarray]:
    tokens = np.asarray(tokens)
    ends = np.flatnonzero(tokens == eod)
    assert len(tokens) == 0 or ends[-1] == len(tokens) - 1, "every document ends with eod"
    return np.split(tokens, ends + 1)[:-1]


def store_files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- end to end


@pytest.mark.e2e
def test_text_glob_jsonl_parquet_end_to_end(corpus: dict, tmp_path: Path) -> None:
    out = tmp_path / "store"
    result = run_prepare([*corpus["args"], "--output", str(out), "--val-fraction", "0.2",
                          "--shard-bytes", "4000", "--workers", "1"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Prepared" in result.stdout and "Traceback" not in result.stderr
    store = TokenStore.open(out)
    tok = ByteTokenizer()
    expected = {"train": [], "val": []}
    for text in corpus["texts"]:
        expected[split_of(text, 0.2)].append(text)
    assert expected["val"] and expected["train"]  # the fraction really splits this corpus
    for split in ("train", "val"):
        docs = [tok.decode(d) for d in documents(store.tokens(split), tok.eod_id)]
        assert docs == expected[split]  # every document, in input order, each followed by eod
        assert store.meta["splits"][split]["documents"] == len(expected[split])
    kinds = {Path(s["path"]).name: (s["kind"], s["documents"]) for s in store.meta["sources"]}
    assert kinds["web.jsonl"] == ("jsonl", 40) and kinds["books.parquet"] == ("parquet", 40)
    assert kinds["doc00.txt"] == ("text", 1) and kinds["empty.txt"] == ("text", 0)
    assert store.meta["prepare"]["shards"] > 10 and not (tmp_path / "store.partial").exists()
    # The same command again finds the finished store and does nothing.
    again = run_prepare([*corpus["args"], "--output", str(out), "--val-fraction", "0.2",
                         "--shard-bytes", "4000", "--workers", "1"], tmp_path)
    assert again.returncode == 0 and "already prepared" in again.stdout


@pytest.mark.e2e
def test_killed_and_resumed_is_byte_identical(corpus: dict, tmp_path: Path) -> None:
    common = [*corpus["args"], "--shard-bytes", "3000", "--val-fraction", "0.1", "--progress", "none"]
    whole = run_prepare([*common, "--output", str(tmp_path / "whole"), "--workers", "2"], tmp_path)
    assert whole.returncode == 0, whole.stderr
    killed = run_prepare([*common, "--output", str(tmp_path / "resumed"), "--_fail-after-shards", "3"], tmp_path)
    assert killed.returncode == -signal.SIGKILL
    work = tmp_path / "resumed.partial" / "shards"
    assert len(list(work.glob("*.json"))) == 3 and list(work.glob("*.tmp"))  # killed inside shard 4
    assert not (tmp_path / "resumed").exists()
    resumed = run_prepare([*common, "--output", str(tmp_path / "resumed"), "--workers", "1"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "Resuming: 3 of" in resumed.stderr
    assert store_files(tmp_path / "resumed") == store_files(tmp_path / "whole")
    assert not (tmp_path / "resumed.partial").exists()


@pytest.mark.e2e
def test_changed_settings_do_not_mix_with_an_interrupted_run(corpus: dict, tmp_path: Path) -> None:
    common = [*corpus["args"], "--shard-bytes", "3000", "--output", str(tmp_path / "s"), "--progress", "none"]
    assert run_prepare([*common, "--_fail-after-shards", "1"], tmp_path).returncode == -signal.SIGKILL
    changed = run_prepare([*common, "--val-fraction", "0.3"], tmp_path)
    assert changed.returncode == 2 and "Traceback" not in changed.stderr
    assert "interrupted preparation with other settings" in changed.stderr and "delete" in changed.stderr


# ----------------------------------------------------------------------------- tokenizers


def prepare_in_process(args: list[str]) -> int:
    return prepare_main([*args, "--workers", "1", "--progress", "none"])


def test_train_bpe_then_hf_gives_the_same_tokens(corpus: dict, tmp_path: Path) -> None:
    assert prepare_in_process([*corpus["args"], "-o", str(tmp_path / "bpe"), "--tokenizer", "train-bpe:400"]) == 0
    bpe = TokenStore.open(tmp_path / "bpe")
    assert bpe.tokenizer == "hf" and bpe.meta["tokenizer_config"]["eod_token"] == "<|endoftext|>"
    assert 300 < bpe.vocab_size <= 400 and (tmp_path / "bpe" / "tokenizer.json").is_file()
    tok = bpe.load_tokenizer()
    docs = documents(bpe.tokens("train"), bpe.eod_id)
    train_texts = [t for t in corpus["texts"] if split_of(t, 0.01) == "train"]
    assert [tok.decode(d) for d in docs] == train_texts
    assert len(bpe.tokens("train")) < 0.8 * sum(len(t.encode()) for t in train_texts)  # merges compress
    # The saved tokenizer.json, given back as `hf:`, reproduces the store token for token.
    hf_args = [*corpus["args"], "-o", str(tmp_path / "hf"), "--tokenizer", f"hf:{tmp_path / 'bpe' / 'tokenizer.json'}"]
    assert prepare_in_process(hf_args) == 0
    hf = TokenStore.open(tmp_path / "hf")
    assert hf.fingerprint == bpe.fingerprint and hf.tokenizer_id == bpe.tokenizer_id


def write_tiktoken(path: Path) -> list[bytes]:
    """A tiny BPE rank file: the 256 bytes, then merges whose parts rank lower."""
    ranks = [bytes([b]) for b in range(256)] + [b"th", b"the", b" t", b" the", b"in", b"ing", b"er", b" a"]
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(ranks)))
    return ranks


def test_tiktoken_rank_file(corpus: dict, tmp_path: Path) -> None:
    write_tiktoken(tmp_path / "tiny.tiktoken")
    args = [*corpus["args"], "-o", str(tmp_path / "tt"), "--tokenizer", f"tiktoken:{tmp_path / 'tiny.tiktoken'}",
            "--tiktoken-pattern", "gpt2", "--val-fraction", "0"]
    assert prepare_in_process(args) == 0
    store = TokenStore.open(tmp_path / "tt")
    assert (store.tokenizer, store.vocab_size, store.eod_id) == ("tiktoken", 265, 264)
    tok = store.load_tokenizer()
    docs = documents(store.tokens("train"), store.eod_id)
    assert [tok.decode(d) for d in docs] == corpus["texts"]
    assert store.tokens("train")[:].max() == 264 and (np.asarray(store.tokens("train")) == 257).any()  # "the"
    assert len(store.tokens("val")) == 0
    assert store.meta["tokenizer_config"]["pattern"] == "gpt2"


# ----------------------------------------------------------------------------- zarr3


def test_zarr3_store_matches_flat(corpus: dict, tmp_path: Path) -> None:
    for fmt in ("flat", "zarr3"):
        assert prepare_in_process([*corpus["args"], "-o", str(tmp_path / fmt), "--format", fmt,
                                   "--val-fraction", "0.2"]) == 0
    flat, zarr = TokenStore.open(tmp_path / "flat"), TokenStore.open(tmp_path / "zarr3")
    assert (flat.format, zarr.format) == ("runner-flat-v1", "runner-zarr3-v1")
    assert zarr.fingerprint == flat.fingerprint  # the fingerprint is the content, not the format
    for split in ("train", "val"):
        assert np.array_equal(np.asarray(zarr.tokens(split)), np.asarray(flat.tokens(split)))
    assert (tmp_path / "zarr3" / "train" / "zarr.json").is_file()
    # Through the mixture and the loader, both formats give the same batches.
    loaders = [BatchLoader(build_strategy("mixture", {"sources": [{"path": str(tmp_path / f), "name": "c"}]})
                           .train(64, seed=3), global_batch=8, accumulate_steps=2, start_step=0)
               for f in ("flat", "zarr3")]
    for step in (0, 7, 50):
        a, b = (loader.batch_at(step) for loader in loaders)
        assert all(np.array_equal(a[k], b[k]) for k in a)
    for loader in loaders:
        loader.close()


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("extra, message", [
    (["--tokenizer", "sentencepiece:x.model"], "no tokenizer of that kind"),
    (["--tokenizer", "hf:/nonexistent/tokenizer.json"], "cannot be read"),
    (["--tokenizer", "train-bpe:100"], "at least 257"),
    (["--val-fraction", "1.5"], "--val-fraction"),
    (["--jsonl-field", "text"], "has no field 'text'"),
])
def test_errors_are_one_paragraph(corpus: dict, tmp_path: Path, capsys: pytest.CaptureFixture,
                                  extra: list[str], message: str) -> None:
    args = [str(corpus["root"] / "web.jsonl"), "-o", str(tmp_path / "s"), *extra]
    assert prepare_in_process(args) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # after any progress lines, one paragraph
    assert err.startswith("error: ") and message in err and "Fix:" in err
    assert list(tmp_path.iterdir()) == []  # no store, and no work directory with nothing to resume


def test_input_errors(corpus: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    def error(*args: str) -> str:
        assert prepare_in_process([*args, "-o", str(tmp_path / "s")]) == 2
        return capsys.readouterr().err

    assert "no such file or directory" in error(str(tmp_path / "missing.txt"))
    assert "the glob matches no files" in error(str(tmp_path / "*.nothing"))
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    assert "no training documents" in error(str(tmp_path / "blank"))
    assert "has no such column (it has: body, n)" in error(str(corpus["root"] / "books.parquet"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    assert f"Invalid JSON at {bad}, line 2" in error(str(bad))
    assert "cannot be guessed" in error(str(bad), "--tokenizer", f"tiktoken:{bad}")


@pytest.mark.e2e
def test_cli_error_exit_code_and_help(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.txt").write_text("some text")
    assert run_prepare([str(other), "-o", str(tmp_path / "s"), "--val-fraction", "0"], tmp_path).returncode == 0
    (other / "b.txt").write_text("more text")  # different inputs, same output
    result = run_prepare([str(other), "-o", str(tmp_path / "s")], tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "a different token store already exists there" in result.stderr
    help_text = run_prepare(["--help"], tmp_path)
    assert help_text.returncode == 0 and "--tokenizer" in help_text.stdout and "_fail" not in help_text.stdout


def test_output_inside_an_input_directory_is_not_read_back(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("alpha " * 50)
    (tmp_path / "docs" / "b.txt").write_text("beta " * 50)
    args = [str(tmp_path / "docs"), "-o", str(tmp_path / "docs" / "store"), "--val-fraction", "0"]
    assert prepare_in_process(args) == 0
    assert prepare_in_process(args) == 0 and "already prepared" in capsys.readouterr().out
    assert TokenStore.open(tmp_path / "docs" / "store").meta["splits"]["train"]["documents"] == 2
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    assert prepare_in_process([str(tmp_path / "docs" / "a.txt"), "-o", str(tmp_path / "taken")]) == 2
    assert "it exists and is not a token store" in capsys.readouterr().err

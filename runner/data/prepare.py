"""Prepare a token store from text files, JSONL or Parquet: ``python -m runner.data.prepare``.

    python -m runner.data.prepare 'corpus/**/*.txt' web.jsonl --output stores/web \\
        --tokenizer train-bpe:32000 --val-fraction 0.01

The inputs are cut into shards in a fixed order (text files grouped, JSONL at line boundaries,
Parquet by row groups; about ``--shard-bytes`` each), and each shard is tokenized into its own
files in a work directory, written under temporary names and renamed, then recorded. The plan
and the settings are kept in the work directory's ``manifest.json``. Killed at any point and run
again with the same command, the tool skips the recorded shards and finishes the rest; the store
is then assembled by concatenating the shards in plan order, so it is byte-identical to the one
an uninterrupted run writes, whatever the number of workers.

A document goes to the validation split when the first 8 bytes of the BLAKE2b hash of its text,
read as a fraction of 2**64, are below ``--val-fraction``: stable across runs, machines and input
order, and copies of one document always land in the same split. Every document is followed by
the tokenizer's end-of-document id.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from runner.checkpoint.files import atomic_write, atomic_write_json
from runner.checkpoint.storage import cache_root
from runner.data.store import (
    FORMATS,
    META_FILE,
    SPLITS,
    TokenStore,
    build_store,
    dtype_for_vocab,
    is_remote,
    normalize_location,
)
from runner.data.tokenizer import (
    TIKTOKEN_PATTERNS,
    TOKENIZERS,
    HFTokenizer,
    Tokenizer,
    TrainedBPE,
    check_user_tokenizer,
    encode_batch,
    load_tokenizer,
    parse_tokenizer_spec,
)
from runner.errors import ConfigError, UserError

MANIFEST_VERSION = 1
DEFAULT_SHARD_BYTES = 64 * 2**20
ENCODE_BATCH_BYTES = 4 * 2**20  # text handed to the tokenizer at once
READ_BLOCK_TOKENS = 16 * 2**20  # shard tokens read at once while assembling
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")


# ----------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m runner.data.prepare",
        description="Tokenize text, JSONL or Parquet files into a runner token store (train and val splits). "
                    "Interrupted, it resumes when run again with the same command.",
        epilog="Example: python -m runner.data.prepare 'books/*.txt' web.jsonl --output stores/mix "
               "--tokenizer train-bpe:8192 --val-fraction 0.01",
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="text files (one document each), *.jsonl/*.ndjson (one document per line), "
                             "*.parquet (one per row), directories (every file below) or quoted globs ('**' recurses)")
    parser.add_argument("-o", "--output", required=True,
                        help="the store to write: a local directory, or with --format zarr3 also a gs:// URL")
    parser.add_argument("--format", choices=sorted(FORMATS), default="flat",
                        help="flat: memory-mapped local files (fastest); zarr3: tensorstore zarr v3, local or "
                             "gs:// (default: flat)")
    parser.add_argument("--tokenizer", default="byte",
                        help="byte | hf:PATH/tokenizer.json | tiktoken:PATH.tiktoken | train-bpe:VOCAB_SIZE "
                             "(a byte-level BPE trained on these inputs, saved in the store) (default: byte)")
    parser.add_argument("--eod-token", default=None,
                        help="hf: the vocabulary's end-of-document token (default: <|endoftext|>, </s>, ... "
                             "whichever it has; else one extra id)")
    parser.add_argument("--tiktoken-pattern", choices=TIKTOKEN_PATTERNS, default=None,
                        help="tiktoken: the pre-tokenization regex (default: guessed from the file name)")
    parser.add_argument("--bpe-sample-bytes", type=int, default=2**30,
                        help="train-bpe: learn merges from the first this many bytes of training text "
                             "(default: 1 GiB)")
    parser.add_argument("--jsonl-field", default="text", help="the JSONL field holding the text (default: text)")
    parser.add_argument("--parquet-column", default="text",
                        help="the Parquet column holding the text (default: text)")
    parser.add_argument("--val-fraction", type=float, default=0.01,
                        help="share of documents (by hash) in the validation split, in [0, 1) (default: 0.01)")
    parser.add_argument("--shard-bytes", type=int, default=DEFAULT_SHARD_BYTES,
                        help="input bytes per shard, the unit of work and of resumption (default: 64 MiB)")
    parser.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 16),
                        help="tokenizing processes (default: the CPU count, at most 16)")
    parser.add_argument("--work-dir", default=None,
                        help="where shards are kept until the store is assembled (default: OUTPUT.partial "
                             "beside a local output; under the runner cache for a URL)")
    parser.add_argument("--progress", choices=("auto", "rich", "none"), default="auto",
                        help="auto: a live bar on a terminal (default: auto)")
    # Tests: SIGKILL this process in the middle of the shard after the first N of this run.
    parser.add_argument("--_fail-after-shards", dest="fail_after_shards", type=int, default=None,
                        help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return prepare(args)
    except UserError as err:
        print("error: " + " ".join(str(err).split()), file=sys.stderr, flush=True)
        return err.exit_code
    except KeyboardInterrupt:
        print("Interrupted. Run the same command again to resume.", file=sys.stderr, flush=True)
        return 130


# ----------------------------------------------------------------------------- inputs and plan


@dataclass(frozen=True)
class InputFile:
    path: str  # absolute
    kind: str  # text | jsonl | parquet
    size: int
    mtime_ns: int


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def _files_below(directory: Path) -> list[Path]:
    """Regular files below ``directory``, sorted, skipping hidden files and directories."""
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(Path(root) / f for f in files if not f.startswith("."))
    return sorted(found)


def expand_inputs(patterns: Sequence[str]) -> list[InputFile]:
    """Paths, directories and globs -> files, in argument order (each glob and directory sorted),
    each file once."""
    paths: list[Path] = []
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        if glob.has_magic(expanded):
            matches = sorted(Path(m) for m in glob.glob(expanded, recursive=True))
            if not matches:
                raise ConfigError("INPUT", pattern, "the glob matches no files.",
                                  "check the pattern (quote it so the shell leaves it to this tool).")
            for match in matches:
                paths.extend(_files_below(match) if match.is_dir() else [match])
        elif Path(expanded).is_dir():
            below = _files_below(Path(expanded))
            if not below:
                raise ConfigError("INPUT", pattern, "the directory holds no files.", "give a directory with documents.")
            paths.extend(below)
        elif Path(expanded).is_file():
            paths.append(Path(expanded))
        else:
            raise ConfigError("INPUT", pattern, "there is no such file or directory.",
                              "fix the path, or quote a glob such as 'data/*.jsonl'.")
    seen: set[str] = set()
    files = []
    for path in paths:
        absolute = str(path.absolute())
        if absolute not in seen:
            seen.add(absolute)
            stat = path.stat()
            files.append(InputFile(absolute, _kind(path), stat.st_size, stat.st_mtime_ns))
    return files


def _jsonl_ranges(path: str, size: int, shard_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges of about ``shard_bytes`` that start and end at line boundaries."""
    ranges, start = [], 0
    with open(path, "rb") as f:
        while start < size:
            target = start + shard_bytes
            if target >= size:
                end = size
            else:
                f.seek(target - 1)
                end = min(size, target - 1 + len(f.readline()))
            ranges.append((start, end))
            start = end
    return ranges


def _check_parquet(file: InputFile, column: str) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(file.path).metadata
        schema = meta.schema.to_arrow_schema()
    except (OSError, pa.ArrowException) as err:
        raise UserError(f"Cannot read the Parquet file {file.path} ({err}). Fix: check that it is a valid "
                        "Parquet file, or remove it from the inputs.") from None
    if column not in schema.names:
        raise ConfigError("--parquet-column", column, f"{file.path} has no such column (it has: "
                          f"{', '.join(schema.names)}).", "name the column that holds the text.")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise ConfigError("--parquet-column", column, f"in {file.path} it holds {kind}, not text.",
                          "name a string column.")
    return meta


def plan_shards(files: Sequence[InputFile], shard_bytes: int, parquet_column: str) -> list[dict[str, Any]]:
    """The fixed list of shards: consecutive text files grouped to ``shard_bytes``, JSONL files cut
    at line boundaries, Parquet files by groups of consecutive row groups."""
    shards: list[dict[str, Any]] = []
    group: list[str] = []
    group_bytes = 0

    def close_group() -> None:
        nonlocal group, group_bytes
        if group:
            shards.append({"kind": "text", "files": group, "bytes": group_bytes})
        group, group_bytes = [], 0

    for file in files:
        if file.kind == "text":
            group.append(file.path)
            group_bytes += file.size
            if group_bytes >= shard_bytes:
                close_group()
            continue
        close_group()
        if file.kind == "jsonl":
            for start, end in _jsonl_ranges(file.path, file.size, shard_bytes):
                shards.append({"kind": "jsonl", "file": file.path, "start": start, "end": end, "bytes": end - start})
        else:
            meta = _check_parquet(file, parquet_column)
            row_groups: list[int] = []
            size = 0
            for i in range(meta.num_row_groups):
                row_groups.append(i)
                size += meta.row_group(i).total_byte_size
                if size >= shard_bytes or i == meta.num_row_groups - 1:
                    shards.append({"kind": "parquet", "file": file.path, "row_groups": row_groups, "bytes": size})
                    row_groups, size = [], 0
    close_group()
    return shards


# ----------------------------------------------------------------------------- documents


def shard_documents(shard: dict[str, Any], jsonl_field: str, parquet_column: str) -> Iterator[tuple[str, str]]:
    """(input file, text) of every non-empty document of a shard, in order."""
    if shard["kind"] == "text":
        for path in shard["files"]:
            text = _read(path).decode("utf-8", errors="replace")
            if text:
                yield path, text
    elif shard["kind"] == "jsonl":
        path = shard["file"]
        with open(path, "rb") as f:
            f.seek(shard["start"])
            data = f.read(shard["end"] - shard["start"])
        offset = shard["start"]
        for line in data.splitlines(keepends=True):
            text = _jsonl_text(path, offset, line, jsonl_field)
            offset += len(line)
            if text:
                yield path, text
    else:
        import pyarrow.parquet as pq

        path = shard["file"]
        table = pq.ParquetFile(path).read_row_groups(shard["row_groups"], columns=[parquet_column])
        for text in table.column(parquet_column).to_pylist():
            if text:
                yield path, text


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise UserError(f"Cannot read the input {path} ({err.strerror or err}). Fix: check that it exists "
                        "and is readable; then run the same command again to resume.") from None


def _jsonl_text(path: str, offset: int, line: bytes, field_name: str) -> str | None:
    if not line.strip():
        return None

    def where() -> str:
        with open(path, "rb") as f:
            line_number = f.read(offset).count(b"\n") + 1
        return f"{path}, line {line_number}"

    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"Invalid JSON at {where()} ({err}). Fix: repair or remove that line; each line of a "
                        ".jsonl file must be one JSON object.") from None
    if not isinstance(record, dict) or field_name not in record:
        has = f"it has: {', '.join(record)}" if isinstance(record, dict) else "it is not an object"
        raise UserError(f"The JSON at {where()} has no field {field_name!r} ({has}). Fix: pass "
                        "--jsonl-field with the name of the field that holds the text.")
    text = record[field_name]
    if text is not None and not isinstance(text, str):
        raise UserError(f"The field {field_name!r} at {where()} holds {type(text).__name__}, not text. Fix: "
                        "pass --jsonl-field naming a text field.")
    if text and b"\\u" in line:  # a \uD800-style escape can make a lone surrogate, which is not UTF-8
        text = text.encode("utf-8", errors="replace").decode("utf-8")
    return text


def is_validation(text: str, val_fraction: float) -> bool:
    """The stable hash split: BLAKE2b of the text, first 8 bytes as a fraction of 2**64."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


# ----------------------------------------------------------------------------- shards


@dataclass(frozen=True)
class ShardJob:
    index: int
    shard: dict[str, Any]
    shard_dir: str
    tokenizer_spec: str
    tokenizer_options: dict[str, Any]
    val_fraction: float
    jsonl_field: str
    parquet_column: str
    die_midway: bool = False


def shard_files(shard_dir: str | Path, index: int) -> dict[str, Path]:
    base = Path(shard_dir) / f"{index:06d}"
    return {"train": base.with_suffix(".train.bin"), "val": base.with_suffix(".val.bin"),
            "record": base.with_suffix(".json")}


_TOKENIZER_CACHE: dict[str, Tokenizer] = {}


def _tokenizer_for(job: ShardJob) -> Tokenizer:
    key = json.dumps([job.tokenizer_spec, job.tokenizer_options], sort_keys=True)
    if key not in _TOKENIZER_CACHE:
        _TOKENIZER_CACHE[key] = make_tokenizer(job.tokenizer_spec, job.tokenizer_options)
    return _TOKENIZER_CACHE[key]


def make_tokenizer(spec: str, options: dict[str, Any]) -> Tokenizer:
    tokenizer = load_tokenizer(spec, **options)
    return tokenizer if spec.partition(":")[0] in TOKENIZERS else check_user_tokenizer(tokenizer, spec)


def run_shard(job: ShardJob) -> dict[str, Any]:
    """Tokenize one shard into ``NNNNNN.{train,val}.bin`` and record it in ``NNNNNN.json``.

    The token files are written under temporary names and renamed; the record is written last,
    the same way, so a shard either has a complete record or is redone.
    """
    try:
        tokenizer = _tokenizer_for(job)
    except ConfigError as err:  # keyword-built errors do not pickle back from a worker
        raise UserError(str(err)) from None
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    eod = np.array([tokenizer.eod_id], dtype)
    files = shard_files(job.shard_dir, job.index)
    tmp = {split: files[split].with_name(files[split].name + ".tmp") for split in SPLITS}
    outs = {split: open(tmp[split], "wb") for split in SPLITS}
    counts = {split: {"tokens": 0, "documents": 0} for split in SPLITS}
    per_file: dict[str, int] = {}
    batch: dict[str, list[str]] = {split: [] for split in SPLITS}
    batch_bytes = 0

    def flush() -> None:
        nonlocal batch_bytes
        for split in SPLITS:
            if batch[split]:
                ids = encode_batch(tokenizer, batch[split])
                data = np.concatenate([part for doc in ids for part in (doc.astype(dtype, copy=False), eod)])
                outs[split].write(data.data)
                counts[split]["tokens"] += data.size
                counts[split]["documents"] += len(batch[split])
                batch[split] = []
        batch_bytes = 0
        if job.die_midway:
            os.kill(os.getpid(), signal.SIGKILL)

    try:
        for path, text in shard_documents(job.shard, job.jsonl_field, job.parquet_column):
            batch["val" if is_validation(text, job.val_fraction) else "train"].append(text)
            per_file[path] = per_file.get(path, 0) + 1
            batch_bytes += len(text)
            if batch_bytes >= ENCODE_BATCH_BYTES:
                flush()
        flush()
        for split in SPLITS:
            outs[split].flush()
            os.fsync(outs[split].fileno())
    finally:
        for out in outs.values():
            out.close()
    for split in SPLITS:
        os.replace(tmp[split], files[split])
    record = {"index": job.index, "splits": counts, "documents_by_file": per_file, "dtype": dtype.name}
    _write_json_atomically(files["record"], record)
    return record


def load_record(shard_dir: str | Path, index: int, itemsize: int) -> dict[str, Any] | None:
    """The record of a finished shard whose token files are intact, else None (redo it)."""
    files = shard_files(shard_dir, index)
    try:
        record = json.loads(files["record"].read_text())
        for split in SPLITS:
            if files[split].stat().st_size != record["splits"][split]["tokens"] * itemsize:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record


def _write_json_atomically(path: Path, data: Any) -> None:
    atomic_write_json(path, data, durable=True, indent=1, sort_keys=True)


def _init_worker() -> None:
    # One tokenizing process per core: the tokenizers' own thread pools would only oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RUNNER_PREPARE_WORKER"] = "1"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops handing out shards


# ----------------------------------------------------------------------------- the tool


@dataclass
class Progress:
    """A rich progress bar over input bytes, or nothing (a summary line is printed either way)."""

    total: int
    done: int
    style: str
    _bar: Any = field(default=None, init=False)

    def __enter__(self) -> Progress:
        if self.style == "rich" or (self.style == "auto" and sys.stderr.isatty()):
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn
            from rich.progress import Progress as Bar

            self._bar = Bar(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            TimeRemainingColumn(), console=Console(stderr=True))
            self._bar.start()
            self._task = self._bar.add_task("tokenizing", total=self.total, completed=self.done)
        return self

    def advance(self, amount: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, amount)

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()


def _check_args(args: argparse.Namespace) -> None:
    if not 0.0 <= args.val_fraction < 1.0:
        raise ConfigError("--val-fraction", args.val_fraction, "it must be in [0, 1).",
                          "use e.g. 0.01 for one document in a hundred (0: no validation split).")
    if args.shard_bytes < 1:
        raise ConfigError("--shard-bytes", args.shard_bytes, "it must be positive.", "use e.g. 67108864 (64 MiB).")
    if args.workers < 1:
        raise ConfigError("--workers", args.workers, "it must be at least 1.", "use e.g. the number of CPU cores.")
    if args.bpe_sample_bytes < 1:
        raise ConfigError("--bpe-sample-bytes", args.bpe_sample_bytes, "it must be positive.", "use e.g. 1073741824.")
    if args.format == "flat" and is_remote(args.output):
        raise ConfigError("--output", args.output, "a flat store is memory-mapped, so it must be local.",
                          "use --format zarr3 for a bucket, or a local directory.")


def _work_dir(args: argparse.Namespace, output: str) -> Path:
    if args.work_dir:
        return Path(args.work_dir).expanduser().absolute()
    if not is_remote(output):
        return Path(output + ".partial")
    return cache_root() / "prepare" / hashlib.sha256(output.encode()).hexdigest()[:16]


def _tokenizer_settings(args: argparse.Namespace) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """(tokenizer class, loader options, manifest record) for ``--tokenizer``."""
    cls, arg = parse_tokenizer_spec(args.tokenizer)
    options: dict[str, Any] = {}
    if args.eod_token is not None:
        options["eod_token"] = args.eod_token
    if args.tiktoken_pattern is not None:
        options["tiktoken_pattern"] = args.tiktoken_pattern
    record: dict[str, Any] = {"spec": args.tokenizer, **options}
    if getattr(cls, "TRAINS", False):
        record["vocab_size"] = TrainedBPE.parse_vocab_size(arg, spec=args.tokenizer)
        record["sample_bytes"] = args.bpe_sample_bytes
    elif arg:
        path = Path(arg).expanduser()
        if path.is_file():
            record["file_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return cls, options, record


def prepare(args: argparse.Namespace) -> int:
    _check_args(args)
    output = normalize_location(args.output)
    cls, options, tokenizer_record = _tokenizer_settings(args)
    trains = getattr(cls, "TRAINS", False)
    tokenizer = None if trains else make_tokenizer(args.tokenizer, options)  # fail early on a bad vocabulary
    work = _work_dir(args, output)
    _check_output(output)
    # Never read our own output or work files back as inputs (an output inside an input directory).
    files = [f for f in expand_inputs(args.inputs) if not _is_within(f.path, output, str(work))]
    shards = plan_shards(files, args.shard_bytes, args.parquet_column)
    if not shards:
        raise ConfigError("INPUT", list(args.inputs), "the inputs hold no files.", "name files with documents.")
    settings = {
        "tokenizer": tokenizer_record, "val_fraction": args.val_fraction, "jsonl_field": args.jsonl_field,
        "parquet_column": args.parquet_column, "shard_bytes": args.shard_bytes, "format": args.format,
    }
    manifest = {
        "version": MANIFEST_VERSION,
        "settings": settings,
        "inputs": [vars(f) for f in files],
        "shards": shards,
    }
    manifest_sha = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    if _already_prepared(output, manifest_sha):
        print(f"{output} is already prepared from these inputs and settings; nothing to do.")
        return 0

    _start_or_resume(work, manifest)
    try:
        return _prepare_in(work, output, args, shards, files, settings, manifest_sha, tokenizer, options,
                           tokenizer_record)
    except UserError:
        if not any((work / "shards").glob("*.json")) and not (work / HFTokenizer.FILE).exists():
            shutil.rmtree(work, ignore_errors=True)  # nothing to resume: leave no work directory behind
        raise


def _prepare_in(work: Path, output: str, args: argparse.Namespace, shards: list[dict[str, Any]],
                files: list[InputFile], settings: dict[str, Any], manifest_sha: str, tokenizer: Tokenizer | None,
                options: dict[str, Any], tokenizer_record: dict[str, Any]) -> int:
    """Train the BPE if asked, tokenize the shards not done yet, assemble the store."""
    shard_dir = work / "shards"
    shard_dir.mkdir(exist_ok=True)

    if tokenizer is None:  # train-bpe
        tokenizer_file = work / HFTokenizer.FILE
        if not tokenizer_file.is_file():
            _train_bpe(tokenizer_file, shards, args, tokenizer_record["vocab_size"])
        shard_spec, shard_options = f"hf:{tokenizer_file}", {"eod_token": TrainedBPE.EOD}
        tokenizer = make_tokenizer(shard_spec, shard_options)
    else:
        shard_spec, shard_options = args.tokenizer, options
    assert tokenizer is not None
    itemsize = dtype_for_vocab(tokenizer.vocab_size).itemsize

    records: dict[int, dict[str, Any]] = {}
    for i in range(len(shards)):
        record = load_record(shard_dir, i, itemsize)
        if record is not None:
            records[i] = record
    pending = [i for i in range(len(shards)) if i not in records]
    total = sum(s["bytes"] for s in shards)
    if records:
        print(f"Resuming: {len(records)} of {len(shards)} shards were done by an earlier run.", file=sys.stderr)
    print(f"Tokenizing {len(pending)} shard(s) of {len(shards)} from {len(files)} file(s) "
          f"({total / 2**20:.1f} MiB) with {tokenizer.name} (vocab {tokenizer.vocab_size}).", file=sys.stderr,
          flush=True)

    def job(i: int, die: bool = False) -> ShardJob:
        return ShardJob(i, shards[i], str(shard_dir), shard_spec, shard_options, args.val_fraction,
                        args.jsonl_field, args.parquet_column, die)

    done_bytes = total - sum(shards[i]["bytes"] for i in pending)
    workers = 1 if args.fail_after_shards is not None else min(args.workers, len(pending))
    with Progress(total, done_bytes, args.progress) as progress:
        if workers <= 1:
            for n, i in enumerate(pending):
                records[i] = run_shard(job(i, die=n == args.fail_after_shards))
                progress.advance(shards[i]["bytes"])
        else:
            context = multiprocessing.get_context("spawn")  # no fork of a process with tokenizer threads
            with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker) as pool:
                futures = {pool.submit(run_shard, job(i)): i for i in pending}
                try:
                    for future in as_completed(futures):
                        records[futures[future]] = future.result()
                        progress.advance(shards[futures[future]]["bytes"])
                except BaseException:
                    for future in futures:  # shards not started yet; running ones finish and are kept
                        future.cancel()
                    raise

    if sum(records[i]["splits"]["train"]["tokens"] for i in records) == 0:
        shutil.rmtree(work, ignore_errors=True)  # finished, and nothing in it worth keeping
        raise UserError(f"The inputs hold no training documents (all empty, or all in validation with "
                        f"--val-fraction {args.val_fraction}). Fix: give inputs with text, or lower --val-fraction.")
    store = _assemble(output, args.format, shard_dir, shards, records, files, tokenizer, settings, manifest_sha)
    shutil.rmtree(work, ignore_errors=True)
    counts = store.meta["splits"]
    print(f"Prepared {output} ({args.format}): {counts['train']['tokens']:,} train tokens in "
          f"{counts['train']['documents']:,} documents, {counts['val']['tokens']:,} val tokens in "
          f"{counts['val']['documents']:,} documents; tokenizer {store.tokenizer_id}, vocab {store.vocab_size}, "
          f"fingerprint {store.fingerprint[:16]}.")
    if counts["val"]["documents"] == 0 and args.val_fraction > 0:
        print(f"Note: no document fell into validation at --val-fraction {args.val_fraction}, so training "
              "evaluates nothing on this store; raise it for a validation split.", file=sys.stderr)
    return 0


def _is_within(path: str, *directories: str) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in directories)


def _check_output(output: str) -> None:
    """A local output must be a store, an empty directory, or not exist yet."""
    path = Path(output)
    if is_remote(output) or not path.exists() or (path / META_FILE).exists():
        return
    if not path.is_dir() or any(path.iterdir()):
        raise ConfigError("--output", output, "it exists and is not a token store.",
                          "choose a new path (or an empty directory) for the store.")


def _already_prepared(output: str, manifest_sha: str) -> bool:
    from runner.data.store import MissingStoreError

    try:
        store = TokenStore.open(output)
    except MissingStoreError:
        return False
    if store.meta.get("prepare", {}).get("manifest_sha256") == manifest_sha:
        return True
    raise ConfigError("--output", output, "a different token store already exists there.",
                      "delete it, or choose another output.")


def _start_or_resume(work: Path, manifest: dict[str, Any]) -> None:
    path = work / "manifest.json"
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            old = None
        if old != manifest:
            changed = [k for k in manifest if not isinstance(old, dict) or old.get(k) != manifest[k]]
            raise UserError(
                f"The work directory {work} holds an interrupted preparation with other "
                f"{', '.join(changed) or 'contents'} than this command. Fix: run the original command again "
                f"to finish it, or delete {work} to start over (or pass another --work-dir)."
            )
        return
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"Cannot create the work directory {work} ({err.strerror or err}). Fix: pass a "
                        "writable --work-dir.") from None
    _write_json_atomically(path, manifest)


def _train_bpe(target: Path, shards: Sequence[dict[str, Any]], args: argparse.Namespace, vocab_size: int) -> None:
    """Learn the BPE from the training documents (in plan order, up to --bpe-sample-bytes) and keep
    it in the work directory, so a resumed run tokenizes with exactly the same vocabulary."""

    def texts() -> Iterator[str]:
        budget = args.bpe_sample_bytes
        for shard in shards:
            for _, text in shard_documents(shard, args.jsonl_field, args.parquet_column):
                if not is_validation(text, args.val_fraction):
                    yield text
                    budget -= len(text)
                    if budget <= 0:
                        return

    print(f"Training a byte-level BPE of {vocab_size} tokens on the training documents.", file=sys.stderr, flush=True)
    tokenizer = TrainedBPE.train(texts(), vocab_size)
    atomic_write(target, tokenizer.data)


def _remove_stale_temporaries(output: str) -> None:
    """Leftovers of a flat store build killed mid-way (``.NAME.tmp-PID-XXXX`` of a dead PID)."""
    if is_remote(output):
        return
    path = Path(output)
    for tmp in path.parent.glob(f".{path.name}.tmp-*"):
        try:
            pid = int(tmp.name.rsplit("-", 2)[-2])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            pass


def _assemble(output: str, fmt: str, shard_dir: Path, shards: Sequence[dict[str, Any]],
              records: dict[int, dict[str, Any]], files: Sequence[InputFile], tokenizer: Tokenizer,
              settings: dict[str, Any], manifest_sha: str) -> TokenStore:
    """Concatenate the shards in plan order into the store (meta.json last)."""
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    documents = {split: sum(records[i]["splits"][split]["documents"] for i in records) for split in SPLITS}
    by_file: dict[str, int] = {}
    for i in sorted(records):
        for path, count in records[i]["documents_by_file"].items():
            by_file[path] = by_file.get(path, 0) + count
    sources = [{"path": f.path, "kind": f.kind, "bytes": f.size, "documents": by_file.get(f.path, 0)} for f in files]

    def chunks(split: str) -> Iterable[np.ndarray]:
        for i in range(len(shards)):
            with open(shard_files(shard_dir, i)[split], "rb") as f:
                while True:
                    block = np.fromfile(f, dtype=dtype, count=READ_BLOCK_TOKENS)
                    if block.size == 0:
                        break
                    yield block

    _remove_stale_temporaries(output)
    prepare_record = {**settings, "manifest_sha256": manifest_sha, "shards": len(shards)}
    return build_store(output, {split: chunks(split) for split in SPLITS}, tokenizer, sources,
                       documents=documents, format=fmt, extra_meta={"prepare": prepare_record})


if __name__ == "__main__":
    sys.exit(main())

"""Loader-only throughput: tokens/s that one process's BatchLoader delivers at gpt_small's shape.

    .venv/bin/python tools/bench/bench_loader.py                       # 100M-token flat store, 20 steps
    .venv/bin/python tools/bench/bench_loader.py --format zarr3 --steps 10 --processes 4

It writes a synthetic uint16 token store (random ids below GPT-2's 50257, ``--tokens`` of them)
into a temporary directory with the real store writer, opens it through the real ``mixture``
strategy, and times the real ``BatchLoader`` (grain threads and prefetch as the trainer uses them)
at seq_len 1024 and a global batch of 256; ``--processes N`` times process 0 of N, which reads
256/N rows per step. It prints one JSON line and a table. For comparison it prints what a
gpt_small train step consumes per host at a given MFU on a few accelerators: computed from the
model's FLOPs per token and the chips' peak, not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for runner

from runner.data.loader import BatchLoader  # noqa: E402
from runner.data.store import write_store  # noqa: E402
from runner.data.strategies import build_strategy  # noqa: E402

SEQ_LEN, GLOBAL_BATCH, VOCAB = 1024, 256, 50257  # gpt_small (conf/job/gpt_small.yaml), GPT-2's vocabulary


@dataclass(frozen=True)
class RandomVocab:
    """Just what the store writer needs to know of a tokenizer."""

    name: str = "bench-random"
    vocab_size: int = VOCAB
    eod_id: int = VOCAB - 1


def make_store(directory: Path, tokens: int, fmt: str, doc_tokens: int = 1 << 20) -> Path:
    rng = np.random.default_rng(0)

    def docs():  # type: ignore[no-untyped-def]
        left = tokens
        while left > 0:
            n = min(doc_tokens, left) - 1  # each document gets an eod
            yield rng.integers(0, VOCAB - 1, n, dtype=np.uint16)
            left -= n + 1

    path = directory / f"bench-{fmt}"
    write_store(path, {"train": docs(), "val": [np.arange(SEQ_LEN * 2, dtype=np.uint16)]}, RandomVocab(),
                [{"kind": "bench", "tokens": tokens}], format=fmt)
    return path


def time_loader(store: Path, steps: int, processes: int, threads: int, prefetch: int) -> dict[str, float]:
    strategy = build_strategy("mixture", {"sources": [{"path": str(store)}]})
    dataset = strategy.train(SEQ_LEN, seed=0, global_batch=GLOBAL_BATCH)
    loader = BatchLoader(dataset, global_batch=GLOBAL_BATCH, accumulate_steps=1, start_step=0, process_index=0,
                         process_count=processes, prefetch=prefetch, num_threads=threads)
    try:
        first = next(loader)  # threads started, first batch in
        rows = first["x"].shape[0] * first["x"].shape[1]
        for _ in range(prefetch + 1):  # drain the prefetched batches: time steady-state production only
            next(loader)
        start = time.perf_counter()
        for _ in range(steps):
            next(loader)
        pipelined = time.perf_counter() - start
        start = time.perf_counter()
        sync_steps = max(1, steps // 4)
        for step in range(10_000, 10_000 + sync_steps):
            loader.batch_at(step)  # no prefetch, one thread: the cost of one batch
        sync = (time.perf_counter() - start) / sync_steps
    finally:
        loader.close()
    return {"rows_per_process": int(rows), "tokens_per_s": steps * rows * SEQ_LEN / pipelined,
            "steps_per_s": steps / pipelined, "sync_batch_ms": sync * 1e3}


def train_step_needs(mfu: float) -> dict[str, float]:
    """Tokens/s a gpt_small train step consumes per host at ``mfu`` (computed, not measured)."""
    from runner.models.gpt.model import GPTConfig, flops_per_token
    from runner.parallel.topology import CHIPS

    cfg = GPTConfig(vocab_size=50304, context_length=SEQ_LEN, d_model=768, n_layers=12, n_heads=12)
    per_token = flops_per_token(cfg, SEQ_LEN)
    hosts = {"h100 x8 host": ("h100", 8), "v4 host (4 chips)": ("v4", 4), "v5e host (8 chips)": ("v5e", 8),
             "v6e host (8 chips)": ("v6e", 8)}
    return {name: CHIPS[chip].peak_bf16_flops * n * mfu / per_token for name, (chip, n) in hosts.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=100_000_000, help="store size (default 100M)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument("--format", choices=("flat", "zarr3"), default="flat")
    parser.add_argument("--processes", type=int, default=1, help="time process 0 of this many (default 1)")
    parser.add_argument("--threads", type=int, default=2, help="grain threads (data.num_threads, default 2)")
    parser.add_argument("--prefetch", type=int, default=2, help="batches ahead (data.prefetch, default 2)")
    parser.add_argument("--mfu", type=float, default=0.4, help="MFU assumed for the train-step comparison")
    parser.add_argument("--dir", default=None, help="where to write the store (default: a temporary directory)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-loader-") as tmp:
        start = time.perf_counter()
        store = make_store(Path(tmp), args.tokens, args.format)
        write_s = time.perf_counter() - start
        result = time_loader(store, args.steps, args.processes, args.threads, args.prefetch)
    needs = train_step_needs(args.mfu)
    record = {
        "bench": "loader", "format": args.format, "store_tokens": args.tokens, "store_write_s": round(write_s, 2),
        "seq_len": SEQ_LEN, "global_batch": GLOBAL_BATCH, "processes": args.processes, "steps": args.steps,
        "threads": args.threads, "prefetch": args.prefetch, "cpus": os.cpu_count(),
        **{k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()},
        "gpt_small_step_needs_tokens_per_s_per_host": {k: round(v) for k, v in needs.items()},
        "assumed_mfu": args.mfu,
    }
    print(json.dumps(record))
    rows = [
        ("store", f"{args.format}, {args.tokens / 1e6:.0f}M uint16 tokens, written in {write_s:.1f} s"),
        ("shape", f"seq {SEQ_LEN}, global batch {GLOBAL_BATCH}, process 0 of {args.processes} "
                  f"({result['rows_per_process']} rows/step)"),
        ("loader tokens/s (this process)", f"{result['tokens_per_s']:,.0f}"),
        ("loader steps/s", f"{result['steps_per_s']:.2f}"),
        ("one batch, synchronous", f"{result['sync_batch_ms']:.1f} ms"),
    ] + [(f"gpt_small step needs, {name}", f"{v:,.0f} tokens/s at {args.mfu:.0%} MFU (computed)")
         for name, v in needs.items()]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The longest row each context-parallel kind fits, by `mode=compile` on this machine (no TPU).

For each kind (job.model.context_parallel) and each setting (plain: nothing tiled; loss: the
defaults, the loss tiled by auto; tiled: that and the feed-forward in 8 tiles; offload: tiled,
with each layer's input and the optimizer state in host memory), compiles the train step at the
given lengths in increasing order and stops at the first that does not fit (or does not compile:
splash's tables past scalar memory). Each compile is one `python -m runner ... mode=compile` process; its JSON report is
appended to --out at once, with the kind, setting and length, so a second run skips what is there.

    .venv/bin/python tools/bench/longest_context.py --out docs/records/bench_longest_context.jsonl \\
        --kinds ring --settings offload --lengths 4194304
    .venv/bin/python tools/bench/longest_context.py --table docs/records/bench_longest_context.jsonl  # the Markdown table

The base is Llama 3 8B on a v5p-256, `mesh.fsdp=4 mesh.context=32`, 4 rows a step (BASE).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE = ["job=llama3_8b", "topology=v5p-256", "mode=compile", "data.strategy=synthetic", "train.batch_size=4",
        "train.accumulate_steps=1", "eval.batch_size=4", "mesh.fsdp=4", "mesh.context=32", "logging.wandb=disabled"]
SETTINGS = {
    "plain": ["job.model.loss_tiles=1", "job.model.mlp_tiles=1"],
    "loss": ["job.model.loss_tiles=0", "job.model.mlp_tiles=1"],  # the defaults: the loss tiled by auto
    "tiled": ["job.model.loss_tiles=0", "job.model.mlp_tiles=8"],
    "offload": ["job.model.loss_tiles=0", "job.model.mlp_tiles=8", "job.model.remat=offload",
                "optimizer.offload=host"],
}
KINDS = ("allgather", "ring", "ulysses", "usp")
GiB = 2**30


def compile_once(kind: str, setting: str, length: int, extra: list[str]) -> dict:
    """One mode=compile process: its JSON report, with what was asked and how long it took."""
    args = [*BASE, *SETTINGS[setting], f"train.seq_len={length}", f"job.model.context_length={length}",
            f"job.model.context_parallel={kind}", *extra]
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "runner", *args], cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"report": "compile"')]
    report = json.loads(lines[-1]) if lines else {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return {"kind": kind, "setting": setting, "length": length, "extra": extra, "exit": proc.returncode,
            "seconds": round(time.perf_counter() - start, 1), "command": "python -m runner " + " ".join(args),
            **{k: report.get(k) for k in ("fits", "memory", "limit_bytes", "compiler_error", "required_bytes",
                                          "collective_bytes", "attention", "error")}}


def search(out: Path, kinds: list[str], settings: list[str], lengths: list[int], extra: list[str]) -> None:
    done = {(r["kind"], r["setting"], r["length"], " ".join(r.get("extra", []))): r for r in _records(out)}
    for kind in kinds:
        for setting in settings:
            for length in sorted(lengths):
                record = done.get((kind, setting, length, " ".join(extra)))
                if record is None:
                    record = compile_once(kind, setting, length, extra)
                    with out.open("a") as f:
                        f.write(json.dumps(record) + "\n")
                print(f"{kind:<10}{setting:<9}{length:>10,}  exit {record['exit']}  {_memory(record)}"
                      f"  ({record['seconds']} s)", flush=True)
                if record["exit"] != 0:
                    break


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _memory(record: dict) -> str:
    memory = record.get("memory")
    if memory:
        host = f" + {memory['host'] / GiB:.2f} GiB host" if memory.get("host") else ""
        return f"{memory['total'] / GiB:.2f} GiB{host}"
    if record.get("compiler_error") and "smem" in record["compiler_error"]:
        return "splash's tables exceed scalar memory"
    if record["exit"] < 0:  # killed by a signal: XLA aborted (or the machine ran out of memory)
        return f"the compile aborted (signal {-record['exit']}) after {record['seconds']:.0f} s on this machine"
    if record.get("required_bytes"):
        return f"{record['required_bytes'] / GiB:.2f} GiB asked"
    return record.get("error") or "no report"


def table(path: Path) -> str:
    """Per kind and setting: the longest length that fit, and the first that did not."""
    rows = ["| `context_parallel` | setting | longest that fits | its memory (device + host) | next length |",
            "| --- | --- | ---: | ---: | --- |"]
    by_series: dict[tuple[str, str, str], list[dict]] = {}
    for record in _records(path):
        by_series.setdefault((record["kind"], record["setting"], " ".join(record.get("extra", []))), []).append(record)
    for (kind, setting, extra), records in sorted(by_series.items(),
                                                   key=lambda kv: (kv[0][2], KINDS.index(kv[0][0]), kv[0][1])):
        records.sort(key=lambda r: r["length"])
        fits = [r for r in records if r["exit"] == 0]
        fails = [r for r in records if r["exit"] != 0]
        best = fits[-1] if fits else None
        after = f"{fails[0]['length']:,}: {_memory(fails[0])}" if fails else "not tried"
        setting = f"{setting} `{extra}`" if extra else setting
        rows.append(f"| {kind} | {setting} | {best['length'] if best else 0:,} | "
                    f"{_memory(best) if best else ''} | {after} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "records" / "bench_longest_context.jsonl")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--lengths", default="1048576,2097152,4194304")
    parser.add_argument("--set", default="", help="more overrides, space-separated (another mesh or batch)")
    parser.add_argument("--table", type=Path, help="print the Markdown table of these records and exit")
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        return 0
    search(args.out, args.kinds.split(","), args.settings.split(","), [int(n) for n in args.lengths.split(",")],
           args.set.split())
    return 0


if __name__ == "__main__":
    sys.exit(main())

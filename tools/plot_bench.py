"""Plot tools/bench.py results: throughput (runner vs baseline) and a step-time breakdown.

    .venv/bin/python tools/plot_bench.py bench.jsonl -o docs/bench_cpu.png

Reads the JSON lines tools/bench.py prints (or appends with --out); lines that are not JSON
objects with "bench": "train" are skipped, so a captured stdout works too. Needs matplotlib
(``pip install -e .[bench]``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def load(paths: list[str]) -> list[dict[str, Any]]:
    records = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("bench") == "train":
                records.append(record)
    return records


def plot(records: list[dict[str, Any]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in records]
    xs = range(len(records))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    w = 0.38
    runner = [r["tokens_per_s"] for r in records]
    base = [r["baseline_tokens_per_s"] for r in records]
    ax1.bar([x - w / 2 for x in xs], runner, w, label="runner (real loop)")
    ax1.bar([x + w / 2 for x in xs], base, w, label="baseline (bare jit loop)")
    for x, r in zip(xs, records):
        ax1.text(x, max(r["tokens_per_s"], r["baseline_tokens_per_s"]) * 1.02, f"{r['ratio']:.3f}x",
                 ha="center", va="bottom", fontsize=9)
    ax1.set_xticks(list(xs), labels)
    ax1.set_ylabel("tokens/s")
    ax1.set_title("Throughput (ratio runner / baseline)")
    ax1.legend(fontsize=8, loc="lower right")
    ax1.margins(y=0.15)

    # Step time: the baseline's step next to runner's, split into its step function (timed in a
    # bare loop), the loop around it, and the slowest step overlapping an asynchronous save.
    ms = 1e3
    b = [r["baseline_step_time_s"] * ms for r in records]
    total = [r["step_time_s"] * ms for r in records]
    fn = [min((r.get("runner_step_only_step_time_s") or r["step_time_s"]) * ms, t) for r, t in zip(records, total)]
    loop_extra = [t - f for t, f in zip(total, fn)]
    save = [max((r.get("save_step_time_s") or 0.0) * ms - t, 0.0) for r, t in zip(records, total)]
    left = [x - w / 2 for x in xs]
    right = [x + w / 2 for x in xs]
    ax2.bar(left, b, w, label="baseline step", color="tab:orange")
    ax2.bar(right, fn, w, label="runner step fn (bare loop)", color="tab:blue")
    ax2.bar(right, loop_extra, w, bottom=fn, label="runner loop extra", color="tab:green")
    ax2.bar(right, save, w, bottom=total, label="extra of slowest step in async save", color="tab:red",
            alpha=0.35, hatch="//")
    ax2.set_xticks(list(xs), labels)
    ax2.set_ylabel("ms per step")
    ax2.set_title("Step time breakdown (median)")
    ax2.legend(fontsize=7, loc="upper left")
    ax2.margins(y=0.25)
    backend = {r.get("backend", "?") for r in records}
    fig.suptitle(f"tools/bench.py on {', '.join(sorted(backend))} ({records[0].get('cpus')} CPUs)")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="files of tools/bench.py JSON lines")
    parser.add_argument("-o", "--output", default="bench.png")
    args = parser.parse_args(argv)
    records = load(args.inputs)
    if not records:
        print(f"error: no tools/bench.py records in {', '.join(args.inputs)}", file=sys.stderr)
        return 2
    plot(records, args.output)
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())

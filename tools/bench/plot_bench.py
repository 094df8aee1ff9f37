"""Plot tools/bench/bench.py results: throughput (runner vs baseline) and a step-time breakdown.

    .venv/bin/python tools/bench/plot_bench.py bench.jsonl -o docs/records/bench_cpu.png

Reads the JSON lines tools/bench/bench.py prints (or appends with --out); lines that are not JSON
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

    n = len(records)
    fig = plt.figure(figsize=(max(10, 3.4 * n), 8.5))
    grid = fig.add_gridspec(2, n, height_ratios=[1, 1])

    # Throughput as the headline ratio (configurations differ by orders of magnitude in tokens/s):
    # the median over rounds as a bar, each round as a dot, the goal as a line.
    ax1 = fig.add_subplot(grid[0, :])
    xs = list(range(n))
    ratios = [r["ratio"] for r in records]
    ax1.bar(xs, ratios, 0.5, color="tab:blue", alpha=0.75, label="runner / baseline tokens/s (median of rounds)")
    for x, r in zip(xs, records):
        rounds = r.get("ratio_per_round") or []
        ax1.scatter([x] * len(rounds), rounds, color="black", s=12, zorder=3,
                    label="one round" if x == 0 else None)
        ax1.text(x, max([r["ratio"], *rounds]) + 0.01, f"{r['ratio']:.3f}", ha="center", va="bottom", fontsize=9)
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.axhline(0.97, color="tab:red", lw=0.8, ls="--", label="goal 0.97")
    ax1.set_xticks(xs, [f"{r['label']}\n{r['tokens_per_s']:,.0f} vs {r['baseline_tokens_per_s']:,.0f} tokens/s"
                        for r in records], fontsize=8)
    low = min(min(r.get("ratio_per_round") or [r["ratio"]]) for r in records)
    ax1.set_ylim(min(0.8, low - 0.05), 1.3)
    ax1.set_ylabel("runner / baseline")
    ax1.set_title("Throughput of runner's loop relative to a bare jitted loop")
    ax1.legend(fontsize=8, loc="upper center", ncol=3)

    # Step time, one panel per configuration on its own scale: the baseline's step next to
    # runner's, split into its step function (timed in a bare loop) and the loop around it, and
    # the extra of the slowest step overlapping an asynchronous save.
    ms = 1e3
    for i, r in enumerate(records):
        ax = fig.add_subplot(grid[1, i])
        total = r["step_time_s"] * ms
        fn = min((r.get("runner_step_only_step_time_s") or r["step_time_s"]) * ms, total)
        save = max((r.get("save_step_time_s") or 0.0) * ms - total, 0.0)
        ax.bar([0], [r["baseline_step_time_s"] * ms], 0.6, color="tab:orange", label="baseline step")
        ax.bar([1], [fn], 0.6, color="tab:blue", label="runner's step function (bare loop)")
        ax.bar([1], [total - fn], 0.6, bottom=[fn], color="tab:green", label="runner's loop around it")
        ax.bar([1], [save], 0.6, bottom=[total], color="tab:red", alpha=0.35, hatch="//",
               label="extra of the slowest step during an async save")
        ax.set_xticks([0, 1], ["baseline", "runner"])
        ax.set_title(f"{r['label']}: ms per step (median)", fontsize=9)
        if i == 0:
            ax.set_ylabel("ms per step")
            handles, names = ax.get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=4, fontsize=8)
    backend = {r.get("backend", "?") for r in records}
    fig.suptitle(f"tools/bench/bench.py on {', '.join(sorted(backend))} ({records[0].get('cpus')} CPUs)")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="files of tools/bench/bench.py JSON lines")
    parser.add_argument("-o", "--output", default="bench.png")
    args = parser.parse_args(argv)
    records = load(args.inputs)
    if not records:
        print(f"error: no tools/bench/bench.py records in {', '.join(args.inputs)}", file=sys.stderr)
        return 2
    plot(records, args.output)
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`runner plot RUN_OR_SWEEP_DIR... --out plot.png`: loss, held-out metrics and the learning rate
against step (or tokens) for one run, several, or every member of a sweep, read from their
metrics.jsonl; each line labelled by the settings that differ between the runs.

No wandb, no TensorBoard: the files a run leaves are enough, local or on gs://.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from runner.checkpoint import storage
from runner.errors import UserError
from runner.exits import USAGE_EXIT_CODE
from runner.main.sweep import SUMMARY_FILE

# Settings that never tell two runs apart in a legend (where they live, how they log).
_UNLABELLED = ("run.", "logging.", "hydra", "distributed.", "checkpoint.", "debug.")


@dataclass
class Run:
    directory: str
    records: list[dict[str, Any]]
    settings: dict[str, Any] = field(default_factory=dict)
    label: str = ""

    def series(self, key: str, x: str) -> tuple[list[float], list[float]]:
        points = [(r[x], r[key]) for r in self.records if isinstance(r.get(key), (int, float)) and x in r]
        return [p[0] for p in points], [p[1] for p in points]


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): tree}


def _read_run(directory: Any) -> Run:
    from omegaconf import OmegaConf

    path = storage.path(directory)
    metrics = path / "metrics.jsonl"
    if not metrics.exists():
        raise UserError(f"{directory} has no metrics.jsonl. Fix: give run directories (or sweep directories, "
                        "which hold summary.json) of runs that logged at least one step.")
    records = []
    for line in metrics.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
    settings = {}
    if (path / "spec.yaml").exists():
        settings = _flatten(OmegaConf.to_container(OmegaConf.create((path / "spec.yaml").read_text())))
    return Run(str(directory), records, settings)


def _members(sweep: Any) -> list[str]:
    """A sweep's member run directories, as its summary lists them (relative ones are found from
    the sweep directory's ancestors, where the sweep was started)."""
    summary = json.loads((storage.path(sweep) / SUMMARY_FILE).read_text())
    found = []
    for member in summary["members"]:
        run_dir = member.get("run_dir") or ""
        if not run_dir or member.get("status") == "failed":
            continue
        if storage.is_remote(run_dir) or Path(run_dir).is_absolute() or storage.is_remote(sweep):
            found.append(run_dir)
            continue
        here = Path(sweep).absolute()
        base = next((p for p in [Path.cwd(), *here.parents] if (p / run_dir / "metrics.jsonl").exists()), Path.cwd())
        found.append(str(base / run_dir))
    return found


def load_runs(paths: Sequence[str]) -> list[Run]:
    """The runs behind `paths` (run or sweep directories), each labelled by what differs."""
    directories: list[str] = []
    for p in paths:
        directories += _members(p) if (storage.path(p) / SUMMARY_FILE).exists() else [p]
    if not directories:
        raise UserError(f"Nothing to plot in {' '.join(paths)}: no run directory and no finished sweep member. "
                        "Fix: give run directories or sweep directories (runs/sweeps/NAME).")
    runs = [_read_run(d) for d in dict.fromkeys(directories)]
    keys = sorted({k for run in runs for k in run.settings if not k.startswith(_UNLABELLED)})
    differing = [k for k in keys if len({repr(run.settings.get(k)) for run in runs}) > 1]
    for run in runs:
        run.label = ", ".join(f"{k}={_short(run.settings.get(k))}" for k in differing) or storage.name(run.directory)
    return runs


def _short(value: Any) -> str:
    """A setting as a legend shows it: floats to 4 significant digits (an Optuna-sampled learning
    rate has 17)."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def panel_title(key: str) -> str:
    """What an eval metric is: a held-out loss, or a (multiple-choice or lm-eval) accuracy."""
    name = key.removeprefix("eval/")
    for suffix, what in (("/loss", "held-out loss"), ("/acc_norm", "accuracy, length-normalised"),
                         ("/acc", "accuracy")):
        if name.endswith(suffix):
            return f"{what}: {name.removesuffix(suffix)}"
    return name


def plot(runs: Sequence[Run], out: str, x: str = "step") -> list[str]:
    """Draw the panels into `out` (any format matplotlib writes); returns the panel titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xkey = "tokens_seen" if x == "tokens" else "step"
    eval_keys = sorted({k for run in runs for r in run.records for k in r
                        if k.startswith("eval/") and k.endswith(("/loss", "/acc", "/acc_norm"))})
    panels = [("train loss", ["loss"]), *[(panel_title(k), [k]) for k in eval_keys],
              ("learning rate", ["lr"])]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, (title, keys) in zip(axes[:, 0], panels):
        for run in runs:
            for key in keys:
                xs, ys = run.series(key, xkey)
                if xs:
                    ax.plot(xs, ys, marker="o" if len(xs) < 20 else None, markersize=3, label=run.label)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("tokens" if x == "tokens" else "step")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    if len(runs) > 1 or labels:
        fig.legend(handles, labels, loc="lower center", ncol=1, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.01 + 0.022 * min(len(runs), 8) / len(panels) * 3, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [title for title, _ in panels]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="runner plot", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", metavar="RUN_OR_SWEEP_DIR", help="run directories or sweep directories")
    parser.add_argument("--out", default="plot.png", help="the picture to write (default plot.png; .svg, .pdf too)")
    parser.add_argument("--x", choices=("step", "tokens"), default="step", help="the horizontal axis")
    args = parser.parse_args(argv)
    try:
        runs = load_runs(args.paths)
        panels = plot(runs, args.out, args.x)
    except UserError as err:
        print("error: " + " ".join(str(err).split()), file=sys.stderr)
        return USAGE_EXIT_CODE
    print(f"{args.out}: {len(runs)} run(s); panels: {', '.join(panels)}")
    for run in runs:
        print(f"  {run.label}: {run.directory}")
    return 0

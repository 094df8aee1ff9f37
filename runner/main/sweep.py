"""Hydra multirun sweeps: deterministic directories, one summary, failures that don't spread.

The sweep's directory is derived from its command line (no timestamps), so rerunning the same
sweep after a crash finds it again: finished members say so and are skipped, unfinished ones
resume from their newest checkpoint. Members run one after another in one process.

Each member returns its objective (`run.objective`, see `objective`) to the sweeper, so Optuna
and other optimizing sweepers work; the summary keeps every member ever run, also when a
sweeper reruns with new trials under the same member numbers.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

from runner.checkpoint import storage
from runner.checkpoint.files import atomic_write_json, read_jsonl
from runner.exits import CRASHED_EXIT_CODE, PREEMPTED_EXIT_CODE, of_members

SUMMARY_FILE = "summary.json"


def _value(argv: Sequence[str], key: str, default: str) -> str:
    for arg in argv:
        k, _, v = arg.partition("=")
        if k.lstrip("+~") == key:
            return v
    return default


def _canonical(arg: str) -> str:
    """An override as it identifies a sweep: a list of values to sweep (`a,b`) in sorted order, so
    the order they are written in does not make another sweep."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        override = OverridesParser.create().parse_overrides([arg])[0]
    except Exception:  # Hydra reports a bad override itself, later
        return arg
    if override.is_discrete_sweep() and not override.value().tags and not override.value().shuffle:
        values = sorted(override.sweep_string_iterator())
        return f"{override.get_key_element()}={','.join(values)}"
    return arg


def sweep_root(argv: Sequence[str]) -> Any:
    """`<run.root>/sweeps/<name>`: `run.sweep` if given, else the job and a hash of the command
    (its overrides in sorted order, each sweep's values sorted); local, or on gs:// with a gs://
    run.root."""
    root = _value(argv, "run.root", "runs")
    name = _value(argv, "run.sweep", "")
    if not name:
        args = sorted(_canonical(a) for a in argv if not a.startswith("-") and not a.startswith("hydra"))
        digest = hashlib.sha256("\n".join(args).encode()).hexdigest()[:10]
        name = f"{_value(argv, 'job', 'gpt_tiny')}-{digest}"
    return storage.path(root) / "sweeps" / name


def sampler_seed(argv: Sequence[str]) -> list[str]:
    """With Optuna (hydra/sweeper=optuna) and no sampler seed given, one derived from the sweep, so
    the same command asks the same trials again: a rerun finds their members finished and the
    study it rebuilds is the whole sweep's. Returns the override to add (or none)."""
    if _value(argv, "hydra/sweeper", "") != "optuna" or any(a.startswith("hydra.sweeper.sampler.seed=") for a in argv):
        return []
    if _value(argv, "hydra/sweeper/sampler", "tpe") == "grid":  # a grid is the same every time, and has no seed
        return []
    digest = hashlib.sha256(str(sweep_root(argv)).encode()).hexdigest()
    return [f"hydra.sweeper.sampler.seed={int(digest[:8], 16) % 2**31}"]


def member_overrides(overrides: Sequence[str], limit: int = 64) -> list[list[str]]:
    """Override lists standing for every member of a sweep, so all can be checked before any
    trains: each combination of the sweep overrides' values (what Hydra's basic sweeper runs)
    when there are at most `limit`, else each value once with the other sweeps at their first.
    An `interval(a, b)` (Optuna's) stands by its two ends. Hydra's own overrides (hydra.*,
    hydra/...) are left out: they configure Hydra, not the run."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    axes: list[list[str]] = []
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.get_key_element()
        if key.lstrip("+~").startswith(("hydra.", "hydra/")) or key.lstrip("+~") == "hydra":
            continue
        if not override.is_sweep_override():
            axes.append([override.input_line])
        elif override.is_discrete_sweep():
            axes.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            interval = override.value()
            axes.append([f"{key}={interval.start}", f"{key}={interval.end}"])
    if math.prod(len(values) for values in axes) <= limit:
        return [list(member) for member in itertools.product(*axes)]
    firsts = [values[0] for values in axes]
    return [firsts[:i] + [value] + firsts[i + 1:] for i, values in enumerate(axes) for value in values]


def _records(run_dir: Any) -> list[dict[str, Any]]:
    return read_jsonl(run_dir / "metrics.jsonl")


def objective(run_dir: Any, name: str) -> tuple[str, float]:
    """(metric, value): the last logged value of `name`, or with `name` empty of the first
    held-out loss the run logged (eval/<first evaluator>/loss); NaN when it was never logged
    (the sweeper then counts the member as failed)."""
    records = _records(run_dir)
    if not name:
        name = next((k for r in records for k in r if k.startswith("eval/") and k.endswith("/loss")), "eval/loss")
    values = [r[name] for r in records if isinstance(r.get(name), (int, float))]
    return name, float(values[-1]) if values else math.nan


def last_metrics(run_dir: Any) -> dict[str, float]:
    """The final train and eval numbers a member logged (empty if it logged none)."""
    merged: dict[str, float] = {}
    for record in _records(run_dir):
        merged.update({k: v for k, v in record.items() if k == "step" or k == "loss" or k.endswith("/loss")})
    return merged


@dataclass
class SweepSummary:
    """Member, overrides, final metrics and status. Each member writes its own record (members
    may run in other processes, e.g. on SLURM) and summary.json is rebuilt from all of them."""

    root: Any  # an epath.Path: local, or gs://

    def record(self, number: int, overrides: Sequence[str], run_dir: str, status: str,
               message: str = "", objective_name: str = "", exit_code: int = 0) -> dict[str, Any]:
        """Write this member's record (one file per member number and overrides: a sweeper's
        later trials never replace earlier ones) and rebuild summary.json from all records.
        `exit_code`: the code the member's run would have exited with on its own (runner.exits)."""
        entry: dict[str, Any] = {"member": number, "overrides": list(overrides), "run_dir": run_dir,
                                 "status": status, "exit_code": exit_code,
                                 "metrics": last_metrics(storage.path(run_dir)) if run_dir else {}}
        if run_dir:
            entry["objective_name"], value = objective(storage.path(run_dir), objective_name)
            entry["objective"] = None if status == "failed" or math.isnan(value) else value  # JSON has no NaN
        if message:
            entry["message"] = message
        members = self.root / "members"
        storage.makedirs(members)
        digest = hashlib.sha256("\n".join(sorted(overrides)).encode()).hexdigest()[:8]
        _write_json(members / f"{number}-{digest}.json", entry)
        _write_json(self.root / SUMMARY_FILE, {"members": self.members})
        return entry

    @property
    def members(self) -> list[dict[str, Any]]:
        files = [p for p in (self.root / "members").glob("*.json")]
        records = [json.loads(p.read_text()) for p in files]
        return sorted(records, key=lambda m: (m["member"], m["overrides"]))

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [m for m in self.members if m["status"] == "failed"]

    @property
    def exit_code(self) -> int:
        """The sweep's exit code, from its members' (runner.exits.of_members): one a rerun may fix
        first (a rerun skips the finished members), else the first other failure, else 0. (A record
        written before members kept their code: 1 if it failed, 75 if it stopped; a local sweep's
        "stopped (exit N)", N.)"""
        return of_members(m["exit_code"] if "exit_code" in m else _old_code(m["status"]) for m in self.members)

    def table(self) -> str:
        members = self.members
        lines = [f"sweep {self.root}: {len(members)} members, {len(self.failed)} failed"]
        for m in members:
            loss, value = m["metrics"].get("loss"), m.get("objective")
            shown = f"loss {loss:.4f}" if isinstance(loss, (int, float)) else ""
            if isinstance(value, (int, float)):
                shown += f" {m['objective_name']} {value:.4f}"
            elif m.get("objective_name"):
                shown += f" {m['objective_name']} nan"
            if m["status"] == "failed" and m.get("message"):
                reason = m["message"]
                shown += f" ({reason[:157] + '...' if len(reason) > 160 else reason})"
            lines.append(f"  [{m['status']}] {' '.join(m['overrides']) or '(no overrides)'} {shown}".rstrip())
        return "\n".join(lines)


def _old_code(status: str) -> int:
    """A member's code from the status of a record written before members kept their code."""
    stopped = re.fullmatch(r"stopped \(exit (\d+)\)", status)
    if stopped:
        return int(stopped.group(1))
    return {"failed": CRASHED_EXIT_CODE, "stopped (resumable)": PREEMPTED_EXIT_CODE}.get(status, 0)


def _write_json(path: Any, data: Any) -> None:
    atomic_write_json(path, data, indent=2)

"""Hydra multirun sweeps: deterministic directories, one summary, failures that don't spread.

The sweep's directory is derived from its command line (no timestamps), so rerunning the same
sweep after a crash finds it again: finished members say so and are skipped, unfinished ones
resume from their newest checkpoint. Members run one after another in one process.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from runner.files import atomic_write_json

SUMMARY_FILE = "summary.json"


def _value(argv: Sequence[str], key: str, default: str) -> str:
    for arg in argv:
        k, _, v = arg.partition("=")
        if k.lstrip("+~") == key:
            return v
    return default


def sweep_root(argv: Sequence[str]) -> Path:
    """`<run.root>/sweeps/<name>`: `run.sweep` if given, else the job and a hash of the command."""
    root = _value(argv, "run.root", "runs")
    name = _value(argv, "run.sweep", "")
    if not name:
        args = sorted(a for a in argv if not a.startswith("-") and not a.startswith("hydra"))
        digest = hashlib.sha256("\n".join(args).encode()).hexdigest()[:10]
        name = f"{_value(argv, 'job', 'gpt_tiny')}-{digest}"
    return Path(root) / "sweeps" / name


def last_metrics(run_dir: Path) -> dict[str, float]:
    """The final train and eval numbers a member logged (empty if it logged none)."""
    merged: dict[str, float] = {}
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            merged.update({k: v for k, v in record.items() if k == "step" or k == "loss" or k.endswith("/loss")})
    return merged


@dataclass
class SweepSummary:
    """Member, overrides, final metrics and status. Each member writes its own record (members
    may run in other processes, e.g. on SLURM) and summary.json is rebuilt from all of them."""

    root: Path

    def record(self, number: int, overrides: Sequence[str], run_dir: str, status: str,
               message: str = "") -> dict[str, Any]:
        entry: dict[str, Any] = {"member": number, "overrides": list(overrides), "run_dir": run_dir,
                                 "status": status, "metrics": last_metrics(Path(run_dir)) if run_dir else {}}
        if message:
            entry["message"] = message
        members = self.root / "members"
        members.mkdir(parents=True, exist_ok=True)
        _write_json(members / f"{number}.json", entry)
        _write_json(self.root / SUMMARY_FILE, {"members": self.members})
        return entry

    @property
    def members(self) -> list[dict[str, Any]]:
        files = sorted((self.root / "members").glob("*.json"), key=lambda p: int(p.stem))
        return [json.loads(p.read_text()) for p in files]

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [m for m in self.members if m["status"] == "failed"]

    def table(self) -> str:
        members = self.members
        lines = [f"sweep {self.root}: {len(members)} members, {len(self.failed)} failed"]
        for m in members:
            loss = m["metrics"].get("loss")
            shown = f"loss {loss:.4f}" if isinstance(loss, (int, float)) else ""
            lines.append(f"  [{m['status']}] {' '.join(m['overrides']) or '(no overrides)'} {shown}".rstrip())
        return "\n".join(lines)


def _write_json(path: Path, data: Any) -> None:
    atomic_write_json(path, data, indent=2)

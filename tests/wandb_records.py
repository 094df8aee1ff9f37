"""Read the records of a wandb offline run file (`run-<id>.wandb`): runner.observability.wandb_history's reader."""

from __future__ import annotations

from pathlib import Path

from runner.observability.wandb_history import records  # noqa: F401  (the tests' name for it)


def launches(run_dir: Path) -> list[dict]:
    """Per launch (oldest first): the wandb run id, whether it was marked preempting, its exit code."""
    found = []
    for launch in sorted((run_dir / "wandb").glob("offline-run-*")):
        (file,) = launch.glob("run-*.wandb")
        kinds = {r.WhichOneof("record_type"): r for r in records(file)}
        found.append({"id": kinds["run"].run.run_id, "preempting": "preempting" in kinds,
                      "exit_code": kinds["exit"].exit.exit_code if "exit" in kinds else None})
    return found

"""mode=eval: which checkpoint, and the spec to evaluate it with.

`python -m runner mode=eval run.dir=RUN` (or `eval.checkpoint=PATH`: a run directory, its
checkpoints/ directory, or one checkpoints/<step> directory) evaluates the newest complete
checkpoint there. The model, data, seed and train.seq_len come from the checkpoint's own saved
spec, so its parameters fit whatever the command line says about them; eval.*, topology, mesh
and logging come from the command line. BaseTrainer.run_eval does the rest and writes
`eval_results.json` into the checkpoint's step directory.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from runner.checkpoint import META, find_state_dir
from runner.errors import UserError
from runner.spec import ExecutionSpec, spec_from_dict

RESULTS_FILE = "eval_results.json"


def checkpoint_step_dir(spec: ExecutionSpec) -> Path:
    """The step directory mode=eval evaluates: the newest complete one under eval.checkpoint,
    else under run.dir."""
    where, key = (spec.eval.checkpoint, "eval.checkpoint") if spec.eval.checkpoint else (spec.run.dir, "run.dir")
    try:
        return find_state_dir(where, key=key).parent
    except UserError:
        raise UserError(
            f"mode=eval found no checkpoint to evaluate: {key}={where!r} holds no complete checkpoint. Fix: "
            "point eval.checkpoint (or run.dir) at a trained run's directory, its checkpoints/ directory, or "
            "one checkpoints/<step> directory."
        ) from None


def saved_meta(step_dir: Path) -> dict[str, Any]:
    """The checkpoint's JSON meta item (spec, model shapes, ...); {} if it has none."""
    file = step_dir / META / "metadata"
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def spec_for_checkpoint(spec: ExecutionSpec) -> ExecutionSpec:
    """The spec to evaluate the checkpoint with: its own job, data, seed and seq_len; the rest,
    and eval.checkpoint pinned to the chosen step directory, from `spec`."""
    step_dir = checkpoint_step_dir(spec)
    saved = saved_meta(step_dir).get("spec")
    try:
        own = spec_from_dict(saved) if saved else None
    except Exception:  # a spec of an older schema: the command line's model must then fit
        own = None
    if own is not None:
        spec = dataclasses.replace(spec, job=own.job, data=own.data, seed=own.seed,
                                   train=dataclasses.replace(spec.train, seq_len=own.train.seq_len))
    return dataclasses.replace(spec, eval=dataclasses.replace(spec.eval, checkpoint=str(step_dir.absolute())))

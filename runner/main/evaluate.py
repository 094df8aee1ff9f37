"""mode=eval: which checkpoint, and the spec to evaluate it with.

`python -m runner mode=eval run.dir=RUN` (or `eval.checkpoint=PATH`: a run directory, its
checkpoints/ directory, or one checkpoints/<step> directory) evaluates the newest complete
checkpoint there. The model, data, seed and train.seq_len come from the checkpoint's own saved
spec, so its parameters fit whatever the command line says about them; eval.*, topology, mesh
and logging come from the command line. `evaluate_checkpoint` restores only the parameters
(no optimizer state is read or built), runs every configured evaluator once, and writes
`eval_results.json` into the checkpoint's step directory.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import jax

from runner.checkpoint.checkpointer import META, STATE, find_state_dir, restore_tree
from runner.checkpoint.files import atomic_write_json
from runner.errors import UserError, first_line
from runner.evaluation.base import prepare_all, run_all
from runner.spec import ExecutionSpec, spec_from_dict
from runner.train.job import JOBS
from runner.train.state import TrainState

RESULTS_FILE = "eval_results.json"


def checkpoint_step_dir(spec: ExecutionSpec) -> Any:
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


def saved_meta(step_dir: Any) -> dict[str, Any]:
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
    return dataclasses.replace(spec, eval=dataclasses.replace(spec.eval, checkpoint=str(step_dir)))


def restore_for_eval(spec: ExecutionSpec) -> tuple[Any, TrainState, Any]:
    """(job, state, step directory): the job built for the checkpoint eval.checkpoint names (else
    the newest under run.dir) with only its parameters, model state, step, rng and guard restored (no
    optimizer state is read or built). `spec` should come from `spec_for_checkpoint`."""
    step_dir = checkpoint_step_dir(spec)
    job = JOBS.get(spec.job.trainer)(spec)
    abstract, sharding = job.program.abstract_state()
    wanted = {"step": abstract.step, "params": abstract.params, "rng": abstract.rng, "guard": abstract.guard}
    if abstract.model_state:
        wanted["model_state"] = abstract.model_state
    try:
        tree = restore_tree(step_dir / STATE, wanted, partial=True)
    except (ValueError, KeyError) as err:
        raise UserError(
            f"Cannot evaluate {step_dir}: its parameters do not fit this model ({first_line(err, 300)}). Fix: "
            "evaluate it with the model settings it was trained with (its checkpoints/<step>/meta holds them), "
            "or point eval.checkpoint elsewhere."
        ) from None
    job.program.state_sharding = sharding.replace(opt_state=())
    state = TrainState(step=tree["step"], apply_fn=job.model.apply, params=tree["params"], tx=job.program.tx,
                       opt_state=(), rng=tree["rng"], guard=tree["guard"], model_state=tree.get("model_state", {}))
    return job, state, step_dir


def evaluate_checkpoint(spec: ExecutionSpec) -> dict[str, Any]:
    """mode=eval: restore the parameters (and step) of the checkpoint eval.checkpoint names (else
    the newest under run.dir) into the job's model, run every configured evaluator once, and write
    eval_results.json into that step directory. Nothing is reused: a rerun recomputes and replaces
    the file."""
    spec = spec_for_checkpoint(spec)
    job, state, step_dir = restore_for_eval(spec)
    context = job.eval_context()
    t0 = time.perf_counter()
    with job.program.context():
        prepare_all(job.evaluators, context)
        metrics, texts = run_all(job.evaluators, context, state)
    step = int(state.step)
    record = {
        "step": step,
        "checkpoint": str(step_dir),
        "metrics": metrics,
        "texts": texts,
        "evaluators": spec.to_dict()["eval"]["evaluators"],
        "topology": spec.topology,
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "seconds": time.perf_counter() - t0,
        "computed_unix": time.time(),
    }
    if jax.process_index() == 0:
        out = atomic_write_json(step_dir / RESULTS_FILE, record, indent=2)
        lines = [f"Evaluated {step_dir} (step {step}) in {record['seconds']:.1f}s:"]
        lines += [f"  {k.removeprefix('eval/')} {v:.4f}" for k, v in metrics.items()]
        lines += [f"  {k.removeprefix('eval/')}: {v!r}" for k, v in texts.items()]
        lines.append(f"  results: {out}")
        print("\n".join(lines), flush=True)
    return record

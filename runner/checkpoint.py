"""Checkpoints through orbax: the train state plus a JSON record of what the run is.

Layout under the run directory::

    checkpoints/<step>/state/   orbax StandardSave of {"step", "params", "opt_state", "rng"}
    checkpoints/<step>/meta/    JSON: step, the resolved spec, data fingerprint, model shapes,
                                tracker run id, best-metric bookkeeping

Orbax writes each step into a temporary directory and renames it on commit, so an interrupted
save is never picked up; leftovers are removed when the manager opens.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from runner.errors import UserError
from runner.spec import CheckpointSpec

log = logging.getLogger(__name__)

STATE, META = "state", "meta"


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:400]


class CheckpointWriteError(UserError):
    """The checkpoint directory cannot be written (read-only, disk full)."""


@dataclass(frozen=True)
class Restored:
    step: int
    state: Any
    meta: dict[str, Any]


def _save_policy(spec: CheckpointSpec) -> policies.SaveDecisionPolicy:
    chosen: list[policies.SaveDecisionPolicy] = []
    if spec.every_steps:
        chosen.append(policies.FixedIntervalPolicy(spec.every_steps))
    if spec.every_minutes:
        # Seconds as a float: int() would turn every_minutes below 1/60 into "no interval".
        chosen.append(policies.ContinuousCheckpointingPolicy(minimum_interval_secs=spec.every_minutes * 60))
    if not chosen:  # only forced saves (final, preemption)
        chosen.append(policies.SpecificStepsPolicy(steps=()))
    return policies.AnySavePolicy(chosen)


def _preservation_policy(spec: CheckpointSpec) -> policies.PreservationPolicy:
    keep: list[policies.PreservationPolicy] = [policies.LatestN(spec.keep)]
    if spec.keep_every:
        keep.append(policies.EveryNSteps(spec.keep_every))
    if spec.keep_best:
        # BestN keeps the *last* n after sorting, so "min" sorts descending (reverse=True).
        keep.append(policies.BestN(get_metric_fn=_best_value(spec), reverse=spec.best_mode == "min",
                                   n=spec.keep_best, keep_checkpoints_without_metrics=False))
    return policies.AnyPreservationPolicy(keep)


def best_metric_name(spec: CheckpointSpec) -> str:
    """checkpoint.best_metric as logged: `eval/` in front, whether or not the user wrote it."""
    return spec.best_metric if spec.best_metric.startswith("eval/") else f"eval/{spec.best_metric}"


def _best_value(spec: CheckpointSpec) -> Callable[[dict[str, Any]], float]:
    """A save's best_metric; a save made between evaluations (metrics {}) ranks last."""
    worst = math.inf if spec.best_mode == "min" else -math.inf
    name = best_metric_name(spec)
    return lambda metrics: float(metrics.get(name, worst))


class Checkpointer:
    """Saves and restores one run's checkpoints; every process calls every method."""

    def __init__(self, directory: Path, spec: CheckpointSpec) -> None:
        self.directory = Path(directory).absolute()
        self.spec = spec
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=_save_policy(spec),
            preservation_policy=_preservation_policy(spec),
            # With best_fn set orbax also writes each save's metrics (checkpoints/<step>/metrics),
            # so the ranking survives restarts.
            best_fn=_best_value(spec) if spec.keep_best else None,
            best_mode=spec.best_mode,
            enable_async_checkpointing=spec.async_save,
            cleanup_tmp_directories=True,
            create=True,
        )
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=(STATE, META))
        except OSError as err:
            raise CheckpointWriteError(
                f"Cannot open the checkpoint directory {self.directory}: {err}. "
                "Fix: make it writable, free some space, or point run.dir somewhere else."
            ) from None

    # ------------------------------------------------------------------ queries

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def read_meta(self, step: int) -> dict[str, Any]:
        return self.manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]

    # ------------------------------------------------------------------ save

    def should_save(self, step: int) -> bool:
        """Whether the save policy asks for a save at `step`. Asked every step, so the common
        case (one process, a step interval, no time interval) is answered without orbax."""
        if jax.process_count() == 1 and not self.spec.every_minutes:
            if not self.spec.every_steps or step % self.spec.every_steps:
                return False
        return self.manager.should_save(step)

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any], force: bool = False,
             metrics: dict[str, float] | None = None) -> bool:
        """Start a save (asynchronous unless configured otherwise); returns whether it began.
        `metrics` (with checkpoint.keep_best: {best_metric: value}) rank it for BestN."""
        args = ocp.args.Composite(**{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)})
        try:
            return self.manager.save(step, args=args, force=force,
                                     metrics=(metrics or {}) if self.spec.keep_best else None)
        except Exception as err:  # OSError, or tensorstore's ValueError(OUT_OF_RANGE ...) for a full disk
            raise CheckpointWriteError(
                f"Saving checkpoint step {step} into {self.directory} failed: {_first_line(err)}. Earlier checkpoints "
                "are untouched. Fix: free disk space or make the directory writable, then rerun the same "
                "command to resume from the newest complete checkpoint."
            ) from None

    def wait(self) -> None:
        """Block until every pending save is committed."""
        try:
            self.manager.wait_until_finished()
        except Exception as err:  # tensorstore reports a full disk as ValueError(OUT_OF_RANGE ...)
            raise CheckpointWriteError(
                f"A checkpoint save into {self.directory} failed: {_first_line(err)}. Earlier checkpoints are untouched. "
                "Fix: free disk space or make the directory writable, then rerun to resume."
            ) from None

    def close(self) -> None:
        self.wait()
        self.manager.close()

    # ------------------------------------------------------------------ restore

    def restore_latest(self, abstract_state: Any, on_damaged: str = "fallback",
                       warn: Callable[[str], None] = log.warning,
                       check: Callable[[dict[str, Any]], None] = lambda meta: None) -> Restored | None:
        """Restore the newest complete checkpoint into `abstract_state`'s shapes and shardings.

        Each candidate's meta is read and passed to `check` first (which raises to refuse a
        checkpoint of another model or other data) so that a refused checkpoint is never
        mistaken for a damaged one. A checkpoint whose files fail to load is reported and,
        with ``on_damaged="fallback"``, set aside in favour of the previous one.
        """
        damaged: list[int] = []
        try:
            for step in reversed(self.steps()):
                meta = self._attempt(step, on_damaged, warn, lambda: self.read_meta(step))
                if meta is None:
                    damaged.append(step)
                    continue
                check(meta)
                state = self._attempt(step, on_damaged, warn, lambda: self.manager.restore(
                    step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(abstract_state)}))[STATE])
                if state is None:
                    damaged.append(step)
                    continue
                return Restored(step=step, state=state, meta=meta)
            return None
        finally:
            if damaged:
                self._set_aside(damaged)

    def _attempt(self, step: int, on_damaged: str, warn: Callable[[str], None], read: Callable[[], Any]) -> Any:
        """`read()`, or None when the checkpoint's files are damaged (or stop, if so configured)."""
        try:
            return read()
        except Exception as err:  # orbax/tensorstore raise many types for damaged files
            first_line = str(err).splitlines()[0][:300] if str(err) else ""
            reason = f"{type(err).__name__}: {first_line}"
            where = self.directory / str(step)
            if on_damaged == "stop":
                raise UserError(
                    f"The newest checkpoint {where} is damaged and cannot be restored ({reason}). "
                    "Fix: delete that step directory to resume from the previous checkpoint, or set "
                    "checkpoint.on_damaged=fallback to do so automatically."
                ) from None
            warn(f"checkpoint {where} is damaged ({reason}); falling back to the previous one")
            return None

    def _set_aside(self, steps: list[int]) -> None:
        """Move damaged steps out of the manager's sight (kept for inspection, never deleted),
        so the resumed run can save those step numbers again."""
        if jax.process_index() == 0:
            aside = self.directory.parent / "damaged_checkpoints"
            aside.mkdir(parents=True, exist_ok=True)
            for step in steps:
                target = aside / f"{step}-{int(time.time())}"
                (self.directory / str(step)).rename(target)
                log.warning("moved damaged checkpoint %s to %s", step, target)
        ocp.multihost.sync_global_processes("runner_set_aside_damaged")
        self.manager.reload()


def find_state_dir(path: str | Path, key: str = "run.init_from") -> Path:
    """The `state` item of the newest checkpoint under a run directory, a checkpoints directory
    or a step directory (for warm starts and mode=eval; `key` names the setting in errors)."""
    p = Path(path)
    if (p / "checkpoints").is_dir():
        p = p / "checkpoints"
    if not (p / STATE).is_dir():
        steps = sorted(int(c.name) for c in p.iterdir() if c.name.isdigit() and (c / STATE).is_dir()) \
            if p.is_dir() else []
        if not steps:
            raise UserError(
                f"{key}={str(path)!r} holds no complete checkpoint. Fix: point it at a run "
                "directory, its checkpoints/ directory, or one checkpoints/<step> directory."
            )
        p = p / str(steps[-1])
    return (p / STATE).absolute()


def restore_tree(state_dir: Path, abstract_tree: Any, partial: bool) -> Any:
    """Restore `abstract_tree`'s leaves (only those, when `partial`) from an orbax state item."""
    args = ocp.args.PyTreeRestore(item=abstract_tree, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_tree),
                                  partial_restore=partial)
    with ocp.PyTreeCheckpointer() as checkpointer:
        return checkpointer.restore(state_dir, args=args)


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) describing `tree`, for restoring into its layout."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)

"""Checkpoints through orbax: the train state plus a JSON record of what the run is.

Layout under the run directory::

    checkpoints/<step>/state/   orbax StandardSave of {"step", "params", "opt_state", "rng"}
    checkpoints/<step>/meta/    JSON: step, the resolved spec, data fingerprint, model shapes,
                                tracker run id, best-metric bookkeeping, and a checksum per
                                array (runner.checkpoint.checksum), checked on every restore

Orbax writes each step into a temporary directory and renames it on commit (on gs://, where a
rename is a copy, into the step directory itself, committed by a final commit_success.txt), so
an interrupted save is never picked up; leftovers are removed when the manager opens. Which steps are saved is
`SavePolicy`'s call (step interval, time interval, best-metric evaluations, the last step);
which are kept is orbax's preservation policies (newest K, every P-th, best K, and with
guard.spike=rewind one old enough to rewind to).

Named snapshots (`save_named`) lie outside that rotation, in `<run.dir>/snapshots/<name>/`,
with the same state/ and meta/ layout, so run.init_from and mode=eval read them too.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from runner.checkpoint import checksum, storage
from runner.errors import UserError, first_line
from runner.spec import CheckpointSpec

log = logging.getLogger(__name__)

STATE, META = "state", "meta"
# beside checkpoints/: steps that failed to load, and steps of a timeline a rewind or a skip left
DAMAGED, ABANDONED = "damaged_checkpoints", "abandoned_checkpoints"


class CheckpointWriteError(UserError):
    """The checkpoint directory cannot be written (read-only, disk full)."""


StorageUnavailable = storage.StorageUnavailable  # (exit 75; raised here for run.dir's checkpoints)


def _barriers_through_the_coordination_service() -> None:
    """Orbax's barriers between processes are, by default, an allgather on the devices. A save
    abandoned on one process (a bucket that stopped answering: `storage.bounded`) leaves that
    allgather queued on its devices, waiting for processes that gave up on it too, and every
    later computation there (the local tier's save of the same step) waits behind it. Orbax's
    own flag makes them barriers of the coordination service instead: off the devices, and with
    a timeout. (Set as orbax's benchmarks set it; runner parses no absl flags.)"""
    from absl import flags
    from orbax.checkpoint._src.multihost import multihost

    flag = flags.FLAGS[multihost.EXPERIMENTAL_ORBAX_USE_DISTRIBUTED_BARRIER.name]
    flag.value, flag.present = True, 1


_barriers_through_the_coordination_service()


@dataclass(frozen=True)
class Restored:
    step: int
    state: Any
    meta: dict[str, Any]
    tier: str = "durable"  # or "local" (runner.checkpoint.local_tier)
    location: Any = None  # the directory it was read from


class SavePolicy:
    """Which steps are saved: every checkpoint.every_steps steps; every checkpoint.every_minutes
    by `clock` (minutes since this launch's start or its latest save); with checkpoint.keep_best,
    every step whose best_metric was evaluated (so BestN can keep it); and (the caller's final save) the
    last step of a launch. The time decision must be the same on every process: with several,
    `agree` (any process says yes) combines them every `agree_every` steps."""

    def __init__(self, spec: CheckpointSpec, clock: Callable[[], float] = time.monotonic,
                 agree: Optional[Callable[[bool], bool]] = None, agree_every: int = 1,
                 warn: Callable[[str], None] = log.warning) -> None:
        self.spec, self.clock, self.agree, self.agree_every, self.warn = spec, clock, agree, agree_every, warn
        # the intervals in force: the spec's, until checkpoint.cadence=auto chooses (runner.train.checkpointing),
        # which also keeps every keep_every-th step (`also_every`), since its steps need not fall on them
        self.every_steps, self.every_minutes, self.also_every = spec.every_steps, spec.every_minutes, 0
        self.last_save_time = clock()
        self.best: dict[str, Any] = {}  # best_metric's best value so far and its step (in every meta)
        self._measured: Optional[tuple[int, float]] = None  # (step, best_metric) of the latest evaluation
        self._decided: tuple[int, bool] = (-1, False)

    @property
    def metric(self) -> str:
        return best_metric_name(self.spec)

    def due(self, step: int) -> bool:
        """Whether `step` is saved. Asked once or more per step; the intervals are decided once
        per step (the time decision may be a collective), an evaluation of best_metric counts
        whenever it happened."""
        if self.metrics(step) is not None:
            return True
        if self._decided[0] != step:
            self._decided = (step, self._interval_due(step))
        return self._decided[1]

    def _interval_due(self, step: int) -> bool:
        if any(every and step % every == 0 for every in (self.every_steps, self.also_every)):
            return True
        if not self.every_minutes:
            return False
        timely = self.clock() - self.last_save_time >= self.every_minutes * 60
        if self.agree is None:
            return timely
        return step % self.agree_every == 0 and self.agree(timely)

    def saved(self, step: int) -> None:
        self.last_save_time = self.clock()

    def note_evaluation(self, step: int, results: Mapping[str, float], complete: bool) -> None:
        """Remember best_metric if this evaluation measured it (it is then saved with this step);
        `complete` says every evaluator ran, so a missing metric is a mistake in the config."""
        c = self.spec
        if not c.keep_best:
            return
        name = self.metric
        if name not in results:
            if complete and results:
                problem = (f"checkpoint.best_metric={c.best_metric!r} is not a metric the evaluators log. "
                           f"Fix: use one of: {', '.join(sorted(results))}.")
                if step == 0:
                    raise UserError(problem)
                self.warn(problem)
            return
        if step == 0:  # the untrained baseline is never saved, so it is no candidate
            return
        value = float(results[name])
        self._measured = (step, value)
        best = self.best if self.best.get("metric") == name and self.best.get("mode") == c.best_mode else {}
        if not best or (value < best["value"] if c.best_mode == "min" else value > best["value"]):
            best = {"metric": name, "mode": c.best_mode, "step": step, "value": value}
        self.best = best

    def metrics(self, step: int) -> Optional[dict[str, float]]:
        """{best_metric: value} when it was evaluated at this very step (else None)."""
        if not self.spec.keep_best or self._measured is None or self._measured[0] != step:
            return None
        return {self.metric: self._measured[1]}


@dataclasses.dataclass
class RewindReach(policies.PreservationPolicy):
    """Keeps the newest checkpoint at least `back` steps older than the next step, whatever the
    other policies say, so that a loss spike found later has a checkpoint to rewind to
    (guard.spike=rewind: `back` is guard.rewind_back plus the spike rule's reach)."""

    back: int

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> Sequence[bool]:
        if not checkpoints:
            return []
        reach = checkpoints[-1].step + 1 - self.back
        old_enough = [i for i, c in enumerate(checkpoints) if c.step <= reach]
        return [bool(old_enough) and i == old_enough[-1] for i in range(len(checkpoints))]


def _preservation_policy(spec: CheckpointSpec, rewind_back: Optional[int] = None) -> policies.PreservationPolicy:
    keep: list[policies.PreservationPolicy] = [policies.LatestN(spec.keep)]
    if rewind_back is not None:
        keep.append(RewindReach(rewind_back))
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

    def __init__(self, directory: Any, spec: CheckpointSpec, policy: Optional[SavePolicy] = None,
                 rewind_back: Optional[int] = None) -> None:
        """`rewind_back`: also keep the newest checkpoint at least that many steps old (`RewindReach`)."""
        self.directory = storage.absolute(directory)
        self.spec = spec
        self.policy = policy or SavePolicy(spec)
        self.saved_step: Optional[int] = None  # the newest step saved or restored by this launch
        self.unavailable = False  # its storage failed past retries and the bound (StorageUnavailable)
        options = ocp.CheckpointManagerOptions(
            # runner decides when (SavePolicy) and saves with force=True; orbax never saves by itself
            save_decision_policy=policies.SpecificStepsPolicy(steps=()),
            preservation_policy=_preservation_policy(spec, rewind_back),
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

    def save(self, step: int, state: Any, meta: Callable[[], dict[str, Any]]) -> bool:
        """Start saving `state` (a tree of arrays) at `step` (unless this step is saved already);
        asynchronous unless configured otherwise. The caller decides when (its SavePolicy, asked
        once per step: runner.train.checkpointing). `meta()` is the JSON record, built only when a
        save happens. Returns whether a save began."""
        if step == self.saved_step:
            return False
        metrics = self.policy.metrics(step)
        record = {**meta(), "checksums": checksum.checksums(state)}
        args = ocp.args.Composite(**{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(record)})
        try:
            storage.bounded(lambda: self.manager.save(step, args=args, force=True,
                                                      metrics=(metrics or {}) if self.spec.keep_best else None),
                            self.timeout_s)
        except Exception as err:  # OSError, or tensorstore's ValueError(OUT_OF_RANGE ...) for a full disk
            self._unavailable(err, f"saving checkpoint step {step}")
            raise CheckpointWriteError(
                f"Saving checkpoint step {step} into {self.directory} failed: {first_line(err)}. Earlier checkpoints "
                "are untouched. Fix: free disk space or make the directory writable, then rerun the same "
                "command to resume from the newest complete checkpoint."
            ) from None
        self.saved_step = step
        self.policy.saved(step)
        return True

    def wait(self) -> None:
        """Block until every pending save is committed."""
        if self.unavailable:
            return
        try:
            storage.bounded(self.manager.wait_until_finished, self.timeout_s)
        except Exception as err:  # tensorstore reports a full disk as ValueError(OUT_OF_RANGE ...)
            self._unavailable(err, "a checkpoint save")
            raise CheckpointWriteError(
                f"A checkpoint save into {self.directory} failed: {first_line(err)}. Earlier checkpoints are untouched. "
                "Fix: free disk space or make the directory writable, then rerun to resume."
            ) from None

    @property
    def timeout_s(self) -> float:
        return self.spec.storage_timeout_minutes * 60

    def _unavailable(self, err: Exception, what: str) -> None:
        """Raise StorageUnavailable for a failure of a remote run.dir (a bucket down or refusing,
        after the clients' own retries); a local disk's failures are the user's to fix."""
        if not storage.is_remote(self.directory):
            return
        self.unavailable = True  # close() must not wait on it again
        reason = str(err) if isinstance(err, StorageUnavailable) else f"{type(err).__name__}: {first_line(err, 300)}"
        raise StorageUnavailable(
            f"The durable checkpoint tier {self.directory} is unavailable: {what} failed ({reason}), retries "
            "included. No checkpoint there is half-committed (a save counts only once its commit marker is "
            "written), and earlier ones are untouched. Fix: check the bucket and the network, then rerun the "
            "same command: it resumes from the newest complete checkpoint of either tier."
        ) from None

    def close(self) -> None:
        if self.unavailable:  # its threads may never return: leave them (daemon) to the process's end
            return
        self.wait()
        self.manager.close()

    # ------------------------------------------------------------------ restore

    def restore_latest(self, abstract_state: Any, on_damaged: str = "fallback",
                       warn: Callable[[str], None] = log.warning,
                       check: Callable[[dict[str, Any]], None] = lambda meta: None,
                       ours: Callable[[dict[str, Any]], bool] = lambda meta: True) -> Restored | None:
        """Restore the newest complete checkpoint into `abstract_state`'s shapes and shardings.

        Each candidate's meta is read and passed to `check` first (which raises to refuse a
        checkpoint of another model or other data) so that a refused checkpoint is never
        mistaken for a damaged one. A checkpoint whose files fail to load is reported and,
        with ``on_damaged="fallback"``, set aside in favour of the previous one. A checkpoint that
        is not `ours` (trained on data the run now skips: runner.data.skips) is set aside too.
        """
        damaged: list[int] = []
        abandoned: list[int] = []
        try:
            for step in reversed(self.steps()):
                meta = self._attempt(step, on_damaged, warn, lambda: self.read_meta(step))
                if meta is None:
                    damaged.append(step)
                    continue
                check(meta)
                if not ours(meta):
                    abandoned.append(step)
                    continue
                state = self._attempt(step, on_damaged, warn, lambda: self._restore_checked(step, abstract_state, meta))
                if state is None:
                    damaged.append(step)
                    continue
                self.saved_step = step
                self.policy.best = dict(meta.get("best") or {})
                return Restored(step=step, state=state, meta=meta, location=self.directory)
            return None
        finally:
            if damaged:
                self._set_aside(damaged)
            if abandoned:
                self._set_aside(abandoned, ABANDONED)

    def _restore_checked(self, step: int, abstract_state: Any, meta: dict[str, Any]) -> Any:
        state = self.manager.restore(step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(abstract_state)}))
        checksum.verify(state[STATE], meta.get("checksums"))  # a flipped bit orbax's reads do not notice
        return state[STATE]

    def _attempt(self, step: int, on_damaged: str, warn: Callable[[str], None], read: Callable[[], Any]) -> Any:
        """`read()`, or None when the checkpoint's files are damaged (or stop, if so configured)."""
        try:
            return read()
        except Exception as err:  # orbax/tensorstore raise many types for damaged files
            reason = f"{type(err).__name__}: {first_line(err, 300)}"
            where = self.directory / str(step)
            if on_damaged == "stop":
                raise UserError(
                    f"The newest checkpoint {where} is damaged and cannot be restored ({reason}). "
                    "Fix: delete that step directory to resume from the previous checkpoint, or set "
                    "checkpoint.on_damaged=fallback to do so automatically."
                ) from None
            warn(f"checkpoint {where} is damaged ({reason}); falling back to the previous one")
            return None

    def abandon_after(self, step: int) -> list[int]:
        """Set aside every checkpoint newer than `step` (a rewind to it: they were trained on data
        the run now skips); pending saves are awaited first. Returns their steps."""
        self.wait()
        newer = [s for s in self.steps() if s > step]
        if newer:
            self._set_aside(newer, ABANDONED)
        self.saved_step = step if step in self.steps() else None
        return newer

    def _set_aside(self, steps: list[int], folder: str = DAMAGED) -> None:
        """Move damaged (or abandoned) steps out of the manager's sight (kept for inspection, never
        deleted), so the resumed run can save those step numbers again."""
        if jax.process_index() == 0:
            aside = self.directory.parent / folder
            for step in steps:
                target = aside / f"{step}-{int(time.time())}"
                storage.move_tree(self.directory / str(step), target)
                log.warning("moved %s checkpoint %s to %s", folder.split("_")[0], step, target)
        ocp.multihost.sync_global_processes(f"runner_set_aside_{folder}")
        self.manager.reload()


def find_state_dir(path: Any, key: str = "run.init_from") -> Any:
    """The `state` item of the newest checkpoint under a run directory, a checkpoints directory
    or a step directory, local or gs:// (for warm starts and mode=eval; `key` names the setting
    in errors)."""
    p = storage.absolute(path)
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
    return p / STATE


def restore_tree(state_dir: Any, abstract_tree: Any, partial: bool) -> Any:
    """Restore `abstract_tree`'s leaves (only those, when `partial`) from an orbax state item."""
    args = ocp.args.PyTreeRestore(item=abstract_tree, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_tree),
                                  partial_restore=partial)
    with ocp.PyTreeCheckpointer() as checkpointer:
        return checkpointer.restore(state_dir, args=args)


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) describing `tree`, for restoring into its layout."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


# ----------------------------------------------------------------------------- named snapshots


def save_named(directory: Any, state: Any, meta: dict[str, Any]) -> Any:
    """Save a snapshot outside the step rotation (awaited; replaces an older one of that name)."""
    directory = storage.absolute(directory)
    meta = {**meta, "checksums": checksum.checksums(state)}
    args = ocp.args.Composite(**{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)})
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            checkpointer.save(directory, args=args, force=True)
    except Exception as err:
        raise CheckpointWriteError(
            f"Saving the snapshot {directory} failed: {first_line(err)}. Fix: free disk space or make the "
            "directory writable."
        ) from None
    return directory


def restore_named(directory: Any, abstract_state: Any) -> Restored:
    """Restore a snapshot written by `save_named`, or any one step directory."""
    directory = storage.absolute(directory)
    if not (directory / STATE).is_dir():
        raise UserError(f"There is no checkpoint at {directory}. Fix: name a snapshot this run saved, or a step "
                        "number of its checkpoints/.")
    args = ocp.args.Composite(**{STATE: ocp.args.StandardRestore(abstract_state), META: ocp.args.JsonRestore()})
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        restored = checkpointer.restore(directory, args=args)
    meta = dict(restored[META] or {})
    try:
        checksum.verify(restored[STATE], meta.get("checksums"))
    except checksum.ChecksumMismatch as err:
        raise UserError(f"The checkpoint {directory} is damaged: {err}. Fix: restore from another snapshot or "
                        "step.") from None
    return Restored(step=int(meta.get("step", 0)), state=restored[STATE], meta=meta, location=directory)


def check_compatible(saved: Mapping[str, Any], model_shapes: Mapping[str, Any], fingerprint: str,
                     allow_data_change: bool, directory: Any, warn: Callable[[str], None] = log.warning) -> None:
    """Refuse to resume a checkpoint (its meta: `saved`) of another model, or of other data unless
    checkpoint.allow_data_change says so."""
    shapes = saved.get("model_shapes")
    if shapes is not None and shapes != model_shapes:
        changed = sorted(k for k in set(shapes) | set(model_shapes) if shapes.get(k) != model_shapes.get(k))
        raise UserError(
            f"The checkpoints in {directory} are of a different model: parameter shapes differ at "
            f"{', '.join(changed[:5])}. Fix: use the model settings of that run (see its spec.yaml), or a new "
            "run.dir for the new model."
        )
    theirs = saved.get("data_fingerprint")
    if theirs is not None and theirs != fingerprint:
        if allow_data_change:
            warn(f"resuming on different data (fingerprint {theirs[:12]} -> {fingerprint[:12]}), as "
                 "checkpoint.allow_data_change allows")
            return
        raise UserError(
            f"The checkpoints in {directory} were trained on other data (data fingerprint {theirs[:12]} there, "
            f"{fingerprint[:12]} now; sources there: {saved.get('spec', {}).get('data', {}).get('sources')}). "
            "Fix: use the data settings of that run, set checkpoint.allow_data_change=true to continue on the new "
            "data on purpose, or use a new run.dir."
        )


def warm_start(init_from: str, init_mode: str, abstract_tree: Any) -> dict[str, Any]:
    """What run.init_from gives a new run: the parameters of another run's newest (or named)
    checkpoint, or with run.init_mode=full its whole state (a tree shaped like `abstract_tree`)."""
    state_dir = find_state_dir(init_from)
    try:
        if init_mode == "full":
            tree = restore_tree(state_dir, abstract_tree, partial=False)
        else:
            tree = restore_tree(state_dir, {"params": abstract_tree["params"]}, partial=True)
    except (ValueError, KeyError) as err:
        raise UserError(
            f"Cannot warm start from {state_dir}: {first_line(err, 300)}. Fix: the source run must have the same "
            "model shapes (and, with run.init_mode=full, the same optimizer)."
        ) from None
    if jax.process_index() == 0:
        print(f"warm start: {init_mode} from {state_dir}", flush=True)
    return tree

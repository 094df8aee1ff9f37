"""A run's checkpoints as one loop component: it owns the cadence (it asks the save policies once
per step: steps, time, best-K), saves when due, restores on start, makes a launch's final save and
named snapshots. The stores underneath (runner.checkpoint.checkpointer for the durable tier in
run.dir, runner.checkpoint.local_tier for checkpoint.local.dir) store; this decides when, which
tier, and with what around it.

Two tiers: a step due for the durable tier is saved there (it restores anywhere, so a local save
of the same step adds nothing); a step due only for the local tier is saved locally. On start,
every process agrees on the newest local step that all of them can restore (from their own
shards, or, for a process without them, from the copies other processes hold); when that is at
least as new as the durable tier's newest, it is restored from the local tier (checked, and on
any process's failure set aside on every process), else the durable tier is restored as before.
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Optional, Protocol

import jax

from runner.checkpoint import checkpointer as ckpt
from runner.checkpoint import checksum, local_tier, replicas, storage
from runner.errors import first_line
from runner.parallel.distributed import all_processes, any_process, from_process, steps_by_process
from runner.spec import ExecutionSpec
from runner.train.loop import Component, Loop
from runner.train.state import state_tree

SNAPSHOTS = "snapshots"


class Saved(Protocol):
    """What is saved (the trainer): its state and step, the record kept beside them, and what
    happens around every save (callbacks, a metrics flush, goodput)."""

    state: Any
    step: int
    mesh: Any

    def checkpoint_meta(self) -> dict[str, Any]: ...

    def saving(self, step: int, tier: str = "durable") -> ContextManager[None]: ...


class Checkpointing(Component):
    """The one component that saves. The step's metrics are read before its state is saved (it
    asks for them), so a kill after a save loses no line of metrics.jsonl; the last step of a
    launch is saved by `save_final`, after the final evaluation."""

    def __init__(self, spec: ExecutionSpec, run_dir: Any, owner: Saved, warn: Callable[[str], None] = print) -> None:
        self.spec, self.run_dir, self.owner, self.warn = spec, run_dir, owner, warn
        self._due = self._local_due = False
        self.durable_newest: Optional[int] = None  # the durable tier's newest step when the run started
        self.rebuilt_for: Optional[list[int]] = None  # processes whose local shards came from other processes'
        self.rebuilt_from: list[int] = []

    @functools.cached_property
    def checkpointer(self) -> ckpt.Checkpointer:
        """Opened on first use, so mode=compile never touches (or cleans up in) the run directory."""
        policy = ckpt.SavePolicy(self.spec.checkpoint, warn=self.warn,
                                 agree=any_process if jax.process_count() > 1 else None,
                                 agree_every=self.spec.distributed.stop_check_every)
        return ckpt.Checkpointer(self.run_dir / "checkpoints", self.spec.checkpoint, policy)

    @functools.cached_property
    def local(self) -> Optional[local_tier.LocalTier]:
        """The local tier (checkpoint.local.dir), opened on first use; None when not configured."""
        spec = self.spec.checkpoint.local
        if not spec.dir:
            return None
        instance = local_tier.instance_id(self.run_dir)  # process 0 creates it on the run's first launch
        if jax.process_count() > 1:  # every process, so none reads it before process 0 has written it
            ckpt.ocp.multihost.sync_global_processes("runner_local_tier_id")
        instance = instance or local_tier.instance_id(self.run_dir)
        return local_tier.LocalTier(spec, local_tier.run_key(self.run_dir, instance),
                                    local_tier.layout_key(self.owner.mesh), self.spec.checkpoint.async_save, self.warn)

    @functools.cached_property
    def local_policy(self) -> ckpt.SavePolicy:
        return ckpt.SavePolicy(self.spec.checkpoint.local, warn=self.warn,  # type: ignore[arg-type]
                               agree=any_process if jax.process_count() > 1 else None,
                               agree_every=self.spec.distributed.stop_check_every)

    # ------------------------------------------------------------------ the loop's cadence

    def needs_metrics(self, loop: Loop, step: int) -> bool:
        self._due = step < loop.total and self.checkpointer.policy.due(step)  # the one question per step
        self._local_due = (not self._due and step < loop.total and self.local is not None
                           and self.local_policy.due(step))
        return self._due or self._local_due

    def after_step(self, loop: Loop, step: int) -> None:
        if loop.stopping:
            return
        if self._due:
            self.save()
        elif self._local_due:
            self.save_local()

    # ------------------------------------------------------------------ saving

    def save(self) -> bool:
        """Save the owner's current step (unless saved already); asynchronous unless configured."""
        step = self.owner.step
        if self.checkpointer.saved_step == step:
            return False
        with self._durable(), self.owner.saving(step):
            saved = self.checkpointer.save(step, state_tree(self.owner.state), self.owner.checkpoint_meta)
        if saved and self.local is not None:
            self.local_policy.saved(step)  # the durable save covers this step: the local cadence restarts
        return saved

    @contextlib.contextmanager
    def _durable(self) -> Iterator[None]:
        """Around every call on the durable tier: when its storage is unavailable (exit 75), keep
        the current step in the local tier first, so the rerun loses nothing."""
        try:
            yield
        except ckpt.StorageUnavailable as err:
            local = self.local
            if local is None or not local.usable:
                raise
            step = self.owner.step
            local.save(step, state_tree(self.owner.state), self.owner.checkpoint_meta())
            local.wait()
            kept = step in local.steps()
            raise ckpt.StorageUnavailable(
                f"{err} " + (f"Step {step} is kept in the local tier ({local.directory})." if kept else
                             "The local tier could not keep the current step either.")) from None

    def save_local(self) -> bool:
        """Save the owner's current step to the local tier (a failure there is a warning)."""
        assert self.local is not None
        step = self.owner.step
        with self.owner.saving(step, tier="local"):
            saved = self.local.save(step, state_tree(self.owner.state), self.owner.checkpoint_meta())
        self.local_policy.saved(step)
        return saved

    def save_final(self, suffix: Path | None = None) -> None:
        """A launch's last save, awaited; with `suffix`, also a snapshot of that name under
        <run.dir>/snapshots/, outside the keep policies."""
        self.save()
        with self._durable():
            self.wait()
        if suffix is not None:
            target = self.run_dir / SNAPSHOTS / suffix
            if jax.process_index() == 0:
                storage.makedirs(target.parent)
            ckpt.save_named(target, state_tree(self.owner.state), self.owner.checkpoint_meta())

    def wait(self) -> None:
        self.checkpointer.wait()
        if "local" in self.__dict__ and self.local is not None:
            self.local.wait()

    def note_evaluation(self, step: int, results: dict[str, float], complete: bool) -> None:
        """Tell the policy (best-K) what an evaluation found."""
        self.checkpointer.policy.note_evaluation(step, results, complete)

    # ------------------------------------------------------------------ restoring

    def restore(self, abstract: Any, suffix: Path | None,
                check: Callable[[dict[str, Any]], None]) -> Optional[ckpt.Restored]:
        """The newest complete checkpoint (damaged ones set aside as checkpoint.on_damaged says),
        or with `suffix` the snapshot of that name (a number: that step of checkpoints/)."""
        tree = state_tree(abstract)
        if suffix is None:
            self.durable_newest = self.checkpointer.latest_step()
            restored = self._restore_local(tree, check) if self.local is not None else None
            restored = restored or self.checkpointer.restore_latest(
                tree, self.spec.checkpoint.on_damaged, warn=self.warn, check=check)
            if self.local is not None:  # newer local steps of one process are a timeline being recomputed
                self.local.drop_after(restored.step if restored else -1)
            return restored
        suffix = Path(suffix)
        where = (self.checkpointer.directory / suffix.name) if suffix.name.isdigit() else \
            self.run_dir / SNAPSHOTS / suffix
        restored = ckpt.restore_named(where, tree)
        check(restored.meta)
        return restored

    def _restore_local(self, tree: Any, check: Callable[[dict[str, Any]], None]) -> Optional[ckpt.Restored]:
        """The newest local step that is at least as new as the durable tier's and that every
        process can restore: from its own shards, or, on a process that lacks the step (a
        replaced host, or one killed before that save committed), from copies of its shards that
        other processes hold (runner.checkpoint.replicas). A step that cannot be read or checked
        is dropped from every process's local tier."""
        local = self.local
        assert local is not None
        held = steps_by_process(local.steps())
        everyone = frozenset(range(jax.process_count()))
        for step in sorted(held, reverse=True):
            if self.durable_newest is not None and step < self.durable_newest:
                break
            holders = held[step]
            if holders != everyone:
                devices = {d.id for d in self.owner.mesh.devices.flat if d.process_index in holders}
                lost = replicas.unreplicated(tree, devices)
                if lost:
                    self.warn(f"local checkpoint step {step} is held by process(es) {_listed(holders)} only, and "
                              f"the mesh keeps no copy of the others' shards of {len(lost)} array(s) (e.g. "
                              f"{lost[0]}) on them (no data-parallel replica across hosts); an older step is used")
                    continue
            restored, problem = self._restore_local_step(step, holders, tree, check)
            if restored is not None:
                return restored
            self.warn(f"local checkpoint step {step} cannot be restored on every process "
                      f"({problem or 'another process could not read it'}); it is dropped and an older one used")
            local.drop(step)
        return None

    def _restore_local_step(self, step: int, holders: frozenset[int], tree: Any,
                            check: Callable[[dict[str, Any]], None]) -> tuple[Optional[ckpt.Restored], Optional[str]]:
        """One local step on every process (collective); a process not in `holders` gets its
        shards from the holders' copies and the record from the lowest holder."""
        local = self.local
        assert local is not None
        mine, rebuilt = jax.process_index() in holders, len(holders) < jax.process_count()
        meta, problem = self._read_local(lambda: local.read_meta(step)) if mine else (None, None)
        if not all_processes(problem is None):
            return None, problem
        if rebuilt:  # every process restores with the same record
            meta = json.loads(from_process(min(holders), json.dumps(meta) if mine else None))
        check(meta)  # the same model and data (the same answer on every process)
        state, problem = self._read_local(lambda: local.restore(step, tree, meta)) if mine else \
            (replicas.zeros(tree), None)
        if not all_processes(problem is None):
            return None, problem
        if rebuilt:
            state = replicas.rebuild(state, {d.id for d in self.owner.mesh.devices.flat if d.process_index in holders})
        problem = self._verify(state, meta)
        if problem is not None:
            return None, problem
        self.checkpointer.policy.best = dict(meta.get("best") or {})
        local.saved_step = step if mine else None
        self.rebuilt_for = None if not rebuilt else sorted(set(range(jax.process_count())) - holders)
        self.rebuilt_from = sorted(holders)
        return ckpt.Restored(step=step, state=state, meta=meta, tier="local", location=local.directory), None

    @staticmethod
    def _read_local(read: Callable[[], Any]) -> tuple[Any, Optional[str]]:
        try:
            return read(), None
        except Exception as err:  # a lost, truncated or foreign local checkpoint: any error orbax raises
            return None, f"{type(err).__name__}: {first_line(err, 200)}"

    @staticmethod
    def _verify(state: Any, meta: dict[str, Any]) -> Optional[str]:
        """The checksums of a local restore (collective: the same answer on every process)."""
        try:
            checksum.verify(state, meta.get("checksums"))
            return None
        except checksum.ChecksumMismatch as err:
            return str(err)

    def restored_from(self, restored: ckpt.Restored) -> str:
        """Where a restore came from, for the progress line and the run card."""
        if restored.tier != "local":
            return f"{restored.location}"
        newer = restored.step - (self.durable_newest or 0)
        durable = f"step {self.durable_newest}" if self.durable_newest is not None else "none"
        rebuilt = "" if not self.rebuilt_for else \
            f"; process {_listed(self.rebuilt_for)}'s shards rebuilt from the copies on process {_listed(self.rebuilt_from)}"
        return (f"local tier {restored.location}{rebuilt}; the durable tier's newest: {durable}, so {newer} steps not "
                "recomputed")

    def describe(self, restored_step: Optional[int], restored_from: str) -> str:
        """The run card's line: each tier's cadence and where this launch restored from."""
        c = self.spec.checkpoint

        def cadence(spec: Any) -> str:
            parts = [f"every {spec.every_steps} steps"] if spec.every_steps else []
            parts += [f"every {spec.every_minutes:g} min"] if spec.every_minutes else []
            return " and ".join(parts) or "at the end of each launch"

        line = f"checkpoints: durable {cadence(c)}, keep {c.keep}, in {self.checkpointer.directory}"
        if self.local is not None:
            line += f"; local {cadence(c.local)}, keep {c.local.keep}, in {self.local.directory}"
            if self.local.skipped:
                line += f" ({self.local.skipped} local saves skipped)"
        if restored_step:
            line += f"; restored step {restored_step} from {restored_from}"
        return line

    def forget_stale_local(self) -> None:
        """After the restore: other layouts' and deleted runs' local checkpoints can never be used."""
        if self.local is not None:
            self.local.forget_other_layouts()

    def close(self) -> None:
        if "checkpointer" in self.__dict__:
            self.checkpointer.close()
        if self.__dict__.get("local") is not None:
            self.local.close()


def _listed(processes: Any) -> str:
    return ", ".join(str(p) for p in sorted(processes))

"""A run's checkpoints as one loop component: it owns the cadence (it asks the save policy once per
step: steps, time, best-K), saves when due, restores on start, makes a launch's final save and
named snapshots. The checkpointer underneath (runner.checkpoint.checkpointer) stores; this
decides when, and with what around it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional, Protocol

import jax

from runner.checkpoint import checkpointer as ckpt
from runner.checkpoint import storage
from runner.parallel.distributed import any_process
from runner.spec import ExecutionSpec
from runner.train.loop import Component, Loop
from runner.train.state import state_tree

SNAPSHOTS = "snapshots"


class Saved(Protocol):
    """What is saved (the trainer): its state and step, the record kept beside them, and what
    happens around every save (callbacks, a metrics flush, goodput)."""

    state: Any
    step: int

    def checkpoint_meta(self) -> dict[str, Any]: ...

    def saving(self, step: int) -> ContextManager[None]: ...


class Checkpointing(Component):
    """The one component that saves. The step's metrics are read before its state is saved (it
    asks for them), so a kill after a save loses no line of metrics.jsonl; the last step of a
    launch is saved by `save_final`, after the final evaluation."""

    def __init__(self, spec: ExecutionSpec, run_dir: Any, owner: Saved, warn: Callable[[str], None] = print) -> None:
        self.spec, self.run_dir, self.owner, self.warn = spec, run_dir, owner, warn
        self._due = False

    @functools.cached_property
    def checkpointer(self) -> ckpt.Checkpointer:
        """Opened on first use, so mode=compile never touches (or cleans up in) the run directory."""
        policy = ckpt.SavePolicy(self.spec.checkpoint, warn=self.warn,
                                 agree=any_process if jax.process_count() > 1 else None,
                                 agree_every=self.spec.distributed.stop_check_every)
        return ckpt.Checkpointer(self.run_dir / "checkpoints", self.spec.checkpoint, policy)

    # ------------------------------------------------------------------ the loop's cadence

    def needs_metrics(self, loop: Loop, step: int) -> bool:
        self._due = step < loop.total and self.checkpointer.policy.due(step)  # the one question per step
        return self._due

    def after_step(self, loop: Loop, step: int) -> None:
        if self._due and not loop.stopping:
            self.save()

    # ------------------------------------------------------------------ saving

    def save(self) -> bool:
        """Save the owner's current step (unless saved already); asynchronous unless configured."""
        step = self.owner.step
        if self.checkpointer.saved_step == step:
            return False
        with self.owner.saving(step):
            return self.checkpointer.save(step, state_tree(self.owner.state), self.owner.checkpoint_meta)

    def save_final(self, suffix: Path | None = None) -> None:
        """A launch's last save, awaited; with `suffix`, also a snapshot of that name under
        <run.dir>/snapshots/, outside the keep policies."""
        self.save()
        self.checkpointer.wait()
        if suffix is not None:
            target = self.run_dir / SNAPSHOTS / suffix
            if jax.process_index() == 0:
                storage.makedirs(target.parent)
            ckpt.save_named(target, state_tree(self.owner.state), self.owner.checkpoint_meta())

    def wait(self) -> None:
        self.checkpointer.wait()

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
            return self.checkpointer.restore_latest(tree, self.spec.checkpoint.on_damaged, warn=self.warn, check=check)
        suffix = Path(suffix)
        where = (self.checkpointer.directory / suffix.name) if suffix.name.isdigit() else \
            self.run_dir / SNAPSHOTS / suffix
        restored = ckpt.restore_named(where, tree)
        check(restored.meta)
        return restored

    def close(self) -> None:
        if "checkpointer" in self.__dict__:
            self.checkpointer.close()


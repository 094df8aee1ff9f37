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

With checkpoint.cadence=auto the intervals are chosen (runner.checkpoint.cadence) at the launch's
start and after every save, from goodput's timings (a save's blocking seconds per tier, the step
time) and launches.jsonl's (each launch's start, restore and compile) as process 0 measured them,
shared with every process so that all decide alike, over the run's hosts (machines, not processes);
the fixed intervals hold until each tier has a measured save.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Optional, Protocol

import jax

from runner.checkpoint import checkpointer as ckpt
from runner.checkpoint import cadence, checksum, local_tier, replicas, storage
from runner.errors import first_line
from runner.models import place_hf_params
from runner.models.hf.mapping import HF_PREFIX
from runner.observability import launches
from runner.observability.goodput import Goodput
from runner.observability.metrics import METRICS_FILE, truncate_jsonl
from runner.parallel.distributed import all_processes, any_process, from_process, hosts_by_process, steps_by_process
from runner.spec import ExecutionSpec
from runner.train.loop import Component, Loop
from runner.train.rewind import RewindJournal
from runner.train.state import state_tree

SNAPSHOTS = "snapshots"


class Saved(Protocol):
    """What is saved (the trainer): its state and step, the record kept beside them, and what
    every save touches around it (`Checkpointing.saving`)."""

    state: Any
    step: int
    mesh: Any
    callbacks: Any  # runner.train.callbacks.Callbacks: on_save_start, on_save_end
    logger: Any  # the metrics logger while training (else None): flushed before a save can commit
    goodput: Goodput

    def checkpoint_meta(self) -> dict[str, Any]: ...

    def goodput_totals(self) -> dict[str, float]: ...

    def watching(self, phase: str, step: int) -> ContextManager[None]: ...


@dataclass(frozen=True)
class Resumed:
    """Where a launch took up the run: the step it restored (None: a fresh start), where from (tier
    and directory), which tier, and the wandb run it continues."""

    step: Optional[int] = None
    source: str = ""
    tier: str = ""
    wandb_run_id: Optional[str] = None


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
        self._launch_step = 0  # the step this launch's loop started from (its step time is measured from there)
        self._undone_before = 0  # goodput's recomputed steps then (a rewind's undone steps count from there)
        self._relaunches: list[float] = []  # each launch's start, restore and compile seconds (launches.jsonl)

    @functools.cached_property
    def checkpointer(self) -> ckpt.Checkpointer:
        """Opened on first use, so mode=compile never touches (or cleans up in) the run directory."""
        policy = ckpt.SavePolicy(self.spec.checkpoint, warn=self.warn,
                                 agree=any_process if jax.process_count() > 1 else None,
                                 agree_every=self.spec.distributed.stop_check_every)
        g = self.spec.guard  # a rewind needs a checkpoint old enough to go back to (runner.train.rewind)
        reach = g.rewind_back + g.spike_within - 1 if g.spike == "rewind" else None
        return ckpt.Checkpointer(self.run_dir / "checkpoints", self.spec.checkpoint, policy, rewind_back=reach)

    @functools.cached_property
    def journal(self) -> RewindJournal:
        """The run's rewinds and the data windows it skips (read on first use: mode=compile never does)."""
        return RewindJournal(self.spec, self.run_dir)

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

    @functools.cached_property
    def auto(self) -> Optional[cadence.AutoCadence]:
        """checkpoint.cadence=auto's chooser (None: the fixed intervals)."""
        c = self.spec.checkpoint
        if c.cadence != "auto":
            return None
        fixed = f"durable {_every(c)}" + (f", local {_every(c.local)}" if self.local is not None else "")
        return cadence.AutoCadence(c.mtbf_hours, len(set(self.host_of)), c.auto_max_minutes * 60, fixed,
                                   local=self.local is not None, local_recovers=self._local_recovers())

    @functools.cached_property
    def host_of(self) -> list[int]:
        """Each process's machine (gathered once, on every process): a machine's failure takes all its
        processes, so the job fails per machine, and SLURM starts one process per GPU."""
        return hosts_by_process()

    def _local_recovers(self) -> float:
        """The fraction of failures the local tier recovers from: all but a lost host's, and those
        too when the other machines hold a copy of every shard of one (process 0's machine's, as all
        are alike; its other processes are lost with it)."""
        if self.local is None:
            return 0.0
        host = self.host_of
        others = {d.id for d in self.owner.mesh.devices.flat if host[d.process_index] != host[0]}
        copied = bool(others) and not replicas.unreplicated(state_tree(self.owner.state), others)
        return 1.0 if copied else 1.0 - self.spec.checkpoint.local.host_loss_fraction

    def start(self, loop: Loop) -> None:
        self._launch_step = self.owner.step
        self._undone_before = self.owner.goodput.recomputed_steps
        if self.auto is not None:
            self._relaunches = self._launch_costs()
            self._choose()

    def _launch_costs(self) -> list[float]:
        """Process 0: each launch's start, restore and compile seconds from launches.jsonl (this launch's
        line is there: written as its loop started), which counts the launches killed before their first
        save that the checkpoints forget. [] where it cannot be read: the checkpoints' estimate then."""
        if jax.process_index() != 0:
            return []
        try:
            read = functools.partial(launches.read, self.run_dir)
            lines = storage.bounded(read, launches.WRITE_BOUND_S) if storage.is_remote(self.run_dir) else read()
        except Exception as err:  # a bucket that does not answer: the estimate from the checkpoints instead
            self.warn(f"could not read {launches.FILE} ({type(err).__name__}: {first_line(err, 200)}); auto's "
                      "relaunch cost is the checkpoints' estimate, low when launches die before their first save")
            return []
        return [sum(float(line.get(f"{c}_s") or 0.0) for c in ("startup", "restore", "compile")) for line in lines]

    def _choose(self) -> None:
        """auto: choose from process 0's measurements (every process calls this at the same step)."""
        assert self.auto is not None
        choice, line = self.auto.update(self._measured())
        if choice is not None:
            policy, keep_every = self.checkpointer.policy, self.spec.checkpoint.keep_every
            policy.every_steps, policy.every_minutes, policy.also_every = choice.every_steps, 0.0, keep_every
            if self.local is not None:
                self.local_policy.every_steps, self.local_policy.every_minutes = choice.local_every_steps, 0.0
        if line and jax.process_index() == 0:
            say = self.owner.logger.progress.message if self.owner.logger is not None else print
            say(line)

    def _measured(self) -> cadence.Measured:
        g = self.owner.goodput
        totals = self.owner.goodput_totals()
        # the steps this launch trained: those it advanced, and those a rewind undid (trained, then counted
        # as recomputed), so that its training seconds, which include theirs, are over all of them
        steps = self.owner.step - self._launch_step + (g.recomputed_steps - self._undone_before)
        if steps > 0:  # this launch's steps: its training and data waits so far
            seconds = sum(totals[c] - g.before.get(c, 0.0) for c in ("train", "data_wait"))
        else:  # at a relaunch: the steps kept from the launches before
            steps, seconds = self.owner.step, totals["train"] + totals["data_wait"] - totals["recomputed"]
        step_s = seconds / steps if steps > 0 and seconds > 0 else None
        measured = cadence.Measured.of(totals, g.saves, g.launches_before + 1, step_s, self._relaunches)
        mine = json.dumps(dataclasses.asdict(measured))
        if jax.process_count() > 1:
            mine = from_process(0, mine if jax.process_index() == 0 else None)
        return cadence.Measured(**json.loads(mine))

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
        else:
            return
        if self.auto is not None:  # a save measured: choose again (at the same step on every process)
            self._choose()

    # ------------------------------------------------------------------ saving

    @contextlib.contextmanager
    def saving(self, step: int, tier: str = "durable") -> Iterator[None]:
        """Around every save: the callbacks, the metrics it covers logged before it can commit (a
        durable save cannot go ahead without them), and its time counted as checkpointing, per tier."""
        owner = self.owner
        owner.callbacks.dispatch("on_save_start", step=step)
        if owner.logger is not None:
            try:
                owner.logger.sync()
            except ckpt.StorageUnavailable as err:  # the durable tier stops the run; a local save still protects it
                if tier == "durable":
                    raise
                self.warn(f"{err} The local save of step {step} goes ahead; its metrics stay in memory until an "
                          "upload succeeds.")
        category = "checkpoint" if tier == "durable" else "checkpoint_local"
        with owner.watching("save", step), owner.goodput.timing(category):
            yield
        owner.goodput.saved(category)
        owner.callbacks.dispatch("on_save_end", step=step)

    def save(self) -> bool:
        """Save the owner's current step (unless saved already); asynchronous unless configured."""
        step = self.owner.step
        if self.checkpointer.saved_step == step:
            return False
        with self._durable(), self.saving(step):
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
        with self.saving(step, tier="local"):
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
                tree, self.spec.checkpoint.on_damaged, warn=self.warn, check=check, ours=self.journal.ours)
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
        if not self.journal.ours(meta):
            return None, "it was trained on data the run now skips (train.skip_batches, rewinds.json)"
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

    def resumed(self, restored: Optional[ckpt.Restored], goodput: Goodput) -> Resumed:
        """After the restore (None: a fresh start): metrics.jsonl cut back to the restored step (a
        fresh start logs everything anew), goodput's totals carried on with the steps the cut lost,
        and the record of where this launch took up the run."""
        metrics = self.run_dir / METRICS_FILE
        if restored is None:
            goodput.carry(None, truncate_jsonl(metrics, -1), 0)
            return Resumed()
        step = int(restored.step)
        goodput.carry(restored.meta.get("goodput"), truncate_jsonl(metrics, step), step)
        if restored.tier == "local":
            goodput.local_tier_spared_steps = step - (self.durable_newest or 0)
        return Resumed(step, self.restored_from(restored), restored.tier, restored.meta.get("wandb_run_id"))

    def finished_already(self, resumed: Resumed) -> None:
        """A relaunch with nothing left to train. A last step restored from the local tier is not in
        the durable tier yet (the launch that reached it stopped when its durable save failed): saved
        there now, before the local tier (a host's disk) can be lost (unless that save committed after all)."""
        step, steps, run_dir = self.owner.step, self.spec.train.steps, self.run_dir
        if resumed.tier == "local" and step not in self.checkpointer.steps():
            self.save_final()
            if jax.process_index() == 0:
                print(f"Run {run_dir} had reached step {step} (train.steps={steps}), but that step was only in the "
                      f"local tier ({resumed.source}); it is now saved to {self.checkpointer.directory}.", flush=True)
            return
        if jax.process_index() == 0:
            print(f"Run {run_dir} already finished at step {step} (train.steps={steps}); nothing to do. Raise "
                  "train.steps to continue it.", flush=True)

    def warm_start(self, abstract: Any, fresh: Any, import_hf: Callable[[Any], Any]) -> Any:
        """run.init_from on a `fresh` state: another run's parameters (a new optimizer, step 0), or with
        run.init_mode=full its whole state; or with `hf:DIR` a Hugging Face model's parameters, read
        by the job (`import_hf`: its model family's layout) and placed by runner.models."""
        run = self.spec.run
        if run.init_from.startswith(HF_PREFIX):
            return fresh.replace(params=place_hf_params(self.spec, import_hf(abstract.params), abstract.params))
        tree = ckpt.warm_start(run.init_from, run.init_mode, state_tree(abstract))
        return abstract.replace(**tree) if run.init_mode == "full" else fresh.replace(params=tree["params"])

    def restored_from(self, restored: ckpt.Restored) -> str:
        """Where a restore came from, for the progress line and the run card."""
        if restored.tier != "local":
            return f"{restored.location}"
        newer = restored.step - (self.durable_newest or 0)
        durable = f"step {self.durable_newest}" if self.durable_newest is not None else "none"
        rebuilt = "" if not self.rebuilt_for else (f"; process {_listed(self.rebuilt_for)}'s shards rebuilt from "
                                                   f"the copies on process {_listed(self.rebuilt_from)}")
        return (f"local tier {restored.location}{rebuilt}; the durable tier's newest: {durable}, so {newer} steps not "
                "recomputed")

    def describe(self, restored_step: Optional[int], restored_from: str) -> str:
        """The run card's line: each tier's cadence and where this launch restored from."""
        c = self.spec.checkpoint

        def every(spec: Any) -> str:
            return f"auto (from {_every(spec)} until measured)" if c.cadence == "auto" else _every(spec)

        line = f"checkpoints: durable {every(c)}, keep {c.keep}, in {self.checkpointer.directory}"
        if self.local is not None:
            line += f"; local {every(c.local)}, keep {c.local.keep}, in {self.local.directory}"
            if self.local.skipped:
                line += f" ({self.local.skipped} local saves skipped)"
        if restored_step:
            line += f"; restored step {restored_step} from {restored_from}"
        if self.journal.skips:
            line += f"; data batches skipped: {self.journal.describe()} ({len(self.journal)} rewinds)"
        return line

    def abandon_after(self, step: int) -> list[int]:
        """A rewind to `step`: the newer steps of both tiers were trained on data the run now skips.
        The durable ones are set aside, the local ones dropped; returns the durable ones."""
        if "local" in self.__dict__ and self.local is not None:
            self.local.wait()
            self.local.drop_after(step)
        return self.checkpointer.abandon_after(step)

    def forget_stale_local(self) -> None:
        """After the restore: other layouts' and deleted runs' local checkpoints can never be used."""
        if self.local is not None:
            self.local.forget_other_layouts()

    def close(self) -> None:
        if "checkpointer" in self.__dict__:
            self.checkpointer.close()
        if self.__dict__.get("local") is not None:
            self.local.close()


def _every(spec: Any) -> str:
    """A tier's fixed interval in words."""
    parts = [f"every {spec.every_steps} steps"] if spec.every_steps else []
    parts += [f"every {spec.every_minutes:g} min"] if spec.every_minutes else []
    return " and ".join(parts) or "at the end of each launch"


def _listed(processes: Any) -> str:
    return ", ".join(str(p) for p in sorted(processes))

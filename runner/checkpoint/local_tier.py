"""The local checkpoint tier: frequent saves of each process's own shards to its host's disk.

A save to a bucket of a large model takes minutes of bandwidth, so the durable tier (run.dir)
saves rarely and a preemption loses up to that much work on every host. The local tier saves
often to checkpoint.local.dir (node-local NVMe, or /dev/shm), where a save costs seconds.

Layout, per process::

    <checkpoint.local.dir>/<run key>/<layout key>/process-<i>/<step>/{state,meta}

- The run key names the run (run.dir's name and a hash of its location) and the run's *instance*
  (an id kept in run.dir, `LOCAL_TIER_ID`): a run directory deleted and started again never finds
  the local checkpoints of the run that was deleted.
- The layout key names the process count and the devices of the mesh. Local shards fit only the
  layout that wrote them, so a restart onto another layout finds none and restores from the
  durable tier, which reshards.

Orbax underneath: its emergency CheckpointManager keeps a local tier only for meshes of two or
more slices (replicas broadcast over the slice axis), and on one slice it saves to the durable
directory alone; runner's local tier has to work on one slice, on GPUs and on CPUs too. So it
uses what orbax's emergency manager builds its local tier from: a standard CheckpointManager per
process, `primary_host=None` and `active_processes={this process}` (every process writes and
commits its own directory, with no barrier that a dead or full-disk peer could hold up), and an
ArrayHandler that writes every shard this process holds (`replica_id=None`). Whether a step is
complete on every process is decided when a run starts (`runner.train.checkpointing`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies
from orbax.checkpoint._src.serialization import type_handler_registry, type_handlers

from runner.checkpoint import checksum, storage
from runner.checkpoint.files import atomic_write
from runner.errors import first_line
from runner.spec import LocalCheckpointSpec

log = logging.getLogger(__name__)

STATE, META = "state", "meta"
LOCAL_TIER_ID = "local_tier_id"  # in run.dir: this run instance's id


def instance_id(run_dir: Any) -> str:
    """The id of this run instance, kept in run.dir (created by process 0 on first use; the
    caller makes the other processes wait for it)."""
    where = storage.absolute(run_dir) / LOCAL_TIER_ID
    if where.exists():
        return where.read_text().strip()
    if jax.process_index() == 0:
        storage.makedirs(storage.absolute(run_dir))
        atomic_write(where, secrets.token_hex(6) + "\n", durable=True)
    return ""  # unknown until process 0 has written it: call again after a barrier


def layout_key(mesh: Any) -> str:
    """The process count and the mesh's axes and device order (which shards each process holds)."""
    axes = ",".join(f"{name}={size}" for name, size in mesh.shape.items())
    devices = ",".join(f"{d.process_index}:{d.id}" for d in mesh.devices.flat)
    digest = hashlib.sha256(f"{axes}|{devices}".encode()).hexdigest()[:10]
    return f"{jax.process_count()}proc-{digest}"


def run_key(run_dir: Any, instance: str) -> str:
    location = os.fspath(storage.absolute(run_dir))
    return f"{storage.name(location)}-{hashlib.sha256(location.encode()).hexdigest()[:8]}-{instance}"


def _manager(directory: Path, keep: int, async_save: bool) -> ocp.CheckpointManager:
    me = jax.process_index()
    multiprocessing = ocp.options.MultiprocessingOptions(
        primary_host=None, active_processes={me}, barrier_sync_key_prefix=f"runner_local_{me}")
    arrays = type_handler_registry.create_type_handler_registry(
        (jax.Array, type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False)))
    options = ocp.CheckpointManagerOptions(
        save_decision_policy=policies.SpecificStepsPolicy(steps=()),  # runner decides when
        preservation_policy=policies.LatestN(keep),
        multiprocessing_options=multiprocessing,
        enable_async_checkpointing=async_save,
        enable_per_process_directory_creation=True,
        save_root_metadata=False,
        cleanup_tmp_directories=True,
        enable_background_delete=False,
        create=False,  # orbax cannot create a root directory for one process of several: made here
    )
    handlers = {STATE: ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, type_handler_registry=arrays,
                                                   multiprocessing_options=multiprocessing),
                META: ocp.JsonCheckpointHandler(multiprocessing_options=multiprocessing)}
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


class LocalTier:
    """One process's local checkpoints. Every failure to write is a warning that turns a save
    into a skipped one (training goes on, protected by the durable tier), never an error."""

    def __init__(self, spec: LocalCheckpointSpec, run: str, layout: str, async_save: bool = True,
                 warn: Callable[[str], None] = log.warning) -> None:
        self.spec, self.warn = spec, warn
        self.run_root = Path(os.path.abspath(os.path.expanduser(spec.dir))) / run
        self.layout_root = self.run_root / layout
        self.directory = self.layout_root / f"process-{jax.process_index()}"
        self.saved_step: Optional[int] = None
        self.skipped = 0  # saves that failed (a full or unwritable disk) this launch
        self._pending: Optional[int] = None  # the step of an asynchronous save not yet known to have committed
        self.manager: Optional[ocp.CheckpointManager] = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.manager = _manager(self.directory, spec.keep, async_save)
        except Exception as err:
            self._failed(f"cannot open {self.directory}: {first_line(err, 200)}")

    @property
    def usable(self) -> bool:
        return self.manager is not None

    def _failed(self, what: str) -> None:
        self.skipped += 1
        if self.skipped == 1:  # once per launch: the tier stays on and tries again at its next save
            self.warn(f"local checkpoint tier (checkpoint.local.dir={self.spec.dir}): {what}. That local save is "
                      "skipped and training continues; the durable tier in run.dir still protects the run. Fix: free "
                      "space there or point checkpoint.local.dir at a larger disk.")

    # ------------------------------------------------------------------ queries

    def steps(self) -> list[int]:
        """Steps committed in this process's directory."""
        if self.manager is None:
            return []
        self.manager.reload()
        return sorted(self.manager.all_steps())

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> bool:
        """Start saving `state` at `step` (asynchronous, like the durable tier); a failure now or
        of the previous save is warned about and skipped. Returns whether a save began."""
        if self.manager is None or step == self.saved_step:
            return False
        self._settle()
        record = {**meta, "checksums": checksum.checksums(state), "tier": "local"}
        try:
            self.manager.save(step, args=ocp.args.Composite(**{STATE: ocp.args.PyTreeSave(state),
                                                                META: ocp.args.JsonSave(record)}), force=True)
        except Exception as err:
            self._failed(f"saving step {step} failed ({first_line(err, 200)})")
            self._discard(step)
            return False
        self.saved_step, self._pending = step, step
        return True

    def _settle(self) -> None:
        """Learn whether the pending asynchronous save committed (waiting for it, as the next save
        would); a failed one is warned about and its leftovers removed."""
        if self.manager is None or self._pending is None:
            return
        step, self._pending = self._pending, None
        try:
            self.manager.wait_until_finished()
        except Exception as err:
            self._failed(f"saving step {step} failed ({first_line(err, 200)})")
            self._discard(step)

    def _discard(self, step: int) -> None:
        """Remove a failed save's partial files (orbax's temporary directory for it), so a full
        disk is not kept full by them."""
        # orbax writes <step>.orbax-checkpoint-tmp* and renames it to <step> on commit
        for leftover in [self.directory / str(step), *self.directory.glob(f"{step}.*")]:
            if leftover.exists() and not (leftover / "commit_success.txt").exists():
                shutil.rmtree(leftover, ignore_errors=True)

    def wait(self) -> None:
        self._settle()

    def close(self) -> None:
        self._settle()
        if self.manager is not None:
            try:
                self.manager.close()
            except Exception as err:
                self._failed(f"closing failed ({first_line(err, 200)})")

    # ------------------------------------------------------------------ restore

    def read_meta(self, step: int) -> dict[str, Any]:
        assert self.manager is not None
        return self.manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]

    def restore(self, step: int, abstract_state: Any, meta: dict[str, Any]) -> Any:
        """This process's shards of `step` (the caller checks them against the saved checksums, a
        collective step)."""
        assert self.manager is not None
        restore = ocp.args.PyTreeRestore(abstract_state,
                                         restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state))
        return self.manager.restore(step, args=ocp.args.Composite(**{STATE: restore}))[STATE]

    def drop(self, step: int) -> None:
        """Delete one local checkpoint (damaged, or not complete on every process)."""
        if self.manager is not None and step in self.manager.all_steps():
            try:
                self.manager.delete(step)
            except Exception:
                shutil.rmtree(self.directory / str(step), ignore_errors=True)

    def drop_after(self, step: int) -> None:
        """Delete the local checkpoints newer than `step`, the step the run resumes from: they
        belong to the launch that died and are about to be trained (and saved) again."""
        for newer in [s for s in self.steps() if s > step]:
            self.drop(newer)

    def forget_other_layouts(self) -> None:
        """Remove this run's local checkpoints of other layouts and of deleted instances of the
        run (they can never be restored). Several processes of a host may race here: harmless."""
        parent = self.run_root.parent
        prefix = self.run_root.name.rsplit("-", 1)[0] + "-"
        for stale in [*(p for p in parent.glob(prefix + "*") if p != self.run_root),
                      *(p for p in self.run_root.glob("*") if p != self.layout_root)]:
            shutil.rmtree(stale, ignore_errors=True)

"""The local checkpoint tier (checkpoint.local.*): saves each process's shards on its own host,
restores from the newest step every process holds, and never at the cost of the durable tier."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runner.errors import ConfigError
from tests.conftest import TINY, read_metrics, run_runner, runner_env, shared_run
from tests.test_spec import spec_for
from tests.train.test_multiprocess import finish, launch
from tests.train.test_restore import params_of
from tests.train.test_restore import reference  # noqa: F401 (a fixture: the uninterrupted 24-step run)

STEPS = 16
TIERS = ["checkpoint.every_steps=8", "checkpoint.local.every_steps=2"]
BASE = [*TINY, f"train.steps={STEPS}", "eval.every=0", "optimizer.lr=1e-2", "checkpoint.keep=5"]


# ----------------------------------------------------------------------------- settings


@pytest.mark.parametrize("overrides, key, words", [
    (["checkpoint.local.dir=gs://b/x", "checkpoint.local.every_steps=2"], "checkpoint.local.dir", "local path"),
    (["checkpoint.local.dir=/tmp/x"], "checkpoint.local.dir", "never save"),
    (["checkpoint.local.dir=/tmp/x", "checkpoint.local.every_steps=2", "checkpoint.local.keep=0"],
     "checkpoint.local.keep", "> 0"),
    (["checkpoint.local.every_minutes=-1"], "checkpoint.local.every_minutes", ">= 0"),
])
def test_settings_the_local_tier_cannot_honour_are_refused(overrides, key, words) -> None:
    with pytest.raises(ConfigError) as info:
        spec_for(*overrides)
    assert info.value.key == key and words in str(info.value)


def test_an_unknown_local_tier_setting_is_refused() -> None:
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="replicas"):
        spec_for("checkpoint.local.replicas=2")


def test_a_failed_local_save_removes_only_its_own_leftovers(tmp_path) -> None:
    """In-process: steps 10 and 12 committed, then the save of step 14 fails after writing part of
    itself (an orbax temporary directory and an uncommitted step directory, as a disk that fills
    mid-save leaves them): it is warned about once and skipped, its partial files are removed, and
    10 and 12 stay and restore."""
    import errno

    import jax.numpy as jnp

    from runner.checkpoint.checkpointer import abstract_like
    from runner.checkpoint.local_tier import LocalTier
    from runner.spec import LocalCheckpointSpec

    warned: list[str] = []
    tier = LocalTier(LocalCheckpointSpec(dir=str(tmp_path), every_steps=2, keep=3), "run-x", "1proc-y",
                     async_save=False, warn=warned.append)
    state = {"w": jnp.arange(6.0), "step": jnp.asarray(0)}
    for step in (10, 12):
        assert tier.save(step, {**state, "step": jnp.asarray(step)}, {"step": step})
    real_save = tier.manager.save

    def fills_the_disk(step: int, *args: object, **kwargs: object) -> None:
        (tier.directory / f"{step}.orbax-checkpoint-tmp-123" / "state").mkdir(parents=True)
        (tier.directory / str(step) / "state").mkdir(parents=True)
        raise OSError(errno.ENOSPC, "No space left on device")

    tier.manager.save = fills_the_disk
    assert not tier.save(14, {**state, "step": jnp.asarray(14)}, {"step": 14})
    assert tier.skipped == 1 and len(warned) == 1 and "saving step 14 failed" in warned[0]
    assert "No space left on device" in warned[0] and "training continues" in warned[0]
    assert sorted(p.name for p in tier.directory.iterdir()) == ["10", "12"]
    tier.manager.save = real_save
    meta = tier.read_meta(12)
    assert meta["step"] == 12 and meta["tier"] == "local" and set(meta["checksums"]) == {"['step']", "['w']"}
    restored = tier.restore(12, abstract_like(state), meta)
    assert int(restored["step"]) == 12
    tier.close()


# ----------------------------------------------------------------------------- runs


def local_steps(root: Path) -> dict[str, list[int]]:
    """{process-i: committed steps} under a checkpoint.local.dir."""
    return {p.name: sorted(int(s.name) for s in p.iterdir() if s.name.isdigit() and (s / "commit_success.txt").exists())
            for p in sorted(root.glob("*/*/process-*"))}


def durable_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def assert_bitwise(a: Path, b: Path, steps: int = STEPS) -> None:
    """Two runs of `steps` steps: the same loss at every step, the same final parameters, bit for bit."""
    la = {r["step"]: r["loss"] for r in read_metrics(a) if "loss" in r}
    lb = {r["step"]: r["loss"] for r in read_metrics(b) if "loss" in r}
    assert la == lb and sorted(la) == list(range(1, steps + 1))
    for x, y in zip(params_of(a, steps), params_of(b, steps), strict=True):
        np.testing.assert_array_equal(x, y)


def launched(args: list[str], tmp_path: Path, **env: str) -> list[tuple[int, str, str]]:
    return finish(launch(args, tmp_path, **env), timeout=300)


def killed(results: list[tuple[int, str, str]]) -> None:
    codes = [code for code, _, _ in results]
    assert -signal.SIGKILL in codes and 0 not in codes, [r[2][-2000:] for r in results]


def two_process_reference_on(mesh: list[str]) -> Path:
    """Two processes x two devices on `mesh` (the default: []), uninterrupted, durable saves every 8
    steps: made once a session, read here and by test_gcs."""
    def make(tmp: Path) -> Path:
        for code, _, stderr in launched([*BASE, *mesh, "run.dir=run", "checkpoint.every_steps=8"], tmp):
            assert code == 0, stderr[-3000:]
        return tmp / "run"

    return shared_run("-".join(["two-process-reference", *mesh]), make)


REPLICATED = ["mesh.data=2", "mesh.fsdp=2"]  # the data axis across the two processes: each holds a whole copy


@pytest.mark.e2e
def test_two_processes_resume_from_the_freshest_tier_and_end_bitwise(tmp_path) -> None:
    """Two processes x two devices on data=2 x fsdp=2: the state split by fsdp within each process
    and copied across them by the data axis."""
    local = tmp_path / "local"
    args = [*BASE, *TIERS, *REPLICATED, "run.dir=run", f"checkpoint.local.dir={local}"]

    # 1. killed while the local save of step 12 is being written (that save waited for 10's)
    killed(launched(args, tmp_path, RUNNER_FAULT="kill_after_save:12"))
    assert durable_steps(tmp_path / "run") == [8]
    held = local_steps(local)
    assert set(held) == {"process-0", "process-1"} and all(10 in steps for steps in held.values()), held
    # 12 if either committed it in time: the state is copied over the data axis (across both
    # processes), so one process's copy of a step is the whole step
    newest = max(set.union(*(set(s) for s in held.values())))

    # 2. the newest step is newer than the durable tier's 8: restored from the local tier
    second = launched(args, tmp_path, RUNNER_FAULT="kill_at_step:13")
    killed(second)
    assert f"resumed from step {newest} (local tier {local}" in second[0][1], second[0][1][-2000:]
    assert f"the durable tier's newest: step 8, so {newest - 8} steps not recomputed" in second[0][1]
    # (each process dies at step 13 once its own saves are written; the other one may be cut
    # short by its partner's death, like hosts of a preempted slice)
    assert 12 in local_steps(local)["process-0"]

    # 3. a replaced host: process 1's local checkpoints are gone; process 0's copy of step 12
    #    holds every shard process 1 needs, so 12 is restored, process 1's shards rebuilt from it
    shutil.rmtree(next(local.glob("*/*/process-1")))
    third = launched(args, tmp_path, RUNNER_FAULT="kill_at_step:15")
    killed(third)
    out = third[0][1]
    assert "resumed from step 12 (local tier" in out, out[-2000:]
    assert ("process 1's shards rebuilt from the copies on process 0; the durable tier's newest: step 8, so 4 steps "
            "not recomputed") in out, out[-2000:]
    assert 14 in local_steps(local)["process-0"], local_steps(local)

    # 4. another process count: the local shards (of two processes) do not fit one process with
    #    four devices, which restores the durable tier, resharded, and removes the stale layout
    other = run_runner([*args, "train.steps=9"], tmp_path, devices=4, RUNNER_FAULT="kill_at_step:9")
    assert other.returncode == -signal.SIGKILL, other.stderr[-3000:]
    assert f"resumed from step 8 ({tmp_path / 'run' / 'checkpoints'})" in other.stdout
    assert list(local_steps(local)) == ["process-0"] and len(list(local.glob("*/*"))) == 1

    # 5. back on two processes, to the end
    final = launched(args, tmp_path)
    for code, _, stderr in final:
        assert code == 0, stderr[-3000:]
    assert "resumed from step 8 (" in final[0][1]
    assert_bitwise(tmp_path / "run", two_process_reference_on(REPLICATED))
    card = (tmp_path / "run" / "RUN_CARD.md").read_text()
    assert "local every 2 steps, keep 2" in card
    goodput = [r for r in read_metrics(tmp_path / "run") if "goodput/launches" in r][-1]
    assert goodput["goodput/checkpoint_local_s"] > 0 and goodput["goodput/checkpoint_s"] > 0


@pytest.mark.deep
def test_a_replaced_host_without_replicas_restores_the_durable_tier(tmp_path) -> None:
    """Two processes x two devices on fsdp=4. Killed during the durable save of step 8, then at step
    13; process 1's local directory deleted (a replaced host); rerun to the end. The state is split
    over both processes and process 0's copy is half of it: the durable tier's 8 is restored, and
    the run ends bit-exact with an uninterrupted run on the same mesh. (With a data axis across the
    processes, process 0's copy rebuilds process 1's shards: the test above, step 3.)"""
    mesh = ["mesh.data=1", "mesh.fsdp=4"]
    local = tmp_path / "local"
    args = [*BASE, *TIERS, *mesh, "run.dir=run", f"checkpoint.local.dir={local}"]
    reference = two_process_reference_on(mesh)

    # 1. killed while the durable save of step 8 is being written: nothing half-committed is read
    killed(launched(args, tmp_path, RUNNER_FAULT="kill_after_save:8"))
    durable = durable_steps(tmp_path / "run")
    assert durable in ([], [8]), durable
    held = [set(steps) for steps in local_steps(local).values()]  # 2, 4 and 6, as far as each got
    resumed = 8 if durable else max(set.intersection(*held))  # a step is whole only where both hold it
    second = launched(args, tmp_path, RUNNER_FAULT="kill_at_step:13")
    killed(second)
    assert f"resumed from step {resumed} (" in second[0][1], second[0][1][-2000:]
    assert durable_steps(tmp_path / "run") == [8] and 12 in local_steps(local)["process-0"]

    # 2. a replaced host, then on to the end
    shutil.rmtree(next(local.glob("*/*/process-1")))
    final = launched(args, tmp_path)
    for code, _, stderr in final:
        assert code == 0, stderr[-3000:]
    out = final[0][1]
    assert "local checkpoint step 12 is held by process(es) 0 only" in out, out[-2000:]
    assert f"resumed from step 8 ({tmp_path / 'run' / 'checkpoints'})" in out, out[-2000:]
    assert_bitwise(tmp_path / "run", reference)


@pytest.mark.deep
def test_a_full_local_disk_skips_that_tier_and_training_goes_on(tmp_path, reference) -> None:
    """checkpoint.local.dir on a 256 KiB tmpfs (in a private mount namespace), smaller than one
    local save: every local save fails, is warned about once, leaves nothing behind, and the run
    finishes on the durable tier exactly as a run without a local tier (the session's 24-step
    reference: test_restore's run, which this one is with a local tier)."""
    from tests.train.test_restore import BASE as RESTORE_BASE
    from tests.train.test_restore import STEPS as RESTORE_STEPS

    small = tmp_path / "small"
    small.mkdir()
    args = [*RESTORE_BASE, "checkpoint.local.every_steps=2", "run.dir=run"]
    namespace = ["unshare", "--mount", "--propagation", "private"] if _root() else \
        ["unshare", "--user", "--map-root-user", "--mount"]
    runner = " ".join(f"'{a}'" for a in [*args, f"checkpoint.local.dir={small}"])
    script = (f"mount -t tmpfs -o size=256k tmpfs {small} && {sys.executable} -m runner {runner}; code=$?; "
              f"echo files left: $(find {small} -type f | wc -l); exit $code")
    result = subprocess.run([*namespace, "sh", "-c", script], cwd=tmp_path, env=runner_env(tmp_path),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("warning: local checkpoint tier") == 1, result.stdout[-3000:]
    assert "That local save is skipped and training continues" in result.stdout
    assert "No space left on device" in result.stdout or "RESOURCE_EXHAUSTED" in result.stdout
    # 2, 4, 6, 10, 12, 14, 18, 20, 22 (the durable tier's steps are not saved locally)
    assert "(9 local saves skipped)" in (tmp_path / "run" / "RUN_CARD.md").read_text()
    assert "files left: 0" in result.stdout  # no partial save keeps the small disk full
    assert durable_steps(tmp_path / "run") == [8, 16, 24]
    assert_bitwise(tmp_path / "run", reference, RESTORE_STEPS)


def _root() -> bool:
    import os

    return os.geteuid() == 0


@pytest.mark.deep
def test_a_damaged_local_checkpoint_is_dropped_for_the_previous_one(tmp_path, reference) -> None:
    """One process; killed at step 13 with local steps 10 and 12. A bit flipped in step 12's
    largest array file (orbax reads it without complaint, or fails): the checksums (or the read)
    reject it, it is dropped, step 10 is restored from the local tier, and the run ends bit-exact."""
    from tests.train.test_restore import BASE as RESTORE_BASE
    from tests.train.test_restore import assert_same_run

    local = tmp_path / "local"
    args = [*RESTORE_BASE, "run.dir=run", f"checkpoint.local.dir={local}", "checkpoint.local.every_steps=2"]
    first = run_runner(args, tmp_path, RUNNER_FAULT="kill_at_step:13")
    assert first.returncode == -signal.SIGKILL
    assert local_steps(local) == {"process-0": [10, 12]}
    step_dir = next(local.glob("*/*/process-0/12"))
    victim = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    again = run_runner(args, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "local checkpoint step 12 cannot be restored on every process" in again.stdout, again.stdout[-3000:]
    assert "resumed from step 10 (local tier" in again.stdout
    assert_same_run(tmp_path / "run", reference)

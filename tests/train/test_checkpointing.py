"""checkpoint.cadence=auto in runner.train.checkpointing, in-process: a fake step and a fake clock,
saves that block a known time, real orbax checkpoints. The intervals follow what goodput measured,
and every process would decide from process 0's measurement."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from runner.checkpoint import cadence as cd
from runner.checkpoint.checkpointer import Checkpointer, SavePolicy
from runner.observability.goodput import Goodput
from runner.spec import CheckpointSpec, ExecutionSpec, LocalCheckpointSpec
from runner.train import checkpointing as module
from runner.train.checkpointing import Checkpointing
from runner.train.loop import Loop
from tests.train.test_loop import Clock, fake_step, holder

STEP_S, SAVE_S, START_S = 0.5, 2.0, 6.0


def owner_for(clock: Clock, h: Any, said: list[str]) -> Any:
    """The trainer's part Checkpointing sees: a save blocks SAVE_S of the clock (while the meta is
    built, inside the save's timing), and goodput runs on the same clock."""
    goodput = Goodput(started=clock.now, clock=clock)

    class Owner:
        state = property(lambda self: SimpleNamespace(step=np.int32(h.step), params=np.zeros(4, np.float32),
                                                      opt_state=(), rng=np.zeros(2, np.uint32), guard=()))
        step = property(lambda self: h.step)
        logger = SimpleNamespace(progress=SimpleNamespace(message=said.append), sync=lambda: None)
        callbacks = SimpleNamespace(dispatch=lambda event, step: None)

        def __init__(self) -> None:
            self.goodput = goodput

        def checkpoint_meta(self) -> dict:
            clock.now += SAVE_S
            return {"step": h.step, "goodput": goodput.to_meta(goodput.totals())}

        def goodput_totals(self) -> dict[str, float]:
            return goodput.totals()

        def watching(self, phase: str, step: int) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

    return Owner()


def test_auto_keeps_the_fixed_interval_until_a_save_is_measured_then_chooses(tmp_path: Path) -> None:
    clock, h, said = Clock(), holder(), []
    spec = ExecutionSpec(checkpoint=CheckpointSpec(every_steps=10, keep=100, cadence="auto", mtbf_hours=0.02))
    owner = owner_for(clock, h, said)
    checkpoints = Checkpointing(spec, tmp_path, owner)
    checkpoints.checkpointer = Checkpointer(tmp_path / "checkpoints", spec.checkpoint,
                                            SavePolicy(spec.checkpoint, clock=clock))

    def step(state: dict, batch: int) -> tuple[dict, dict]:
        clock.now += STEP_S
        return fake_step(state, batch)

    clock.now += START_S  # the launch's start before its loop: the relaunch cost until one is measured
    owner.goodput.start_loop()
    try:
        Loop(h, step, itertools.count(1), [checkpoints], total=100, clock=clock).run()
        checkpoints.save_final()
        expected = cd.best(cd.Costs(SAVE_S, START_S, 72.0), min_s=STEP_S, max_s=3600.0)
        every = round(expected.durable_s / STEP_S)
        assert 20 < every < 40  # Daly: about 15.7 s of 0.5 s steps
        # the fixed 10 first; then multiples of the chosen interval; the final save
        assert checkpoints.checkpointer.steps() == [10, *range(every, 100, every), 100]
        assert len(said) == 2 and "until a durable save and a step are measured; relaunch 6 s" in said[0]
        assert said[1].startswith(f"checkpoint cadence auto: durable every {every} steps")
        assert "a durable save blocks 2 s (1 save), relaunch 6 s (1 launch), step 0.5 s" in said[1]
        assert owner.goodput.saves == {"checkpoint": 2 + len(range(every, 100, every))}
        report = owner.goodput.report(owner.goodput.totals())
        assert report["goodput/saves"] == len(checkpoints.checkpointer.steps()) and report["goodput/saves_local"] == 0
        assert checkpoints.checkpointer.read_meta(every)["goodput"]["saves"] == {"checkpoint": 1}  # (not itself)
        assert "durable auto (from every 10 steps until measured)" in checkpoints.describe(None, "")
    finally:
        checkpoints.close()


def test_a_relaunch_chooses_at_once_from_the_carried_measurements(tmp_path: Path) -> None:
    clock, h, said = Clock(), holder(), []
    spec = ExecutionSpec(checkpoint=CheckpointSpec(every_steps=10, cadence="auto", mtbf_hours=0.02, keep_every=25))
    owner = owner_for(clock, h, said)
    carried = {"seconds": {"train": 20.0, "checkpoint": 8.0, "startup": 10.0, "compile": 2.0, "wall": 45.0},
               "launches": 2, "saves": {"checkpoint": 4}}
    owner.goodput.carry(carried, [], restored=40)
    h.step = 40
    checkpoints = Checkpointing(spec, tmp_path, owner)
    checkpoints.checkpointer = Checkpointer(tmp_path / "checkpoints", spec.checkpoint,
                                            SavePolicy(spec.checkpoint, clock=clock))
    owner.goodput.start_loop()
    try:
        checkpoints.start(SimpleNamespace())
        policy = checkpoints.checkpointer.policy
        # 20 s over 40 kept steps, saves of 2 s, relaunches of (10 + 2 + this one's) / 3
        assert "step 0.5 s" in said[0] and "a durable save blocks 2 s (4 saves)" in said[0]
        assert policy.every_steps == cd.AutoCadence(0.02, 1, 3600.0, "").choose(
            checkpoints._measured()).every_steps and policy.every_minutes == 0
        assert policy.also_every == 25 and policy.due(50) and policy.due(75)  # keep_every's steps still saved
    finally:
        checkpoints.close()


def test_every_process_decides_from_process_0s_measurement(tmp_path: Path, monkeypatch) -> None:
    clock, h, said = Clock(), holder(), []
    spec = ExecutionSpec(checkpoint=CheckpointSpec(every_steps=10, cadence="auto", mtbf_hours=0.02))
    checkpoints = Checkpointing(spec, tmp_path, owner_for(clock, h, said))
    zeros = cd.Measured(3.0, 5, None, 0, 7.0, 2, 0.25)
    shared: list[Any] = []

    def from_process(source: int, text: str | None) -> str:
        shared.append((source, text))
        return json.dumps(dataclasses.asdict(zeros))

    monkeypatch.setattr(module, "from_process", from_process)
    monkeypatch.setattr(module, "jax", SimpleNamespace(process_count=lambda: 2, process_index=lambda: 1))
    assert checkpoints._measured() == zeros  # process 1 takes process 0's, whatever it measured itself
    assert shared == [(0, None)]


def fake_mesh(processes: int, devices_each: int) -> SimpleNamespace:
    """A mesh's devices as Checkpointing reads them: ids and the process each belongs to."""
    devices = [SimpleNamespace(id=i, process_index=i // devices_each) for i in range(processes * devices_each)]
    return SimpleNamespace(devices=np.array(devices, dtype=object))


def test_the_job_mtbf_counts_machines_not_processes(tmp_path: Path, monkeypatch) -> None:
    """Four processes on two machines (one per GPU pair, as SLURM starts one per GPU): the job's MTBF is
    the per-host one over 2, not 4, and a lost machine's shards count as copied only when the other
    machine holds them (process 1 shares process 0's machine, so it is lost with it)."""
    clock, h, said = Clock(), holder(), []
    local = LocalCheckpointSpec(dir=str(tmp_path / "local"), every_steps=5, host_loss_fraction=0.75)
    spec = ExecutionSpec(checkpoint=CheckpointSpec(every_steps=10, cadence="auto", mtbf_hours=1.0, local=local))
    owner = owner_for(clock, h, said)
    owner.mesh = fake_mesh(4, 2)
    gathered: list[str] = []
    monkeypatch.setattr(module, "hosts_by_process", lambda: gathered.append("gather") or [0, 0, 1, 1])
    monkeypatch.setattr(module, "jax", SimpleNamespace(process_count=lambda: 4, process_index=lambda: 0))
    holders: list[set[int]] = []
    missing: list[str] = []
    monkeypatch.setattr(module.replicas, "unreplicated", lambda tree, devices: holders.append(set(devices)) or missing)

    def auto_of(checkpoints: Checkpointing) -> cd.AutoCadence:
        checkpoints.__dict__["local"] = SimpleNamespace()  # (a local tier is configured; never opened here)
        assert checkpoints.auto is not None
        return checkpoints.auto

    auto = auto_of(Checkpointing(spec, tmp_path, owner))
    assert auto.hosts == 2 and auto.mtbf_s == pytest.approx(1800.0) and gathered == ["gather"]
    assert holders == [{4, 5, 6, 7}]  # the other machine's devices (processes 2 and 3), not process 1's
    assert auto.local_recovers == 1.0  # they hold a copy of every shard
    missing.append("params['w']")
    assert auto_of(Checkpointing(spec, tmp_path, owner)).local_recovers == pytest.approx(0.25)


def test_the_relaunch_cost_is_the_mean_over_launches_jsonl(tmp_path: Path) -> None:
    """The checkpoints remember 2 launches (12 s of start, restore and compile: 6 s each), but launches.jsonl
    has every launch that reached its loop, one killed before its first save too: the mean over its lines."""
    from runner.observability import launches
    from runner.train.checkpointing import Resumed

    clock, h, said = Clock(), holder(), []
    spec = ExecutionSpec(checkpoint=CheckpointSpec(every_steps=10, cadence="auto", mtbf_hours=0.02))
    owner = owner_for(clock, h, said)
    carried = {"seconds": {"train": 20.0, "checkpoint": 8.0, "startup": 10.0, "compile": 2.0, "wall": 45.0},
               "launches": 2, "saves": {"checkpoint": 4}}
    owner.goodput.carry(carried, [], restored=40)
    h.step = 40
    for startup in (9.0, 21.0, 6.0):
        launches.append(tmp_path, {"launch": 1, "startup_s": startup, "restore_s": 1.0, "compile_s": 2.0})
    checkpoints = Checkpointing(spec, tmp_path, owner)
    checkpoints.checkpointer = Checkpointer(tmp_path / "checkpoints", spec.checkpoint,
                                            SavePolicy(spec.checkpoint, clock=clock))
    clock.now += 4.0  # this launch's start: its own line, 4 s
    owner.goodput.start_loop(tmp_path, Resumed(40, "", "durable"))
    try:
        checkpoints.start(SimpleNamespace())
        assert launches.read(tmp_path)[-1]["startup_s"] == 4.0 and launches.read(tmp_path)[-1]["hosts"] == 1
        # (12 + 24 + 9 + 4) / 4
        assert "relaunch 12.2 s (4 launches)" in said[0], said
    finally:
        checkpoints.close()


def test_the_step_time_counts_the_steps_a_rewind_undid(tmp_path: Path) -> None:
    """40 steps in 20 s, a rewind to step 10 (30 steps undone), 20 more in 10 s: 60 steps in 30 s, 0.5 s
    each, not 30 s over the 30 steps the launch advanced."""
    clock, h, said = Clock(), holder(), []
    spec = ExecutionSpec(checkpoint=CheckpointSpec(every_steps=10, cadence="auto", mtbf_hours=0.02))
    owner = owner_for(clock, h, said)
    checkpoints = Checkpointing(spec, tmp_path, owner)
    owner.goodput.start_loop()
    checkpoints.start(SimpleNamespace())
    clock.now += 20.0
    h.step = 40
    owner.goodput.undone(30, 15.0)  # (as runner.train.rewind counts it)
    h.step = 10
    clock.now += 10.0
    h.step = 30
    assert checkpoints._measured().step_s == pytest.approx(0.5)

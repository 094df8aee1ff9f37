"""The step loop and the checkpoint policy in-process: a fake step function, an injected clock,
real orbax checkpoints. No subprocess and no timing: every assertion is about order and counts."""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from runner.checkpoint.checkpointer import Checkpointer, SavePolicy
from runner.errors import UserError
from runner.observability.goodput import Goodput
from runner.spec import CheckpointSpec, ExecutionSpec, TrainSpec
from runner.train.checkpointing import Checkpointing
from runner.train.hooks import Evaluation, StopRequests
from runner.train.loop import Component, Loop
from runner.train.stopping import StopConditions


class Clock:
    """Time that moves only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fake_step(state: dict, batch: int) -> tuple[dict, dict]:
    """A 'train step': the state counts steps and sums the batches it saw."""
    return {"steps": state["steps"] + 1, "seen": state["seen"] + batch}, {"loss": 1.0 / (state["steps"] + 1)}


class Recorder(Component):
    """Writes down every call the loop makes, and can ask for metrics at chosen steps."""

    def __init__(self, log: list, wants: set[int] = frozenset()) -> None:
        self.log, self.wants = log, wants

    def start(self, loop: Loop) -> None:
        self.log.append("start")

    def before_step(self, loop: Loop, step: int) -> None:
        self.log.append(f"before {step}")

    def needs_metrics(self, loop: Loop, step: int) -> bool:
        self.log.append(f"asked {step}")
        return step in self.wants

    def on_metrics(self, loop: Loop, step: int, metrics: dict) -> None:
        self.log.append(f"metrics {step} {metrics['loss']:.3f}")

    def after_step(self, loop: Loop, step: int) -> None:
        self.log.append(f"after {step}")

    def end(self, loop: Loop) -> None:
        self.log.append("end")


def holder(step: int = 0) -> SimpleNamespace:
    return SimpleNamespace(state={"steps": step, "seen": 0}, step=step)


def test_metrics_are_handed_on_one_step_late_unless_a_component_acts_at_that_step() -> None:
    log: list[str] = []
    h = holder()
    ending = Loop(h, fake_step, itertools.count(1), [Recorder(log, wants={2})], total=4).run()
    assert ending.finished and ending.step == 4 and h.step == 4
    assert h.state == {"steps": 4, "seen": 1 + 2 + 3 + 4}  # batch s went to step s
    assert log == [
        "start",
        "before 1", "asked 1", "after 1",  # step 1's metrics wait until step 2 is queued
        "before 2", "metrics 1 1.000", "asked 2", "metrics 2 0.500", "after 2",  # wanted now
        "before 3", "asked 3", "after 3",
        "before 4", "metrics 3 0.333", "asked 4", "after 4",
        "metrics 4 0.250", "end",
    ]


def test_a_stop_ends_after_that_step_and_a_halt_before_the_components_act() -> None:
    class StopAt(Component):
        def __init__(self, step: int, halt: bool) -> None:
            self.step, self.halt = step, halt

        def on_metrics(self, loop: Loop, step: int, metrics: dict) -> None:
            if step == self.step and self.halt:
                loop.halt("a guard")

        def needs_metrics(self, loop: Loop, step: int) -> bool:
            if step == self.step and not self.halt:
                loop.stop("a signal")
                return True
            return False

    log: list[str] = []
    ending = Loop(holder(), fake_step, itertools.count(1), [StopAt(3, halt=False), Recorder(log)], total=10).run()
    assert (ending.step, ending.stop, ending.halt) == (3, "a signal", None)
    assert log[-3:] == ["metrics 3 0.333", "after 3", "end"]  # acted on step 3, read everything, stopped

    log.clear()
    ending = Loop(holder(), fake_step, itertools.count(1), [StopAt(3, halt=True), Recorder(log)], total=10).run()
    # step 3's metrics are read while step 4 runs; the halt reads step 4's at once and stops
    assert (ending.step, ending.halt) == (4, "a guard")
    assert log[-4:] == ["metrics 3 0.333", "asked 4", "metrics 4 0.250", "end"]


def test_a_resumed_loop_starts_at_its_step_and_a_finished_one_takes_no_batch() -> None:
    h = holder(step=7)
    ending = Loop(h, fake_step, itertools.count(8), [], total=9).run()
    assert ending.step == 9 and h.state["seen"] == 8 + 9
    done = holder(step=9)
    assert Loop(done, fake_step, iter(()), [], total=9).run().finished  # next() on an empty iterator never called


# ----------------------------------------------------------------------------- checkpoint policy


def test_time_policy_saves_when_the_interval_has_passed_by_the_clock() -> None:
    clock = Clock()
    policy = SavePolicy(CheckpointSpec(every_steps=0, every_minutes=0.5), clock=clock)
    assert not policy.due(1)
    clock.now += 29.0
    assert not policy.due(2)
    clock.now += 1.0
    assert policy.due(3) and policy.due(3)  # asked twice in a step: one decision
    policy.saved(3)
    clock.now += 10.0
    assert not policy.due(4)
    clock.now += 20.0
    assert policy.due(5)


def test_step_policy_and_several_processes_agree_on_time_every_n_steps() -> None:
    policy = SavePolicy(CheckpointSpec(every_steps=5, every_minutes=0.0))
    assert [s for s in range(1, 21) if policy.due(s)] == [5, 10, 15, 20]
    clock, asked = Clock(), []

    def agree(flag: bool) -> bool:  # what distributed.any_process does across processes
        asked.append(flag)
        return flag

    timed = SavePolicy(CheckpointSpec(every_steps=0, every_minutes=1.0), clock=clock, agree=agree, agree_every=10)
    clock.now += 61.0
    assert [s for s in range(1, 25) if timed.due(s)] == [10, 20]  # time checked only at the agreed steps
    assert asked == [True, True]


def test_best_metric_evaluations_are_saved_and_the_best_is_tracked() -> None:
    spec = CheckpointSpec(every_steps=0, keep_best=2, best_metric="stdlib/loss", best_mode="min")
    policy = SavePolicy(spec)
    policy.note_evaluation(0, {"eval/stdlib/loss": 9.0}, complete=True)  # baseline: never a candidate
    assert not policy.due(0) and policy.best == {}
    policy.note_evaluation(4, {"eval/stdlib/loss": 3.0}, complete=True)
    assert policy.due(4) and policy.metrics(4) == {"eval/stdlib/loss": 3.0} and not policy.due(5)
    policy.note_evaluation(8, {"eval/stdlib/loss": 4.0}, complete=True)
    assert policy.best == {"metric": "eval/stdlib/loss", "mode": "min", "step": 4, "value": 3.0}
    with pytest.raises(UserError, match="checkpoint.best_metric='nope'"):
        SavePolicy(CheckpointSpec(keep_best=1, best_metric="nope")).note_evaluation(0, {"eval/x": 1.0}, True)


def state_tree(step: int) -> dict[str, Any]:
    return {"step": np.int32(step), "w": np.full((4,), step, np.float32)}


def test_checkpoints_component_saves_by_time_with_real_orbax(tmp_path: Path) -> None:
    """The time-based save test that no longer races the machine: every step takes 7 s of fake time,
    a save is due every 20 s, the last step is saved by the job's final save. The policy is asked
    once per step, by the component alone."""
    clock = Clock()
    spec = ExecutionSpec(checkpoint=CheckpointSpec(every_steps=0, every_minutes=20 / 60, keep=100, async_save=True))
    h = holder()
    around: list[int] = []

    class Owner:  # what runner.train.checkpointing saves: the trainer's part, faked
        state = property(lambda self: SimpleNamespace(step=np.int32(h.step), params=np.full((4,), h.step, np.float32),
                                                      opt_state=(), rng=np.zeros(2, np.uint32), guard=()))
        step = property(lambda self: h.step)
        logger = None
        goodput = Goodput()
        callbacks = SimpleNamespace(dispatch=lambda event, step: around.append(step) if event == "on_save_start"
                                    else None)

        def checkpoint_meta(self) -> dict:
            return {"step": h.step}

        def watching(self, phase: str, step: int) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

    checkpoints = Checkpointing(spec, tmp_path, Owner())
    policy = SavePolicy(spec.checkpoint, clock=clock)
    checkpoints.checkpointer = Checkpointer(tmp_path / "checkpoints", spec.checkpoint, policy)
    asked: list[int] = []
    due = policy.due
    policy.due = lambda step: asked.append(step) or due(step)

    def slow_step(state: dict, batch: int) -> tuple[dict, dict]:
        clock.now += 7.0
        return fake_step(state, batch)

    try:
        Loop(h, slow_step, itertools.count(1), [checkpoints], total=10, clock=clock).run()
        checkpoints.save_final()
        assert not checkpoints.save()  # saved already
        # 7 s a step: 21 s at step 3, then 21 s more at 6 and at 9; the final save at 10
        assert checkpoints.checkpointer.steps() == [3, 6, 9, 10] and around == [3, 6, 9, 10]
        meta = checkpoints.checkpointer.read_meta(9)
        assert meta["step"] == 9 and set(meta["checksums"]) == {"['params']", "['rng']", "['step']"}
        assert asked == list(range(1, 10))  # once per step; never for the last, whose save is the job's
    finally:
        checkpoints.close()


def test_evaluation_runs_at_its_cadence_never_at_the_last_step() -> None:
    ran: list[tuple[int, Any]] = []
    h = holder()
    evaluators = [SimpleNamespace(every=3), SimpleNamespace(every=4)]
    evaluation = Evaluation(evaluators, lambda ev: ev.every, lambda only: ran.append((h.step, only and len(only))))
    Loop(h, fake_step, itertools.count(1), [evaluation], total=12).run()
    # step 0: the baseline (all); the final evaluation after the loop is the job's
    assert ran == [(0, None), (3, 1), (4, 1), (6, 1), (8, 1), (9, 1)]


def test_stop_requests_use_the_time_limit_by_the_clock(tmp_path: Path) -> None:
    clock = Clock()
    spec = ExecutionSpec(train=TrainSpec(steps=100, time_limit_minutes=1.0, time_limit_margin_s=0.0, stop_file=""))
    stops = StopConditions(spec, tmp_path, 0, clock=clock)
    h = holder()

    def step(state: dict, batch: int) -> tuple[dict, dict]:
        clock.now += 5.0
        return fake_step(state, batch)

    ending = Loop(h, step, itertools.count(1), [StopRequests(stops)], total=100, clock=clock).run()
    # The first read covers two steps (in a real run, the one that compiles), so the longest "step"
    # seen is 10 s; room is kept for 3 of those: the run stops once 30 s + 30 s reach 60 s.
    assert ending.stop and "time limit" in ending.stop and ending.step == 6


@pytest.mark.parametrize("start, limit, ending_step, stopped", [(0, 4, 4, True), (4, 4, 8, True), (4, 6, 10, False),
                                                                  (8, 2, 10, False)])
def test_the_launch_step_limit_stops_short_of_the_last_step_only(tmp_path: Path, start: int, limit: int,
                                                                  ending_step: int, stopped: bool) -> None:
    """train.max_steps_this_launch: a launch that reaches train.steps within its limit finishes the
    run (final evaluation, exit 0) instead of stopping resumably at the last step."""
    spec = ExecutionSpec(train=TrainSpec(steps=10, max_steps_this_launch=limit, stop_file=""))
    h = holder()
    h.step = start
    ending = Loop(h, fake_step, itertools.count(1), [StopRequests(StopConditions(spec, tmp_path, start))],
                  total=10).run()
    assert ending.step == ending_step and bool(ending.stop) is stopped, ending


def test_a_stop_file_that_cannot_be_looked_for_is_no_stop_request(tmp_path: Path) -> None:
    """A bucket answering 503 to the stop file's probe: a warning, once; training goes on, and a
    stop file that can be seen again is honoured."""
    warned: list[str] = []
    spec = ExecutionSpec(train=TrainSpec(steps=100, stop_file="STOP"))
    stops = StopConditions(spec, tmp_path, 0, warn=warned.append)
    down = SimpleNamespace(exists=lambda: (_ for _ in ()).throw(OSError("injected, 503")))
    stops.stop_file = down
    assert stops.check(1, 0.1, processes=1) is None and stops.check(2, 0.1, processes=1) is None
    assert len(warned) == 1 and "injected, 503" in warned[0] and "goes on" in warned[0]
    stops.stop_file = tmp_path / "STOP"
    (tmp_path / "STOP").touch()
    assert "stop file" in stops.check(3, 0.1, processes=1)


def test_a_stop_you_ask_for_exits_76_any_other_75_and_every_process_agrees(tmp_path: Path, monkeypatch) -> None:
    """The stop file and SIGINT are a person's stop (76, which no supervisor restarts); SIGTERM and the
    limits are a stop to be resumed (75). With several processes the kind is agreed, so a process
    that saw nothing exits with the code of the one that saw the stop file."""
    import signal

    from runner.exits import PREEMPTED_EXIT_CODE, STOPPED_ON_REQUEST_EXIT_CODE
    from runner.train import stopping

    ended: list[int] = []
    logger = SimpleNamespace(progress=SimpleNamespace(message=lambda text: None),
                             ending=lambda code, preempted: ended.append(code))
    spec = ExecutionSpec(train=TrainSpec(steps=100, stop_file="STOP"))

    def code_of(stops: StopConditions, reason: str | None) -> int:
        assert reason
        return stopping.stopped(stops, reason, 5, logger).exit_code

    stops = StopConditions(spec, tmp_path, 0)
    (tmp_path / "STOP").touch()
    assert code_of(stops, stops.check(1, 0.1, processes=1)) == STOPPED_ON_REQUEST_EXIT_CODE
    assert not (tmp_path / "STOP").exists()  # honoured: a rerun goes on
    for signum, code in ((signal.SIGINT, STOPPED_ON_REQUEST_EXIT_CODE), (signal.SIGTERM, PREEMPTED_EXIT_CODE)):
        stops = StopConditions(spec, tmp_path, 0)
        stops.on_signal(signum, None)
        assert code_of(stops, stops.check(1, 0.1, processes=1)) == code
    limited = StopConditions(ExecutionSpec(train=TrainSpec(steps=10, max_steps_this_launch=2)), tmp_path, 0)
    assert code_of(limited, limited.check(2, 0.1, processes=1)) == PREEMPTED_EXIT_CODE
    assert ended == [76, 76, 75, 75]  # the logger (wandb) is told each code
    monkeypatch.setattr(stopping, "any_process", lambda flag: True)  # another process saw the stop file
    stops = StopConditions(spec, tmp_path, 0)
    reason = stops.check(spec.distributed.stop_check_every, 0.1, processes=2)
    assert reason == "a stop request from another process" and code_of(stops, reason) == STOPPED_ON_REQUEST_EXIT_CODE

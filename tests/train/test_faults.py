"""The fault injector's own rules (runner.train.faults): several faults in one spec, each armed
at its step and process, and `hold_alone` holding a lone process until a signal is recorded."""

from __future__ import annotations

import pytest

from runner.train import faults


def test_a_spec_of_several_faults_arms_each_at_its_step_and_process(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = "slow_steps:1, hold_alone:16@0,kill_at_step:6@1#1,kill_after_save:8#2"
    assert faults.parse(spec) == {"slow_steps": ("1", "", ""), "hold_alone": ("16", "0", ""),
                                  "kill_at_step": ("6", "1", "1"), "kill_after_save": ("8", "", "2")}
    monkeypatch.setenv("RUNNER_FAULT", spec)  # read when asked, not on import
    assert faults.armed("hold_alone", 16) and not faults.armed("hold_alone", 15)
    assert not faults.armed("kill_at_step", 6)  # this test's process is process 0, not 1
    monkeypatch.setenv("RUNNER_ATTEMPT", "2")
    assert faults.armed("kill_after_save", 8) and not faults.armed("kill_after_save", 7)
    monkeypatch.setenv("RUNNER_ATTEMPT", "3")  # the supervisor's next attempt gets past it
    assert not faults.armed("kill_after_save", 8)
    assert not faults.armed("stall_in_step", 16)
    kinds = [type(c).__name__ for c in faults.components(lambda: None, lambda: False)]
    assert kinds == ["KillAtStep", "SlowSteps", "HoldAlone"]
    monkeypatch.delenv("RUNNER_FAULT")  # unset: the loop gets nothing of it
    assert faults.components(lambda: None, lambda: False) == [] and faults.callbacks() == []


def test_hold_alone_waits_before_its_step_until_a_signal_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNNER_FAULT", "hold_alone:3")
    slept: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    looks = iter([False, False, False, True])
    hold = faults.HoldAlone(lambda: next(looks))
    hold.before_step(None, 2)  # another step: no wait
    assert slept == []
    hold.before_step(None, 3)  # waits until the fourth look sees the signal
    assert slept == [0.1, 0.1, 0.1]

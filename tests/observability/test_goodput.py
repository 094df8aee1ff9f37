"""Goodput accounting with an injected clock: each category, the carried totals, lost steps."""

from __future__ import annotations

import pytest

from runner.observability.goodput import Goodput, summary_line


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_resumed_launch_adds_to_the_carried_totals_and_counts_lost_steps() -> None:
    clock = Clock()
    g = Goodput(started=90.0, clock=clock)  # 10 s of imports before the trainer existed
    carried = {"seconds": {"wall": 50.0, "train": 30.0, "startup": 20.0}, "launches": 1}
    lost = [{"step": s, "loss": 1.0, "step_time_s": 0.5} for s in (9, 10, 11, 12)] + [{"step": 12, "eval/x": 1.0}]
    with g.timing("restore"):
        clock.now += 2.0
    g.carry(carried, lost, restored=8)
    assert g.recomputed_steps == 4 and g.spent["recomputed"] == pytest.approx(2.0)
    with g.timing("compile"):
        clock.now += 3.0
    g.start_loop()  # 15 s after the launch: 10 startup, 2 restore, 3 compile
    clock.now += 10.0
    with g.timing("eval"):
        clock.now += 1.0
    with g.timing("checkpoint"):
        clock.now += 0.5
    g.end_loop()
    with g.timing("checkpoint"):  # the final save, after the loop
        clock.now += 0.5
    totals = g.totals(data_wait=1.5)
    assert totals["startup"] == pytest.approx(20.0 + 10.0)
    assert totals["restore"] == pytest.approx(2.0) and totals["compile"] == pytest.approx(3.0)
    assert totals["train"] == pytest.approx(30.0 + 2.0 + (11.5 - 1.0 - 0.5 - 1.5))  # loop less eval, save, wait
    assert totals["checkpoint"] == pytest.approx(1.0) and totals["data_wait"] == pytest.approx(1.5)
    assert totals["wall"] == pytest.approx(50.0 + 2.0 + 27.0)
    report = g.report(totals)
    assert report["goodput/launches"] == 2 and report["goodput/recomputed_steps"] == 4
    assert report["goodput/percent"] == pytest.approx(100 * (totals["train"] - 2.0) / totals["wall"])
    assert g.to_meta(totals)["launches"] == 2
    assert "4 steps recomputed" in summary_line(report) and "over 2 launches" in summary_line(report)


def test_a_launch_that_died_before_its_first_checkpoint_still_counts() -> None:
    g = Goodput(started=0.0, clock=Clock())
    g.carry(None, [{"step": s, "loss": 1.0, "step_time_s": 1.0} for s in (1, 2, 3)], restored=0)
    assert g.launches_before == 1 and g.recomputed_steps == 3
    fresh = Goodput(started=0.0, clock=Clock())
    fresh.carry(None, [], restored=0)
    assert fresh.launches_before == 0 and fresh.recomputed_steps == 0


def test_a_launch_lost_after_a_later_checkpoint_than_the_one_restored_is_counted() -> None:
    """Launch 1 saved step 4; launch 2 resumed from it, logged 5-8 and died before its save of 8
    committed; launch 3 restores 4 again, whose metadata says one launch: the lost records say two."""
    g = Goodput(started=0.0, clock=Clock())
    lost = [{"step": s, "loss": 1.0, "step_time_s": 1.0, "goodput/launches": 2.0} for s in (5, 6, 7, 8)]
    g.carry({"seconds": {"wall": 10.0}, "launches": 1}, lost, restored=4)
    assert g.launches_before == 2 and g.recomputed_steps == 4
    assert g.report(g.totals(data_wait=0.0))["goodput/launches"] == 3


def test_the_loop_s_start_writes_the_launch_s_line_for_supervisors(tmp_path, capsys, monkeypatch) -> None:
    """start_loop(run_dir, resumed): process 0 appends where the launch took the run up and what
    starting it cost to launches.jsonl; a directory it cannot write is a warning, never the run's end."""
    from types import SimpleNamespace

    from runner.observability import launches

    clock = Clock()
    monkeypatch.setenv("RUNNER_ATTEMPT", "3")
    g = Goodput(started=90.0, clock=clock)
    g.carry({"seconds": {}, "launches": 4}, [], restored=8)
    with g.timing("restore"):
        clock.now += 2.0
    with g.timing("compile"):
        clock.now += 3.0
    g.start_loop(tmp_path, SimpleNamespace(step=8, tier="local"))
    (line,) = launches.read(tmp_path)
    assert {k: v for k, v in line.items() if k != "time"} == {
        "launch": 5, "attempt": 3, "restored_step": 8, "tier": "local", "startup_s": 10.0, "restore_s": 2.0,
        "compile_s": 3.0, "processes": 1, "hosts": 1}
    Goodput(started=90.0, clock=clock).start_loop(tmp_path, SimpleNamespace(step=None, tier=""))
    assert [r["restored_step"] for r in launches.read(tmp_path)] == [8, None]  # appended, oldest first
    (tmp_path / "a-file").write_text("")
    Goodput(clock=clock).start_loop(tmp_path / "a-file", None)  # run.dir is a file: said, and training goes on
    assert "warning: could not write" in capsys.readouterr().err

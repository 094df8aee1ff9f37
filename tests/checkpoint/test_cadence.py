"""runner.checkpoint.cadence in-process: the formulas on hand-computed cases, the simulation against
the closed form (seeded, within its standard error), the optimum, and auto's choices and lines."""

from __future__ import annotations

import math

import pytest

from runner.checkpoint import cadence as cd
from runner.checkpoint.cadence import AutoCadence, Cadence, Costs, Measured
from runner.errors import ConfigError


def test_the_defaults_come_from_llama_3s_published_figures() -> None:
    # 54 days x 24 h x 2,048 hosts / 419 interruptions
    assert cd.LLAMA3_MTBF_HOURS_PER_HOST == pytest.approx(6334.6, abs=0.1)
    assert cd.DEFAULT_MTBF_HOURS == 6300.0 and cd.DEFAULT_HOST_LOSS == 0.78
    job = cd.job_mtbf_s(6300, 2048)
    assert job == pytest.approx(6300 * 3600 / 2048) and job / 3600 == pytest.approx(3.076, abs=1e-3)  # ~ every 3 h
    assert Costs(1, 1, job).failures_per_day == pytest.approx(7.80, abs=0.01)
    assert cd.job_mtbf_s(6300, 128) / 3600 == pytest.approx(49.2, abs=0.1)  # a v5p-1024 slice: 128 hosts


def test_young_and_daly_by_hand() -> None:
    assert cd.young(2.0, 100.0) == pytest.approx(20.0)
    # r = C / 2M = 0.01: 20 (1 + 0.1 / 3 + 0.01 / 9) - 2
    assert cd.daly(2.0, 100.0) == pytest.approx(20.0 * (1 + 0.1 / 3 + 0.01 / 9) - 2.0)
    assert cd.daly(300.0, 100.0) == 100.0  # C >= 2M: save once per MTBF
    assert cd.first_order_goodput(20.0, 2.0, 10.0, 1000.0) == pytest.approx(1 - 0.1 - 20.0 / 1000)


def test_one_tier_goodput_is_dalys_complete_model() -> None:
    # tau / (M e^(R/M) (e^((tau + C)/M) - 1)): tau 20, C 2, R 10, M 1000
    by_hand = 20.0 / (1000.0 * math.exp(0.01) * (math.exp(0.022) - 1.0))
    assert cd.expected_goodput(Cadence(20.0), Costs(2.0, 10.0, 1000.0)) == pytest.approx(by_hand, rel=1e-12)
    assert by_hand == pytest.approx(0.8902, abs=1e-4)
    # no failures: only the saves cost
    assert cd.expected_goodput(Cadence(20.0), Costs(2.0, 10.0, 1e15)) == pytest.approx(20 / 22, rel=1e-9)
    # near the first-order estimate when everything is small against M
    costs = Costs(1.0, 5.0, 1e6)
    assert cd.expected_goodput(Cadence(1000.0), costs) == pytest.approx(
        cd.first_order_goodput(1000.0, 1.0, 5.0, 1e6), abs=1e-5)


def test_two_tiers_by_hand() -> None:
    # no failures: k local intervals cost (k - 1) local saves and one durable
    costs = Costs(10.0, 60.0, 1e15, local_save_s=1.0, local_recovers=0.5)
    assert cd.expected_goodput(Cadence(400.0, 100.0), costs) == pytest.approx(400 / (400 + 3 + 10), rel=1e-9)
    # one local interval per durable one: the local tier saves nothing and the model is one tier's
    one = Costs(10.0, 60.0, 5000.0, local_save_s=1.0, local_recovers=0.9)
    assert Cadence(100.0, 100.0).k == 1
    assert cd.expected_goodput(Cadence(100.0, 100.0), one) == pytest.approx(
        cd.expected_goodput(Cadence(100.0), Costs(10.0, 60.0, 5000.0)))
    # a local tier that recovers every failure: each failure loses one local interval at most
    every = Costs(10.0, 60.0, 5000.0, local_save_s=1.0, local_recovers=1.0)
    none = Costs(10.0, 60.0, 5000.0, local_save_s=1.0, local_recovers=0.0)
    assert cd.expected_goodput(Cadence(1000.0, 100.0), every) > cd.expected_goodput(Cadence(1000.0, 100.0), none)


@pytest.mark.parametrize("cadence, costs", [
    (Cadence(20.0), Costs(2.0, 10.0, 100.0)),  # a failure every 3 saves: far from first order
    (Cadence(300.0, 50.0), Costs(20.0, 40.0, 2000.0, local_save_s=2.0, local_recovers=0.6)),
    (Cadence(200.0, 50.0), Costs(20.0, 40.0, 1000.0, local_save_s=2.0, local_recovers=0.0)),
])
def test_the_simulation_agrees_with_the_closed_form(cadence: Cadence, costs: Costs) -> None:
    period = cadence.k * cadence.period_s
    sim = cd.simulate(cadence, costs, work_s=400 * period, runs=40, seed=7)
    assert sim.failures > 50  # (enough of them to average)
    # (over seeds 0 to 29 the largest miss is 2.5 standard errors, and the mean miss 0.2 or less)
    assert sim.goodput == pytest.approx(cd.expected_goodput(cadence, costs), abs=3 * sim.stderr)


def test_a_failure_during_a_relaunch_restarts_it_from_the_same_tier_in_both() -> None:
    """R/M = 0.5, p = 0.9, 30 local intervals to a durable one: two failures in five come during a
    relaunch. Were the simulation to draw the tier again for those (back to the durable save with 1 - p,
    as it once did), it would fall 3 to 5 points below the closed form (5 to 9 standard errors, seeds 0
    to 4); both model a failed relaunch as restarted from the same tier."""
    cadence, costs = Cadence(3000.0, 100.0), Costs(20.0, 500.0, 1000.0, local_save_s=1.0, local_recovers=0.9)
    sim = cd.simulate(cadence, costs, work_s=40 * 3000.0, runs=40, seed=3)
    assert sim.failures > 200 and sim.stderr < 0.006
    assert sim.goodput == pytest.approx(cd.expected_goodput(cadence, costs), abs=3 * sim.stderr)


def test_costs_beyond_fifty_mtbfs_are_refused_rather_than_overflowing_or_hanging() -> None:
    with pytest.raises(cd.Unworkable, match=r"a relaunch of 800 s is 800 times the job's MTBF \(1 s\)"):
        cd.expected_goodput(Cadence(1.0), Costs(0.1, 800.0, 1.0))  # math.expm1(800) overflows
    with pytest.raises(cd.Unworkable, match="segment"):
        cd.expected_goodput(Cadence(60.0), Costs(1.0, 1.0, 1.0))
    with pytest.raises(cd.Unworkable, match="first start"):
        cd.expected_run_goodput(Cadence(1.0), Costs(0.1, 1.0, 1.0), 10.0, start_s=900.0)
    # within range but e^30 relaunch tries: the simulation refuses what it could not finish
    with pytest.raises(cd.Unworkable, match="simulated run would meet"):
        cd.simulate(Cadence(1.0), Costs(0.1, 30.0, 1.0), 10.0, runs=1)
    # given failure times bound the replay: it runs
    assert cd.simulate(Cadence(1.0), Costs(0.1, 30.0, 1.0), 10.0, runs=1, failure_times=[0.5, 2.0]).failures == 2
    # the optimum stays within range; a save beyond it is refused
    near = cd.best(Costs(40.0, 1.0, 1.0))
    assert near.durable_s + 40.0 <= 50.0 and cd.expected_goodput(near, Costs(40.0, 1.0, 1.0)) > 0
    with pytest.raises(cd.Unworkable, match="a save of 60 s"):
        cd.best(Costs(60.0, 1.0, 1.0))
    # in a run, one paragraph naming the setting (exit 2)
    with pytest.raises(ConfigError, match="checkpoint.mtbf_hours=1e-05") as info:
        AutoCadence(1e-5, 1, 3600.0, "").choose(measured())
    assert "Fix:" in str(info.value) and "\n" not in str(info.value)


def test_the_simulation_is_seeded_and_replays_given_failures() -> None:
    cadence, costs = Cadence(10.0), Costs(1.0, 5.0, 60.0)
    assert cd.simulate(cadence, costs, 600.0, runs=3, seed=1) == cd.simulate(cadence, costs, 600.0, runs=3, seed=1)
    assert cd.simulate(cadence, costs, 600.0, runs=3, seed=1) != cd.simulate(cadence, costs, 600.0, runs=3, seed=2)
    # one failure at 15 s of a 30 s run: saves at 10 (+1), 20 (+1); the failure at 15 loses 4 s, pays 5,
    # trains 10..20 again, then 20..30 and the final save: 15 + 5 + 11 + 11 = 42
    replay = cd.simulate(cadence, costs, 30.0, runs=1, final_save=True, failure_times=[15.0])
    assert replay.failures == 1 and replay.goodput == pytest.approx(30.0 / 42.0)
    assert cd.simulate(cadence, costs, 30.0, runs=1, failure_times=[]).goodput == pytest.approx(30.0 / 32.0)


def test_best_is_dalys_optimum_for_one_tier_and_respects_its_bounds() -> None:
    costs = Costs(2.0, 10.0, 1000.0)
    chosen = cd.best(costs)
    assert chosen.local_s is None and chosen.durable_s == pytest.approx(cd.daly(2.0, 1000.0), rel=0.01)
    assert cd.expected_goodput(chosen, costs) >= cd.expected_goodput(Cadence(cd.daly(2.0, 1000.0)), costs) - 1e-12
    assert cd.best(costs, max_s=30.0).durable_s == pytest.approx(30.0, rel=1e-6)
    assert cd.best(costs, min_s=500.0).durable_s == pytest.approx(500.0, rel=1e-6)


def test_best_two_tiers_turns_the_local_tier_off_when_it_cannot_pay() -> None:
    base = dict(save_s=20.0, relaunch_s=60.0, mtbf_s=3600.0)
    useless = cd.best(Costs(**base, local_save_s=1.0, local_recovers=0.0))
    costly = cd.best(Costs(**base, local_save_s=20.0, local_recovers=0.9))
    assert useless.local_s is None and costly.local_s is None
    useful = cd.best(Costs(**base, local_save_s=1.0, local_recovers=0.9), max_s=3600.0)
    assert useful.k > 1 and useful.local_s < cd.daly(20.0, 3600.0) < useful.durable_s
    everything = cd.best(Costs(**base, local_save_s=1.0, local_recovers=1.0), max_s=1800.0)
    assert everything.durable_s <= 1800.0 * 1.0001  # nothing pays for durable saves: the cap decides


def measured(save_s: float | None = 2.0, step_s: float | None = 0.5, local: float | None = None) -> Measured:
    return Measured(save_s, 4, local, 4 if local else 0, 6.0, 1, step_s)


def test_measured_costs_are_goodputs_seconds_over_its_counts() -> None:
    totals = {"checkpoint": 8.0, "checkpoint_local": 1.0, "startup": 20.0, "restore": 4.0, "compile": 6.0}
    m = Measured.of(totals, {"checkpoint": 4, "checkpoint_local": 10}, launches=3, step_s=0.2)
    assert (m.save_s, m.local_save_s, m.relaunch_s, m.step_s) == (2.0, 0.1, 10.0, 0.2)
    none = Measured.of({"checkpoint": 0.0}, {}, launches=1, step_s=None)
    assert none.save_s is None and none.local_save_s is None and none.relaunch_s == 0.0
    # launches.jsonl's lines, when there are any: every launch that reached its loop, those the checkpoints
    # forgot (killed before their first save) too
    listed = Measured.of(totals, {"checkpoint": 4}, launches=3, step_s=0.2, relaunches=[4.0, 6.0, 20.0, 2.0])
    assert (listed.relaunch_s, listed.launches) == (8.0, 4)


def test_auto_waits_for_each_measurement_then_chooses_in_steps() -> None:
    auto = AutoCadence(0.02, 1, 3600.0, "durable every 10 steps")  # M = 72 s
    choice, line = auto.update(measured(save_s=None))
    assert choice is None and "durable every 10 steps (the fixed intervals) until a durable save is measured" in line
    assert auto.update(measured(save_s=None)) == (None, None)  # said once
    choice, line = auto.update(measured())
    expected = cd.best(Costs(2.0, 6.0, 72.0), min_s=0.5, max_s=3600.0)
    assert choice.every_steps == round(expected.durable_s / 0.5) and choice.local_every_steps == 0
    assert choice.cadence.durable_s == choice.every_steps * 0.5
    assert f"durable every {choice.every_steps} steps" in line and "local off" in line
    assert "a durable save blocks 2 s (4 saves), relaunch 6 s (1 launch), step 0.5 s" in line
    assert "job MTBF 72 s (checkpoint.mtbf_hours=0.02 per host over 1 host: 1,200 interruptions a day)" in line
    assert line.endswith(f"expected goodput {100 * choice.goodput:.1f}%")
    assert auto.update(measured(save_s=2.2)) == (None, None)  # a 5% move of the optimum is no change
    moved, again = auto.update(measured(save_s=8.0))  # a save 4 times as costly: twice the interval
    assert moved is not None and moved.every_steps > 1.5 * choice.every_steps and again


def test_auto_with_a_local_tier_chooses_both_and_a_multiple() -> None:
    auto = AutoCadence(100.0, 64, 3600.0, "durable every 100 steps, local every 10 steps", local=True,
                       local_recovers=0.9)
    assert auto.update(measured(save_s=20.0))[1].endswith("until a local save is measured; relaunch 6 s, job MTBF "
                                                         "93.8 min (checkpoint.mtbf_hours=100 per host over 64 hosts: "
                                                         "15.4 interruptions a day)")
    choice, line = auto.update(measured(save_s=20.0, local=0.5))
    assert choice.local_every_steps > 0 and choice.every_steps % choice.local_every_steps == 0
    assert choice.every_steps > choice.local_every_steps
    assert "local tier recovers 90% of failures" in line
